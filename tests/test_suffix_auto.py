"""Lookahead(drafts="suffix") as the engine runs it: lossless (greedy and sampling, batch
4, EOS mid-batch, a warm cache of earlier outputs) with decoding_length="auto", whose
trees are sized from the nodes' calibrated path probabilities and the verify costs
(core/budget.py); costs that make every tree a loss give plain decoding."""

from __future__ import annotations

import pytest

from lookahead_jax.core import budget as budget_lib
from lookahead_jax.core.budget import AcceptanceStats
from lookahead_jax.drafters.suffix import SuffixCache, SuffixDrafter
from lookahead_jax.generate import generate
from lookahead_jax.strategies import Lookahead
from lookahead_jax.strategies import lookahead as lookahead_strategy
from lookahead_jax.strategies.lookahead import SUFFIX_SETTINGS
from tiny import ByteTokenizer, load_prompts, pin_verify_costs, tiny_model

MAX_NEW = 32
CACHE = 1280
TEXTS = [p["prompt"] for p in load_prompts(4)]  # 12 prompts from RAG / code / math
REFS = [[t] for t in TEXTS]
SETTINGS = {"strategy default": dict(SUFFIX_SETTINGS),
            "alpha 4, offset 4": dict(alpha=4.0, offset=4.0, buckets=SUFFIX_SETTINGS["buckets"])}


def run(model, tok, batch=4, texts=TEXTS, refs=REFS, **kw):
    """Generate `texts` in batches of `batch`: (token ids, forward steps, tree sizes)."""
    ids, steps, trees = [], 0, []
    for s in range(0, len(texts), batch):
        out = generate(model, tok, texts[s:s + batch], max_new_tokens=MAX_NEW, max_cache_len=CACHE,
                       references=refs[s:s + batch] if refs else None, **kw)
        ids += out.token_ids
        steps += out.stats["forward_steps"]
        trees.append(out.stats["mean_tree_size"])
    return ids, steps, trees


@pytest.fixture(scope="module")
def plain(model, tok):
    """Greedy's (token ids, forward steps)."""
    return run(model, tok, refs=None)[:2]


@pytest.fixture(scope="module")
def greedy(plain):
    return plain[0]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_auto_is_lossless_with_a_warm_cache(model, tok, plain, greedy, setting):
    """One drafter for every call (its cache of earlier outputs and its acceptance
    statistics warm on the second pass, as a process serves requests): greedy's tokens,
    and the auto budget does draft."""
    drafter = SuffixDrafter(**SETTINGS[setting], cache=SuffixCache(), acceptance=AcceptanceStats())
    for _ in range(2):  # the second pass drafts from the first pass's outputs as well
        ids, steps, trees = run(model, tok, strategy=Lookahead(drafts="suffix"), drafter=drafter)
        assert ids == greedy
    assert max(trees) > 0 and steps < plain[1]
    assert any(drafter.acceptance.calibration(k) for k in drafter.acceptance.samples)


def test_strategy_auto_batch1_is_lossless(model, tok, greedy):
    """Through the strategy alone (the engine's shared cache and statistics), batch 1."""
    ids, _, _ = run(model, tok, batch=1, texts=TEXTS[:4], refs=REFS[:4], strategy=Lookahead(drafts="suffix"))
    assert ids == greedy[:4]


def test_eos_mid_batch(model, greedy):
    """Rows end at an EOS token at different steps; the suffix drafter ends them alike."""
    eos = greedy[1][10]  # a token row 1 emits at step 10
    tok = ByteTokenizer()
    tok.eos_token_ids = {eos}
    ref = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    assert ref.rows[1].finish_reason == "eos" and len({len(r.token_ids) for r in ref.rows}) > 1
    for dl in ("auto", 7):
        out = generate(model, tok, TEXTS[:4], max_new_tokens=MAX_NEW, max_cache_len=CACHE, references=REFS[:4],
                       strategy=Lookahead(decoding_length=dl, drafts="suffix"))
        assert out.token_ids == ref.token_ids
        assert [r.finish_reason for r in out.rows] == [r.finish_reason for r in ref.rows]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_sampling_equals_plain_sampling(model, tok, temperature, top_k, top_p):
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    ref, _, _ = run(model, tok, texts=TEXTS[:8], refs=None, **kw)
    ids, _, _ = run(model, tok, texts=TEXTS[:8], refs=REFS[:8], strategy=Lookahead(drafts="suffix"), **kw)
    assert ids == ref


def test_auto_prices_trees_with_the_verify_costs(model, tok, plain, monkeypatch):
    """Trees that cost 50 plain steps never pay: auto drafts nothing (plain decoding);
    free trees always pay: it drafts. Tokens are greedy's either way."""
    pin_verify_costs(monkeypatch, lambda T: 1.0 if T == 0 else 50.0)
    drafter = SuffixDrafter(**SUFFIX_SETTINGS, acceptance=AcceptanceStats())
    ids, steps, trees = run(model, tok, strategy=Lookahead(drafts="suffix"), drafter=drafter)
    assert ids == plain[0] and max(trees) == 0 and steps == plain[1]
    # the drafts were still proposed and scored
    assert any(drafter.acceptance.calibration(k) for k in drafter.acceptance.samples)
    pin_verify_costs(monkeypatch, lambda T: 1.0)
    ids, steps, trees = run(model, tok, strategy=Lookahead(drafts="suffix"),
                            drafter=SuffixDrafter(**SUFFIX_SETTINGS))
    assert ids == plain[0] and max(trees) > 0 and steps < plain[1]


def test_a_fuller_batch_drafts_less():
    """One row's draft alone and beside 7 rows without drafts, on the CPU's prior costs:
    the block of 8 rows pays more per tree node, so auto picks a smaller tree (or none)."""
    d = SuffixDrafter(**SUFFIX_SETTINGS, acceptance=AcceptanceStats())
    key, probs = ("suffix", 4), (1.0, 1.0, 1.0, 0.2, 0.2, 0.2, 0.2)
    for _ in range(20):  # a class whose drafts are accepted as predicted
        d.acceptance.observe([5, 6, 7], [-1, 0, 1], [5, 6, 7, 8], key, (1.0, 1.0, 1.0))
    buckets = (0, 1, 3, 7, 15)
    picks = {B: budget_lib.AutoBudget(buckets, budget_lib.prior_costs("cpu", buckets, batch=B), d.acceptance)
             .choose([key], rows=B, accept_probs=[probs]) for B in (1, 8)}
    assert picks[1] >= 3 and picks[8] < picks[1]


def test_a_fixed_decoding_length_is_the_suffix_drafters_cap(model):
    """decoding_length=N above the drafter's usual 32 nodes: its trees may have N nodes
    (not silently 32); under auto, 32 (trees of at most 31, a bucket)."""
    from lookahead_jax.core.engine import engine_for

    eng = engine_for(model)
    assert Lookahead(decoding_length=63).drafter(eng).max_nodes == 63
    assert Lookahead(decoding_length=7).drafter(eng).max_nodes == 32
    assert Lookahead().drafter(eng).max_nodes == 32


def test_thinned_proposals_are_lossless_and_resume(model, tok, monkeypatch):
    """A full block (>= THIN_ROWS rows) where no tree pays: after a few plain choices the
    drafter is asked only on probe steps (`AutoBudget.propose_nodes`), and the tokens are
    greedy's; with free trees at the same occupancy, nothing is skipped and it drafts."""
    rows = budget_lib.THIN_ROWS
    texts = (TEXTS * 2)[:rows]
    ref = generate(model, tok, texts, max_new_tokens=MAX_NEW, max_cache_len=CACHE)
    pin_verify_costs(monkeypatch, lambda T: 1.0 if T == 0 else 50.0)
    out = generate(model, tok, texts, max_new_tokens=MAX_NEW, max_cache_len=CACHE, references=[[t] for t in texts],
                   strategy=Lookahead(drafts="suffix"), drafter=SuffixDrafter(**SUFFIX_SETTINGS))
    assert out.token_ids == ref.token_ids
    assert out.stats["mean_tree_size"] == 0 and out.stats["proposals_skipped"] > MAX_NEW // 2
    pin_verify_costs(monkeypatch, lambda T: 1.0)
    out = generate(model, tok, texts, max_new_tokens=MAX_NEW, max_cache_len=CACHE, references=[[t] for t in texts],
                   strategy=Lookahead(drafts="suffix"), drafter=SuffixDrafter(**SUFFIX_SETTINGS))
    assert out.token_ids == ref.token_ids
    assert out.stats["mean_tree_size"] > 0 and out.stats["proposals_skipped"] == 0
