"""Retrieval-augmented decoding on the one decode loop: in-context RaLM (RaLMSpec, its
speculative form, is ralmspec.py).

RaLM (in-context retrieval-augmented LM, `strategy="ralm"`), per row:

    passage = top-1 of retrieve(question text)               # before the first prefill
    row prompt = head + passage tokens + "\\n\\n" + question + tail   # passage before the question
    every `stride` generated tokens (boundary g = stride, 2*stride, ...):
        query = text of the last `query_tokens` tokens of question + generated[:g]
        p = top-1 of retrieve(query)
        p != passage: new row prompt with p, keep generated[:g], re-prefill (`replace_prompt`:
                      the cache keeps the prefix shared with the old context, e.g. the
                      head; the rest is forwarded)
        p == passage: decoding just continues

The question is the prompt's text (after the BOS the tokenizer added), or for a chat prompt
the content of its last user message: head and tail are the chat template's tokens around
it (generate's `encode_prompts(spans=True)`), so the passage goes inside the user turn and
the template's own words (system prompt, role names) never enter a query. The passage is
`retriever.corpus[i].contents` (its title, when it has one, on its own line, then its
text), cut to `max_passage_tokens`. A boundary g only matters if a token after it is produced: rows that end
(EOS, stop string, max_new_tokens) at or before g never retrieve at g.

RaLMSpec (`strategy="ralmspec"`, ralmspec.py) gives the same outputs, token for token,
with fewer calls to the full index (speculative retrieval, verified in batches).

With `lookahead` (drafts as strategy "lookahead": its suffix drafter) a step can emit several tokens
and cross boundaries; they are processed in order, and tokens past a boundary whose passage
changes are cut. Streamed text (`on_text`) is only text that no later retrieval can change.

Host logic only: the forwards are decode.py's (`step`, `replace_prompt`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path

import jax
import numpy as np

from ..core.decode import replace_prompt, step
from ..core.multihost import broadcast_plan, multiprocess, padded
from ..drafters.trie import TrieDrafter
from .base import StrategyBase
from .speculation import FinalTextStream, auto_or_int, number_in

log = logging.getLogger(__name__)

SEPARATOR = "\n\n"  # between the passage and the prompt
MAX_STRIDE = 4096


@dataclasses.dataclass(frozen=True)
class RaLM(StrategyBase):
    """In-context retrieval-augmented decoding (module docstring): every `stride` generated
    tokens the last `query_tokens` tokens query the retriever and its top-1 passage is put
    before the prompt (the row is re-prefilled when the passage changes).

    retriever: a `retrieval.Retriever` built from a Corpus (its `.corpus` gives the text), or
        a kind ("bm25", "dense", "hnsw", "ivf") loaded with `retrieval.load_retriever(kind,
        corpus)` (the index must have been built: `python -m lookahead_jax.retrieval build`),
        or "remote:HOST:PORT": a `retrieval.RemoteRetriever` asking the server that
        `python -m lookahead_jax.retrieval serve` started (same results, out of process).
    corpus: the corpus (JSON Lines path or `Corpus`) when `retriever` is a kind; with
        "remote:..." optional (a local copy of the server's corpus, checked by sha256;
        without it passages come from the server).
    stride: generated tokens between retrievals (1..4096).  query_tokens: query length in
        tokens of prompt + output (the first query is the whole prompt).
    max_passage_tokens: passages are cut to this many tokens; the cache is sized for it (an
        error if a prompt plus a passage of that length cannot fit `max_cache_len`).
    lookahead: 0 = plain decoding (greedy or sampling); "auto" or N > 0 = drafts as strategy
        "lookahead" (its default, the suffix drafter) with decoding_length N; the row's
        prompt, with the passage in effect, is among what it drafts from."""

    retriever: object = None
    corpus: object = None
    stride: int = 4
    query_tokens: int = 32
    max_passage_tokens: int = 256
    lookahead: object = 0

    name = "ralm"
    uses_question_spans = True
    runs_own_loop = True
    help = "retrieval-augmented decoding: top-1 passage before the prompt, re-retrieved every --stride tokens"
    cli_names = {}
    parsers = {"retriever": str, "corpus": str, "lookahead": auto_or_int}
    metavars = {"retriever": "KIND|remote:HOST:PORT", "corpus": "JSONL", "lookahead": "N|auto"}
    field_help = {
        "retriever": "retriever kind bm25|dense|hnsw|ivf (its index built with python -m "
                     "lookahead_jax.retrieval build), or remote:HOST:PORT (a server started with "
                     "python -m lookahead_jax.retrieval serve)",
        "corpus": "the passages (JSON Lines of {id, text, title?}) the index was built from",
        "stride": "generated tokens between retrievals (default 4)",
        "query_tokens": "the query is the text of the last N tokens of prompt + output (default 32)",
        "max_passage_tokens": "passages are cut to N tokens; the cache is sized for them (default 256)",
        "lookahead": "drafts as --strategy lookahead (suffix drafter), N nodes or auto (default 0: none)",
    }

    def __post_init__(self):
        object.__setattr__(self, "lookahead", auto_or_int(self.lookahead))

    # ---- checks and components
    def validate(self) -> None:
        from ..retrieval import KINDS, UnknownRetriever
        from ..retrieval.remote import is_remote, parse_address

        r = self.retriever
        if r is None:
            raise ValueError(f"strategy {self.name!r} needs a retriever: retriever=<Retriever object>, "
                             f"retriever=KIND and corpus=PATH (KIND one of {', '.join(KINDS)}), or "
                             "retriever=remote:HOST:PORT (python -m lookahead_jax.retrieval serve)")
        if isinstance(r, str):
            if is_remote(r):
                parse_address(r)  # a ValueError naming the HOST:PORT form
            elif r not in KINDS:
                raise UnknownRetriever(f"unknown retriever {r!r}; valid: {', '.join(KINDS)}, remote:HOST:PORT, "
                                       "or a Retriever object")
            elif self.corpus is None:
                raise ValueError(f"retriever={r!r} needs corpus=PATH (the JSON Lines file its index was built from)")
        elif not all(callable(getattr(r, m, None)) for m in ("retrieve", "retrieve_from")):
            raise ValueError(f"retriever must be a retriever kind or a Retriever object, got {type(r).__name__}")
        number_in("stride", self.stride, 1, MAX_STRIDE)
        number_in("query_tokens", self.query_tokens, 1, 1 << 20)
        number_in("max_passage_tokens", self.max_passage_tokens, 1, 1 << 20)
        la = self.lookahead
        if la != "auto":
            from ..core import tree as tree_lib

            number_in("lookahead", la, 0, tree_lib.MAX_NODES)

    @property
    def takes_references(self) -> bool:  # lookahead drafts from them too
        return self.lookahead != 0

    def _lookahead(self):
        from .lookahead import Lookahead

        return None if self.lookahead == 0 else Lookahead(decoding_length=self.lookahead)

    def drafter(self, engine):
        la = self._lookahead()
        return la.drafter(engine) if la is not None else None

    def max_nodes(self, drafter=None) -> int:
        la = self._lookahead()
        if drafter is None:
            return 0
        return la.max_nodes(drafter) if la is not None else drafter.max_nodes

    def setup(self, engine, state, drafter=None, references=None):
        from ..core.acceptance import TokenMatch
        from ..core.budget import FixedBudget

        if drafter is None:
            return None, TokenMatch(state.sampling), FixedBudget(0)
        la = self._lookahead()
        if la is not None:
            return la.setup(engine, state, drafter, references)
        return drafter, TokenMatch(state.sampling), FixedBudget(drafter.max_nodes)

    def start(self, tokenizer, n_rows: int, engine=None):
        """The run over n_rows rows (`strategies.base.Run`): rewrites each entering prompt,
        then drives the loop."""
        return RalmRun(self, tokenizer, n_rows)


# ----------------------------------------------------------------------------- retrievers
_LOADED: dict = {}  # the last retriever loaded by (kind, corpus): one entry


def resolve_retriever(retriever, corpus=None):
    """A Retriever object as given, a `RemoteRetriever` for "remote:HOST:PORT" (a new one
    per run: it asks the server what it holds), or `load_retriever(kind, corpus)` (the last
    one loaded is kept, keyed by the corpus file's path, size and mtime)."""
    if not isinstance(retriever, str):
        return retriever
    from ..retrieval import load_retriever
    from ..retrieval.remote import RemoteRetriever, is_remote

    if is_remote(retriever):
        return RemoteRetriever(retriever, corpus=corpus)
    from ..retrieval.corpus import Corpus

    if isinstance(corpus, Corpus):
        key = (retriever, "sha256", corpus.fingerprint)
    else:
        p = Path(corpus).expanduser()
        st = p.stat() if p.is_file() else None
        key = (retriever, str(p.resolve()), st and (st.st_size, st.st_mtime_ns))
    if key not in _LOADED:
        r = load_retriever(retriever, corpus)
        _LOADED.clear()
        _LOADED[key] = r
    return _LOADED[key]


class ProcessZeroRetriever:
    """Over several processes: `retrieve` / `retrieve_from` answered by process 0's
    retriever and broadcast (`multihost.broadcast_plan`, ids and scores in one call), so
    that every process takes the same passages whatever its own index, encoder (a dense
    one's float rounding) or remote server would answer. The other processes do not search;
    they keep the retriever for its corpus (passage text). The answer is padded or cut to
    [len(queries), k] (INVALID = -1, score -inf) on process 0, so every process knows its
    shape beforehand. Every process must call it at the same points, as every collective."""

    def __init__(self, inner):
        self.inner, self.corpus = inner, inner.corpus

    def __getattr__(self, name):  # warm_up and the rest: the retriever's own
        return getattr(self.inner, name)

    def _agreed(self, call, n: int, k: int) -> tuple:
        got_ids, got_scores = call() if jax.process_index() == 0 else (None, None)
        ids, scores = broadcast_plan((padded(got_ids, n, k, -1, np.int32),  # (corpus < 2^31)
                                      padded(got_scores, n, k, -np.inf, np.float32)))
        return ids.astype(np.int64), scores

    def retrieve(self, queries, k):
        return self._agreed(lambda: self.inner.retrieve(queries, k), len(queries), k)

    def retrieve_from(self, queries, candidates, k):
        return self._agreed(lambda: self.inner.retrieve_from(queries, candidates, k), len(queries), k)


# ----------------------------------------------------------------------------- runs
class RalmRun:
    """RaLM over the rows of a decode state (`strategies.base.Run`): per row the request's
    original prompt and question span, the passage in effect, the next boundary, the
    passages used; retrieval counters of every request so far. Requests enter rows with
    `add` (the first retrieval) and leave with `remove`; `step` is one verify step and the
    retrievals it leads to."""

    picks_first_token = False  # prefill picks each row's first token, as for greedy

    def __init__(self, strat: RaLM, tokenizer, n_rows: int):
        self.strat, self.tok = strat, tokenizer
        self.retriever = resolve_retriever(strat.retriever, strat.corpus)
        corpus = getattr(self.retriever, "corpus", None)
        if corpus is None:
            raise ValueError("the retriever has no corpus to take passage text from: build it from a "
                             "retrieval.Corpus (e.g. BM25Retriever.build(corpus)) or use load_retriever")
        self.corpus = corpus
        self.n_docs = len(corpus)
        if multiprocess():  # every retrieval is process 0's (a per-step choice: the passages)
            self.retriever = ProcessZeroRetriever(self.retriever)
        B = int(n_rows)
        self.sep = list(tokenizer.encode(SEPARATOR, add_special_tokens=False))
        self.extra_tokens = strat.max_passage_tokens + len(self.sep)
        self.extra_note = (f"up to {self.extra_tokens} tokens of retrieved passage "
                           f"(max_passage_tokens={strat.max_passage_tokens})")
        self.orig = [[] for _ in range(B)]  # the request's own prompt per row
        self.span = [(0, 0)] * B  # its question's [start, end)
        self.passage = [-1] * B  # corpus position in effect per row
        self.next_g = [strat.stride] * B  # next boundary (generated tokens) per row
        self.history = [[] for _ in range(B)]  # (boundary, passage) where the passage changed
        self.row_reprefills = [0] * B
        self._tokens: dict = {}  # passage tokens by corpus position
        self.retrieval_s = self.last_retrieve_s = 0.0
        self.retrieval_calls = 0
        self.retrievals = 0  # queries answered by the full index
        self.reprefills = 0  # of the requests that have left
        # context tokens the re-prefills forwarded (root included) / kept in the cache (the
        # prefix the new context shares with the old: `replace_prompt`); a re-prefill from
        # slot 0 would have forwarded their sum
        self.reprefill_tokens = self.reused_tokens = 0
        self.reprefill_s, self.reprefill_calls = 0.0, 0  # re-prefills' time (a call: one batch of rows)
        self._stream = FinalTextStream(tokenizer)
        self._seg = None  # the verify steps since the last pause: (seconds, steps, tokens per row)

    def warm_up(self, state):
        """For `Slots.rehearse`: the retriever's own shapes a short request does not reach
        (a dense retriever's query lengths and counts: `DenseRetriever.warm_up`), compiled
        in a background thread while requests are served. Returns the thread (None: the
        retriever has nothing to warm up)."""
        warm = getattr(self.retriever, "warm_up", None)
        if not callable(warm):
            return None

        def work():
            try:
                warm(state.batch)
            except Exception:  # noqa: BLE001 - the shapes then compile at first use
                log.exception("the retriever's warm-up failed: its query shapes compile at first use")

        thread = threading.Thread(target=work, name="lookahead-jax-retriever-warm-up", daemon=True)
        thread.start()
        return thread

    # ---- text
    def _passage_tokens(self, pid: int) -> list:
        if pid not in self._tokens:
            text = self.corpus[int(pid)].contents
            self._tokens[pid] = list(self.tok.encode(text, add_special_tokens=False))[:self.strat.max_passage_tokens]
        return self._tokens[pid]

    def _prompt(self, b: int, pid: int) -> list:
        """head + passage + separator + question + tail (module docstring)."""
        orig, a = self.orig[b], self.span[b][0]
        return orig[:a] + self._passage_tokens(pid) + self.sep + orig[a:]

    def _question(self, b: int) -> list:
        a, e = self.span[b]
        return self.orig[b][a:e]

    def _query(self, state, b: int, g: int) -> str:
        ctx = self._question(b) + state.rows[b].ids[:g]
        return self.tok.decode(ctx[-self.strat.query_tokens:], skip_special_tokens=True)

    # ---- retrieval (timed)
    def _retrieve(self, queries, k):
        t0 = time.perf_counter()
        ids, _ = self.retriever.retrieve(queries, min(k, self.n_docs))
        self.last_retrieve_s = time.perf_counter() - t0
        self.retrieval_s += self.last_retrieve_s
        self.retrieval_calls += 1
        self.retrievals += len(queries)
        return np.asarray(ids)

    def _first_k(self) -> int:
        return 1

    # ---- requests enter and leave rows
    def add(self, state, rows, prompt_ids, spans=None) -> list:
        """The requests entering `rows`: the first retrieval (the whole question is the
        query) in one call; returns each row's prompt with its top-1 passage before the
        question. spans: per prompt the [start, end) of its question (None: after the BOS
        the tokenizer adds), e.g. a chat template's user message (module docstring)."""
        rows = [int(b) for b in rows]
        prompt_ids = [list(x) for x in prompt_ids]
        if spans is None:
            spans = [None] * len(rows)
        if len(spans) != len(rows) or len(prompt_ids) != len(rows):
            raise ValueError(f"add: {len(rows)} rows need as many prompts and spans")
        own_bos = None
        for i, (x, sp) in enumerate(zip(prompt_ids, spans)):
            if sp is None:
                from ..prompts import adds_bos, question_span

                own_bos = adds_bos(self.tok) if own_bos is None else own_bos
                spans[i] = question_span(self.tok, x, own_bos)
            a, e = spans[i]
            if not 0 <= a < e <= len(x):
                raise ValueError(f"a question span must be a [start, end) inside its prompt of {len(x)} tokens, "
                                 f"got {spans[i]!r}")
        for b, x, (a, e) in zip(rows, prompt_ids, spans):
            self._reset(b)
            self.orig[b], self.span[b] = x, (int(a), int(e))
        ids = self._retrieve([self.tok.decode(self._question(b), skip_special_tokens=True) for b in rows],
                             self._first_k())
        self._prefetched(rows, ids)
        out = []
        for b, row in zip(rows, ids):
            self.passage[b] = int(row[0])
            self.history[b] = [(0, int(row[0]))]
            out.append(self._prompt(b, int(row[0])))
            self._stream.add(state.rows[b])
        return out

    def _reset(self, b: int) -> None:
        """Row b starts a new request (the last one's counts stay in the totals)."""
        self.reprefills += self.row_reprefills[b]
        self.row_reprefills[b] = 0
        self.passage[b], self.next_g[b], self.history[b] = -1, self.strat.stride, []

    def remove(self, rows) -> None:
        for b in rows:
            self._reset(int(b))
            self.orig[int(b)] = []
            self._stream.drop(int(b))

    def close(self) -> None:
        pass

    def _prefetched(self, rows, ids) -> None:
        pass

    # ---- the loop
    def step(self, engine, state, drafter, rule, budget) -> None:
        """One turn: the retrievals due (rows that reached a boundary, e.g. just after their
        prefill), one verify step over the active rows, the retrievals it makes due; text no
        retrieval can change any more is streamed."""
        self._resolve(engine, state, drafter)
        if state.active.any():
            if self._seg is None:
                self._seg = [0.0, 0, [(len(r.ids), r.steps) for r in state.rows]]
            t0 = time.perf_counter()
            step(engine, state, drafter, rule, budget)
            self._seg[0] += time.perf_counter() - t0
            self._seg[1] += 1
            if self._paused(state) or not state.active.any():  # a pause ends the segment
                seconds, steps, n0 = self._seg
                self._seg = None
                self._timed_decode(state, seconds, steps, n0)
            self._resolve(engine, state, drafter)
        state.mark_finished()
        self._stream.flush(state, self.final_upto)

    def _timed_decode(self, state, seconds, steps, n0) -> None:
        pass

    def _due(self, state, b: int) -> bool:
        """Row b has reached its next boundary with a token still to come, or passed it."""
        r, g = state.rows[b], self.next_g[b]
        return g < r.max_new and (len(r.ids) > g or (len(r.ids) == g and r.finish is None))

    def _paused(self, state) -> bool:
        return any(self._due(state, b) for b in self._held(state))

    def _held(self, state) -> list:
        """The rows holding a request."""
        return [b for b in range(state.batch) if self.orig[b]]

    def final_upto(self, state, b: int) -> int:
        """Generated tokens of row b that no retrieval can change any more."""
        return min(len(state.rows[b].ids), self.next_g[b])

    def _resolve(self, engine, state, drafter) -> None:
        while True:
            due = [b for b in self._held(state) if self._due(state, b)]
            if not due:
                return
            ids = self._retrieve([self._query(state, b, self.next_g[b]) for b in due], 1)
            swaps = []
            for b, row in zip(due, ids):
                g, pid = self.next_g[b], int(row[0])
                self.next_g[b] = g + self.strat.stride
                if pid != self.passage[b]:
                    self.passage[b] = pid
                    self.history[b].append((g, pid))
                    swaps.append((b, g))
            self._swap(engine, state, drafter, swaps)

    def _swap(self, engine, state, drafter, swaps) -> None:
        """Re-prefill rows with their passage in effect, keeping g generated tokens."""
        if not swaps:
            return
        rows = [b for b, _ in swaps]
        t0 = time.perf_counter()
        kept = replace_prompt(engine, state, rows, [self._prompt(b, self.passage[b]) for b in rows],
                              [g for _, g in swaps], drafter=drafter)
        self.reprefill_s += time.perf_counter() - t0
        self.reprefill_calls += 1
        for b, k in zip(rows, kept):
            self.row_reprefills[b] += 1
            self.reused_tokens += int(k)
            self.reprefill_tokens += len(state.context(b)) - int(k)
        # lookahead: replace_prompt told the drafter (rollback(rows, kept)); the suffix drafter
        # rebuilds the row from the state's prompt, which holds the new passage, at its next
        # propose. A trie (a TrieDrafter given as drafter=) gets the passage's n-grams as
        # more inputs of the row's request.
        if isinstance(drafter, TrieDrafter):
            for b in rows:
                drafter.add_input(b, self._passage_tokens(self.passage[b]))

    def row_stats(self, b: int) -> dict:
        """Row b's retrieval record (generate puts it in `rows[b].retrieval`, the CLI in its
        --json rows): the passages used, from which generated token on, and their ids."""
        return dict(passages=[dict(from_token=int(g), position=int(p), id=str(self.corpus[int(p)].id))
                              for g, p in self.history[b]],
                    reprefills=self.row_reprefills[b])

    def counters(self) -> dict:
        """The retrieval counters of every request so far (ralmspec adds its
        `SpeculationStats`)."""
        return dict(retrieval_s=round(self.retrieval_s, 4), retrieval_calls=self.retrieval_calls,
                    retrievals=self.retrievals, reprefills=self.reprefills + sum(self.row_reprefills),
                    reprefill_tokens=self.reprefill_tokens, reused_tokens=self.reused_tokens,
                    reprefill_s=round(self.reprefill_s, 4))

    def summary(self) -> dict:
        """The counters under "retrieval" (the one shape of every retrieval run's counters,
        which the CLI sums over batches) and, as ralm has always given them, at the top of
        the stats too, with each row's passage changes."""
        c = self.counters()
        return dict(c, retrieval=c, passages=[[[int(g), int(p)] for g, p in h] for h in self.history])
