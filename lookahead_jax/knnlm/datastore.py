"""The KNN-LM datastore: (hidden state before the LM head -> next token) over a corpus.

    python -m lookahead_jax.knnlm build --model smollm2-135m --corpus F.jsonl [--max-passages N]
    ds = load_datastore(model, corpus="F.jsonl")      # DatastoreNotBuilt names the command above

Entries. Each passage's `contents` (title line + text, as retrieval indexes it) is encoded
as the model's tokenizer does (`tokenizer.encode(text)`: with BOS when the model adds one),
cut to `max_tokens`; one forward gives the final hidden states h [P,D] (after the final
norm: the LM head's input), and entry t is (key h[t], value token[t+1]) for t = 0..P-2.
Passages are laid out in corpus order and the entries of one passage are consecutive, so
"entry j+1 follows entry j" (what speculative KNN-LM caches) holds inside a passage.

    # passage tokens [BOS, a, b, c] -> entries (h_BOS -> a), (h_a -> b), (h_b -> c)

Layout of a datastore directory:

    keys.npy     [N,D] float16 (default) or float32   hidden states
    values.npy   [N] int32                             next tokens
    offsets.npy  [n_passages + 1] int64                passage i = entries offsets[i]..offsets[i+1]-1
    meta.json    format, model identity (name, dtype, fingerprint of config + weights),
                 corpus sha256 / source, n_passages, max_tokens, n_entries, dim, key dtype
    hnsw.faiss   optional faiss IndexHNSWFlat (L2) over the keys (`build --hnsw`, or made
                 at first use of knn_search="hnsw")
    ivf.faiss    optional faiss IVF index with int8 codes (L2) over the keys, made at first
                 use of knn_speculate="ivf" (speculation's candidates only: 13 s and N x D
                 bytes at 1M entries)

Default location: `<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/knnlm/<model>-<fp12>/
<corpus sha16>/`, one datastore per (model, corpus); `--out DIR` / `path=` put it anywhere.
Loading checks the model's fingerprint (a datastore of another model, or the same model in
another dtype, is a StaleDatastore) and, when a corpus is given, its sha256; errors carry
the build command (`.command`), as the retrieval indexes' do.

Keys are stored in float16 (half the bytes; searches compute in float32); a build whose
hidden states exceed float16's range stops with an error asking for `--key-dtype float32`.

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

import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..core.buckets import PROMPT_BUCKETS
from ..presets import cache_root as _project_cache_root
from ..retrieval.corpus import Corpus, load_corpus
from ..retrieval.store import IndexUnavailable

__all__ = ["FORMAT", "KEY_DTYPES", "BuildInterrupted", "Datastore", "DatastoreUnavailable", "DatastoreNotBuilt",
           "StaleDatastore", "build_datastore", "build_command", "datastore_dir", "load_datastore",
           "model_identity", "partial_dir"]

FORMAT = 1  # meta.json layout version
KEY_DTYPES = ("float16", "float32")
MAX_TOKENS = 512  # tokens per passage (longer passages are cut)
BATCH_TOKENS = 4096  # padded tokens per forward while building
PLAN = 3  # `_plan`'s version: a partial build of another plan starts over (2: power-of-two rows; 3: _padded_len)
COMMIT_S = 10.0  # a build commits its progress (flushed keys, passages done) this often, in seconds
# The build command an error suggests takes the first SUGGESTED_MAX_PASSAGES passages of a
# larger corpus (minutes on a 2-core CPU; a whole Wikipedia-sized corpus takes hours there).
SUGGESTED_MAX_PASSAGES = 100
F16_MAX = float(np.finfo(np.float16).max)


class DatastoreUnavailable(IndexUnavailable):
    """The datastore cannot be used as it is; `.command` (re)builds it."""


class DatastoreNotBuilt(DatastoreUnavailable, FileNotFoundError):
    """No datastore for this (model, corpus) / at this path yet."""


class StaleDatastore(DatastoreUnavailable):
    """The datastore was built for another model (or dtype), another corpus, or by another
    format version."""


# ----------------------------------------------------------------------------- identity
def model_identity(model) -> dict:
    """{name, dtype, fingerprint}: the fingerprint is the sha256 of the config and of a few
    weights (the final norm and the first embedding rows), so another checkpoint with the
    same config, or the same one in another dtype, is another model."""
    import jax.numpy as jnp

    params = model.params
    h = hashlib.sha256(repr(model.config).encode())
    dtype = jnp.dtype(getattr(model, "dtype", jnp.float32)).name
    h.update(dtype.encode())
    for leaf in (params["final_norm"], params["embed"][:4]):
        h.update(np.ascontiguousarray(np.asarray(leaf, np.float32)).tobytes())
    return {"name": getattr(model, "name", "") or "", "dtype": dtype, "fingerprint": h.hexdigest()}


def _model_key(ident: dict) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", ident["name"]).strip("_") or "model"
    return f"{name}-{ident['dtype']}-{ident['fingerprint'][:12]}"


def cache_root() -> Path:
    """<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/knnlm (not created here)."""
    return _project_cache_root() / "knnlm"


def datastore_dir(model, corpus: Union[Corpus, str, Path]) -> Path:
    """The default directory of the datastore of (model, corpus)."""
    corpus = load_corpus(corpus)
    return cache_root() / _model_key(model_identity(model)) / corpus.fingerprint[:16]


def build_command(model, corpus=None, path: Union[str, Path, None] = None) -> str:
    """The command that builds the datastore (the Python call for a model or corpus that has
    no name / file to give the command line). For a corpus of more than
    SUGGESTED_MAX_PASSAGES passages (or an unknown one) it builds over the first
    SUGGESTED_MAX_PASSAGES only (`--max-passages`): a start that takes minutes, not hours."""
    ident = model_identity(model)
    source = getattr(corpus, "source", None) if isinstance(corpus, Corpus) else corpus
    if not ident["name"] or (corpus is not None and source is None):
        out = f", path={str(path)!r}" if path is not None else ""
        return f"lookahead_jax.knnlm.build_datastore(model, tokenizer, corpus{out})"
    cmd = ["python", "-m", "lookahead_jax.knnlm", "build", "--model", ident["name"],
           "--corpus", str(source) if source is not None else "CORPUS.jsonl"]
    if not isinstance(corpus, Corpus) or len(corpus) > SUGGESTED_MAX_PASSAGES:
        cmd += ["--max-passages", str(SUGGESTED_MAX_PASSAGES)]
    if ident["dtype"] != "float32":
        cmd += ["--dtype", ident["dtype"]]
    if path is not None:
        cmd += ["--out", str(path)]
    return shlex.join(cmd)


# ----------------------------------------------------------------------------- loading
@dataclasses.dataclass
class Datastore:
    """A datastore on disk, opened: keys [N,D] (memory-mapped), values [N], offsets, meta."""

    path: Path
    meta: dict
    keys: np.ndarray  # [N,D] float16 / float32
    values: np.ndarray  # [N] int32
    offsets: np.ndarray  # [n_passages + 1] int64

    @property
    def size(self) -> int:
        return len(self.values)

    @property
    def dim(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.offsets.nbytes

    def passage_of(self, entry: int) -> int:
        """The corpus position of the passage holding `entry`."""
        return int(np.searchsorted(self.offsets, entry, side="right") - 1)

    def __repr__(self) -> str:
        m = self.meta
        return (f"Datastore({self.size:,} entries x {self.dim} ({m['key_dtype']}), "
                f"{m['n_passages']:,} passages, model {m['model']['name'] or '?'}, {self.path})")


def read_meta(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _open(path: Path, meta: dict) -> Datastore:
    keys = np.load(path / "keys.npy", mmap_mode="r")
    values = np.load(path / "values.npy")
    offsets = np.load(path / "offsets.npy")
    if keys.shape != (meta["n_entries"], meta["dim"]) or values.shape != (meta["n_entries"],):
        raise StaleDatastore(f"the datastore at {path} is damaged: keys {keys.shape}, values {values.shape}, "
                             f"meta.json says {meta['n_entries']} entries of dim {meta['dim']}", "")
    return Datastore(path, meta, keys, values, offsets)


def mismatch(meta: dict, ident: dict, corpus: Optional[Corpus]) -> Optional[str]:
    if meta.get("format") != FORMAT:
        return f"it has format {meta.get('format')}, this version reads {FORMAT}"
    m = meta.get("model", {})
    if m.get("fingerprint") != ident["fingerprint"]:
        same_name = m.get("name") == ident["name"] and m.get("dtype") != ident["dtype"]
        return (f"it was built for model {m.get('name') or '?'} ({m.get('dtype')}, fingerprint "
                f"{str(m.get('fingerprint'))[:12]}), not this one ({ident['name'] or '?'}, {ident['dtype']}, "
                f"fingerprint {ident['fingerprint'][:12]})" + ("; the dtypes differ" if same_name else ""))
    if corpus is not None and meta.get("corpus_sha256") != corpus.fingerprint:
        return (f"it was built from another corpus ({meta.get('corpus_source') or 'in memory'}, sha256 "
                f"{str(meta.get('corpus_sha256'))[:16]}), not this one ({corpus.source or 'in memory'}, "
                f"sha256 {corpus.fingerprint[:16]})")
    return None


def load_datastore(model, corpus: Union[Corpus, str, Path, None] = None,
                   path: Union[str, Path, None] = None) -> Datastore:
    """The datastore of `model`: at `path` if given, else the default one for (model,
    corpus); without either, the only datastore built for this model (several: an error
    listing them). Raises DatastoreNotBuilt / StaleDatastore naming the build command."""
    corpus = load_corpus(corpus) if corpus is not None else None
    ident = model_identity(model)
    if path is not None:
        path = Path(path).expanduser()
        cmd = build_command(model, corpus, path)
        meta = read_meta(path)
        if meta is None:
            raise DatastoreNotBuilt(f"no KNN-LM datastore at {path}. Build it with:\n  {cmd}", cmd)
        why = mismatch(meta, ident, corpus)
        if why:
            raise StaleDatastore(f"the KNN-LM datastore at {path} is stale: {why}. Rebuild it with:\n  {cmd}", cmd)
        return _open(path, meta)
    home = cache_root() / _model_key(ident)
    if corpus is None:
        found = sorted(p.parent for p in home.glob("*/meta.json"))
        cmd = build_command(model, None)
        if not found:
            raise DatastoreNotBuilt(f"no KNN-LM datastore built for model {ident['name'] or '?'} under "
                                    f"{home.parent}. Build one with:\n  {cmd}", cmd)
        if len(found) > 1:
            listed = "\n  ".join(f"{p} ({(read_meta(p) or {}).get('corpus_source')})" for p in found)
            raise ValueError(f"{len(found)} KNN-LM datastores are built for model {ident['name'] or '?'}:\n  "
                             f"{listed}\nchoose one with datastore=DIR (--datastore) or corpus=FILE (--corpus)")
        path = found[0]
        meta = read_meta(path)
        why = mismatch(meta, ident, None)
        if why:
            raise StaleDatastore(f"the KNN-LM datastore at {path} is stale: {why}. Rebuild it with:\n  {cmd}", cmd)
        return _open(path, meta)
    path = home / corpus.fingerprint[:16]
    cmd = build_command(model, corpus)
    meta = read_meta(path)
    if meta is None:
        older = [p.parent for p in home.glob("*/meta.json")
                 if corpus.source and (read_meta(p.parent) or {}).get("corpus_source") == str(corpus.source)]
        if older:
            raise StaleDatastore(f"the KNN-LM datastore of {corpus.source} is stale: the file changed since "
                                 f"{older[0]} was built (sha256 now {corpus.fingerprint[:16]}). Build it again "
                                 f"with:\n  {cmd}", cmd)
        raise DatastoreNotBuilt(f"no KNN-LM datastore for model {ident['name'] or '?'} and {corpus!r} under "
                                f"{home.parent}. Build it with:\n  {cmd}", cmd)
    why = mismatch(meta, ident, corpus)
    if why:
        raise StaleDatastore(f"the KNN-LM datastore at {path} is stale: {why}. Rebuild it with:\n  {cmd}", cmd)
    return _open(path, meta)


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
            build_hnsw(_open(path, meta), progress=progress)
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
        build_hnsw(_open(path, meta), progress=progress)
    return path


# ----------------------------------------------------------------------------- faiss
HNSW_M = 32
HNSW_EF_CONSTRUCTION = 128


def _faiss_index(ds: Datastore, name: str, make, step: int, progress: bool, save: bool):
    """The faiss index `name` over the keys: read from the datastore when there (and of the
    same size and dimension), else `make()` (an empty index, trained if it needs it) filled
    in chunks of `step` keys, with a progress bar, and saved atomically into the datastore."""
    import faiss
    from tqdm.auto import tqdm

    f = ds.path / name
    if f.exists():
        index = faiss.read_index(str(f))
        if index.ntotal == ds.size and index.d == ds.dim:
            return index
    index = make()
    for s in tqdm(range(0, ds.size, step), desc=f"faiss {f.stem}", unit="chunk", disable=not progress):
        index.add(np.ascontiguousarray(ds.keys[s:s + step], np.float32))
    if save:
        tmp = f.with_name(f".{name}.tmp-{os.getpid()}")
        faiss.write_index(index, str(tmp))
        os.replace(tmp, f)
    return index


def build_hnsw(ds: Datastore, progress: bool = False, save: bool = True):
    """The faiss IndexHNSWFlat (L2, M=32, efConstruction=128) over the keys, read from
    `hnsw.faiss` when there (and matching), else built (and saved into the datastore)."""
    import faiss

    def make():
        index = faiss.IndexHNSWFlat(ds.dim, HNSW_M)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        return index

    return _faiss_index(ds, "hnsw.faiss", make, 8192, progress, save)

def ivf_lists(n: int) -> int:
    """Inverted lists of the IVF index over n keys: about 2 sqrt(n) (a power of two: 2,048
    at 1M), at most one per 64 keys (k-means wants ~39+ training points per centroid)."""
    want = 1 << max(0, round(math.log2(max(1.0, 2 * math.sqrt(n)))))
    return max(1, min(want, n // 64))


def build_ivf(ds: Datastore, progress: bool = False, save: bool = True):
    """The faiss IndexIVFScalarQuantizer (L2, `ivf_lists` lists, 8-bit codes) over the keys,
    read from `ivf.faiss` when there (and matching), else built (k-means on up to 64 keys per
    list, a fixed sample) and saved into the datastore. It proposes candidates for
    speculation only: its approximate distances never decide a token."""
    import faiss

    def make():
        nlist = ivf_lists(ds.size)
        train = np.sort(np.random.default_rng(0).choice(ds.size, min(ds.size, 64 * nlist), replace=False))
        index = faiss.IndexIVFScalarQuantizer(faiss.IndexFlatL2(ds.dim), ds.dim, nlist,
                                              faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_L2)
        index.train(np.asarray(ds.keys[train], np.float32))
        return index

    return _faiss_index(ds, "ivf.faiss", make, 65536, progress, save)

