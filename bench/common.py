"""Shared pieces of the benchmarks: prompts from ../shared/data, the HF peer, JSON output.

Every benchmark prints and saves JSON (with the command that produced it). Speed is only
ever measured here, never asserted in tests.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("LOOKAHEAD_JAX_DATA", ROOT.parent / "shared" / "data"))


def read_jsonl(name: str, n: int):
    path = DATA / name
    if not path.exists():
        sys.exit(f"error: {path} not found; set LOOKAHEAD_JAX_DATA to the folder holding {name}")
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= n:
                break
    return rows


def dataset_prompts(name: str, n: int, max_chars: int = 2400):
    """(prompts, references) per dataset; prompts are chat messages or plain text."""
    if name == "nq":
        rows = [r for r in read_jsonl("nq_rag.jsonl", 40 * n) if len(r["context"]) <= max_chars][:n]
        msgs = [[{"role": "user", "content":
                  f"Answer the question using the passage.\n\nPassage: {r['context']}\n\n"
                  f"Question: {r['question']}?"}] for r in rows]
        return msgs, [[r["context"]] for r in rows]
    if name == "humaneval":
        rows = read_jsonl("humaneval.jsonl", n)
        return [r["prompt"] for r in rows], [[] for _ in rows]
    if name == "gsm8k":
        rows = read_jsonl("gsm8k_test.jsonl", n)
        msgs = [[{"role": "user", "content": r["question"] + "\nLet's think step by step."}] for r in rows]
        return msgs, [[] for _ in rows]
    raise SystemExit(f"unknown dataset {name!r}; use nq, humaneval, gsm8k")


def model_gguf(model: str) -> Path:
    """The GGUF behind `--model`: a `.gguf` path as given, else the preset's packaged file."""
    if model.endswith(".gguf"):
        p = Path(model).expanduser()
        if not p.is_file():
            sys.exit(f"error: {p} not found")
        return p
    from lookahead_jax.fetch import gguf_path

    return gguf_path(model)


def resolve_hf_device(device: str) -> str:
    """'auto' -> 'cuda' when JAX's default backend is a GPU and torch sees CUDA, else 'cpu'."""
    if device != "auto":
        return device
    import jax
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


class HFPeer:
    """HF transformers (torch; CPU by default, `device="cuda"` on a GPU) on the same GGUF
    file, fed the same token ids.

    packed=False (the default, "same model"): weights dequantized at load into a dense
    f32/bf16 model, exactly the weights we run. packed=True: transformers 5 keeps GGUF
    weights in their quantized blocks and multiplies with dequantize-on-the-fly kernels
    (4-5 bits per weight read instead of 32): a different, quantized execution, reported
    separately for reference.
    """

    def __init__(self, gguf_path, dtype: str, threads: int | None = None, packed: bool = False,
                 device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM, GgufConfig

        torch.set_num_threads(threads or os.cpu_count())
        self.torch = torch
        self.device = device
        p = Path(gguf_path)
        td = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        qc = GgufConfig(gguf_file=p.name, dequantize=not packed)
        self.model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=td,
                                                          quantization_config=qc)
        self.model.to(device)
        self.model.eval()
        # ignore EOS like our ignore_eos=True: EOS stays an ordinary token (min_new_tokens
        # would instead forbid it and change the tokens)
        self.model.generation_config.eos_token_id = None

    def generate(self, ids, max_new_tokens: int, prompt_lookup: int = 0):
        torch = self.torch
        x = torch.tensor([ids], device=self.device)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        if prompt_lookup:
            kw["prompt_lookup_num_tokens"] = prompt_lookup
        sync = torch.cuda.synchronize if self.device.startswith("cuda") else (lambda: None)
        with torch.inference_mode():
            sync()
            t0 = time.perf_counter()
            out = self.model.generate(x, **kw)
            sync()
            dt = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), dt


def environment() -> dict:
    import jax

    env = dict(python=platform.python_version(), jax=jax.__version__, device=str(jax.devices()[0]),
               cpu_count=os.cpu_count(), machine=platform.machine())
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    return env


def save(result: dict, out: str) -> None:
    result["command"] = " ".join([Path(sys.executable).name] + sys.argv)
    result["environment"] = environment()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
