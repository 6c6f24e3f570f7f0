"""Peak memory of a command and every process it starts (test workers, subprocesses).

    python bench/memory_peak.py --out bench/results/memory-suite.json -- python -m pytest -q -m "slow or not slow"
    python bench/memory_peak.py -- python -m lookahead_jax.generate --model qwen2.5-coder-1.5b --prompt hi

Every 0.25 s it sums the resident memory (RSS) of the command's process tree (the largest
sum, when, and the processes that made it), and reads each process's VmHWM from /proc (the
kernel's own peak RSS of that process: no spike of one process is missed between samples,
which a summed-RSS sampler alone can miss). Linux only (psutil, /proc). Prints and saves
JSON; GiB = 2^30 bytes. Exits with the command's exit status.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

GiB = 2**30


def vmhwm(pid: int):
    """The process's peak resident memory in bytes (VmHWM), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def measure(cmd: list, every: float = 0.25) -> dict:
    import psutil

    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak, peak_at, peak_procs, hwm, t0 = 0, 0.0, [], {}, time.time()
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        total, parts = 0, []
        for p in procs:
            try:
                rss, name = p.memory_info().rss, " ".join(p.cmdline())[:160]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += rss
            parts.append((rss, name))
            h = vmhwm(p.pid)
            if h:
                hwm[(p.pid, name)] = max(hwm.get((p.pid, name), 0), h)
        if total > peak:
            peak, peak_at, peak_procs = total, time.time() - t0, sorted(parts, reverse=True)[:6]
        time.sleep(every)
    return dict(command=cmd, returncode=proc.wait(), wall_s=round(time.time() - t0, 1),
                peak_summed_rss_gib=round(peak / GiB, 2), peak_at_s=round(peak_at, 1),
                peak_processes=[dict(rss_gib=round(r / GiB, 2), cmd=n) for r, n in peak_procs],
                largest_process_peaks=[dict(vmhwm_gib=round(h / GiB, 2), pid=pid, cmd=n)
                                       for (pid, n), h in sorted(hwm.items(), key=lambda x: -x[1])[:8]])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        sys.exit("usage: python bench/memory_peak.py [--out FILE] -- COMMAND ...")
    i = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="save the JSON here")
    a = ap.parse_args(argv[:i])
    res = measure(argv[i + 1:])
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res["returncode"]


if __name__ == "__main__":
    sys.exit(main())
