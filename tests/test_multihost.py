"""Several processes: the generate command run by 2 local processes of 4 CPU devices each
(gloo collectives), on one (data=2, model=4) mesh spanning both, gives the tokens of one
process (greedy, lookahead and SpecInfer, at temperature 0 and sampled; RaLM and RaLMSpec
over a BM25 index; speculative KNN-LM, exact search and faiss's); processes given different
flags stop at start; a killed process ends the other; a stalled one (alive, its main thread
stuck in host code) ends both.

Each run is 2 children of `multihost_worker.py` (the command with the tiny random model of
a fixed seed, so both processes hold the same weights) with a free port for the
coordinator and a timeout, so a hang fails the test instead of hanging the suite. The
decoding runs compile for minutes on a 2-core CPU: they are marked slow.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from lookahead_jax.generate import generate
from lookahead_jax.strategies import KNNLM, RaLM, SpecInfer
from multihost_worker import DRAFT, Tokenizer, tiny_draft, tiny_multihost

TESTS = pathlib.Path(__file__).resolve().parent
WORKER = TESTS / "multihost_worker.py"
MESH = "data=2,model=4"
MESH_TP = "model=8"  # one model over both processes' devices
# repeated text, so that lookahead's drafts are accepted (the tiny model repeats too)
PROMPTS = ["the cat sat on the mat, the cat sat on the mat, the cat", "abcabcabcabc", "1 2 3 1 2 3 1 2 3",
           "hello hello hello", "to be or not to be", "aaaa bbbb aaaa bbbb", "x = x + 1; x = x + 1;", "la la la"]
NEW = 24
RUN_S = 400  # one 2-process run at most (compiling on a busy 2-core machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), e.get("PYTHONPATH", "")])
    return e


def start(tmp_path, commands, port=None, extra_env=None):
    """2 worker processes; commands[i]: process i's command lines (lists of args), run in turn."""
    port = port or free_port()
    environ = dict(env(), **(extra_env or {}))
    procs = []
    for pid, cmds in enumerate(commands):
        argv = []
        for c in cmds:
            argv += (["--then"] if argv else []) + c + [
                "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)]
        out, err = open(tmp_path / f"p{pid}.out", "w"), open(tmp_path / f"p{pid}.err", "w")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *argv], stdout=out, stderr=err, env=environ,
                                      cwd=tmp_path))
    return procs


def finish(tmp_path, procs, timeout=RUN_S):
    """(exit statuses, stdouts, stderrs); a process still running after `timeout` fails the test."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a process ran past {timeout} s:\n" + read(tmp_path, "err")[0][-3000:])
    return [p.returncode for p in procs], read(tmp_path, "out"), read(tmp_path, "err")


def read(tmp_path, kind) -> list:
    return [(tmp_path / f"p{i}.{kind}").read_text(errors="replace") for i in range(2)]


def json_runs(stdout: str) -> list:
    """Per command: (its JSON rows, its summary)."""
    runs = []
    for part in stdout.split("--- end of command")[:-1]:
        objs = [json.loads(line) for line in part.splitlines() if line.startswith("{")]
        runs.append(([o for o in objs if "summary" not in o], [o["summary"] for o in objs if "summary" in o][0]))
    return runs


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return str(path)


def bm25_corpus(tmp_path, monkeypatch) -> str:
    """A corpus of 40 passages of 4 of the prompts' words (and a few others) whose BM25 index
    is built in a cache the worker processes share (LOOKAHEAD_JAX_CACHE, inherited)."""
    pytest.importorskip("bm25s")
    pytest.importorskip("Stemmer")
    import re

    import numpy as np

    from lookahead_jax.retrieval import build_index

    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "cache"))
    words = sorted({w.lower() for p in PROMPTS for w in re.findall(r"[A-Za-z0-9]+", p)} | {"river", "king", "music"})
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": " ".join(rng.choice(words, 4))}) + "\n"
                            for i in range(40)))
    build_index("bm25", str(path), progress=False)
    return str(path)


def knn_datastore(tmp_path) -> str:
    """A KNN-LM datastore of the tiny model (built here, read by the workers: 770 entries):
    each prompt followed by the model's own continuation, text the decoding meets again."""
    pytest.importorskip("faiss")
    from lookahead_jax.knnlm import build_datastore
    from lookahead_jax.retrieval import Corpus

    model, tok = tiny_multihost(), Tokenizer()
    out = generate(model, tok, PROMPTS, max_new_tokens=40)
    passages = [p + tok.decode(t) for p, t in zip(PROMPTS, out.token_ids)]
    return str(build_datastore(model, tok, Corpus.from_passages(passages), path=tmp_path / "ds", progress=False))


@pytest.mark.slow
def test_every_strategy_over_two_processes_gives_one_process_tokens(tmp_path, prompts_file, monkeypatch):
    """One launch of 2 processes runs every command in turn (the compiled programs shared):
    greedy, lookahead, SpecInfer (greedy with its auto budget; sampled, mss, with its draft
    probabilities), RaLM and RaLMSpec (--async-verify: process 0 verifies, its answers broadcast),
    speculative KNN-LM (exact search, cache speculation, OS3's stride; sampled, faiss flat
    search and IVF candidates) against plain KNN-LM on one device; and lookahead on a mesh
    whose 'model' axis spans both processes (tensor parallel over them)."""
    corpus, datastore = bm25_corpus(tmp_path, monkeypatch), knn_datastore(tmp_path)
    base = ["--prompts-file", prompts_file, "--batch-size", "8", "--max-new-tokens", str(NEW), "--json",
            "--mesh", MESH]
    look, sample = ["--strategy", "lookahead", "--decoding-length", "8"], ["--temperature", "0.8", "--seed", "3"]
    spec = ["--strategy", "specinfer", "--draft-model", DRAFT]
    # sampled SpecInfer's tokens depend on which steps drafted: every step drafts (fixed), and
    # the draft's f32 weights as one device runs them
    spec_sampled = spec + ["--budget", "fixed", "--draft-weights", "float32"] + sample
    rag = ["--retriever", "bm25", "--corpus", corpus, "--stride", "2", "--query-tokens", "16",
           "--max-passage-tokens", "64"]
    knn = ["--strategy", "knnlm", "--datastore", datastore, "--knn-k", "4", "--speculative"]
    cmds = [base, base + look, base + sample, base + look + sample, base + spec, base + spec_sampled,
            base + ["--strategy", "ralm"] + rag, base + ["--strategy", "ralmspec", "--async-verify"] + rag,
            base + knn + ["--speculation-stride", "auto"],
            base + knn + ["--knn-search", "flat", "--knn-speculate", "ivf"] + sample,
            # tensor parallel across the processes: the 'model' axis spans both, so each holds
            # only part of a split weight (their engines must not read it back whole)
            [MESH_TP if a == MESH else a for a in base] + look]
    t0 = time.monotonic()
    # 8 commands: 789 s here under a load average of ~10 on 2 cores; 10 (knnlm too): 260 s at ~4 (a hang
    # guard, not a target)
    rcs, outs, errs = finish(tmp_path, start(tmp_path, [cmds, cmds]), timeout=3 * RUN_S)
    took = time.monotonic() - t0
    assert rcs == [0, 0], errs[0][-3000:] + errs[1][-3000:]
    # one process, one device
    model, tok = tiny_multihost(), Tokenizer()
    greedy = generate(model, tok, PROMPTS, max_new_tokens=NEW).token_ids
    sampled = generate(model, tok, PROMPTS, max_new_tokens=NEW, temperature=0.8, seed=3).token_ids
    assert sampled != greedy
    spec_want = generate(model, tok, PROMPTS, max_new_tokens=NEW, temperature=0.8, seed=3,
                         strategy=SpecInfer(draft_model=tiny_draft(), budget="fixed", draft_weights="float32"))
    ralm = generate(model, tok, PROMPTS, max_new_tokens=NEW, strategy=RaLM(
        retriever="bm25", corpus=corpus, stride=2, query_tokens=16, max_passage_tokens=64))
    knn_want = generate(model, tok, PROMPTS, max_new_tokens=NEW, strategy=KNNLM(datastore=datastore, knn_k=4))
    knn_sampled = generate(model, tok, PROMPTS, max_new_tokens=NEW, temperature=0.8, seed=3,
                           strategy=KNNLM(datastore=datastore, knn_k=4, knn_search="flat"))
    assert knn_want.token_ids != greedy and knn_sampled.token_ids != sampled  # the neighbours change tokens
    runs = json_runs(outs[0])
    assert len(runs) == len(cmds), outs[0][-2000:]
    names = ("greedy", "lookahead") * 2 + ("specinfer",) * 2 + ("ralm", "ralmspec") + ("knnlm",) * 2 + ("lookahead",)
    wants = (greedy, greedy, sampled, sampled, greedy, spec_want.token_ids, ralm.token_ids, ralm.token_ids,
             knn_want.token_ids, knn_sampled.token_ids, greedy)
    for (rows, summary), strategy, want in zip(runs, names, wants):
        assert summary["strategy"] == strategy
        assert [r["token_ids"] for r in sorted(rows, key=lambda r: r["prompt_index"])] == want, strategy
    # lookahead and SpecInfer drafted and had drafts accepted: the broadcast plans were real trees
    assert all(runs[i][1]["tokens_per_step"] > 1.0 for i in (1, 3, 4, 5, 10)), [runs[i][1] for i in (1, 3, 4, 5, 10)]
    # the passages of one process (re-prefills included), and ralmspec speculated
    for rows, _ in runs[6:8]:
        got = [r["retrieval"]["passages"] for r in sorted(rows, key=lambda r: r["prompt_index"])]
        assert got == [r.retrieval["passages"] for r in ralm.rows]
    assert ralm.stats["retrieval"]["reprefills"] > 0, ralm.stats["retrieval"]
    assert runs[7][1]["retrieval"]["speculations"] > 0, runs[7][1]["retrieval"]
    # speculative KNN-LM speculated, had lists verified wrong and rolled back (exact, cache), right (ivf)
    exact, ivf = runs[8][1]["retrieval"], runs[9][1]["retrieval"]
    assert exact["speculations"] > 0 and exact["rollbacks"] > 0 and exact["search"] == "exact", exact
    assert ivf["speculation_hits"] > 0 and (ivf["search"], ivf["speculate"]) == ("flat", "ivf"), ivf
    # ralmspec verified asynchronously over both processes (process 0's worker, its answers broadcast)
    assert "speculations_while_verifying" in runs[7][1]["retrieval"], runs[7][1]["retrieval"]
    assert outs[1].count("{") == 0  # process 1 computes the same, prints nothing
    print(f"2-process greedy, lookahead (also tensor parallel over both), specinfer, ralm, ralmspec and knnlm: "
          f"{took:.0f} s")


@pytest.mark.parametrize("flags,error", [
    (["--num-processes", "2", "--process-id", "0"], "need --coordinator-address HOST:PORT"),
    (["--coordinator-address", "h:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id 2 is out of range for --num-processes 2 (0..1)"),
    (["--coordinator-address", "h:1", "--num-processes", "0"], "--num-processes must be >= 1"),
    (["--coordinator-address", "h", "--num-processes", "2"], "--coordinator-address must look like HOST:PORT"),
])
def test_bad_process_flags_are_one_error_line(flags, error, capsys):
    from lookahead_jax.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--prompt", "x", *flags])
    assert e.value.code == 2
    assert error in capsys.readouterr().err


def test_processes_given_different_flags_stop_at_start(tmp_path, prompts_file):
    base = ["--prompts-file", prompts_file, "--batch-size", "8", "--mesh", MESH]
    procs = start(tmp_path, [[base + ["--max-new-tokens", "8"]], [base + ["--max-new-tokens", "9"]]])
    rcs, _, errs = finish(tmp_path, procs, timeout=120)
    assert rcs == [2, 2], errs
    for err in errs:
        assert "error: process 1 of 2 runs a different configuration than process 0" in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_ends_the_other_within_30_s(tmp_path, prompts_file, victim):
    """Process `victim` is killed (SIGKILL) while they decode: the other exits non-zero
    within 30 s with one line naming it (process 0: the coordinator, whose loss JAX's
    client reports itself)."""
    cmd = ["--prompts-file", prompts_file, "--batch-size", "1", "--max-new-tokens", "200", "--mesh", MESH]
    procs = start(tmp_path, [[cmd], [cmd]])
    deadline = time.monotonic() + RUN_S
    while "--- prompt 1" not in read(tmp_path, "out")[0]:  # decoding its second prompt: past compiling
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail("the run did not reach its second prompt:\n" + read(tmp_path, "err")[0][-3000:])
        time.sleep(0.5)
    procs[victim].kill()
    t0 = time.monotonic()
    survivor = procs[1 - victim]
    try:
        rc = survivor.wait(30)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail(f"process {1 - victim} still ran 30 s after process {victim} was killed")
    took = time.monotonic() - t0
    err = read(tmp_path, "err")[1 - victim]
    assert rc != 0
    if victim:  # the heartbeat watcher's line
        lines = [line for line in err.splitlines()
                 if line.startswith("error: process 0 of 2:") and "process 1 stopped" in line]
    else:  # the coordinator gone: JAX's client aborts at once (its line names the leader, task 0),
        # or the watcher's line comes first
        lines = [line for line in err.splitlines() if "process 0 (the coordinator) is unreachable" in line
                 or ("Terminating process because the JAX distributed service detected fatal errors" in line
                     and "the leader task was preempted/died" in line)]
    assert lines, err[-3000:]
    print(f"process {1 - victim} exited {took:.1f} s after process {victim} was killed: {lines[-1][:300]}")


STALL_S = 10  # the stall runs' --stall-timeout


@pytest.mark.slow
@pytest.mark.parametrize("stalled", [None, 1, 0])
def test_a_stalled_process_ends_both_within_bounded_time(tmp_path, prompts_file, stalled):
    """Process `stalled`'s main thread sleeps for good before its 12th collective, mid-decode
    (`multihost_worker.stall_before`; its heartbeat thread runs on): the other, waiting in
    the step after, exits 3 within --stall-timeout + 20 s with one line naming it as
    stalled, and the stalled one then ends too (its watcher sees the other's heartbeat
    stop, or JAX's client the coordinator gone) within 30 s. None: no stall, the same
    flags: the run finishes (the short timeout does not fire while they compile or step)."""
    cmd = ["--prompts-file", prompts_file, "--batch-size", "8", "--max-new-tokens", str(NEW), "--mesh", MESH,
           "--stall-timeout", str(STALL_S)]
    extra = {} if stalled is None else {"LOOKAHEAD_TEST_STALL_AT": f"{stalled}:12"}
    t0 = time.monotonic()
    procs = start(tmp_path, [[cmd], [cmd]], extra_env=extra)
    if stalled is None:
        rcs, outs, errs = finish(tmp_path, procs)
        assert rcs == [0, 0], errs[0][-3000:] + errs[1][-3000:]
        assert outs[0].count("--- prompt") == len(PROMPTS), outs[0][-2000:]
        print(f"2-process greedy with --stall-timeout {STALL_S}: {time.monotonic() - t0:.1f} s, exit 0")
        return
    waiter, victim = procs[1 - stalled], procs[stalled]

    def bounded(p, seconds, what):
        try:
            return p.wait(seconds)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{what}:\n" + "\n".join(e[-3000:] for e in read(tmp_path, "err")))

    while "stalling before collective" not in read(tmp_path, "err")[stalled]:
        if time.monotonic() - t0 > RUN_S or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail("the run did not reach the stall:\n" + "\n".join(e[-3000:] for e in read(tmp_path, "err")))
        time.sleep(0.2)
    t_stall = time.monotonic()
    rc = bounded(waiter, STALL_S + 20, f"process {1 - stalled} still ran {STALL_S + 20} s into process {stalled}'s stall")
    t_waiter = time.monotonic()
    rc_victim = bounded(victim, 30, f"the stalled process {stalled} still ran 30 s after the other ended")
    t_victim = time.monotonic()
    errs = read(tmp_path, "err")
    assert rc == 3, errs[1 - stalled][-3000:]
    lines = [line for line in errs[1 - stalled].splitlines()
             if line.startswith(f"error: process {1 - stalled} of 2: process {stalled} stalled: alive")]
    assert len(lines) == 1, errs[1 - stalled][-3000:]
    assert rc_victim != 0, errs[stalled][-3000:]
    print(f"process {stalled} stalled: process {1 - stalled} exited 3 after {t_waiter - t_stall:.1f} s "
          f"(--stall-timeout {STALL_S}), process {stalled} {t_victim - t_waiter:.1f} s later (status {rc_victim}): "
          f"{lines[0]}")


def test_process_zero_retriever_answers_the_asked_shape():
    """`ProcessZeroRetriever` (RaLM over several processes) pads or cuts process 0's answer
    to [queries, k] (INVALID -1, score -inf), the shape every process allocates for the
    broadcast; with one process it is process 0."""
    import numpy as np

    from lookahead_jax.strategies.ralm import ProcessZeroRetriever

    class Short:  # answers one column whatever k is asked
        corpus = ["a", "b"]

        def retrieve(self, queries, k):
            return np.array([[1]] * len(queries)), np.array([[0.5]] * len(queries), np.float32)

        def retrieve_from(self, queries, candidates, k):
            return np.array([[0, 1, 1]] * len(queries)), np.zeros((len(queries), 3), np.float32)

    r = ProcessZeroRetriever(Short())
    ids, scores = r.retrieve(["x", "y"], 2)
    assert ids.dtype == np.int64 and ids.tolist() == [[1, -1], [1, -1]]
    assert scores.tolist() == [[0.5, -np.inf], [0.5, -np.inf]]
    assert r.retrieve_from(["x"], [[0, 1]], 2)[0].tolist() == [[0, 1]]
    assert r.corpus == ["a", "b"]


def test_a_stall_is_a_live_peer_behind_and_frozen_while_this_process_waits():
    """`stalled_peer` (the watcher's rule) with this process inside collective 13 since
    t=0, a 5 s timeout: fires at t=6 for a peer at 11 unchanged since t=0, and only then."""
    from lookahead_jax.core.multihost import stalled_peer

    inside = (13, True, 0.0)
    assert stalled_peer(inside, {1: (11, 0.0)}, 6.0, 5.0).startswith("process 1 stalled: alive")
    assert stalled_peer(inside, {1: (13, 0.0), 2: (12, 0.5)}, 6.0, 5.0).startswith("process 2 stalled")
    assert stalled_peer(inside, {1: (11, 3.0)}, 6.0, 5.0) is None  # behind, but it moved 3 s ago (host work)
    assert stalled_peer((13, False, 0.0), {1: (11, 0.0)}, 60.0, 5.0) is None  # this one idles (outside)
    assert stalled_peer(inside, {1: (11, 0.0)}, 4.0, 5.0) is None  # not yet the timeout
    assert stalled_peer((13, True, 2.0), {1: (11, 0.0)}, 6.0, 5.0) is None  # inside for 4 s only
    assert stalled_peer(inside, {1: (14, 0.0)}, 60.0, 5.0) is None  # ahead: it waits for this one
    assert stalled_peer(inside, {1: (13, 0.0)}, 60.0, 5.0) is None  # in the same collective
    assert stalled_peer(inside, {1: (11, 0.0)}, 60.0, 0.0) is None  # --stall-timeout 0: off
    assert stalled_peer(inside, {}, 60.0, 5.0) is None


def test_collectives_are_counted_and_the_heartbeat_carries_the_count(monkeypatch):
    """`collective` counts entries and marks inside/outside (also when the call raises);
    a heartbeat value "count:entered:inside" gives its entered count, others None."""
    from lookahead_jax.core import multihost

    monkeypatch.setattr(multihost, "_progress", (7, False, 0.0))
    t = time.monotonic()
    with multihost.collective():
        n, inside, since = multihost.progress()
        assert (n, inside) == (8, True) and since >= t
    assert multihost.progress() == (8, False, since)
    with pytest.raises(KeyError):
        with multihost.collective():
            raise KeyError
    assert multihost.progress()[:2] == (9, False)
    assert [multihost._entered(v) for v in ("12:8:1", "done", None, "12", "a:b:c")] == [8, None, None, None, None]


def test_the_stall_timeout_flag(capsys):
    """--stall-timeout: the same default everywhere (`multihost.STALL_TIMEOUT_S`), a negative
    value is one error line, and it is part of the configuration every process must share
    (the hash `check_same_config` compares)."""
    import dataclasses

    from lookahead_jax.cli import parse_args
    from lookahead_jax.core.multihost import STALL_TIMEOUT_S, config_digest
    from lookahead_jax.serve.__main__ import _config, parser
    from lookahead_jax.serve.server import ServeConfig

    cfg = parse_args(["--prompt", "x"])
    assert cfg.stall_timeout_s == STALL_TIMEOUT_S == ServeConfig().stall_timeout_s
    p = parser()
    assert _config(p, p.parse_args([])).stall_timeout_s == STALL_TIMEOUT_S
    assert _config(p, p.parse_args(["--stall-timeout", "0"])).stall_timeout_s == 0
    short = parse_args(["--prompt", "x", "--stall-timeout", "5"])
    assert short.stall_timeout_s == 5

    def digest(c):
        return config_digest(dataclasses.asdict(dataclasses.replace(c, distributed=())))

    assert digest(short) != digest(cfg)
    with pytest.raises(SystemExit) as e:
        parse_args(["--prompt", "x", "--stall-timeout", "-1"])
    assert e.value.code == 2
    assert "--stall-timeout must be >= 0 seconds" in capsys.readouterr().err
