"""What the retrieval strategies (ralm / ralmspec, knnlm) share: option checks, OS3 (the
speculation stride) and its constants, the speculation counters (`SpeculationStats`, one
shape for both), and the stream that hands `on_text` only text no later retrieval can
change.

OS3 (RaLMSpec, Zhang et al. ICML'24) picks the speculation stride s of the next round:
the number of positions a round resolves, E(s), over the round's seconds, T(s), both from
g, the chance that a speculation is right, a (the seconds of one speculated position) and
the verification's cost. Two forms:

* RaLMSpec (`os3_stride`, `os3_rates`): g is the row's sliding-window estimate
  (`AcceptanceWindow`: of its last OS3_WINDOW checks, (hits + 1) / (n + 2)); a
  verification of n queries costs b(n) = b0 + b1 n (fitted by `fit_verify_cost` from the
  measured verification calls); a passage change costs a re-prefill, R seconds, which a
  row pays at a fraction 1 - g of its boundaries whatever s is (ralmspec re-prefills only
  where RaLM does). s = 0 is plain RaLM (a real retrieval at every boundary):
  E(0) = 1, T(0) = a + b(1) + (1 - g) R. Synchronous s >= 1: a round decodes s + 1
  strides (one after its real boundary, one after each of its s speculated boundaries) and
  verifies s + 1 queries: E(s) = (1 - g^(s+1)) / (1 - g),
  T(s) = (s + 1) a + b(s + 1) + (1 - g^(s+1)) R. Asynchronous s >= 1: every speculated
  boundary's real retrieval starts on a worker as soon as it is free and overlaps
  decoding; the result is applied at the first pause after it is ready, so a miss (or a
  change, which goes on with the passage in effect until verified) loses the decoding
  done while its verification ran, not a stride; s bounds a row's unverified boundaries
  (a row at s waits). One call then covers n(s) = min(s, ceil(b(1) / a)) boundaries (the
  worker is busy about b(n) while n strides pass), so per boundary E = 1 and
  T(s) = max(a, b(n) / n) + (1 - g)(b(n) + R): speculation beats T(0) whenever g > 0 and
  the worker keeps up; ties go to the largest s (more room, no cost), s = 0 only when
  strictly faster.
  A lookup that names another passage (chance d, `detect`; the window counts these apart)
  is verified at once, ending the round with no stride wasted; only a lookup that keeps
  the passage wrongly (chance m = 1 - g - d) wastes the rest of its round. With d > 0 the
  synchronous form counts the three outcomes (first non-keep at boundary j: a change
  resolves j boundaries in j a + b(j); a miss at i resolves i and the round runs on to
  its real boundary): E(s) = sum_j g^(j-1) (d + m) j + g^s (s + 1),
  T(s) = sum_j g^(j-1) d (j a + b(j)) + (sum_j g^(j-1) m + g^s) ((s + 1) a + b(s + 1))
  + (1 - g^(s+1)) R, j = 1..s; d = 0 gives the form above (counting a change as a miss,
  as before, overstated its cost: OS3 chose s = 0 where passages change often).
  The re-prefill term is E(s) (1 - g) R for every s: it shifts T/E by the same (1 - g) R,
  so it never changes the argmax; it keeps the predicted rates (and their ratio to s = 0)
  true.
* KNN-LM (`os3_stride_knnlm`, `os3_rates_knnlm`): every position of a round is
  speculated and the verification adds none: E(s) = (1 - g^s) / (1 - g),
  T(s) = s a + b(s B) for B active rows, the verification's search of n queries costing
  b(n) = b0 + b1 n (`fit_verify_cost` over the last VERIFY_FIT_CALLS verifications: a
  batched exact search costs ~2x one query at 8 queries on a CPU, so long rounds are not
  free), g = (kept + 1) / (n + 2) over the last KNN_WINDOW checks of the process (kept: the
  position's token stood). s = 0 is plain KNN-LM, a real step of a0 seconds plus a search
  of B queries per position: E(0) = 1, T(0) = a0 + b(B); it is taken unless a stride is
  predicted KNN_SPEC_MARGIN (5%) faster (a search too cheap to hide, or speculations that rarely
  stand). s = 0 holds for SHADOW_EVERY real steps, the first of which also makes the pick
  speculation would have made and notes whether it equals the real one (g stays
  measured); then OS3 is asked again (its cost and the shadow's, ~1 ms each where a step
  is ~30 ms, are paid once per SHADOW_EVERY steps).

s = argmax over 0..MAX_SPECULATION_STRIDE; until a and b are measured a round
uses the strategy's default (RALM_DEFAULT_STRIDE, KNNLM_DEFAULT_STRIDE).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from ..core.rows import stop_holdback

MAX_SPECULATION_STRIDE = 16
RALM_DEFAULT_STRIDE = 3  # ralmspec's s before OS3 has measurements
KNNLM_DEFAULT_STRIDE = 4  # speculative knnlm's
OS3_WINDOW = 16  # ralmspec's acceptance estimate: the row's last OS3_WINDOW checks
KNN_WINDOW = 256  # speculative knnlm's: the process's last KNN_WINDOW checks (every position is one)
KNN_SPEC_MARGIN = 1.05  # speculative knnlm speculates only where predicted >= 5% faster than plain
SHADOW_EVERY = 16  # speculative knnlm at s = 0: OS3 asked, and a shadow check, every SHADOW_EVERY real steps
VERIFY_FIT_CALLS = 64  # b0 + b1 n is fitted to the last VERIFY_FIT_CALLS verification calls


def number_in(name, v, lo, hi, integer: bool = True) -> None:
    """A ValueError naming `name` unless v is an integer (or, integer=False, a number) in
    [lo, hi] (bools are not numbers here)."""
    ok = not isinstance(v, bool) and isinstance(v, (int, np.integer) if integer else (int, float, np.number))
    if not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} in [{lo}, {hi}], got {v!r}")


def auto_or_int(v):
    """"auto", or an integer from its string (the CLI's form); anything else as it is, for
    `validate` to name."""
    if isinstance(v, str) and v != "auto":
        try:
            return int(v)
        except ValueError:
            return v
    return v


def check_speculation_stride(v) -> None:
    """A ValueError unless v is "auto" or an integer in [1, MAX_SPECULATION_STRIDE]."""
    if v != "auto":
        try:
            number_in("speculation_stride", v, 1, MAX_SPECULATION_STRIDE)
        except ValueError:
            raise ValueError(f"speculation_stride must be 'auto' or an integer in [1, {MAX_SPECULATION_STRIDE}], "
                             f"got {v!r}") from None


# ----------------------------------------------------------------------------- OS3
def os3_rates(gamma: float, a: float, b0: float, b1: float = 0.0, reprefill: float = 0.0,
              max_s: int = MAX_SPECULATION_STRIDE, asynchronous: bool = False, detect: float = 0.0) -> np.ndarray:
    """RaLMSpec's predicted boundaries per second E(s) / T(s) for s = 0..max_s (module
    docstring); rates[0] is plain RaLM's. `detect` (synchronous form only): the chance that
    a boundary's cache lookup names another passage, which ends the round at once with a
    verification (no stride wasted); gamma is then the chance of a lookup that keeps the
    passage and is right, and 1 - gamma - detect that of one that keeps it wrongly."""
    g = min(max(gamma, 0.0), 1.0 - 1e-9)
    s = np.arange(0, max_s + 1, dtype=np.float64)
    cost = lambda n: b0 + b1 * n  # noqa: E731  a verification of n queries
    if asynchronous:  # per boundary; n: the boundaries one call covers (module docstring)
        per_call = max(1.0, float(np.ceil(cost(1) / a))) if a > 0 else float(max_s)
        n = np.maximum(np.minimum(s, per_call), 1.0)
        e = np.ones_like(s)
        t = np.maximum(a, cost(n) / n) + (1 - g) * (cost(n) + reprefill)
    elif detect > 0:
        d = min(max(detect, 0.0), 1.0 - g)
        m = 1.0 - g - d
        e, t = np.zeros_like(s), np.zeros_like(s)
        for i, n in enumerate(s.astype(int)):
            j = np.arange(1, n + 1, dtype=np.float64)
            first = g ** (j - 1)  # boundaries 1..j-1 kept and right
            full = (n + 1) * a + cost(n + 1)  # the round runs to its real boundary n + 1
            e[i] = (first * d * j).sum() + (first * m * j).sum() + g ** n * (n + 1)
            t[i] = (first * d * (j * a + cost(j))).sum() + ((first * m).sum() + g ** n) * full
        t += (1 - g ** (s + 1)) * reprefill
    else:
        e = (1 - g ** (s + 1)) / (1 - g)
        t = (s + 1) * a + cost(s + 1) + (1 - g ** (s + 1)) * reprefill
    e[0], t[0] = 1.0, a + cost(1) + (1 - g) * reprefill  # s = 0: plain RaLM
    return e / np.maximum(t, 1e-30)


def os3_stride(gamma: float, a: float, b0: float, b1: float = 0.0, reprefill: float = 0.0,
               max_s: int = MAX_SPECULATION_STRIDE, asynchronous: bool = False, min_s: int = 0,
               detect: float = 0.0) -> int:
    """RaLMSpec's OS3: argmax over s in min_s..max_s of `os3_rates` (module docstring); 0
    (plain RaLM) when speculation cannot pay. Asynchronous: ties among s >= 1 go to the
    largest s, and s = 0 is taken only when strictly faster than every s >= 1.
    # gamma 0.9, a 1, b0 2 -> 5 (E/T: s=0 .333, 1 .475, 3 .573, 4 .585, 5 .586, 6 .580);
    # gamma 0, a 1, b0 100 -> 0 (every speculation wrong: each round wastes a stride)."""
    rates = os3_rates(gamma, a, b0, b1, reprefill, max_s, asynchronous, detect)
    if not asynchronous:
        return int(min_s + np.argmax(rates[min_s:]))
    lo = max(min_s, 1)
    tail = rates[lo:][::-1]
    best = lo + len(tail) - 1 - int(np.argmax(tail))
    return best if min_s >= 1 or rates[best] > rates[0] else 0


def fit_verify_cost(calls) -> tuple:
    """(b0, b1) of b(n) = b0 + b1 n, least squares over (n queries, seconds) of the
    verification calls, both >= 0. With fewer than two distinct n the slope cannot be
    seen: (mean seconds, 0), the cost taken as constant in n."""
    calls = list(calls)
    if not calls:
        return 0.0, 0.0
    n = np.array([c[0] for c in calls], np.float64)
    t = np.array([c[1] for c in calls], np.float64)
    if len(np.unique(n)) < 2:
        return float(t.mean()), 0.0
    b1, b0 = np.polyfit(n, t, 1)
    if b1 < 0:  # noise: no growth with n
        return float(t.mean()), 0.0
    if b0 < 0:  # through the origin
        return 0.0, float((n * t).sum() / (n * n).sum())
    return float(b0), float(b1)


@dataclasses.dataclass
class KnnMeasures:
    """What OS3 has measured of speculative KNN-LM with one datastore and settings, kept on
    the engine (`KnnlmStore.os3`, knnlm/search.py) so that a call starts from the last
    call's figures instead of the default stride: the last KNN_WINDOW check outcomes (g), the last
    VERIFY_FIT_CALLS (queries, seconds) of verifications and real searches (b(n)), the
    seconds of speculative steps (a) and of real steps less their searches (a0), and the costs
    speculative="auto" measured at a run's start (knnlm_decision.py), per queries per search."""

    outcomes: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=KNN_WINDOW))
    verify_log: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=VERIFY_FIT_CALLS))
    step_s: float = 0.0
    spec_steps: int = 0
    plain_s: float = 0.0
    plain_steps: int = 0
    costs: dict = dataclasses.field(default_factory=dict)  # queries per search -> KnnCosts (speculative="auto")

    def stride(self, rows: int, choose=None) -> int:
        """OS3's s for a round of `rows` active rows (0..MAX_SPECULATION_STRIDE), or the
        default stride until a speculative step and a verification were measured. `choose`:
        the rule (os3_stride_knnlm; the strategy passes its module's name for it)."""
        if not self.verify_log or not self.spec_steps:
            return KNNLM_DEFAULT_STRIDE
        g = (sum(self.outcomes) + 1) / (len(self.outcomes) + 2)
        b0, b1 = fit_verify_cost(self.verify_log)
        a = self.step_s / self.spec_steps
        a0 = self.plain_s / self.plain_steps if self.plain_steps else a
        return (choose or os3_stride_knnlm)(g, a, b0, b1, rows, a0=a0, min_s=0)


class AcceptanceWindow:
    """Per row, the outcomes of its last `size` checks: "keep" (the lookup kept the passage
    and was right: the round goes on), "change" (the lookup named another passage: verified
    at once, no stride wasted) or "miss" (it kept the passage wrongly: the round's strides
    after it are wasted). `gamma(b)` = (keeps + 1) / (n + 2) and `detect(b)` = changes /
    (n + 2) over them (gamma 0.5 before any), so old outcomes are forgotten (the paper's
    sliding window). A bool notes keep (True) or miss (False)."""

    OUTCOMES = ("keep", "change", "miss")

    def __init__(self, n_rows: int, size: int = OS3_WINDOW):
        self.size = int(size)
        self.rows = [collections.deque(maxlen=self.size) for _ in range(int(n_rows))]

    def note(self, b: int, outcome) -> None:
        if isinstance(outcome, (bool, np.bool_)):
            outcome = "keep" if outcome else "miss"
        if outcome not in self.OUTCOMES:
            raise ValueError(f"outcome must be one of {self.OUTCOMES} or a bool, got {outcome!r}")
        self.rows[b].append(outcome)

    def reset(self, b: int) -> None:
        self.rows[b].clear()

    def gamma(self, b: int) -> float:
        w = self.rows[b]
        return (sum(o == "keep" for o in w) + 1) / (len(w) + 2)

    def detect(self, b: int) -> float:
        w = self.rows[b]
        return sum(o == "change" for o in w) / (len(w) + 2)


def os3_rates_knnlm(g: float, a: float, b0: float, b1: float = 0.0, rows: int = 1,
                    max_s: int = MAX_SPECULATION_STRIDE, a0: float = None) -> np.ndarray:
    """KNN-LM's predicted positions per second E(s) / T(s) for s = 0..max_s (module
    docstring): a round of s >= 1 speculative steps of `rows` rows (a seconds each) is
    verified by one search of s * rows queries, b(n) = b0 + b1 n; rates[0] is plain
    KNN-LM's: a real step (a0 seconds without its search; default a) and a real search of
    `rows` queries for every position."""
    g = min(max(g, 0.0), 1.0 - 1e-9)
    s = np.arange(0, max_s + 1, dtype=np.float64)
    e = (1 - g ** s) / (1 - g)
    t = s * a + b0 + b1 * s * rows
    e[0], t[0] = 1.0, (a if a0 is None else a0) + b0 + b1 * rows
    return e / np.maximum(t, 1e-30)


def os3_stride_knnlm(g: float, a: float, b0: float, b1: float = 0.0, rows: int = 1,
                     max_s: int = MAX_SPECULATION_STRIDE, a0: float = None, min_s: int = 1) -> int:
    """KNN-LM's OS3: argmax over s in min_s..max_s of `os3_rates_knnlm`; with min_s = 0,
    s = 0 (plain KNN-LM) unless a stride is predicted KNN_SPEC_MARGIN faster (speculation's
    costs the model leaves out, re-picks and cache upkeep, are a few percent).
    # g 0.9, a 1, b 2 -> 6 (rate: s=1 .333, 3 .542, 5 .5850, 6 .5857, 7 .5797);
    # g 0.9, a 1, b(n) = 1 + n -> 3 (s=1 .333, 2 .380, 3 .387, 4 .382): dearer long rounds;
    # g 0.3, a 1.2, a0 1, b 0.2, min_s 0 -> 0 (s=0 .833, 1 .714, 2 .500): a cheap search
    # and speculations that rarely stand: plain KNN-LM."""
    rates = os3_rates_knnlm(g, a, b0, b1, rows, max_s, a0)
    best = 1 + int(np.argmax(rates[1:]))
    return 0 if min_s <= 0 and rates[0] * KNN_SPEC_MARGIN > rates[best] else max(best, min_s)


# ----------------------------------------------------------------------------- counters
@dataclasses.dataclass
class SpeculationStats:
    """The speculation counters of one call, the same for ralmspec and speculative knnlm.

    Per row: speculations made, checked by a verification (`checks`; those dropped by an
    earlier rollback are never checked), right (`hits`: the speculated passage / neighbours
    equal the true ones), rollbacks and the generated tokens they took back. Per call:
    verifications (calls, seconds), speculative lookups (calls, seconds), the stride of
    every round started (`plain_rounds`: those with s = 0, ralmspec's OS3 turning
    speculation off); with asynchronous verification the seconds decoding waited for a
    verification (`verify_wait_s`; of them at a finished row, `verify_wait_end_s`), the
    seconds of verifications made at once in the loop (`blocking_verify_s`: s = 0, a full
    row, a lone row's passage change) and the speculations whose verification ran while
    decoding went on (`overlapped`)."""

    batch: int
    verify_calls: int = 0
    verify_s: float = 0.0
    spec_calls: int = 0
    spec_s: float = 0.0
    verify_wait_s: float = 0.0
    verify_wait_end_s: float = 0.0
    blocking_verify_s: float = 0.0
    overlapped: int = 0
    strides: list = dataclasses.field(default_factory=list)

    ROW_COUNTERS = ("speculations", "checks", "hits", "rollbacks", "rollback_tokens")

    def __post_init__(self):
        for name in self.ROW_COUNTERS:
            setattr(self, name, np.zeros(self.batch, np.int64))
        self.retired = dict.fromkeys(self.ROW_COUNTERS, 0)  # of rows whose request has left

    def retire(self, b: int) -> None:
        """Row b's request has left its slot: its counts go to the call's totals, the row
        starts again from zero (for the next request)."""
        for name in self.ROW_COUNTERS:
            arr = getattr(self, name)
            self.retired[name] += int(arr[b])
            arr[b] = 0

    def total(self, name: str) -> int:
        """A row counter summed over the rows and the requests that have left."""
        return int(getattr(self, name).sum()) + self.retired[name]

    def accuracy(self, b=None) -> float:
        """OS3's running chance that a speculation is right, (hits + 1) / (checks + 2), of row
        b or of every row (and request) so far."""
        if b is None:
            return (self.total("hits") + 1) / (self.total("checks") + 2)
        return (int(self.hits[b]) + 1) / (int(self.checks[b]) + 2)

    def rolled_back(self, b: int, tokens: int) -> None:
        self.rollbacks[b] += 1
        self.rollback_tokens[b] += tokens

    def row_stats(self, b: int) -> dict:
        checks = int(self.checks[b])
        return dict(speculations=int(self.speculations[b]), speculation_checks=checks,
                    speculation_accuracy=round(int(self.hits[b]) / checks, 4) if checks else None,
                    rollbacks=int(self.rollbacks[b]), rollback_tokens=int(self.rollback_tokens[b]))

    def summary(self, asynchronous: bool = False) -> dict:
        checks, hits = self.total("checks"), self.total("hits")
        out = dict(
            speculations=self.total("speculations"), speculation_checks=checks, speculation_hits=hits,
            speculation_accuracy=round(hits / checks, 4) if checks else None,
            mean_speculation_stride=round(float(np.mean(self.strides)), 3) if self.strides else 0.0,
            plain_rounds=sum(1 for x in self.strides if x == 0),
            rollbacks=self.total("rollbacks"), rollback_tokens=self.total("rollback_tokens"),
            verify_calls=self.verify_calls, verify_s=round(self.verify_s, 4), speculation_s=round(self.spec_s, 4),
        )
        if asynchronous:
            out.update(verify_wait_s=round(self.verify_wait_s, 4), verify_wait_end_s=round(self.verify_wait_end_s, 4),
                       blocking_verify_s=round(self.blocking_verify_s, 4), speculations_while_verifying=self.overlapped)
        return out


# settings a retrieval run reports beside its counters under stats["retrieval"] (the same
# in every batch of a call: `merge_counters` keeps them, never sums them)
SETTINGS = frozenset({"datastore", "entries", "k", "knn_lambda", "knn_temperature", "search", "speculative"})


def merge_counters(parts: list) -> dict:
    """Per-batch stats["retrieval"] of one strategy as one: counters summed (settings, bools
    and text from the first batch), per-batch means (mean_*) averaged, the speculation
    accuracy recomputed from its sums."""
    out = dict(parts[0])
    for k, v in out.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in SETTINGS:
            vals = [p.get(k) or 0 for p in parts]
            out[k] = round(sum(vals) / len(vals), 4) if k.startswith("mean_") else \
                (round(sum(vals), 4) if isinstance(v, float) else sum(vals))
    if out.get("speculation_checks"):
        out["speculation_accuracy"] = round(out.get("speculation_hits", 0) / out["speculation_checks"], 4)
    return out


# ----------------------------------------------------------------------------- streaming
class FinalTextStream:
    """Hands on_text only text that is final: the rows' own streaming is switched off and
    each flush sends the text of the tokens no retrieval can change (all of it once the row
    has finished), holding back a tail that is half a character or could grow into a stop
    string."""

    def __init__(self, tokenizer, rows=()):
        self.tok = tokenizer
        self.on_text = {}
        self.sent = {}
        for r in rows:
            self.add(r)

    def add(self, row) -> None:
        """Stream `row` (a request that entered its slot) through this stream."""
        self.drop(row.index)
        if row.on_text is not None:
            self.sent[row.index] = row.streamed_text
            self.on_text[row.index] = row.detach_stream()

    def drop(self, b: int) -> None:
        """Row b's request has left its slot."""
        self.on_text.pop(b, None)
        self.sent.pop(b, None)

    def flush(self, state, final_upto) -> None:
        for b, cb in self.on_text.items():
            r = state.rows[b]
            n = final_upto(state, b)
            done = r.finish is not None and n == len(r.ids)
            if done:
                text = r.text
            else:
                text = self.tok.decode(r.ids[:n], skip_special_tokens=True)
                end = len(text)
                while end and text[end - 1] == "\ufffd":
                    end -= 1
                text = text[:stop_holdback(text, end, r.stop)]
            sent = self.sent[b]
            if len(text) > len(sent) and text.startswith(sent):
                cb(b, text[len(sent):])
                self.sent[b] = text


class SuccessorCache:
    """Speculative KNN-LM's cache (strategies/knnlm_runs.py), per row: for each neighbour a real
    search returned, the `next_n` datastore entries after it (id+1 .. id+next_n, those
    below `size`), the newest `capacity` kept."""

    def __init__(self, n_rows: int, size: int, next_n: int, capacity: int):
        self.rows = [collections.OrderedDict() for _ in range(int(n_rows))]
        self.size, self.next_n, self.capacity = int(size), int(next_n), int(capacity)

    def __len__(self) -> int:
        return len(self.rows)

    def reset(self, b: int) -> None:
        self.rows[b] = collections.OrderedDict()

    def insert(self, b: int, ids) -> None:
        """The entries after each of `ids` (-1: none) enter row b's cache, as its newest."""
        c, ids = self.rows[b], np.asarray(ids)
        succ = (ids[ids >= 0][None, :] + np.arange(1, self.next_n + 1)[:, None]).ravel()
        for x in succ[succ < self.size].tolist():
            c[x] = None
            c.move_to_end(x)
        while len(c) > self.capacity:
            c.popitem(last=False)

    def ids(self) -> np.ndarray:
        """[n_rows, capacity] int32: each row's cached ids, oldest first, -1 padded."""
        out = np.full((len(self.rows), self.capacity), -1, np.int32)
        for b, c in enumerate(self.rows):
            out[b, :len(c)] = np.fromiter(c, np.int32, len(c))
        return out
