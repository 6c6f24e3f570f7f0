"""The retrieval server: one loaded retriever answering `RemoteRetriever`s (remote.py) over
`multiprocessing.connection` sockets, one thread per connection.

    python -m lookahead_jax.retrieval serve --retriever bm25 --corpus F.jsonl [--port 8765]
    # stdout: "retrieval server ready on 127.0.0.1:8765 (bm25, N passages, corpus sha256 ...)"

Requests are (op, args) tuples; replies ("ok", result) or ("error", exception type, message):

    info                          {kind, size, corpus_sha256, corpus_source, protocol, ...}
    retrieve(queries, k)          the retriever's own (np.int64 [Q,k], np.float32 [Q,k])
    score(queries, candidates)    its list of np.float32 [M]
    retrieve_from(queries, candidates, k)
    passages(positions)           [(id, text, title)] for RemoteCorpus
    clear_query_cache             empties a dense retriever's query LRU (benchmarks)

`latency_ms` (--latency-ms, a labelled SIMULATION, as bench/ralmspec.py's
--retrieval-latency): every `retrieve` call sleeps that long first, once per call whatever
its number of queries; `retrieve_from` and `score` (the speculation cache) are not slowed.
The retriever is called from several connection threads at once, as RaLMSpec's worker thread
and decode loop call it in process (the retrievers are made for that: per-thread stemmers,
a locked query cache). Ctrl-C or SIGTERM stops the server.

Host-only module: no jax (a dense retriever it serves uses it).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener
from typing import Callable, Optional, Union

from .base import Retriever
from .remote import DEFAULT_HOST, DEFAULT_PORT, PROTOCOL, authkey_for

__all__ = ["READY", "serve"]

READY = "retrieval server ready on"  # the start of the line printed once it accepts clients


def _handlers(retriever: Retriever, info: dict, latency_s: float) -> dict:
    corpus = retriever.corpus

    def retrieve(queries, k):
        if latency_s > 0:
            time.sleep(latency_s)
        return retriever.retrieve(queries, k)

    def passages(positions):
        out = []
        for p in positions:
            p = int(p)
            if not 0 <= p < len(corpus):
                raise IndexError(f"passage {p} out of range for a corpus of {len(corpus)}")
            out.append((corpus[p].id, corpus[p].text, corpus[p].title))
        return out

    def clear_query_cache():
        clear = getattr(retriever, "clear_query_cache", None)  # dense: its query-embedding LRU
        if clear is not None:
            clear()

    return {"info": lambda: info, "retrieve": retrieve, "score": retriever.score,
            "retrieve_from": retriever.retrieve_from, "passages": passages,
            "clear_query_cache": clear_query_cache}


def _answer(conn, handlers: dict) -> None:
    """Answer one client's requests, in order, until it disconnects."""
    with conn:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            try:
                op, args = msg
                if op not in handlers:
                    raise ValueError(f"unknown request {op!r}; known: {', '.join(sorted(handlers))}")
                reply = ("ok", handlers[op](*args))
            except Exception as e:  # the client raises it; the server goes on
                reply = ("error", type(e).__name__, str(e))
            try:
                conn.send(reply)
            except (OSError, ValueError):
                return


def serve(retriever: Retriever, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, *,
          authkey: Union[bytes, str, None] = None, latency_ms: float = 0.0,
          log: Callable = None, ready: Optional[threading.Event] = None) -> None:
    """Answer clients until Ctrl-C / SIGTERM (or, off the main thread, forever). Port 0 picks
    a free port: the ready line says which. `ready` is set once clients are accepted."""
    corpus = getattr(retriever, "corpus", None)
    if corpus is None:
        raise ValueError("the retriever has no corpus: serve one from load_retriever or built from a Corpus")
    if latency_ms < 0:
        raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
    log = log or (lambda line: print(line, flush=True))
    key = authkey_for(host, authkey)
    info = dict(protocol=PROTOCOL, kind=retriever.kind, size=int(retriever.size),
                corpus_sha256=corpus.fingerprint, corpus_source=str(corpus.source) if corpus.source else None,
                simulated_latency_ms=float(latency_ms) or None)
    handlers = _handlers(retriever, info, latency_ms / 1e3)
    main = threading.current_thread() is threading.main_thread()
    if main:
        def stop(signum, frame):
            raise KeyboardInterrupt

        old = signal.signal(signal.SIGTERM, stop)
    threads = []  # the connections' (joined before returning: below)
    try:
        try:
            listener = Listener((host, port), authkey=key)
        except OSError as e:
            raise OSError(f"the retrieval server cannot listen on {host}:{port}: {e.strerror or e}; "
                          "choose another --port (0 = a free one)") from None
        with listener:
            h, p = listener.address
            sim = f", SIMULATED +{latency_ms:g} ms per retrieve call" if latency_ms else ""
            log(f"{READY} {h}:{p} ({retriever.kind}, {retriever.size:,} passages, corpus sha256 "
                f"{corpus.fingerprint[:16]}{sim})")
            if ready is not None:
                ready.set()
            while True:
                try:
                    conn = listener.accept()
                except AuthenticationError:
                    print("retrieval server: refused a client with the wrong key", file=sys.stderr, flush=True)
                    continue
                except (EOFError, ConnectionError):  # a client that left during the handshake
                    continue
                threads = [t for t in threads if t.is_alive()]
                threads.append(threading.Thread(target=_answer, args=(conn, handlers), daemon=True,
                                                name="retrieval-conn"))
                threads[-1].start()
    except KeyboardInterrupt:
        log("retrieval server stopped")
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)
        # a connection still inside a search when the interpreter exits is ended in native
        # code (jax, faiss), which may abort the process ("exception not rethrown"): let the
        # answers in flight finish first (a client that stays connected is left after 5 s)
        deadline = time.monotonic() + 5.0
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
