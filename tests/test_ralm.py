"""RaLM and RaLMSpec (lookahead_jax/ralm.py) on the tiny llama + byte tokenizer.

RaLMSpec's tokens (and the passages it ends up using) equal RaLM's: strides 1/2/4 x
speculation strides 1/2/5 and OS3, greedy and sampling, batch 1 and > 1, rows ending
mid-batch (with unverified boundaries), BM25 and a dense retriever, speculation forced
always wrong, always right and stale (keeping the passage where it changes: rollbacks); in
every run RaLMSpec's re-prefills are RaLM's (a passage changes only on a verified answer;
OS3's s = 0 in a real run: test_every_speculation_wrong[auto]; OS3's cost model:
tests/test_os3.py). RaLM itself is checked
against its definition (one plain generate per stride) and against plain greedy on the
prompt with the passage written in (`decode.replace_prompt` against a fresh prefill:
tests/test_replace_prompt.py).
Small corpora made here from words the model writes, so the top-1 passage really changes."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from lookahead_jax.generate import generate
from lookahead_jax import retrieval as R
from lookahead_jax.core.engine import engine_for
from lookahead_jax.strategies import RaLM, RaLMSpec
from tiny import load_prompts, own_word_passages

MAX_NEW = 24
PROMPTS = [r["prompt"][:60] for r in load_prompts(3)]  # 9 prompts, 3 sources


@pytest.fixture(scope="module")
def corpus(model, tok) -> R.Corpus:
    """80 passages of 3-11 words: the model's own output words plus the prompts' words."""
    passages = own_word_passages(model, tok, PROMPTS, 80, 48)
    return R.Corpus.from_passages(passages)


@pytest.fixture(scope="module")
def bm25(corpus):
    pytest.importorskip("bm25s")
    pytest.importorskip("Stemmer")
    return R.BM25Retriever.build(corpus, progress=False)


def toy_encode(texts) -> np.ndarray:
    """Hashed character bigrams, L2-normalised [Q, 64]: every byte string gets a vector."""
    out = np.zeros((len(texts), 64), np.float32)
    for i, t in enumerate(texts):
        for a, b in zip(t, t[1:]):
            out[i, zlib.crc32((a + b).encode("utf-8", "surrogatepass")) % 64] += 1.0
        n = np.linalg.norm(out[i])
        if n:
            out[i] /= n
    return out


@pytest.fixture(scope="module")
def dense(corpus):
    return R.DenseRetriever(toy_encode(corpus.all_contents()), toy_encode, corpus=corpus)


class Forced:
    """A retriever whose `retrieve_from` (the speculation) is always wrong or always right:
    "wrong" answers a passage other than the full index's top-1; "right" answers the full
    index's top-1 even when it is not among the candidates; "stale" answers the full
    index's top-1 for the query without its last 6 characters, so it mostly keeps the
    passage in effect and is wrong where the passage changes (rollbacks); "outside" answers
    the first passage not among the candidates, so every lookup names another passage than
    the one in effect (which is always cached)."""

    def __init__(self, inner, mode: str):
        self.inner, self.mode, self.corpus = inner, mode, inner.corpus
        self.spec_calls = 0

    def retrieve(self, queries, k):
        return self.inner.retrieve(queries, k)

    def retrieve_from(self, queries, candidates, k):
        self.spec_calls += 1
        if self.mode == "stale":
            queries = [q[:max(1, len(q) - 6)] for q in queries]
        ids, scores = self.inner.retrieve(queries, k)
        if self.mode == "wrong":
            ids = (ids + 1) % len(self.corpus)
        if self.mode == "outside":
            ids = np.array([[min(set(range(len(self.corpus))) - {int(i) for i in c})] * k for c in candidates])
        return ids, scores


class Slow:
    """`retrieve` takes `delay` seconds longer (an asynchronous verification stays in flight
    over several pauses); records the threads it ran on."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay, self.corpus = inner, delay, inner.corpus
        self.threads = set()

    def retrieve(self, queries, k):
        import threading
        import time

        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        return self.inner.retrieve(queries, k)

    def retrieve_from(self, queries, candidates, k):
        return self.inner.retrieve_from(queries, candidates, k)


class Const:
    """Always the same passage."""

    def __init__(self, corpus, j: int):
        self.corpus, self.j = corpus, j

    def retrieve(self, queries, k):
        return np.full((len(queries), k), self.j, np.int64), np.zeros((len(queries), k), np.float32)

    def retrieve_from(self, queries, candidates, k):
        return self.retrieve(queries, k)


def run(model, tok, prompts, strat, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return generate(model, tok, prompts, strategy=strat, **kw)


def assert_same(a, b):
    assert a.token_ids == b.token_ids
    assert [r.finish_reason for r in a.rows] == [r.finish_reason for r in b.rows]
    assert [r.prompt_token_ids for r in a.rows] == [r.prompt_token_ids for r in b.rows]
    assert a.stats["passages"] == b.stats["passages"]
    for out in (a, b):  # each row's own record (the CLI's --json rows) says the same
        assert [[[p["from_token"], p["position"]] for p in r.retrieval["passages"]] for r in out.rows] \
            == out.stats["passages"]


# ------------------------------------------------------------------------- RaLMSpec == RaLM
@pytest.mark.parametrize("stride", [1, 2, 4])
def test_ralmspec_equals_ralm_greedy(model, tok, bm25, stride):
    base = run(model, tok, PROMPTS, RaLM(retriever=bm25, stride=stride, query_tokens=16))
    changes = sum(len(h) - 1 for h in base.stats["passages"])
    assert changes >= len(PROMPTS)  # the passage really changes while decoding
    assert base.stats["retrievals"] == len(PROMPTS) * (1 + (MAX_NEW - 1) // stride)
    for s in (1, 2, 5, "auto"):
        spec = run(model, tok, PROMPTS, RaLMSpec(retriever=bm25, stride=stride, query_tokens=16,
                                                 speculation_stride=s))
        assert_same(spec, base)
        st = spec.stats
        assert 0 < st["speculation_checks"] <= st["speculations"]  # those after a miss are dropped
        assert 0 < st["speculation_accuracy"] <= 1
        assert st["reprefills"] == base.stats["reprefills"]  # only where RaLM re-prefills
        if s != "auto":
            assert st["mean_speculation_stride"] == s
    # a speculation that keeps the passage where it changes: rolled back, right, no extra re-prefill
    # (with bm25's own cache such misses need the true top-1 uncached: rare at stride 4)
    stale = run(model, tok, PROMPTS, RaLMSpec(retriever=Forced(bm25, "stale"), stride=stride, query_tokens=16,
                                              speculation_stride=3))
    assert_same(stale, base)
    assert stale.stats["rollbacks"] > 0 and stale.stats["reprefills"] == base.stats["reprefills"]


def test_ralmspec_equals_ralm_batch_one(model, tok, bm25):
    """Each prompt alone gives the batch's rows (rows are independent), for both."""
    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    batch = run(model, tok, PROMPTS[:4], RaLM(**kw))
    for i, p in enumerate(PROMPTS[:4]):
        one = run(model, tok, [p], RaLM(**kw))
        assert one.token_ids[0] == batch.token_ids[i]
        assert one.stats["passages"][0] == batch.stats["passages"][i]
        spec = run(model, tok, [p], RaLMSpec(speculation_stride=2, **kw))
        assert_same(spec, one)


@pytest.mark.slow  # CI's full run (the default run keeps its siblings)
def test_ralmspec_equals_ralm_sampling(model, tok, bm25):
    kw = dict(temperature=0.9, top_k=40, seed=7)
    base = run(model, tok, PROMPTS[:6], RaLM(retriever=bm25, stride=2, query_tokens=16), **kw)
    greedy = run(model, tok, PROMPTS[:6], RaLM(retriever=bm25, stride=2, query_tokens=16))
    assert base.token_ids != greedy.token_ids  # it does sample
    for s in (1, 5):
        spec = run(model, tok, PROMPTS[:6], RaLMSpec(retriever=bm25, stride=2, query_tokens=16,
                                                    speculation_stride=s), **kw)
        assert_same(spec, base)
        wrong = run(model, tok, PROMPTS[:6], RaLMSpec(retriever=Forced(bm25, "wrong"), stride=2,
                                                     query_tokens=16, speculation_stride=s), **kw)
        assert_same(wrong, base)
        assert wrong.stats["rollbacks"] > 0


def test_ralmspec_equals_ralm_dense(model, tok, dense):
    base = run(model, tok, PROMPTS, RaLM(retriever=dense, stride=1, query_tokens=8))
    assert sum(len(h) - 1 for h in base.stats["passages"]) >= 2 * len(PROMPTS)
    for s in (2, "auto"):
        spec = run(model, tok, PROMPTS, RaLMSpec(retriever=dense, stride=1, query_tokens=8, speculation_stride=s,
                                                 prefetch=5))
        assert_same(spec, base)


@pytest.mark.parametrize("s", [1, 2, 5, "auto"])
def test_every_speculation_wrong(model, tok, bm25, s):
    """retrieve_from always answers a wrong passage: a speculation that would change the
    passage is verified before any re-prefill, one that keeps it is rolled back; the output
    is still RaLM's (rows that ended on a wrong speculation are revived) and the re-prefills
    are RaLM's, one for one (none on a guess)."""
    base = run(model, tok, PROMPTS, RaLM(retriever=bm25, stride=2, query_tokens=16))
    forced = Forced(bm25, "wrong")
    spec = run(model, tok, PROMPTS, RaLMSpec(retriever=forced, stride=2, query_tokens=16, speculation_stride=s))
    assert_same(spec, base)
    st = spec.stats
    assert st["speculation_checks"] > 0 and st["speculation_accuracy"] == 0
    assert st["rollbacks"] <= st["speculation_checks"] and st["rollback_tokens"] >= st["rollbacks"]
    assert st["reprefills"] == base.stats["reprefills"] > 0
    assert [r.retrieval["reprefills"] for r in spec.rows] == [r.retrieval["reprefills"] for r in base.rows]
    assert forced.spec_calls > 0
    if s == "auto":  # never right: OS3 turns speculation off (s = 0) once it has measured a, b
        assert st["plain_rounds"] > 0


def test_every_speculation_right(model, tok, bm25, corpus):
    """Always right: no rollback. A speculated passage change is still verified before its
    re-prefill (a verification call where RaLM retrieves anyway); where the passage is kept,
    5 speculated boundaries + 1 real share a verification call: 11 boundaries, 2 calls."""
    base = run(model, tok, PROMPTS, RaLM(retriever=bm25, stride=2, query_tokens=16))
    for s in (1, 5):
        spec = run(model, tok, PROMPTS, RaLMSpec(retriever=Forced(bm25, "right"), stride=2, query_tokens=16,
                                                 speculation_stride=s))
        assert_same(spec, base)
        assert spec.stats["rollbacks"] == 0 and spec.stats["speculation_accuracy"] == 1.0
        assert spec.stats["reprefills"] == base.stats["reprefills"]
        assert spec.stats["verify_calls"] <= base.stats["retrieval_calls"]  # some row changes at most boundaries
    kept = Forced(Const(corpus, 3), "right")
    base = run(model, tok, PROMPTS, RaLM(retriever=kept, stride=2, query_tokens=16))
    spec = run(model, tok, PROMPTS, RaLMSpec(retriever=kept, stride=2, query_tokens=16, speculation_stride=5))
    assert_same(spec, base)
    assert spec.stats["verify_calls"] * 3 <= base.stats["retrieval_calls"]


def test_rows_ending_mid_batch(model, tok, bm25):
    """A stop token ends some rows early; rows ending with unverified (wrong) boundaries are
    verified and revived; every row equals RaLM's."""
    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    free = run(model, tok, PROMPTS, RaLM(**kw))
    ends = [t for t in free.token_ids[0][2:8] if t not in free.token_ids[1]]
    assert ends
    base = run(model, tok, PROMPTS, RaLM(**kw), stop_token_ids=[ends[0]])
    reasons = [r.finish_reason for r in base.rows]
    assert "eos" in reasons and "length" in reasons
    for strat in (RaLMSpec(speculation_stride=3, **kw),
                  RaLMSpec(speculation_stride=3, **{**kw, "retriever": Forced(bm25, "wrong")})):
        assert_same(run(model, tok, PROMPTS, strat, stop_token_ids=[ends[0]]), base)


def test_lookahead_drafts_cross_boundaries(model, tok, bm25):
    """With drafts (lookahead's suffix drafter; the n-gram trie given as drafter=) a step
    can pass a boundary: the same tokens as without."""
    from lookahead_jax.drafters.trie import TrieDrafter

    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    base = run(model, tok, PROMPTS[:6], RaLM(**kw))
    la = run(model, tok, PROMPTS[:6], RaLM(lookahead=7, **kw))
    assert_same(la, base)
    # drafts were accepted: fewer forwards per row (with a cold cache of earlier outputs the
    # batch's slowest row may still take as many steps as without: drafts cut at a boundary
    # whose passage changes are redone)
    assert sum(r.forward_steps for r in la.rows) < sum(r.forward_steps for r in base.rows)
    trie = run(model, tok, PROMPTS[:6], RaLM(lookahead=7, **kw), drafter=TrieDrafter())
    assert_same(trie, base)
    assert trie.stats["forward_steps"] < base.stats["forward_steps"]
    spec = run(model, tok, PROMPTS[:6], RaLMSpec(lookahead=7, speculation_stride=2, **kw))
    assert_same(spec, base)
    wrong = run(model, tok, PROMPTS[:6], RaLMSpec(lookahead=7, speculation_stride=2,
                                                 **{**kw, "retriever": Forced(bm25, "wrong")}))
    assert_same(wrong, base)


def test_lookahead_drafts_from_the_passage_in_effect(model, tok, bm25):
    """RaLM's lookahead is the suffix drafter (lookahead's default): after a passage swap
    (replace_prompt) the row's drafts come from its new prompt, the one with the new
    passage (the drafter rebuilds the row from the state's prompt)."""
    from lookahead_jax.drafters.suffix import SuffixDrafter
    from lookahead_jax.strategies.ralm import RalmRun

    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    strat = RaLM(lookahead=7, **kw)
    engine = engine_for(model)
    assert isinstance(strat.drafter(engine), SuffixDrafter)
    seen = []  # (row, passage in effect, the tokens the row's store holds before its output)
    swap = RalmRun._swap

    def spy(self, engine, state, drafter, swaps):
        swap(self, engine, state, drafter, swaps)
        for b, _ in swaps:
            drafter.propose(state, 0)  # rebuilds the rows rolled back
            store = drafter._rows[b][0]
            seen.append((self._passage_tokens(self.passage[b]), store.buf, state.rows[b].prompt_ids))

    RalmRun._swap = spy
    try:
        la = run(model, tok, PROMPTS[:6], strat)
    finally:
        RalmRun._swap = swap
    assert_same(la, run(model, tok, PROMPTS[:6], RaLM(**kw)))
    assert seen, "no passage changed: the test needs a swap"
    for passage, buf, prompt in seen:
        assert buf[:len(prompt)] == prompt  # the store starts with the new prompt ...
        n = len(passage)
        assert any(buf[i:i + n] == passage for i in range(len(prompt) - n + 1))  # ... its passage in it


def test_streaming_sends_only_final_text(model, tok, bm25):
    """on_text never gets text that a rollback later takes back."""
    got = {}
    out = run(model, tok, PROMPTS[:4], RaLMSpec(retriever=Forced(bm25, "wrong"), stride=2, query_tokens=16,
                                               speculation_stride=3, lookahead=7),
              on_text=lambda i, t: got.__setitem__(i, got.get(i, "") + t))
    assert out.stats["rollbacks"] > 0
    assert [got.get(i, "") for i in range(4)] == out.texts


@pytest.mark.parametrize("mode", [pytest.param("bm25", marks=pytest.mark.slow),
                                  pytest.param("wrong", marks=pytest.mark.slow),
                                  pytest.param("slow", marks=pytest.mark.slow),
                                  pytest.param("slow-wrong", marks=pytest.mark.slow), "slow-stale"])
def test_async_verification_equals_ralm(model, tok, bm25, mode):
    """Verification on a worker thread: RaLM's tokens, also when the verification is slow
    (in flight over several boundaries, so rollbacks drop speculations made meanwhile), when
    every speculation is wrong (a lookup that would change the passage: the row goes on with
    the passage in effect, verified by the next call), when speculations keep the passage
    where it changes (stale), and with rows ending (a stop token) while one is in flight;
    re-prefills are RaLM's in each."""
    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    inner = Forced(bm25, mode.split("-")[-1]) if mode.endswith(("wrong", "stale")) else bm25
    retr = Slow(inner, 0.02) if "slow" in mode else inner
    base = run(model, tok, PROMPTS, RaLM(**kw))
    free_ids = base.token_ids
    ends = [t for t in free_ids[0][2:8] if t not in free_ids[1]]
    stopped = run(model, tok, PROMPTS, RaLM(**kw), stop_token_ids=[ends[0]])
    for s in ((2,) if mode == "slow-stale" else (1, 3, "auto")):  # the default run: one of each
        strat = RaLMSpec(speculation_stride=s, async_verify=True, **{**kw, "retriever": retr})
        spec = run(model, tok, PROMPTS, strat)
        assert_same(spec, base)
        st = spec.stats
        assert st["verify_calls"] > 0 and st["verify_wait_s"] <= st["retrieval_s"]
        if mode != "wrong":  # there every lookup says "change": it joins the next launch, made before it
            assert st["speculations_while_verifying"] > 0
        assert st["reprefills"] == base.stats["reprefills"]  # a passage change never on a guess
        if "wrong" in mode:
            assert st["rollbacks"] > 0 and st["speculation_accuracy"] == 0
        if "stale" in mode:
            assert st["rollbacks"] > 0
        assert_same(run(model, tok, PROMPTS, strat, stop_token_ids=[ends[0]]), stopped)
    if "slow" in mode:
        assert any(t.startswith("ralmspec-verify") for t in retr.threads)  # it ran on the worker


@pytest.mark.parametrize("mode", ["right", "outside", "outside-go-on", pytest.param("slow-stale", marks=pytest.mark.slow)])
def test_async_verification_lone_row(model, tok, bm25, mode, monkeypatch):
    """One row alone (batch 1): every speculated boundary goes to the worker as soon as it is
    free; a lookup naming another passage is verified at once when waiting is the cheaper
    (`_wait_on_change`, forced here both ways). RaLM's tokens and re-prefills, one for one;
    a right cache never rolls back and OS3's async form never turns speculation off
    (plain_rounds 0); an `outside` cache (every lookup names another passage) never rolls
    back when the row waits, while in a batch the rows decode on and are rolled back where
    the passage really changes."""
    from lookahead_jax.strategies.ralmspec import RalmSpecRun

    monkeypatch.setattr(RalmSpecRun, "_wait_on_change", lambda self: not mode.endswith("go-on"))
    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    inner = Forced(bm25, "outside" if "outside" in mode else mode.split("-")[-1])
    retr = Slow(inner, 0.02) if "slow" in mode else inner
    strat = RaLMSpec(speculation_stride="auto", prefetch=2, async_verify=True, **{**kw, "retriever": retr})
    for p in PROMPTS[:4]:
        base = run(model, tok, [p], RaLM(**kw))
        spec = run(model, tok, [p], strat)
        assert_same(spec, base)
        st = spec.stats
        assert st["reprefills"] == base.stats["reprefills"] and st["speculation_checks"] > 0
        if mode == "right":
            assert st["rollbacks"] == 0 and st["plain_rounds"] == 0 and st["speculation_accuracy"] == 1.0
        if mode == "outside":
            assert st["rollbacks"] == 0 and st["blocking_verify_s"] > 0
        if mode == "slow-stale":
            assert st["verify_wait_s"] <= st["retrieval_s"]
    if mode == "outside-go-on":  # decoding on past a change: rolled back where the passage changes
        assert st["rollbacks"] > 0
    if mode == "outside":
        base = run(model, tok, PROMPTS, RaLM(**kw))
        spec = run(model, tok, PROMPTS, strat)
        assert_same(spec, base)
        assert spec.stats["reprefills"] == base.stats["reprefills"] and spec.stats["rollbacks"] > 0


def test_async_wait_on_change(bm25, tok):
    """A lone row's lookup names another passage: wait for the verification (b) unless
    decoding on loses less, p * ceil(b / step) * step, p the share of such lookups that
    were right (speculation.py's async model, written out)."""
    r = RaLMSpec(retriever=bm25, async_verify=True).start(tok, 1)
    assert r._wait_on_change()  # nothing measured: wait
    r._step_s, r._tokens_per_step = 0.09, 1.0
    r._verify_cost.extend([(1, 0.1)] * 3)
    r._changes = [16, 10]  # p = 11 / 18: 0.1 s against 0.61 * 2 steps * 0.09 s = 0.11 s
    assert r._wait_on_change()
    r._verify_cost.extend([(1, 0.3)] * 60)  # 0.3 s against 0.61 * 4 * 0.09 = 0.22 s: decode on
    assert not r._wait_on_change()
    r._changes = [16, 16]  # every such lookup right: 17 / 18 * 0.36 s > 0.3 s
    assert r._wait_on_change()
    r.close()


@pytest.mark.slow  # CI's full run (the default run keeps async greedy and sync sampling)
def test_async_verification_sampling_and_lookahead(model, tok, bm25):
    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    samp = dict(temperature=0.9, top_k=40, seed=7)
    base = run(model, tok, PROMPTS[:6], RaLM(**kw), **samp)
    for retr in (bm25, Slow(Forced(bm25, "wrong"), 0.02)):
        spec = run(model, tok, PROMPTS[:6], RaLMSpec(speculation_stride=2, async_verify=True,
                                                    **{**kw, "retriever": retr}), **samp)
        assert_same(spec, base)
    la = run(model, tok, PROMPTS[:6], RaLMSpec(speculation_stride=2, async_verify=True, lookahead=7,
                                              **{**kw, "retriever": Slow(Forced(bm25, "wrong"), 0.02)}))
    assert_same(la, run(model, tok, PROMPTS[:6], RaLM(**kw)))


# ------------------------------------------------------------------------- the slot API
@pytest.mark.parametrize("strat", [
    pytest.param(RaLM(stride=2, query_tokens=16), id="ralm"),
    pytest.param(RaLMSpec(stride=2, query_tokens=16, speculation_stride=2), id="ralmspec"),
    pytest.param(RaLMSpec(stride=1, query_tokens=16, speculation_stride="auto", async_verify=True),
                 id="ralmspec-async")])
def test_slots_insert_mid_decode_equals_alone(model, tok, bm25, strat):
    """Requests inserted into 2 slots while the other decodes, freed when done: each gives
    its tokens and passages alone; events carry only final tokens (never taken back)."""
    import dataclasses

    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request, Slots
    from tiny import drive_slots

    strat = dataclasses.replace(strat, retriever=bm25)
    slots = Slots(engine_for(model), tok, 2, 1024, strat)
    idx = [4, 0, 7, 2, 5]
    try:
        got = drive_slots(slots, [Request(tok.encode(PROMPTS[i]), GenerationParams(max_new_tokens=MAX_NEW)) for i in idx])
    finally:
        slots.close()
    for i, (row, streamed) in zip(idx, got):
        one = run(model, tok, [PROMPTS[i]], strat)
        assert row.ids == streamed == one.token_ids[0], f"prompt {i}"
        assert row.retrieval["passages"] == one.rows[0].retrieval["passages"]
    assert slots.free_slots == [0, 1]
    st = slots.run.summary()
    assert st["retrievals"] >= len(idx)
    if strat.name == "ralmspec":
        assert st["speculation_checks"] > 0 and st["speculation_checks"] <= st["speculations"]


@pytest.mark.parametrize("strat", [
    pytest.param(RaLM(stride=2, query_tokens=16), id="ralm"),
    pytest.param(RaLMSpec(stride=2, query_tokens=16, speculation_stride=2), id="ralmspec")])
def test_server_slots_run_only_listed_programs(model, tok, bm25, strat):
    """A retrieval run's slots as the server builds them (prefill_chunk, fallback, penalty
    rows): prompts and re-prefills go in blocks of the chunk's fixed shape (a passage longer
    than a block in several), so once `warm_up` compiled the listed programs nothing
    compiles in place, and every request gives its tokens and passages alone."""
    import dataclasses

    from lookahead_jax.core.engine import Engine
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request, Slots
    from tiny import drive_slots

    strat = dataclasses.replace(strat, retriever=bm25)
    eng = Engine(model)  # its own table: what compiles is this test's
    slots = Slots(eng, tok, 2, 1024, strat, prefill_chunk=16, fallback=True, penalty_rows=True)
    slots.warm_up(wait="all")
    n = len(eng.compiled.compilations)
    assert slots.state.block == 16 and any(p.kind == "verify" for p in slots.programs())
    idx = [4, 0, 7]
    try:
        got = drive_slots(slots, [Request(tok.encode(PROMPTS[i]), GenerationParams(max_new_tokens=MAX_NEW)) for i in idx])
    finally:
        slots.close()
    assert eng.compiled.compilations[n:] == []
    for i, (row, streamed) in zip(idx, got):
        one = run(model, tok, [PROMPTS[i]], strat)
        assert row.ids == streamed == one.token_ids[0], f"prompt {i}"
        assert row.retrieval["passages"] == one.rows[0].retrieval["passages"]
    assert slots.run.summary()["reprefills"] > 0


def test_slots_take_only_their_strategy(model, tok, bm25):
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request, Slots
    from lookahead_jax.strategies import Greedy

    slots = Slots(engine_for(model), tok, 2, 1024, RaLM(retriever=bm25))
    with pytest.raises(ValueError, match="only its own requests"):
        slots.insert(0, Request(tok.encode(PROMPTS[0]), GenerationParams(max_new_tokens=8), strategy=Greedy()))
    with pytest.raises(ValueError, match="retrieved passage"):  # the passage counts in the cache
        slots.insert(0, Request(tok.encode(PROMPTS[0]), GenerationParams(max_new_tokens=1024 - 100)))


# ------------------------------------------------------------------------- RaLM itself
class Recording:
    """Records every query."""

    def __init__(self, inner):
        self.inner, self.corpus, self.queries = inner, inner.corpus, []

    def retrieve(self, queries, k):
        self.queries += list(queries)
        return self.inner.retrieve(queries, k)

    def retrieve_from(self, queries, candidates, k):
        return self.inner.retrieve_from(queries, candidates, k)


def test_question_spans_and_chat_prompts(model, tok, bm25, corpus):
    """The passage goes before the question: after the tokenizer's BOS for plain prompts,
    inside the (last) user turn for chat prompts; queries are the question (+ output), never
    the chat template's words."""
    from lookahead_jax.prompts import encode_prompts

    q = PROMPTS[0]
    msgs = [{"role": "system", "content": "sys words"}, {"role": "user", "content": q}]
    ids, spans = encode_prompts(tok, [q, q, msgs, [1, 50, 60]], chat=False, spans=True)
    assert spans[0] == (1, len(ids[0])) and spans[3] == (1, 3)  # after the BOS
    assert tok.decode(ids[2][slice(*spans[2])]) == q
    (cid,), ((a, e),) = encode_prompts(tok, [q], chat=True, spans=True)
    assert tok.decode(cid[:a]) == "<user>" and tok.decode(cid[a:e]) == q and tok.decode(cid[e:]) == "\n<assistant>"
    for chat in (False, True):
        r = Recording(bm25)
        out = run(model, tok, [q], RaLM(retriever=r, stride=4, query_tokens=16), chat=chat, max_new_tokens=9)
        pid = out.stats["passages"][0][-1][1]
        head = [1] if not chat else cid[:a]
        rest = tok.encode(q, add_special_tokens=False) + ([] if not chat else cid[e:])
        assert out.rows[0].prompt_token_ids == head + tok.encode(
            corpus[pid].contents + "\n\n", add_special_tokens=False) + rest
        assert r.queries[0] == q  # the question alone, template words excluded
        assert r.queries[1] == tok.decode((tok.encode(q, add_special_tokens=False) + out.token_ids[0][:4])[-16:])
    out = run(model, tok, [msgs], RaLM(retriever=bm25, stride=4))
    assert "sys words" in tok.decode(out.rows[0].prompt_token_ids).split(corpus[out.stats["passages"][0][-1][1]].contents)[0]



def with_passage(tok, corpus, prompt_ids, j, max_passage_tokens=256):
    p = tok.encode(corpus[j].contents, add_special_tokens=False)[:max_passage_tokens]
    return prompt_ids[:1] + p + tok.encode("\n\n", add_special_tokens=False) + prompt_ids[1:]


def test_fixed_passage_is_greedy_on_the_written_prompt(model, tok, corpus):
    """A retriever that always answers passage j: RaLM is plain decoding of BOS + passage j
    + "\\n\\n" + prompt (passage 7 has a title: its own first line), never re-prefilled."""
    for j in (3, 7):
        ids = [tok.encode(p) for p in PROMPTS[:3]]
        out = run(model, tok, PROMPTS[:3], RaLM(retriever=Const(corpus, j), stride=1))
        plain = generate(model, tok, [with_passage(tok, corpus, x, j) for x in ids], max_new_tokens=MAX_NEW)
        assert out.token_ids == plain.token_ids
        assert [r.prompt_token_ids for r in out.rows] == [with_passage(tok, corpus, x, j) for x in ids]
        assert out.stats["reprefills"] == 0 and out.stats["retrievals"] == 3 * MAX_NEW
        assert out.stats["passages"] == [[[0, j]]] * 3
    assert corpus[7].contents.startswith("A title\n")


def reference_ralm(model, tok, retriever, prompt, stride, query_tokens, max_new, **kw):
    """RaLM from its definition: at every boundary retrieve with the last query_tokens
    tokens and generate the next stride tokens with plain `generate` on passage + prompt +
    output so far (a fresh prefill each time)."""
    orig = tok.encode(prompt)
    corpus = retriever.corpus
    top1 = lambda q: int(retriever.retrieve([q], 1)[0][0, 0])  # noqa: E731
    j, gen, used = top1(tok.decode(orig, skip_special_tokens=True)), [], []
    while len(gen) < max_new:
        if gen:
            j = top1(tok.decode((orig + gen)[-query_tokens:], skip_special_tokens=True))
        used.append(j)
        out = generate(model, tok, [with_passage(tok, corpus, orig, j) + gen],
                         max_new_tokens=min(stride, max_new - len(gen)), **kw)
        gen += out.token_ids[0]
        if out.rows[0].finish_reason == "eos":
            break
    return gen, used


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, seed=5)])
def test_ralm_matches_its_definition(model, tok, bm25, sampling):
    for p in PROMPTS[1:3] if not sampling else PROMPTS[2:3]:
        gen, used = reference_ralm(model, tok, bm25, p, 3, 16, MAX_NEW, **sampling)
        out = run(model, tok, [p], RaLM(retriever=bm25, stride=3, query_tokens=16), **sampling)
        assert out.token_ids[0] == gen
        changes = [[0, used[0]]] + [[3 * i, used[i]] for i in range(1, len(used)) if used[i] != used[i - 1]]
        assert out.stats["passages"][0] == changes
        spec = run(model, tok, [p], RaLMSpec(retriever=Forced(bm25, "wrong"), stride=3, query_tokens=16,
                                             speculation_stride=2), **sampling)
        assert spec.token_ids[0] == gen


def test_ralmspec_equals_ralm_with_penalties(model, tok, bm25, corpus):
    """Repetition / presence / frequency penalties: RaLMSpec (speculation right and always
    wrong: rollbacks and re-prefills) gives RaLM's tokens; the passage is part of the
    context (a fixed passage: RaLM is plain decoding of the written prompt)."""
    pen = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.8)
    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    base = run(model, tok, PROMPTS[:4], RaLM(**kw), **pen)
    assert base.token_ids != run(model, tok, PROMPTS[:4], RaLM(**kw)).token_ids
    assert sum(len(h) - 1 for h in base.stats["passages"]) > 0  # passages change: re-prefills
    for retriever in (bm25, Forced(bm25, "wrong")):
        spec = run(model, tok, PROMPTS[:4], RaLMSpec(**{**kw, "retriever": retriever}, speculation_stride=2), **pen)
        assert_same(spec, base)
    assert spec.stats["rollbacks"] > 0
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    fixed = run(model, tok, PROMPTS[:2], RaLM(retriever=Const(corpus, 3), stride=1), **pen)
    plain = generate(model, tok, [with_passage(tok, corpus, x, 3) for x in ids], max_new_tokens=MAX_NEW, **pen)
    assert fixed.token_ids == plain.token_ids


def test_retriever_by_kind_and_corpus_path(model, tok, corpus, bm25, tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "passages.jsonl"
    path.write_text(corpus.to_jsonl())
    with pytest.raises(R.IndexNotBuilt, match="build"):
        run(model, tok, PROMPTS[:2], "ralm", retriever="bm25", corpus=str(path))
    R.build_index("bm25", str(path), progress=False)
    a = run(model, tok, PROMPTS[:2], "ralmspec", retriever="bm25", corpus=str(path), stride=2)
    b = run(model, tok, PROMPTS[:2], RaLM(retriever=bm25, stride=2))
    assert a.token_ids == b.token_ids and a.stats["passages"] == b.stats["passages"]
    assert a.stats["strategy"] == "ralmspec" and a.stats["retrieval_s"] > 0


# ------------------------------------------------------------------------- errors
def test_errors(model, tok, corpus, bm25, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(R.CorpusError, match="empty corpus"):
        run(model, tok, PROMPTS[:1], "ralm", retriever="bm25", corpus=str(empty))
    with pytest.raises(R.UnknownRetriever, match="unknown retriever 'nope'"):
        run(model, tok, PROMPTS[:1], "ralm", retriever="nope", corpus=str(empty))
    with pytest.raises(ValueError, match="needs a retriever"):
        run(model, tok, PROMPTS[:1], "ralmspec")
    with pytest.raises(ValueError, match="needs corpus"):
        run(model, tok, PROMPTS[:1], "ralm", retriever="bm25")
    with pytest.raises(ValueError, match="must be a retriever kind or a Retriever"):
        run(model, tok, PROMPTS[:1], "ralm", retriever=3)
    for bad in (0, -1, 5000, 2.0, True):
        with pytest.raises(ValueError, match=r"stride must be an integer in \[1, 4096\]"):
            run(model, tok, PROMPTS[:1], "ralm", retriever=bm25, stride=bad)
    for bad in (0, 17, "fast"):
        with pytest.raises(ValueError, match="speculation_stride must be 'auto' or an integer"):
            run(model, tok, PROMPTS[:1], "ralmspec", retriever=bm25, speculation_stride=bad)
    with pytest.raises(ValueError, match="prefetch"):
        run(model, tok, PROMPTS[:1], "ralmspec", retriever=bm25, prefetch=0)
    with pytest.raises(ValueError, match="query_tokens"):
        run(model, tok, PROMPTS[:1], "ralm", retriever=bm25, query_tokens=0)
    nocorpus = Forced(bm25, "right")
    nocorpus.corpus = None
    with pytest.raises(ValueError, match="no corpus"):
        run(model, tok, PROMPTS[:1], "ralm", retriever=nocorpus)
    # prompt + a passage of max_passage_tokens cannot fit the cache the caller asked for
    with pytest.raises(ValueError, match=r"max_passage_tokens=256.*cache holds 256 \(max_cache_len=256\)"):
        run(model, tok, PROMPTS[:1], "ralm", retriever=bm25, max_cache_len=256)
    out = run(model, tok, PROMPTS[:1], "ralm", retriever=bm25, max_cache_len=256, max_passage_tokens=64)
    assert out.stats["cache_len"] == 256


def test_reprefills_forward_only_what_the_cache_lacks(model, tok, bm25, corpus):
    """Chat prompts: a re-prefill keeps at least the head (the template's tokens before the
    user's question, where the passage goes) in the cache and forwards the rest; kept +
    forwarded is each new context's length (what a re-prefill from slot 0 forwarded).
    RaLMSpec, always wrong (rollbacks), gives RaLM's tokens."""
    from lookahead_jax.prompts import encode_prompts

    msgs = [[{"role": "system", "content": "sys words"}, {"role": "user", "content": p}] for p in PROMPTS[:4]]
    kw = dict(retriever=bm25, stride=2, query_tokens=16)
    base = run(model, tok, msgs, RaLM(**kw))
    ids, spans = encode_prompts(tok, msgs, chat=True, spans=True)
    sep = tok.encode("\n\n", add_special_tokens=False)
    full = sum(len(x) + len(tok.encode(corpus[p].contents, add_special_tokens=False)) + len(sep) + g
               for x, h in zip(ids, base.stats["passages"]) for g, p in h[1:])
    st = base.stats["retrieval"]
    assert st["reprefills"] == sum(len(h) - 1 for h in base.stats["passages"]) > 0
    assert st["reprefill_tokens"] + st["reused_tokens"] == full
    assert st["reused_tokens"] >= st["reprefills"] * min(a for a, _ in spans) > 0
    spec = run(model, tok, msgs, RaLMSpec(**{**kw, "retriever": Forced(bm25, "wrong")}, speculation_stride=2))
    assert_same(spec, base)
    assert spec.stats["rollbacks"] > 0 and spec.stats["retrieval"]["reused_tokens"] > 0
