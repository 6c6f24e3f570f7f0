"""Speculative KNN-LM's start-of-run decision (`KNNLM(speculative="auto")`,
lookahead_jax/strategies/knnlm_decision.py) on the tiny llama and test_knnlm.py's datastore:
forced on (True), off (False) and auto with injected costs (a search cheap next to a forward:
plain KNN-LM; a dear one: speculation) all give plain KNN-LM's tokens and log-probabilities,
bitwise, and pick the expected mode; auto with the real measurement decides once, logs one
line and reports it; the cost model alone; bad values are named."""

from __future__ import annotations

import logging

import pytest

from lookahead_jax import KNNLM
from lookahead_jax.core.engine import engine_for
from lookahead_jax.knnlm import search as S
from lookahead_jax.strategies.knnlm import parse_speculative
from lookahead_jax.strategies.knnlm_decision import PRIOR_GAMMA, KnnCosts, decide
from lookahead_jax.strategies.knnlm_runs import KnnSpecRun
import test_knnlm as knn_tests
from test_knnlm import assert_same, run

tok, corpus, ds = knn_tests.tok, knn_tests.corpus, knn_tests.ds  # test_knnlm.py's fixtures, shared

CHEAP_SEARCH = dict(forward_s=0.030, search_s=0.002, probe_s=0.004, spec_s=0.001, repick_s=0.001, upkeep_s=0.0003)
DEAR_SEARCH = dict(forward_s=0.030, search_s=0.300, probe_s=0.320, spec_s=0.001, repick_s=0.001, upkeep_s=0.0003)


def inject(monkeypatch, costs: dict) -> list:
    """Replace the measurement by fixed costs; returns the list its calls are noted in."""
    calls = []

    def measure(self, state):
        calls.append(state.batch)
        return KnnCosts(rows=state.batch, probe_queries=4 * state.batch, source="injected", **costs)

    monkeypatch.setattr(KnnSpecRun, "measure_costs", measure)
    return calls


def fresh_measures(model) -> None:
    engine_for(model).stores.of(S.KnnlmStore).os3.clear()


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, seed=3)])
def test_modes_give_plain_tokens_and_the_expected_choice(model, tok, ds, monkeypatch, sampling):
    kw = dict(logprobs=True, stop_token_ids=[116, 158], min_new_tokens=2, **sampling)
    plain = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative=False), **kw)
    st = plain.stats["retrieval"]
    assert st["speculative"] is False and "speculation_decision" not in st

    forced = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative=True, speculation_stride=2), **kw)
    assert_same(forced, plain)
    st = forced.stats["retrieval"]
    assert st["speculation_decision"] == dict(mode="forced", speculate=True, stride=2) and st["speculations"] > 0

    for costs, speculate in ((CHEAP_SEARCH, False), (DEAR_SEARCH, True)):
        for stride in (2, "auto"):
            fresh_measures(model)
            calls = inject(monkeypatch, costs)
            out = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative="auto", speculation_stride=stride), **kw)
            assert_same(out, plain)
            st = out.stats["retrieval"]
            d = st["speculation_decision"]
            assert calls == [d["costs"]["rows"]]  # measured once, for the batch
            assert d["mode"] == "auto" and d["speculate"] is speculate and d["costs"]["source"] == "injected"
            assert d["gamma"] == PRIOR_GAMMA and d["gamma_source"] == "prior"
            if speculate:
                assert st["speculations"] > 0 and d["stride"] >= 1 and d["predicted_speedup"] > 1.05
                assert stride == "auto" or d["stride"] == stride
            else:  # plain KNN-LM from the decision on: no speculation, plain's searches
                assert st["speculations"] == 0 and st["verify_calls"] == 0 and d["stride"] == 0
                assert st["searches"] == plain.stats["retrieval"]["searches"]
            again = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative="auto", speculation_stride=stride), **kw)
            assert_same(again, plain)  # the engine's costs reused: not measured again
            assert len(calls) == 1 and again.stats["retrieval"]["speculation_decision"]["costs_reused"] is True


def test_auto_measures_decides_once_and_logs_one_line(model, tok, ds, caplog):
    plain = run(model, tok, KNNLM(datastore=ds, knn_k=4), logprobs=True)
    fresh_measures(model)
    with caplog.at_level(logging.INFO, logger="lookahead_jax"):
        out = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative="auto"), logprobs=True)
    assert_same(out, plain)
    lines = [r.getMessage() for r in caplog.records if "speculative KNN-LM (auto)" in r.getMessage()]
    assert len(lines) == 1 and "->" in lines[0]
    st = out.stats["retrieval"]
    d = st["speculation_decision"]
    assert d["mode"] == "auto" and isinstance(d["speculate"], bool) and d["costs"]["source"] == "measured"
    assert all(v >= 0 for k, v in d["costs"].items() if k.endswith("_ms"))
    assert st["decision_s"] >= 0
    if d["speculate"]:  # the tiny model's costs on this host decide; either way the tokens are plain's
        assert st["speculations"] > 0
    else:  # plain KNN-LM's searches: the measurement's own are not counted as the run's
        assert st["speculations"] == 0 and st["searches"] == plain.stats["retrieval"]["searches"]
        assert st["search_calls"] == plain.stats["retrieval"]["search_calls"]


def test_cost_model():
    cheap = KnnCosts(rows=1, probe_queries=4, **CHEAP_SEARCH)
    dear = KnnCosts(rows=1, probe_queries=4, **DEAR_SEARCH)
    d = decide(cheap, "auto")
    assert not d.speculate and d.stride == 0 and d.predicted_speedup < 1.05 and "plain KNN-LM" in d.line()
    d = decide(dear, "auto")
    assert d.speculate and d.stride >= 2 and d.predicted_speedup > 2 and "speculate" in d.line()
    assert decide(dear, 3).stride == 3
    assert not decide(dear, "auto", gamma=0.0).speculate  # speculations never stand: plain
    assert decide(dear, "auto", gamma=0.95).as_dict()["gamma_source"] == "measured"
    # a search 2x the forward, a verification of 4 queries 2x one: pays at g = 0.8, not at 0.5
    mid = KnnCosts(rows=1, forward_s=0.03, search_s=0.06, probe_queries=4, probe_s=0.12, spec_s=0.001)
    assert decide(mid, "auto", gamma=0.8).speculate and not decide(mid, "auto", gamma=0.5).speculate
    with pytest.raises(ValueError, match="stride"):
        decide(cheap, 0)
    with pytest.raises(ValueError, match="forward_s"):
        KnnCosts(rows=1, forward_s=-1.0, search_s=0.0, probe_queries=1, probe_s=0.0)
    with pytest.raises(ValueError, match="rows"):
        KnnCosts(rows=0, forward_s=0.0, search_s=0.0, probe_queries=1, probe_s=0.0)


def test_speculative_values(model, tok, ds):
    assert [parse_speculative(v) for v in ("auto", "AUTO", "true", "", "1", "false", "0", "no")] == \
        ["auto", "auto", True, True, True, False, False, False]
    with pytest.raises(ValueError, match="must be true, false or auto"):
        parse_speculative("sometimes")
    assert KNNLM(speculative="auto").speculative == "auto" and KNNLM(speculative="true").speculative is True
    for bad in ("sometimes", 2, None):
        with pytest.raises(ValueError, match="speculative must be True, False or 'auto'"):
            run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative=bad))


def test_cli_speculative_auto(model, tok, corpus, tmp_path, monkeypatch, capsys):
    """--speculative auto / true / false on the command line: the same tokens, the decision in
    the --json summary (auto: its costs; true: forced), a bad value named."""
    import json

    import lookahead_jax.loading as loading
    from lookahead_jax.cli import main
    from lookahead_jax.knnlm.cli import main as knn_main

    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "load", lambda name, dtype="float32", **kw: (model, tok))
    f = tmp_path / "c.jsonl"
    f.write_text(corpus.to_jsonl())
    assert knn_main(["build", "--model", "tiny-llama", "--corpus", str(f), "--quiet"]) == 0
    args = ["--prompt", knn_tests.PROMPTS[0], "--max-new-tokens", "8", "--json", "--strategy", "knnlm",
            "--corpus", str(f), "--knn-k", "4"]
    capsys.readouterr()
    got = {}
    for value in ("false", "auto", "true"):
        assert main(args + ["--speculative", value]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        got[value] = lines[0]["token_ids"], lines[-1]["summary"]["retrieval"]
    assert got["auto"][0] == got["true"][0] == got["false"][0]
    assert got["auto"][1]["speculative"] == "auto" and got["auto"][1]["speculation_decision"]["mode"] == "auto"
    assert "ms" in json.dumps(got["auto"][1]["speculation_decision"]["costs"])
    assert got["true"][1]["speculation_decision"]["mode"] == "forced"
    assert "speculation_decision" not in got["false"][1]
    with pytest.raises(SystemExit):
        main(args + ["--speculative", "sometimes"])
    assert "--speculative must be true, false or auto, got 'sometimes'" in capsys.readouterr().err


@pytest.mark.parametrize("costs,speculate", [(CHEAP_SEARCH, False), (DEAR_SEARCH, True)])
def test_slots_auto_equals_alone(model, tok, ds, monkeypatch, costs, speculate):
    """speculative="auto" on the slot API (requests inserted into 2 slots mid-decode, as the
    server runs them): each request's tokens and log-probabilities are plain KNN-LM's alone,
    whichever mode the decision picked (injected costs), and the events carry them all."""
    from lookahead_jax.core.params import GenerationParams
    from lookahead_jax.core.slots import Request, Slots
    from tiny import drive_slots

    fresh_measures(model)
    inject(monkeypatch, costs)
    prompts = knn_tests.PROMPTS
    slots = Slots(engine_for(model), tok, 2, 512, KNNLM(datastore=ds, knn_k=4, speculative="auto"), logprobs=True)
    idx = [3, 0, 5, 1]
    got = drive_slots(slots, [Request(tok.encode(prompts[i]), GenerationParams(max_new_tokens=knn_tests.MAX_NEW),
                                      sampling_row=i) for i in idx], every=3)
    for i, (row, streamed) in zip(idx, got):
        one = run(model, tok, KNNLM(datastore=ds, knn_k=4), prompts=[prompts[i]], logprobs=True, first_index=i)
        assert row.ids == streamed == one.token_ids[0], f"prompt {i}"
        assert row.logprobs == one.rows[0].logprobs
    st = slots.run.summary()["retrieval"]
    assert st["speculation_decision"]["speculate"] is speculate and (st["speculations"] > 0) == speculate


def test_process_zeros_choices_are_taken(model, tok, ds, monkeypatch):
    """Over several processes the timed choices are process 0's (`multihost.agree_choice`):
    here this process measures costs that say plain KNN-LM while the broadcast answers
    process 0's "speculate at stride 2" (faked, as OS3's later strides: 3). The run takes
    them, speculates, and its tokens and log-probabilities are still plain KNN-LM's."""
    import lookahead_jax.strategies.knnlm_runs as R

    plain = run(model, tok, KNNLM(datastore=ds, knn_k=4), logprobs=True)
    fresh_measures(model)
    inject(monkeypatch, CHEAP_SEARCH)  # this process alone would run plain KNN-LM
    offered = []

    def process_zero(*values):
        offered.append(values)
        return (1, 2) if len(values) == 2 else (3,)  # (speculate, stride) | an OS3 stride

    monkeypatch.setattr(R, "multiprocess", lambda: True)
    monkeypatch.setattr(R, "agree_choice", process_zero)
    monkeypatch.setattr(R, "broadcast_plan", lambda x: x)  # the exact search's lists: this process's own
    out = run(model, tok, KNNLM(datastore=ds, knn_k=4, speculative="auto", speculation_stride="auto"), logprobs=True)
    assert_same(out, plain)
    st = out.stats["retrieval"]
    assert offered[0] == (False, 0) and all(len(v) == 1 for v in offered[1:]) and len(offered) > 1
    assert st["speculation_decision"]["speculate"] is True and st["speculation_decision"]["stride"] == 2
    assert st["speculations"] > 0 and st["mean_speculation_stride"] > 2  # 2 for the first round, then 3
