"""RaLMSpec's OS3 as pure functions (speculation.py): the cost model E(s) / T(s) over
s = 0..16 written out here, s = 0 (plain RaLM) where speculation cannot pay and a positive
stride where it clearly does, the verification cost b0 + b1 n fitted from measured calls,
the sliding-window acceptance estimate. RaLMSpec choosing s = 0 in a real run:
tests/test_ralm.py::test_every_speculation_wrong[auto]."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lookahead_jax.strategies.speculation import AcceptanceWindow, fit_verify_cost, os3_rates, os3_stride


def sync_rate(g, a, b0, b1, r, s):
    """RaLMSpec's boundaries per second at stride s (s = 0: plain RaLM), written out."""
    if s == 0:
        return 1 / (a + b0 + b1 + (1 - g) * r)
    return (1 - g ** (s + 1)) / (1 - g) / ((s + 1) * a + b0 + b1 * (s + 1) + (1 - g ** (s + 1)) * r)


def async_rate(g, a, b0, b1, r, s):
    """Async: per boundary; one call covers n = min(s, ceil(b(1) / a)) boundaries, a miss
    loses the decoding done while its verification ran, b(n)."""
    if s == 0:
        return sync_rate(g, a, b0, b1, r, 0)
    n = max(1, min(s, math.ceil((b0 + b1) / a)))
    b = b0 + b1 * n
    return 1 / (max(a, b / n) + (1 - g) * (b + r))


def async_best(want, min_s=0):
    """The async argmax: ties among s >= 1 to the largest s; s = 0 only when strictly best."""
    lo = max(min_s, 1)
    best = max((s for s in range(lo, len(want)) if want[s] >= max(want[lo:])))
    return best if min_s >= 1 or want[best] > want[0] else 0


def test_os3():
    """s = argmax over 0..16 of E(s) / T(s) (speculation.py's docstring); min_s=1 gives the
    argmax over 1..16 (the form OS3 had before s = 0 was allowed)."""
    cases = [(0.9, 1.0, 2.0), (0.5, 1.0, 10.0), (0.99, 0.1, 10.0), (0.0, 1.0, 1.0), (0.7, 2.0, 0.1)]
    for g, a, b in cases:
        for b1, r in ((0.0, 0.0), (0.3, 0.0), (0.3, 5.0)):
            for asyn, rate in ((False, sync_rate), (True, async_rate)):
                want = [rate(g, a, b, b1, r, s) for s in range(17)]
                np.testing.assert_allclose(os3_rates(g, a, b, b1, r, asynchronous=asyn), want, rtol=1e-9)
                best = async_best if asyn else lambda w, min_s=0: min_s + int(np.argmax(w[min_s:]))
                assert os3_stride(g, a, b, b1, r, asynchronous=asyn) == best(want)
                assert os3_stride(g, a, b, b1, r, asynchronous=asyn, min_s=1) == best(want, 1)
    assert os3_stride(0.9, 1.0, 2.0) == 5
    assert os3_stride(1.0, 1.0, 100.0) == 16  # always right: as far as allowed
    assert os3_stride(0.95, 1.0, 50.0) > os3_stride(0.95, 1.0, 1.0)  # dearer verification, longer rounds
    # async, verification hidden (b < a): speculate, as many unverified boundaries as allowed
    assert os3_stride(0.9, 1.0, 0.5, asynchronous=True) == 16
    assert os3_stride(0.1, 1.0, 0.5, asynchronous=True) == 16  # a miss loses b, plain RaLM waits b each time
    assert os3_stride(0.9, 1.0, 20.0, asynchronous=True) > 3  # dear verification: several per call
    # the re-prefill is paid at a fraction 1 - g of the boundaries whatever s: same argmax
    for g, a, b in cases:
        assert os3_stride(g, a, b, 0.1, 50.0) == os3_stride(g, a, b, 0.1, 0.0)


def test_os3_chooses_zero_when_speculation_cannot_pay():
    """s = 0 (plain RaLM) where speculation cannot pay, a positive stride where it clearly
    does; the verification cost grows with its batch."""
    # never right: each round only wastes strides, sync or async
    assert os3_stride(0.0, 1.0, 100.0) == 0 and os3_stride(0.0, 1.0, 5.0, asynchronous=True) == 0
    assert os3_stride(0.0, 1.0, 100.0, min_s=1) == 1  # the old OS3: verify every boundary, still speculating
    # verification all per query (b0 = 0): batching saves nothing, a lookup and a wasted stride cost
    assert os3_stride(0.9, 1.0, 0.0, 2.0) == 0
    # retrieval negligible beside decoding (0.2%, as bm25 on this CPU): nothing to save
    assert os3_stride(0.6, 1.0, 0.002, 0.0005, 26.0) == 0
    # retrieval dominates, mostly a fixed cost per call, speculation usually right: long rounds
    s = os3_stride(0.9, 1.0, 10.0, 0.2, 26.0)
    assert s >= 4
    rates = os3_rates(0.9, 1.0, 10.0, 0.2, 26.0)
    assert rates[s] > 1.5 * rates[0]
    assert os3_stride(0.9, 1.0, 10.0, 0.2, 26.0, asynchronous=True) >= 1
    # a steeper b1 shortens the rounds
    assert os3_stride(0.95, 1.0, 10.0, 2.0) < os3_stride(0.95, 1.0, 10.0, 0.0)


def test_verify_cost_fit():
    calls = [(n, 0.5 + 0.1 * n) for n in (1, 2, 3, 5, 8, 3, 1)]
    b0, b1 = fit_verify_cost(calls)
    assert b0 == pytest.approx(0.5) and b1 == pytest.approx(0.1)
    assert fit_verify_cost([(4, 1.0), (4, 3.0)]) == (2.0, 0.0)  # one batch size: constant
    assert fit_verify_cost([]) == (0.0, 0.0)
    b0, b1 = fit_verify_cost([(1, 0.1), (2, 0.3), (4, 0.8)])  # intercept < 0: through the origin
    assert b0 == 0.0 and b1 > 0
    assert fit_verify_cost([(1, 0.5), (4, 0.2)])[1] == 0.0  # no growth: constant


def test_acceptance_window_forgets_old_hits():
    w = AcceptanceWindow(2, size=4)
    assert w.gamma(0) == 0.5  # nothing seen
    for _ in range(10):
        w.note(0, True)
    assert w.gamma(0) == (4 + 1) / (4 + 2)  # only the last 4 count
    for _ in range(4):
        w.note(0, False)
    assert w.gamma(0) == 1 / 6  # the 10 hits are forgotten
    w.note(0, True)
    assert w.gamma(0) == 2 / 6
    assert w.gamma(1) == 0.5  # rows are separate
    w.reset(0)
    assert w.gamma(0) == 0.5


def simulate_round(rng, s, g, d, a, b0, b1):
    """One synchronous round of stride s, played out: (boundaries resolved, seconds), the
    re-prefill left out. Boundary j = 1..s: keep (g), change (d: verified now, j queries),
    miss (the rest: the round runs to its real boundary s + 1, resolves the first miss)."""
    first_miss = None
    for j in range(1, s + 1):
        u = rng.random()
        if u < g:
            continue
        if u < g + d and first_miss is None:
            return j, j * a + b0 + b1 * j
        if first_miss is None and u >= g + d:
            first_miss = j
    return (s + 1 if first_miss is None else first_miss), (s + 1) * a + b0 + b1 * (s + 1)


def test_os3_counts_detected_changes_apart():
    """A lookup that names another passage ends its round at once (verified, no stride
    wasted): the rates with `detect` match rounds played out (Monte Carlo), d = 0 gives the
    two-outcome form, and where a quarter of the boundaries change passage and retrieval is
    dear the three-outcome model speculates (s > 0) while the two-outcome one barely does."""
    rng = np.random.default_rng(0)
    for g, d, a, b0, b1 in [(0.7, 0.25, 1.0, 0.8, 0.01), (0.5, 0.1, 1.0, 3.0, 0.2), (0.9, 0.05, 0.5, 2.0, 0.0)]:
        rates = os3_rates(g, a, b0, b1, detect=d)
        for s in (1, 3, 6):
            rounds = [simulate_round(rng, s, g, d, a, b0, b1) for _ in range(40000)]
            e, t = np.mean([r[0] for r in rounds]), np.mean([r[1] for r in rounds])
            assert rates[s] == pytest.approx(e / t, rel=0.02), (g, d, s)
    np.testing.assert_allclose(os3_rates(0.8, 1.0, 2.0, 0.1, 3.0, detect=0.0), os3_rates(0.8, 1.0, 2.0, 0.1, 3.0))
    # NQ-like: a stride 0.14 s, retrieval 0.1 s a call, 70% keeps, 25% changes, re-prefill 0.7 s
    with_d = os3_rates(0.7, 0.14, 0.1, 0.001, 0.7, detect=0.25)
    assert os3_stride(0.7, 0.14, 0.1, 0.001, 0.7, detect=0.25) >= 2 and with_d.max() > 1.08 * with_d[0]
    without = os3_rates(0.7, 0.14, 0.1, 0.001, 0.7)
    assert without.max() < 1.05 * without[0]
    # the asynchronous form ignores detect
    np.testing.assert_allclose(os3_rates(0.7, 1.0, 2.0, asynchronous=True, detect=0.2),
                               os3_rates(0.7, 1.0, 2.0, asynchronous=True))


def test_acceptance_window_three_outcomes():
    w = AcceptanceWindow(1, size=8)
    for o in ("keep", "keep", "change", "miss", "change", "keep"):
        w.note(0, o)
    assert w.gamma(0) == (3 + 1) / (6 + 2) and w.detect(0) == 2 / (6 + 2)
    w.note(0, False)  # a bool: keep / miss
    assert w.detect(0) == 2 / 9 and w.gamma(0) == 4 / 9
    with pytest.raises(ValueError, match="outcome"):
        w.note(0, "maybe")
