"""Command line: build a retrieval index into the cache, query one, or serve one.

    python -m lookahead_jax.retrieval build --corpus F.jsonl --retriever bm25|dense|hnsw|ivf
        [--encoder minilm] [--out DIR] [--force]
    python -m lookahead_jax.retrieval query --corpus F.jsonl --retriever bm25 [-k 5] "a question"
    python -m lookahead_jax.retrieval serve --corpus F.jsonl --retriever bm25
        [--host 127.0.0.1] [--port 8765] [--latency-ms X]

`serve` answers `RemoteRetriever("HOST:PORT")` (a strategy's retriever="remote:HOST:PORT")
until Ctrl-C / SIGTERM (server.py; the key: $LOOKAHEAD_JAX_RETRIEVAL_KEY, needed off loopback).

`--out DIR` is the cache directory (default `<LOOKAHEAD_JAX_CACHE or ~/.cache/lookahead_jax>/
retrieval`); load from it with `load_retriever(..., cache_dir=DIR)`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional, Sequence

from .corpus import CorpusError, load_corpus
from .remote import DEFAULT_HOST, DEFAULT_PORT
from .encoders import DEFAULT_ENCODER, EncoderUnavailable
from .store import KINDS, IndexUnavailable, build_index, index_dir, is_built, load_retriever

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lookahead_jax.retrieval",
                                description="Build, query or serve retrieval indexes (BM25, dense, faiss).")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("build", "build an index into the cache (skipped when up to date)"),
                        ("query", "print the top-k passages for queries"),
                        ("serve", "answer RemoteRetriever clients (retriever=remote:HOST:PORT)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--corpus", required=True, help="JSON Lines file of {id, text, title?}")
        s.add_argument("--retriever", required=True, choices=KINDS)
        s.add_argument("--encoder", default=DEFAULT_ENCODER,
                       help=f"dense encoder name (default {DEFAULT_ENCODER}; see register_encoder)")
        s.add_argument("--out", default=None, help="cache directory (default: the project cache)")
        if name == "build":
            s.add_argument("--force", action="store_true", help="rebuild even when up to date")
            s.add_argument("--quiet", action="store_true", help="no progress bars")
        elif name == "serve":
            s.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST}; "
                           "another than loopback needs $LOOKAHEAD_JAX_RETRIEVAL_KEY)")
            s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0 = a free one")
            s.add_argument("--latency-ms", type=float, default=0.0, metavar="MS",
                           help="SIMULATION: every retrieve call sleeps MS ms first (labelled; default 0)")
        else:
            s.add_argument("-k", type=int, default=5)
            s.add_argument("queries", nargs="+")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        corpus = load_corpus(args.corpus)
        if args.command == "build":
            if not args.force and is_built(args.retriever, corpus, args.encoder, args.out):
                print(f"{args.retriever} index of {len(corpus):,} passages is up to date", file=sys.stderr)
                print(index_dir(args.retriever, corpus, args.encoder, args.out))
                return 0
            t0 = time.perf_counter()
            path = build_index(args.retriever, corpus, encoder=args.encoder, cache_dir=args.out,
                               force=args.force, progress=not args.quiet)
            print(f"{args.retriever} index of {len(corpus):,} passages in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
            print(path)
            return 0
        r = load_retriever(args.retriever, corpus, encoder=args.encoder, cache_dir=args.out)
        if args.command == "serve":
            from .server import serve

            if args.latency_ms:
                print(f"SIMULATION: every retrieve call sleeps {args.latency_ms:g} ms first (--latency-ms)",
                      file=sys.stderr, flush=True)
            serve(r, args.host, args.port, latency_ms=args.latency_ms)
            return 0
        ids, scores = r.retrieve(args.queries, min(args.k, len(corpus)))
        for q, row, srow in zip(args.queries, ids, scores):
            print(f"# {q}")
            for i, s in zip(row, srow):
                if i >= 0:
                    print(f"{s:9.4f}  {corpus[i].id}  {corpus[i].text[:100]}")
        return 0
    except (CorpusError, FileNotFoundError, IndexUnavailable, EncoderUnavailable, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
