"""bench/serve.py's split of the nq-shared requests' time to first token: a passage's first
question, its repeats, and of those the ones whose passage was cached when they were sent
(an earlier question of the passage had its first token) apart from those sent while the
passage was still being prefilled (issue 53's "a request whose passage is cached")."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "serve.py"


@pytest.fixture(scope="module")
def serve_bench():
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def req(start, ttft, ok=True):
    return dict(ok=ok, start_s=start, ttft=ttft)


def test_repeats_split_by_whether_their_passage_had_its_first_token(serve_bench):
    passages = [0, 0, 0, 1, 1, 2, 2]
    res = [req(0.0, 0.5),   # passage 0's first: first token at 0.5
           req(0.1, 0.6),   # sent before 0.5: in flight
           req(0.6, 0.1),   # sent after 0.5: cached
           req(1.0, 0.4),   # passage 1's first (first token at 1.4)
           req(1.4, 0.2),   # sent at exactly its first token: cached
           req(2.0, 0.3, ok=False),  # passage 2's first failed: still its first
           req(3.0, 0.2)]   # no earlier question of passage 2 had a first token: in flight
    g = serve_bench.ttft_groups(res, passages)
    assert g["first"] == [0.5, 0.4]
    assert g["repeat"] == [0.6, 0.1, 0.2, 0.2]
    assert g["cached"] == [0.1, 0.2]
    assert g["inflight"] == [0.6, 0.2]


def test_summary_reports_each_group(serve_bench):
    passages = [0, 0, 1]
    res = [dict(req(0.0, 0.4), tokens=3, itl=[0.02, 0.03], tpot=0.025, text="a"),
           dict(req(0.5, 0.1), tokens=2, itl=[0.02], tpot=0.02, text="b"),
           dict(req(0.0, 0.6), tokens=2, itl=[0.02], tpot=0.02, text="c")]
    s = serve_bench.summarize(res, 1.0, {}, {}, passages)
    assert s["ttft_first_n"] == 2 and s["ttft_cached_n"] == 1 and s["ttft_inflight_n"] == 0
    assert s["ttft_first_mean_ms"] == pytest.approx(500.0)
    assert s["ttft_cached_mean_ms"] == pytest.approx(100.0) and s["ttft_inflight_mean_ms"] is None
