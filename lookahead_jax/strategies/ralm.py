"""Retrieval-augmented decoding on the one decode loop: in-context RaLM and RaLMSpec.

RaLM (in-context retrieval-augmented LM, `strategy="ralm"`), per row:

    passage = top-1 of retrieve(question text)               # before the first prefill
    row prompt = head + passage tokens + "\\n\\n" + question + tail   # passage before the question
    every `stride` generated tokens (boundary g = stride, 2*stride, ...):
        query = text of the last `query_tokens` tokens of question + generated[:g]
        p = top-1 of retrieve(query)
        p != passage: new row prompt with p, keep generated[:g], re-prefill (`replace_prompt`)
        p == passage: decoding just continues

The question is the prompt's text (after the BOS the tokenizer added), or for a chat prompt
the content of its last user message: head and tail are the chat template's tokens around
it (generate's `encode_prompts(spans=True)`), so the passage goes inside the user turn and
the template's own words (system prompt, role names) never enter a query. The passage is
`retriever.corpus[i].contents` (its title, when it has one, on its own line, then its
text), cut to `max_passage_tokens`. A boundary g only matters if a token after it is produced: rows that end
(EOS, stop string, max_new_tokens) at or before g never retrieve at g.

RaLMSpec (`strategy="ralmspec"`): the same outputs, token for token, with fewer calls to
the full index (speculated boundaries are checked in one batched call). Each row keeps a speculation cache of corpus positions (every real retrieval
adds its top-`prefetch`). At a boundary the *speculated* top-1 is the best cached passage
(`retriever.retrieve_from`, which scores a subset exactly as the full index does and ranks
ties the same way); the row goes on with it. After `s` speculated boundaries, at the next
boundary g', one batched `retriever.retrieve` takes the s speculated queries plus the query
at g': the first speculated boundary whose true top-1 differs is rolled back (generated ids
cut to it, prompt replaced by the true passage, later speculation dropped); when all s were
right the query at g' is a real retrieval, whose passage takes effect like RaLM's. A row that
ends with unverified boundaries is verified before it is final (a mismatch revives it).

Why the outputs are RaLM's: a verified boundary has RaLM's passage, so the tokens up to the
next boundary are RaLM's (greedy, or sampling keyed by (seed, row, absolute position)); a
passage change re-prefills exactly the context RaLM re-prefills. With an exact retriever a
rollback always changes the passage (the passage in effect is cached, so when it is still
the true top-1 the cache's top-1 is it too), i.e. RaLM re-prefilled there as well. A
retriever whose `retrieve_from` disagrees with `retrieve` (tests force this) can make a
rollback return to the passage it left: the row is then re-prefilled where RaLM kept
decoding, which gives RaLM's tokens as far as a block forward computes the K/V of an
incremental one (the property lookahead == greedy rests on). Rows are edited and
re-prefilled in different groupings by the two strategies, so identity also rests on a
row's logits not depending on the other rows of a forward, as for every strategy here.

OS3 (`speculation_stride="auto"`): a round decodes s + 1 strides (one after the round's
real boundary, one after each of its s speculated boundaries) and ends with one batched
retrieval. With per-boundary speculation accuracy gamma (independent), the round resolves
E(s) = sum_{i=0..s} gamma^i = (1 - gamma^(s+1)) / (1 - gamma) boundaries (all s right: s+1,
the last by the real retrieval; first miss at i: i) in (s + 1) * a + b seconds, a = one
stride of decoding plus one cache lookup, b = one verification retrieval. Each round picks

    s = argmax_{1 <= s <= MAX_SPECULATION_STRIDE}  E(s) / ((s + 1) * a + b)

from measured a (decode seconds per step * steps per stride + seconds per cache lookup), b
(seconds per verification call) and the row's running gamma ((hits + 1) / (checks + 2)).
Until a and b are measured, s = DEFAULT_SPECULATION_STRIDE.

Asynchronous verification (`async_verify=True`): when a row has s speculated boundaries and
reaches the next one, its batched verification goes to a worker thread and the row speculates
that boundary too and decodes on (XLA, numpy, bm25s and faiss release the GIL, so the
retrieval overlaps decoding). The result is applied at the next pause after it is ready: a
wrong speculation rolls the row back as above, dropping the speculations made since. One
verification is in flight at a time; a row that needs the next one, or ends with unverified
boundaries, waits for it. OS3's async form (the verification of a round overlaps the first
stride of the next; a miss wastes that stride): E(s) = (1 - gamma^s) / (1 - gamma) boundaries
(all s right: s; first miss at i: i) in
T(s) = s * a + gamma^s * max(0, b - a) + (1 - gamma^s) * max(a, b) seconds.
Stats: `verify_s` is the worker's retrieval time, `verify_wait_s` (counted in `retrieval_s`)
the time decoding waited for it, `speculations_while_verifying` the boundaries speculated
while a verification was in flight.

With `lookahead` (n-gram trie drafts, as strategy "lookahead") a step can emit several tokens
and cross boundaries; they are processed in order, and tokens past a boundary whose passage
changes are cut. Streamed text (`on_text`) is only text that no later retrieval can change.

Host logic only: the forwards are decode.py's (`decode`, `replace_prompt`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..core.decode import decode, replace_prompt
from .base import StrategyBase
from .speculation import FinalTextStream, auto_or_int, number_in

SEPARATOR = "\n\n"  # between the passage and the prompt
DEFAULT_SPECULATION_STRIDE = 3  # s before OS3 has measurements
MAX_SPECULATION_STRIDE = 16
MAX_STRIDE = 4096


@dataclasses.dataclass(frozen=True)
class RaLM(StrategyBase):
    """In-context retrieval-augmented decoding (module docstring): every `stride` generated
    tokens the last `query_tokens` tokens query the retriever and its top-1 passage is put
    before the prompt (the row is re-prefilled when the passage changes).

    retriever: a `retrieval.Retriever` built from a Corpus (its `.corpus` gives the text), or
        a kind ("bm25", "dense", "hnsw", "ivf") loaded with `retrieval.load_retriever(kind,
        corpus)` (the index must have been built: `python -m lookahead_jax.retrieval build`).
    corpus: the corpus (JSON Lines path or `Corpus`) when `retriever` is a kind.
    stride: generated tokens between retrievals (1..4096).  query_tokens: query length in
        tokens of prompt + output (the first query is the whole prompt).
    max_passage_tokens: passages are cut to this many tokens; the cache is sized for it (an
        error if a prompt plus a passage of that length cannot fit `max_cache_len`).
    lookahead: 0 = plain decoding (greedy or sampling); "auto" or N > 0 = n-gram trie drafts
        as strategy "lookahead" with decoding_length N (retrieved passages feed the trie)."""

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
    metavars = {"retriever": "KIND", "corpus": "JSONL", "lookahead": "N|auto"}
    field_help = {
        "retriever": "retriever kind bm25|dense|hnsw|ivf (its index built with python -m "
                     "lookahead_jax.retrieval build)",
        "corpus": "the passages (JSON Lines of {id, text, title?}) the index was built from",
        "stride": "generated tokens between retrievals (default 4)",
        "query_tokens": "the query is the text of the last N tokens of prompt + output (default 32)",
        "max_passage_tokens": "passages are cut to N tokens; the cache is sized for them (default 256)",
        "lookahead": "n-gram trie drafts as --strategy lookahead, N nodes or auto (default 0: none)",
    }

    def __post_init__(self):
        object.__setattr__(self, "lookahead", auto_or_int(self.lookahead))

    # ---- checks and components
    def validate(self) -> None:
        from ..retrieval import KINDS, UnknownRetriever

        r = self.retriever
        if r is None:
            raise ValueError(f"strategy {self.name!r} needs a retriever: retriever=<Retriever object>, or "
                             f"retriever=KIND and corpus=PATH (KIND one of {', '.join(KINDS)})")
        if isinstance(r, str):
            if r not in KINDS:
                raise UnknownRetriever(f"unknown retriever {r!r}; valid: {', '.join(KINDS)}, or a Retriever object")
            if self.corpus is None:
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
    def takes_references(self) -> bool:  # they seed lookahead's trie
        return self.lookahead != 0

    def _lookahead(self):
        from . import Lookahead

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

    def start(self, tokenizer, prompt_ids, engine=None, spans=None):
        """The per-call run (generate's hook): rewrites the prompts, then drives the loop.
        spans: per prompt the [start, end) of its question (module docstring)."""
        return RalmRun(self, tokenizer, prompt_ids, spans)


@dataclasses.dataclass(frozen=True)
class RaLMSpec(RaLM):
    """RaLM's outputs with speculative retrieval (module docstring).

    speculation_stride: speculated boundaries per verification: "auto" (OS3) or 1..16.
    prefetch: top-k of each real retrieval that enter the row's speculation cache.
    async_verify: run each batched verification on a worker thread while the rows decode on
        (module docstring, "Asynchronous verification")."""

    speculation_stride: object = "auto"
    prefetch: int = 20
    async_verify: bool = False

    name = "ralmspec"
    help = "ralm's tokens with speculative retrieval from a per-request cache, verified in batches"
    cli_names = {}  # RaLM's fields share their flags (--retriever, --stride, ...) with ralm
    field_help = dict(RaLM.field_help,
                      speculation_stride="speculated boundaries per verification: auto (OS3) or 1..16",
                      prefetch="top-k of each real retrieval added to the speculation cache (default 20)",
                      async_verify="verify on a worker thread while decoding goes on (default off)")

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "speculation_stride", auto_or_int(self.speculation_stride))

    def validate(self) -> None:
        super().validate()
        if self.speculation_stride != "auto":
            try:
                number_in("speculation_stride", self.speculation_stride, 1, MAX_SPECULATION_STRIDE)
            except ValueError:
                raise ValueError(f"speculation_stride must be 'auto' or an integer in "
                                 f"[1, {MAX_SPECULATION_STRIDE}], got {self.speculation_stride!r}") from None
        number_in("prefetch", self.prefetch, 1, 1 << 20)
        if not isinstance(self.async_verify, bool):
            raise ValueError(f"async_verify must be True or False, got {self.async_verify!r}")

    def start(self, tokenizer, prompt_ids, engine=None, spans=None):
        return RalmSpecRun(self, tokenizer, prompt_ids, spans)


# ----------------------------------------------------------------------------- retrievers
_LOADED: dict = {}  # the last retriever loaded by (kind, corpus): one entry


def resolve_retriever(retriever, corpus=None):
    """A Retriever object as given, or `load_retriever(kind, corpus)` (the last one loaded
    is kept, keyed by the corpus file's path, size and mtime)."""
    if not isinstance(retriever, str):
        return retriever
    from ..retrieval import load_retriever
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


# ----------------------------------------------------------------------------- runs
# the run-wide counters `summary()` adds to generate's stats (the CLI's summary sums them
# over batches; `passages` is per row)
COUNTERS = ("retrieval_s", "retrieval_calls", "retrievals", "reprefills", "speculations",
            "speculation_checks", "speculation_hits", "speculation_accuracy", "mean_speculation_stride",
            "rollbacks", "rollback_tokens", "verify_calls", "verify_s", "speculation_s", "verify_wait_s",
            "speculations_while_verifying")

class RalmRun:
    """One generate call of RaLM: per row the original prompt, the passage in effect, the
    next boundary, the passages used; retrieval counters. Hook protocol (generate.py):
    `extra_tokens` (cache sizing), `prompts()` (before prefill), `decode(...)` (instead
    of `decode.decode`), `summary()` (stats)."""

    picks_first_token = False  # prefill picks each row's first token, as for greedy

    def __init__(self, strat: RaLM, tokenizer, prompt_ids, spans=None):
        self.strat, self.tok = strat, tokenizer
        self.retriever = resolve_retriever(strat.retriever, strat.corpus)
        corpus = getattr(self.retriever, "corpus", None)
        if corpus is None:
            raise ValueError("the retriever has no corpus to take passage text from: build it from a "
                             "retrieval.Corpus (e.g. BM25Retriever.build(corpus)) or use load_retriever")
        self.corpus = corpus
        self.n_docs = len(corpus)
        self.orig = [list(x) for x in prompt_ids]
        B = len(self.orig)
        if spans is None:
            from ..prompts import adds_bos, question_span

            own_bos = adds_bos(tokenizer)
            spans = [question_span(tokenizer, x, own_bos) for x in self.orig]
        if len(spans) != B or not all(0 <= a < e <= len(x) for (a, e), x in zip(spans, self.orig)):
            raise ValueError(f"spans must give one [start, end) inside each of the {B} prompts, got {spans!r}")
        self.span = [(int(a), int(e)) for a, e in spans]
        self.sep = list(tokenizer.encode(SEPARATOR, add_special_tokens=False))
        self.extra_tokens = strat.max_passage_tokens + len(self.sep)
        self.extra_note = (f"up to {self.extra_tokens} tokens of retrieved passage "
                           f"(max_passage_tokens={strat.max_passage_tokens})")
        self.passage = [-1] * B  # corpus position in effect per row
        self.next_g = [strat.stride] * B  # next boundary (generated tokens) per row
        self.history = [[] for _ in range(B)]  # (boundary, passage) where the passage changed
        self._tokens: dict = {}  # passage tokens by corpus position
        self.retrieval_s = 0.0
        self.retrieval_calls = 0
        self.retrievals = 0  # queries answered by the full index
        self.row_reprefills = [0] * B
        self._stream = None

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
        self.retrieval_s += time.perf_counter() - t0
        self.retrieval_calls += 1
        self.retrievals += len(queries)
        return np.asarray(ids)

    def _first_k(self) -> int:
        return 1

    # ---- hooks
    def prompts(self) -> list:
        """The initial retrieval (the whole question is the query): each row's prompt with its
        top-1 passage before the question."""
        ids = self._retrieve([self.tok.decode(self._question(b), skip_special_tokens=True)
                              for b in range(len(self.orig))], self._first_k())
        self._prefetched(range(len(self.orig)), ids)
        out = []
        for b, row in enumerate(ids):
            self.passage[b] = int(row[0])
            self.history[b] = [(0, int(row[0]))]
            out.append(self._prompt(b, int(row[0])))
        return out

    def _prefetched(self, rows, ids) -> None:
        pass

    def decode(self, engine, state, drafter, rule, budget) -> None:
        """Decode to the end, pausing at every boundary a row reaches (or crosses)."""
        self._stream = FinalTextStream(state, self.tok)
        while True:
            self._resolve(engine, state, drafter)
            self._stream.flush(state, self._final_upto)
            if not state.active.any():
                break
            t0, steps0 = time.perf_counter(), state.steps
            n0 = [(len(r.ids), r.steps) for r in state.rows]
            decode(engine, state, drafter, rule, budget, until=self._paused)
            self._timed_decode(state, time.perf_counter() - t0, state.steps - steps0, n0)
        self._stream.flush(state, self._final_upto)

    def _timed_decode(self, state, seconds, steps, n0) -> None:
        pass

    def _due(self, state, b: int) -> bool:
        """Row b has reached its next boundary with a token still to come, or passed it."""
        r, g = state.rows[b], self.next_g[b]
        return g < r.max_new and (len(r.ids) > g or (len(r.ids) == g and r.finish is None))

    def _paused(self, state) -> bool:
        return any(self._due(state, b) for b in range(state.batch))

    def _final_upto(self, state, b: int) -> int:
        """Generated tokens of row b that no retrieval can change any more."""
        return min(len(state.rows[b].ids), self.next_g[b])

    def _resolve(self, engine, state, drafter) -> None:
        while True:
            due = [b for b in range(state.batch) if self._due(state, b)]
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
        replace_prompt(engine, state, rows, [self._prompt(b, self.passage[b]) for b in rows],
                       [g for _, g in swaps], drafter=drafter)
        for b in rows:
            self.row_reprefills[b] += 1
        # lookahead: the new passage's n-grams seed the row's trie (its inputs)
        trie, req = getattr(drafter, "trie", None), getattr(drafter, "_req", None)
        if trie is not None and req is not None:
            for b in rows:
                trie.insert_input(self._passage_tokens(self.passage[b]), req[b])

    def row_stats(self, b: int) -> dict:
        """Row b's retrieval record (generate puts it in `rows[b].retrieval`, the CLI in its
        --json rows): the passages used, from which generated token on, and their ids."""
        return dict(passages=[dict(from_token=int(g), position=int(p), id=str(self.corpus[int(p)].id))
                              for g, p in self.history[b]],
                    reprefills=self.row_reprefills[b])

    def summary(self) -> dict:
        return dict(
            retrieval_s=self.retrieval_s, retrieval_calls=self.retrieval_calls, retrievals=self.retrievals,
            reprefills=sum(self.row_reprefills),
            passages=[[[int(g), int(p)] for g, p in h] for h in self.history],
        )


@dataclasses.dataclass
class _Spec:
    g: int  # boundary (generated tokens)
    query: str
    spec: int  # speculated passage (cache top-1)
    before: int  # passage in effect before the boundary


class RalmSpecRun(RalmRun):
    """One generate call of RaLMSpec: RalmRun plus per row the speculation cache, the
    unverified boundaries, the round's speculation stride and accuracy counters."""

    def __init__(self, strat: RaLMSpec, tokenizer, prompt_ids, spans=None):
        super().__init__(strat, tokenizer, prompt_ids, spans)
        B = len(self.orig)
        self.cache = [set() for _ in range(B)]
        self.records = [[] for _ in range(B)]
        self.s = [self._fixed_s() or DEFAULT_SPECULATION_STRIDE] * B
        self.checks = [0] * B  # verified speculations per row
        self.hits = [0] * B
        self.spec_s = 0.0
        self.spec_calls = 0
        self.verify_s = 0.0
        self.verify_calls = 0
        self.s_used = []  # s of every round started
        self._step_s = self._tokens_per_step = None  # OS3 measurements
        self.inflight = [[] for _ in range(B)]  # async: speculations being verified, per row
        self._pending = None  # async: (future, rows, spans) of the verification in flight
        self._pool = None
        self.verify_wait_s = 0.0
        self.overlapped = 0  # async: speculations made while a verification was in flight
        self.row_spec = [0] * B
        self.row_rollbacks = [0] * B
        self.row_rollback_tokens = [0] * B

    def _fixed_s(self) -> Optional[int]:
        s = self.strat.speculation_stride
        return None if s == "auto" else int(s)

    def _first_k(self) -> int:
        return self.strat.prefetch

    def _prefetched(self, rows, ids) -> None:
        for b, row in zip(rows, ids):
            self.cache[b].update(int(i) for i in row if i >= 0)

    def _paused(self, state) -> bool:
        return any(self._due(state, b) or self._unverified_end(state, b) for b in range(state.batch))

    def _unverified_end(self, state, b) -> bool:
        return (bool(self.records[b] or self.inflight[b]) and state.rows[b].finish is not None
                and not self._due(state, b))

    def _final_upto(self, state, b: int) -> int:
        pending = self.inflight[b] or self.records[b]
        g = pending[0].g if pending else self.next_g[b]
        return min(len(state.rows[b].ids), g)

    def decode(self, engine, state, drafter, rule, budget) -> None:
        try:
            super().decode(engine, state, drafter, rule, budget)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None

    def _timed_decode(self, state, seconds, steps, n0) -> None:
        tokens = sum(max(len(r.ids) - n, 0) for r, (n, _) in zip(state.rows, n0))
        row_steps = sum(r.steps - s for r, (_, s) in zip(state.rows, n0))
        if steps > 0 and row_steps > 0 and tokens > 0:
            ema = lambda old, new: new if old is None else 0.8 * old + 0.2 * new  # noqa: E731
            self._step_s = ema(self._step_s, seconds / steps)
            self._tokens_per_step = ema(self._tokens_per_step, tokens / row_steps)

    def os3(self, b: int) -> int:
        """The speculation stride of row b's next round (module docstring)."""
        fixed = self._fixed_s()
        if fixed is not None:
            return fixed
        if self._step_s is None or not self.verify_calls:
            return DEFAULT_SPECULATION_STRIDE
        a = self._step_s * self.strat.stride / self._tokens_per_step
        a += self.spec_s / max(self.spec_calls, 1)
        bt = self.verify_s / self.verify_calls
        return os3_stride((self.hits[b] + 1) / (self.checks[b] + 2), a, bt,
                          asynchronous=self.strat.async_verify)

    def _resolve(self, engine, state, drafter) -> None:
        asynchronous = self.strat.async_verify
        while True:
            spec, verify = [], []
            for b in range(state.batch):
                if self._due(state, b):
                    (verify if len(self.records[b]) >= self.s[b] else spec).append(b)
                elif self._unverified_end(state, b):
                    verify.append(b)
            if self._pending is not None and (verify or self._pending[0].done()):
                swaps = []
                self._collect(state, swaps)
                self._swap(engine, state, drafter, swaps)
                continue  # rolled-back rows have new boundaries; verified ones fewer records
            if not spec and not verify:
                return
            swaps = []
            if asynchronous:
                launch = [b for b in verify if self._due(state, b)]
                ended = [b for b in verify if not self._due(state, b)]
                if ended:  # nothing decodes on for a finished row: verify it now
                    self._verify(state, ended, swaps)
                if launch:
                    self._launch(launch)
                    spec += launch
            elif verify:
                self._verify(state, verify, swaps)
            if spec:
                self._speculate(state, sorted(spec), swaps)
            self._swap(engine, state, drafter, swaps)

    # ---- asynchronous verification
    def _launch(self, rows) -> None:
        """Start one batched verification of the listed rows' speculations on the worker;
        they move to `inflight` (the rows then speculate their current boundary)."""
        queries, spans = [], []
        for b in rows:
            recs, self.records[b] = self.records[b], []
            self.inflight[b] = recs
            spans.append((len(queries), len(recs)))
            queries += [r.query for r in recs]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ralmspec-verify")
        k = min(self.strat.prefetch, self.n_docs)

        def work():
            t0 = time.perf_counter()
            ids, _ = self.retriever.retrieve(queries, k)
            return np.asarray(ids), time.perf_counter() - t0

        self._pending = (self._pool.submit(work), list(rows), spans)

    def _collect(self, state, swaps) -> None:
        """Wait for the verification in flight (if not done) and apply it: a wrong speculation
        rolls its row back and drops the speculations made since."""
        future, rows, spans = self._pending
        self._pending = None
        t0 = time.perf_counter()
        ids, seconds = future.result()
        wait = time.perf_counter() - t0
        self.verify_wait_s += wait
        self.retrieval_s += wait
        self.verify_s += seconds
        self.verify_calls += 1
        self.retrieval_calls += 1
        self.retrievals += sum(n for _, n in spans)
        for b, (i0, n) in zip(rows, spans):
            recs, self.inflight[b] = self.inflight[b], []
            self._apply(state, b, recs, ids[i0:i0 + n], False, swaps)

    def _speculate(self, state, rows, swaps) -> None:
        queries = [self._query(state, b, self.next_g[b]) for b in rows]
        t0 = time.perf_counter()
        ids, _ = self.retriever.retrieve_from(queries, [np.fromiter(self.cache[b], np.int64) for b in rows], 1)
        dt = time.perf_counter() - t0
        self.spec_s += dt
        self.retrieval_s += dt
        self.spec_calls += 1
        for b, q, row in zip(rows, queries, ids):
            g, pid = self.next_g[b], int(row[0])
            pid = self.passage[b] if pid < 0 else pid  # INVALID: nothing cached (never: the passage is)
            if not self.records[b]:
                self.s_used.append(self.s[b])
            self.records[b].append(_Spec(g, q, pid, self.passage[b]))
            self.row_spec[b] += 1
            self.overlapped += self._pending is not None
            self.next_g[b] = g + self.strat.stride
            if pid != self.passage[b]:
                self.passage[b] = pid
                self.history[b].append((g, pid))
                swaps.append((b, g))

    def _verify(self, state, rows, swaps) -> None:
        """One batched retrieval: every listed row's speculated queries, plus the query at
        its current boundary when it is at one."""
        queries, spans = [], []
        for b in rows:
            now = self._due(state, b)
            q = [r.query for r in self.records[b]] + ([self._query(state, b, self.next_g[b])] if now else [])
            spans.append((len(queries), len(q), now))
            queries += q
        t0 = time.perf_counter()
        ids = self._retrieve(queries, self.strat.prefetch)
        self.verify_s += time.perf_counter() - t0
        self.verify_calls += 1
        for b, (i0, n, now) in zip(rows, spans):
            recs, self.records[b] = self.records[b], []
            self._apply(state, b, recs, ids[i0:i0 + n], now, swaps)

    def _apply(self, state, b, recs, got, now, swaps) -> None:
        """A verification's answers for row b: its top-k enter the cache, the speculations
        are checked (a rollback also drops those made since: async), the next s is chosen."""
        self._prefetched([b] * len(got), got)
        if not self._check(state, b, recs, got, now, swaps):
            self.records[b] = []
        self.s[b] = self.os3(b)

    def _check(self, state, b, recs, got, now, swaps) -> bool:
        """Row b's speculations `recs` against the true top-1s `got` (plus, when `now`, the
        real retrieval at its current boundary). False: rolled back at the first wrong one."""
        for rec, row in zip(recs, got):
            true = int(row[0])
            self.checks[b] += 1
            if true == rec.spec:
                self.hits[b] += 1
                continue
            # first wrong speculation: back to its boundary with the true passage
            self.row_rollbacks[b] += 1
            self.row_rollback_tokens[b] += len(state.rows[b].ids) - rec.g
            self.history[b] = [h for h in self.history[b] if h[0] < rec.g]
            if true != rec.before:
                self.history[b].append((rec.g, true))
            self.passage[b] = true
            self.next_g[b] = rec.g + self.strat.stride
            swaps.append((b, rec.g))
            return False
        if now:  # all right: the query at the current boundary was a real retrieval
            g, true = self.next_g[b], int(got[-1][0])
            self.next_g[b] = g + self.strat.stride
            if true != self.passage[b]:
                self.passage[b] = true
                self.history[b].append((g, true))
                swaps.append((b, g))
        return True

    def row_stats(self, b: int) -> dict:
        out = super().row_stats(b)
        checks = self.checks[b]
        out.update(speculations=self.row_spec[b], speculation_checks=checks,
                   speculation_accuracy=round(self.hits[b] / checks, 4) if checks else None,
                   rollbacks=self.row_rollbacks[b], rollback_tokens=self.row_rollback_tokens[b])
        return out

    def summary(self) -> dict:
        out = super().summary()
        checks = sum(self.checks)
        out.update(
            speculations=sum(self.row_spec), speculation_checks=checks, speculation_hits=sum(self.hits),
            speculation_accuracy=sum(self.hits) / checks if checks else None,
            mean_speculation_stride=float(np.mean(self.s_used)) if self.s_used else 0.0,
            rollbacks=sum(self.row_rollbacks), rollback_tokens=sum(self.row_rollback_tokens),
            verify_calls=self.verify_calls, verify_s=self.verify_s, speculation_s=self.spec_s,
        )
        if self.strat.async_verify:
            out.update(verify_wait_s=self.verify_wait_s, speculations_while_verifying=self.overlapped)
        return out


def os3_stride(gamma: float, a: float, b: float, max_s: int = MAX_SPECULATION_STRIDE,
               asynchronous: bool = False) -> int:
    """argmax over s in 1..max_s of E(s) / T(s) (module docstring). Synchronous:
    E(s) = (1 - gamma^(s+1)) / (1 - gamma), T(s) = (s + 1) a + b
    # gamma 0.9, a 1, b 2 -> 5 (E/T: s=1 .475, 3 .573, 4 .585, 5 .586, 6 .580).
    Asynchronous: E(s) = (1 - gamma^s) / (1 - gamma),
    T(s) = s a + gamma^s max(0, b - a) + (1 - gamma^s) max(a, b)."""
    gamma = min(max(gamma, 0.0), 1.0 - 1e-9)
    s = np.arange(1, max_s + 1)
    if asynchronous:
        g = gamma ** s
        rate = (1 - g) / (1 - gamma) / (s * a + g * max(0.0, b - a) + (1 - g) * max(a, b))
    else:
        rate = (1 - gamma ** (s + 1)) / (1 - gamma) / ((s + 1) * a + b)
    return int(s[int(np.argmax(rate))])
