"""Acceptance rules: which nodes of a verified token tree are kept (device side, jitted).

A rule is a frozen (hashable) dataclass, a static argument of the one verify step
(`verify.verify_step`). Given the target's logits at every block node it returns, per row,
the deepest accepted node `best` and the `bonus` token sampled after it:

    rule(logits [B,1+T,V], tokens, parent, depth, anc, positions, seed, row,
         draft_probs=None, sampling=None) -> (best [B], bonus [B])

The verify step turns that into the emitted tokens (the drafted tokens on the path root
-> best, then the bonus) and the K/V compaction, so every rule shares one verify step and
every drafter shares every rule. `draft_probs` ([B,1+T,V], the distribution each node was
drawn from) is optional: None means deterministic drafts (one-hot), as the trie's.
`sampling`: each row's values (`sampling.RowSampling`, or a static `SamplingParams`);
the verify step always passes it (greedy `SamplingParams()` when every row is greedy),
so a rule's own `sampling` field is only the default of a direct call: it is not
compared or hashed, and rules that differ only in it share one compiled step.

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
from typing import Optional

import jax
import jax.numpy as jnp

from .drafts import depths
from .sampling import RowSampling, SamplingParams, filter_logits, position_keys, select_tokens

GREEDY = SamplingParams()


@dataclasses.dataclass(frozen=True)
class TokenMatch:
    """Accept a node iff its token is the model's own pick at its parent (and so is every
    ancestor's). Identical output to plain decoding with the same sampling and seed (each
    row's own: `sampling=` of the call, else the field)."""

    sampling: SamplingParams = dataclasses.field(default=GREEDY, compare=False)

    def __call__(self, logits, tokens, parent, depth, anc, positions, seed, row, draft_probs=None, sampling=None):
        T1 = tokens.shape[1]
        sp = self.sampling if sampling is None else sampling
        choice = select_tokens(logits, sp, seed, row, positions + 1)  # [B,1+T]
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
                         budgets: Sequence[int], depth: Optional[Sequence[int]] = None) -> tuple:
        """Drafts a tree of the first `b` nodes would have accepted, for every b in
        `budgets` (ascending), given the true continuation `actual` (tokens after the root).

        # tokens [5, 7, 6], parents [-1, 0, -1], actual [5, 7, 9], budgets (0, 1, 3)
        # -> node0 ok (depth 1), node1 ok (depth 2), node2 wrong -> (0, 1, 2)

        depth: `depths(parents)` when the caller has it (`Draft.depths`).
        """
        if depth is None:
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


# salts of the speculative-sampling streams: the acceptance uniforms and the bonus draw of
# a step are keyed by (seed, row, root position) and these, apart from every token key
SALT_ACCEPT, SALT_BONUS = 0x5EC1, 0x5EC2


@dataclasses.dataclass(frozen=True)
class SpecSampling:
    """Exact tree speculative sampling (SpecInfer's multi-step speculative sampling, with
    children drawn without replacement as in Sequoia): the emitted tokens are distributed
    exactly as plain sampling from the target with `sampling` (temperature / top-k / top-p),
    whatever the drafts. Greedy (temperature 0) is `TokenMatch`.

    Per row, a walk from the root. At the current node u the residual target is p (at
    first the target's filtered distribution at u) and the proposal q (the distribution
    u's children were drawn from, `draft_probs[u]`). Its children c1, c2, ... are tried in
    block order, which is the order they were drawn in:

        x = token of c; accept with probability min(1, p(x) / q(x))
        accepted: move to c (p <- target at c, q <- draft_probs[c]), try c's children
        rejected: p <- normalize(max(0, p - q));  q <- normalize(q without x)
        no child left: emit the bonus token ~ p (at a leaf: the target at the leaf)

    Why exact: one try is standard speculative sampling (x ~ q, accepted with min(1, p/q),
    else the output must be drawn from norm(max(0, p - q)) =: p'). Instead of drawing from
    p' directly, the walk tries the next child, which was drawn from q without x; p'(x) = 0
    (x is only rejected where q(x) > p(x)), so this is again speculative sampling of p'
    with proposal q-without-x, and by induction the token that leaves u is distributed as
    p. Children drawn *with* replacement, or top-k children, or a q not renormalized,
    break the argument (the statistical tests show each breaks the distribution).

    A node whose `draft_probs` row is all zero (or `draft_probs=None`), or whose token has
    q(x) = 0, was proposed deterministically (an n-gram trie): its proposal is one-hot(x),
    so it is accepted with probability p(x), and a rejection zeroes x in p.

    Worked example (V = 3, root u with children a = token 0, b = token 1, drawn without
    replacement from q = [.6, .3, .1]; target p = [.2, .5, .3]):
        try a: accept with min(1, .2/.6) = 1/3. Rejected (2/3):
               p <- norm(max(0, p - q)) = norm([0, .2, .2]) = [0, .5, .5]
               q <- norm([0, .3, .1]) = [0, .75, .25]
        try b: accept with min(1, .5/.75) = 2/3. Rejected: p <- norm([0, 0, .25]) = [0, 0, 1]
        bonus ~ p: token 2.
    P(token 0 first) = P(a drawn first) * 1/3 = .6/3 = .2 = p(0), as it must be.

    Per row (`sampling=` a `RowSampling`): a greedy row (temperature 0) is `TokenMatch`'s
    argmax, the others walk with their own filtered target.

    Randomness: the uniform of block node c is keyed by (seed, row, the root's position,
    SALT_ACCEPT, c), the bonus by (..., SALT_BONUS): a pure function of the state, fresh at
    every step (each step has its own root position), independent of the draft's keys.
    """

    sampling: SamplingParams = dataclasses.field(default=SamplingParams(temperature=1.0), compare=False)

    def __call__(self, logits, tokens, parent, depth, anc, positions, seed, row, draft_probs=None, sampling=None):
        sp = self.sampling if sampling is None else sampling
        match = (logits, tokens, parent, depth, anc, positions, seed, row)
        if isinstance(sp, SamplingParams) and sp.greedy:
            return TokenMatch()(*match, sampling=GREEDY)
        def walk():
            p_all = jax.nn.softmax(filter_logits(logits, sp), axis=-1)  # [B,1+T,V]
            q_all = jnp.zeros_like(p_all) if draft_probs is None else draft_probs.astype(jnp.float32)
            step_keys = position_keys(seed, row, positions[:, :1])[:, 0]  # [B,2]
            best, bonus = jax.vmap(lambda *a: _walk(self, *a))(p_all, q_all, tokens, parent, step_keys)
            return best.astype(jnp.int32), bonus.astype(jnp.int32)

        if not isinstance(sp, RowSampling):
            return walk()
        # greedy rows: the argmax match, as alone; whether any row samples is data (one
        # compiled step for greedy and sampled batches; an all-greedy one skips the walk)
        g_best, g_bonus = (x.astype(jnp.int32) for x in TokenMatch()(*match, sampling=GREEDY))

        def mixed():
            best, bonus = walk()
            sampled = sp.temperature > 0  # [B]
            return jnp.where(sampled, best, g_best), jnp.where(sampled, bonus, g_bonus)

        return jax.lax.cond(jnp.any(sp.temperature > 0), mixed, lambda: (g_best, g_bonus))

    # the two updates after a rejection (methods, so that a test can break one of them)
    @staticmethod
    def residual(p, q):
        """The target after rejecting a draw from q: normalize(max(0, p - q)); p itself
        where that is empty (p <= q everywhere: a rejection had probability 0)."""
        r = jnp.maximum(p - q, 0.0)
        return jnp.where(jnp.sum(r) > 0, _normalized(r), p)

    @staticmethod
    def without(q, x):
        """The proposal of the next sibling: q without the rejected token x, renormalized
        (siblings are drawn without replacement)."""
        return _normalized(q.at[x].set(0.0))


def _normalized(x):
    s = jnp.sum(x)
    return jnp.where(s > 0, x / jnp.where(s > 0, s, 1.0), x)


def _walk(rule, p_all, q_all, tokens, parent, key):
    """One row of `SpecSampling`: p_all/q_all [1+T,V], tokens/parent [1+T], key [2]."""
    T1, V = p_all.shape
    idx = jnp.arange(T1)
    accept_key = jax.random.fold_in(key, SALT_ACCEPT)

    def body(_, st):
        u, ptr, p, q, done, bonus = st
        cand = (parent == u) & (idx > ptr)
        has = jnp.any(cand) & ~done
        c = jnp.argmax(cand)  # the next child in block (= draw) order
        x = tokens[c]
        drawn = (jnp.sum(q) > 0) & (q[x] > 0)  # else: a deterministic child, proposal one-hot(x)
        qv = jnp.where(drawn, q, jax.nn.one_hot(x, V, dtype=q.dtype))
        ratio = p[x] / jnp.where(qv[x] > 0, qv[x], 1.0)
        u01 = jax.random.uniform(jax.random.fold_in(accept_key, c))
        ok = has & (u01 < ratio)
        rej = has & ~ok
        p_rej = rule.residual(p, qv)
        q_rej = jnp.where(drawn, rule.without(q, x), q)
        # no child left (or a leaf): the walk ends with the bonus token drawn from p
        end = ~done & ~has
        draw = jax.random.categorical(jax.random.fold_in(key, SALT_BONUS), jnp.log(p))
        u = jnp.where(ok, c, u)
        ptr = jnp.where(has, c, ptr)
        p = jnp.where(ok, p_all[c], jnp.where(rej, p_rej, p))
        q = jnp.where(ok, q_all[c], jnp.where(rej, q_rej, q))
        bonus = jnp.where(end, draw.astype(jnp.int32), bonus)
        return u, ptr, p, q, done | end, bonus

    init = (jnp.int32(0), jnp.int32(0), p_all[0], q_all[0], jnp.bool_(False), jnp.int32(0))
    # each pass tries one child or ends the walk: T tries at most, then the bonus
    u, _, _, _, _, bonus = jax.lax.fori_loop(0, T1 + 1, body, init)
    return u, bonus
