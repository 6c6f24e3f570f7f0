"""SpecInfer: a draft model's token tree (drafters/model.py), exact tree speculative sampling
(acceptance.SpecSampling), through the one decode loop.

* Greedy: token for token plain greedy decoding, with drafts that are always right (the
  target itself), partly right (a perturbed target) and never right (another random
  model); batch 1 and 4, several tree shapes, EOS mid-batch, stop strings, rollback.
* "invariant" sampling: token for token plain sampling with the same seed.
* "mss" sampling: the distribution of the first two tokens is the target's, checked with
  a chi-square test on >= 1e5 samples, at the rule (many tree shapes / samplings, bad and
  perfect drafts) and end to end through `generate` on a tiny model with a small
  vocabulary; the same check catches broken rules.
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lookahead_jax.core.decode import rollback
from lookahead_jax.generate import generate
from lookahead_jax.prompts import encode_prompts
from lookahead_jax.core import tree as tree_lib
from lookahead_jax.core.acceptance import SpecSampling
from lookahead_jax.drafters.merge import merge
from lookahead_jax.drafters.model import ModelDrafter, check_expansion, expansion_tree
from lookahead_jax.core.drafts import Draft
from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.models import forward, init_cache
from lookahead_jax.core.sampling import SamplingParams, filter_logits
from lookahead_jax.strategies import SpecInfer
from lookahead_jax.strategies.specinfer import DraftStore
from tiny import ByteTokenizer, EditRun, load_prompts, tiny_model

chisquare = pytest.importorskip("scipy.stats").chisquare

MAX_NEW = 32
CACHE = 1280  # the prompts reach 725 tokens
PROMPTS = load_prompts(4)  # 12 prompts from RAG / code / math
TEXTS = [p["prompt"] for p in PROMPTS]


def _request(ids, max_new_tokens, **kw) -> Request:
    """Every request of this file (one place for `Request`'s fields)."""
    fields = {k: kw.pop(k) for k in ("strategy", "sampling_row", "references", "on_text") if k in kw}
    return Request(ids, GenerationParams(max_new_tokens=max_new_tokens, **kw), **fields)


def perturbed(model, scale, seed=0):
    """The model with Gaussian noise (relative `scale`) on every weight: a draft that
    agrees with the target often, not always."""
    leaves, tdef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return types.SimpleNamespace(config=model.config, params=jax.tree.unflatten(tdef, noisy),
                                 name=f"{model.name}+noise{scale}", dtype=model.dtype)


@pytest.fixture(scope="module")
def drafts(model):
    return {"same": model, "close": perturbed(model, 0.3), "random": tiny_model("llama", seed=2)}


def run(model, tok, batch, **kw):
    ids, steps = [], 0
    for s in range(0, len(TEXTS), batch):
        out = generate(model, tok, TEXTS[s:s + batch], max_new_tokens=MAX_NEW, max_cache_len=CACHE, **kw)
        ids += out.token_ids
        steps += sum(r.forward_steps for r in out.rows)  # per row (prefill included)
    return ids, steps


@pytest.fixture(scope="module")
def greedy(model, tok):
    return run(model, tok, 4)[0]


# ----------------------------------------------------------------------------- tree shape
def test_expansion_tree_shape():
    assert expansion_tree((2, 2)) == ([-1, -1, 0, 0, 1, 1], [1, 1, 2, 2, 2, 2])
    parents, levels = expansion_tree((1, 1, 3, 1, 1, 1, 1, 1))
    assert len(parents) == 20 and max(levels) == 8
    assert all(p < i for i, p in enumerate(parents))
    for bad in [(), (0, 1), (1, 17), (4, 4, 4, 4)]:
        with pytest.raises(ValueError):
            check_expansion(bad)


# ----------------------------------------------------------------------------- greedy
SHAPES = [(4, (1, 1, 3, 1, 1, 1, 1, 1)), (1, (2, 2, 1)), (4, (4,))]
FAST = {("same", 0), ("close", 1), ("random", 2)}  # the default run; CI runs all (`slow`)


@pytest.mark.parametrize("draft,batch,expansion", [
    pytest.param(d, *SHAPES[i], marks=() if (d, i) in FAST else pytest.mark.slow)
    for i in range(len(SHAPES)) for d in ("same", "close", "random")])
def test_specinfer_greedy_equals_greedy(model, tok, greedy, drafts, draft, batch, expansion):
    # "same" keeps the draft's weights f32 (the target itself: always right); the others
    # run the default bf16 draft weights
    weights = "float32" if draft == "same" else "bfloat16"
    ids, steps = run(model, tok, batch, strategy=SpecInfer(draft_model=drafts[draft], expansion=expansion,
                                                           draft_weights=weights, budget="fixed"))
    assert ids == greedy
    n_tokens = sum(len(x) for x in ids)
    if draft == "same":  # every draft accepted: the full depth (+ the bonus) per step
        assert steps < n_tokens / 1.8
    if draft == "random":  # nothing accepted: one token per forward, as plain decoding
        assert steps >= n_tokens * 0.9


def test_bf16_draft_weights(model, tok, greedy, drafts):
    """draft_weights="bfloat16" (the default): the draft runs on a private engine whose
    packed weights are bf16 (where the CPU kernels pack), the caller's draft model keeps
    its f32 params, the output is greedy's, and the target itself as a bf16 draft is
    still accepted almost always."""
    from lookahead_jax.core.packing import packed_dtype as _packed_dtype
    from lookahead_jax.strategies.specinfer import draft_engine

    target = engine_for(model)
    before = jax.tree.leaves(drafts["same"].params)
    ids, steps = run(model, tok, 4, strategy=SpecInfer(draft_model=drafts["same"], expansion=(1, 1, 1, 1),
                                                       budget="fixed"))  # every step drafts
    assert ids == greedy
    assert steps < sum(len(x) for x in ids) / 2.5  # 5 tokens per step when every draft is accepted
    eng = draft_engine(target, drafts["same"], "bfloat16")
    assert eng is not engine_for(drafts["same"]) and eng.weight_dtype == jnp.bfloat16
    if _packed_dtype(engine_for(drafts["same"]).params) is not None:  # kernels on: packing applies
        assert _packed_dtype(eng.params) == jnp.bfloat16
    assert all(a is b for a, b in zip(jax.tree.leaves(drafts["same"].params), before))
    assert draft_engine(target, drafts["same"], "float32") is engine_for(drafts["same"])
    with pytest.raises(ValueError, match="draft_weights"):
        generate(model, tok, "hi", strategy="specinfer", draft_model=model, draft_weights="int8")


def test_bf16_draft_by_name_is_packed_as_it_loads(model, tok, greedy, drafts, tmp_path):
    """A draft loaded by name (a saved directory) is packed into bf16 as its weights are
    read (`load(packed_dtype=)`): the same bf16 weights as packing the f32 model in
    memory, and greedy's tokens."""
    import lookahead_jax as lj
    from test_distill import byte_tokenizer

    from lookahead_jax.strategies.specinfer import draft_engine

    lj.save_pretrained(lj.Model(model.config, model.params, "draft"), byte_tokenizer(), tmp_path / "d")
    target = engine_for(model)
    by_name = draft_engine(target, str(tmp_path / "d"), "bfloat16")
    ref = draft_engine(target, drafts["same"], "bfloat16")
    assert by_name.model.params is by_name.params  # its only weights are the packed ones
    assert jax.tree.structure(by_name.params) == jax.tree.structure(ref.params)
    for a, b in zip(jax.tree.leaves(by_name.params), jax.tree.leaves(ref.params)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    ids, _ = run(model, tok, 4, strategy=SpecInfer(draft_model=str(tmp_path / "d"), expansion=(1, 1, 1, 1),
                                                  budget="fixed"))
    assert ids == greedy


def test_specinfer_eos_mid_batch_and_stop(model, greedy, drafts):
    tok = ByteTokenizer()
    tok.eos_token_ids = {greedy[1][10]}
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    ref = generate(model, tok, TEXTS[:4], **kw)
    assert "eos" in [r.finish_reason for r in ref.rows] and len({len(t) for t in ref.token_ids}) > 1
    for d in ("same", "close"):
        out = generate(model, tok, TEXTS[:4], strategy="specinfer", draft_model=drafts[d], budget="fixed", **kw)
        assert out.token_ids == ref.token_ids
        assert [r.finish_reason for r in out.rows] == [r.finish_reason for r in ref.rows]
    tok = ByteTokenizer()
    stop = tok.decode(greedy[4])[12:14]
    ref = generate(model, tok, TEXTS[4:8], stop=[stop], **kw)
    out = generate(model, tok, TEXTS[4:8], stop=[stop], strategy="specinfer", draft_model=drafts["close"],
                   budget="fixed", **kw)
    assert ref.rows[0].finish_reason == "stop"
    assert out.token_ids == ref.token_ids and out.texts == ref.texts


def test_draft_budget_chooses_by_measured_rates():
    """DraftBudget (budget="auto"): it drafts until the draft's cost and the gain are
    measured, then drafts iff 1 + a > (1 + margin)(rho + delta) in plain steps of the
    batch; a plain choice holds HOLD steps, the last of which drafts again, and the hold
    doubles (up to MAX_HOLD) while the probes keep choosing plain; a drafted choice resets
    it. delta is measured as d x rho / v_T on drafted steps that are not a switch's
    catch-up; rho blends the prior with the observed t(T) / t(0)."""
    from lookahead_jax.core.budget import forward_cost
    from lookahead_jax.strategies.specinfer import DraftBudget

    b = DraftBudget(4, prior=1.1)
    assert b.T == 4 and b.rho() == 1.1
    assert b.choose() and b.probing  # nothing measured: a probe
    b.delta = 0.1
    assert b.choose() and b.probing  # no gain measured yet
    b.gains.append(0.3)  # 1.3 tokens per step against 1.03 x 1.2 = 1.236: drafting pays
    assert b.choose() and not b.probing
    b.gains[0] = 0.2  # 1.2 < 1.236: plain, held (a probe costs 0.2 plain steps: / 2% = 10 < HOLD)
    assert not b.choose()
    H = DraftBudget.HOLD
    assert [b.choose() for _ in range(H)] == [False] * (H - 1) + [True]  # the probe
    assert b.probing
    assert not b.choose() and b.hold == 2 * H  # the probe still says plain: twice as long
    for _ in range(2 * H):
        b.choose()
    b.gains[0] = 0.3
    assert b.choose() and b.next_hold == H  # drafting pays again: the hold starts over
    # a dear probe (rho 4 + delta 1.5 - 1 = 4.5 plain steps) waits 4.5 / PROBE_SHARE steps
    dear = DraftBudget(4, prior=4.0)
    dear.delta = 1.5
    dear.gains.append(3.0)  # 4 tokens per step against 1.03 x 5.5: plain
    assert not dear.choose() and dear.hold == math.ceil(4.5 / DraftBudget.PROBE_SHARE)
    # delta from a drafted step: the draft took d = 0.05 s, the verify v_T = 0.1 s at rho 2
    b2 = DraftBudget(4, prior=2.0)
    b2._draft_s = 0.05
    b2.record(4, 64, 0.1)
    assert b2.delta == pytest.approx(1.0)
    b2.record(4, 64, 0.1)  # no draft time (a switch's catch-up): not a sample
    assert b2.delta == pytest.approx(1.0)
    # observed ratios (a plain step's time at the window, then the tree's) move rho
    for _ in range(12):
        b2.record(0, 64, 0.05)
        b2.record(4, 64, 0.05 * 3.0)
    assert 2.0 < b2.rho() < 3.0
    assert DraftBudget(4).prior == pytest.approx(forward_cost("cpu", 5))


def test_draft_budget_prior_grows_with_the_batch(model, tok, drafts):
    """SpecInfer(budget="auto").setup prices the tree for the whole batch: the verify block
    of B x (1 + T) rows against B rows, so a fuller batch pays more for the same tree."""
    from lookahead_jax.strategies.specinfer import DraftBudget

    engine = engine_for(model)
    strat = SpecInfer(draft_model=drafts["close"], budget="auto")
    drafter = strat.drafter(engine)
    priors = []
    for B in (1, 8):  # the budget of Slots of B rows, set up at their first insert
        slots = Slots(engine, tok, B, CACHE, strat, drafter=drafter)
        slots.insert(list(range(B)), [_request(x, 4) for x in encode_prompts(tok, (TEXTS * 2)[:B], chat=False)])
        assert isinstance(slots.budget, DraftBudget)
        priors.append(slots.budget.prior)
        slots.close()
    assert 1 < priors[0] < priors[1]


@pytest.mark.parametrize("sampler", ["greedy", "invariant"])
def test_auto_budget_switching_keeps_tokens(model, tok, greedy, drafts, monkeypatch, sampler):
    """Steps that draft and steps that do not, alternated in runs of 1-5 (the draft cache
    then catches up on up to 5 tokens it missed, more than a step's catch-up: its prefill
    path), give plain decoding's tokens: greedy (batch 4, EOS mid-batch) and the
    drafter-invariant sampler (plain sampling's tokens for the seed)."""
    from lookahead_jax.strategies.specinfer import DraftBudget

    pattern = [True, False, True, True, False, False, False, False, False, True, False, False]
    calls = []
    monkeypatch.setattr(DraftBudget, "choose", lambda self: calls.append(1) or pattern[len(calls) % len(pattern)])
    kw = dict(max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    if sampler == "invariant":
        kw.update(temperature=0.8, top_k=20, seed=7)
    t = ByteTokenizer()
    t.eos_token_ids = {greedy[1][10]}
    ref = generate(model, t, TEXTS[:4], **kw)
    out = generate(model, t, TEXTS[:4], strategy="specinfer", draft_model=drafts["close"], expansion=(1, 1, 2, 1),
                   budget="auto", **(dict(sampler="invariant") if sampler == "invariant" else {}), **kw)
    assert out.token_ids == ref.token_ids
    assert [r.finish_reason for r in out.rows] == [r.finish_reason for r in ref.rows]
    st = out.stats["draft_budget"]
    assert st["drafted_steps"] > 3 and st["plain_steps"] > 3 and len(calls) == st["drafted_steps"] + st["plain_steps"]
    assert sum(r.forward_steps for r in out.rows) < sum(r.forward_steps for r in ref.rows)  # drafts accepted


def test_auto_budget_end_to_end_is_greedy(model, tok, greedy, drafts):
    """budget="auto", unpatched, with the target as its own draft (a draft step costs ~4
    plain steps here): greedy's tokens, and the choice is in the stats."""
    ids, _ = run(model, tok, 4, strategy=SpecInfer(draft_model=drafts["same"], draft_weights="float32",
                                                   budget="auto"))
    assert ids == greedy
    out = generate(model, tok, TEXTS[:4], strategy="specinfer", draft_model=drafts["same"], max_new_tokens=MAX_NEW,
                   max_cache_len=CACHE, budget="auto")
    st = out.stats["draft_budget"]
    assert st["drafted_steps"] >= 1 and st["drafted_steps"] + st["plain_steps"] == out.stats["forward_steps"] - 1
    # the first forward step is the prefill; under overlap decode.step defers `score`, and the
    # gains are still read once the state holds each step's tokens (measures cleared: the
    # run probes, so it drafts, instead of starting from the measures of the calls above)
    engine_for(model).stores.of(DraftStore).budgets.clear()
    lapped = generate(model, tok, TEXTS[:4], strategy="specinfer", draft_model=drafts["same"],
                      max_new_tokens=MAX_NEW, max_cache_len=CACHE, budget="auto", overlap=True)
    assert lapped.token_ids == greedy[:4]
    assert lapped.stats["draft_budget"]["drafted_steps"] >= 1
    assert lapped.stats["draft_budget"]["mean_tokens_per_drafted_step"] > 1


def test_model_drafter_rollback(model, tok, greedy, drafts):
    """Decode, roll rows back (a plug-in's `decode.rollback`: the draft cache too), decode
    on: still plain greedy (4 slots, a fixed budget)."""
    engine = engine_for(model)
    drafter = ModelDrafter(engine_for(drafts["close"]), (1, 1, 2, 1))
    run = EditRun()
    slots = Slots(engine, tok, 4, CACHE, SpecInfer(draft_model=drafts["close"], expansion=(1, 1, 2, 1),
                                                    budget="fixed"), drafter=drafter, run=run)
    slots.insert(list(range(4)), [_request(x, MAX_NEW) for x in encode_prompts(tok, TEXTS[:4], chat=False)])
    while slots.state.steps < 4:
        slots.step()

    def back(engine, state, drafter, *_):
        for b in range(4):
            rollback(state, [b], int(state.lengths[b]) - 3, drafter)

    run.edits.append(back)
    while slots.busy:
        slots.step()
    assert not run.edits  # the rollback ran
    assert [slots.free(b).ids for b in range(4)] == greedy[:4]
    slots.close()


def test_merge_shares_prefixes():
    merged, maps = merge([Draft([5, 7, 9], [-1, 0, 1]), Draft([5, 7, 4, 8], [-1, 0, 1, -1])])
    assert (merged.tokens, merged.parents) == ([5, 7, 9, 4, 8], [-1, 0, 1, 1, -1])
    assert maps == [[0, 1, 2], [0, 1, 3, 4]]


@pytest.mark.parametrize("draft,batch", [("close", 4), ("random", 1)])
def test_draft_model_merged_with_the_trie_equals_greedy(model, tok, greedy, drafts, draft, batch):
    """A draft model's tree + lookahead's trie nodes, merged: still plain greedy; with a
    useless draft model the trie still drafts (fewer forwards than tokens)."""
    ids, steps = run(model, tok, batch, strategy=SpecInfer(draft_model=drafts[draft], expansion=(1, 1, 2, 1),
                                                           lookahead_nodes=8, budget="fixed"))
    assert ids == greedy
    if draft == "random":
        assert steps < sum(len(x) for x in ids) * 0.95


# ----------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("temperature,top_k,top_p", [pytest.param(1.0, 0, 1.0, marks=pytest.mark.slow),
                                                     (0.7, 20, 0.9)])
def test_invariant_sampling_equals_plain_sampling(model, tok, drafts, temperature, top_k, top_p):
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234, max_new_tokens=MAX_NEW,
              max_cache_len=CACHE)
    ref = generate(model, tok, TEXTS[:4], **kw).token_ids
    for d in ("same", "random"):
        out = generate(model, tok, TEXTS[:4], strategy="specinfer", draft_model=drafts[d], sampler="invariant",
                       budget="fixed", **kw)  # every step drafts
        ids, steps = out.token_ids, sum(r.forward_steps for r in out.rows)
        assert ids == ref
        if d == "same":  # the target's own noise: its first child is the target's sample
            assert steps < sum(len(x) for x in ids) / 1.8


# The rule on synthetic trees: root children drawn from Q0, their children from Q1[x];
# the target is P0 at the root and P1[x] after token x. The first two emitted tokens must
# be distributed as P0(t1) P1(t1, t2) (after the filters). Every sample has its own seed.
V = 5


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _draw(q, k, rng, how):
    if how == "without":  # Gumbel-top-k: k draws without replacement, in draw order
        return np.argsort(-(np.log(q) + rng.gumbel(size=q.shape)), axis=-1)[..., :k]
    if how == "with":
        cum = q.cumsum(-1)
        return (rng.random(q.shape[:-1] + (k,))[..., None] > cum[..., None, :]).sum(-1)
    return np.broadcast_to(np.argsort(-q, axis=-1)[..., :k], q.shape[:-1] + (k,))  # top-k


def _rule_samples(rule, P0, P1, Q0, Q1, n, w1, w2, how, seed):
    rng = np.random.default_rng(seed)
    c = _draw(np.broadcast_to(Q0, (n, V)), w1, rng, how)  # [n,w1]
    g = _draw(Q1[c], w2, rng, how).reshape(n, -1)  # [n,w1*w2]
    par = [-1] * w1 + [i for i in range(w1) for _ in range(w2)]
    blk = tree_lib.with_root(tree_lib.pack([Draft([0] * len(par), par)], len(par)), np.zeros(1, np.int32))
    T1 = 1 + len(par)
    tokens = np.concatenate([np.zeros((n, 1), np.int64), c, g], 1).astype(np.int32)
    parent, depth = np.broadcast_to(blk.parents, (n, T1)), np.broadcast_to(blk.depth, (n, T1))
    logits = np.zeros((n, T1, V), np.float32)
    q = np.zeros((n, T1, V), np.float32)
    logits[:, 0], q[:, 0] = np.log(P0), Q0
    logits[:, 1:1 + w1], q[:, 1:1 + w1] = np.log(P1[c]), Q1[c]
    best, bonus = jax.jit(rule)(logits, tokens, parent, depth, np.broadcast_to(blk.mask, (n, T1, T1)),
                                depth, np.arange(n, dtype=np.uint32), np.zeros(n, np.int32), q)
    best, bonus = np.asarray(best), np.asarray(bonus)
    r = np.arange(n)
    d = depth[r, best]
    t1 = np.where(d == 0, bonus, np.where(d == 1, tokens[r, best], tokens[r, np.maximum(parent[r, best], 0)]))
    return t1, np.where(d == 1, bonus, tokens[r, best]), d  # t2 only where d >= 1


def _pvalue(t1, t2, P0, P1):
    obs = np.bincount(t1 * V + t2, minlength=V * V).astype(np.float64)
    return _chi2(obs, (P0[:, None] * P1).reshape(-1))


def _chi2(counts, probs):
    """Chi-square p-value of counts against probabilities (cells expecting <= 5 dropped)."""
    probs = np.asarray(probs, np.float64)
    keep = probs * counts.sum() > 5
    obs = counts[keep]
    return chisquare(obs, probs[keep] / probs[keep].sum() * obs.sum()).pvalue


def _target(sp, logits):
    return np.asarray(jax.nn.softmax(filter_logits(jnp.asarray(logits), sp), axis=-1))


def _check_rule(rule, sp, draft, how="without", w1=3, w2=2, n=100_000, seed=1):
    """p-value of the chi-square test of the rule's first two tokens against the target."""
    rng = np.random.default_rng(7)
    L0, L1 = rng.normal(size=V) * 1.5, rng.normal(size=(V, V)) * 1.5
    P0, P1 = _softmax(L0), _softmax(L1)
    Q0, Q1 = (P0, P1) if draft == "same" else (_softmax(-L0), _softmax(-L1))  # far from p
    t1, t2, d = _rule_samples(rule, P0, P1, Q0, Q1, n, w1, w2, how, seed)
    T0, T1 = _target(sp, L0), _target(sp, L1)  # the filtered target
    # where only the bonus was emitted, the next token is plain sampling from the target
    fresh = (np.random.default_rng(seed + 1).random(n)[:, None] > T1[t1].cumsum(-1)).sum(-1)
    t2 = np.where(d == 0, fresh, t2)
    return _pvalue(t1, t2, T0, T1), d, P0, Q0


@pytest.mark.parametrize("temperature,top_k,top_p,draft", [
    (1.0, 0, 1.0, "bad"), (0.6, 0, 1.0, "bad"), (1.0, 3, 1.0, "bad"), (1.3, 0, 0.7, "bad"),
    (1.0, 0, 1.0, "same"), (0.7, 3, 0.9, "same")])
def test_spec_sampling_is_exact(temperature, top_k, top_p, draft):
    sp = SamplingParams(temperature, top_k, top_p)
    p, d, _, _ = _check_rule(SpecSampling(sp), sp, draft)
    assert p > 1e-3, p
    if draft == "same" and (temperature, top_k, top_p) == (1.0, 0, 1.0):
        assert (d == 2).mean() > 0.99  # q = p: every first child is accepted


@pytest.mark.parametrize("shape", [(1, 1), (5, 2)])
def test_spec_sampling_is_exact_for_other_trees(shape):
    sp = SamplingParams(1.0)
    assert _check_rule(SpecSampling(sp), sp, "bad", w1=shape[0], w2=shape[1])[0] > 1e-3


def test_deterministic_drafts_are_the_one_hot_case():
    """Children proposed without draft probabilities (an n-gram trie: q = one-hot) under
    sampling: the same rule with all-zero draft rows, still exact."""
    sp = SamplingParams(1.0)

    @dataclasses.dataclass(frozen=True)
    class NoProbs(SpecSampling):
        def __call__(self, *args):
            return SpecSampling.__call__(self, *args[:-1], None)

    p, d, P0, Q0 = _check_rule(NoProbs(sp), sp, "bad", how="topk")
    assert p > 1e-3, p
    # a deterministic child x is accepted with probability p(x): a first token from the
    # tree exactly as often as the target puts mass on the 3 children
    assert abs((d > 0).mean() - P0[np.argsort(-Q0)[:3]].sum()) < 0.01


def test_draws_with_replacement_waste_duplicates_but_stay_exact():
    """A duplicate sibling x has q(x) = 0 once x was rejected, and p(x) = 0 too: it is
    never accepted, so draws with replacement only waste nodes."""
    sp = SamplingParams(1.0)
    assert _check_rule(SpecSampling(sp), sp, "bad", how="with")[0] > 1e-3


@dataclasses.dataclass(frozen=True)
class NoResidual(SpecSampling):  # broken: after a rejection the target stays p
    @staticmethod
    def residual(p, q):
        return p


@dataclasses.dataclass(frozen=True)
class NoRenormalize(SpecSampling):  # broken: siblings are tried against the full q
    @staticmethod
    def without(q, x):
        return q


@pytest.mark.parametrize("rule,how", [(NoResidual, "without"), (NoRenormalize, "without"),
                                      (SpecSampling, "topk")])
def test_the_check_catches_broken_rules(rule, how):
    """The same check fails for a rule without the residual, for q not renormalized after
    a rejection, and for deterministic top-k children presented as draws from q."""
    sp = SamplingParams(1.0)
    assert _check_rule(rule(sp), sp, "bad", how=how)[0] < 1e-6


# ----------------------------------------------------------------------------- end to end
SMALL_V = 8


@pytest.fixture(scope="module")
def small():
    """A tiny target and a bad draft with an 8-token vocabulary (ids 3..7 are bytes)."""
    dims = dict(vocab_size=SMALL_V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, head_scale=1.0)
    return tiny_model("llama", seed=3, **dims), tiny_model("llama", seed=4, **dims)


def _exact_two_tokens(model, prompt, sp):
    """P(t1, t2 | prompt) of plain sampling with `sp`, from full forwards."""
    seqs = np.array([prompt + [a] for a in range(SMALL_V)], np.int32)  # [V, P+1]
    n = seqs.shape[1]
    cache = init_cache(model.config, SMALL_V, 16)
    pos = np.broadcast_to(np.arange(n, dtype=np.int32), seqs.shape)
    mask = np.broadcast_to(np.tril(np.ones((n, 16), bool)), (SMALL_V, n, 16))
    logits, _ = forward(model.params, seqs, pos, cache, mask, model.config)
    p = np.asarray(jax.nn.softmax(filter_logits(logits, sp), axis=-1), np.float64)
    return p[0, -2][:, None] * p[:, -1]  # [t1, t2]


@pytest.mark.slow  # CI's full run (the default run keeps the rule's statistical tests above)
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9)])
def test_specinfer_sampling_distribution_end_to_end(small, temperature, top_k, top_p):
    """1e5 continuations through generate (ModelDrafter + SpecSampling on the verify step):
    the first two tokens follow plain sampling's exact distribution."""
    target, draft = small
    tok = ByteTokenizer()
    prompt = [1, 5, 3]
    sp = SamplingParams(temperature, top_k, top_p)
    exact = _exact_two_tokens(target, prompt, sp)
    rows, n = 20_000, 100_000
    counts = np.zeros(SMALL_V * SMALL_V)
    accepted = []
    for first in range(0, n, rows):
        out = generate(target, tok, [prompt] * rows, max_new_tokens=2, strategy="specinfer",
                         draft_model=draft, expansion=(2, 2), budget="fixed", temperature=temperature, top_k=top_k,
                         top_p=top_p, seed=11, first_index=first, ignore_eos=True, max_cache_len=16)
        ids = np.array(out.token_ids)
        counts += np.bincount(ids[:, 0] * SMALL_V + ids[:, 1], minlength=SMALL_V ** 2)
        accepted.append(out.stats["forward_steps"])
    p = _chi2(counts, exact.reshape(-1))
    assert p > 1e-3, p


# ----------------------------------------------------------------------------- errors
def test_specinfer_errors(model, tok, tmp_path):
    with pytest.raises(ValueError, match="needs a draft model"):
        generate(model, tok, "hi", strategy="specinfer")
    other = tiny_model("llama", seed=2, vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300"):
        generate(model, tok, "hi", strategy="specinfer", draft_model=other)
    with pytest.raises(ValueError, match="expansion widths"):
        generate(model, tok, "hi", strategy="specinfer", draft_model=model, expansion=(1, 99))
    with pytest.raises(ValueError, match="merges trees"):
        generate(model, tok, "hi", strategy="specinfer", draft_model=model, lookahead_nodes=4, temperature=1.0)
    with pytest.raises(ValueError, match="lookahead_nodes must be"):
        generate(model, tok, "hi", strategy="specinfer", draft_model=model, lookahead_nodes=200)
    with pytest.raises(ValueError, match="cannot load draft model"):
        generate(model, tok, "hi", strategy="specinfer", draft_model=str(tmp_path / "missing"))
