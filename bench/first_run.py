"""What a CLI user waits for: fresh processes of `python -m lookahead_jax.generate`.

Two measurements (issue 16, items 1 and 3), each a fresh process per run, alternated
between the checkouts compared (`--trees NEW OLD ...`: directories holding a checkout;
each runs its own code) so that the machine's drift hits every side alike:

* first run: greedy vs lookahead (`auto`) on one chat prompt; the process's wall time,
  and generate's compile / calibration seconds from `--json`'s summary. The persistent
  compilation cache is warm (a first pass per side fills it) unless `--cold`, which gives
  every run an empty cache.
* mixed-length batch: one ~1,500-token prompt alone, with one short prompt, and with two
  (`--batch-size` = rows); the summary's prefill seconds (time to the first token) and
  wall seconds, greedy.

    python bench/first_run.py --trees . ../old-checkout --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def long_prompt(n_tokens: int = 1490) -> str:
    """Passages of the bundled wiki corpus (or repeated text) cut to ~n tokens of SmolLM2."""
    import lookahead_jax as lj

    _, tok = lj.load("smollm2-135m")
    corpus = Path(os.environ.get("LOOKAHEAD_BENCH_CORPUS", "../shared/data/wiki_passages.jsonl"))
    text = ""
    if corpus.exists():
        with open(corpus) as f:
            for line in f:
                p = json.loads(line)
                text += p.get("title", "") + "\n" + p.get("text", p.get("contents", "")) + "\n\n"
                if len(tok.encode(text)) > n_tokens:
                    break
    else:
        while len(tok.encode(text)) <= n_tokens:
            text += "The quick brown fox jumps over the lazy dog. "
    ids = tok.encode(text)[:n_tokens]
    return tok.decode(ids, skip_special_tokens=True) + "\n\nSummarize the passages above in one sentence:"


def run(tree: Path, args: list, env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "lookahead_jax.generate", *args, "--json"], cwd=tree, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{p.stderr[-2000:]}")
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    summary = lines[-1]["summary"]
    return dict(process_s=round(wall, 2), **{k: summary.get(k) for k in (
        "wall_s", "prefill_s", "compile_s", "calibrate_s", "forward_steps", "new_tokens", "compilations")},
        texts=[x.get("text") for x in lines[:-1]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=["."], help="checkouts to compare (first: the new one)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="an empty compilation cache for every run")
    ap.add_argument("--only", choices=("first", "mixed"), help="one of the two measurements")
    ap.add_argument("--out", default=str(RESULTS / "first-run.json"))
    a = ap.parse_args()
    trees = [Path(t).resolve() for t in a.trees]
    names = [t.name for t in trees]
    base_env = dict(os.environ)
    cache = Path(tempfile.mkdtemp(prefix="first_run_xla_"))
    results = dict(command="python " + " ".join(sys.argv), host_cpu=cpu_name(), trees=[str(t) for t in trees],
                   cold=a.cold, first_run={}, mixed={})

    from lookahead_jax.presets import cache_root

    root = cache_root()

    def fresh_root(path: Path) -> Path:
        """A cache root whose converted models and kernels are the user's (symlinks), with
        its own compilation cache (xla/)."""
        path.mkdir(parents=True, exist_ok=True)
        for entry in root.iterdir() if root.exists() else ():
            if entry.name != "xla" and not (path / entry.name).exists():
                (path / entry.name).symlink_to(entry)
        return path

    def env_for(i: int) -> dict:
        if a.cold:
            return dict(base_env, LOOKAHEAD_JAX_CACHE=str(fresh_root(Path(tempfile.mkdtemp(prefix="first_run_cold_")))))
        return dict(base_env, LOOKAHEAD_JAX_CACHE=str(fresh_root(cache / f"{i}-{names[i]}")))

    chat = ["--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "32"]
    if a.only != "mixed":
        jobs = [(s, chat + ["--strategy", s]) for s in ("greedy", "lookahead")]
        if not a.cold:  # fill each side's compilation cache
            for i, t in enumerate(trees):
                for _, args in jobs:
                    run(t, args, env_for(i))
        for r in range(a.reps):
            for i, t in enumerate(trees if r % 2 == 0 else trees[::-1]):
                i = trees.index(t)
                for s, args in (jobs if r % 2 == 0 else jobs[::-1]):
                    out = run(t, args, env_for(i))
                    results["first_run"].setdefault(f"{names[i]}/{s}", []).append(out)
                    print(f"first run  {names[i]:>12} {s:>9}: process {out['process_s']:6.1f} s, compile "
                          f"{out['compile_s']:5.1f} s, calibration {out['calibrate_s'] or 0:5.1f} s", flush=True)
    if a.only != "first":
        long = long_prompt()
        files = {}
        tmp = Path(tempfile.mkdtemp(prefix="first_run_prompts_"))
        for rows in (1, 2, 3):
            f = tmp / f"rows{rows}.jsonl"
            f.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                   [long, "The capital of France is", "def fibonacci(n):"][:rows]) + "\n")
            files[rows] = ["--prompts-file", str(f), "--batch-size", str(rows), "--max-new-tokens", "16"]
        if not a.cold:
            for i, t in enumerate(trees):
                for args in files.values():
                    run(t, args, env_for(i))
        for r in range(a.reps):
            for t in (trees if r % 2 == 0 else trees[::-1]):
                i = trees.index(t)
                for rows, args in files.items():
                    out = run(t, args, env_for(i))
                    results["mixed"].setdefault(f"{names[i]}/rows{rows}", []).append(out)
                    print(f"mixed      {names[i]:>12} rows={rows}: prefill {out['prefill_s']:6.2f} s, wall "
                          f"{out['wall_s']:6.2f} s, process {out['process_s']:6.1f} s", flush=True)
        texts = {k: [o["texts"] for o in v] for k, v in results["mixed"].items()}
        for rows in (1, 2, 3):
            firsts = {texts[f"{n}/rows{rows}"][0][0] for n in names}
            results.setdefault("same_long_text", {})[rows] = len(firsts) == 1
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(f"saved {a.out}")


if __name__ == "__main__":
    main()
