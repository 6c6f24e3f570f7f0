"""The prefix cache (`core.prefix_cache`, `Slots(prefix_cache=)`): prompt blocks a request
prefilled are kept on the engine and written into the rows of later prompts that begin
with the same tokens, which forward only the rest.

* Lossless: requests sharing a long passage (different questions, the same prompt twice),
  prompts at the block edges (an exact multiple of C, shorter than C, a last block of
  exactly C tokens or of 2), greedy, lookahead and sampled / penalized requests, 3 slots:
  token for token those without the cache, in a first pass (hits within the pass) and a
  second (every block cached).
* A second request with a cached passage forwards fewer blocks, as many fewer as the
  counters' hit blocks; the counters add up.
* Exactness by construction, checked: the cached blocks are bit for bit the K/V a fresh
  prefill writes, and so is the whole prompt of a request that took them.
* LRU order and the byte bound (host unit test), the bound under real requests.
* The block copy / write programs compile once, whatever the row and position; on a
  (data=2, model=4) mesh of 8 CPU devices the same holds, with the same tokens.
* Through the server: the second request with the same long prompt hits (/metrics) and
  returns the same text.
"""

from __future__ import annotations

import numpy as np
import pytest

from lookahead_jax.core.engine import Engine, engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.prefix_cache import PrefixCache, budget_bytes, chain_keys
from lookahead_jax.core.sampling import SamplingParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.strategies import Lookahead
from tiny import ByteTokenizer, drive_slots, load_prompts, tiny_model

C = 16
U = C - 1  # slots a non-last block commits: the cache's unit
CACHE = 512
BUDGET = 64 << 20
PROMPTS = [p["prompt"] for p in load_prompts()]
PASSAGE = PROMPTS[0][:150]  # 151 tokens with BOS: 9 full units
QUESTIONS = [" Question: who wrote it?", " Question: what is it about?", " Q: when"]
SP = SamplingParams(0.8, 0, 0.95)


def edge(n: int) -> str:
    return PROMPTS[5][:n - 1]  # BOS + n - 1 bytes: n tokens


# shared passage + 3 questions, the first again; prompts of 10 (< C), 31 (last block of C),
# 32 (last block of 2 tokens), 48 (3C) tokens, the last again
# (every RAG prompt begins with the same instruction: their first block is shared too)
OTHERS = [p["prompt"][:100] for p in load_prompts(2) if p["source"] != "nq_rag"]  # code, math
TEXTS = [PASSAGE + q for q in QUESTIONS] + [PASSAGE + QUESTIONS[0]] + [edge(n) for n in (10, 31, 32, 48)] + [edge(48)]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def fresh(engine) -> None:
    engine.stores.clear(PrefixCache)  # (the engine outlives the tests of this module)


def blocks(n_tokens: int) -> int:
    """Prefill blocks of a prompt of n_tokens without the cache."""
    return max(1, -(-(n_tokens - 1) // U))


def requests(tok, kind: str, texts=TEXTS) -> list:
    """`texts` as requests: greedy, or every third sampled (with a presence penalty) for
    kind "sampling"."""
    out = []
    for i, t in enumerate(texts):
        sampled = kind == "sampling" and i % 3 == 1
        p = GenerationParams(max_new_tokens=12 + (i % 4) * 5, seed=3, **(
            dict(temperature=0.8, top_p=0.95, presence_penalty=0.5) if sampled else {}))
        out.append(Request(tok.encode(t), p, sampling_row=i))
    return out


def run(model, tok, kind: str, budget, texts=TEXTS) -> tuple:
    strat = None if kind == "greedy" else Lookahead(decoding_length=7)
    slots = Slots(engine_for(model), tok, 3, CACHE, strat, prefill_chunk=C, prefix_cache=budget)
    out = drive_slots(slots, requests(tok, kind, texts), every=2)
    for row, events in out:
        assert events == row.ids
    return [row.ids for row, _ in out], slots


@pytest.mark.parametrize("kind", ["greedy", "lookahead", "sampling"])
def test_tokens_equal_those_without_the_cache(model, tok, kind):
    engine = engine_for(model)
    fresh(engine)
    want, _ = run(model, tok, kind, None)
    first, slots = run(model, tok, kind, BUDGET)  # hits within the pass (passage, repeated prompts)
    s1 = slots.prefix.cache.summary()
    second, slots = run(model, tok, kind, BUDGET)  # every block cached already
    s2 = slots.prefix.cache.summary()
    assert first == want and second == want
    assert s1["prefix_cache_hits"] > 0 and s2["prefix_cache_hits"] - s1["prefix_cache_hits"] > s1["prefix_cache_hits"]
    assert s2["prefix_cache_stored"] == s1["prefix_cache_stored"]  # nothing new to store the second time


def test_overlap_same_tokens(model, tok):
    """overlap=True (a step's bookkeeping deferred to the next): blocks are taken and
    written between steps after it, the tokens those without the cache."""
    engine = engine_for(model)
    fresh(engine)
    want, _ = run(model, tok, "lookahead", None)
    slots = Slots(engine, tok, 3, CACHE, Lookahead(decoding_length=7), prefill_chunk=C, prefix_cache=BUDGET,
                  overlap=True)
    out = drive_slots(slots, requests(tok, "lookahead"), every=2)
    assert [row.ids for row, _ in out] == want and slots.prefix.cache.summary()["prefix_cache_hits"] > 0


def test_a_cached_passage_forwards_fewer_blocks(model, tok):
    """One request with a passage, then another with the same passage and another
    question (one slot each, nothing decoding: every block at insert): the second forwards
    its blocks but those cached, and the counters say so."""
    engine = engine_for(model)
    fresh(engine)
    slots = Slots(engine, tok, 2, CACHE, prefill_chunk=C, prefix_cache=BUDGET)
    a, b = tok.encode(PASSAGE + QUESTIONS[0]), tok.encode(PASSAGE + QUESTIONS[1])
    slots.insert(0, Request(a, GenerationParams(max_new_tokens=4)))
    assert slots.row(0).steps == blocks(len(a))  # no hit: every block forwarded
    finish(slots)
    n_a = (len(a) - 2) // U  # units stored: its blocks but the last
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    hit = min(common // U, (len(b) - 2) // U)
    assert hit >= 8
    slots.insert(1, Request(b, GenerationParams(max_new_tokens=4)))  # (nothing decoding: every block now)
    assert slots.row(1).steps == blocks(len(b)) - hit  # only the rest forwarded
    s = slots.prefix.cache.summary()
    assert s["prefix_cache_lookups"] == 2 and s["prefix_cache_queries"] == len(a) + len(b)
    assert s["prefix_cache_hit_blocks"] == hit and s["prefix_cache_hits"] == hit * U
    assert s["prefix_cache_hit_requests"] == 1 and s["prefix_cache_evictions"] == 0
    assert s["prefix_cache_stored"] == s["prefix_cache_blocks"] == n_a + (len(b) - 2) // U - hit
    assert s["prefix_cache_bytes"] == s["prefix_cache_blocks"] * slots.prefix.nbytes
    finish(slots)


def finish(slots) -> None:
    while slots.busy:
        for ev in slots.step():
            if ev.finish:
                slots.free(ev.slot)


def _row_kv(slots, row: int, n: int) -> list:
    """Row `row`'s K and V of slots 0..n-1, every layer, as host arrays."""
    cache = slots.state.cache
    return [np.asarray(x[row, :, :n]) for x in cache.k + cache.v]


@pytest.mark.parametrize("chunk", [16, 32])  # 32: the blocks' windows change along the prompt (128, 512)
def test_cached_blocks_are_bit_exact(model, tok, chunk):
    """The K/V the cache holds for a prompt's blocks equal, bit for bit, a fresh prefill's
    (no cache); and a request that took them from the cache (another question after the
    same passage) holds, over its whole prompt, the K/V a fresh prefill of it writes."""
    engine = engine_for(model)
    fresh(engine)
    unit = chunk - 1
    a, b = tok.encode(PASSAGE + QUESTIONS[0]), tok.encode(PASSAGE + QUESTIONS[2])
    plain = Slots(engine, tok, 2, CACHE, prefill_chunk=chunk)
    plain.insert(0, Request(a, GenerationParams(max_new_tokens=1)))
    plain.insert(1, Request(b, GenerationParams(max_new_tokens=1)))
    want_a, want_b = _row_kv(plain, 0, len(a)), _row_kv(plain, 1, len(b))

    cached = Slots(engine, tok, 2, CACHE, prefill_chunk=chunk, prefix_cache=BUDGET)
    cached.insert(1, Request(a, GenerationParams(max_new_tokens=1)))  # stores its units (from row 1)
    store = cached.prefix.cache
    keys = chain_keys(a, unit, (len(a) - 2) // unit, cached.prefix.salt)
    assert len(keys) >= 5 and all(k in store for k in keys)
    for i, key in enumerate(keys):
        k, v = store._blocks[key][0]
        got = [np.asarray(x) for x in k + v]
        for layer, (g, w) in enumerate(zip(got, want_a)):
            assert g.tobytes() == w[:, i * unit:(i + 1) * unit].tobytes(), (i, layer)
    cached.insert(0, Request(b, GenerationParams(max_new_tokens=1)))  # takes a's passage blocks (into row 0)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert store.summary()["prefix_cache_hit_blocks"] == min(common // unit, (len(b) - 2) // unit) >= 4
    for layer, (g, w) in enumerate(zip(_row_kv(cached, 0, len(b)), want_b)):
        assert g.tobytes() == w.tobytes(), layer
    assert cached.row(0).ids == plain.row(1).ids


def test_lru_order_and_bound():
    """Host unit test: a hit makes a prompt's blocks the most recent; the least recently
    used go first; a chain's own blocks are never evicted to store its next; the bytes stay
    within the capacity."""
    cache = PrefixCache(4 * 10)
    salt = b"s"
    ka, kb, kc = (chain_keys(list(range(s, s + 6)), 3, 2, salt) for s in (0, 100, 200))
    for keys in (ka, kb):
        for i in range(2):
            assert cache.put(keys[:i + 1], f"block{i}", 10)
    assert cache.match(ka, 7, 3) == ["block0", "block1"]  # A used again: B is the least recent
    for i in range(2):
        cache.put(kc[:i + 1], "c", 10)
    assert all(k in cache for k in ka + kc) and not any(k in cache for k in kb)
    assert cache.bytes == 40 <= cache.capacity and cache.evictions == 2
    assert cache.match(kb, 7, 3) == [] and cache.summary()["prefix_cache_hits"] == 6
    small = PrefixCache(15)  # room for one block: a chain's second never evicts its first
    assert small.put(ka[:1], "a0", 10) and not small.put(ka[:2], "a1", 10)
    assert ka[0] in small and small.bytes == 10
    small.resize(5)
    assert len(small) == 0 and small.bytes == 0
    assert budget_bytes(None) == budget_bytes(0) == 0 and budget_bytes(7) == 7
    for bad in (-1, 1.5, "8", True):
        with pytest.raises(ValueError, match="prefix_cache must be a byte budget"):
            budget_bytes(bad)


def test_bytes_stay_within_the_bound(model, tok):
    """Real requests through slots whose cache holds 5 blocks (TEXTS, whose RAG prompts
    share their instruction header, then prompts of the other sources): it stays within its
    bytes, evicts, and the tokens are still those without the cache."""
    engine = engine_for(model)
    fresh(engine)
    probe = Slots(engine, tok, 3, CACHE, prefill_chunk=C, prefix_cache=BUDGET)
    budget = 5 * probe.prefix.nbytes + 1
    texts = TEXTS + OTHERS
    want, _ = run(model, tok, "greedy", None, texts)
    got, slots = run(model, tok, "greedy", budget, texts)
    s = slots.prefix.cache.summary()
    assert got == want
    assert s["prefix_cache_bytes"] <= budget and s["prefix_cache_blocks"] <= 5 and s["prefix_cache_evictions"] > 0


def test_block_programs_compile_once(model, tok):
    """On an engine of its own: blocks copied out of and written into every row at many
    positions run one program each ("kv_copy", "kv_write")."""
    engine = Engine(model)
    slots = Slots(engine, tok, 3, CACHE, Lookahead(decoding_length=7), prefill_chunk=C, prefix_cache=BUDGET)
    out = drive_slots(slots, requests(tok, "greedy"), every=1)
    s = slots.prefix.cache.summary()
    assert s["prefix_cache_stored"] >= 9 and s["prefix_cache_hit_blocks"] >= 9 and len(out) == len(TEXTS)
    names = [c.split("(")[0] for c in engine.compiled.compilations]
    assert names.count("kv_copy") == 1 and names.count("kv_write") == 1


MESH_CHILD = """
import json, os, sys
sys.path.insert(0, {tests!r})
from lookahead_jax.core import sharding as sh
from lookahead_jax.core.engine import Engine
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.strategies import Lookahead
from tiny import ByteTokenizer, load_prompts, tiny_model

model = tiny_model("llama", vocab_size=260, n_heads=8, n_kv_heads=4, head_dim=8)
eng, tok = Engine(model, sh.make_mesh(data=2, model=4)), ByteTokenizer()
passage = load_prompts()[0]["prompt"][:150]

def run(cache):
    s = Slots(eng, tok, 2, 512, Lookahead(decoding_length=7), prefill_chunk=16, prefix_cache=cache)
    out = []
    for i, q in enumerate([" Q: one", " Q: two", " Q: one"]):
        s.insert(i % 2, Request(tok.encode(passage + q), GenerationParams(max_new_tokens=8)))
        while s.busy:
            s.step()
        out.append(s.free(i % 2).ids)
    return out, s

want, _ = run(None)
got, s = run(64 << 20)
print("RESULT " + json.dumps(dict(same=got == want, hits=s.prefix.cache.summary()["prefix_cache_hit_blocks"],
      programs=[c.split("(")[0] for c in eng.compiled.compilations if c.startswith("kv_")])))
"""


def test_on_a_mesh():
    """On 8 CPU devices, a (data=2, model=4) mesh (a child process, as tests/test_sharding.py
    runs its mesh checks): requests sharing a passage hit, with the tokens they give without
    the cache, one copy and one write program."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    code = MESH_CHILD.format(tests=str(pathlib.Path(__file__).resolve().parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert res["same"] and res["hits"] >= 18 and res["programs"] == ["kv_copy", "kv_write"], res


def test_off_and_where_it_does_not_apply(model, tok):
    """None / 0: no cache; without prefill_chunk (whole prompts): none either."""
    engine = engine_for(model)
    assert Slots(engine, tok, 2, CACHE, prefill_chunk=C, prefix_cache=0).prefix is None
    assert Slots(engine, tok, 2, CACHE, prefill_chunk=C).prefix is None
    assert Slots(engine, tok, 2, CACHE, prefix_cache=BUDGET).prefix is None


def test_server_second_request_hits():
    """Through the server (tiny model, prefill_chunk 32, the default prefix cache): the same
    long prompt twice, one after the other: the second hits (/metrics) and returns the
    same text."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from lookahead_jax.serve import ServeConfig, make_server, start_in_thread

    cfg = ServeConfig(model="tiny", strategy="lookahead", max_batch=2, max_len=512, prefill_chunk=32,
                      warmup="none")
    srv = make_server(cfg, tiny_model("llama", seed=6), ByteTokenizer())
    uv, thread, url = start_in_thread(srv)
    prompt = PROMPTS[0][:200]

    def metric(name):
        text = httpx.get(url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"lookahead_jax:{name}"))

    try:
        texts = []
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json=dict(model="tiny", prompt=prompt, max_tokens=16,
                                                               temperature=0), timeout=300)
            assert r.status_code == 200
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1]
        n = metric("prompt_tokens_total") / 2
        assert metric("prefix_cache_queries_total") == 2 * n > 190
        assert metric("prefix_cache_hits_total") == 31 * ((n - 2) // 31)  # the second: all its blocks but the last
        assert metric("prefix_cache_bytes") > 0
    finally:
        uv.should_exit = True
        thread.join(60)
