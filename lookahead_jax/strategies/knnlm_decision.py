"""Whether speculative KNN-LM speculates (`KNNLM(speculative="auto")`): decided once, at the
start of a run, from costs measured there.

Speculation saves real searches but adds work per position: a search of the row's cache
(and IVF candidates) in each speculative step, the pick made again at verification, the
cache's upkeep, and a verification search of s x B queries instead of B. Where a search is
cheap next to a forward (a small datastore), that extra work is not paid back and
speculative KNN-LM runs slower than plain KNN-LM (issue 53: 0.77x on a 26K-entry store).
So with speculative="auto" the run decodes its first `DECIDE_AFTER` positions by plain
KNN-LM steps (what plain would do: no loss), measures (`KnnCosts`, by
`KnnSpecRun.measure_costs`, knnlm_runs.py):

    forward_s   F: a real step less its search (forward, pick, host), the least of the
                first real steps
    search_s    S(B): a real search of the B active rows' queries (least of those steps)
    probe_s     S(n): a real search of n = s B queries (s: the fixed stride, or
                KNNLM_DEFAULT_STRIDE for "auto"), timed twice on the last step's hidden
                states tiled, the least taken
    spec_s      C: what a speculative step adds to a forward: the cache search (and IVF
                candidates), timed twice
    repick_s    P: one pick (`choose`), made again for a verified position
    upkeep_s    U: the cache's upkeep of one position (the real step's insert)

and `decide` applies OS3's KNN-LM model (speculation.py, `os3_rates_knnlm`) with
a = F + C + P + U, a0 = F, b(n) through (B, S(B)) and (n, S(n)), and g the measured chance
that a position keeps its token (the engine's record for this datastore and settings, once
it has MIN_OUTCOMES checks) or else PRIOR_GAMMA: speculate (at the fixed stride, or OS3's
best) only where that is predicted KNN_SPEC_MARGIN (5%) faster than plain KNN-LM; otherwise
the run goes on as plain KNN-LM (`KnnRun.step`: no caches, no shadow checks), so its worst
case is plain's time plus the measurement (a few searches, once per engine, datastore,
settings and row count: the costs are kept with OS3's measurements and reused by later
calls, which decide again with the g of that time). The decision is logged once (one line:
the costs and the choice) and reported as stats["retrieval"]["speculation_decision"].
speculative=True speculates whatever the costs (forced on), False is plain KNN-LM (off).
The tokens are plain KNN-LM's in every case (knnlm_runs.py's module docstring).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .speculation import KNN_SPEC_MARGIN, MAX_SPECULATION_STRIDE, fit_verify_cost, os3_rates_knnlm

__all__ = ["DECIDE_AFTER", "KnnCosts", "MIN_OUTCOMES", "PRIOR_GAMMA", "SpeculationDecision", "decide"]

DECIDE_AFTER = 2  # real (plain) steps of a run before speculative="auto" decides
PRIOR_GAMMA = 0.8  # g before MIN_OUTCOMES checks (1M-entry store, SmolLM2-135M: 0.81 of positions kept)
MIN_OUTCOMES = 32  # checks of the engine's record that replace the prior


@dataclasses.dataclass(frozen=True)
class KnnCosts:
    """Seconds measured at the start of a run (module docstring), for `rows` active rows."""
    rows: int
    forward_s: float
    search_s: float
    probe_queries: int
    probe_s: float
    spec_s: float = 0.0
    repick_s: float = 0.0
    upkeep_s: float = 0.0
    source: str = "measured"

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "source" and not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"KnnCosts.{f.name} must be a number >= 0, got {v!r}")
        if self.rows < 1 or self.probe_queries < 1:
            raise ValueError(f"KnnCosts needs rows >= 1 and probe_queries >= 1, got {self.rows}, {self.probe_queries}")

    def verify_cost(self) -> tuple:
        """(b0, b1): b(n) = b0 + b1 n through the two measured searches."""
        return fit_verify_cost([(self.rows, self.search_s), (self.probe_queries, self.probe_s)])


@dataclasses.dataclass(frozen=True)
class SpeculationDecision:
    """What a speculative KNN-LM run does: speculate (at `stride`, 0 = plain KNN-LM) and why."""
    mode: str  # "auto" (decided from costs) or "forced" (speculative=True)
    speculate: bool
    stride: object  # the stride speculation starts with (speculation_stride="auto": OS3's pick), 0: plain
    gamma: Optional[float] = None
    gamma_source: Optional[str] = None  # "measured" | "prior"
    predicted_speedup: Optional[float] = None  # best speculative rate / plain's, predicted
    costs: Optional[KnnCosts] = None
    reused: bool = False  # the costs were measured by an earlier call on this engine

    def as_dict(self) -> dict:
        out = dict(mode=self.mode, speculate=self.speculate, stride=self.stride)
        if self.costs is not None:
            c = self.costs
            out.update(gamma=round(self.gamma, 4), gamma_source=self.gamma_source,
                       predicted_speedup=round(self.predicted_speedup, 4), costs_reused=self.reused,
                       costs=dict(source=c.source, rows=c.rows, forward_ms=_ms(c.forward_s), search_ms=_ms(c.search_s),
                                  probe_queries=c.probe_queries, probe_search_ms=_ms(c.probe_s),
                                  spec_step_extra_ms=_ms(c.spec_s), repick_ms=_ms(c.repick_s),
                                  upkeep_ms=_ms(c.upkeep_s)))
        return out

    def line(self) -> str:
        """The one log line: the measured costs and the choice."""
        c = self.costs
        what = (f"speculate (stride {self.stride}, predicted {self.predicted_speedup:.2f}x plain)" if self.speculate
                else f"plain KNN-LM (speculation predicted {self.predicted_speedup:.2f}x plain)")
        return (f"speculative KNN-LM (auto): forward {_ms(c.forward_s)} ms, search of {c.rows} "
                f"{_ms(c.search_s)} ms, of {c.probe_queries} {_ms(c.probe_s)} ms, speculative step +{_ms(c.spec_s)} "
                f"ms, re-pick {_ms(c.repick_s)} ms, upkeep {_ms(c.upkeep_s)} ms, g {self.gamma:.2f} "
                f"({self.gamma_source}){' [costs of an earlier call]' if self.reused else ''} -> {what}")


def _ms(s: float) -> float:
    return round(1e3 * s, 3)


def decide(costs: KnnCosts, stride, gamma: Optional[float] = None, margin: float = KNN_SPEC_MARGIN,
           reused: bool = False) -> SpeculationDecision:
    """speculative="auto"'s choice (module docstring): `stride` is the strategy's
    speculation_stride (an int, or "auto": OS3's best of 1..MAX_SPECULATION_STRIDE);
    `gamma`: the measured chance that a position keeps its token, None for PRIOR_GAMMA."""
    if stride != "auto" and not (isinstance(stride, int) and 1 <= stride <= MAX_SPECULATION_STRIDE):
        raise ValueError(f"stride must be 'auto' or an integer in [1, {MAX_SPECULATION_STRIDE}], got {stride!r}")
    g, source = (PRIOR_GAMMA, "prior") if gamma is None else (float(gamma), "measured")
    c = costs
    b0, b1 = c.verify_cost()
    a = c.forward_s + c.spec_s + c.repick_s + c.upkeep_s
    rates = os3_rates_knnlm(g, a, b0, b1, c.rows, a0=c.forward_s)
    best = 1 + int(rates[1:].argmax()) if stride == "auto" else int(stride)
    speedup = float(rates[best] / rates[0])
    speculate = speedup > margin
    return SpeculationDecision(mode="auto", speculate=speculate, stride=best if speculate else 0, gamma=g,
                               gamma_source=source, predicted_speedup=speedup, costs=c, reused=reused)
