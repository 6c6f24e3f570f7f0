"""Prefix-cache warm jobs (`core.prefix_warm`, the scheduler's warm queue, the server's chat
turns): a finished chat's next-turn prefix (prompt, answer, the template's end of turn) is
forwarded in the prompt's own prefill blocks through a free slot into the cache.

* Slots: a warm job stores (n - 1) // U units of its n tokens (the cached ones taken, not
  counted as a lookup), bit for bit the K/V a fresh prefill of a longer prompt beginning
  with them writes; that prompt then takes every one of them and gives the tokens it
  gives without the cache. A warm row is neither free nor busy; free / cancel at any
  block keeps the units stored so far and frees the slot; a warm job whose rest a request
  prefilled meanwhile ends without another block.
* Scheduler: a waiting request preempts a warm job (the job is queued again and, started
  again, forwards only what is not stored yet); no warm block while a job runs; with the
  cache off nothing is queued.
* Server: a chat's second turn hits on the first turn's answer (/metrics), its text and
  the first turn's equal those of a server without the prefix cache.
"""

from __future__ import annotations


import json
import time

import numpy as np
import pytest

from lookahead_jax.core.engine import engine_for
from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.prefix_cache import PrefixCache, chain_keys
from lookahead_jax.core.rows import Phase
from lookahead_jax.core.slots import Request, Slots
from lookahead_jax.strategies import Lookahead
from tiny import ByteTokenizer, load_prompts, tiny_model

C = 16
U = C - 1
CACHE = 512
BUDGET = 64 << 20
TEXT = [p["prompt"] for p in load_prompts()][0][:200]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=2)


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def _row_kv(slots, row: int, n: int) -> list:
    cache = slots.state.cache
    return [np.asarray(x[row, :, :n]) for x in cache.k + cache.v]


def _finish(slots) -> dict:
    out = {}
    while slots.busy:
        for ev in slots.step():
            if ev.finish:
                out[ev.slot] = slots.free(ev.slot).ids
    return out


@pytest.mark.parametrize("extra", [0, 1, 7])  # n - 1 a multiple of U, and not
def test_warm_units_are_a_prefills_and_the_next_prompt_takes_them(model, tok, extra):
    engine = engine_for(model)
    engine.stores.clear(PrefixCache)
    first = tok.encode(TEXT[:40])  # "turn 1": its prompt blocks are cached by its own prefill
    warm = tok.encode(TEXT[:90 + extra])  # its prompt + "answer": n - 1 = 90 + extra tokens, 90 = 6 U
    nxt = tok.encode(TEXT[:90 + extra + 30])  # the "next turn": begins with the warm sequence
    assert nxt[:len(warm)] == warm
    plain = Slots(engine, tok, 2, CACHE, Lookahead(decoding_length=7), prefill_chunk=C)
    plain.insert(0, Request(nxt, GenerationParams(max_new_tokens=12)))
    want_kv = _row_kv(plain, 0, len(nxt))
    want = _finish(plain)[0]

    slots = Slots(engine, tok, 2, CACHE, Lookahead(decoding_length=7), prefill_chunk=C, prefix_cache=BUDGET)
    slots.insert(1, Request(first, GenerationParams(max_new_tokens=4)))
    _finish(slots)
    cache = slots.prefix.cache
    s0 = cache.summary()
    n_first = (len(first) - 2) // U
    assert s0["prefix_cache_blocks"] == n_first
    w = slots.warming
    assert w.start(0, warm)
    assert slots.row(0).phase is Phase.WARMING and 0 not in slots.free_slots and not slots.busy
    assert int(slots.state.lengths[0]) == n_first * U  # turn 1's blocks taken, not counted as a lookup
    blocks = 0
    while w.rows:
        w.advance()
        blocks += 1
    units = (len(warm) - 1) // U
    assert blocks == units - n_first and 0 in slots.free_slots
    s1 = cache.summary()
    assert s1["prefix_cache_lookups"] == s0["prefix_cache_lookups"] and s1["prefix_cache_queries"] == \
        s0["prefix_cache_queries"]
    assert s1["prefix_cache_blocks"] == units and s1["prefix_cache_warm_jobs"] == 1
    assert s1["prefix_cache_warm_tokens"] == (units - n_first) * U
    keys = chain_keys(warm, U, units, slots.prefix.salt)
    for i, key in enumerate(keys):  # bit for bit the next prompt's own prefill
        got = [np.asarray(x) for x in cache._blocks[key][0][0] + cache._blocks[key][0][1]]
        for g, want_l in zip(got, want_kv):
            assert g.tobytes() == want_l[:, i * U:(i + 1) * U].tobytes(), i
    assert not w.start(0, warm)  # every unit cached: nothing to do, the slot stays free
    assert slots.row(0).phase is Phase.FREE

    slots.insert(0, Request(nxt, GenerationParams(max_new_tokens=12)))
    s2 = cache.summary()
    assert s2["prefix_cache_hit_blocks"] - s1["prefix_cache_hit_blocks"] == units  # the warm units, all
    for g, want_l in zip(_row_kv(slots, 0, len(nxt)), want_kv):
        assert g.tobytes() == want_l.tobytes()
    assert _finish(slots)[0] == want


def test_cancel_keeps_what_is_stored_and_frees_the_slot(model, tok):
    engine = engine_for(model)
    engine.stores.clear(PrefixCache)
    slots = Slots(engine, tok, 1, CACHE, prefill_chunk=C, prefix_cache=BUDGET)
    warm = tok.encode(TEXT[:100])
    w = slots.warming
    assert w.start(0, warm)
    w.advance()
    w.advance()
    with pytest.raises(ValueError, match="holds a request"):
        slots.insert(0, Request(warm, GenerationParams(max_new_tokens=2)))
    row = slots.free(0)  # a warm row: cancelled
    assert row.phase is Phase.WARMING and slots.free_slots == [0] and not w.rows
    s = slots.prefix.cache.summary()
    assert s["prefix_cache_blocks"] == 2 and s["prefix_cache_warm_cancelled"] == 1
    assert w.start(0, warm)  # again: the two stored units taken, the rest forwarded
    assert int(slots.state.lengths[0]) == 2 * U
    while w.rows:
        w.advance()
    assert slots.prefix.cache.summary()["prefix_cache_blocks"] == (len(warm) - 1) // U
    slots.insert(0, Request(warm + tok.encode("?", add_special_tokens=False), GenerationParams(max_new_tokens=3)))
    with pytest.raises(ValueError, match="not a free slot"):  # a request holds it
        w.start(0, warm)
    assert _finish(slots)


def test_a_warm_job_ends_when_a_request_prefilled_the_rest(model, tok):
    """The next turn arrives while its warm job still runs (another slot): the request takes
    the stored units and prefills (and stores) the rest; the warm job then ends without
    forwarding another block."""
    engine = engine_for(model)
    engine.stores.clear(PrefixCache)
    slots = Slots(engine, tok, 2, CACHE, prefill_chunk=C, prefix_cache=BUDGET)
    warm = tok.encode(TEXT[:100])
    w = slots.warming
    assert w.start(0, warm)
    w.advance()
    slots.insert(1, Request(tok.encode(TEXT[:130]), GenerationParams(max_new_tokens=2)))  # (idle: every block now)
    steps = slots.state.steps
    assert w.advance() == 0 and not w.rows and slots.state.steps == steps and 0 in slots.free_slots
    s = slots.prefix.cache.summary()
    assert s["prefix_cache_hit_blocks"] == 1 and s["prefix_cache_warm_tokens"] == U
    _finish(slots)


def test_no_warming_without_the_cache(model, tok):
    engine = engine_for(model)
    assert Slots(engine, tok, 1, CACHE, prefill_chunk=C).warming is None
    assert Slots(engine, tok, 1, CACHE, prefix_cache=BUDGET).warming is None


def _job(ids, max_new, outs):
    from lookahead_jax.serve.scheduler import Job

    return Job(list(ids), GenerationParams(max_new_tokens=max_new), outs.append)


def test_a_waiting_request_preempts_a_warm_job(model, tok):
    """One slot: a warm job runs a block; a request arrives: the warm job gives the slot up
    (cancelled, queued again), the request runs and gives the tokens it gives alone; then the
    warm job starts again from what it stored and ends."""
    from lookahead_jax.serve.scheduler import Scheduler

    engine = engine_for(model)
    engine.stores.clear(PrefixCache)
    sched = Scheduler(engine, tok, Lookahead(decoding_length=7), max_batch=1, max_len=CACHE, prefill_chunk=C,
                      prefix_cache=BUDGET)
    assert sched.warms
    warm = tok.encode(TEXT[:150])
    assert sched.warm(warm) and sched.warm_pending
    sched._warm()  # (the engine thread's turn, driven here: a warm block)
    w, cache = sched.slots.warming, sched.slots.prefix.cache
    assert w.rows == [0] and cache.summary()["prefix_cache_blocks"] == 1
    outs = []
    req = tok.encode(TEXT[100:160])
    sched.submit([_job(req, 10, outs)])
    sched._warm()  # a job waits: no warm block
    assert cache.summary()["prefix_cache_blocks"] == 1
    sched._admit()  # the job takes the slot: the warm job is cancelled and queued again
    assert not w.rows and list(sched.running) == [0] and list(sched.warm_waiting) == [warm]
    assert cache.summary()["prefix_cache_warm_cancelled"] == 1
    while sched.running:
        sched._step()
    got = [t for o in outs for t in o.tokens]
    assert outs[-1].finish in ("eos", "length")
    alone = Slots(engine, tok, 1, CACHE, Lookahead(decoding_length=7), prefill_chunk=C)
    alone.insert(0, Request(req, GenerationParams(max_new_tokens=10)))
    assert got == _finish(alone)[0]
    sched._warm()  # started again: the stored block taken, the next one forwarded
    assert int(sched.slots.state.lengths[0]) == 2 * U
    while sched.warm_pending:
        sched._warm()
    s = cache.summary()
    assert s["prefix_cache_warm_jobs"] == 2 and s["prefix_cache_warm_tokens"] == (len(warm) - 1) // U * U
    assert sched.slots.free_slots == [0]

    off = Scheduler(engine, tok, Lookahead(decoding_length=7), max_batch=1, max_len=CACHE, prefill_chunk=C)
    assert not off.warms and not off.warm(warm) and not off.warm_pending


def test_no_warm_block_while_a_job_runs(model, tok):
    """A free slot, but a job decodes: the warm job waits (its blocks would lengthen the job's
    steps) and begins once the job is done."""
    from lookahead_jax.serve.scheduler import Scheduler

    engine = engine_for(model)
    engine.stores.clear(PrefixCache)
    sched = Scheduler(engine, tok, None, max_batch=2, max_len=CACHE, prefill_chunk=C, prefix_cache=BUDGET)
    outs = []
    sched.submit([_job(tok.encode(TEXT[:20]), 6, outs)])
    sched._admit()
    assert sched.warm(tok.encode(TEXT[:100]))
    steps = 0
    while sched.running:
        sched._warm()
        assert not sched.slots.warming.rows and len(sched.warm_waiting) == 1
        sched._step()
        steps += 1
    assert steps >= 1 and outs[-1].finish
    sched._warm()
    assert sched.slots.warming.rows and not sched.warm_waiting


def _server(prefix_mb):
    from lookahead_jax.serve import ServeConfig, make_server, start_in_thread

    cfg = ServeConfig(model="tiny", strategy="lookahead", max_batch=2, max_len=512, prefill_chunk=32,
                      warmup="none", prefix_cache_mb=prefix_mb)
    srv = make_server(cfg, tiny_model("llama", seed=6), ByteTokenizer())
    return (srv,) + start_in_thread(srv)


def test_chat_second_turn_hits_on_the_answer():
    """Two-turn chats through servers with the prefix cache (default) and without: the
    first turn's answer is warmed after it ends (/metrics: a warm job, its tokens), the
    second turn takes every block of [turn 1's prompt, answer, end of turn] (its prompt
    hits as far as the warm sequence's units), and both turns' texts equal those of the
    server without the cache (which queues no warm job); streamed and not."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from lookahead_jax.serve.chat import next_turn_ids

    tok = ByteTokenizer()
    texts, stats = {}, {}
    for mb in (0, 512):
        srv, uv, thread, url = _server(mb)

        def metric(name):
            text = httpx.get(url + "/metrics").text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith(f"lookahead_jax:{name}"))

        try:
            for stream in (False, True):
                msgs = [dict(role="system", content="Be brief."),
                        dict(role="user", content=TEXT[:90] + (" (streamed)" if stream else ""))]
                answers = []
                for turn in range(2):
                    body = dict(model="tiny", messages=msgs, max_tokens=40, temperature=0, stream=stream)
                    h0 = metric("prefix_cache_hits_total")
                    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
                    assert r.status_code == 200
                    if stream:
                        parts = [json.loads(x[6:]) for x in r.text.splitlines()
                                 if x.startswith("data: {")]
                        answer = "".join(p["choices"][0]["delta"].get("content", "") for p in parts
                                         if p["choices"])
                    else:
                        answer = r.json()["choices"][0]["message"]["content"]
                    answers.append(answer)
                    hits = metric("prefix_cache_hits_total") - h0
                    if turn == 0:
                        first = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
                        warm = next_turn_ids(tok, msgs, answer)
                        deadline = time.time() + 120
                        while (metric("prefix_cache_warm_jobs_total") < 1 + stream or srv.scheduler.warm_pending) \
                                and mb and time.time() < deadline:
                            time.sleep(0.05)
                        msgs = msgs + [dict(role="assistant", content=answer), dict(role="user", content="Why?")]
                    else:
                        prompt = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
                        assert prompt[:len(warm)] == warm and len(warm) > 31 * 4
                        if mb:  # every unit of the warm sequence (turn 1's own and the answer's)
                            assert hits == 31 * min((len(warm) - 1) // 31, (len(prompt) - 2) // 31) \
                                > 31 * ((len(first) - 2) // 31)  # (turn 1's prompt blocks alone)
                texts[mb, stream] = answers
            stats[mb] = {k: metric(k) for k in ("prefix_cache_warm_jobs_total", "prefix_cache_warm_tokens_total",
                                                "prefix_cache_warm_cancelled_total")}
        finally:
            uv.should_exit = True
            thread.join(60)
    assert texts[0, False] == texts[512, False] and texts[0, True] == texts[512, True]
    assert stats[0] == {k: 0 for k in stats[0]}
    assert stats[512]["prefix_cache_warm_jobs_total"] >= 2 and stats[512]["prefix_cache_warm_tokens_total"] > 0
