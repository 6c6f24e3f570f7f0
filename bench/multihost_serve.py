"""The server over several local processes against one process with the same mesh: the same
answers (checked, token for token) and each run's throughput and time to first token.

One process holds every device of the mesh (XLA_FLAGS=--xla_force_host_platform_device_count
= data x model on CPU); then `--processes` processes hold data x model / processes devices
each (`python -m lookahead_jax.serve ... --coordinator-address 127.0.0.1:PORT --num-processes N
--process-id I`, docs/multihost.md "The server"): process 0 serves HTTP, the others follow
its engine. Each run: wait for /health 200 (the warm-up's minimum set), one untimed request
per prompt (every program a request runs compiled), then the timed round: every prompt sent
at once as a completion request (temperature 0, stop at EOS or --max-tokens), then SIGTERM.
On one machine the processes share its cores: this measures what the processes, their
collectives and the record cost, not what several hosts gain.

    python bench/multihost_serve.py                     # smollm2-135m, 8 prompts, data=2,model=2, greedy
    python bench/multihost_serve.py --strategy lookahead --out /tmp/mhs.json

Prints a line per run; JSON to bench/results/multihost-serve.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from multihost import free_port, mesh_devices  # noqa: E402


def complete(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=3600, json=dict(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, return_token_ids=True))
    r.raise_for_status()
    return dict(ids=list(r.json()["choices"][0]["token_ids"]), s=time.perf_counter() - t0)


def stream_ttft(url: str, model: str, prompt: str, max_tokens: int) -> float:
    """Seconds to the first streamed chunk with text of one request."""
    import httpx

    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", timeout=3600, json=dict(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    return time.perf_counter() - t0
    return float("nan")


def run(a, n_proc: int, devices: int, prompts: list) -> dict:
    """One server over n_proc processes of devices // n_proc CPU devices: its answers and times."""
    import httpx

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // n_proc}")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port, coord = free_port(), free_port()
    cmd = [sys.executable, "-m", "lookahead_jax.serve", "--model", a.model, "--strategy", a.strategy,
           "--max-batch", str(a.max_batch), "--mesh", a.mesh, "--port", str(port)]
    procs, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for pid in range(n_proc):
            dist = [] if n_proc == 1 else ["--coordinator-address", f"127.0.0.1:{coord}",
                                           "--num-processes", str(n_proc), "--process-id", str(pid)]
            err = open(Path(tmp) / f"p{pid}.err", "w")
            procs.append(subprocess.Popen(cmd + dist, stdout=subprocess.DEVNULL, stderr=err, env=env))
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                if any(p.poll() is not None for p in procs):
                    raise SystemExit(f"{n_proc} processes: a server process ended:\n"
                                     + (Path(tmp) / "p0.err").read_text()[-3000:])
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            ready = time.perf_counter() - t0
            with cf.ThreadPoolExecutor(len(prompts)) as pool:  # untimed: compiles what the round runs
                list(pool.map(lambda p: complete(url, a.model, p, a.max_tokens), prompts))
            t1 = time.perf_counter()
            with cf.ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda p: complete(url, a.model, p, a.max_tokens), prompts))
            wall = time.perf_counter() - t1
            ttft = [stream_ttft(url, a.model, p, a.max_tokens) for p in prompts[:a.ttft_prompts]]
        finally:
            procs[0].send_signal(signal.SIGTERM)
            try:
                rcs = [p.wait(120) for p in procs]
            except subprocess.TimeoutExpired:
                rcs = None
            for p in procs:
                p.kill()
    tokens = sum(len(g["ids"]) for g in got)
    return dict(processes=n_proc, devices_per_process=devices // n_proc, ready_s=round(ready, 1),
                wall_s=round(wall, 2), tokens=tokens, tokens_per_s=round(tokens / wall, 2),
                latency_p50_s=round(sorted(g["s"] for g in got)[len(got) // 2], 2),
                ttft_alone_s=[round(t, 3) for t in ttft], exit_statuses=rcs, token_ids=[g["ids"] for g in got])


def main() -> None:
    from common import read_jsonl, save

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of data/humaneval_sample.jsonl")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--strategy", default="greedy", choices=("greedy", "lookahead"))
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--mesh", default="data=2,model=2")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--ttft-prompts", type=int, default=3, help="prompts sent alone, streamed, for their TTFT")
    ap.add_argument("--out", default=str(ROOT / "bench/results/multihost-serve.json"))
    a = ap.parse_args()
    devices = mesh_devices(a.mesh, a.processes)
    prompts = [r["prompt"] for r in read_jsonl(ROOT / "data/humaneval_sample.jsonl", a.prompts)]
    runs = {}
    for n in (1, a.processes):
        r = runs[n] = run(a, n, devices, prompts)
        print(f"{n} process(es) x {devices // n} devices: ready in {r['ready_s']} s; {r['tokens']} tokens in "
              f"{r['wall_s']} s ({r['tokens_per_s']} tok/s, latency p50 {r['latency_p50_s']} s); TTFT alone "
              f"{r['ttft_alone_s']} s; exit {r['exit_statuses']}", flush=True)
    same = runs[1]["token_ids"] == runs[a.processes]["token_ids"]
    print(f"answers of {a.processes} processes == answers of 1 process: {same}")
    result = dict(bench="multihost_serve", model=a.model, strategy=a.strategy, mesh=a.mesh, prompts=len(prompts),
                  max_tokens=a.max_tokens, max_batch=a.max_batch, same_tokens=same, stops_at_eos=True,
                  runs=[{k: v for k, v in r.items() if k != "token_ids"} for r in runs.values()])
    save(result, a.out)
    if not same:
        raise SystemExit("the processes' answers differ from one process's")


if __name__ == "__main__":
    main()
