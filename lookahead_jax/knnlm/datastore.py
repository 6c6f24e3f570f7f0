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

Building it (the forwards, resumable, into `<dir>.partial/`): `build.py`. This module is
the store itself: what a datastore directory holds, where it lives, how it is found,
checked and opened, and the faiss indexes kept beside its keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Optional, Union

import numpy as np

from ..presets import cache_root as _project_cache_root
from ..retrieval.corpus import Corpus, load_corpus
from ..retrieval.store import IndexUnavailable

__all__ = ["FORMAT", "KEY_DTYPES", "Datastore", "DatastoreUnavailable", "DatastoreNotBuilt",
           "StaleDatastore", "build_command", "datastore_dir", "load_datastore",
           "model_identity"]

FORMAT = 1  # meta.json layout version
KEY_DTYPES = ("float16", "float32")
# The build command an error suggests takes the first SUGGESTED_MAX_PASSAGES passages of a
# larger corpus (minutes on a 2-core CPU; a whole Wikipedia-sized corpus takes hours there).
SUGGESTED_MAX_PASSAGES = 100


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

    from ..core.multihost import to_host

    params = model.params
    h = hashlib.sha256(repr(model.config).encode())
    dtype = jnp.dtype(getattr(model, "dtype", jnp.float32)).name
    h.update(dtype.encode())
    for leaf in to_host((params["final_norm"], params["embed"][:4])):  # (sharded over processes: gathered)
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


def open_datastore(path: Path, meta: dict) -> Datastore:
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
        return open_datastore(path, meta)
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
        return open_datastore(path, meta)
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
    return open_datastore(path, meta)



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

