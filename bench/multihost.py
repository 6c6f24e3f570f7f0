"""The generate command over several local processes against one process with the same mesh:
the same tokens (checked), and each run's summary (wall time, tokens/s, compile time).

One process holds every device of the mesh (XLA_FLAGS=--xla_force_host_platform_device_count
= data x model on CPU); then `--processes` processes hold data x model / processes devices
each, started with --coordinator-address 127.0.0.1:PORT --num-processes N --process-id I
(docs/multihost.md), process 0's stdout read. On one machine the processes share its cores:
this measures what the processes and their collectives cost, not what several hosts gain.

    python bench/multihost.py                                   # smollm2-135m, 8 prompts, data=2,model=2
    python bench/multihost.py --prompts 4 --max-new-tokens 8 --strategy lookahead --out /tmp/mh.json

Prints a line per run; JSON to bench/results/multihost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mesh_devices(mesh: str, processes: int) -> int:
    """The devices of `--mesh` ("data=2,model=2"), which `processes` must divide."""
    axes = dict((k, int(v)) for k, v in (x.split("=") for x in mesh.split(",")))
    devices = axes.get("data", 1) * axes.get("model", 1)
    if devices % processes:
        raise SystemExit(f"--processes {processes} does not divide the mesh's {devices} devices")
    return devices


def run(args, n_proc: int, devices: int, timeout: int) -> tuple:
    """(process 0's JSON rows, its summary, wall seconds of the whole run) of the command
    over n_proc processes of devices // n_proc CPU devices each."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices // n_proc}")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port, procs, t0 = free_port(), [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for pid in range(n_proc):
            dist = [] if n_proc == 1 else ["--coordinator-address", f"127.0.0.1:{port}",
                                           "--num-processes", str(n_proc), "--process-id", str(pid)]
            out = open(Path(tmp) / f"p{pid}.out", "w")
            procs.append(subprocess.Popen([sys.executable, "-m", "lookahead_jax.generate", *args, *dist],
                                          stdout=out, stderr=subprocess.DEVNULL if pid else None, env=env))
        try:
            rcs = [p.wait(timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()
        wall = time.perf_counter() - t0
        if any(rcs):
            raise SystemExit(f"{n_proc} processes: exit statuses {rcs}")
        objs = [json.loads(line) for line in (Path(tmp) / "p0.out").read_text().splitlines() if line.startswith("{")]
    rows = sorted((o for o in objs if "summary" not in o), key=lambda r: r["prompt_index"])
    return rows, next(o["summary"] for o in objs if "summary" in o), wall


def main() -> None:
    from common import read_jsonl, save

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of data/humaneval_sample.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--strategy", default="greedy", choices=("greedy", "lookahead"))
    ap.add_argument("--mesh", default="data=2,model=2")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run at most")
    ap.add_argument("--out", default=str(ROOT / "bench/results/multihost.json"))
    a = ap.parse_args()
    devices = mesh_devices(a.mesh, a.processes)
    recs = read_jsonl(ROOT / "data/humaneval_sample.jsonl", a.prompts)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.writelines(json.dumps({"prompt": r["prompt"]}) + "\n" for r in recs)
    args = ["--model", a.model, "--prompts-file", f.name, "--batch-size", str(len(recs)), "--no-chat",
            "--max-new-tokens", str(a.max_new_tokens), "--strategy", a.strategy, "--mesh", a.mesh, "--json"]
    runs = {}
    for n in (1, a.processes):
        rows, summary, wall = run(args, n, devices, a.timeout)
        runs[n] = dict(processes=n, devices_per_process=devices // n, wall_s=round(wall, 2), summary=summary,
                       token_ids=[r["token_ids"] for r in rows])
        print(f"{n} process(es) x {devices // n} devices: {summary['new_tokens']} tokens, decode "
              f"{summary['wall_s']:.2f} s ({summary['tokens_per_s']:.1f} tok/s), compile {summary['compile_s']:.1f} s, "
              f"whole run {wall:.1f} s", flush=True)
    os.unlink(f.name)
    same = runs[1]["token_ids"] == runs[a.processes]["token_ids"]
    print(f"tokens of {a.processes} processes == tokens of 1 process: {same}")
    result = dict(bench="multihost", model=a.model, strategy=a.strategy, mesh=a.mesh, prompts=len(recs),
                  max_new_tokens=a.max_new_tokens, same_tokens=same,
                  runs=[{k: v for k, v in r.items() if k != "token_ids"} for r in runs.values()])
    save(result, a.out)
    if not same:
        raise SystemExit("the processes' tokens differ from one process's")


if __name__ == "__main__":
    main()
