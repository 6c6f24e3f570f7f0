"""Draft distillation (`lookahead_jax.distill`) on a tiny random target.

* The teacher loop's continuations are the target's greedy outputs (`lj.generate`), and
  its top-1 at every continuation position is the token that follows.
* A few steps lower the distillation loss over the whole training set.
* The output directory loads with `lj.load`: the trained params exactly, the draft
  config, the target's tokenizer.
* An interrupted run resumes at its saved step and ends where an uninterrupted one does
  (same losses, same params); a rerun with other settings is refused.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import load_prompts, tiny_model

import lookahead_jax as lj
from lookahead_jax import distill as D
from lookahead_jax.convert.tokenizer import Tokenizer

TEXTS = ["def add(a, b):", "Question: what is 2 + 2?", "caf\u00e9 \u00fcber na\u00efve", "<s>x</s>"]


def byte_tokenizer() -> Tokenizer:
    """A real `Tokenizer` (savable) over the tiny models' 259 ids: 0 <pad>, 1 <s>, 2 </s>,
    then the 256 bytes (byte-level BPE without merges)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(alphabet)}}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<s>", "</s>")])
    meta = {"format": 1, "bos_token": "<s>", "bos_token_id": 1, "eos_token": "</s>", "eos_token_id": 2,
            "pad_token": "<pad>", "pad_token_id": 0, "eos_token_ids": [2], "add_bos": False,
            "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                             "{% if add_generation_prompt %}<assistant>{% endif %}"}
    return Tokenizer(backend, meta)


CFG = dict(layers=2, steps=8, batch_size=4, seq_len=64, lr=3e-4, warmup=2, topk=8, gen_tokens=16,
           gen_batch=8, eval_every=4, save_every=0, ce_weight=0.25)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = tiny_model("llama", n_layers=4, tie_embeddings=True)
    tok = byte_tokenizer()
    assert tok.vocab_size == target.config.vocab_size
    rows = load_prompts(4)
    train = {s: [r["prompt"][:40] for r in rows if r["source"] == s][:3] for s in ("nq_rag", "humaneval", "gsm8k")}
    evals = {"mixed": [r["prompt"][:40] for r in rows if r["source"] != "gsm8k"][3:5]}
    return target, tok, train, evals, tmp_path_factory.mktemp("distill-data")


def run(setup, out, on_step=None, **kw):
    target, tok, train, evals, data = setup
    cfg = D.DistillConfig(**{**CFG, **kw})
    return D.distill(target, tok, train, evals, out, cfg, data_dir=data, progress=False,
                     on_step=on_step, report=lambda s: None)


def test_teacher_data_is_the_targets_greedy_output(setup):
    target, tok, train, _, _ = setup
    prompts = train["humaneval"] + train["nq_rag"][:1]
    ids = [tok.encode(p) for p in prompts]  # 4 rows: the distill runs' chunk shape (one compile)
    exs = D.teacher_chunk(target, ids, 12, 64, 8, tok.eos_token_ids, batch=4)
    out = lj.generate(target, tok, prompts, max_new_tokens=12)
    for ex, row, x in zip(exs, out.rows, ids):
        n = len(ex["tokens"])
        assert list(ex["tokens"][:len(x)]) == x and ex["n_prompt"] == len(x)
        assert list(ex["tokens"][len(x):]) == list(row.token_ids)
        assert ex["topk_v"].shape == ex["topk_i"].shape == (n - 1, 8)
        pos = np.arange(len(x) - 1, n - 1)
        np.testing.assert_array_equal(ex["topk_i"][pos, 0], ex["tokens"][pos + 1])
        v = ex["topk_v"].astype(np.float32)
        assert np.all(np.diff(v, axis=1) <= 0) and np.all(np.exp(v).sum(1) <= 1.001)


_loss = jax.jit(D.distill_loss, static_argnums=(2, 3))


def _data_loss(params, config, examples, cfg):
    """Weighted mean distillation loss over every training row (one fixed packing)."""
    P = D.loss_slots(cfg.seq_len, cfg.prompt_weight)
    rows = D.pack_rows(examples, range(len(examples)), cfg.seq_len, P, cfg.prompt_weight)
    tot = wsum = 0.0
    for i in range(0, len(rows), cfg.batch_size):
        b = D.make_batch(examples, rows[i:i + cfg.batch_size], cfg.batch_size, cfg.seq_len, P, cfg.topk,
                         cfg.prompt_weight)
        loss, _ = _loss(params, {k: jnp.asarray(v) for k, v in b.items()}, config, cfg.ce_weight)
        tot += float(loss) * b["weight"].sum()
        wsum += b["weight"].sum()
    return tot / wsum


def test_distill_lowers_loss_and_loads(setup, tmp_path):
    target, tok, train, evals, data = setup
    out = tmp_path / "draft"
    res = run(setup, out)
    assert res["step"] == res["steps_run"] == 8 and len(res["history"]) == 8
    cfg = D.DistillConfig(**CFG)
    examples = [e for v in D.build_examples(target, tok, train, cfg, data, progress=False).values() for e in v]
    config0, params0 = D.init_draft(target.params, target.config, cfg.layers, cfg.init)
    before = _data_loss(params0, config0, examples, cfg)
    after = _data_loss(res["params"], res["config"], examples, cfg)
    assert after < 0.6 * before, (before, after)  # 1.02 -> 0.45 here
    assert 0.0 <= res["eval"]["all"]["top1"] <= res["eval"]["all"]["top5"] <= 1.0
    assert res["eval"]["all"]["positions"] > 0
    assert [e["step"] for e in res["evals"]] == [0, 4, 8]

    model, tok2 = lj.load(str(out), keep_unpacked=True)  # plain arrays, to compare with the trained ones
    assert model.config == target.config.replace(n_layers=2) == res["config"]
    got, want = jax.tree.leaves_with_path(model.params), jax.tree.leaves_with_path(res["params"])
    assert [p for p, _ in got] == [p for p, _ in want]
    for (p, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
    np.testing.assert_array_equal(np.asarray(model.params["embed"]), np.asarray(target.params["embed"]))
    assert not np.array_equal(np.asarray(model.params["layers"][0]["qkv"]),
                              np.asarray(target.params["layers"][0]["qkv"]))  # it was trained
    assert tok2.vocab_size == tok.vocab_size and tok2.eos_token_ids == tok.eos_token_ids
    assert tok2.chat_template == tok.chat_template and tok2.special_tokens_map == tok.special_tokens_map
    for s in TEXTS:
        assert tok2.encode(s) == tok.encode(s) and tok2.decode(tok.encode(s)) == s
    saved = json.loads((out / "distill.json").read_text())
    assert saved["step"] == 8 and saved["config"] == res["config"].to_dict()
    # the draft runs as a model: greedy generation through the library
    assert lj.generate(model, tok2, ["def f(x):"], max_new_tokens=4).rows[0].new_tokens == 4


def test_resume_continues_from_saved_step(setup, tmp_path):
    full = run(setup, tmp_path / "full")

    def interrupt(step, metrics):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(setup, tmp_path / "cut", on_step=interrupt)
    saved = json.loads((tmp_path / "cut" / "distill.json").read_text())
    assert saved["step"] == 3 and [h["step"] for h in saved["history"]] == [1, 2, 3]
    assert (tmp_path / "cut" / "train_state" / "00000003").is_dir()
    assert lj.load(str(tmp_path / "cut"))[0].config.n_layers == 2  # exported at the interrupt

    resumed = run(setup, tmp_path / "cut")
    assert resumed["step"] == 8 and resumed["steps_run"] == 5
    a = [(h["step"], h["loss"]) for h in full["history"]]
    b = [(h["step"], h["loss"]) for h in resumed["history"]]
    assert [s for s, _ in b] == list(range(1, 9))
    np.testing.assert_allclose([x for _, x in b], [x for _, x in a], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(full["params"])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    assert resumed["eval"]["all"] == full["eval"]["all"]

    again = run(setup, tmp_path / "cut")  # finished: nothing left to train
    assert again["steps_run"] == 0 and again["step"] == 8
    with pytest.raises(ValueError, match="layers"):
        run(setup, tmp_path / "cut", layers=1)


def test_init_and_packing():
    target = tiny_model("llama", n_layers=5)  # untied head: lm_head is frozen with the embedding
    assert D.init_layers(30, 2, "first") == [0, 1] and D.init_layers(30, 2, "spaced") == [0, 29]
    assert D.init_layers(30, 4, "spaced") == [0, 10, 19, 29]
    cfg, params = D.init_draft(target.params, target.config, 3, "spaced")
    assert cfg.n_layers == 3
    for i, j in enumerate([0, 2, 4]):
        np.testing.assert_array_equal(np.asarray(params["layers"][i]["qkv"]),
                                      np.asarray(target.params["layers"][j]["qkv"]))
    trainable, frozen = D.split_trainable(params, train_embed=False)
    assert sorted(frozen) == ["embed", "lm_head"] and "embed" not in trainable
    assert sorted(D.split_trainable(params, True)[0]) == sorted(params)
    with pytest.raises(ValueError, match="layers"):
        D.draft_config(target.config, 6)

    exs = [dict(tokens=np.arange(n, dtype=np.int32), n_prompt=p,
                topk_v=np.zeros((n - 1, 2), np.float16), topk_i=np.zeros((n - 1, 2), np.int32))
           for n, p in [(10, 4), (20, 15), (7, 3), (30, 10)]]
    rows = D.pack_rows(exs, range(4), seq_len=32, slots=24, prompt_weight=0.0)
    assert sorted(j for r in rows for j in r) == [0, 1, 2, 3] and len(rows) == 3
    for r in rows:
        assert sum(len(exs[j]["tokens"]) for j in r) <= 32
        assert sum(len(exs[j]["tokens"]) - exs[j]["n_prompt"] for j in r) <= 24
    b = D.make_batch(exs, rows, 4, 32, 24, 2, 0.0)
    # every continuation position appears once, with the next token as its label
    assert b["weight"].sum() == sum(n - p for n, p in [(10, 4), (20, 15), (7, 3), (30, 10)])
    assert rows[0][:2] == [0, 1]  # first fit: 10 + 20 tokens share row 0
    assert b["segment"][0, :30].tolist() == [1] * 10 + [2] * 20 and b["segment"][0, 30:].tolist() == [0, 0]
    assert b["positions"][0, :30].tolist() == list(range(10)) + list(range(20))
    # example 0's continuation: positions 3..8 predict tokens 4..9; example 1's follow at 10+14..
    assert b["idx"][0, :11].tolist() == list(range(3, 9)) + list(range(24, 29))
    assert b["label"][0, :11].tolist() == list(range(4, 10)) + list(range(15, 20))
    assert b["weight"][3].sum() == 0  # the fourth row is padding


def test_split_prompts_small_files(tmp_path):
    """A file shorter than 2 x EVAL_POOL (the repository's data/ samples) holds out its first
    half for evaluation and trains on the rest; a source with no record for training is
    refused with an error naming the fix (it used to end in "no training examples")."""
    rows = [{"question": f"q{i}", "answer": "a"} for i in range(20)]
    (tmp_path / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, evals = D.split_prompts(tmp_path, 8, 4, sources=("gsm8k",))
    text = lambda ps: [p[0]["content"].split("\n")[0] for p in ps]  # noqa: E731
    assert text(evals["gsm8k"]) == ["q0", "q1", "q2", "q3"]
    assert len(train["gsm8k"]) == 8 and {int(q[1:]) for q in text(train["gsm8k"])} <= set(range(10, 20))
    (tmp_path / "gsm8k_test.jsonl").write_text("")
    with pytest.raises(ValueError, match="no training prompt.*--data"):
        D.split_prompts(tmp_path, 8, 4, sources=("gsm8k",))
