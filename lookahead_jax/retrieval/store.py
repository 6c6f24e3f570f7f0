"""Build retrieval indexes once, keep them on disk, load them by (kind, corpus, encoder).

    python -m lookahead_jax.retrieval build --corpus F.jsonl --retriever bm25|dense|hnsw|ivf
    r = load_retriever("bm25", "F.jsonl")     # IndexNotBuilt names the command above if missing

Layout under the cache root (`<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/retrieval`, or
the `cache_dir` / `--out` given):

    <sha16>/bm25/                bm25s's files + bm25.json + meta.json
    <sha16>/dense-<encoder>/     embeddings.npy [N,E] float32 + meta.json
    <sha16>/hnsw-<encoder>/      index.faiss + meta.json (embeddings from dense-<encoder>/)
    <sha16>/ivf-<encoder>/       index.faiss + meta.json

<sha16> is the start of the corpus file's sha256, so an edited corpus never loads an old
index: it gets a new directory, and `load_retriever` explains that the old one is stale.
meta.json repeats the full hash, the passage count and the encoder; any mismatch is a
StaleIndex. Each index is written to a temporary directory and renamed into place, so a
build cut short leaves nothing that looks finished. hnsw/ivf reuse (or first build) the
dense embeddings: encoding the corpus is the slow step.

Host-only module: no jax (the dense retriever it returns uses it).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Optional, Union

import numpy as np

from lookahead_jax.presets import cache_root as _project_cache_root

from .base import Retriever
from .corpus import Corpus, load_corpus
from .encoders import DEFAULT_ENCODER, get_encoder

__all__ = ["KINDS", "UnknownRetriever", "IndexUnavailable", "IndexNotBuilt", "StaleIndex",
           "cache_root", "index_dir", "build_command", "build_index", "is_built", "load_retriever"]

KINDS = ("bm25", "dense", "hnsw", "ivf")
FORMAT = 1  # meta.json layout version
ENCODE_BATCH = 256  # texts per encoder call while embedding the corpus


class UnknownRetriever(ValueError):
    """A retriever kind that is not one of KINDS."""


class IndexUnavailable(RuntimeError):
    """The index cannot be used as it is; `command` rebuilds it."""

    def __init__(self, message: str, command: str):
        super().__init__(message)
        self.command = command


class IndexNotBuilt(IndexUnavailable, FileNotFoundError):
    """No index for this (kind, corpus, encoder) yet."""


class StaleIndex(IndexUnavailable):
    """The index on disk was built for another corpus (version) or encoder."""


def cache_root() -> Path:
    """<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/retrieval (not created here)."""
    return _project_cache_root() / "retrieval"


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise UnknownRetriever(f"unknown retriever {kind!r}; valid: {', '.join(KINDS)}")
    return kind


def _subdir(kind: str, encoder: str) -> str:
    return "bm25" if kind == "bm25" else f"{kind}-{encoder}"


def index_dir(kind: str, corpus: Corpus, encoder: str = DEFAULT_ENCODER,
              cache_dir: Union[str, Path, None] = None) -> Path:
    """Where the index of (kind, corpus, encoder) lives; the encoder matters for dense kinds."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return root / corpus.fingerprint[:16] / _subdir(check_kind(kind), encoder)


def build_command(kind: str, corpus: Corpus, encoder: str = DEFAULT_ENCODER,
                  cache_dir: Union[str, Path, None] = None) -> str:
    """The command line that builds this index (or the Python call, for an in-memory corpus)."""
    dense = kind != "bm25"
    if corpus.source is None:
        enc = f", encoder={encoder!r}" if dense else ""
        out = f", cache_dir={str(cache_dir)!r}" if cache_dir is not None else ""
        return f"lookahead_jax.retrieval.build_index({kind!r}, corpus{enc}{out})"
    cmd = ["python", "-m", "lookahead_jax.retrieval", "build", "--corpus", str(corpus.source),
           "--retriever", kind]
    if dense and encoder != DEFAULT_ENCODER:
        cmd += ["--encoder", encoder]
    if cache_dir is not None:
        cmd += ["--out", str(cache_dir)]
    return shlex.join(cmd)


# --- building ----------------------------------------------------------------------------------


def build_index(kind: str, corpus: Union[Corpus, str, Path], *, encoder: str = DEFAULT_ENCODER,
                cache_dir: Union[str, Path, None] = None, force: bool = False,
                progress: bool = True) -> Path:
    """Build the index of (kind, corpus, encoder) unless an up-to-date one exists (`force`
    rebuilds it); returns its directory."""
    corpus = load_corpus(corpus)
    path = index_dir(kind, corpus, encoder, cache_dir)
    if not force and is_built(kind, corpus, encoder, cache_dir):
        return path
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if kind == "bm25":
            from .bm25 import BM25Retriever

            r = BM25Retriever.build(corpus, progress=progress)
            r.save(tmp)
            extra = {"params": r.params, "versions": _versions("bm25s", "PyStemmer")}
        elif kind == "dense":
            emb = _encode_corpus(corpus, encoder, progress)
            np.save(tmp / "embeddings.npy", emb)
            extra = {"dim": int(emb.shape[1])}
        else:
            import faiss

            from .dense import build_faiss

            dense = build_index("dense", corpus, encoder=encoder, cache_dir=cache_dir,
                                progress=progress)  # reused when up to date, even with force
            emb = np.load(dense / "embeddings.npy")
            faiss.write_index(build_faiss(emb, kind, progress=progress), str(tmp / "index.faiss"))
            extra = {"dim": int(emb.shape[1]), "versions": _versions("faiss-cpu")}
        meta = {"format": FORMAT, "kind": kind, "corpus_sha256": corpus.fingerprint,
                "corpus_source": str(corpus.source) if corpus.source else None,
                "n_passages": len(corpus), "encoder": encoder if kind != "bm25" else None,
                "created": datetime.datetime.now().isoformat(timespec="seconds"), **extra}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _encode_corpus(corpus: Corpus, encoder: str, progress: bool) -> np.ndarray:
    from tqdm.auto import tqdm

    enc = get_encoder(encoder)
    texts = corpus.all_contents()
    parts = []
    for s in tqdm(range(0, len(texts), ENCODE_BATCH), desc=f"encode ({encoder})", unit="batch",
                  disable=not progress):
        v = np.asarray(enc(texts[s:s + ENCODE_BATCH]), np.float32)
        if v.ndim != 2 or len(v) != len(texts[s:s + ENCODE_BATCH]):
            raise ValueError(f"encoder {encoder!r} returned shape {v.shape} for "
                             f"{len(texts[s:s + ENCODE_BATCH])} texts; expected [texts, dim]")
        parts.append(v)
    return np.concatenate(parts)


def _versions(*dists: str) -> dict:
    out = {}
    for d in dists:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = None
    return out


# --- loading -----------------------------------------------------------------------------------


def load_retriever(kind: str, corpus: Union[Corpus, str, Path], *, encoder: str = DEFAULT_ENCODER,
                   cache_dir: Union[str, Path, None] = None, **options) -> Retriever:
    """The retriever of (kind, corpus, encoder) from the cache. `options` go to the retriever:
    DenseRetriever's `chunk_size`, `ef_search` (hnsw), `nprobe` (ivf), `query_cache`.

    Raises IndexNotBuilt / StaleIndex (their message and `.command` hold the build command),
    UnknownRetriever, and EncoderUnavailable for a dense kind whose encoder is not registered.
    """
    check_kind(kind)
    corpus = load_corpus(corpus)
    path = index_dir(kind, corpus, encoder, cache_dir)
    _require(path, kind, corpus, encoder, cache_dir)
    if kind == "bm25":
        from .bm25 import BM25Retriever

        if options:
            raise TypeError(f"bm25 takes no options, got {', '.join(sorted(options))}")
        return BM25Retriever.load(path, corpus)
    from .dense import DenseRetriever

    dense = index_dir("dense", corpus, encoder, cache_dir)
    if kind != "dense":
        _require(dense, "dense", corpus, encoder, cache_dir, needed_by=kind)
    emb = np.load(dense / "embeddings.npy")
    index = None
    if kind != "dense":
        import faiss

        index = faiss.read_index(str(path / "index.faiss"))
    return DenseRetriever(emb, get_encoder(encoder), kind=kind, index=index, corpus=corpus, **options)


def _read_meta(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def _mismatch(meta: dict, kind: str, corpus: Corpus, encoder: str) -> Optional[str]:
    if meta.get("format") != FORMAT:
        return f"it has index format {meta.get('format')}, this version reads {FORMAT}"
    if meta.get("kind") != kind:
        return f"it is a {meta.get('kind')!r} index, not {kind!r}"
    if meta.get("corpus_sha256") != corpus.fingerprint or meta.get("n_passages") != len(corpus):
        return (f"it was built for another corpus ({meta.get('corpus_source') or 'in memory'}: "
                f"{meta.get('n_passages')} passages, sha256 {str(meta.get('corpus_sha256'))[:16]}), "
                f"not this one ({len(corpus)} passages, sha256 {corpus.fingerprint[:16]})")
    if kind != "bm25" and meta.get("encoder") != encoder:
        return f"it was built with encoder {meta.get('encoder')!r}, not {encoder!r}"
    return None


def is_built(kind: str, corpus: Union[Corpus, str, Path], encoder: str = DEFAULT_ENCODER,
             cache_dir: Union[str, Path, None] = None) -> bool:
    """Whether an up-to-date index of (kind, corpus, encoder) is on disk."""
    corpus = load_corpus(corpus)
    ok = _valid(index_dir(kind, corpus, encoder, cache_dir), kind, corpus, encoder)
    if ok and kind in ("hnsw", "ivf"):  # they read the dense index's embeddings
        ok = _valid(index_dir("dense", corpus, encoder, cache_dir), "dense", corpus, encoder)
    return ok


def _valid(path: Path, kind: str, corpus: Corpus, encoder: str) -> bool:
    meta = _read_meta(path)
    return meta is not None and _mismatch(meta, kind, corpus, encoder) is None


def _require(path: Path, kind: str, corpus: Corpus, encoder: str, cache_dir,
             needed_by: Optional[str] = None) -> None:
    """Raise IndexNotBuilt / StaleIndex with the build command unless `path` is usable."""
    cmd = build_command(needed_by or kind, corpus, encoder, cache_dir)
    what = f"{kind} index" + (f" (encoder {encoder!r})" if kind != "bm25" else "")
    if needed_by:
        what += f", which the {needed_by} index reads,"
    meta = _read_meta(path)
    if meta is not None:
        why = _mismatch(meta, kind, corpus, encoder)
        if why:
            raise StaleIndex(f"the {what} at {path} is stale: {why}. Rebuild it with:\n  {cmd}", cmd)
        return
    # Nothing here: say whether the same file was indexed before it changed, or other encoders.
    root = path.parent.parent
    older, encoders = [], []
    for m in sorted(root.glob(f"*/{path.name}/meta.json")):
        other = _read_meta(m.parent) or {}
        if corpus.source and other.get("corpus_source") == str(corpus.source):
            older.append(m.parent)
    if kind != "bm25":
        encoders = sorted({(_read_meta(m.parent) or {}).get("encoder")
                           for m in path.parent.glob(f"{kind}-*/meta.json")} - {None})
    if older:
        raise StaleIndex(f"the {what} of {corpus.source} is stale: the file changed since "
                         f"{older[0]} was built (sha256 now {corpus.fingerprint[:16]}). "
                         f"Build it again with:\n  {cmd}", cmd)
    note = f" (built here for encoder(s) {', '.join(encoders)} only)" if encoders else ""
    raise IndexNotBuilt(f"no {what} for {corpus!r} under {root}{note}. Build it with:\n  {cmd}", cmd)
