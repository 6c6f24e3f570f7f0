"""One jitted decode step that verifies a token tree: shared by every drafter.

Input per row b: the root (last emitted token, not yet in the cache) followed by T draft
nodes, packed by `tree.py` into a block of 1+T:

    tokens [B,1+T]   root then nodes (pad token where invalid)
    parent [B,1+T]   index of each node's parent in the block (root: -1, padding: -2)
    depth  [B,1+T]   0 for the root, 1 for its children, ...
    anc    [B,1+T,1+T] anc[i, j] = j is i or an ancestor of i; the root is everyone's
                     ancestor (padding sees the root and itself, and is never accepted)

Algorithm (one forward, no shape depends on the outcome):
1. Forward the block at positions `length + depth`, slots `length .. length+T`; each query
   sees the committed prefix and its own ancestors.
2. The acceptance rule (a static component, `acceptance.py`) picks the deepest accepted
   node `best` and the bonus token after it. `TokenMatch`: at every node i choose the
   model's token `c[i]` for position `length + depth[i] + 1` (argmax, or a sample keyed
   by (seed, row, position): see sampling.py); node i is correct if tokens[i] ==
   c[parent[i]], accepted if it and all its ancestors are correct; bonus = c[best].
   Because the choice at a node depends only on its own logits and position, this is
   exactly what plain decoding would choose after the root-to-i path.
3. The accepted path root -> best has n = depth[best] drafts.
4. Emit the n drafted tokens on the path plus the bonus: n + 1 tokens (for TokenMatch
   exactly the tokens plain decoding would emit over the same n + 1 steps).
5. Compact the path's K/V into slots length .. length+n and advance length by n + 1
   (inactive rows: by 0). Rejected nodes are simply not committed.

    # parents [-1, 0, 0, 1] (root, a, b, a's child c); c = model choices
    # correct = [T, tok[1]==c[0], tok[2]==c[0], tok[3]==c[1]]; if a and c are correct:
    # best = 3, path = [0, 1, 3], emitted = [tok[1], tok[3], c[3]], length += 3

With T = 0 (no drafts) the step is plain decoding: one token per forward.

Every step takes one inputs pytree and one static mode (`inputs.py`: `StepInputs`,
`StepMode`). Options that change a step the same way in plain decoding and in
verification, so every strategy stays exact with them (all off by default: the step is
then unchanged):
* each row's sampling values (`StepInputs.sampling`, a `sampling.RowSampling`: None =
  every row greedy, the argmax path) and penalties (`StepInputs.penalties`, a
  `sampling.RowPenalties`): values are arrays, only their flags are compiled in.
* each row's logit_bias (`StepInputs.bias`, a `sampling.RowBias`): added to the raw
  logits of every node (`sampling.add_bias`), first, so every rule (token match, the
  speculative sampler's target distribution) verifies against the biased distribution,
  as plain decoding picks from it.
* penalties (repetition / presence / frequency) with the row's `seen` [B,V] (ids in the
  context up to the root) and `counts` [B,V] (generated ids up to the root): node i's
  logits are penalized by its own context, the base plus the drafted tokens on its path
  root -> i (`path_counts`), i.e. by exactly the context plain decoding has at that
  position. Applied to the raw logits, before the ban below.
* `suppress` [B] with the mode's `ban` ids (min_new_tokens): the logits at a position
  below suppress[b] give the `ban` tokens (EOS, stop ids) probability 0 before the rule
  sees them, so a node is checked against exactly what plain decoding would pick there.
* `mode.logprobs`: also return the model's log-probability of every emitted token
  (log_softmax of the raw logits, before temperature / top-k / top-p / bans) at the node
  that chose it: the values plain decoding computes for the same token at the same place.
* `mode.top_logprobs` = k > 0: also return the k most likely ids and their
  log-probabilities (`top_k_logprobs` of the same raw logits) where each emitted token
  was chosen (`extend_step`: after every forwarded token, the prompt's included). The
  tokens are those of the step without it; the first id is the raw logits' argmax (the
  greedy pick where no penalty or ban applies). With `inputs.scores` (a bool scalar) they
  and a prefill's `mode.prompt_logprobs` are computed only where it is true (`on_demand`:
  a `lax.cond`), so slots that serve them compile one program for steps with and without.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .acceptance import GREEDY, TokenMatch
from ..models import KVCache, advance, commit, hidden_states, logits_from_hidden
from ..models.config import ModelConfig
from .inputs import StepInputs, StepMode
from .sampling import SamplingParams, add_bias, penalize, select_tokens


def tree_mask(length, anc, n_slots):
    """attn mask [B,1+T,S]: all committed slots, plus the ancestors within the block."""
    B, T1, _ = anc.shape
    s = jnp.arange(n_slots)[None, None, :]  # [1,1,S]
    prefix = s < length[:, None, None]  # [B,1,S]
    rel = s - length[:, None, None]  # slot offset inside the block
    in_block = (rel >= 0) & (rel < T1)
    block = jnp.take_along_axis(
        anc, jnp.broadcast_to(jnp.clip(rel, 0, T1 - 1), (B, T1, n_slots)), axis=2
    )
    return prefix | (in_block & block)


def banned(logits, positions, suppress, ban: tuple):
    """logits [B,T,V] with the `ban` ids at -inf where positions [B,T] < suppress [B]
    (min_new_tokens: the token after such a position may not end the row)."""
    if suppress is None or not ban:
        return logits
    ids = jnp.asarray(ban, jnp.int32)
    early = (positions < suppress[:, None])[..., None]  # [B,T,1]
    cur = logits[..., ids]
    return logits.at[..., ids].set(jnp.where(early, -jnp.inf, cur))


def path_counts(tokens, anc, V: int):
    """[B,1+T,V] int32: how often each id occurs on node i's path below the root (i
    included; the root is in the host's base counts). Padding counts only itself.

    # tokens [r, a, b, a], parents [-1, 0, 0, 1]: node 3 counts a twice, node 2 counts b,
    # node 0 (the root) nothing
    """
    B, T1 = tokens.shape
    below = anc.at[:, :, 0].set(False).astype(jnp.int32)  # [B,1+T,1+T] (node i, ancestor j)
    bi = jnp.arange(B)[:, None, None]
    ii = jnp.arange(T1)[None, :, None]
    ids = jnp.where(tokens < 0, V, tokens)[:, None, :]  # [B,1,1+T]; invalid ids are dropped
    return jnp.zeros((B, T1, V), jnp.int32).at[bi, ii, ids].add(below, mode="drop")


def token_logprobs(logits, picks):
    """log_softmax(logits [B,T,V])[picks [B,T]] -> [B,T] f32."""
    lf = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(lf, jnp.clip(picks, 0)[..., None], axis=-1)[..., 0]
    return chosen - jax.nn.logsumexp(lf, axis=-1)


class VerifyOut(NamedTuple):
    """What a verify step returns beside the cache (device arrays; optional fields are None
    unless asked for, so one shape of result serves every option)."""

    tokens: jax.Array  # [B,1+T] int32 emitted tokens, -1 past n
    n: jax.Array  # [B] int32 tokens emitted (0 for inactive rows)
    path: jax.Array  # [B,1+T] int32 block indices of the accepted nodes root..best, then 0
    logprobs: Optional[jax.Array] = None  # [B,1+T] f32 of the emitted tokens (logprobs=True)
    hidden: Optional[jax.Array] = None  # [B,1+T,D] final hidden state of every block node (hidden=True)
    top_logprobs: Optional[jax.Array] = None  # [B,1+T,k] f32 where each emitted token was chosen (0 past n)
    top_ids: Optional[jax.Array] = None  # [B,1+T,k] int32 their ids (-1 past n)


class ExtendOut(NamedTuple):
    """What an extend (prefill) step returns beside the cache."""

    tokens: jax.Array  # [B] int32 the next token of each row (0 with emit=False)
    logprobs: Optional[jax.Array] = None  # [B] f32 its log-probability (logprobs=True)
    hidden: Optional[jax.Array] = None  # [B,D] final hidden state of each row's last forwarded token (hidden=True)
    top_logprobs: Optional[jax.Array] = None  # [B,P,k] f32 after every forwarded token (top_logprobs=k)
    top_ids: Optional[jax.Array] = None  # [B,P,k] int32 their ids
    prompt_logprobs: Optional[jax.Array] = None  # [B,P] f32 at p: log p(tokens[p + 1] | ..p) (prompt_logprobs)


def top_k_logprobs(logits, k: int):
    """The k most likely ids after each position: logits [B,T,V] -> (log-probs [B,T,k] f32,
    descending; ids [B,T,k] int32). The log-probabilities are computed as `token_logprobs`
    computes them, bit for bit: a chosen token that is the most likely has exactly its
    top value (clients test greediness by equality, e.g. lm-eval's loglikelihood)."""
    lf = logits.astype(jnp.float32)
    v, i = jax.lax.top_k(lf - jax.nn.logsumexp(lf, axis=-1, keepdims=True), k)
    return v, i.astype(jnp.int32)


def on_demand(flag, fn, *args):
    """fn(*args) where `flag` (`StepInputs.scores`) is None or true, else zeros of its
    shapes: under a `lax.cond`, so one program serves steps whose rows ask for these scores
    and steps whose rows don't, and only the first pay for them."""
    if flag is None:
        return fn(*args)

    def zeros(*a):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *a))

    return jax.lax.cond(flag, fn, zeros, *args)


def verify_step(params, cache: KVCache, inputs: StepInputs, *, config: ModelConfig, rule, mode: StepMode):
    """Returns (`VerifyOut`, cache): the emitted tokens, their count and the accepted path;
    with `mode.logprobs` their log-probabilities, with `mode.hidden` the final hidden state
    of every block node (e.g. for a drafter that drafts from the target's features).

    inputs (`inputs.StepInputs`): tokens / parent / depth / mask (the packed block), active,
    seed, row; optional: sampling (each row's `RowSampling`; None: every row greedy; the
    rule's own field is not used), draft_probs (the drafts' distributions, for rules that
    need them), suppress (with `mode.ban`: min_new_tokens), penalties with seen / counts,
    bias (each row's logit_bias): see the module docstring. rule: the acceptance rule
    (`acceptance.TokenMatch`, ...), static. mode.window: the number of cache slots attention reads (0: all). Every active
    row needs length + 1 + T <= window; the decode loop picks it with `window_for`."""
    mode.check(inputs)
    x = inputs
    tokens, parent, depth, anc = x.tokens, x.parent, x.depth, x.mask
    window, top_logprobs = mode.window, mode.top_logprobs
    B, T1 = tokens.shape
    length = cache.length
    positions = length[:, None] + depth  # [B,1+T]
    mask = tree_mask(length, anc, window or cache.max_len)
    h, cache = hidden_states(params, tokens, positions, cache, mask, config)  # [B,1+T,D]
    raw = logits_from_hidden(params, h, config)  # [B,1+T,V]
    pen = x.penalties
    path = (lambda: path_counts(tokens, anc, raw.shape[-1])) if T1 > 1 else None
    logits = penalize(add_bias(raw, x.bias), pen, x.seen, x.counts, path)
    logits = banned(logits, positions, x.suppress, mode.ban)
    best, bonus = rule(logits, tokens, parent, depth, anc, positions, x.seed, x.row, x.draft_probs,
                       sampling=GREEDY if x.sampling is None else x.sampling)
    active = x.active.astype(bool)
    n_acc = jnp.take_along_axis(depth, best[:, None], axis=1)[:, 0]  # [B] accepted drafts
    n_emit = jnp.where(active, n_acc + 1, 0).astype(jnp.int32)
    if T1 == 1:  # plain decoding
        top = on_demand(x.scores, lambda r: top_k_logprobs(r, top_logprobs), raw) if top_logprobs else (None, None)
        out = VerifyOut(bonus[:, None], n_emit, jnp.zeros((B, 1), jnp.int32),
                        token_logprobs(raw, bonus[:, None]) if mode.logprobs else None, h if mode.hidden else None,
                        *top)
        return out, advance(cache, n_emit)

    # path[d] = index of the accepted node at depth d (d = 0..n_acc); rest 0
    on_path = jnp.take_along_axis(anc, best[:, None, None], axis=1)[:, 0, :]  # [B,1+T]
    slot = jnp.where(on_path, depth, T1)  # out-of-range -> dropped
    idx = jnp.broadcast_to(jnp.arange(T1, dtype=jnp.int32), (B, T1))
    path = jax.vmap(lambda s, i: jnp.zeros((T1,), jnp.int32).at[s].set(i, mode="drop"))(slot, idx)

    # emitted[d] = token of the path's node at depth d+1 (d < n_acc), then the bonus
    nxt = jnp.take_along_axis(tokens, jnp.concatenate([path[:, 1:], path[:, :1]], axis=1), axis=1)
    d = jnp.arange(T1)[None, :]
    emitted = jnp.where(d < n_acc[:, None], nxt, jnp.where(d == n_acc[:, None], bonus[:, None], -1))
    cache = commit(cache, path, n_emit)
    lp, top = None, (None, None)
    if mode.logprobs:  # emitted[d] was chosen at the path's node of depth d
        at_path = jnp.take_along_axis(raw, path[:, :, None], axis=1)  # [B,1+T,V]
        lp = jnp.where(d <= n_acc[:, None], token_logprobs(at_path, emitted), 0.0)
    if top_logprobs:
        def tops(raw, path, kept):
            v, i = top_k_logprobs(jnp.take_along_axis(raw, path[:, :, None], axis=1), top_logprobs)
            return jnp.where(kept[..., None], v, 0.0), jnp.where(kept[..., None], i, -1)

        top = on_demand(x.scores, tops, raw, path, d <= n_acc[:, None])
    return VerifyOut(emitted, n_emit, path, lp, h if mode.hidden else None, *top), cache


def extend_step(params, cache: KVCache, inputs: StepInputs, *, config: ModelConfig, mode: StepMode):
    """Forward each row's `n_new[b]` tokens (right-padded block `tokens` [B,P]) at positions
    length[b] .. length[b]+n-1 into the existing cache, and pick the next token after
    them: a prefill that need not start at 0 (also chunked prefill, and what an outer loop
    such as retrieval-augmented decoding needs after a rollback).

    Returns (`ExtendOut`: next token [B] (+ its log-probability, + the last forwarded
    token's hidden state, when asked), cache). With mode.emit all n tokens are committed
    (length += n) and the next token is the model's pick at position length + n (the row's
    next root). Without it the last token stays uncommitted (length += n - 1): it is the
    root the next step forwards, as after any decode step. Rows with n_new = 0 are left
    as they are. mode.window: slots attention reads (>= max(length) + P; a fresh prefill
    reads only its own P slots). inputs.sampling (`RowSampling`): each row's values (None:
    every row greedy). suppress / mode.ban, mode.logprobs, penalties, bias: as in
    `verify_step`; seen / counts cover the whole context up to the last forwarded token
    (the token picked here follows it). mode.top_logprobs = k: also the top log-probs [B,P,k] and their ids
    of the distribution after every forwarded token (position n_new-1: the one the next
    token is picked from; padding positions past it hold junk): what a teacher needs over a
    whole prompt (distillation). mode.prompt_logprobs: also the log-probability of each
    forwarded token given the context before it, [B,P], at position p that of tokens[p + 1]
    (the prompt's log-probabilities as a plain forward's log_softmax gives them; p >=
    n_new - 1 holds junk: the next block, which re-forwards this one's last token, or the
    pick, covers it).

    inputs.sel [G] (optional): the block is for cache rows `sel` only; every per-row input
    and output then has G rows (`StepInputs.rows`). The forward reads and writes those
    rows' slots in place (`hidden_states(rows=)`: no copy of their windows out and back),
    so it costs G rows, not the cache's B: a mixed-length batch prefills each group of
    similar lengths apart, and a server's newcomer prefills beside the running rows."""
    mode.check(inputs)
    x = inputs
    tokens, n_new, sel, window, top_logprobs = x.tokens, x.n_new, x.sel, mode.window, mode.top_logprobs
    B, P = tokens.shape
    length = cache.length if sel is None else cache.length[sel]
    positions = length[:, None] + jnp.arange(P, dtype=jnp.int32)[None, :]  # [B,P]
    s = jnp.arange(window)[None, None, :]
    mask = s <= positions[:, :, None]  # [B,P,W]: the committed prefix and the block, causal
    h, cache = hidden_states(params, tokens, positions, cache, mask, config, rows=sel)
    last = jnp.take_along_axis(h, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)  # [B,1,D]
    raw = logits_from_hidden(params, last, config)  # [B,1,V]
    logits = penalize(add_bias(raw, x.bias), x.penalties, x.seen, x.counts)
    logits = banned(logits, (length + n_new - 1)[:, None], x.suppress, mode.ban)
    sp = GREEDY if x.sampling is None else x.sampling
    nxt = select_tokens(logits, sp, x.seed, x.row, (length + n_new)[:, None])[:, 0]
    keep = n_new if mode.emit else jnp.maximum(n_new - 1, 0)
    if sel is None:
        cache = advance(cache, keep)
    else:
        cache = cache.replace(length=cache.length.at[sel].add(jnp.asarray(keep, jnp.int32)))
    top, prompt_lps = (None, None), None
    if top_logprobs or mode.prompt_logprobs:
        def scores(h, raw, tokens, n_new):
            every = logits_from_hidden(params, h, config)  # [B,P,V]
            # at n_new - 1 the very logits the pick above came from (a [B,P] matmul may round differently)
            last_pos = (jnp.arange(P)[None, :] == jnp.maximum(n_new - 1, 0)[:, None])[..., None]  # [B,P,1]
            top = top_k_logprobs(jnp.where(last_pos, raw, every), top_logprobs) if top_logprobs else (None, None)
            # p -> tokens[p + 1] (the last position's is junk: 0's target)
            lps = token_logprobs(every, jnp.concatenate([tokens[:, 1:], tokens[:, :1] * 0], axis=1)) \
                if mode.prompt_logprobs else None
            return top, lps

        top, prompt_lps = on_demand(x.scores, scores, h, raw, tokens, n_new)
    return ExtendOut(nxt, token_logprobs(raw, nxt[:, None])[:, 0] if mode.logprobs else None,
                     last[:, 0] if mode.hidden else None, *top, prompt_logprobs=prompt_lps), cache


class StepsOut(NamedTuple):
    """What `plain_steps` returns beside the cache."""

    tokens: jax.Array  # [B,K] int32 each row's tokens in order, -1 past n
    n: jax.Array  # [B] int32 tokens each row emitted (it stops at a stop id or its remaining count)
    logprobs: Optional[jax.Array] = None  # [B,K] f32 of the tokens (logprobs=True), 0 past n


def plain_steps(params, cache: KVCache, inputs: StepInputs, *, config: ModelConfig, rule, mode: StepMode):
    """Up to `mode.steps` plain decode steps in one call: a `lax.while_loop` of the verify
    step of a root-only block (tokens [B,1], the rows' roots; parent / depth / mask its
    constant rows), so the host is woken once per `steps` tokens instead of once per token.
    Each iteration is exactly `verify_step` on that block (the same tokens and log-probs as
    `steps` separate calls); a row stops after emitting one of its `inputs.stop_ids` [B,E]
    (-1 pads) or `inputs.remaining` [B] tokens, and the loop ends when every row has
    stopped or after `steps` iterations. mode.window: covers every active row's length +
    steps. No penalties (seen / counts change every token; the caller takes single steps
    then). Returns (`StepsOut`, cache advanced by each row's n)."""
    if inputs.penalties is not None or inputs.seen is not None or inputs.counts is not None:
        raise ValueError("plain_steps takes no penalties")
    steps, logprobs = mode.steps, mode.logprobs
    one = mode._replace(steps=0)  # each iteration's verify step
    B = inputs.tokens.shape[0]
    root = inputs.tokens[:, 0]
    remaining, stop_ids = inputs.remaining, inputs.stop_ids
    x = inputs._replace(remaining=None, stop_ids=None)

    def body(carry):
        i, cache, root, live, out, lps, n = carry
        o, cache = verify_step(params, cache, x._replace(tokens=root[:, None], active=live), config=config,
                               rule=rule, mode=one)
        new = o.tokens[:, 0]
        out = out.at[:, i].set(jnp.where(live, new, -1))
        if logprobs:
            lps = lps.at[:, i].set(jnp.where(live, o.logprobs[:, 0], 0.0))
        n = n + live.astype(jnp.int32)
        stop = (new[:, None] == stop_ids).any(axis=1) | (n >= remaining)
        root = jnp.where(live, new, root)
        return i + 1, cache, root, live & ~stop, out, lps, n

    def cond(carry):
        return (carry[0] < steps) & carry[3].any()

    live = x.active.astype(bool) & (remaining > 0)
    init = (jnp.int32(0), cache, root, live, jnp.full((B, steps), -1, jnp.int32),
            jnp.zeros((B, steps), jnp.float32) if logprobs else None, jnp.zeros((B,), jnp.int32))
    _, cache, _, _, out, lps, n = jax.lax.while_loop(cond, body, init)
    return StepsOut(out, n, lps), cache


@functools.lru_cache(maxsize=None)
def jitted_plain_steps(config: ModelConfig, rule):
    """jit(plain_steps) for one (config, rule); the cache donated, the mode static."""
    return jax.jit(functools.partial(plain_steps, config=config, rule=rule), donate_argnums=(1,),
                   static_argnames=("mode",))


@functools.lru_cache(maxsize=None)
def jitted_extend(config: ModelConfig):
    """jit(extend_step) for one config; the cache donated, the mode static."""
    return jax.jit(functools.partial(extend_step, config=config), donate_argnums=(1,), static_argnames=("mode",))


@functools.lru_cache(maxsize=None)
def jitted_verify_step(config: ModelConfig, rule):
    """jit(verify_step) for one (config, acceptance rule); the cache (argument 1) is donated
    and the mode (keyword) is static: one compilation per (tree bucket, mode)."""
    if isinstance(rule, SamplingParams):  # the rule every strategy used before rules existed
        rule = TokenMatch(rule)
    return jax.jit(functools.partial(verify_step, config=config, rule=rule), donate_argnums=(1,),
                   static_argnames=("mode",))


WINDOW_MIN = 128
WINDOW_STEP = 4  # each window 4x the one before: few windows, so few compiled steps


def window_for(needed: int, max_len: int) -> int:
    """Smallest attention window (WINDOW_MIN x 4^k, or the whole cache) that covers `needed`
    slots. A window keeps a step's attention proportional to the length where attention
    reads every slot of it (XLA's attention: GPU, TPU, prefill blocks); each window is one
    compiled program per step shape, so the ladder is coarse: S = 2048 has three (128, 512,
    2048). Decode and verify steps that the CPU attention kernel runs take the whole cache
    instead (`Engine.window`).
    # window_for(100, 2048) -> 128; window_for(129, 2048) -> 512; window_for(700, 768) -> 768
    """
    if needed > max_len:
        raise ValueError(f"a step needs {needed} cache slots but the cache holds {max_len}")
    w = WINDOW_MIN
    while w < needed:
        w *= WINDOW_STEP
    return max_len if w >= max_len else w


def fit_draft_probs(probs, T: int):
    """Draft distributions [B,1+N,V] (block order) cut or zero-padded to the step's 1+T."""
    if probs is None or probs.shape[1] == 1 + T:
        return probs
    if probs.shape[1] > 1 + T:
        return probs[:, :1 + T]
    return jnp.pad(probs, ((0, 0), (0, 1 + T - probs.shape[1]), (0, 0)))
