"""guidellm's default chat benchmark against a greedy and a lookahead server (issue 52's
table): throughput, TTFT and ITL at concurrency 1, 4 and 8, with temperature 0 and with
guidellm's default sampling (it sends no temperature: the server's default, 1).

Both servers run at once (`python -m lookahead_jax.serve --model M --strategy S
--max-batch 8`, each on its own port, warmed up: /health 200 with every listed program
compiled), idle while the other is
measured; the runs alternate greedy / lookahead per sampling setting, on the same
synthetic prompts (guidellm's `synthetic_text` with a fixed seed), streamed chat
completions with `max_completion_tokens` and `ignore_eos` (a fixed length, as guidellm
sends them). Needs the `clients` extra (guidellm) and the model's GGUF (its HF tokenizer
is saved for guidellm's synthetic data).

    python bench/guidellm_serve.py --out bench/results/guidellm-serve.json

Prints a markdown table and saves JSON with the host CPU and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from first_run import cpu_name

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def start(model: str, strategy: str, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lookahead_jax.serve", "--model", model, "--strategy", strategy,
           "--max-batch", "8", "--port", str(port)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 1800:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                h = json.loads(r.read())  # ready, and every listed program compiled (none in the runs)
                if r.status == 200 and h.get("programs_ready") == h.get("programs_total"):
                    return p
        except OSError:
            pass
        if p.poll() is not None:
            raise SystemExit(f"the {strategy} server exited: see {log}")
        time.sleep(1)
    raise SystemExit(f"the {strategy} server was not ready in 30 min: see {log}")


def run_guidellm(url: str, model: str, tokenizer: Path, body: dict, a, work: Path) -> list:
    """One guidellm run (its benchmarks at each concurrency): the per-benchmark metrics."""
    backend = {"kind": "openai_http", "target": url, "model": model}
    if body:
        backend["extras"] = {"body": body}
    scenario = {"spec": {
        "backend": backend,
        "profile": {"kind": "concurrent", "streams": a.streams[0]},
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens}],
        "constraints": [{"kind": "max_requests", "count": a.requests}],
        "outputs": [{"kind": "json", "path": str(work / "report.json")}]},
        "benchmarks": [{"profile.streams": s} for s in a.streams]}
    (work / "scenario.json").write_text(json.dumps(scenario))
    env = {**os.environ, **OFFLINE, "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    p = subprocess.run([sys.executable, "-m", "guidellm", "run", "--scenario", str(work / "scenario.json"),
                        "--disable-console-interactive"], cwd=work, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"guidellm failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    out = []
    for b in json.loads((work / "report.json").read_text())["benchmarks"]:
        m, totals = b["metrics"], b["metrics"]["request_totals"]
        pick = lambda name, stat: m[name]["successful"][stat]  # noqa: E731
        out.append(dict(concurrency=b["config"]["strategy"]["streams"], successful=totals["successful"],
                        errored=totals["errored"], incomplete=totals["incomplete"],
                        output_tokens_per_s=pick("output_tokens_per_second", "mean"),
                        requests_per_s=pick("requests_per_second", "mean"),
                        ttft_ms_median=pick("time_to_first_token_ms", "median"),
                        ttft_ms_p95=pick("time_to_first_token_ms", "percentiles")["p95"],
                        itl_ms_median=pick("inter_token_latency_ms", "median"),
                        itl_ms_p95=pick("inter_token_latency_ms", "percentiles")["p95"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "guidellm-serve.json"))
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from lookahead_jax.fetch import gguf_path

    work = Path(tempfile.mkdtemp(prefix="guidellm-"))
    gguf = gguf_path(a.model)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(work / "tokenizer")
    servers = {s: (8600 + i, start(a.model, s, 8600 + i, work / f"{s}.log")) for i, s in enumerate(("greedy", "lookahead"))}
    results = []
    try:
        for label, body in (("temperature 0", {"temperature": 0}), ("default sampling", {})):
            for strategy, (port, _) in servers.items():  # alternated: same prompts, one after the other
                rows = run_guidellm(f"http://127.0.0.1:{port}", a.model, work / "tokenizer", body, a, work)
                for r in rows:
                    results.append(dict(strategy=strategy, sampling=label, **r))
                    print(json.dumps(results[-1]), flush=True)
    finally:
        for _, p in servers.values():
            p.terminate()
            p.wait(60)
    lines = ["| sampling | strategy | concurrency | output tok/s | req/s | TTFT median / p95 (ms) | ITL median / p95 (ms) "
             "| errors |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['sampling']} | {r['strategy']} | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['requests_per_s']:.2f} | {r['ttft_ms_median']:.0f} / {r['ttft_ms_p95']:.0f} | "
                     f"{r['itl_ms_median']:.0f} / {r['itl_ms_p95']:.0f} | {r['errored'] + r['incomplete']} |")
    print("\n".join(lines))
    Path(a.out).write_text(json.dumps(dict(
        command="python bench/guidellm_serve.py " + " ".join(sys.argv[1:]), host_cpu=cpu_name(),
        model=a.model, prompt_tokens=a.prompt_tokens, output_tokens=a.output_tokens, requests=a.requests,
        results=results, table="\n".join(lines)), indent=1))


if __name__ == "__main__":
    main()
