"""The resumable KNN-LM datastore build (lookahead_jax/knnlm/build.py) on the tiny llama.

A build killed for real (SIGKILL to a subprocess) and rerun gives the store of an
uninterrupted build bit for bit (keys, values, offsets, meta) and forwards only the passages
it had not kept; so does one stopped by an error or by Ctrl-C (BuildInterrupted, the CLI's
exit 130 and one line); a partial build of other settings is discarded and rebuilt whole.
BATCH_TOKENS is made small (many forwards over a small corpus) and COMMIT_S 0 (progress
committed after every forward) unless a test needs the commit on stopping alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import lookahead_jax.loading as loading
from lookahead_jax.knnlm import build as D
from lookahead_jax.knnlm import BuildInterrupted, build_datastore, load_datastore
from lookahead_jax.retrieval import Corpus
from tiny import tiny_model

TESTS = Path(__file__).parent
BATCH_TOKENS = 64  # rows per forward: 4 passages of <= 16 tokens, 2 of <= 32, 1 of <= 64
WORDS = "the quick brown fox jumps over a lazy dog while seven old owls sing softly".split()


def passages() -> list:
    rng = np.random.default_rng(3)
    out = [" ".join(rng.choice(WORDS, int(n))) for n in rng.integers(1, 12, 26)]
    out[5] = ""  # no entries: the build's last, forward-less batch
    return out


N_PASSAGES = len(passages())
N_FORWARDED = N_PASSAGES - 1


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    monkeypatch.setattr(D, "BATCH_TOKENS", BATCH_TOKENS)
    monkeypatch.setattr(D, "COMMIT_S", 0.0)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    f.write_text(Corpus.from_passages(passages()).to_jsonl())
    return f


@pytest.fixture(scope="module")
def reference(model, tok, corpus_file, tmp_path_factory):
    """An uninterrupted build (float16 keys) -> its directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "BATCH_TOKENS", BATCH_TOKENS)
        path = build_datastore(model, tok, corpus_file, path=tmp_path_factory.mktemp("ref") / "ds", progress=False)
    return path


def assert_same_store(a: Path, b: Path):
    for name in ("keys", "values", "offsets"):
        x, y = np.load(a / f"{name}.npy"), np.load(b / f"{name}.npy")
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x.view(f"u{x.itemsize}"), y.view(f"u{y.itemsize}"), err_msg=name)  # bitwise
    ma, mb = (json.loads((p / "meta.json").read_text()) for p in (a, b))
    for m in (ma, mb):
        del m["build_s"], m["created"]
    assert ma == mb
    assert not D.partial_dir(a).exists() and not D.partial_dir(b).exists()
    assert sorted(os.listdir(a)) == sorted(os.listdir(b)) == ["keys.npy", "meta.json", "offsets.npy", "values.npy"]


def count_forwards(monkeypatch, fail_at=None, exc=RuntimeError):
    """Wrap the build's forward: counts the passages forwarded (rows starting with BOS);
    the call number `fail_at` (1-based) raises `exc` instead."""
    seen = {"calls": 0, "passages": 0}
    orig = D._hidden_fn

    def hidden_fn(*a):
        fn = orig(*a)

        def counted(params, tokens):
            seen["calls"] += 1
            if seen["calls"] == fail_at:
                raise exc("injected")
            seen["passages"] += int((np.asarray(tokens)[:, 0] != 0).sum())
            return fn(params, tokens)

        return counted

    monkeypatch.setattr(D, "_hidden_fn", hidden_fn)
    return seen


def progress_of(path: Path) -> dict:
    return json.loads((D.partial_dir(path) / "progress.json").read_text())


KILLED_BUILD = """
import sys, time
sys.path.insert(0, {tests!r})
from lookahead_jax.core.compile import enable_compilation_cache
from lookahead_jax.knnlm import build as D
from tiny import ByteTokenizer, tiny_model
enable_compilation_cache("xla-tests")  # as conftest does: the shapes the reference build compiled
D.BATCH_TOKENS, D.COMMIT_S = {batch}, 0.0
orig = D._hidden_fn
def slow(*a):
    fn = orig(*a)
    def forward(params, tokens):
        time.sleep(0.5)  # a window to be killed in, between committed forwards
        return fn(params, tokens)
    return forward
D._hidden_fn = slow
D.build_datastore(tiny_model("llama", seed=1), ByteTokenizer(), sys.argv[1], path=sys.argv[2], progress=False)
"""


def test_killed_build_resumes_to_the_same_store(model, tok, corpus_file, reference, tmp_path, monkeypatch,
                                                capsys):
    """SIGKILL mid-build (some but not all passages committed), then the same build: the
    uninterrupted store bit for bit, forwarding only the passages not kept."""
    out = tmp_path / "ds"
    script = tmp_path / "build.py"
    script.write_text(KILLED_BUILD.format(tests=str(TESTS), batch=BATCH_TOKENS))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, str(script), str(corpus_file), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    killed, t_end = False, time.monotonic() + 120
    try:
        while time.monotonic() < t_end and proc.poll() is None:
            try:
                done = progress_of(out)["passages_done"]
            except (OSError, ValueError):
                done = 0
            if 0 < done < N_FORWARDED:
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.02)
    finally:
        proc.kill()
        log = proc.communicate()[0].decode(errors="replace")
    assert killed and proc.wait() == -signal.SIGKILL, f"the build was not killed mid-way (rc {proc.returncode}):\n{log}"
    kept = progress_of(out)
    assert 0 < kept["passages_done"] < N_FORWARDED and not (out / "meta.json").exists()
    capsys.readouterr()
    seen = count_forwards(monkeypatch)
    assert build_datastore(model, tok, corpus_file, path=out, progress=False) == out
    err = capsys.readouterr().err
    assert f"resuming build at passage {kept['passages_done']}/{N_PASSAGES} " in err
    assert_same_store(out, reference)
    assert seen["passages"] == N_FORWARDED - kept["passages_done"]  # nothing forwarded twice
    assert load_datastore(model, corpus_file, out).size == load_datastore(model, corpus_file, reference).size


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_stopped_build_keeps_its_passages(model, tok, corpus_file, reference, tmp_path, monkeypatch, capsys,
                                          exc):
    """An error or Ctrl-C in the 4th forward: the 3 finished ones are committed (Ctrl-C says
    so in BuildInterrupted); the rerun forwards the rest and gives the same store."""
    out = tmp_path / "ds"
    monkeypatch.setattr(D, "COMMIT_S", 1e9)  # no commit but the one on stopping
    count_forwards(monkeypatch, fail_at=4, exc=exc)
    with pytest.raises(BuildInterrupted if exc is KeyboardInterrupt else RuntimeError, match="injected|kept") as e:
        build_datastore(model, tok, corpus_file, path=out, progress=False)
    kept = progress_of(out)["passages_done"]
    batches = D._plan(D.passage_tokens(tok, Corpus.from_jsonl(corpus_file)), load_counts(reference))
    assert kept == sum(len(rows) for _, rows in batches[:3]) and not out.exists()
    if exc is KeyboardInterrupt:
        assert (e.value.kept, e.value.total, e.value.partial) == (kept, N_PASSAGES, D.partial_dir(out))
    lock = D._lock(D.partial_dir(out))  # another build holds the partial build: refused
    with pytest.raises(RuntimeError, match="another build is writing"):
        build_datastore(model, tok, corpus_file, path=out, progress=False)
    lock.close()
    seen = count_forwards(monkeypatch)
    build_datastore(model, tok, corpus_file, path=out, progress=False)
    assert f"resuming build at passage {kept}/{N_PASSAGES} " in capsys.readouterr().err
    assert_same_store(out, reference)
    assert seen["passages"] == N_FORWARDED - kept


def load_counts(path: Path) -> np.ndarray:
    return np.diff(np.load(path / "offsets.npy"))


def test_partial_build_of_other_settings_starts_over(model, tok, corpus_file, reference, tmp_path, monkeypatch,
                                                     capsys):
    """A partial build with float32 keys, of fewer passages, of another model, then the
    reference's build: discarded (said on stderr), every passage forwarded again, the
    uninterrupted store."""
    out = tmp_path / "ds"
    count_forwards(monkeypatch, fail_at=3)
    with pytest.raises(RuntimeError, match="injected"):
        build_datastore(model, tok, corpus_file, path=out, key_dtype="float32", progress=False)
    assert progress_of(out)["passages_done"] > 0
    seen = count_forwards(monkeypatch)
    build_datastore(model, tok, corpus_file, path=out, progress=False)
    err = capsys.readouterr().err
    assert "has other settings (key_dtype): starting over" in err and "resuming" not in err
    assert_same_store(out, reference)
    assert seen["passages"] == N_FORWARDED
    # a partial build of fewer passages: other settings too
    count_forwards(monkeypatch, fail_at=2)
    with pytest.raises(RuntimeError):
        build_datastore(model, tok, corpus_file, path=tmp_path / "b", max_passages=20, progress=False)
    seen = count_forwards(monkeypatch)
    build_datastore(model, tok, corpus_file, path=tmp_path / "b", progress=False)
    assert "(n_passages, tokens_sha256): starting over" in capsys.readouterr().err
    assert_same_store(tmp_path / "b", reference)
    assert seen["passages"] == N_FORWARDED
    # another model of the same shapes (its keys would fit the partial arrays)
    count_forwards(monkeypatch, fail_at=4)
    with pytest.raises(RuntimeError):
        build_datastore(tiny_model("llama", seed=2), tok, corpus_file, path=tmp_path / "c", progress=False)
    seen = count_forwards(monkeypatch)
    build_datastore(model, tok, corpus_file, path=tmp_path / "c", progress=False)
    assert "has other settings (model): starting over" in capsys.readouterr().err
    assert_same_store(tmp_path / "c", reference)
    assert seen["passages"] == N_FORWARDED


def test_cli_interrupt_and_resume(model, tok, corpus_file, reference, tmp_path, monkeypatch, capsys):
    """Ctrl-C in `python -m lookahead_jax.knnlm build`: exit 130 and one line naming the
    passages kept, no traceback; the same command resumes (the progress bar starts at the
    entries kept) and gives the same store."""
    from lookahead_jax.knnlm.cli import main

    monkeypatch.setattr(loading, "load", lambda name, dtype="float32", **kw: (model, tok))
    out = tmp_path / "ds"
    args = ["build", "--model", "tiny-llama", "--corpus", str(corpus_file), "--out", str(out)]
    monkeypatch.setattr(D, "COMMIT_S", 1e9)  # no commit but the one on stopping
    count_forwards(monkeypatch, fail_at=3, exc=KeyboardInterrupt)
    assert main(args + ["--quiet"]) == 130
    prog = progress_of(out)
    assert prog["passages_done"] > 0
    assert capsys.readouterr().err == (f"interrupted; rerun the same command to resume ({prog['passages_done']} "
                                       f"of {N_PASSAGES} passages kept)\n")
    seen = count_forwards(monkeypatch)
    assert main(args) == 0
    got = capsys.readouterr()
    assert got.out.strip() == str(out) and seen["passages"] == N_FORWARDED - prog["passages_done"]
    n = int(load_counts(reference).sum())
    assert f" {prog['entries_done']}/{n} " in got.err  # the bar starts at the entries kept
    assert_same_store(out, reference)
