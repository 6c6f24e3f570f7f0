"""A retriever in another process: `RemoteRetriever` asks a retrieval server (server.py) over
a socket, with the same API and the same results as the retriever the server holds.

    python -m lookahead_jax.retrieval serve --retriever bm25 --corpus F.jsonl --port 8765
    r = RemoteRetriever("127.0.0.1:8765")           # or strategy retriever="remote:127.0.0.1:8765"
    ids, scores = r.retrieve(queries, k)            # the server's retriever's exact arrays
    r.corpus[ids[0, 0]].text

Why: in process, RaLMSpec's asynchronous verification shares the GIL with decoding, and
BM25's Python-level scoring holds it; out of process a search really overlaps decoding (the
client thread only waits on a socket). Results are the server's own `retrieve` / `score` /
`retrieve_from` arrays, pickled (np.int64 / np.float32, shapes as in process), so they are
bit for bit the in-process ones. Arguments are validated here first (base.Retriever's
checks, the same messages), so a bad call costs no round trip.

Transport: `multiprocessing.connection` (stdlib) with an HMAC authkey: the server answers
only clients that know the key, since both sides unpickle what they receive. The key is
`authkey=`, else $LOOKAHEAD_JAX_RETRIEVAL_KEY, else a fixed default that is only accepted
for a server on a loopback address. One connection per client thread (RaLMSpec's worker
thread and the decode loop call at once; the server answers each connection on its own
thread).

`corpus`: the passages RaLM puts before the question. With `corpus=PATH` (or a Corpus) the
local copy is used after checking its sha256 equals the server's; without it, passages are
fetched from the server when first needed (`RemoteCorpus`), so the client needs no copy of
the file and only the passages used travel.

Errors: no server -> RemoteRetrievalError naming the command that starts one; the server
gone mid-run -> RemoteRetrievalError at once (the socket closes); no answer within
`timeout` seconds -> RemoteRetrievalError (never a hang).

Host-only module: no jax.
"""

from __future__ import annotations

import ipaddress
import os
import threading
from collections.abc import Sequence as SequenceABC
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from typing import Optional, Sequence, Union

from .base import Retriever
from .corpus import Corpus, Passage, load_corpus

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "KEY_ENV", "PREFIX", "RemoteCorpus", "RemoteRetrievalError",
           "RemoteRetriever", "authkey_for", "is_remote", "parse_address", "serve_command"]

PREFIX = "remote:"  # a retriever named "remote:HOST:PORT" (strategies, CLI) is a RemoteRetriever
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8765
KEY_ENV = "LOOKAHEAD_JAX_RETRIEVAL_KEY"
_LOOPBACK_KEY = b"lookahead-jax-retrieval"  # the default key: loopback addresses only
PROTOCOL = 1  # the request / reply format below; the server's info says which it speaks
TIMEOUT_S = 600.0  # default wait for one answer (a long batched search on a big index)
PASSAGE_BATCH = 256  # passages per request when RemoteCorpus fetches many


class RemoteRetrievalError(ConnectionError):
    """The retrieval server cannot be reached, refused the key, went away or did not answer."""


def is_remote(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def parse_address(address) -> tuple:
    """"HOST:PORT", "remote:HOST:PORT" or (host, port) -> (host, port) (IPv4 or a name)."""
    if isinstance(address, tuple) and len(address) == 2:
        host, port = address
    else:
        text = str(address)
        text = text[len(PREFIX):] if text.startswith(PREFIX) else text
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"a retrieval server address is HOST:PORT (e.g. {DEFAULT_HOST}:{DEFAULT_PORT}), "
                             f"got {address!r}")
    try:
        port = int(port)
    except (TypeError, ValueError):
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"the port of a retrieval server address must be an integer in 0..65535, "
                         f"got {address!r}")
    return str(host), port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authkey_for(host: str, authkey: Union[bytes, str, None] = None) -> bytes:
    """The key to use: `authkey`, else $LOOKAHEAD_JAX_RETRIEVAL_KEY, else the default key,
    which only a loopback address may use (anyone can read it in this file)."""
    key = authkey if authkey is not None else os.environ.get(KEY_ENV) or None
    if key is None:
        if not _is_loopback(host):
            raise ValueError(f"a retrieval server on {host!r} (not a loopback address) needs a secret key: "
                             f"set {KEY_ENV} (or pass --authkey / authkey=) on the server and the client")
        return _LOOPBACK_KEY
    return key.encode() if isinstance(key, str) else bytes(key)


def serve_command(host: str, port: int) -> str:
    """The command that starts a server at host:port (for error messages)."""
    where = "" if host == DEFAULT_HOST else f" --host {host}"
    return (f"python -m lookahead_jax.retrieval serve --retriever bm25|dense|hnsw|ivf --corpus F.jsonl"
            f"{where} --port {port}")


class RemoteCorpus(SequenceABC):
    """The server's corpus, passages fetched on first use and kept: `len`, `[i]` -> Passage,
    `fingerprint` (its sha256), `source` (the server's path: a string, not read here)."""

    def __init__(self, retriever: "RemoteRetriever", n: int, fingerprint: str, source: Optional[str]):
        self._r, self._n, self.fingerprint, self.source = retriever, int(n), fingerprint, source
        self._cache: dict = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        i = int(i)
        if not -self._n <= i < self._n:
            raise IndexError(f"passage {i} out of range for a corpus of {self._n}")
        i %= self._n
        self.fetch([i])
        return self._cache[i]

    def fetch(self, positions) -> None:
        """Bring these passages over (those not here yet), PASSAGE_BATCH per request."""
        with self._lock:
            missing = sorted({int(p) for p in positions} - set(self._cache))
        for s in range(0, len(missing), PASSAGE_BATCH):
            part = missing[s:s + PASSAGE_BATCH]
            got = self._r.call("passages", part)
            with self._lock:
                self._cache.update({p: Passage(*t) for p, t in zip(part, got)})

    def contents(self, i: int) -> str:
        return self[i].contents

    def all_contents(self) -> list:
        self.fetch(range(self._n))
        return [self._cache[i].contents for i in range(self._n)]

    def __iter__(self):
        self.fetch(range(self._n))
        return (self._cache[i] for i in range(self._n))

    def __repr__(self) -> str:
        return f"RemoteCorpus({self._n} passages, sha256={self.fingerprint[:12]}..., server {self._r.address_text})"


class RemoteRetriever(Retriever):
    """A retriever served by `python -m lookahead_jax.retrieval serve` (module docstring).

    address: "HOST:PORT" (or "remote:HOST:PORT", or (host, port)).  authkey: the server's key
    (default: $LOOKAHEAD_JAX_RETRIEVAL_KEY, else the loopback default).  corpus: a local copy
    of the server's corpus (path or Corpus; its sha256 must match), else passages come from
    the server.  timeout: seconds to wait for one answer."""

    def __init__(self, address, *, authkey: Union[bytes, str, None] = None,
                 corpus: Union[Corpus, str, None] = None, timeout: float = TIMEOUT_S):
        self.address = parse_address(address)
        self.address_text = f"{self.address[0]}:{self.address[1]}"
        self._key = authkey_for(self.address[0], authkey)
        self.timeout = float(timeout)
        self._local = threading.local()
        self._conns: list = []
        self._conns_lock = threading.Lock()
        info = self.call("info")
        if info.get("protocol") != PROTOCOL:
            raise RemoteRetrievalError(f"the retrieval server at {self.address_text} speaks protocol "
                                       f"{info.get('protocol')}, this client {PROTOCOL}: run both from "
                                       "the same lookahead_jax version")
        self.info = info
        self.kind = info["kind"]
        self._size = int(info["size"])
        self.simulated_latency_ms = info.get("simulated_latency_ms") or 0.0
        if corpus is not None:
            local = load_corpus(corpus)
            if local.fingerprint != info["corpus_sha256"] or len(local) != self._size:
                raise ValueError(
                    f"corpus {local!r} is not the retrieval server's ({info.get('corpus_source')}: "
                    f"{self._size} passages, sha256 {info['corpus_sha256'][:16]}); pass the file the "
                    f"server was started with, or no corpus (passages then come from the server)")
            self.corpus = local
        else:
            self.corpus = RemoteCorpus(self, self._size, info["corpus_sha256"], info.get("corpus_source"))

    @property
    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        sim = f", SIMULATED +{self.simulated_latency_ms:g} ms per retrieve" if self.simulated_latency_ms else ""
        return f"RemoteRetriever({self.kind} at {self.address_text}, {self._size} passages{sim})"

    # ---- the public API: checked here, answered by the server's retriever
    def retrieve(self, queries: Sequence[str], k: int) -> tuple:
        queries = self._check_queries(queries)
        self._check_k(k)
        return self.call("retrieve", queries, int(k))

    def score(self, queries: Sequence[str], candidates: Sequence) -> list:
        queries = self._check_queries(queries)
        return self.call("score", queries, self._check_candidates(candidates, len(queries)))

    def retrieve_from(self, queries: Sequence[str], candidates: Sequence, k: int) -> tuple:
        queries = self._check_queries(queries)
        self._check_k(k)
        return self.call("retrieve_from", queries, self._check_candidates(candidates, len(queries)), int(k))

    def clear_query_cache(self) -> None:
        """Empty the served retriever's query-embedding LRU (dense; benchmarks' fairness)."""
        self.call("clear_query_cache")

    def _shortlist(self, queries: list, k: int) -> list:  # not used: `retrieve` asks the server
        raise NotImplementedError("RemoteRetriever answers retrieve() on the server")

    def _score_subset(self, queries: list, candidates: list) -> list:
        raise NotImplementedError("RemoteRetriever answers score() on the server")

    # ---- transport
    def call(self, op: str, *args):
        """One request on this thread's connection; the server's reply, or its error raised."""
        conn = self._connection()
        try:
            conn.send((op, args))
            answered = conn.poll(self.timeout)  # True also when the server closed the socket
            reply = conn.recv() if answered else None
        except (EOFError, OSError) as e:
            self._drop(conn)
            raise RemoteRetrievalError(
                f"the retrieval server at {self.address_text} went away during {op} ({type(e).__name__}); "
                f"start it again with: {serve_command(*self.address)}") from e
        if not answered:  # its late reply must never be read as the next call's answer
            self._drop(conn)
            raise RemoteRetrievalError(f"the retrieval server at {self.address_text} did not answer "
                                       f"{op} within {self.timeout:g} s (timeout=)")
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        error = {"ValueError": ValueError, "TypeError": TypeError, "IndexError": IndexError}.get(kind)
        if error is not None:
            raise error(message)
        raise RemoteRetrievalError(f"the retrieval server at {self.address_text} failed on {op}: "
                                   f"{kind}: {message}")

    def _connection(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        try:
            conn = Client(self.address, authkey=self._key)
        except AuthenticationError as e:
            raise RemoteRetrievalError(f"the retrieval server at {self.address_text} refused this client's "
                                       f"key: set {KEY_ENV} (or authkey=) to the server's key") from e
        except OSError as e:
            raise RemoteRetrievalError(f"no retrieval server at {self.address_text} ({e.strerror or e}); "
                                       f"start one with: {serve_command(*self.address)}") from None
        except EOFError as e:
            raise RemoteRetrievalError(f"{self.address_text} closed the connection during the handshake: "
                                       "is it a lookahead_jax retrieval server?") from e
        self._local.conn = conn
        with self._conns_lock:
            self._conns.append(conn)
        return conn

    def _drop(self, conn) -> None:
        """Forget a broken connection (the next call on this thread opens a new one)."""
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._conns_lock:
            if conn in self._conns:
                self._conns.remove(conn)
        try:
            conn.close()
        except OSError:
            pass

    def close(self) -> None:
        """Close every thread's connection."""
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except OSError:
                pass
        self._local = threading.local()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
