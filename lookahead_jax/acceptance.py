"""Acceptance rules: which nodes of a verified token tree are kept (device side, jitted).

A rule is a frozen (hashable) dataclass, a static argument of the one verify step
(`verify.verify_step`). Given the target's logits at every block node it returns, per row,
the deepest accepted node `best` and the `bonus` token sampled after it:

    rule(logits [B,1+T,V], tokens, parent, depth, anc, positions, seed, row,
         draft_probs=None) -> (best [B], bonus [B])

The verify step turns that into the emitted tokens (the drafted tokens on the path root
-> best, then the bonus) and the K/V compaction, so every rule shares one verify step and
every drafter shares every rule. `draft_probs` ([B,1+T,V], the distribution each node was
drawn from) is optional: None means deterministic drafts (one-hot), as the trie's.

`TokenMatch` (this module) is exact for greedy decoding and for position-keyed sampling:
at every node it picks the token plain decoding would pick there (argmax, or the sample
keyed by (seed, row, position)), and accepts the longest path whose drafted tokens equal
those picks. A speculative-sampling rule (SpecInfer's multi-step sampling, which needs
`draft_probs`) is a second implementation of the same call.

Each rule also has a host replay (`accepted_lengths`): how many drafts of a tree's first
b nodes it would have accepted given the true continuation, used by the budget policy to
score every budget counterfactually once the outcome is known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp

from .drafts import depths
from .sampling import SamplingParams, select_tokens


@dataclasses.dataclass(frozen=True)
class TokenMatch:
    """Accept a node iff its token is the model's own pick at its parent (and so is every
    ancestor's). Identical output to plain decoding with the same `sampling` and seed."""

    sampling: SamplingParams = SamplingParams()

    def __call__(self, logits, tokens, parent, depth, anc, positions, seed, row, draft_probs=None):
        T1 = tokens.shape[1]
        choice = select_tokens(logits, self.sampling, seed, row, positions + 1)  # [B,1+T]
        if T1 == 1:  # plain decoding: the root's pick
            return jnp.zeros(tokens.shape[:1], jnp.int32), choice[:, 0]
        parent_choice = jnp.take_along_axis(choice, jnp.clip(parent, 0, T1 - 1), axis=1)
        correct = (tokens == parent_choice) & (parent >= 0)  # [B,1+T]
        correct = correct.at[:, 0].set(True)
        ok = jnp.all(jnp.where(anc, correct[:, None, :], True), axis=-1)  # [B,1+T]
        best = jnp.argmax(jnp.where(ok, depth, -1), axis=-1).astype(jnp.int32)  # [B], first max
        bonus = jnp.take_along_axis(choice, best[:, None], axis=1)[:, 0]
        return best, bonus

    @staticmethod
    def accepted_lengths(tokens: Sequence[int], parents: Sequence[int], actual: Sequence[int],
                         budgets: Sequence[int]) -> tuple:
        """Drafts a tree of the first `b` nodes would have accepted, for every b in
        `budgets` (ascending), given the true continuation `actual` (tokens after the root).

        # tokens [5, 7, 6], parents [-1, 0, -1], actual [5, 7, 9], budgets (0, 1, 3)
        # -> node0 ok (depth 1), node1 ok (depth 2), node2 wrong -> (0, 1, 2)
        """
        depth = depths(parents)
        ok = [False] * len(tokens)
        out, best, i = [], 0, 0
        for b in budgets:
            while i < min(b, len(tokens)):
                p, d = parents[i], depth[i]
                if (p < 0 or ok[p]) and d <= len(actual) and tokens[i] == actual[d - 1]:
                    ok[i] = True
                    best = max(best, d)
                i += 1
            out.append(best)
        return tuple(out)
