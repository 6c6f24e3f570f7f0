"""Shared pieces of the benchmarks: prompts from ../shared/data, the HF peer, JSON output.

Every benchmark prints and saves JSON with the command that produced it and the host it
ran on (`host_info()`: CPU model, cores, platform, jax backend and devices, torch if
used): speed ratios move between hosts. Generation stops at EOS by default, for our
methods and the HF peer alike (what users get); `--ignore-eos` runs a fixed length, a
separate, labelled result (`stop_at_eos: false`). Speed is only ever measured here, never
asserted in tests.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("LOOKAHEAD_JAX_DATA", ROOT.parent / "shared" / "data"))


def read_jsonl(name, n: int, keep=None):
    """The first `n` rows (that `keep(row)` accepts) of `name` in $LOOKAHEAD_JAX_DATA, or of
    the file `name` when it is a Path (e.g. the repository's data/)."""
    path = name if isinstance(name, Path) else DATA / name
    if not path.exists():
        sys.exit(f"error: {path} not found; set LOOKAHEAD_JAX_DATA to the folder holding {name}")
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if keep is None or keep(r):
                rows.append(r)
            if len(rows) >= n:
                break
    return rows


DATASETS = ("nq", "squad", "humaneval", "gsm8k", "nq-shared", "humaneval-x4")
HUMANEVAL_SAMPLES = 4  # humaneval-x4: samples per task
HUMANEVAL_TEMPERATURE = 0.7


def _rag_message(context: str, question: str) -> list:
    return [{"role": "user", "content": f"Answer the question using the passage.\n\nPassage: {context}\n\n"
             f"Question: {question}?"}]


def dataset_prompts(name: str, n: int, max_chars: int = 2400):
    """(prompts, references) per dataset (`DATASETS`); prompts are chat messages or plain
    text, references per prompt a list of passages (texts).

    nq: NQ RAG (the passage in the prompt and as the reference); squad: Disfl-QA / SQuAD
    from the repository's data/squad_disfl_sample.jsonl, prompted like nq; humaneval,
    gsm8k: no references; nq-shared: repeated traffic, `n` NQ questions, 3 per passage,
    questions on one passage one after another (`shared_prompts`); humaneval-x4: each of the
    first `n` HumanEval tasks 4 times in a row (4n prompts), to be sampled
    (`dataset_sampling`: temperature 0.7, a seed per sample)."""
    if name == "nq":
        rows = [r for r in read_jsonl("nq_rag.jsonl", 40 * n) if len(r["context"]) <= max_chars][:n]
        return [_rag_message(r["context"], r["question"]) for r in rows], [[r["context"]] for r in rows]
    if name == "squad":
        rows = read_jsonl(ROOT / "data" / "squad_disfl_sample.jsonl", n, keep=lambda r: len(r["context"]) <= max_chars)
        # the questions end in " ?" already (PTB spacing): no second question mark
        return ([_rag_message(r["context"], r["question"].rstrip(" ?")) for r in rows],
                [[r["context"]] for r in rows])
    if name == "nq-shared":
        return shared_prompts(n, 3, max_chars)
    if name == "humaneval":
        rows = read_jsonl("humaneval.jsonl", n)
        return [r["prompt"] for r in rows], [[] for _ in rows]
    if name == "humaneval-x4":
        rows = read_jsonl("humaneval.jsonl", n)
        return ([r["prompt"] for r in rows for _ in range(HUMANEVAL_SAMPLES)],
                [[] for _ in rows for _ in range(HUMANEVAL_SAMPLES)])
    if name == "gsm8k":
        rows = read_jsonl("gsm8k_test.jsonl", n)
        msgs = [[{"role": "user", "content": r["question"] + "\nLet's think step by step."}] for r in rows]
        return msgs, [[] for _ in rows]
    raise SystemExit(f"unknown dataset {name!r}; the datasets are: {', '.join(DATASETS)}")


def dataset_sampling(name: str, n_prompts: int) -> list:
    """Per prompt of `dataset_prompts(name, ...)` (n_prompts of them) the sampling options
    for `lj.generate`: {} (greedy) except humaneval-x4: temperature 0.7 with seed = the
    prompt's index in the set, so the 4 samples of a task differ and every method can be
    checked against plain sampling with the same seed."""
    if name == "humaneval-x4":
        return [dict(temperature=HUMANEVAL_TEMPERATURE, seed=i) for i in range(n_prompts)]
    return [{} for _ in range(n_prompts)]


def shared_prompts(n: int, per_passage: int, max_chars: int = 2400):
    """NQ RAG as repeated traffic: `per_passage` distinct questions for each of n /
    per_passage passages (from nq_rag.jsonl, passages of at most `max_chars`), questions on
    one passage one after another; (prompts, references) as `dataset_prompts`."""
    by_ctx = defaultdict(list)
    for r in read_jsonl("nq_rag.jsonl", 15000):
        if len(r["context"]) <= max_chars:
            by_ctx[r["context"]].append(r)
    rows = []
    for ctx, rs in by_ctx.items():
        qs = list(dict.fromkeys(r["question"] for r in rs))
        if len(qs) >= per_passage:
            rows += [dict(context=ctx, question=q) for q in qs[:per_passage]]
        if len(rows) >= n:
            break
    return [_rag_message(r["context"], r["question"]) for r in rows[:n]], [[r["context"]] for r in rows[:n]]


SEP = -1  # between the segments of the copy oracle's source


def oracle(recs, earlier: bool, anchor: int = 0):
    """Copy oracle tokens per step over records [(prompt ids, [reference ids...], output
    ids)] in the order they ran: at each step, the longest prefix of the true continuation
    that occurs anywhere in the prompt + references + output so far (any span, any
    position: unlimited tree width and depth), plus the step's own token; `earlier`: also in
    earlier records' outputs. anchor k: only spans whose preceding k tokens equal the
    context's last k (k = 1, "root-anchored": what follows an occurrence of the root, the
    ceiling of any drafter that matches at least the root token, as the trie and the suffix
    drafters do)."""
    import numpy as np

    tokens = steps = 0
    past = []
    for prompt, refs, out in recs:
        prompt, out = list(prompt), list(out)
        base = list(prompt)
        for r in refs:
            base += [SEP] + list(r)
        if earlier:
            for o in past:
                base += [SEP] + list(o)
        j = 0
        while j < len(out) - 1:
            src = np.asarray(base + [SEP] + out[:j + 1], np.int64)
            truth = out[j + 1:len(out) - 1]  # the last token comes from the final step
            cand = np.arange(len(src))
            ctx = prompt + out[:j + 1]
            for k in range(1, anchor + 1):
                cand = cand[cand - k >= 0]
                cand = cand[src[cand - k] == ctx[-k]]
            a = 0
            for t in truth:
                cand = cand[cand + a < len(src)]
                cand = cand[src[cand + a] == t]
                if not len(cand):
                    break
                a += 1
            tokens += a + 1
            steps += 1
            j += a + 1
        past.append(out)
    return round(tokens / steps, 3) if steps else float("nan")


def copy_oracles(recs) -> dict:
    """The four copy oracles (`oracle`) of a set's records: tokens per step."""
    return {"oracle (own)": oracle(recs, False), "oracle (+ earlier outputs)": oracle(recs, True),
            "root-anchored oracle (own)": oracle(recs, False, 1),
            "root-anchored oracle (+ earlier outputs)": oracle(recs, True, 1)}


def oracle_line(o: dict) -> str:
    return (f"copy oracle {o['oracle (own)']} / {o['oracle (+ earlier outputs)']} tok/step (own / + earlier), "
            f"root-anchored {o['root-anchored oracle (own)']} / {o['root-anchored oracle (+ earlier outputs)']}")


def cold_stores(model) -> None:
    """Forget what the model's engine keeps across requests for drafting (the trie, the
    suffix drafter's cache of earlier outputs, acceptance statistics, SpecInfer's measured
    gains) and the prefix cache's blocks, so a run on prompts
    an earlier run already answered drafts from nothing but its own warm-up. A drafter
    takes the engine's cache when it is made: call this before making the server / calling
    generate."""
    from lookahead_jax.core.engine import engine_for
    from lookahead_jax.core.prefix_cache import PrefixCache
    from lookahead_jax.drafters.suffix import SuffixStore
    from lookahead_jax.drafters.trie import TrieStore
    from lookahead_jax.strategies.specinfer import DraftStore

    stores = engine_for(model).stores
    stores.clear(TrieStore)  # the tries and their acceptance statistics
    stores.clear(SuffixStore)  # the cache of earlier outputs and its acceptance statistics
    # SpecInfer's auto budget: gains measured on earlier runs' prompts (its draft engines stay)
    stores.of(DraftStore).budgets.clear()
    stores.clear(PrefixCache)  # prompt blocks' K/V: a run's measured passages are not cached before it


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
        # no EOS of its own: generate() is told which ids stop (ours, `eos_ids`), or none
        # for a fixed length (like our ignore_eos=True: EOS stays an ordinary token;
        # min_new_tokens would instead forbid it and change the tokens)
        self.model.generation_config.eos_token_id = None

    def generate(self, ids, max_new_tokens: int, prompt_lookup: int = 0, eos_ids=None):
        """(new token ids, seconds). `eos_ids`: the ids that stop generation (pass our
        tokenizer's `eos_token_ids`, so HF stops where we do; the EOS token is kept, as
        ours keeps it); None or empty = a fixed length of `max_new_tokens`."""
        torch = self.torch
        x = torch.tensor([ids], device=self.device)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        if eos_ids:
            kw["eos_token_id"] = sorted(int(i) for i in eos_ids)
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


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's 'model name' (x86), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_info() -> dict:
    """Where a result was measured (ratios between methods move between hosts): CPU model,
    core count, platform, Python, jax version, backend and devices, and torch /
    transformers where this process imported them."""
    info = dict(cpu_model=cpu_model(), cpu_count=os.cpu_count(), platform=platform.platform(),
                machine=platform.machine(), python=platform.python_version())
    if hasattr(os, "sched_getaffinity"):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    try:
        import jax

        devs = jax.devices()
        info.update(jax=jax.__version__, jax_backend=jax.default_backend(),
                    jax_devices=[f"{d} ({getattr(d, 'device_kind', '?')})" for d in devs])
    except Exception as e:  # noqa: BLE001 - record why rather than lose the result
        info["jax"] = f"unavailable: {e}"
    if "torch" in sys.modules:  # only when a benchmark used it (the HF peer)
        torch = sys.modules["torch"]
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        if torch.cuda.is_available():
            info["torch_cuda_device"] = torch.cuda.get_device_name(0)
    if "transformers" in sys.modules:
        info["transformers"] = getattr(sys.modules["transformers"], "__version__", "?")
    return info


def host_line() -> str:
    h = host_info()
    return (f"host: {h['cpu_model']}, {h['cpu_count']} cores, {h['platform']}, "
            f"jax {h.get('jax')} on {h.get('jax_backend', '?')}")


def default_out(name: str, ignore_eos: bool, ext: str = "json") -> str:
    """bench/results/<name>.json, or <name>-fixedlen.json for an `--ignore-eos` run, so a
    fixed-length run never overwrites the headline (stops-at-EOS) result."""
    return str(ROOT / "bench" / "results" / f"{name}{'-fixedlen' if ignore_eos else ''}.{ext}")


def eos_mode(ignore_eos: bool) -> str:
    return "fixed length (EOS ignored)" if ignore_eos else "stops at EOS"


def save(result: dict, out: str) -> None:
    """Write `result` as JSON with the command line and the host (`host_info()`)."""
    result["command"] = " ".join([Path(sys.executable).name] + sys.argv)
    result["host"] = host_info()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"saved {out}")


def bar_plot(result: dict, path: str, title: str, fmt: str = "%.0f", key: str = "tokens_per_s",
             ylabel: str = "tokens / s", ref_line=None) -> None:
    """`key` (default tokens/s) per dataset (groups) and method (bars) of a bench result,
    saved as PNG; a method missing from a group leaves its slot empty; `ref_line`: a
    dashed horizontal line (e.g. 1.0 for speedups). The title gets the prompt count
    (`prompts_label`, else "N prompts/dataset"), the length mode (stops at EOS / fixed
    length) and the host CPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(result["datasets"])
    methods = list(dict.fromkeys(m for d in sets for m in result["datasets"][d]["methods"]))
    fig, ax = plt.subplots(figsize=(1.5 + 1.6 * len(sets) * len(methods) / 3, 4.2))
    w = 0.8 / len(methods)
    for j, m in enumerate(methods):
        xs = [i + j * w for i, d in enumerate(sets) if m in result["datasets"][d]["methods"]]
        vals = [result["datasets"][d]["methods"][m][key] for d in sets if m in result["datasets"][d]["methods"]]
        bars = ax.bar(xs, vals, w, label=m)
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    if ref_line is not None:
        ax.axhline(ref_line, color="gray", linestyle="--", linewidth=0.8)
    ax.set_xticks([i + w * (len(methods) - 1) / 2 for i in range(len(sets))], sets)
    ax.set_ylabel(ylabel)
    length = (f"fixed length (EOS ignored), {result['max_new_tokens']} new tokens"
              if not result.get("stop_at_eos", True) else f"stops at EOS, <= {result['max_new_tokens']} new tokens")
    cpu = result.get("host", {}).get("cpu_model", "")
    per = result.get("prompts_label") or f"{result['prompts_per_dataset']} prompts/dataset"
    ax.set_title(f"{title}, {per}\n{length}" + (f"\n{cpu}" if cpu else ""),
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")
