"""Several processes (hosts) decoding as one: `jax.distributed`, the checks at start, and
the points where host values cross processes (`to_host`, and process 0's choices:
`broadcast_plan` and its packed forms `agree_drafts`, `agree_choice`).

    init_distributed(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=0)
    mesh = make_mesh(data=2, model=4)          # jax.devices(): every process's devices
    check_same_config({"model": ..., "mesh": ..., "batch": ...})   # a mismatch: one error
    ...
    tokens = to_host(step_out)                 # a global array -> numpy on every process
    plan = broadcast_plan(plan)                # process 0's choice, the same on every process

Every process runs the same programs in the same order (STYLE.md, "Several processes"):
a per-step choice made on the host (drafts, tree shape, budget, bucket) is made on
process 0 and broadcast (`broadcast_plan`), never computed separately, since processes
that pick different shapes hang in their next collective.

Failures: a process that dies stops sending heartbeats to the coordination service; after
`heartbeat_timeout_s` the service reports it and the others' runtime ends them (JAX's
distributed client aborts the process, logging which task it lost). `init_distributed`
sets that timeout (30 s, JAX's own default is 100 s) so a survivor exits within a bounded
time; `watch_peers` (started by `init_distributed`) ends it sooner (15 s) with one plain
line naming the lost process. A process that is alive but stalled (its main thread stuck in host
code while the others wait in the next collective) is found by counting the collectives
(`collective`, `stalled_peer`): the heartbeat carries how many this process has entered.

With one process every function here is a no-op that returns its input (or numpy of it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from typing import Optional

import jax
import numpy as np

log = logging.getLogger("lookahead_jax")

# heartbeat timeout (s) of the coordination service: how long a dead peer goes unnoticed
# (the second bound, after `watch_peers`' PEER_TIMEOUT_S)
HEARTBEAT_TIMEOUT_S = 30
# how long a peer may keep the others waiting in a collective while doing host work (s; 0: no
# limit): longer than the known one-sided host work between two collectives (a model only one
# host downloads, since loading follows the first collective; a faiss HNSW index process 0
# builds at its first search; a compile one process's persistent cache lacks: minutes)
STALL_TIMEOUT_S = 600.0
ENV = ("LOOKAHEAD_COORDINATOR_ADDRESS", "LOOKAHEAD_NUM_PROCESSES", "LOOKAHEAD_PROCESS_ID")


def check_flags(coordinator_address: Optional[str], num_processes: Optional[int],
                process_id: Optional[int], stall_timeout_s: float = STALL_TIMEOUT_S) -> Optional[str]:
    """The error message of a bad combination of the flags, or None."""
    if stall_timeout_s < 0:
        return f"--stall-timeout must be >= 0 seconds (0: off), got {stall_timeout_s:g}"
    if num_processes is not None and num_processes < 1:
        return f"--num-processes must be >= 1, got {num_processes}"
    if process_id is not None and process_id < 0:
        return f"--process-id must be >= 0, got {process_id}"
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        return f"--process-id {process_id} is out of range for --num-processes {num_processes} (0..{num_processes - 1})"
    given = [n for n, v in (("--num-processes", num_processes), ("--process-id", process_id)) if v is not None]
    if given and coordinator_address is None and (num_processes or 0) > 1:
        return f"{' and '.join(given)} need --coordinator-address HOST:PORT (process 0's address)"
    if coordinator_address is not None:
        host, _, port = coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            return f"--coordinator-address must look like HOST:PORT, got {coordinator_address!r}"
    return None


def init_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                     process_id: Optional[int] = None, *, auto: bool = False,
                     heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
                     stall_timeout_s: float = STALL_TIMEOUT_S) -> bool:
    """`jax.distributed.initialize`, before any other JAX call. Returns whether it ran.

    Nothing given (and auto False) and no LOOKAHEAD_* variables: one process, nothing done.
    auto: let JAX detect the cluster (TPU pod slices, SLURM, Open MPI) from its environment.
    On CPU the cross-process collectives go through gloo (`jax_cpu_collectives_implementation`).
    stall_timeout_s: `stalled_peer`'s limit (0: off), also set by a second call in the same
    processes (a later command), whose watcher is the first one's."""
    global _stall_timeout_s
    env = [os.environ.get(k) or None for k in ENV]
    for name, value in zip(ENV[1:], env[1:]):
        if value is not None and not value.isdigit():
            raise ValueError(f"{name} must be a whole number, got {value!r}")
    coordinator_address = coordinator_address or env[0]
    num_processes = num_processes if num_processes is not None else (int(env[1]) if env[1] else None)
    process_id = process_id if process_id is not None else (int(env[2]) if env[2] else None)
    if coordinator_address is None and num_processes in (None, 1) and not auto:
        return False
    _stall_timeout_s = float(stall_timeout_s)
    if jax.distributed.is_initialized():  # a second command in the same processes (tests)
        return True
    error = check_flags(coordinator_address, num_processes, process_id)
    if error:
        raise ValueError(error)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # (the CPU backend's only)
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
    watch_peers()
    log.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())
    return True


def multiprocess() -> bool:
    return jax.process_count() > 1


# ----------------------------------------------------------------------------- collectives
# this process's host collectives: (how many it entered, whether it is inside the last one,
# when it entered it by time.monotonic()); one tuple, replaced whole, read by the heartbeat
_progress = (0, False, 0.0)
_stall_timeout_s = STALL_TIMEOUT_S


@contextlib.contextmanager
def collective():
    """Around each host-side collective of ours (`to_host`, `broadcast_plan`,
    `check_same_config`: every process enters them in the same order, so their count is
    the same point of the program on every process). The heartbeat (`watch_peers`) sends
    the count, which is how a waiting process tells a stalled peer (alive, behind, its count
    frozen) from a busy or idle one. Costs a tuple: nothing crosses processes here."""
    global _progress
    _progress = (_progress[0] + 1, True, time.monotonic())
    try:
        yield
    finally:
        _progress = (_progress[0], False, _progress[2])


def progress() -> tuple:
    """(collectives entered, inside one now, when it entered it: time.monotonic())."""
    return _progress


def stalled_peer(mine: tuple, peers: dict, now: float, timeout_s: float) -> Optional[str]:
    """Why a live peer is stalled, or None: this process has been inside its collective N
    for more than `timeout_s` while the peer has entered only collectives before N and that
    number has not changed for `timeout_s`. mine: `progress()`; peers: {process: (its
    collectives entered, when this host saw that number change)}, live peers only (their
    heartbeat moves); now and the times: this host's time.monotonic(); timeout_s 0: off.

    What it leaves alone: a peer doing host work whose number still moves, or that is
    ahead (it waits for this one); any peer while this process is outside a collective
    (an idle server, its own host work); a wait shorter than the timeout (compiling,
    an index only process 0 builds). A peer stalled while this process idles (process 0's
    engine thread stuck while a follower waits for its next call) looks idle: not found."""
    entered, inside, since = mine
    if timeout_s <= 0 or not inside or now - since <= timeout_s:
        return None
    for q, (theirs, moved) in sorted(peers.items()):
        if theirs < entered and now - moved > timeout_s:
            return (f"process {q} stalled: alive, but it has not reached collective {entered} in "
                    f"{now - since:.0f} s (it is at {theirs}; --stall-timeout {timeout_s:g} s)")
    return None


# ----------------------------------------------------------------------------- host values
def to_host(tree):
    """Every array leaf of `tree` as numpy, the whole global value on every process (a
    collective when a leaf spans other processes' devices: call it on every process, in
    the same order). None leaves stay None."""
    if not multiprocess():
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    with collective():  # (a replicated leaf's read waits for the step that every process runs)
        return jax.tree.map(get, tree)


def broadcast_plan(tree):
    """Process 0's value of `tree` (numpy arrays / scalars) on every process: the one
    broadcast point of a step's host choices. Leaves go in one packed buffer per dtype."""
    if not multiprocess():
        return tree
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    with collective():
        out = multihost_utils.broadcast_one_to_all(arrays)
    return jax.tree.unflatten(treedef, [np.asarray(o).astype(a.dtype).reshape(a.shape)
                                        for o, a in zip(out, arrays)])


def padded(x, n: int, k: int, fill, dtype) -> np.ndarray:
    """x [n, <= k] (process 0's answer, e.g. a retrieval's ids; None on the other processes)
    in an [n, k] array of `dtype`, `fill` past its columns: the shape every process knows
    before it takes part in process 0's `broadcast_plan` of it."""
    out = np.full((n, k), fill, dtype)
    if x is not None:
        x = np.asarray(x)
        m = min(k, x.shape[1] if x.ndim == 2 else 0)
        out[:, :m] = x[:, :m]
    return out


def agree_drafts(drafts, T: int):
    """(drafts, T) of process 0 on every process: a step's host plan (the drafts after the
    budget's cut, the tree bucket after any fallback) in one packed int32 buffer
    [T, then per row: n, tokens[MAX_NODES], parents[MAX_NODES]]. Process 0 keeps its own
    objects; the others get Drafts of the same tokens and parents (their classes and
    estimates only feed their own budget, whose choices are not used).

    Draft probabilities (a draft model's `q [B,1+N,V]`, sampled SpecInfer) are not sent:
    they are a global device array, the output of the draft's program that every process
    ran on the same inputs (its budget's choice agreed before it ran: `agree_choice`), so
    every process holds the same one; each keeps its own."""
    from .drafts import Draft, DraftBatch
    from .tree import MAX_NODES

    B, N = len(drafts), MAX_NODES
    buf = np.zeros(1 + B * (1 + 2 * N), np.int32)
    buf[0] = T
    rows = buf[1:].reshape(B, 1 + 2 * N)
    for b, d in enumerate(drafts.drafts):
        n = len(d)
        rows[b, 0], rows[b, 1:1 + n], rows[b, 1 + N:1 + N + n] = n, d.tokens, d.parents
    got = broadcast_plan(buf)
    if jax.process_index() == 0:
        return drafts, T
    rows = got[1:].reshape(B, 1 + 2 * N)
    out = []
    for r in rows:
        n = int(r[0])
        out.append(Draft([int(t) for t in r[1:1 + n]], [int(p) for p in r[1 + N:1 + N + n]]))
    return DraftBatch(tuple(out), probs=drafts.probs), int(got[0])


def agree_choice(*values: int) -> tuple:
    """Process 0's small integers (a budget's choice made before a step's draft model runs:
    whether to draft, whether it is a probe) on every process, in one int32 buffer. The
    draft model's programs span every process's devices, so every process must run them
    alike: the choice cannot wait for `agree_drafts`, which comes after them."""
    if not multiprocess():
        return tuple(int(v) for v in values)
    return tuple(int(v) for v in broadcast_plan(np.asarray(values, np.int32)))


# ----------------------------------------------------------------------------- checks
def config_digest(config: dict) -> str:
    """A short hash of `config` (JSON, sorted keys; values turned to str where not JSON)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_same_config(config: dict) -> None:
    """Every process hashes `config` (model, strategy options, mesh, batch, dtype, ...) and
    the hashes are all-gathered: a process whose hash differs from process 0's is a
    ValueError naming it (on every process), before any decoding collective could hang."""
    if not multiprocess():
        return
    from jax.experimental import multihost_utils

    mine = np.frombuffer(bytes.fromhex(config_digest(config)), np.uint8)
    with collective():
        every = np.asarray(multihost_utils.process_allgather(mine))  # [P, 8]
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise ValueError(
            f"process {', '.join(map(str, differ))} of {every.shape[0]} runs a different configuration "
            f"than process 0 (model, strategy options, mesh, batch, dtype, prompts): give every process "
            f"the same flags (this is process {jax.process_index()}, config hash {config_digest(config)})")


# a peer whose heartbeat has not moved for this long is gone. A live process's heartbeat
# thread can wait seconds for the GIL: a compiled program written to the compilation cache
# holds it while serialized (0.5 s for a 1,500-op program on a quiet 2-core host; a follower
# of a 2-process server once saw process 0's heartbeat stand still for 5 s on a loaded CI
# host and ended both). 15 s: 3x that, still half of JAX's own bound.
PEER_TIMEOUT_S = 15.0
COORDINATOR_TIMEOUT_S = 60.0  # the same for process 0, whose death ends the others at once anyway
_HB = "lookahead_jax/heartbeat/"


def watch_peers(timeout_s: float = PEER_TIMEOUT_S, every_s: float = 1.0, grace_s: float = 60.0) -> bool:
    """Start a daemon thread that keeps this process's heartbeat in the coordination
    service's key-value store ("count:entered:inside", every `every_s`: a counter and
    `progress()`, in one write) and reads every peer's: a peer whose counter has not moved
    for `timeout_s` (seen by this host's clock; `grace_s` for its first one; a look of this
    thread's that came late, its own process held up, restarts every peer's clock), a coordinator
    that no longer answers, or a peer `stalled_peer` finds stalled (the limit set by
    `init_distributed`) ends this process at once with one line naming the process (exit
    status 3), before JAX's own heartbeat timeout (`init_distributed`) aborts it with a
    stack trace. A stalled peer is ended in turn by its own watcher, when the heartbeats of
    the processes that left stop. A process that ends normally marks its heartbeat "done"
    (atexit) and is not waited for. Returns whether it started (it needs the distributed
    client, which JAX keeps in `jax._src.distributed`)."""
    import atexit
    import threading

    try:
        from jax._src import distributed
        client = distributed.global_state.client
    except (ImportError, AttributeError):
        client = None
    if client is None or not multiprocess():
        return False
    me, n = jax.process_index(), jax.process_count()
    seen = {}  # peer -> (its last value, when it changed, by this host's clock)
    moved = {}  # peer -> (its collectives entered, when that changed, by this host's clock)
    start = time.monotonic()

    def gone(line: str) -> None:
        print(f"error: process {me} of {n}: {line}; ending this process", file=sys.stderr, flush=True)
        os._exit(3)

    stop = threading.Event()

    def loop():
        count, last_look = 0, start
        while not stop.is_set():
            count += 1
            entered, inside, _ = mine = _progress
            try:
                client.key_value_set(f"{_HB}{me}", f"{count}:{entered}:{int(inside)}", allow_overwrite=True)
                values = dict(client.key_value_dir_get(_HB))
            except Exception as e:  # noqa: BLE001 - any failure of the service: the coordinator is gone
                if me == 0:
                    gone(f"the coordination service failed ({str(e).splitlines()[0][:200]})")
                gone(f"process 0 (the coordinator) is unreachable ({str(e).splitlines()[0][:200]})")
            now = time.monotonic()
            # this thread itself held up (its process busy, or the host): peers starved by
            # the same load wrote nothing either; their clocks restart from this look
            late = now - last_look > 2 * every_s + 1.0
            last_look = now
            for q in range(n):
                if q == me:
                    continue
                v = values.get(f"{_HB}{q}")
                if v == "done":
                    moved.pop(q, None)  # (it ended normally: neither dead nor stalled)
                    continue
                last, since = seen.get(q, (None, start))
                # process 0 hosts the coordination service: its death fails this thread's
                # calls at once (above), so a still heartbeat of its is only a hang, given
                # COORDINATOR_TIMEOUT_S (a live process 0 once held its heartbeat for >5 s
                # mid-compile on a loaded host)
                limit = timeout_s if q else max(timeout_s, COORDINATOR_TIMEOUT_S)
                if v != last or late and last is not None:
                    seen[q] = (v, now)
                elif now - since > (limit if last is not None else grace_s):
                    gone(f"process {q} stopped (no heartbeat for {now - since:.0f} s: it died or hangs)")
                theirs = _entered(v)
                if theirs is not None and moved.get(q, (None,))[0] != theirs:
                    moved[q] = (theirs, now)
            stalled = stalled_peer(mine, moved, now, _stall_timeout_s)
            if stalled:
                gone(stalled)
            stop.wait(every_s)

    def done():
        # the thread ends first: a daemon thread still inside a call of the distributed
        # client when the interpreter finalizes is ended by pthread_exit inside C++ code,
        # which aborts the process ("FATAL: exception not rethrown", exit -6: a follower of
        # the 2-process server ended so after its engine had ended normally)
        stop.set()
        thread.join(timeout=10 * every_s)
        try:
            client.key_value_set(f"{_HB}{me}", "done", allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the service may be gone already
            pass

    atexit.register(done)
    thread = threading.Thread(target=loop, name="lookahead-heartbeat", daemon=True)
    thread.start()
    return True


def _entered(value: Optional[str]) -> Optional[int]:
    """The collectives entered that a heartbeat value ("count:entered:inside") carries, or
    None (no value yet, "done", or another version's plain counter)."""
    parts = (value or "").split(":")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def exit_on_failure(exc: BaseException) -> None:
    """An error escaped the decoding of one of several processes: the others would wait in
    their next collective, and a collective that lost its peer raises here too. Print the
    traceback, give the heartbeat watcher (`watch_peers`) the time to name a lost peer
    (it ends the process), else end it with one line (exit status 3): never wait out the
    runtime's shutdown barrier. One process: returns (the caller re-raises)."""
    if not multiprocess():
        return
    import traceback

    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    time.sleep(PEER_TIMEOUT_S + 2)
    print(f"error: process {jax.process_index()} of {jax.process_count()}: {type(exc).__name__}: "
          f"{str(exc).splitlines()[0][:300] if str(exc) else ''}; ending this process", file=sys.stderr, flush=True)
    os._exit(3)


__all__ = [
    "ENV", "HEARTBEAT_TIMEOUT_S", "PEER_TIMEOUT_S", "agree_choice", "agree_drafts", "broadcast_plan", "check_flags",
    "STALL_TIMEOUT_S", "check_same_config", "collective", "config_digest", "exit_on_failure", "init_distributed",
    "multiprocess", "progress", "stalled_peer", "to_host", "watch_peers",
]
