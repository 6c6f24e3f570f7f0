"""What a device step takes: one inputs pytree and one small static mode.

Every device step (`verify.verify_step`, `verify.extend_step`, `verify.plain_steps`) has
the signature `step(params, cache, inputs, *, config, <rule>, mode)` (gemma's sampler, whose
`SamplingState` carries a decode loop's arrays in one pytree, is the model):

* `StepInputs`: every array the step reads, one pytree. The per-row sampling values
  (`sampling.RowSampling`), penalties (`sampling.RowPenalties`) and logit biases
  (`sampling.RowBias`) are in it as arrays,
  so their values never recompile; a field that is None is absent (the step does without:
  no penalties, no draft distributions, the whole batch instead of a `sel`). Its treedef
  (which fields are present, and the rows' sampling / penalty flags) is part of the
  compiled program, with the arrays' shapes.
* `StepMode`: the few static choices (hashable, a jit static argument): the attention
  window, the banned ids, what the step returns beside its tokens, and the prefill's emit /
  plain_steps' step count. Everything else about a request is data.

So the compiled programs of a configuration are (step kind, rule, shapes, treedef, mode):
`core/programs.py` lists them.

    x = StepInputs(tokens, seeds, rowids, n_new=n_new)            # a prefill block
    out, cache = engine.extend(cache, x, StepMode(window=P))
    x = StepInputs.tree(block, active, seeds, rowids, sampling=values)
    out, cache = engine.verify(cache, x, StepMode(window=512, logprobs=True), rule=rule)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np


class StepInputs(NamedTuple):
    """A device step's arrays ([B, ...] per row; B the block's rows, see `sel`). Fields
    that a step kind does not read stay None."""

    tokens: Any  # [B,P] int32: a prefill's right-padded block, or the root then the tree's nodes
    seed: Any  # [B] uint32 each row's sampling seed (a token is keyed by seed, row, position)
    row: Any  # [B] int32 each row's id in that key
    n_new: Any = None  # [B] int32 prefill: the tokens each row forwards (0: the row is left alone)
    parent: Any = None  # [B,1+T] int32 verify: each node's parent (root -1, padding -2)
    depth: Any = None  # [B,1+T] int32 verify: each node's depth (root 0)
    mask: Any = None  # [B,1+T,1+T] bool verify: mask[i, j] = j is i or one of its ancestors
    active: Any = None  # [B] bool verify / plain_steps: rows that take the step
    sampling: Any = None  # sampling.RowSampling: each row's values (None: every row greedy)
    penalties: Any = None  # sampling.RowPenalties: each row's (None: none)
    bias: Any = None  # sampling.RowBias: each row's logit_bias (None: none)
    seen: Any = None  # [B,V] bool: ids in each row's context (penalties that use it)
    counts: Any = None  # [B,V] int32: each id's count in the generated ids (penalties that use it)
    suppress: Any = None  # [B] int32: below this position the mode's `ban` ids are banned (min_new_tokens)
    draft_probs: Any = None  # [B,1+T,V] f32: the drafts' distributions (rules that need them)
    sel: Any = None  # [G] int32 prefill: the block is for these cache rows only (every [B] field has G rows)
    remaining: Any = None  # [B] int32 plain_steps: tokens each row may still emit
    stop_ids: Any = None  # [B,E] int32 plain_steps: each row's EOS ids, -1 padded
    # bool scalar: whether this step computes the mode's top / prompt log-probabilities
    # (a `lax.cond`: one program serves steps whose rows ask and steps whose rows don't;
    # the outputs are zeros when false). None: the mode's are always computed
    scores: Any = None

    @classmethod
    def tree(cls, block, active, seed, row, **fields) -> "StepInputs":
        """The inputs of a verify step of a packed `tree.VerifyBlock` (root + nodes)."""
        return cls(None, seed, row, active=active, **fields).with_block(block)

    def with_block(self, block) -> "StepInputs":
        """These inputs with the packed `tree.VerifyBlock` `block` as their block (tokens,
        parent, depth, mask)."""
        return self._replace(tokens=block.tokens, parent=block.parents, depth=block.depth, mask=block.mask)

    def rows(self, sel) -> "StepInputs":
        """These inputs cut to the cache rows `sel` (a prefill over those rows only: `sel`
        set, every per-row field but the block's own, tokens and n_new, taken at them)."""
        sel = np.asarray(sel, np.int32)
        cut = {k: jax.tree.map(lambda a: np.asarray(a)[sel], v) for k, v in self._asdict().items()
               if v is not None and k not in ("tokens", "n_new", "sel", "scores")}
        return self._replace(sel=sel, **cut)


class StepMode(NamedTuple):
    """A step's static choices (each distinct mode is its own compiled program)."""

    window: int = 0  # cache slots attention reads (0: all); verify / plain_steps need length + 1 + T <= window
    ban: tuple = ()  # ids banned below `StepInputs.suppress` (EOS and stop ids; () = no ban)
    logprobs: bool = False  # also the emitted tokens' log-probabilities
    hidden: bool = False  # also the final hidden states (verify: every node; prefill: each row's last token)
    top_logprobs: int = 0  # k > 0: also the k most likely ids and their log-probabilities (see `StepInputs.scores`)
    emit: bool = True  # prefill: commit every forwarded token and pick the next (False: the last stays the root)
    steps: int = 0  # plain_steps: up to this many decode steps in one call
    prompt_logprobs: bool = False  # prefill: also each forwarded token's log-probability given those before it

    def check(self, inputs: StepInputs) -> None:
        """Raise where the inputs and the mode disagree (a ban without its positions)."""
        if self.ban and inputs.suppress is None:
            raise ValueError("StepMode.ban needs StepInputs.suppress (the position below which the ids are banned)")


def place(inputs: StepInputs, put) -> StepInputs:
    """Host (numpy) leaves of `inputs` through `put` (e.g. `Engine.arg`); device arrays stay."""
    return jax.tree.map(lambda x: x if isinstance(x, jax.Array) else put(x), inputs)
