"""What a user waits for before lookahead-jax is useful: start-to-ready, the first
requests' latency, programs compiled and compile seconds, for the CLI and the server,
with cold and warm compilation caches. Every measurement is a fresh process.

"Cold": a fresh temporary LOOKAHEAD_JAX_CACHE in which the converted model (`--model`'s
folder), the built CPU kernels (`kernels`) and `gguf` are symlinked from the real cache
root: nothing compiled (no `xla/`, no `xla-steps/`), nothing converted again. "Warm": a
second process on that same directory.

* `--cli`: the README's pair, `python -m lookahead_jax.generate --prompts-file
  data/humaneval_sample.jsonl --max-new-tokens 128 [--strategy lookahead] --json`
  (the first `--n` prompts); per rep cold greedy, cold lookahead (a cache dir each),
  then warm greedy, warm lookahead on those dirs, the order reversed every other rep
  (ABBA: this machine's speed drifts by 20-30%). The process's wall time, and from the
  `--json` summary compile_s, calibrate_s, the decode time (wall_s: compilation
  excluded), tokens, compilations, and each compiled program with its seconds (`-v`'s
  log lines: `-v` only adds logging); the token ids of every run are checked against the
  first greedy run's (lookahead is lossless: a mismatch is printed loudly, kept in the
  JSON, and the exit status is 1).
* `--server`: `python -m lookahead_jax.serve --model M --strategy lookahead --max-batch 8
  --port P` (+ `--serve-arg`): seconds from the process's start until the port accepts a
  connection and until GET /health first answers 200 (polled every 0.25 s; 503 bodies
  kept when they change, e.g. `{"status": "warming up", "programs_ready": k, ...}`, and
  the log's `warm-up: k / n steps` lines with their times), then the latency of a first
  greedy chat request (temperature 0) and of a first sampled one (temperature 1, top_p
  0.9, a longer prompt), `--request-tokens` each (ignore_eos: a fixed length), and
  /metrics' program / compile gauges (`lookahead_jax:programs_compiled`,
  `programs_total`, `compile_seconds`) when the server has them; always also the
  server log's `compiled ... (compilation #k)` lines, counted before and after ready and
  during each first request, and `usable_s` (start until both first requests answered:
  with `--serve-arg=--warmup=none` the compilations move from ready into it). Cold, then
  a restart on the warm dir. `--jax-log-compiles` (JAX_LOG_COMPILES=1) also counts every
  XLA compilation, the small jits the engine's lines do not show included.
* `--mixed`: a fresh cold server (then, with `--mixed-warm`, a restart on its dir): one
  streaming greedy chat completion of `--stream-tokens` (ignore_eos) and, while it
  streams, `--mixed-requests` sampled requests one after another, each with a longer
  prompt (data/ passages + an NQ question), every other one with presence / frequency /
  repetition penalties; every chunk's arrival time, the gaps between
  consecutive chunks (p50 / p99 / max), the gaps over 0.5 s with the compilations the
  server logged during them, and each sampled request's time to first token and latency
  (they stream too).

Each process's code is fingerprinted as it starts (lookahead_jax/, models/, convert/):
a warm run whose code differs from its cold run's (someone edited the tree meanwhile;
the caches' keys changed) is flagged `code_changed_since_cold` and starred in the table.
Without any of the three, all three run. The issue's targets are printed with the table:
cold server ready (200) within 60 s, warm within 15 s, at most 16 programs; no stream gap
over 0.5 s during which the server compiled.

    python bench/cold_start.py --cli --reps 2
    python bench/cold_start.py --server --mixed --mixed-warm --keep-logs
    python bench/cold_start.py --smoke --server --serve-arg=--warmup=none --out /tmp/cs.json

Writes `--out` (default bench/results/cold-start.json: the host CPU, the command line,
timestamps and every run's raw numbers) and a plot next to it (.png); with --keep-logs the
servers' logs (stdout + stderr) next to it too. Every process started here is stopped at
the end, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, save  # noqa: E402
from first_run import cpu_name  # noqa: E402

DATA = ROOT / "data"
RESULTS = ROOT / "bench" / "results"
TARGETS = dict(cold_ready_s=60.0, warm_ready_s=15.0, max_programs=16, max_compile_gap_s=0.5)
COMPILED = re.compile(r"compiled (.*) in ([\d.]+) s \(compilation #(\d+)\)")
WARMUP = re.compile(r"warm-up: (\d+) / (\d+) steps")
XLA_COMPILE = re.compile(r"Finished XLA compilation of (\S+) in ([\d.e-]+) sec")  # JAX_LOG_COMPILES=1
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
PROCS: list = []  # every process started here: stopped in main's finally


# ----------------------------------------------------------------------------- processes
def cache_root() -> Path:
    """The real cache root, as lookahead_jax.presets.cache_root (not imported: this process
    stays free of jax while it times others)."""
    env = os.environ.get("LOOKAHEAD_JAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lookahead_jax"


def cold_dir(model: str, tmp: Path, label: str) -> Path:
    """A fresh cache root holding symlinks to the real one's model, kernels and gguf."""
    d = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=tmp))
    for name in (model, "kernels", "gguf"):
        if (cache_root() / name).exists():
            (d / name).symlink_to(cache_root() / name)
        elif name == model:
            print(f"warning: {cache_root() / name} not found: the cold run converts the model too", flush=True)
    return d


def cache_size(d: Path) -> dict:
    """Files and bytes of the compilation caches (xla/, xla-steps/) under cache root `d`."""
    out = {}
    for sub in ("xla", "xla-steps"):
        files = [p for p in (d / sub).rglob("*") if p.is_file()] if (d / sub).exists() else []
        out[sub] = dict(files=len(files), mb=round(sum(p.stat().st_size for p in files) / 2 ** 20, 1))
    return out


def kernel_builds() -> set:
    k = cache_root() / "kernels"
    return {p.name for p in k.iterdir()} if k.exists() else set()


def code_sha() -> str:
    """A fingerprint of the code under test (lookahead_jax/, models/, convert/: *.py, *.cc),
    taken as each process starts: an edit between a cold and its warm run changes the
    step cache's and XLA's keys, and the warm run is not warm (flagged)."""
    import hashlib

    h = hashlib.sha256()
    for d in ("lookahead_jax", "models", "convert"):
        for f in sorted((ROOT / d).rglob("*")):
            if f.suffix in (".py", ".cc") and f.is_file():
                h.update(str(f.relative_to(ROOT)).encode() + f.read_bytes())
    return h.hexdigest()[:12]


def child_env(root: Path, log_compiles: bool = False) -> dict:
    env = dict(os.environ, LOOKAHEAD_JAX_CACHE=str(root), PYTHONUNBUFFERED="1")
    if log_compiles:
        env["JAX_LOG_COMPILES"] = "1"
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # would replace the cache under test
    if env.get("LOOKAHEAD_JAX_XLA_CACHE") == "0" or env.get("LOOKAHEAD_JAX_STEP_CACHE") == "0":
        print("warning: LOOKAHEAD_JAX_XLA_CACHE / LOOKAHEAD_JAX_STEP_CACHE = 0 in the environment: warm runs "
              "are not warm", flush=True)
    return env


def spawn(cmd: list, env: dict, **kw) -> subprocess.Popen:
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, **kw)
    PROCS.append(p)
    return p


def stop(p: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGINT (a server drains and exits), then SIGKILL to the process's own group."""
    if p.poll() is None:
        try:
            p.send_signal(signal.SIGINT)
            p.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs, q):
    import numpy as np

    return round(float(np.percentile(xs, q)), 4) if len(xs) else None


# ----------------------------------------------------------------------------- CLI
def cli_prompts(n: int, tmp: Path) -> Path:
    src = DATA / "humaneval_sample.jsonl"
    lines = src.read_text().splitlines()
    if n >= len(lines):
        return src
    f = tmp / f"humaneval_first{n}.jsonl"
    f.write_text("\n".join(lines[:n]) + "\n")
    return f


def run_cli(a, strategy: str, root: Path, prompts: Path) -> dict:
    args = ["--prompts-file", str(prompts.relative_to(ROOT) if prompts.is_relative_to(ROOT) else prompts),
            "--max-new-tokens", str(a.max_new_tokens)] + (["--strategy", strategy] if strategy != "greedy" else [])
    cmd = [sys.executable, "-m", "lookahead_jax.generate", *args, "--json", "-v"]  # -v: its compilations logged
    kernels, code = kernel_builds(), code_sha()
    t0 = time.perf_counter()
    p = spawn(cmd, child_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=a.run_timeout)
    except subprocess.TimeoutExpired:
        stop(p)
        raise SystemExit(f"{' '.join(cmd)}: no result within --run-timeout {a.run_timeout} s")
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err[-3000:]}")
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    s = rows[-1]["summary"]
    compiled = [dict(program=c.group(1), s=float(c.group(2))) for c in map(COMPILED.search, err.splitlines()) if c]
    return dict(command="python -m lookahead_jax.generate " + " ".join(args + ["--json", "-v"]), process_s=round(wall, 2),
                compile_s=s.get("compile_s"), calibrate_s=s.get("calibrate_s"), decode_s=s.get("wall_s"),
                prefill_s=s.get("prefill_s"), new_tokens=s.get("new_tokens"), forward_steps=s.get("forward_steps"),
                tokens_per_step=s.get("tokens_per_step"), compilations=s.get("compilations"),
                kernels_built=sorted(kernel_builds() - kernels), cache_files=cache_size(root), code=code,
                compiled=compiled, compiled_logged_s=round(sum(c["s"] for c in compiled), 2), token_ids=[r.get("token_ids") for r in rows[:-1]],
                texts=[r.get("text") for r in rows[:-1]])


def measure_cli(a, tmp: Path, result: dict) -> None:
    prompts = cli_prompts(a.n, tmp)
    runs = result["cli"]["runs"]
    for rep in range(a.reps):
        order = ["greedy", "lookahead"] if rep % 2 == 0 else ["lookahead", "greedy"]
        dirs = {s: cold_dir(a.model, tmp, f"cli-{s}-{rep}") for s in order}
        for cache in ("cold", "warm"):
            for s in order:
                r = run_cli(a, s, dirs[s], prompts)
                r.update(rep=rep, strategy=s, cache=cache, at=datetime.now().isoformat(timespec="seconds"))
                runs.append(r)
                print(f"cli rep {rep} {cache:4s} {s:9s}: process {r['process_s']:7.1f} s, compile "
                      f"{r['compile_s'] or 0:6.1f} s, calibration {r['calibrate_s'] or 0:5.1f} s, decode "
                      f"{r['decode_s'] or 0:6.2f} s, {r['new_tokens']} tokens, {r['compilations']} compilations"
                      + (f", kernels built {r['kernels_built']}" if r["kernels_built"] else ""), flush=True)
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
        for r in runs:
            if r["rep"] == rep and r["cache"] == "warm":
                cold = next(c for c in runs if c["rep"] == rep and c["cache"] == "cold" and c["strategy"] == r["strategy"])
                r["code_changed_since_cold"] = r["code"] != cold["code"]
                if r["code_changed_since_cold"]:
                    print(f"warning: cli rep {rep} warm {r['strategy']}: the code changed since its cold run "
                          f"({cold['code']} -> {r['code']}): not a warm-cache measurement", flush=True)
    ref = next(r for r in runs if r["strategy"] == "greedy")
    mismatches = []
    for i, r in enumerate(runs):
        for j, (x, y) in enumerate(zip(ref["token_ids"], r["token_ids"])):
            if x != y:
                k = next((k for k, (u, v) in enumerate(zip(x or [], y or [])) if u != v), min(len(x or []), len(y or [])))
                mismatches.append(dict(run=i, strategy=r["strategy"], cache=r["cache"], rep=r["rep"], prompt=j,
                                       first_diff_token=k))
        if len(r["token_ids"]) != len(ref["token_ids"]):
            mismatches.append(dict(run=i, strategy=r["strategy"], rows=len(r["token_ids"])))
    result["cli"].update(identical_tokens=not mismatches, mismatches=mismatches)
    if mismatches:
        print("\n" + "!" * 78 + f"\n!!! LOSSLESS CHECK FAILED: {len(mismatches)} rows differ from the first greedy "
              f"run's tokens:\n!!! {mismatches[:8]}\n" + "!" * 78 + "\n", file=sys.stderr, flush=True)
    else:
        print(f"cli: the token ids of all {len(runs)} runs are identical (greedy = lookahead)", flush=True)


# ----------------------------------------------------------------------------- server
def read_log(path: Path, t_start: float, t_ready: float | None = None) -> dict:
    """The server log's compilations (the engine's `compiled ... (compilation #k)` lines;
    with --jax-log-compiles also every XLA compilation JAX logs) and warm-up progress,
    times in seconds since the process's start."""
    compiled, progress, xla = [], [], []
    for line in path.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        t = round(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() - t_start, 3) if m else None
        c = COMPILED.search(line)
        if c:
            compiled.append(dict(t=t, program=c.group(1), s=float(c.group(2)), n=int(c.group(3))))
        x = XLA_COMPILE.search(line)
        if x:
            xla.append(dict(t=t, program=x.group(1), s=float(x.group(2))))
        w = WARMUP.search(line)
        if w:
            progress.append(dict(t=t, done=int(w.group(1)), total=int(w.group(2))))
    before = [c for c in compiled if t_ready is None or c["t"] is None or c["t"] <= t_ready]
    out = dict(compiled=compiled, warmup_progress=progress, programs_before_ready=len(before),
               programs_after_ready=len(compiled) - len(before),
               compile_s_logged=round(sum(c["s"] for c in compiled), 2))
    if xla:  # every jit JAX compiled, the engine's steps and the small ones it does not count
        after = [x for x in xla if t_ready is not None and x["t"] is not None and x["t"] > t_ready]
        out["xla"] = dict(compilations=len(xla), seconds=round(sum(x["s"] for x in xla), 2),
                          over_100ms=sum(x["s"] > 0.1 for x in xla), after_ready=len(after),
                          after_ready_s=round(sum(x["s"] for x in after), 2),
                          slowest=sorted(xla, key=lambda x: -x["s"])[:8])
    out["_xla"] = xla  # the whole list: for `logged_during`, not saved
    return out


def logged_during(entries: list, t0: float, t1: float) -> dict:
    """The log entries (`read_log`'s compiled / xla lists) between t0 and t1: count, seconds."""
    e = [x for x in entries if x["t"] is not None and t0 <= x["t"] <= t1]
    return dict(n=len(e), s=round(sum(x["s"] for x in e), 2))


def scrape(url: str) -> dict:
    """/metrics' program / compile gauges and counters (any name holding 'program' or 'compil')."""
    import httpx

    out = {}
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError as e:
        return dict(error=str(e))
    for line in text.splitlines():
        if line.startswith("lookahead_jax:") and ("program" in line.split()[0] or "compil" in line.split()[0]):
            try:
                out[line.split()[0]] = float(line.split()[-1])
            except ValueError:
                pass
    return out


class Server:
    """`python -m lookahead_jax.serve` on a free 127.0.0.1 port and cache root `root`, its
    stdout and stderr in `log`; `ready()` polls the port and /health."""

    def __init__(self, a, root: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.root = log, root
        self.cmd = [sys.executable, "-m", "lookahead_jax.serve", "--model", a.model, "--strategy", a.strategy,
                    "--max-batch", str(a.max_batch), "--host", "127.0.0.1", "--port", str(self.port)] + \
            [x for s in a.serve_arg for x in shlex.split(s)]
        self.kernels, self.code = kernel_builds(), code_sha()
        self.t_start = time.time()
        self.proc = spawn(self.cmd, child_env(root, a.jax_log_compiles), stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def ready(self, timeout: float) -> dict:
        import httpx

        port_s = health_s = None
        polls, last = [], None
        while True:
            t = time.time() - self.t_start
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}) before ready:\n"
                                 + self.log.read_text(errors="replace")[-3000:])
            if t > timeout:
                raise SystemExit(f"the server was not ready within --ready-timeout {timeout} s "
                                 f"(port open: {port_s is not None}); log tail:\n"
                                 + self.log.read_text(errors="replace")[-2000:])
            if port_s is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                    port_s = round(time.time() - self.t_start, 3)
                except OSError:
                    pass
            if port_s is not None:
                try:
                    r = httpx.get(self.url + "/health", timeout=5)
                    try:
                        body = r.json() if r.content else None
                    except ValueError:
                        body = r.text[:300]
                    if (r.status_code, body) != last:
                        polls.append(dict(t=round(time.time() - self.t_start, 3), status=r.status_code, body=body))
                        last = (r.status_code, body)
                    if r.status_code == 200:
                        health_s = round(time.time() - self.t_start, 3)
                        break
                except httpx.HTTPError as e:
                    polls.append(dict(t=round(t, 3), error=type(e).__name__))
            time.sleep(0.25)
        return dict(port_s=port_s, health_s=health_s, health_polls=polls)

    def close(self) -> None:
        stop(self.proc)


def chat(url: str, t_start: float, model: str, content: str, max_tokens: int, **sampling) -> dict:
    """A non-streaming chat request of max_tokens tokens (ignore_eos); start / end: seconds
    since the server's start."""
    import httpx

    body = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
                ignore_eos=True, stream=False, **sampling)
    t0 = time.time()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=None)
    t1 = time.time()
    d = r.json() if r.status_code == 200 else {}
    return dict(latency_s=round(t1 - t0, 3), start=round(t0 - t_start, 3), end=round(t1 - t_start, 3),
                status=r.status_code, usage=d.get("usage"),
                text=((d.get("choices") or [{}])[0].get("message") or {}).get("content"),
                error=None if r.status_code == 200 else r.text[:500])


def passages(chars: int, offset: int = 0) -> str:
    """Passages of data/passages.jsonl, from the `offset`-th, joined up to ~`chars` characters."""
    text = []
    for i, line in enumerate(open(DATA / "passages.jsonl")):
        if i >= offset:
            text.append(json.loads(line)["text"])
            if sum(map(len, text)) >= chars:
                break
    return "\n\n".join(text)[:chars]


def rag_prompt(chars: int, k: int) -> str:
    q = [json.loads(x) for x in open(DATA / "nq_questions.jsonl")][k]
    return f"Answer the question using the passages.\n\nPassages: {passages(chars, 7 * k)}\n\nQuestion: {q['question']}?"


GREEDY_PROMPT = "What is the capital of France? Answer in one sentence."
SAMPLED_CHARS = 700  # the first sampled request's passage: another prompt length (bucket) than the greedy one
STREAM_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
MIXED_CHARS = (120, 400, 1000, 2000, 3500, 5000, 6500)  # the mixed load's sampled prompts: growing lengths


def measure_server(a, root: Path, label: str, logs: list) -> dict:
    log = root / f"{label}.log"
    logs.append((label, log))
    srv = Server(a, root, log)
    try:
        r = dict(label=label, command=" ".join(["python"] + srv.cmd[1:]), started=datetime.now().isoformat(timespec="seconds"))
        r.update(srv.ready(a.ready_timeout))
        r["metrics_at_ready"] = scrape(srv.url)
        r["first_greedy"] = chat(srv.url, srv.t_start, a.model, GREEDY_PROMPT, a.request_tokens, temperature=0)
        r["first_sampled"] = chat(srv.url, srv.t_start, a.model, rag_prompt(SAMPLED_CHARS, 0), a.request_tokens,
                                  temperature=1.0, top_p=0.9, seed=0)
        r["metrics"] = scrape(srv.url)
    finally:
        srv.close()
    r.update(read_log(log, srv.t_start, r.get("health_s")))
    xla = r.pop("_xla")
    r.update(cache_files=cache_size(root), kernels_built=sorted(kernel_builds() - srv.kernels), code=srv.code)
    # until both first requests are answered: what a user waits for before the server is useful
    r["usable_s"] = r["first_sampled"]["end"]
    for k in ("first_greedy", "first_sampled"):  # compilations the log shows during each request
        q = r[k]
        q["compiled_during"] = logged_during(r["compiled"], q["start"], q["end"])
        if xla:
            q["xla_compiled_during"] = logged_during(xla, q["start"], q["end"])
    m = r["metrics"]
    r["programs"] = next((v for k, v in m.items() if k.startswith("lookahead_jax:programs_compiled")),
                         len(r["compiled"]))
    r["programs_source"] = "metrics" if any(k.startswith("lookahead_jax:programs_compiled") for k in m) else "log"
    r["compile_s"] = next((v for k, v in m.items() if k.startswith("lookahead_jax:compile_seconds")),
                          r["compile_s_logged"])
    for k in ("first_greedy", "first_sampled"):
        if r[k]["status"] != 200:
            print(f"warning: {label} {k} answered {r[k]['status']}: {r[k]['error']}", flush=True)
    print(f"server {label:5s}: port {r['port_s']} s, /health 200 at {r['health_s']} s, first greedy "
          f"{r['first_greedy']['latency_s']} s, first sampled {r['first_sampled']['latency_s']} s, programs "
          f"{r['programs']} ({r['programs_source']}; {r['programs_after_ready']} after ready), compile "
          f"{r['compile_s']} s", flush=True)
    return r


async def mixed_load(a, url: str, t_start: float) -> dict:
    """One greedy stream, and sampled requests one after another while it streams."""
    import httpx

    chunks, first = [], asyncio.Event()
    stream_body = dict(model=a.model, messages=[{"role": "user", "content": STREAM_PROMPT}], temperature=0,
                       max_tokens=a.stream_tokens, ignore_eos=True, stream=True,
                       stream_options={"include_usage": True})
    info = {}

    async def stream(http):
        info["start"] = time.time()
        try:
            async with http.stream("POST", url + "/v1/chat/completions", json=stream_body) as r:
                info["status"] = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if d.get("usage") and not d.get("choices"):
                        info["tokens"] = d["usage"].get("completion_tokens")
                    if any((c.get("delta") or {}).get("content") for c in d.get("choices") or ()):
                        chunks.append(time.time())
                        first.set()
        finally:
            info["end"] = time.time()
            first.set()  # a stream that failed before its first chunk does not hold the requests

    async with httpx.AsyncClient(timeout=None) as http:
        task = asyncio.create_task(stream(http))
        await first.wait()
        sampled = []
        for k in range(a.mixed_requests):
            prompt = rag_prompt(MIXED_CHARS[k % len(MIXED_CHARS)] * (1 + k // len(MIXED_CHARS)), k + 1)
            body = dict(model=a.model, messages=[{"role": "user", "content": prompt}], temperature=1.0,
                        max_tokens=a.mixed_tokens, ignore_eos=True, seed=k, stream=True,
                        stream_options={"include_usage": True})
            if k % 2:  # every other one with penalties (data on the server's steps: no program of its own)
                body.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)
            t0 = time.time()
            ttft, usage = None, None  # streamed: its time to first token as well as its latency
            async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    usage = d.get("usage") or usage
                    if ttft is None and any((c.get("delta") or {}).get("content") for c in d.get("choices") or ()):
                        ttft = time.time() - t0
            t1 = time.time()
            sampled.append(dict(start=round(t0 - t_start, 3), end=round(t1 - t_start, 3), latency_s=round(t1 - t0, 3),
                                ttft_s=None if ttft is None else round(ttft, 3),
                                status=status, prompt_tokens=(usage or {}).get("prompt_tokens"),
                                completion_tokens=(usage or {}).get("completion_tokens"),
                                penalties=bool(k % 2), during_stream=not task.done()))
        await task
    return dict(stream_status=info.get("status"), stream_tokens=info.get("tokens"), chunks=len(chunks),
                stream_start=round(info["start"] - t_start, 3), chunk_t=[round(t - t_start, 4) for t in chunks],
                sampled=sampled)


def measure_mixed(a, root: Path, label: str, logs: list) -> dict:
    log = root / f"{label}.log"
    logs.append((label, log))
    srv = Server(a, root, log)
    try:
        r = dict(label=label, command=" ".join(["python"] + srv.cmd[1:]))
        r.update(srv.ready(a.ready_timeout))
        r.update(asyncio.run(mixed_load(a, srv.url, srv.t_start)))
        r["metrics"] = scrape(srv.url)
    finally:
        srv.close()
    lg = read_log(log, srv.t_start, r["health_s"])
    xla = lg.pop("_xla")
    r.update(code=srv.code, cache_files=cache_size(root))
    ts = r["chunk_t"]
    gaps = [round(y - x, 4) for x, y in zip(ts, ts[1:])]
    long = []
    for i, g in enumerate(gaps):
        if g > TARGETS["max_compile_gap_s"]:
            t0, t1 = ts[i], ts[i + 1]
            comp = [c["program"] for c in lg["compiled"] if c["t"] is not None and t0 - 0.05 <= c["t"] <= t1 + 0.05]
            comp += [f"xla:{c['program']} {c['s']:.2f}s" for c in xla
                     if c["t"] is not None and t0 <= c["t"] <= t1 + 0.05 and c["s"] > 0.05]
            busy = [k for k, s in enumerate(r["sampled"]) if s["start"] < t1 and s["end"] > t0]
            long.append(dict(at=t0, gap_s=g, compiled=comp, sampled_requests=busy))
    during = [c for c in lg["compiled"] if c["t"] is not None and ts and ts[0] <= c["t"] <= ts[-1]]
    r.update(gaps=gaps, gap_p50_s=pct(gaps, 50), gap_p99_s=pct(gaps, 99), gap_max_s=max(gaps) if gaps else None,
             long_gaps=long, compiled_during_stream=[c["program"] for c in during],
             compile_gaps=sum(1 for g in long if g["compiled"]), programs_logged=len(lg["compiled"]),
             warmup_progress=lg["warmup_progress"], **({"xla": lg["xla"]} if "xla" in lg else {}))
    print(f"mixed {label:5s}: ready {r['health_s']} s, {r['chunks']} chunks, gap p50 {r['gap_p50_s']} p99 "
          f"{r['gap_p99_s']} max {r['gap_max_s']} s, {len(long)} gaps > 0.5 s ({r['compile_gaps']} with a "
          f"compilation), {len(during)} compiled while streaming; sampled latencies "
          f"{[s['latency_s'] for s in r['sampled']]} s", flush=True)
    return r


def warn_code_change(runs: list) -> None:
    """Flag a warm server run whose code differs from the cold run's (see `code_sha`)."""
    for r in runs[1:]:
        r["code_changed_since_cold"] = r.get("code") != runs[0].get("code")
        if r["code_changed_since_cold"]:
            print(f"warning: {r['label']} server: the code changed since the cold run ({runs[0].get('code')} -> "
                  f"{r.get('code')}): not a warm-cache measurement", flush=True)


# ----------------------------------------------------------------------------- report
def table(result: dict) -> None:
    print(f"\n== cold start, {result['model']}, {result['host_cpu']}")
    cli = result.get("cli", {}).get("runs")
    if cli:
        c = result["cli"]
        print(f"\nCLI: {c['prompts']} HumanEval prompts, --max-new-tokens {c['max_new_tokens']} (wall of the process; "
              "compile / calibration / decode from --json)")
        print(f"{'rep':>3} {'cache':5} {'strategy':9} {'process s':>9} {'compile s':>9} {'logged s':>8} {'calib s':>7} "
              f"{'decode s':>8} {'tokens':>6} {'programs':>8}")
        for r in cli:
            print(f"{r['rep']:>3} {r['cache'] + '*' * bool(r.get('code_changed_since_cold')):5} {r['strategy']:9} {r['process_s']:9.1f} {r['compile_s'] or 0:9.1f} "
                  f"{r.get('compiled_logged_s', 0):8.1f} {r['calibrate_s'] or 0:7.1f} {r['decode_s'] or 0:8.2f} {r['new_tokens']!s:>6} {r['compilations']!s:>8}")
        print("(compile s: the summary's compile_s, waits for background loads included; logged s: the sum of "
              "the `compiled ... in X s` lines of -v, the programs the summary counts)")
        print("lossless (same token ids in every run):", "yes" if c["identical_tokens"] else
              f"NO: {len(c['mismatches'])} rows differ")
    for key, title in (("server", "Server"), ("mixed", "Mixed load")):
        runs = result.get(key) or []
        if not runs:
            continue
        print(f"\n{title}: --strategy {result['server_strategy']} --max-batch {result['max_batch']} "
              + " ".join(result["serve_args"]))
        if key == "server":
            print(f"{'cache':5} {'port s':>7} {'/health s':>9} {'greedy s':>8} {'sampled s':>9} {'usable s':>8} "
                  f"{'programs':>8} {'after ready':>11} {'compile s':>9}" + ("   xla compiles (after ready)"
                                                                        if any("xla" in r for r in runs) else ""))
            for r in runs:
                print(f"{r['label'] + '*' * bool(r.get('code_changed_since_cold')):5} {r['port_s'] or 0:7.1f} {r['health_s'] or 0:9.1f} "
                      f"{r['first_greedy']['latency_s']:8.2f} {r['first_sampled']['latency_s']:9.2f} "
                      f"{r['usable_s']:8.1f} {r['programs']!s:>8} {r['programs_after_ready']:>11} "
                      f"{r['compile_s'] or 0:9.1f}" + (f"   {r['xla']['compilations']} ({r['xla']['after_ready']}), "
                                                       f"{r['xla']['seconds']} s" if "xla" in r else ""))
            print("(port / /health: seconds from the process's start; greedy / sampled: the first requests' "
                  "latency; usable: start to both answered; programs: /metrics' programs_compiled, else the log's "
                  "compilation lines)")
        else:
            print(f"{'cache':5} {'ready s':>7} {'chunks':>6} {'gap p50':>7} {'p99':>6} {'max':>6} {'>0.5s':>5} "
                  f"{'compiling':>9}  sampled latencies s")
            for r in runs:
                print(f"{r['label'] + '*' * bool(r.get('code_changed_since_cold')):5} {r['health_s']:7.1f} {r['chunks']:>6} {r['gap_p50_s'] or 0:7.3f} "
                      f"{r['gap_p99_s'] or 0:6.3f} {r['gap_max_s'] or 0:6.3f} {len(r['long_gaps']):>5} "
                      f"{r['compile_gaps']:>9}  {[s['latency_s'] for s in r['sampled']]}")
    if any(r.get("code_changed_since_cold") for k in ("server", "mixed") for r in result.get(k) or []) or \
            any(r.get("code_changed_since_cold") for r in result.get("cli", {}).get("runs") or []):
        print("* the code (lookahead_jax/, models/, convert/) changed between this run and its cold run: "
              "its cache was not warm for it")
    t = result.get("targets")
    if t:
        print("\nissue targets:")
        for k, v in t.items():
            print(f"  {k}: {v}")


def targets(result: dict) -> dict:
    out = {}
    if any(re.search(r"--warmup[= ]none", x) for x in result.get("serve_args") or []):
        out["note"] = ("--warmup none: the server is ready before it compiles anything; the compilations "
                       "fall in the first requests (see usable_s), not in the ready time")
    for r in result.get("server") or []:
        limit = TARGETS["cold_ready_s" if r["label"].startswith("cold") else "warm_ready_s"]
        out[f"{r['label']} ready (200) <= {limit:.0f} s"] = f"{r['health_s']} s: " + \
            ("met" if r["health_s"] is not None and r["health_s"] <= limit else "NOT met")
        out[f"{r['label']} programs <= {TARGETS['max_programs']}"] = f"{r['programs']}: " + \
            ("met" if r["programs"] <= TARGETS["max_programs"] else "NOT met")
    for r in result.get("mixed") or []:
        out[f"mixed {r['label']}: no gap > 0.5 s with a compilation"] = \
            f"{r['compile_gaps']} such gaps (max gap {r['gap_max_s']} s): " + ("met" if not r["compile_gaps"] else "NOT met")
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has = dict(ready=result.get("server") or result.get("cli", {}).get("runs"), first=result.get("server"),
               mixed=result.get("mixed"))
    panels = [p for p in ("ready", "first", "mixed") if has[p]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    axes = dict(zip(panels, axes[0]))
    if "ready" in axes:
        ax, bars = axes["ready"], []
        for r in result.get("cli", {}).get("runs") or []:
            bars.append((f"CLI {r['strategy'][:5]}\n{r['cache']}" + "*" * bool(r.get("code_changed_since_cold")),
                         r["process_s"], "C0" if r["cache"] == "cold" else "C1"))
        for r in result.get("server") or []:
            bars.append((f"server\n{r['label']} /health" + "*" * bool(r.get("code_changed_since_cold")), r["health_s"] or 0,
                         "C0" if r["label"].startswith("cold") else "C1"))
        labels = list(dict.fromkeys(b[0] for b in bars))  # reps: the mean, and each rep as a dot
        for i, lab in enumerate(labels):
            vals = [b[1] for b in bars if b[0] == lab]
            bar = ax.bar(i, sum(vals) / len(vals), color=next(b[2] for b in bars if b[0] == lab))
            ax.bar_label(bar, fmt="%.1f", fontsize=7)
            if len(vals) > 1:
                ax.plot([i] * len(vals), vals, "k.", markersize=4)
        ax.set_xticks(range(len(labels)), labels, fontsize=6)
        if result.get("server"):
            ax.axhline(TARGETS["cold_ready_s"], color="C0", linestyle="--", linewidth=0.7, label="target, cold server")
            ax.axhline(TARGETS["warm_ready_s"], color="C1", linestyle="--", linewidth=0.7, label="target, warm server")
            ax.legend(fontsize=6)
        ax.set_ylabel("seconds")
        ax.set_title("start to ready (CLI: the whole process; *: code changed since the cold run)", fontsize=8)
    if "first" in axes:
        ax = axes["first"]
        runs = result.get("server") or []
        for j, k in enumerate(("first_greedy", "first_sampled")):
            bar = ax.bar([i + 0.4 * j for i in range(len(runs))], [r[k]["latency_s"] for r in runs], 0.4,
                         label=k.replace("_", " "))
            ax.bar_label(bar, fmt="%.2f", fontsize=7)
        ax.set_xticks([i + 0.2 for i in range(len(runs))], [r["label"] for r in runs])
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
        ax.set_title(f"server: first requests' latency ({result['request_tokens']} tokens)", fontsize=8)
    if "mixed" in axes:
        ax = axes["mixed"]
        for j, r in enumerate(result["mixed"]):
            ts = r["chunk_t"]
            if len(ts) < 2:
                continue
            xs = [t - ts[0] for t in ts[1:]]  # each chunk's arrival; the line below it: the gap before it
            ax.vlines(xs, 0, r["gaps"], color=f"C{j}", linewidth=0.8)
            ax.plot(xs, r["gaps"], ".", markersize=3, color=f"C{j}", label=f"{r['label']}: gap before each chunk")
            for k, q in enumerate(r["sampled"]):
                ax.axvspan(q["start"] - ts[0], q["end"] - ts[0], color=f"C{j}", alpha=0.06 + 0.06 * (k % 2))
                ax.text(q["start"] - ts[0], ax.get_ylim()[1] * 0.97, f"s{k}", fontsize=6, va="top", color=f"C{j}")
            cx = [(g["at"] + g["gap_s"] - ts[0], g["gap_s"]) for g in r["long_gaps"] if g["compiled"]]
            if cx:
                ax.plot(*zip(*cx), "rx", label="a compilation during the gap" if j == 0 else None)
        ax.axhline(TARGETS["max_compile_gap_s"], color="gray", linestyle="--", linewidth=0.7)
        ax.set_xlabel("seconds since the stream's first chunk", fontsize=8)
        ax.set_ylabel("gap before the chunk, s")
        ax.legend(fontsize=7)
        ax.set_title(f"mixed load: greedy stream ({result['stream_tokens']} tokens), shaded s0, s1, ...: sampled "
                     "requests", fontsize=8)
    fig.suptitle(f"lookahead_jax cold start, {result['model']}, {result['host_cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", action="store_true", help="the generate CLI, greedy and lookahead, cold and warm")
    ap.add_argument("--server", action="store_true", help="the server: ready and first requests, cold then warm")
    ap.add_argument("--mixed", action="store_true", help="a greedy stream with sampled requests during it (cold)")
    ap.add_argument("--mixed-warm", action="store_true", help="--mixed also on a restart on the warm dir")
    ap.add_argument("--smoke", action="store_true", help="everything small: --n 2, --max-new-tokens 8, --max-batch 2, "
                    "--request-tokens 8, --stream-tokens 48, --mixed-requests 2, --mixed-tokens 16, --reps 1 "
                    "(options given explicitly win)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, help="CLI repetitions, the order reversed each (default 2)")
    ap.add_argument("--n", type=int, help="CLI: the first N prompts of data/humaneval_sample.jsonl (default all 20)")
    ap.add_argument("--max-new-tokens", type=int, help="CLI (default 128)")
    ap.add_argument("--strategy", default="lookahead", help="the server's --strategy")
    ap.add_argument("--max-batch", type=int, help="the server's --max-batch (default 8)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="passed to the server (repeatable; split like a shell), e.g. --serve-arg=--warmup=none")
    ap.add_argument("--request-tokens", type=int, help="server: tokens of each first request (default 32)")
    ap.add_argument("--stream-tokens", type=int, help="mixed: tokens of the greedy stream (default 200)")
    ap.add_argument("--mixed-requests", type=int, help="mixed: sampled requests during the stream (default 5)")
    ap.add_argument("--mixed-tokens", type=int, help="mixed: tokens of each sampled request (default 32)")
    ap.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds a server may take to get ready")
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="seconds a CLI process may take")
    ap.add_argument("--jax-log-compiles", action="store_true",
                    help="servers run with JAX_LOG_COMPILES=1: every XLA compilation is logged and counted, also "
                    "the small jits the engine's `compiled ... (compilation #k)` lines do not show (a verbose log)")
    ap.add_argument("--keep-logs", action="store_true", help="save the servers' logs next to --out")
    ap.add_argument("--out", default=str(RESULTS / "cold-start.json"))
    a = ap.parse_args(argv)
    small = dict(reps=1, n=2, max_new_tokens=8, max_batch=2, request_tokens=8, stream_tokens=48, mixed_requests=2,
                 mixed_tokens=16)
    full = dict(reps=2, n=20, max_new_tokens=128, max_batch=8, request_tokens=32, stream_tokens=200,
                mixed_requests=5, mixed_tokens=32)
    for k, v in (small if a.smoke else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if not (a.cli or a.server or a.mixed or a.mixed_warm):
        a.cli = a.server = a.mixed = True
    a.mixed = a.mixed or a.mixed_warm

    # a SIGTERM stops this process as Ctrl-C does: the finally below stops the servers
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    tmp = Path(tempfile.mkdtemp(prefix="cold_start_"))
    result = dict(host_cpu=cpu_name(), cpus_usable=len(os.sched_getaffinity(0)), model=a.model,
                  started=datetime.now().isoformat(timespec="seconds"), smoke=a.smoke,
                  cli=dict(prompts=a.n, max_new_tokens=a.max_new_tokens, reps=a.reps, runs=[]) if a.cli else {},
                  server_strategy=a.strategy, max_batch=a.max_batch, serve_args=a.serve_arg,
                  request_tokens=a.request_tokens, stream_tokens=a.stream_tokens, mixed_tokens=a.mixed_tokens,
                  real_cache_root=str(cache_root()), targets_wanted=TARGETS, server=[], mixed=[])
    logs: list = []
    status = 0
    try:
        if a.cli:
            measure_cli(a, tmp, result)
            status = 0 if result["cli"]["identical_tokens"] else 1
        if a.server:
            root = cold_dir(a.model, tmp, "server")
            for label in ("cold", "warm"):
                result["server"].append(measure_server(a, root, label, logs))
            warn_code_change(result["server"])
        if a.mixed:
            root = cold_dir(a.model, tmp, "mixed")
            for label in ("cold", "warm") if a.mixed_warm else ("cold",):
                result["mixed"].append(measure_mixed(a, root, label, logs))
            warn_code_change(result["mixed"])
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the clean-up short
        for p in PROCS:
            stop(p)
        result["finished"] = datetime.now().isoformat(timespec="seconds")
        result["targets"] = targets(result)
        result["complete"] = sys.exc_info()[0] is None
        save(result, a.out)
        result["command"] = "python " + " ".join(sys.argv)  # save() wrote it with the interpreter's name
        Path(a.out).write_text(json.dumps(result, indent=2))
        if a.keep_logs:
            for label, log in logs:
                if log.exists():
                    dest = Path(a.out).with_name(f"{Path(a.out).stem}-{log.parent.name.split('-')[0]}-{label}.log")
                    shutil.copy(log, dest)
                    print(f"saved {dest}")
        shutil.rmtree(tmp, ignore_errors=True)
    table(result)
    plot(result, str(Path(a.out).with_suffix(".png")))
    return status


if __name__ == "__main__":
    sys.exit(main())
