"""Serving over several processes (`jax.distributed`): process 0 serves HTTP and runs the
engine thread (`scheduler.Scheduler`); every other process builds the same server and
follows it, making the same `Slots` calls in the same order with the same arguments, so
that every process runs the same programs (each step's collectives) on the same state.

    # process 0: its scheduler records every call on its slots
    sched = Scheduler(engine, tokenizer, ..., replicate=Channel())
    # every other process: the same scheduler, driven by the record
    follow(Scheduler(engine, tokenizer, ...), Channel())

The record is one ordered stream of messages from process 0 through the coordination
service's key-value store (the one `jax.distributed` runs): a message is (serial, which
slots, the call, its arguments, how process 0's call before it ended), written before
process 0 makes the call. What crosses is what the engine thread does to its slots:
building them (sampling, penalties), `insert` (each request's prompt ids, params,
strategy, sampling row, references and question span; not its text callback), `step`,
`free`, `programs`, `warm_up`, `rehearse`, `close`, the prefix cache's warm rows
(`warming.start / advance / cancel`), and the end. Every other input of a call is state
both processes hold alike. The per-step choices made from process 0's clock are broadcast
inside the calls, as for `generate` (a verify step's drafts and tree size:
`multihost.agree_drafts`; SpecInfer's budget and the step budget's prefill blocks:
`multihost.agree_choice`), and over several processes slots compile a program they lack
instead of doing without it (`fallback` off), so which programs run does not depend on
each process's compile progress. The bytes are pickles: the key-value store is the
processes' own, reached only by them.

Checks: each message carries how process 0's previous call ended (it returned, or the
name of its exception); a follower whose own call ended otherwise has left process 0's
state and ends at once with one line (exit status 3), and process 0's heartbeat watcher
(`multihost.watch_peers`) then ends it with a line naming the follower. A follower waits
for the next message as long as the server is idle (a read that fails, for want of the
message or of the service, is made again a poll later); a process 0 that died ends it
through the same watcher. Messages are kept in directories of `BLOCK`; the one two blocks back is
deleted as a block begins (a follower is never that far behind: every step is a
collective it must join).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading
import time

from ..core.request import Request

log = logging.getLogger("lookahead_jax.serve")

PREFIX = "lookahead_jax/serve/record/"
BLOCK = 1024  # messages per key directory of the record
RETURNED = "returned"  # a call's outcome when it raised nothing


class Channel:
    """The record's stream (module docstring): process 0 `publish`es, the others `receive`
    in order. client: a `jax.distributed` client (default: this process's); poll_s: how
    long one read of the store waits before it is retried."""

    def __init__(self, client=None, prefix: str = PREFIX, poll_s: float = 1.0):
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                raise RuntimeError("serving over several processes needs jax.distributed initialized first")
        self.client, self.prefix, self.poll_ms = client, prefix, max(1, int(poll_s * 1000))
        self.n = 0  # messages written (process 0) or read (the others)
        self.outcome = RETURNED  # how process 0's last recorded call ended (sent with the next message)
        self._lock = threading.Lock()

    def _key(self, n: int) -> str:
        return f"{self.prefix}{n // BLOCK}/{n}"

    def publish(self, call: str, sid=None, args=()) -> None:
        """Write the next message: `call` on slots `sid` with `args` (process 0)."""
        with self._lock:
            self.n += 1
            n = self.n
            if n % BLOCK == 0 and n // BLOCK >= 2:  # a block begins: the one two back is read by all
                self.client.key_value_delete(f"{self.prefix}{n // BLOCK - 2}/")
            self.client.key_value_set_bytes(self._key(n), pickle.dumps((n, sid, call, args, self.outcome)))

    def receive(self) -> tuple:
        """The next message (n, sid, call, args, outcome of process 0's call before it),
        waiting for it as long as it takes (the others)."""
        self.n += 1
        key = self._key(self.n)
        while True:
            t0 = time.monotonic()
            try:
                data = self.client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except RuntimeError:  # (jax.errors.JaxRuntimeError) not written yet, or the service failed:
                # read again; a process 0 that is gone ends this one (`multihost.watch_peers`)
                time.sleep(max(0.0, self.poll_ms / 1000 - (time.monotonic() - t0)))
        msg = pickle.loads(data)
        if msg[0] != self.n:
            raise RuntimeError(f"the serving record is out of order: message {msg[0]} read as {self.n}")
        return msg


class RecordedSlots:
    """A `Slots` whose calls that change it are written to the record before they are made
    (process 0); everything else is read from the slots themselves. sid: its number in
    the record (the follower builds its own under it)."""

    def __init__(self, slots, channel: Channel, sid: int):
        self._slots, self._channel, self._sid = slots, channel, sid
        self.warming = None if slots.warming is None else RecordedWarming(self, slots.warming)

    def __getattr__(self, name):
        return getattr(self._slots, name)

    def _call(self, name: str, wire: tuple, call, *args, **kwargs):
        self._channel.publish(name, self._sid, wire)
        try:
            out = call(*args, **kwargs)
        except BaseException as e:
            self._channel.outcome = type(e).__name__
            raise
        self._channel.outcome = RETURNED
        return out

    def insert(self, slots, requests):
        reqs = [requests] if isinstance(requests, Request) else list(requests)
        wire = [dataclasses.replace(r, on_text=None) for r in reqs]  # (a callback does not cross)
        return self._call("insert", (slots, wire), self._slots.insert, slots, requests)

    def step(self):
        return self._call("step", (), self._slots.step)

    def free(self, slot):
        return self._call("free", (slot,), self._slots.free, slot)

    def programs(self):  # (the strategy's setup may run programs: calibration)
        return self._call("programs", (), self._slots.programs)

    def warm_up(self, sampled: bool = False, progress=None, wait: str = "all"):
        return self._call("warm_up", (sampled, None, wait), self._slots.warm_up, sampled, progress, wait)

    def rehearse(self, *args):
        return self._call("rehearse", args, self._slots.rehearse, *args)

    def close(self):
        return self._call("close", (), self._slots.close)


class RecordedWarming:
    """The prefix cache's warm rows of `RecordedSlots` (`core.prefix_warm.PrefixWarm`),
    their changes recorded as the slots' are."""

    def __init__(self, owner: RecordedSlots, warming):
        self._owner, self._warming = owner, warming

    def __getattr__(self, name):
        return getattr(self._warming, name)

    def start(self, slot, ids):
        return self._owner._call("warming.start", (slot, list(ids)), self._warming.start, slot, ids)

    def advance(self):
        return self._owner._call("warming.advance", (), self._warming.advance)

    def cancel(self, slot):
        return self._owner._call("warming.cancel", (slot,), self._warming.cancel, slot)


class Recorder:
    """Process 0's side: numbers the slots its scheduler builds and wraps them
    (`Scheduler(replicate=)` calls `built`), and ends the record (`stop`)."""

    def __init__(self, channel: Channel):
        self.channel, self.count = channel, 0

    def built(self, slots, sampling, penalties) -> RecordedSlots:
        sid, self.count = self.count, self.count + 1
        self.channel.publish("build", sid, (sampling, penalties))
        self.channel.outcome = RETURNED
        return RecordedSlots(slots, self.channel, sid)

    def stop(self) -> None:
        self.channel.publish("stop")


def follow(sched, channel: Channel) -> int:
    """Run process 0's record on this process's scheduler `sched` (built as process 0's, not
    started) until process 0 ends it; returns the number of calls made. Slots 0 are the
    ones `sched` built; later ones are built here as the record says. A call whose outcome
    differs from process 0's ends this process (module docstring)."""
    import jax

    me, n = jax.process_index(), jax.process_count()
    table, last, calls = {}, None, 0
    first = sched.slots
    while True:
        _, sid, call, args, theirs = channel.receive()
        if last is not None and last[1] != theirs:
            print(f"error: process {me} of {n}: its {last[0]} ended {last[1]} where process 0's ended {theirs}: "
                  "this process no longer holds the server's state; ending it", file=sys.stderr, flush=True)
            os._exit(3)
        if call == "stop":
            break
        outcome = RETURNED
        try:
            if call == "build":
                table[sid] = first if sid == 0 and first is not None else sched._build_slots(*args)
                first = None
            elif call.startswith("warming."):
                getattr(table[sid].warming, call.split(".", 1)[1])(*args)
            else:
                getattr(table[sid], call)(*args)
                if call == "close":
                    table.pop(sid)
        except BaseException as e:  # noqa: BLE001 - compared with process 0's outcome at the next message
            outcome = type(e).__name__
            log.debug("follower: %s raised %s", call, outcome, exc_info=True)
        last = (call, outcome)
        calls += 1
    for slots in table.values():
        slots.close()
    return calls


__all__ = ["BLOCK", "Channel", "PREFIX", "RecordedSlots", "RecordedWarming", "Recorder", "follow"]
