"""The two halves of test_real_model's Qwen comparison, each run in a fresh process
(`python tests/real_model_worker.py ours|hf`, JSON on stdin, a `RESULT {json}` line on
stdout), so that the test process holds neither model: the 1.5B in f32 is ~6.6 GiB of
weights in either library, and one process that had loaded ours, then torch and HF's
(whose GGUF loader also keeps the 1 GiB file mapped while it dequantizes) peaked at
9-12 GiB, over the suite's 8 GB. A process's memory all goes back to the OS when it ends.

ours: {"name", "prompts", "new"} -> our greedy and lookahead tokens (`lj.load`, f32, packed
    for the CPU kernels as it loads), the prompt ids, EOS ids and forward steps.
hf:   {"gguf", "prompts", "prompt_ids", "greedy", "eos", "new"} -> HF's tokenizer ids for the
    prompts, and per prompt HF's greedy tokens, the first position k where they differ from
    ours, and there HF's logit gap (HF's token minus ours; full forward of the common prefix).
"""

from __future__ import annotations

import json
import sys


def ours(name: str, prompts: list, new: int) -> dict:
    import lookahead_jax as lj
    from lookahead_jax.core.compile import enable_compilation_cache
    from lookahead_jax.prompts import encode_prompts

    enable_compilation_cache("xla-tests")  # the test processes' cache (conftest.py)
    model, tok = lj.load(name, dtype="float32", progress=False)
    greedy = lj.generate(model, tok, prompts, max_new_tokens=new)
    look = lj.generate(model, tok, prompts, max_new_tokens=new, strategy="lookahead", decoding_length=16)
    return dict(prompt_ids=encode_prompts(tok, prompts, chat=False), greedy=greedy.token_ids,
                lookahead=look.token_ids, eos=sorted(tok.eos_token_ids),
                look_steps=look.stats["forward_steps"], greedy_steps=greedy.stats["forward_steps"])


def hf(gguf: str, prompts: list, prompt_ids: list, greedy: list, eos: list, new: int) -> dict:
    import pathlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pathlib.Path(gguf)  # no lookahead_jax import: this process holds no JAX
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_ids = []
    for p in prompts:
        if isinstance(p, str):
            hf_ids.append(hf_tok(p)["input_ids"])
        else:
            enc = hf_tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            hf_ids.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    del hf_tok

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = eos
    rows = []
    for ids, mine in zip(prompt_ids, greedy):
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=eos[0])
        theirs = out[0, len(ids):].tolist()
        k = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        gap = None
        if mine != theirs and k is not None:
            with torch.inference_mode():
                logits = model(torch.tensor([ids + theirs[:k]])).logits[0, -1]
            gap = float(logits[theirs[k]] - logits[mine[k]])
        rows.append(dict(theirs=theirs, k=k, gap=gap))
    return dict(hf_ids=hf_ids, rows=rows)


if __name__ == "__main__":
    result = {"ours": ours, "hf": hf}[sys.argv[1]](**json.load(sys.stdin))
    print("RESULT " + json.dumps(result), flush=True)
