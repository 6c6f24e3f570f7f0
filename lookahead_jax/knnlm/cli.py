"""Command line: build a KNN-LM datastore.

    python -m lookahead_jax.knnlm build --model smollm2-135m --corpus F.jsonl [--max-passages N]
        [--max-tokens 512] [--dtype float32] [--key-dtype float16|float32] [--out DIR] [--hnsw]
        [--force] [--quiet]

Without `--out` the datastore goes to the default place for (model, corpus), where
`generate --strategy knnlm --corpus F.jsonl` (or without --corpus, when it is the model's
only datastore) finds it; with `--out DIR` pass `--datastore DIR` to generate.

The build is resumable: interrupted (Ctrl-C: exit 130, saying how many passages are kept;
or killed), the same command again continues where it stopped, from `DIR.partial/`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from .build import MAX_TOKENS
from .datastore import KEY_DTYPES

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from ..presets import DEFAULT_MODEL

    p = argparse.ArgumentParser(prog="python -m lookahead_jax.knnlm",
                                description="Build a KNN-LM datastore (hidden state -> next token).")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a datastore (skipped when up to date)")
    b.add_argument("--model", default=DEFAULT_MODEL, help="preset name or local path (as generate's --model)")
    b.add_argument("--corpus", required=True, help="JSON Lines file of {id, text, title?}")
    b.add_argument("--max-passages", type=int, default=None, help="the first N passages only (default: all)")
    b.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"passages are cut to N tokens (default {MAX_TOKENS})")
    b.add_argument("--dtype", default="float32", help="the model's dtype: float32 | bfloat16 (as generate's)")
    b.add_argument("--key-dtype", default="float16", choices=KEY_DTYPES, help="storage of the keys (default float16)")
    b.add_argument("--out", default=None, help="datastore directory (default: the project cache, keyed by model "
                   "and corpus)")
    b.add_argument("--hnsw", action="store_true", help="also build the faiss HNSW index (knn_search=hnsw)")
    b.add_argument("--force", action="store_true", help="rebuild even when up to date (a partial build with the "
                   "same settings still resumes: delete DIR.partial to start afresh)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..retrieval.corpus import CorpusError, load_corpus
    from .build import BuildInterrupted, build_datastore
    from .datastore import DatastoreUnavailable, read_meta, datastore_dir, load_datastore

    args = _parser().parse_args(argv)
    if args.max_passages is not None and args.max_passages < 1:
        print("error: --max-passages must be >= 1", file=sys.stderr)
        return 2
    try:
        corpus = load_corpus(args.corpus)
        from .. import loading

        model, tok = loading.load(args.model, dtype=args.dtype)
        before = read_meta(Path(args.out).expanduser() if args.out else datastore_dir(model, corpus))
        path = build_datastore(model, tok, corpus, max_passages=args.max_passages, max_tokens=args.max_tokens,
                               key_dtype=args.key_dtype, path=args.out, force=args.force, hnsw=args.hnsw,
                               progress=not args.quiet)
        ds = load_datastore(model, corpus, path)
        m = ds.meta
        fresh = before is None or before.get("created") != m["created"]
        print(f"knnlm datastore: {ds.size:,} entries x {ds.dim} ({m['key_dtype']}) from {m['n_passages']:,} "
              f"passages, {ds.nbytes / 2**20:.1f} MiB, "
              + (f"built in {m['build_s']:.1f} s" if fresh else "up to date"), file=sys.stderr)
        print(path)
        return 0
    except BuildInterrupted as e:
        print(f"interrupted; rerun the same command to resume ({e.kept:,} of {e.total:,} passages kept)",
              file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted (before the build kept any passage)", file=sys.stderr)
        return 130
    except (CorpusError, FileNotFoundError, ValueError, RuntimeError, DatastoreUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
