"""Building the KNN-LM datastore (`datastore.py` holds the store itself: its layout, entries
and loading): the passages' tokens, one forward per batch of them for the keys, written into
`<dir>.partial/` and renamed into place when done.

Building is resumable. It fills `<dir>.partial/` (keys.npy memory-mapped, values and offsets
written first, progress.json) and renames it into place when done. Every COMMIT_S seconds
(and when stopped by an error or Ctrl-C) it flushes the keys, then atomically records the
passages done; a killed build (kill -9, OOM) loses the forwards since. The same build
again (same model fingerprint, corpus, tokens, max_tokens, key dtype) continues at the
recorded passage, running the very forwards an uninterrupted build would (on one machine:
the same store, bit for bit); other settings discard the partial build and start over. A
flock keeps two builds out of one partial directory.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..core.buckets import PROMPT_BUCKETS
from ..retrieval.corpus import Corpus, load_corpus
from .datastore import (
    FORMAT, KEY_DTYPES, build_hnsw, datastore_dir, mismatch, model_identity, open_datastore, read_meta,
)

__all__ = ["BuildInterrupted", "build_datastore", "partial_dir"]

MAX_TOKENS = 512  # tokens per passage (longer passages are cut)
BATCH_TOKENS = 4096  # padded tokens per forward while building
PLAN = 3  # `_plan`'s version: a partial build of another plan starts over (2: power-of-two rows; 3: _padded_len)
COMMIT_S = 10.0  # a build commits its progress (flushed keys, passages done) this often, in seconds
F16_MAX = float(np.finfo(np.float16).max)


# ----------------------------------------------------------------------------- building
def _padded_len(n: int) -> int:
    """Padded length of a build forward's passages: n rounded up to 16 (32 above 256, the prompt
    buckets above 512). A forward's passages are neighbours in length order, so this leaves
    little padding (a 4,000-passage Wikipedia sample: 93% real tokens, 79% with the buckets)."""
    if n <= 512:
        step = 16 if n <= 256 else 32
        return max(step, -(-n // step) * step)
    return next((b for b in PROMPT_BUCKETS if b >= n), 1 << (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _hidden_fn(config, dtype_name: str):
    """jit: tokens [B,P] (right-padded passages, positions 0..P-1) -> final hidden states
    [B,P,D] f32, from an empty cache of P slots (causal mask; padding after a passage does
    not change its states)."""
    import jax
    import jax.numpy as jnp

    from ..models import hidden_states, init_cache

    def fn(params, tokens):
        B, P = tokens.shape
        cache = init_cache(config, B, P, jnp.dtype(dtype_name))
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        mask = jnp.arange(P)[None, None, :] <= positions[:, :, None]  # [B,P,P]
        h, _ = hidden_states(params, tokens, positions, cache, mask, config)
        return h.astype(jnp.float32)

    return jax.jit(fn)


def passage_tokens(tokenizer, corpus: Corpus, max_passages: Optional[int] = None,
                   max_tokens: int = MAX_TOKENS) -> list:
    """Token ids of the first `max_passages` passages (`tokenizer.encode(contents)`, cut to
    max_tokens): the datastore's passages, in corpus order."""
    n = len(corpus) if max_passages is None else min(max_passages, len(corpus))
    return [list(tokenizer.encode(corpus[i].contents))[:max_tokens] for i in range(n)]


class BuildInterrupted(KeyboardInterrupt):
    """Ctrl-C during `build_datastore`: the finished passages are kept in `partial`; the same
    build again resumes there."""

    def __init__(self, partial: Path, kept: int, total: int):
        super().__init__(f"interrupted; {kept} of {total} passages kept in {partial}")
        self.partial, self.kept, self.total = partial, kept, total


def partial_dir(path: Union[str, Path]) -> Path:
    """Where the build of the datastore at `path` lives until it is finished: `<path>.partial`."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def _plan(toks: list, counts: np.ndarray) -> list:
    """[(P, passages)]: the forwards of a build, longest passages first, rows per forward the
    largest power of two <= BATCH_TOKENS / P: no forward but the last pads rows (passages
    without entries last, P = 0: no forward). A batch depends only on the passages from its first
    on: a build resumed at a batch boundary runs the same forwards (bitwise the same keys)."""
    order = sorted((i for i in range(len(toks)) if counts[i]), key=lambda i: -len(toks[i]))
    batches, i = [], 0
    while i < len(order):
        P = _padded_len(len(toks[order[i]]))
        rows = 1 << (max(1, BATCH_TOKENS // P).bit_length() - 1)  # a power of two: no padding rows
        batches.append((P, order[i:i + rows]))
        i += rows
    empty = [i for i in range(len(toks)) if not counts[i]]
    return batches + ([(0, empty)] if empty else [])


def _write_json(f: Path, obj: dict) -> None:
    """Atomically: a reader (or a killed writer) sees the old file or the new one."""
    tmp = f.with_name(f".{f.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, f)


def _lock(work: Path):
    """An exclusive flock on `work/lock` (held while the file stays open): two builds of one
    datastore at once would overwrite each other's partial build."""
    import fcntl

    f = open(work / "lock", "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise RuntimeError(f"another build is writing {work} (wait for it, or end it)") from None
    return f


def _start(work: Path, settings: dict, toks: list, offsets: np.ndarray, dim: int) -> tuple:
    """The partial build in `work`: resumed when its settings are these (-> keys memmap,
    progress), else (re)started with empty keys, the values and offsets (-> keys, progress)."""
    N, key_dtype = int(offsets[-1]), settings["key_dtype"]
    try:
        prog = json.loads((work / "progress.json").read_text())
    except (OSError, ValueError):
        prog = None
    if prog is not None:
        theirs = prog.get("settings", {})
        diff = sorted(k for k in set(settings) | set(theirs) if settings.get(k) != theirs.get(k))
        if not diff:
            try:
                keys = np.load(work / "keys.npy", mmap_mode="r+")
                values = np.load(work / "values.npy", mmap_mode="r")
                if (keys.shape == (N, dim) and keys.dtype == np.dtype(key_dtype) and values.shape == (N,)
                        and np.array_equal(np.load(work / "offsets.npy"), offsets)):
                    return keys, prog
            except (OSError, ValueError):
                pass
        why = f"other settings ({', '.join(diff)})" if diff else "damaged arrays"
        print(f"knnlm build: the partial build in {work} has {why}: starting over", file=sys.stderr)
    (work / "progress.json").unlink(missing_ok=True)  # first: no half-deleted build looks resumable
    for f in work.iterdir():
        if f.name != "lock":
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    keys = np.lib.format.open_memmap(work / "keys.npy", mode="w+", dtype=np.dtype(key_dtype), shape=(N, dim))
    values = np.lib.format.open_memmap(work / "values.npy", mode="w+", dtype=np.int32, shape=(N,))
    for j, t in enumerate(toks):
        values[offsets[j]:offsets[j + 1]] = t[1:]
    values.flush()
    del values
    np.save(work / "offsets.npy", offsets)
    prog = {"settings": settings, "passages_done": 0, "entries_done": 0, "max_abs_key": 0.0, "build_s": 0.0}
    _write_json(work / "progress.json", prog)
    return keys, prog


def build_datastore(model, tokenizer, corpus: Union[Corpus, str, Path], *, max_passages: Optional[int] = None,
                    max_tokens: int = MAX_TOKENS, key_dtype: str = "float16",
                    path: Union[str, Path, None] = None, force: bool = False, hnsw: bool = False,
                    progress: bool = True) -> Path:
    """Build the datastore of (model, corpus) unless an up-to-date one with these settings
    exists (`force` rebuilds it); returns its directory (default: `datastore_dir`).
    `hnsw`: also build the faiss HNSW index. Raises CorpusError for an empty corpus and
    ValueError when no passage has 2 tokens.

    Resumable: the build fills `<path>.partial/` (keys memory-mapped) and commits its
    progress (progress.json: settings, passages done) after flushing the keys, about every
    COMMIT_S seconds and when it stops on an error; a later build with the same
    settings (model, corpus, tokens, max_tokens, key dtype) continues from the committed
    passages, one with other settings starts over. Ctrl-C raises BuildInterrupted (a
    KeyboardInterrupt) saying how many passages are kept. Finished: meta.json is written
    and the directory renamed into place."""
    import jax.numpy as jnp

    from ..core.engine import engine_for

    corpus = load_corpus(corpus)
    if max_passages is not None and (isinstance(max_passages, bool) or not isinstance(max_passages, int)
                                     or max_passages < 1):
        raise ValueError(f"max_passages must be a positive integer, got {max_passages!r}")
    if key_dtype not in KEY_DTYPES:
        raise ValueError(f"key_dtype must be one of {KEY_DTYPES}, got {key_dtype!r}")
    if not isinstance(max_tokens, int) or max_tokens < 2:
        raise ValueError(f"max_tokens must be an integer >= 2, got {max_tokens!r}")
    ident = model_identity(model)
    path = Path(path).expanduser() if path is not None else datastore_dir(model, corpus)
    n_pass = len(corpus) if max_passages is None else min(max_passages, len(corpus))
    meta = read_meta(path)
    if (not force and meta is not None and mismatch(meta, ident, corpus) is None
            and meta.get("n_passages") == n_pass and meta.get("max_tokens") == max_tokens
            and meta.get("key_dtype") == key_dtype):
        if hnsw:
            build_hnsw(open_datastore(path, meta), progress=progress)
        return path

    if path.exists() and (not path.is_dir() or (meta is None and any(path.iterdir()))):
        raise ValueError(f"{path} exists and is not a KNN-LM datastore: give a new or empty directory "
                         "(it would be replaced)")
    t0 = time.perf_counter()
    toks = passage_tokens(tokenizer, corpus, n_pass, max_tokens)
    counts = np.array([max(len(t) - 1, 0) for t in toks], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    N, D = int(offsets[-1]), model.config.d_model
    if N == 0:
        raise ValueError(f"no datastore entries: none of the {n_pass} passages encodes to 2 or more tokens")
    tok_sha = hashlib.sha256()
    for t in toks:
        tok_sha.update(np.asarray([len(t), *t], np.int64).tobytes())
    settings = {"format": FORMAT, "model": ident, "corpus_sha256": corpus.fingerprint, "n_passages": n_pass,
                "max_tokens": max_tokens, "key_dtype": key_dtype, "batch_tokens": BATCH_TOKENS, "plan": PLAN,
                "tokens_sha256": tok_sha.hexdigest()}
    engine = engine_for(model)
    fn = _hidden_fn(model.config, jnp.dtype(engine.dtype).name)
    params = engine.params

    work = partial_dir(path)
    work.mkdir(parents=True, exist_ok=True)
    lock = _lock(work)
    try:
        keys, prog = _start(work, settings, toks, offsets, D)
        batches = _plan(toks, counts)
        done, peak, ent = prog["passages_done"], prog["max_abs_key"], prog["entries_done"]
        skip = np.cumsum([len(rows) for _, rows in batches]).tolist()
        if done not in [0] + skip:  # never: a resume point is a batch boundary of the same plan
            raise RuntimeError(f"{work}/progress.json: {done} passages done is no batch boundary; delete {work}")
        todo = batches[([0] + skip).index(done):]
        if done:
            print(f"knnlm build: resuming build at passage {done:,}/{n_pass:,} ({ent:,}/{N:,} entries kept in "
                  f"{work})", file=sys.stderr)

        def commit():
            nonlocal t_mark
            keys.flush()  # the rows first, then the progress that counts them
            now = time.perf_counter()
            prog.update(passages_done=done, entries_done=ent, max_abs_key=peak,
                        build_s=round(prog["build_s"] + now - t_mark, 2))  # over all runs of this build
            _write_json(work / "progress.json", prog)
            t_mark = now

        from tqdm.auto import tqdm

        t_mark = t0
        with tqdm(total=N, initial=ent, desc="knnlm datastore", unit="entry", disable=not progress,
                  dynamic_ncols=True) as bar:
            try:
                for P, rows in todo:
                    if P:
                        block = np.zeros((1 << (len(rows) - 1).bit_length(), P), np.int32)  # rows: a power of two
                        for r, j in enumerate(rows):
                            block[r, :len(toks[j])] = toks[j]
                        h = np.asarray(fn(params, block))  # [R,P,D] f32
                        for r, j in enumerate(rows):
                            c, o = int(counts[j]), int(offsets[j])
                            part = h[r, :c]
                            peak = max(peak, float(np.abs(part).max()))
                            if key_dtype == "float16" and peak > F16_MAX:
                                raise ValueError(f"hidden states reach {peak:.3g}, beyond float16's range: "
                                                 "build with --key-dtype float32 (key_dtype='float32')")
                            keys[o:o + c] = part
                    n = int(counts[rows].sum())
                    done, ent = done + len(rows), ent + n
                    bar.set_postfix_str(f"passages {done:,}/{n_pass:,}", refresh=False)
                    bar.update(n)
                    if time.perf_counter() - t_mark >= COMMIT_S:
                        commit()
            except BaseException as e:  # keep the finished batches (an unfinished one is redone)
                commit()
                if isinstance(e, KeyboardInterrupt) and not isinstance(e, BuildInterrupted):
                    raise BuildInterrupted(work, done, n_pass) from None
                raise
        commit()
        del keys
        values = np.load(work / "values.npy", mmap_mode="r")
        meta = {"format": FORMAT, "model": ident, "corpus_sha256": corpus.fingerprint,
                "corpus_source": str(corpus.source) if corpus.source else None,
                "corpus_passages": len(corpus), "n_passages": n_pass, "max_tokens": max_tokens,
                "n_entries": N, "dim": D, "key_dtype": key_dtype, "max_abs_key": peak,
                "bytes": int(N * D * np.dtype(key_dtype).itemsize + values.nbytes + offsets.nbytes),
                "build_s": prog["build_s"],
                "created": datetime.datetime.now().isoformat(timespec="seconds")}
        del values
        (work / "meta.json").write_text(json.dumps(meta, indent=1))
        (work / "progress.json").unlink()
        (work / "lock").unlink()
        shutil.rmtree(path, ignore_errors=True)
        os.replace(work, path)
    finally:
        lock.close()
    if hnsw:
        build_hnsw(open_datastore(path, meta), progress=progress)
    return path
