"""`serve.replica` in one process: process 0's scheduler records every call on its slots
into a stand-in for the coordination service's key-value store, a second scheduler (its own
engine) follows the record in another thread, and ends with it; the follower's requests
end with the tokens process 0's jobs got (plain decoding, prefill blocks, the prefix cache and
its warm jobs, greedy and sampled requests, one with top_k last). A
follower whose call ends otherwise than process 0's stops with one line; the record's
messages come in order and old blocks of them are deleted. (Over 2 real processes:
tests/test_multihost_serve.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from lookahead_jax.core.params import GenerationParams
from lookahead_jax.core.sampling import SamplingParams
from lookahead_jax.serve import replica
from lookahead_jax.serve.jobs import Job
from lookahead_jax.serve.scheduler import Scheduler
from tiny import ByteTokenizer, tiny_model

TEXT = "the cat sat on the mat, the dog sat on the log; " * 4


class Store:
    """The coordination service's key-value store as the client shows it (bytes, blocking
    reads that time out with DEADLINE_EXCEEDED, deleting a directory)."""

    def __init__(self):
        self.kv, self.cond, self.deleted = {}, threading.Condition(), []

    def key_value_set_bytes(self, key, value):
        with self.cond:
            self.kv[key] = value
            self.cond.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.kv[key]

    def key_value_delete(self, key):
        with self.cond:
            self.deleted.append(key)
            for k in [k for k in self.kv if k.startswith(key)]:
                del self.kv[k]


class Spy:
    """A follower's slots, keeping what `free` returns (the request's tokens)."""

    def __init__(self, slots, freed):
        self._slots, self._freed = slots, freed

    def __getattr__(self, name):
        return getattr(self._slots, name)

    def free(self, slot):
        row = self._slots.free(slot)
        if row.finish != "abort":
            self._freed.append((list(row.prompt_ids), list(row.ids)))
        return row


def scheduler(replicate=None, seed=1):
    """Plain decoding: one token a row a step on both sides. (A drafting strategy's trees
    come from each engine's own drafter and timed budget; over processes `agree_drafts`
    makes them process 0's, in one process nothing does, so rows could end at other steps.)"""
    model, tok = tiny_model("llama", seed=seed), ByteTokenizer()
    sched = Scheduler(_engine(model), tok, None, max_batch=3,
                      max_len=512, prefill_chunk=32, prefix_cache=2 ** 22, replicate=replicate)
    sched.model = model  # (the engine holds its model weakly)
    return sched


def _engine(model):
    from lookahead_jax.core.engine import Engine

    return Engine(model)  # one of its own: the follower's stores (prefix cache, drafter's) are apart


def test_a_follower_ends_with_process_zeros_tokens():
    store = Store()
    sched = scheduler(replicate=replica.Recorder(replica.Channel(store)))
    follower = scheduler()
    freed = []
    follower.slots = Spy(follower.slots, freed)
    done = {}
    thread = threading.Thread(daemon=True, target=lambda: done.setdefault("calls", replica.follow(follower,
                                                                                     replica.Channel(store))))
    thread.start()
    tok = sched.tokenizer
    outs = {}
    # (prompt, max new tokens, sampling): greedy and sampled, three sharing a cached passage; the
    # last one, sampled with top_k, after the others ended
    specs = [(TEXT + "and then", 12, {}), ("abcabcabc", 20, {}), (TEXT + "so", 10, {}),
             ("hello hello", 16, {"temperature": 0.8}), (TEXT[:60], 8, {}),
             ("x = 1; " * 5, 8, {"temperature": 0.5, "top_k": 3})]

    def job(i):
        text, n, sampling = specs[i]
        return Job(tok.encode(text), GenerationParams(max_new_tokens=n, seed=i, **sampling),
                   lambda o, i=i: outs.setdefault(i, []).append(o))

    def wait(n):
        while sum(bool(o) and o[-1].finish is not None for o in outs.values()) < n:
            time.sleep(0.1)

    sched.start()
    sched.submit([job(i) for i in range(5)])
    wait(5)
    sched.warm(tok.encode(TEXT + "and then, the end; " * 5))  # a warm job's blocks, recorded too
    while sched.warm_pending:
        time.sleep(0.1)
    sched.submit([job(5)])
    wait(6)
    sched.shutdown()
    thread.join(120)
    assert not thread.is_alive() and done["calls"] > 10
    want = {(tuple(tok.encode(specs[i][0])), tuple(t for o in outs[i] for t in o.tokens)) for i in outs}
    assert {(tuple(p), tuple(ids)) for p, ids in freed} == want
    assert all(outs[i][-1].finish in ("eos", "length") for i in outs)
    # the warm job ran there too; both caches hold the same blocks
    mine, theirs = sched.slots.prefix.cache.summary(), follower.slots.prefix.cache.summary()
    assert mine["prefix_cache_warm_jobs"] == 1 and mine["prefix_cache_warm_tokens"] > 0
    assert theirs == mine
    # every message read, in order (its calls and the end)
    assert max(int(k.rsplit("/", 1)[1]) for k in store.kv) == done["calls"] + 1


def test_a_follower_whose_call_ends_otherwise_stops(monkeypatch, capsys):
    store = Store()
    channel = replica.Channel(store)
    channel.publish("build", 0, (SamplingParams(), None))
    channel.publish("free", 0, (0,))  # slot 0 is free: the follower's free raises
    channel.outcome = replica.RETURNED  # ... where process 0's returned
    channel.publish("stop")

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(replica.os, "_exit", exit_)
    with pytest.raises(SystemExit) as e:
        replica.follow(scheduler(), replica.Channel(store))
    assert e.value.code == 3
    err = capsys.readouterr().err
    assert "its free ended ValueError where process 0's ended returned" in err, err


def test_the_record_keeps_its_order_and_deletes_old_blocks(monkeypatch):
    monkeypatch.setattr(replica, "BLOCK", 4)
    store = Store()
    out, into = replica.Channel(store), replica.Channel(store, poll_s=0.01)
    got = []
    reader = threading.Thread(daemon=True, target=lambda: got.extend(into.receive() for _ in range(7)))
    reader.start()  # (reading before anything is written: it waits)
    for i in range(7):
        out.publish("step", 0, (i,))
    reader.join(10)
    assert [(m[0], m[2], m[3]) for m in got] == [(i + 1, "step", (i,)) for i in range(7)]
    for i in range(7, 13):
        out.publish("step", 0, (i,))
    assert store.deleted == [replica.PREFIX + "0/", replica.PREFIX + "1/"]  # blocks 0 and 1 (at 8 and 12)
    assert min(int(k.rsplit("/", 1)[1]) for k in store.kv) == 8
    with pytest.raises(RuntimeError, match="DEADLINE"):
        store.blocking_key_value_get_bytes("nothing", 1)
