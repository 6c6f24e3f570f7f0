"""Choosing the draft budget T (tree nodes per verify step) from measured costs.

Model: a step that verifies T draft nodes costs t(T) seconds (measured once per model,
batch, cache length and attention window by timing the compiled verify step) and emits
1 + a(T) tokens per row, where a(T) is the number of accepted drafts. Expected throughput
of a step over rows r is

    tokens/s(T) = sum_r E[1 + a_r(T)] / t(T),

and `AutoBudget` picks the bucket T that maximises it (one T per step: the batch shares
the verify block), but only leaves plain decoding (T = 0) when the best tree is predicted
to be at least `margin` (10%) faster: costs and acceptance are estimates, and a wrong
tree costs more than it saves (the target is "never slower than plain decoding").

a(T) is estimated without trying every T: drafters return nodes in best-first,
topological order, so the tree of budget T' < T is the first T' nodes of the full draft.
Since decoding is lossless, the tokens eventually generated are the ground truth, so for
every step we can compute, once enough later tokens are known, how many drafts *any*
budget would have had accepted (`accepted_lengths`). Those counts are kept per draft
*class* (`Draft.key`, e.g. the trie's match length and how dominant its top
continuation is), because acceptance differs a lot between classes: a two-token match
with a single continuation is accepted far more often than a one-token match with many.
The estimate of a(T) for the current draft is the mean over recent drafts of its class.

`AcceptanceStats` outlives a request (like the drafter's global trie: a drafter keeps
one), so a new request starts from what earlier ones measured. A class never seen yet
is predicted to accept nothing, so the step stays plain decoding (T = 0, never slower)
until evidence says a tree pays; its drafts are still proposed in full and scored, so
the evidence comes without trying.

A drafter that knows more about each draft than its class (the suffix drafter's path
probabilities: `Draft.accept_probs`, per node the chance it is accepted) gets a(T) from
the draft itself: a(T) = r(T) x (sum of the first T nodes' probabilities), where r(T),
the ratio of drafts accepted to drafts predicted within the first T nodes, is measured per
class like a(T) (`AcceptanceStats.calibration`; an unseen class starts at r = 1/2 worth
`calib_prior` = 8 predicted tokens, and a request's own drafts shrink towards the shared
ratio with the same weight; 8 to 32 replayed alike on recorded NQ answers, 2 lost ~3%
of the estimated speedup: bench/results/suffix-replay-auto.json). The tree size is still
chosen here, once per step for the whole batch: the drafter proposes its best-first tree
and the budget prices every prefix of it against the measured verify costs (expected
accepted tokens per unit of step time, plain decoding at T = 0 included).
"""

from __future__ import annotations

import collections
import numbers
from typing import Hashable, Optional, Protocol, Sequence, runtime_checkable

from .acceptance import TokenMatch
from .drafts import depths
from .tree import BUCKETS, buckets_up_to


# how many drafts a tree's first b nodes accept, given the true continuation: the host
# replay of the acceptance rule (one definition, next to the rule itself)
accepted_lengths = TokenMatch.accepted_lengths


def predicted_lengths(accept_probs) -> tuple:
    """The drafter's expected accepted drafts within the first T nodes, for T in `BUCKETS`:
    the sums of the nodes' acceptance probabilities (`Draft.accept_probs`).
    # [1.0, 0.5, 0.25] -> (0, 1.0, 1.75, 1.75, ...)"""
    out, total, i, q = [], 0.0, 0, list(accept_probs)
    for T in BUCKETS:
        while i < min(T, len(q)):
            total += float(q[i])
            i += 1
        out.append(total)
    return tuple(out)


def accepted_length(tokens, parents, actual, budget: int) -> int:
    """`accepted_lengths` for one budget."""
    return accepted_lengths(tokens, parents, actual, (budget,))[0]


def outcome_known(tokens, parents, actual, max_depth: int, depth=None) -> bool:
    """Whether later tokens can no longer change how many drafts are accepted: `actual`
    reaches the draft's depth, or the accepted path already stopped short of it (a node
    deeper than the first mismatch needs an accepted parent): the same as
    `accepted_length(tokens, parents, actual, len(tokens)) < len(actual)`, replayed only
    until a node at depth len(actual) is accepted. depth: `depths(parents)` if known
    (`Draft.depths`; the replay runs after every step while the outcome is open)."""
    n = len(actual)
    if n >= max_depth:
        return True
    if n == 0:  # nothing known yet: accepted length 0 is not short of it
        return False
    if depth is None:
        depth = depths(parents)
    ok = [False] * len(tokens)
    for i, (t, p, d) in enumerate(zip(tokens, parents, depth)):
        if d <= n and (p < 0 or ok[p]) and t == actual[d - 1]:
            if d == n:
                return False
            ok[i] = True
    return True


# `AutoBudget.propose_nodes`: plain choices in a row before proposing is thinned, the
# fewest active rows where it is, and the most steps between two probes
THIN_AFTER, THIN_ROWS, THIN_MAX_GAP = 4, 8, 16


@runtime_checkable
class BudgetPolicy(Protocol):
    """How many draft nodes a step verifies (`FixedBudget`, `AutoBudget`).

    buckets: the tree sizes it may pick (static shapes); max_nodes: the largest; plan(drafts,
    state) -> nodes allowed this step; record(T, window, seconds): a real step's time;
    score(state): after each step (e.g. score earlier drafts against the tokens now known);
    summary() -> dict for the call's stats; calibrate_s: seconds spent timing steps before
    decoding (not decode time)."""

    buckets: tuple
    calibrate_s: float

    @property
    def max_nodes(self) -> int: ...

    def propose_nodes(self, state) -> int: ...

    def plan(self, drafts, state) -> int: ...

    def record(self, T: int, window: int, seconds: float) -> None: ...

    def score(self, state) -> None: ...

    def summary(self) -> dict: ...


class FixedBudget:
    """A fixed draft budget: every step drafts up to `limit` nodes, padded to the smallest
    of `tree.buckets_up_to(limit)` that holds the largest draft (limit 0: plain decoding).

    The budget-policy interface of the decode loop (`AutoBudget` is the other one):
    `buckets`, `max_nodes`, `propose_nodes(state)` (the drafter's budget this step),
    `plan(drafts, state) -> nodes allowed this step`,
    `record(T, window, seconds)` (a real step's time), `score(state)` (after each step),
    `summary() -> dict` (for the call's stats)."""

    calibrate_s = 0.0

    def __init__(self, limit: int = 0):
        self.buckets = buckets_up_to(limit)  # validates the range
        self.max_nodes = limit

    def propose_nodes(self, state) -> int:
        return self.max_nodes

    def plan(self, drafts, state) -> int:
        return self.max_nodes

    def record(self, T: int, window: int, seconds: float) -> None:
        pass

    def score(self, state) -> None:
        pass

    def summary(self) -> dict:
        return {}


class NoTree:
    """`budget` for one step that verifies no tree (T = 0) and proposes none: a step of
    `Slots` that carries a prefill block (with `Slots.trees_while_prefilling` False; off by
    default: docs/serving.md, "Admission through the server") spends its time on the block, not on a
    speculation tree (issue 57: a tree step of the running batch plus a block was the
    stream's longest gap). The rest is `budget`'s: its buckets, the plain step's time
    recorded into its calibration, and the scoring of earlier drafts. Lossless: a row's
    tokens do not depend on the tree size."""

    def __init__(self, budget):
        self.budget = budget

    def __getattr__(self, name):
        return getattr(self.budget, name)

    def propose_nodes(self, state) -> int:
        return 0

    def plan(self, drafts, state) -> int:
        return 0


class AcceptanceStats:
    """Accepted drafts per budget bucket (all of `tree.BUCKETS`), kept per draft class over
    the last `window` scored drafts of that class.

    Per class it keeps the window's samples and their running sums (exact: counts are
    integers), so `expected` costs O(buckets) whatever the window: the policy asks for it
    every step, and on a GPU a step is a few milliseconds."""

    def __init__(self, window: int = 256):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.samples: dict = {}  # key -> deque of tuples (a(T) for T in BUCKETS)
        self._sums: dict = {}  # key -> [sum over the deque of a(T)] per bucket
        # drafts with the drafter's own estimates (Draft.accept_probs): key -> deque of
        # (a(T) per bucket, predicted a(T) per bucket), and its sums [accepted, predicted]
        self._calib: dict = {}
        self._calib_sums: dict = {}

    def observe(self, tokens, parents, actual, key: Hashable = None, accept_probs=None,
                depth=None) -> None:
        q = self.samples.get(key)
        if q is None:
            q = self.samples[key] = collections.deque(maxlen=self.window)
            self._sums[key] = [0] * len(BUCKETS)
        sums = self._sums[key]
        if len(q) == self.window:  # the oldest sample leaves the window
            for i, a in enumerate(q[0]):
                sums[i] -= a
        new = accepted_lengths(tokens, parents, actual, BUCKETS, depth)
        q.append(new)
        for i, a in enumerate(new):
            sums[i] += a
        if accept_probs is not None:
            c = self._calib.get(key)
            if c is None:
                c = self._calib[key] = collections.deque(maxlen=self.window)
                self._calib_sums[key] = ([0.0] * len(BUCKETS), [0.0] * len(BUCKETS))
            acc, pred = self._calib_sums[key]
            if len(c) == self.window:
                old_a, old_p = c[0]
                for i in range(len(BUCKETS)):
                    acc[i] -= old_a[i]
                    pred[i] -= old_p[i]
            p = predicted_lengths(accept_probs)
            c.append((new, p))
            for i in range(len(BUCKETS)):
                acc[i] += new[i]
                pred[i] += p[i]

    def calibration(self, key: Hashable = None) -> Optional[tuple]:
        """(accepted, predicted): per bucket of `BUCKETS`, the drafts accepted within the
        first T nodes and the drafter's estimate of them (`predicted_lengths`), summed over
        the class's recent drafts that carried estimates; None if none did."""
        return self._calib_sums.get(key) if self._calib.get(key) else None

    def expected(self, key: Hashable = None) -> Optional[dict]:
        """Mean accepted drafts {T: a(T)} over the class's recent drafts; None if unseen."""
        q = self.samples.get(key)
        if not q:
            return None
        n = len(q)
        return {b: s / n for b, s in zip(BUCKETS, self._sums[key])}

    def count(self, key: Hashable = None) -> int:
        q = self.samples.get(key)
        return len(q) if q else 0


# Typical cost of one forward of N query rows (all rows of the batch together: B x (1 + T)),
# relative to a forward of one row, per platform: the starting costs of `AutoBudget` when
# nothing was calibrated (real steps correct them, `StepTimes`). The weights are read once
# per forward whatever N, so small blocks ride along almost free until the block is
# compute-bound; beyond the table the cost grows linearly with N (the last segment's slope).
# CPU: measured with SmolLM2-135M at batch 1 (packed f32 kernels, 2 cores; a 1.5B model is
# as compute-bound per token), N = 32..128 re-measured after the kernel's cache-blocked
# product for blocks above 16 rows (length 200, two runs: 3.4 / 6.4-6.5 / 11.2-11.4); GPU:
# SmolLM2-135M on an H100, where up to ~16 rows cost about one; N = 128 extrapolated.
PRIOR_FORWARD_COST = {
    "cpu": {1: 1.0, 2: 1.08, 4: 1.13, 8: 1.33, 16: 1.95, 32: 3.4, 64: 6.4, 128: 11.3},
    "gpu": {1: 1.0, 2: 1.32, 4: 1.32, 8: 1.32, 16: 1.35, 32: 2.4, 64: 2.4, 128: 4.5},
}
# the same at batch 1, keyed by tree size T (a block of 1 + T rows)
PRIOR_COST_RATIOS = {p: {n - 1: c for n, c in t.items()} for p, t in PRIOR_FORWARD_COST.items()}


def forward_cost(platform: str, rows: int) -> float:
    """Prior cost of a forward of `rows` query rows relative to one row
    (`PRIOR_FORWARD_COST`): piecewise linear between the table's sizes, linear beyond.
    # forward_cost("cpu", 12) -> 1.64 (between 8: 1.33 and 16: 1.95); ("cpu", 256) -> 21.1
    """
    if rows < 1:
        raise ValueError(f"a forward has at least one row, got {rows}")
    table = PRIOR_FORWARD_COST["cpu" if platform == "cpu" else "gpu"]
    ns = sorted(table)
    for lo, hi in zip(ns, ns[1:]):
        if rows <= hi:
            return table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
    lo, hi = ns[-2], ns[-1]
    return table[hi] + (table[hi] - table[lo]) * (rows - hi) / (hi - lo)


def prior_costs(platform: str, buckets: Sequence[int], batch: int = 1) -> dict:
    """{T: t(T)/t(0)} for `platform` ("cpu", "gpu"/"cuda"/"rocm", "tpu": as gpu), the
    tree sizes asked (any T >= 0, not only the buckets) and a verify block of `batch` rows
    (every row of the cache is computed, busy or not): forward_cost(batch x (1 + T)) /
    forward_cost(batch). A tree is dearer
    in a fuller batch: on the CPU a 15-node tree costs 1.95 plain steps at batch 1 and
    ~8.5 at batch 8, where plain rows already make the block compute-bound; so `auto`
    drafts less as the batch fills, down to none.
    # prior_costs("cpu", (0, 1, 15), batch=8) -> {0: 1.0, 1: 1.47, 15: 8.5}"""
    bad = [b for b in buckets if not isinstance(b, numbers.Integral) or b < 0]
    if bad:
        raise ValueError(f"tree sizes must be integers >= 0, got {bad}")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    base = forward_cost(platform, batch)
    return {b: forward_cost(platform, batch * (1 + b)) / base for b in buckets}


class StepTimes:
    """Verify step times observed while decoding, as ratios to a plain decoding step.

    Calibration times each bucket a few times before a run; on a busy or throttling
    machine those readings are off by 10-20%, which is the whole margin of a tree that
    accepts one draft in three. Real steps are timed anyway (the host waits for their
    tokens), so every step of size T > 0 yields a sample t(T) / t(0), where t(0) is a
    moving average of recent plain steps at the same attention window. Ratios, not
    seconds: the machine's speed drifts by tens of percent within minutes, and it drifts
    for every T alike. A sample is only taken while that average is fresh (a plain step
    at the window within the last `max_age` steps). Shared by the requests of one model,
    batch and cache shape, like the calibrated costs."""

    def __init__(self, window: int = 32, max_age: int = 32, alpha: float = 0.3):
        if window < 1 or max_age < 1 or not 0 < alpha <= 1:
            raise ValueError(f"need window >= 1, max_age >= 1, 0 < alpha <= 1; got {window}, {max_age}, {alpha}")
        self.window, self.max_age, self.alpha = window, max_age, alpha
        self.steps = 0
        self.base: dict = {}  # attention window -> (moving average of t(0), step it was updated)
        self.samples: dict = {}  # T -> deque of t(T) / t(0)

    def record(self, T: int, window: int, seconds: float) -> None:
        self.steps += 1
        if T == 0:
            old = self.base.get(window)
            avg = seconds if old is None else (1 - self.alpha) * old[0] + self.alpha * seconds
            self.base[window] = (avg, self.steps)
            return
        base = self.base.get(window)
        if base is None or self.steps - base[1] > self.max_age:
            return
        q = self.samples.get(T)
        if q is None:
            q = self.samples[T] = collections.deque(maxlen=self.window)
        q.append(seconds / base[0])

    def ratio(self, T: int) -> tuple:
        """(median observed t(T) / t(0), number of samples); (None, 0) if none."""
        q = self.samples.get(T)
        if not q:
            return None, 0
        s = sorted(q)
        n = len(s)
        return (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2), n

    def blended(self, T: int, prior: float, weight: float) -> float:
        """t(T) / t(0): `prior` blended with the observed median, n samples weighted
        n : `weight` (the prior alone before any sample)."""
        obs, n = self.ratio(T)
        return prior if not n else (n * obs + weight * prior) / (n + weight)


class AutoBudget:
    """The bucket T that maximises expected tokens per second for the current drafts.

    One per batch (a `generate` call, or a `Slots` whose requests come and go). Its
    estimate of a(T) for a class blends the shared statistics with the request's own
    drafts of that class, weighting the shared mean like `prior` drafts of its own: a
    prompt on which a usually good class keeps failing (the model paraphrases this
    passage) stops drafting after a few steps instead of paying for trees until the shared
    window forgets. "Own" is per batch row and restarts when another request takes the
    row (a new `RowState` in it), so one request's failures never silence the next one's
    drafts, and a row whose drafts fail stops counting in the step's choice while the
    others' still do."""

    def __init__(self, buckets: Sequence[int], cost: dict, stats: Optional[AcceptanceStats] = None,
                 margin: float = 0.1, prior: float = 8.0, times: Optional[StepTimes] = None,
                 cost_prior: float = 4.0, calib_prior: float = 8.0, calib_start: float = 0.5):
        if not buckets:
            raise ValueError("AutoBudget needs at least one bucket")
        missing = [b for b in buckets if b not in cost]
        if missing:
            raise ValueError(f"no measured cost for buckets {missing}")
        unknown = [b for b in buckets if b not in BUCKETS]
        if unknown:
            raise ValueError(f"buckets {unknown} are not tree buckets {BUCKETS}")
        self.buckets = tuple(sorted(buckets))
        self.cost = dict(cost)
        self.stats = stats if stats is not None else AcceptanceStats()
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if prior < 0:
            raise ValueError(f"prior must be >= 0, got {prior}")
        self.margin = margin
        self.prior = prior
        # row -> (the RowState of its request, that request's drafts only); None: drafts
        # observed without a row (the statistics of the whole call)
        self.local: dict = {}
        self.times = times if times is not None else StepTimes()
        if cost_prior < 0:
            raise ValueError(f"cost_prior must be >= 0, got {cost_prior}")
        self.cost_prior = cost_prior
        if calib_prior <= 0 or calib_start < 0:
            raise ValueError(f"need calib_prior > 0 and calib_start >= 0, got {calib_prior}, {calib_start}")
        self.calib_prior, self.calib_start = calib_prior, calib_start
        self._pending: list = []  # (row state, tokens generated before, draft, its depth)
        # thinning (`propose_nodes`): plain choices in a row at >= THIN_ROWS rows, the
        # fewest rows among them, steps left before the next probe, proposals skipped
        self._plain_run, self._plain_rows, self._until_probe, self.skipped = 0, 0, 0, 0
        self.calibrate_s = 0.0  # set by whoever timed the steps first (Lookahead(calibrate=True))

    def record(self, T: int, window: int, seconds: float) -> None:
        """Time of a real verify step of bucket T at attention `window`."""
        self.times.record(T, window, seconds)

    def cost_ratios(self) -> dict:
        """t(T) / t(0) per bucket: the calibrated ratio, blended with the ratios observed
        on real steps (n samples weighted n : cost_prior), kept monotone in T."""
        c0 = self.cost.get(0) or self.cost[self.buckets[0]]
        out, floor = {}, 0.0
        for b in self.buckets:
            r = self.cost[b] / c0
            if b and self.buckets[0] == 0:  # observed ratios are to plain steps
                r = self.times.blended(b, r, self.cost_prior)
            floor = max(floor, r)
            out[b] = floor
        return out

    def _own(self, b, row, create: bool = False) -> Optional[AcceptanceStats]:
        """Row b's statistics while `row` (a RowState) holds it; a new request in the row
        starts empty (create=True, at plan time); None for a request that left the row."""
        hit = self.local.get(b)
        if hit is None or hit[0] is not row:
            if not create:
                return None
            hit = self.local[b] = (row, AcceptanceStats(window=1 << 30))
        return hit[1]

    def observe(self, tokens, parents, actual, key: Hashable = None, b=None, row=None,
                accept_probs=None, depth=None) -> None:
        """Score one draft against the tokens that followed it: into the shared
        statistics and the own ones of row b while `row` holds it (b None: the call's)."""
        self.stats.observe(tokens, parents, actual, key, accept_probs, depth)
        own = self._own(b, row, create=b is None)
        if own is not None:
            own.observe(tokens, parents, actual, key, accept_probs, depth)

    def _ratios(self, stats, key, prior: dict) -> dict:
        """r(T) = (accepted + calib_prior x prior(T)) / (predicted + calib_prior) per bucket
        over the class's drafts with estimates in `stats` (`prior` alone without any)."""
        cal = stats.calibration(key) if stats is not None else None
        if cal is None:
            return prior
        acc, pred = cal
        k = self.calib_prior
        return {T: (acc[i] + k * prior[T]) / (pred[i] + k) for i, T in enumerate(BUCKETS) if T in prior}

    def calibrated_ratios(self, key: Hashable = None, b=None) -> dict:
        """r(T) per bucket: accepted / predicted drafts of class `key` (module docstring),
        the shared ratio (from `calib_start`), then row b's own drafts shrunk towards it."""
        shared = self._ratios(self.stats, key, {T: self.calib_start for T in self.buckets})
        hit = self.local.get(b)
        return self._ratios(hit[1] if hit is not None else None, key, shared)

    def expected_accepted(self, key: Hashable = None, b=None, accept_probs=None) -> dict:
        """a(T) per bucket for drafts of class `key` (0 for an unseen class): the mean over
        the n drafts of the class that row b's request made (b None: the call's) and the
        shared mean, weighted n : prior. With the draft's own estimates (`accept_probs`):
        their sums over the first T nodes times the class's calibrated ratio r(T)."""
        if accept_probs is not None:
            pred = dict(zip(BUCKETS, predicted_lengths(accept_probs)))
            r = self.calibrated_ratios(key, b)
            return {T: r[T] * pred[T] for T in self.buckets}
        hit = self.local.get(b)
        own_stats = hit[1] if hit is not None else None
        shared = self.stats.expected(key)
        own = own_stats.expected(key) if own_stats is not None else None
        n = own_stats.count(key) if own_stats is not None else 0
        if shared is None:
            return {b: 0.0 for b in self.buckets}
        if own is None:
            return {b: shared[b] for b in self.buckets}
        w = n / (n + self.prior) if n + self.prior else 1.0
        return {b: w * own[b] + (1 - w) * shared[b] for b in self.buckets}

    @property
    def max_nodes(self) -> int:
        return self.buckets[-1]

    def propose_nodes(self, state) -> int:
        """The drafter's budget this step: `max_nodes`, or 0 (propose nothing) while trees
        have stopped paying at this occupancy. After THIN_AFTER plain choices in a row with
        >= THIN_ROWS active rows, the drafts are proposed (and scored) only on probe steps,
        with 1, 2, 4, ... up to THIN_MAX_GAP skipped steps between two probes; a probe that
        picks a tree, or fewer active rows than in the run (a fuller batch only pays more
        per tree), ends it. At high occupancy the proposing and scoring were ~2-3% of a
        plain step's time here with no tree ever chosen (the engine's slots driven directly,
        32 rows); thinning takes most of that away, and costs at most THIN_MAX_GAP steps of
        a tree that would have started paying."""
        if self._plain_run < THIN_AFTER:
            return self.max_nodes
        if int(state.active.sum()) < self._plain_rows:
            self._plain_run = 0
            return self.max_nodes
        if self._until_probe > 0:
            self._until_probe -= 1
            self.skipped += 1
            return 0
        return self.max_nodes

    def _note_choice(self, T: int, rows: int) -> None:
        """A step that had drafts chose T with `rows` active rows (for `propose_nodes`)."""
        if T or rows < THIN_ROWS:
            self._plain_run = 0
            return
        self._plain_rows = rows if self._plain_run == 0 else min(self._plain_rows, rows)
        self._plain_run += 1
        if self._plain_run >= THIN_AFTER:
            self._until_probe = min(THIN_MAX_GAP, 2 ** (self._plain_run - THIN_AFTER))

    def plan(self, drafts, state) -> int:
        """Nodes allowed this step (`choose` over the classes of the active rows' drafts);
        remembers the drafts so that `score` can count what every budget would have
        accepted once the rows' later tokens are known."""
        live = [b for b, a in enumerate(state.active) if a]
        full = [(b, drafts[b]) for b in live if len(drafts[b])]
        for b, _ in full:
            self._own(b, state.rows[b], create=True)
        self._pending += [(b, state.rows[b], len(state.rows[b].ids), d, d.max_depth) for b, d in full]
        T = self.choose([d.key for _, d in full], rows=len(live), owners=[b for b, _ in full],
                        accept_probs=[d.accept_probs for _, d in full])
        if full:
            self._note_choice(T, len(live))
        return T

    def score(self, state) -> None:
        """Score the drafts whose outcome is now decided (the row went past their depth,
        their path broke off, or the row finished)."""
        keep = []
        for b, row, g0, d, depth in self._pending:
            actual = row.ids[g0:]
            if row.finish or outcome_known(d.tokens, d.parents, actual, depth, d.depths):
                self.observe(d.tokens, d.parents, actual, d.key, b, row, d.accept_probs, d.depths)
            else:
                keep.append((b, row, g0, d, depth))
        self._pending = keep

    def summary(self) -> dict:
        return dict(
            proposals_skipped=self.skipped,  # steps that proposed nothing (`propose_nodes`)
            verify_cost_ms={b: round(c * 1e3, 2) for b, c in self.cost.items()},
            verify_cost_ratio={b: round(r, 3) for b, r in self.cost_ratios().items()},
            observed_cost_ratio={  # median t(T)/t(0) of real steps, samples
                b: [round(r, 3), n] for b in self.buckets for r, n in [self.times.ratio(b)] if n},
            expected_accepted={  # per draft class (e.g. the trie's match length, dominance)
                str(k): {b: round(a, 3) for b, a in self.expected_accepted(k).items()}
                for k in sorted(self.stats.samples, key=repr)},
            calibrated_ratio={  # per class of drafts with their own estimates: accepted / predicted
                str(k): {b: round(r, 3) for b, r in self.calibrated_ratios(k).items()}
                for k in sorted(self.stats._calib, key=repr)},
        )

    def choose(self, keys: Sequence[Hashable] = (None,), rows: Optional[int] = None,
               owners: Optional[Sequence] = None, accept_probs: Optional[Sequence] = None) -> int:
        """T for a step of `rows` active rows (default len(keys)), of which those with a
        draft have the classes `keys` (owners: their batch rows, whose own statistics
        count; default the call's); rows without a draft emit one token whatever T is.
        The step's cost ratio t(T) / t(0) is the whole block's (every row of the batch is
        computed), so a fuller batch pays more for the same tree and needs more accepted
        drafts across its rows to justify it. accept_probs: per draft its nodes' own
        estimates (`Draft.accept_probs`) or None."""
        rows = len(keys) if rows is None else rows
        if rows < len(keys):
            raise ValueError(f"{len(keys)} drafts for {rows} rows")
        owners = [None] * len(keys) if owners is None else list(owners)
        if len(owners) != len(keys):
            raise ValueError(f"{len(owners)} owners for {len(keys)} drafts")
        probs = [None] * len(keys) if accept_probs is None else list(accept_probs)
        if len(probs) != len(keys):
            raise ValueError(f"{len(probs)} estimates for {len(keys)} drafts")
        accs = [self.expected_accepted(k, o, p) for k, o, p in zip(keys, owners, probs)]
        ratio = self.cost_ratios()
        rate = {b: (rows + sum(a[b] for a in accs)) / ratio[b] for b in self.buckets}
        best = max(self.buckets, key=lambda b: (rate[b], -b))  # ties go to the smaller tree
        # a tree must beat plain decoding clearly: the estimates are noisy, plain is not
        if 0 in rate and best != 0 and rate[best] < (1 + self.margin) * rate[0]:
            return 0
        return best
