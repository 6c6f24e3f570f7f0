"""`generate(prefix_cache=)`: prompts prefilled in blocks through the engine's prefix cache
(`core.prefix_cache`), as the server's slots do.

* Lossless: a batch of prompts sharing a header, one that does not, and one shorter than a
  block, greedy, lookahead, sampled (seed, n=2) and SpecInfer (target and draft): token for token
  generate without the cache (whole prompts), in a first call (hits within the batch) and
  a second (the header cached); gemma3 (sliding windows narrower than a block) and qwen2
  too; a cache too small for a block (blocks, none kept).
* Within one call the header is forwarded once: the later rows wait for its blocks and
  take them (hit blocks = header units x the other rows; stored = the header's units).
* Across calls: a second call with the same header and other questions hits for every row
  and stores nothing new; the counters are the call's.
* Bad values: a clear ValueError (the retrieval strategies with it: tests/test_prefix_cache_ralm.py).
* The CLI's --prefix-cache-mb: the same tokens, the header hit across batches, its
  counters in the summary; bad values rejected before the model loads.
"""

from __future__ import annotations

import json

import pytest

import lookahead_jax.loading as loading
from lookahead_jax.cli import main

from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.prefix_cache import PrefixCache
from lookahead_jax.generate import PREFIX_CHUNK, generate
from lookahead_jax.strategies import SpecInfer
from tiny import ByteTokenizer, load_prompts, tiny_model

U = PREFIX_CHUNK - 1  # a cached unit
BUDGET = 64 << 20
CACHE = 512  # one cache length for every call (hits across calls need the same)
HEADER = load_prompts()[0]["prompt"][:200]  # 201 tokens with BOS: 3 whole units and 12 tokens
QUESTIONS = [" Question: who wrote it?", " Question: what is it about?", " Q: when?", " Question: where?",
             " Question: why so?", " Q: how many?"]
SHORT = "Short prompt"  # 13 tokens: less than a block
OTHER = load_prompts()[-1]["prompt"][:90]  # shares nothing with the header


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def fresh(model) -> None:
    engine_for(model).stores.clear(PrefixCache)


KINDS = {
    "greedy": dict(),
    "lookahead": dict(strategy="lookahead", decoding_length=7),
    "sampling": dict(temperature=0.8, top_p=0.95, seed=3, n=2),
}


def gen(model, tok, prompts, kind, cache=None, **kw):
    opts = dict(KINDS[kind]) if isinstance(kind, str) else dict(kind)
    return generate(model, tok, prompts, max_new_tokens=14, max_cache_len=CACHE, prefix_cache=cache, **opts, **kw)


@pytest.mark.parametrize("kind", list(KINDS))
def test_tokens_equal_those_without_the_cache(model, tok, kind):
    prompts = [HEADER + q for q in QUESTIONS[:3]] + [OTHER, SHORT]
    want = gen(model, tok, prompts, kind).token_ids
    fresh(model)
    first = gen(model, tok, prompts, kind, BUDGET)
    second = gen(model, tok, prompts, kind, BUDGET)
    assert first.token_ids == want and second.token_ids == want
    n = KINDS[kind].get("n", 1)
    rows = 3 * n  # rows with the header (each prompt's n samples are rows of their own)
    assert first.stats["prefix_cache_hit_blocks"] == 3 * (rows - 1) + (n - 1) * (len(OTHER) + 1 - 2) // U
    assert second.stats["prefix_cache_hit_blocks"] == 3 * rows + n * (len(OTHER) + 1 - 2) // U
    assert second.stats["prefix_cache_stored"] == 0 and second.stats["prefix_cache_lookups"] == len(prompts) * n


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_other_families(tok, family):
    """gemma3 (sliding-window layers narrower than a block, qk-norm) and qwen2 (qkv bias):
    the same tokens, in a first call and a second that takes the header."""
    m = tiny_model(family)
    prompts = [HEADER + q for q in QUESTIONS[:2]]
    want = gen(m, tok, prompts, "greedy").token_ids
    first = gen(m, tok, prompts, "greedy", BUDGET)
    second = gen(m, tok, prompts, "greedy", BUDGET)
    assert first.token_ids == want and second.token_ids == want
    assert first.stats["prefix_cache_hit_blocks"] == 3 and second.stats["prefix_cache_hit_blocks"] == 6


def test_specinfer_target(model, tok):
    prompts = [HEADER + q for q in QUESTIONS[:2]] + [SHORT]
    kind = dict(strategy=SpecInfer(draft_model=tiny_model("llama", seed=7), expansion=(1, 1, 2), budget="fixed"))
    want = gen(model, tok, prompts, kind).token_ids
    fresh(model)
    out = gen(model, tok, prompts, kind, BUDGET)
    assert out.token_ids == want and out.stats["prefix_cache_hit_blocks"] == 3
    assert out.stats["draft_prefix_cache_hit_blocks"] > 0  # the draft's units too (its engine's totals)


def test_header_forwarded_once_then_hit_across_calls(model, tok):
    """One call of 3 questions stores the header's 3 units and forwards them once (the
    other two rows take them: 6 hit blocks, 3 fewer prefill steps than without the cache
    would need at most); a second call of 3 other questions takes them for every row."""
    fresh(model)
    a = [HEADER + q for q in QUESTIONS[:3]]
    b = [HEADER + q for q in QUESTIONS[3:]]
    first = gen(model, tok, a, "greedy", BUDGET)
    s = first.stats
    assert s["prefix_cache_stored"] == 3 and s["prefix_cache_hit_blocks"] == 6 and s["prefix_cache_hits"] == 6 * U
    assert s["prefix_cache_lookups"] == 3 and s["prefix_cache_queries"] == s["prompt_tokens"]
    assert s["prefix_cache_hit_requests"] == 2 and s["prefix_cache_blocks"] == 3
    second = gen(model, tok, b, "greedy", BUDGET)
    s = second.stats
    assert s["prefix_cache_stored"] == 0 and s["prefix_cache_hit_blocks"] == 9 and s["prefix_cache_hit_requests"] == 3
    assert s["prefill_steps"] == 1  # every row's last block, in one round
    assert second.token_ids == gen(model, tok, b, "greedy").token_ids
    assert first.rows[0].prefill_steps == 4 and first.rows[1].prefill_steps == 1  # 3 header blocks + its last


def test_short_prompts_only(model, tok):
    fresh(model)
    prompts = [SHORT, SHORT + "!", "a b"]
    out = gen(model, tok, prompts, "greedy", BUDGET)
    assert out.token_ids == gen(model, tok, prompts, "greedy").token_ids
    assert out.stats["prefix_cache_lookups"] == 3 and out.stats["prefix_cache_hits"] == 0
    assert out.stats["prefix_cache_stored"] == 0


def test_a_cache_too_small_for_a_block(model, tok):
    """1 byte: blocks prefilled, none kept (the bench's block-prefill baseline), same tokens."""
    fresh(model)
    prompts = [HEADER + q for q in QUESTIONS[:2]]
    out = gen(model, tok, prompts, "greedy", 1)
    assert out.token_ids == gen(model, tok, prompts, "greedy").token_ids
    assert out.stats["prefix_cache_stored"] == out.stats["prefix_cache_hits"] == 0


def test_off_and_bad_values(model, tok):
    out = gen(model, tok, [SHORT], "greedy", 0)
    assert not any(k.startswith("prefix_cache") for k in out.stats)
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match="prefix_cache"):
            gen(model, tok, [SHORT], "greedy", bad)


def cli(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_flag(model, tok, capsys, monkeypatch, tmp_path):
    """Two batches of two prompts with the header: the first batch's second row and both
    rows of the second take its 3 units (9 hit units), the tokens those without it."""
    loads = []
    monkeypatch.setattr(loading, "load", lambda name, dtype="float32", **kw: loads.append(name) or (model, tok))
    prompts = [HEADER + q for q in QUESTIONS[:4]]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    fresh(model)
    rc, out, err = cli(capsys, "--prompts-file", str(f), "--max-new-tokens", "8", "--json", "--batch-size", "2",
                       "--prefix-cache-mb", "64")
    assert rc == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    summary = lines[-1]["summary"]
    assert [x["token_ids"] for x in lines[:-1]] == generate(model, tok, prompts, max_new_tokens=8).token_ids
    assert summary["prefix_cache_hits"] == 9 * U and summary["prefix_cache_queries"] == sum(len(p) + 1 for p in prompts)
    for argv, msg in [(["--prefix-cache-mb", "-1"], "--prefix-cache-mb must be >= 0 (0: off), got -1.0")]:
        loads.clear()
        rc, out, err = cli(capsys, "--prompt", "hi", *argv)
        assert rc == 2 and msg in err and loads == []
    rc, out, err = cli(capsys, "--help")
    assert rc == 0 and "--prefix-cache-mb MB" in out and "(default 0: off" in out
