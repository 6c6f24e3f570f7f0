"""Speedup against the cost of one retrieval, from `bench/ralmspec.py` results.

    python bench/retrieval_curve.py bench/results/ralmspec-async-nolatency.json \
        bench/results/ralmspec-async-latency100ms-quiet.json bench/results/ralmspec-async-latency300ms.json

Each input is one run of `bench/ralmspec.py` (the same questions for every method, tokens
checked against the baseline). Per retriever group of a run, the x value is what one
full-index query cost its baseline (RaLM: retrieval seconds / full-index queries; KNN-LM:
search seconds / searches), simulated latency included, and y is each speculative method's
wall-clock speedup over that baseline (`speedup` in the run's JSON). Runs whose outputs
differed from the baseline are marked; each point names the CPU of its run (the inputs
may come from different hosts: the legend says which). Writes JSON (the points, each with its source file)
and a PNG (log x) next to it: where speculation pays, and where it cannot (retrieval a
small share of the time: the ceiling, marked x per run, is 1 / (1 - retrieval share)).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import host_line, save  # noqa: E402


def points(path: Path) -> list:
    """[point]: one per (retriever group, speculative method) of a ralmspec.py result."""
    r = json.loads(path.read_text())
    if "retrievers" not in r:
        raise ValueError(f"{path}: not a bench/ralmspec.py result (no 'retrievers')")
    out = []
    for group, g in r["retrievers"].items():
        base_name = g.get("baseline")
        if not base_name:
            continue
        base = g["methods"][base_name]
        queries = base.get("full_index_queries") or base.get("retrieval_calls")
        if not queries:
            continue
        per_query_ms = 1e3 * base["retrieval_s"] / queries
        share = base["retrieval_s"] / base["time_s"] if base["time_s"] else 0.0
        for name, m in g["methods"].items():
            if name == base_name or "speedup" not in m:
                continue
            out.append(dict(group=group, method=name, retrieval_ms_per_query=round(per_query_ms, 3),
                            baseline_retrieval_share=round(share, 4), ceiling=round(1 / max(1 - share, 1e-9), 3),
                            speedup=m["speedup"], identical=m.get("identical_to_baseline"),
                            simulated_latency_ms=r.get("simulated_retrieval_latency_ms"),
                            questions=r.get("questions"), source=path.name,
                            host=(r.get("host") or {}).get("cpu_model")))
    return out


def all_identical(identical) -> bool:
    """"k/n" identical outputs (or a bool, or None when not recorded): were all n identical?"""
    if identical is None or isinstance(identical, bool):
        return identical is not False
    k, _, n = str(identical).partition("/")
    return k.strip() == n.strip()


def plot(pts: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.4))
    series = {}
    for p in pts:
        series.setdefault((p["group"], p["method"]), []).append(p)
    for (group, method), ps in sorted(series.items()):
        ps = sorted(ps, key=lambda p: p["retrieval_ms_per_query"])
        xs = [p["retrieval_ms_per_query"] for p in ps]
        hosts = sorted({str(p.get("host")) for p in ps})
        ax.plot(xs, [p["speedup"] for p in ps], "o-", label=f"{group}: {method} ({', '.join(hosts)})")
        for p in ps:
            if not all_identical(p["identical"]):
                ax.annotate("outputs differ", (p["retrieval_ms_per_query"], p["speedup"]), fontsize=7)
    ceil = sorted({(p["retrieval_ms_per_query"], p["ceiling"]) for p in pts})
    ax.plot([c[0] for c in ceil], [c[1] for c in ceil], "kx", ls="none",  # per run and group: not a curve
            label="ceiling 1 / (1 - retrieval share)")
    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("one full-index retrieval of the baseline, ms (simulated latency included)")
    ax.set_ylabel("speedup over the baseline (same tokens)")
    hosts = sorted({str(p.get("host")) for p in pts})
    where = f"measured on {', '.join(hosts)} (2 cores each)" if len(hosts) > 1 else host_line()
    ax.set_title(f"speculative retrieval: speedup vs retrieval cost\n{where}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="bench/ralmspec.py result JSON files")
    ap.add_argument("--out", default="bench/results/retrieval-curve.json")
    a = ap.parse_args(argv)
    pts = []
    for f in a.results:
        p = Path(f)
        if not p.is_file():
            sys.exit(f"error: {p} not found")
        try:
            pts += points(p)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            sys.exit(f"error: {p}: {e}")
    if not pts:
        sys.exit("error: no speculative method with a baseline in these results")
    for p in sorted(pts, key=lambda p: (p["group"], p["method"], p["retrieval_ms_per_query"])):
        print(f"{p['group']:>10} {p['method']:>10}  {p['retrieval_ms_per_query']:9.2f} ms/query  "
              f"retrieval {100 * p['baseline_retrieval_share']:5.1f}% of the baseline  "
              f"speedup {p['speedup']:.2f}x (ceiling {p['ceiling']:.2f}x)  [{p['source']}]")
    save(dict(points=pts), a.out)
    plot(pts, str(Path(a.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
