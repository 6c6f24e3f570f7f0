"""Interleaved A/B of two revisions' decode loops, in one process.

    python bench/ab_loop.py                          # 8315dd5 (before the layout / slot API) vs the working tree
    python bench/ab_loop.py --new-rev HEAD           # vs the last commit, exported the same way
    python bench/ab_loop.py --smoke                  # 1 prompt, 16 tokens, saved under /tmp

The old revision (`--old-rev`, a git commit) is exported with `git archive` into a
temporary folder as a package of another name, `lookahead_jax_old` (its `models/` and
`convert/` inside it, as pyproject maps them; the package's absolute `lookahead_jax`
imports are rewritten to the new name), so both import side by side. The new side is the
installed `lookahead_jax` (the working tree), or `--new-rev` exported as
`lookahead_jax_new`. Both call the same CPU kernels: the kernel library is registered
once, by the new side, and the old copy's `models.cpu_kernels` reuses that registration
(`--kernels share`, the default, when both copies' `cpu_kernels.cc` are identical or the
new one has every kernel the old one calls; see `kernel_setup`).

Each side loads the model once (`--model`, f32) and is warmed up (compiled, and auto
calibrated) on each dataset's first prompt, untimed. Then, for every prompt and strategy
(greedy, and lookahead at each `--configs` decoding_length:branch_length), the two sides
run in ABBA order (A = old on even prompts, new on odd ones), each with a fresh trie
drafter (cold, with the prompt's references: every run of a prompt starts from the same
drafter state, so repeats do not draft from their own earlier output). Generation stops
at EOS. Every run's tokens are checked: new == old, and lookahead == greedy. By default
(`--calibration shared`) `auto` on both sides reads one verify-cost table, measured once,
and one table of real step times (the online correction of those costs): calibrating and
correcting each side separately (`own`) makes the two budgets pick different trees from
noise in two measurements, which is not a difference between the loops.

Reported per strategy: total wall time (generate's `wall_s`: compilation and calibration
excluded) and tokens/s of each side, the ratio new/old of tokens/s (> 1: the new loop is
faster), and the per-prompt ratios' median and interquartile range. Prints a table, saves
JSON (with the command, the revisions and the host) to bench/results/ab-loop.json.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, dataset_prompts, host_line, save  # noqa: E402

# `from lookahead_jax...` / `import lookahead_jax...` at the start of a line (code or a
# docstring example: both harmless to rename)
IMPORT_RE = re.compile(r"^(\s*(?:from|import)\s+)lookahead_jax(?=[\s.,;]|$)", re.M)


def git(*args) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def export(rev: str, name: str, dest: Path) -> dict:
    """`git archive rev lookahead_jax models convert` into dest/name as package `name`:
    models/ and convert/ become its subpackages, absolute `lookahead_jax` imports become
    `name`. Returns what was done (commit, rewritten files)."""
    sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    src = dest / f"src-{name}"
    src.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", sha, "lookahead_jax", "models", "convert"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True)
    pkg = dest / name
    shutil.move(str(src / "lookahead_jax"), str(pkg))
    for sub in ("models", "convert"):
        if (src / sub).is_dir() and not (pkg / sub).exists():
            shutil.move(str(src / sub), str(pkg / sub))
    shutil.rmtree(src)
    rewritten = []
    for f in sorted(pkg.rglob("*.py")):
        text = f.read_text()
        new = IMPORT_RE.sub(lambda m: m.group(1) + name, text)
        if new != text:
            f.write_text(new)
            rewritten.append(str(f.relative_to(pkg)))
        # absolute names the rewrite cannot see: the copy would import the other package
        if re.search(r"""import_module\(\s*['"]lookahead_jax[.'"]""", new):
            raise SystemExit(f"{rev}:{f.relative_to(pkg)} imports lookahead_jax by a string; "
                             "extend export() to rename it")
    if str(dest) not in sys.path:
        sys.path.insert(0, str(dest))
    return dict(rev=rev, commit=sha, package=name, rewritten_imports=rewritten)


def working_tree() -> dict:
    dirty = git("status", "--porcelain", "--", "lookahead_jax", "models", "convert")
    return dict(rev="working tree", package="lookahead_jax", head=git("rev-parse", "HEAD"),
                uncommitted_files=len(dirty.splitlines()))


def kernel_setup(old, new, mode: str) -> dict:
    """Make both packages call the same registered CPU kernels.

    jax.ffi.register_ffi_target registers by name, process-wide; the two copies build the
    library from their own cpu_kernels.cc (cached .so per source and key) and register the
    same target names. 'share': register the new side's, then point the old module's
    `_state` (its record of the registration) at the new one's, so the old copy never
    registers and its ffi_calls resolve to the same handlers; only when the two .cc files
    are identical, or when they differ but the new library has every handler the old side
calls: then both sides run the new kernels (the A/B compares loops, not kernels).
    'separate': each side registers its own. With jax 0.10.2 on CPU the second registration
    of the same names (another .so: the revisions' kernel cache keys differ) raised no
    error, so both sides report kernels on, but which library's function then serves a name
    is XLA's registry's choice, not visible from here: hence 'share' by default. Should a
    registration be refused, the old side runs XLA's dot, and `old_error` says so."""
    info = dict(mode=mode)
    try:
        ck_new = importlib.import_module(new.__name__ + ".models.cpu_kernels")
        ck_old = importlib.import_module(old.__name__ + ".models.cpu_kernels")
    except ImportError as e:
        info["error"] = f"no models.cpu_kernels: {e}"
        return info
    info["new_vector_width"] = ck_new.vector_width()
    info["same_source"] = Path(ck_old.SOURCE).read_bytes() == Path(ck_new.SOURCE).read_bytes()
    if mode == "share":
        if not info["same_source"]:
            # both sides run the new kernels: right for comparing loops, as long as every
            # kernel the old side calls exists in the new library under the same name
            handlers = lambda path: set(re.findall(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\((\w+)", Path(path).read_text()))  # noqa: E731
            missing = handlers(ck_old.SOURCE) - handlers(ck_new.SOURCE)
            if missing:
                raise SystemExit(f"the new cpu_kernels.cc lacks the old side's kernels {sorted(missing)}; "
                                 "use --kernels separate")
            info["note"] = "sources differ: both sides run the new side's kernels (a superset of the old's names)"
            print("kernels: the revisions' cpu_kernels.cc differ; both sides run the new ones", flush=True)
        if not hasattr(ck_old, "_state") or not hasattr(ck_new, "_state"):
            raise SystemExit("a cpu_kernels module has no _state to share; use --kernels separate")
        ck_old._state = ck_new._state  # the old module's functions read the global at call time
    info["old_vector_width"] = ck_old.vector_width()
    for side, ck in (("new", ck_new), ("old", ck_old)):
        if getattr(ck, "_state", {}).get("error"):
            info[f"{side}_error"] = ck._state["error"]
    return info


def module(pkg, *names):
    """The first of pkg.<name> that imports: a module moved between the revisions (e.g.
    `engine` -> `core.engine`, `generate.encode_prompts` -> `prompts`)."""
    for name in names:
        try:
            return importlib.import_module(f"{pkg.__name__}.{name}")
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"{pkg.__name__} has none of the modules {names}")


def share_costs(pkgs, models) -> dict:
    """Give both sides' auto budget the same verify costs: measured once by the new side's
    engine (S = 512, length 256, every bucket), then each side's measuring function is
    replaced by one that returns that table (the new side's `Engine.measure_verify_costs`,
    the old revision's `generate.measure_verify_costs`). Real step times still correct it
    on each side, as in normal use."""
    new, old = pkgs["new"], pkgs["old"]
    engine_mod = module(new, "core.engine", "engine")
    acc = module(new, "core.acceptance", "acceptance")
    sampling = module(new, "core.sampling", "sampling")
    tree = module(new, "core.tree", "tree")
    buckets = tuple(b for b in tree.BUCKETS if b <= 64)
    engine = engine_mod.engine_for(models["new"])
    table = engine.measure_verify_costs(acc.TokenMatch(sampling.SamplingParams()), 1, 512, buckets, 256)

    engine_mod.Engine.measure_verify_costs = lambda self, rule, B, S, bk, *r, **k: {T: table[T] for T in bk}
    old_engine = module(old, "core.engine", "engine", "generate")
    if hasattr(old_engine, "Engine"):  # revisions with an Engine (measure_verify_costs a method)
        old_engine.Engine.measure_verify_costs = lambda self, rule, B, S, bk, *r, **k: {T: table[T] for T in bk}
    elif hasattr(old_engine, "measure_verify_costs"):  # the oldest: a function of generate
        old_engine.measure_verify_costs = lambda model, verify, B, S, bk, *r, **k: {T: table[T] for T in bk}
    else:
        raise SystemExit("the old revision has no measure_verify_costs to share; use --calibration own")

    # one table of observed step times too: each side's online correction (StepTimes)
    # otherwise drifts apart on noise (a slow spell during one side's run) and the two
    # budgets pick different trees for the same drafts
    times = SharedStepTimes()
    engine.step_times = times
    if hasattr(old_engine, "engine_for"):
        old_engine.engine_for(models["old"]).step_times = times
    else:
        models["old"].__dict__["_step_times"] = times
    return dict(cost_ms={T: round(c * 1e3, 3) for T, c in table.items()}, step_times="shared")


class SharedStepTimes(dict):
    """The sides key their step-time tables (verify rule or function, B, S); the rule
    objects differ between the packages, so key by (B, S) only: one StepTimes per shape,
    whichever side makes it first (the classes have the same interface)."""

    def setdefault(self, key, default=None):
        return super().setdefault(tuple(key[1:]), default)

    def __getitem__(self, key):
        return super().__getitem__(tuple(key[1:]))


def quartiles(xs):
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-rev", default="8315dd5",
                    help="git revision of the old side (default: before the layout / slot API change)")
    ap.add_argument("--new-rev", help="git revision of the new side (default: the installed working tree)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--datasets", nargs="+", default=["nq", "humaneval", "gsm8k"])
    ap.add_argument("--n", type=int, default=8, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="at most; generation stops at EOS")
    ap.add_argument("--configs", nargs="+", default=["auto:12", "7:12"],
                    help="lookahead decoding_length:branch_length ('auto' = the default budget)")
    ap.add_argument("--mode", default="hierarchical")
    ap.add_argument("--kernels", choices=("share", "separate"), default="share",
                    help="share: both sides call the kernels registered by the new side (default)")
    ap.add_argument("--calibration", choices=("shared", "own"), default="shared",
                    help="shared (default): both sides' auto budget gets one verify-cost table, measured once "
                         "by the new side (S=512, length 256), so the A/B compares the loops and not two "
                         "noisy calibrations (that pick different trees); own: each side calibrates as usual")
    ap.add_argument("--smoke", action="store_true", help="1 prompt of the first dataset, 16 tokens, saved under /tmp")
    ap.add_argument("--out", help="default bench/results/ab-loop.json (--smoke: <tmp>/ab-loop-smoke.json)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.datasets, a.n, a.max_new_tokens = a.datasets[:1], 1, 16
    a.out = a.out or (str(Path(tempfile.gettempdir()) / "ab-loop-smoke.json") if a.smoke
                      else str(ROOT / "bench" / "results" / "ab-loop.json"))

    tmp = tempfile.TemporaryDirectory(prefix="ab_loop_")
    dest = Path(tmp.name)
    revs = dict(old=export(a.old_rev, "lookahead_jax_old", dest))
    if a.new_rev:
        revs["new"] = export(a.new_rev, "lookahead_jax_new", dest)
    else:
        revs["new"] = working_tree()
    try:
        pkgs = {side: importlib.import_module(revs[side]["package"]) for side in ("new", "old")}
    except Exception as e:
        raise SystemExit(f"importing a side failed ({type(e).__name__}: {e}); if the working tree is "
                         "mid-edit, retry later or pass --new-rev HEAD") from e
    for side in ("old", "new"):
        print(f"{side}: {revs[side]['rev']} ({revs[side].get('commit', revs[side].get('head'))}) "
              f"as {pkgs[side].__name__} from {Path(pkgs[side].__file__).parent}", flush=True)
    kernels = kernel_setup(pkgs["old"], pkgs["new"], a.kernels)
    print(f"kernels: {kernels}", flush=True)
    print(host_line(), flush=True)

    models, toks, gens, encs, drafters = {}, {}, {}, {}, {}
    for side, pkg in pkgs.items():
        models[side], toks[side] = pkg.load(a.model, dtype=a.dtype)
        gens[side] = pkg.generate  # the public function (the callable module in old revisions)
        encs[side] = module(pkg, "prompts", "generate").encode_prompts
        drafters[side] = importlib.import_module(pkg.__name__ + ".drafters.trie").TrieDrafter

    calibration = dict(mode=a.calibration)
    if a.calibration == "shared":
        calibration.update(share_costs(pkgs, models))
        print(f"calibration: one table for both sides {calibration['cost_ms']}", flush=True)

    strategies = {"greedy": None}
    for c in a.configs:
        dl, bl = (c.split(":") + ["12"])[:2]
        strategies[f"lookahead[{dl}:{bl}]"] = dict(decoding_length=dl if dl == "auto" else int(dl),
                                                   branch_length=int(bl))

    def run(side, name, x, refs, max_new):
        cfg = strategies[name]
        kw = dict(max_new_tokens=max_new)
        if cfg is not None:
            kw.update(strategy="lookahead", references=[refs], mode=a.mode, **cfg,
                      drafter=drafters[side](cfg["branch_length"], a.mode))  # fresh: same state every run
        out = gens[side](models[side], toks[side], [x], **kw)
        return out.rows[0].token_ids, out.stats

    names = list(strategies)
    acc = {n: {s: dict(wall=0.0, tokens=0, steps=0, runs=0, compile=0.0) for s in ("old", "new")} for n in names}
    per_prompt = {n: [] for n in names}
    mismatches = {n: 0 for n in names}
    lossless = {n: 0 for n in names}  # lookahead tokens == greedy tokens (new side)
    runs_total = 0
    for ds in a.datasets:
        prompts, refs = dataset_prompts(ds, a.n)
        ids = {side: encs[side](toks[side], prompts, chat=False) for side in pkgs}
        if ids["old"] != ids["new"]:
            raise SystemExit(f"[{ds}] the two sides tokenize the prompts differently")
        ids = ids["new"]
        for side in ("old", "new"):  # warm-up: compile (and calibrate auto) on the first prompt
            for name in names:
                run(side, name, ids[0], refs[0], a.max_new_tokens)
        for i, x in enumerate(ids):
            order = ["old", "new", "new", "old"] if i % 2 == 0 else ["new", "old", "old", "new"]
            line = f"[{ds} {i}]"
            greedy_ids = None
            for name in names:
                walls = {"old": 0.0, "new": 0.0}
                first = None
                for side in order:
                    t, s = run(side, name, x, refs[i], a.max_new_tokens)
                    runs_total += 1
                    if first is None:
                        first = t
                    elif t != first:
                        mismatches[name] += 1
                    walls[side] += s["wall_s"]
                    r = acc[name][side]
                    r["wall"] += s["wall_s"]
                    r["tokens"] += s["new_tokens"]
                    r["steps"] += s["forward_steps"]
                    r["compile"] += s.get("compile_s", 0.0)
                    r["runs"] += 1
                if name == "greedy":
                    greedy_ids = first
                lossless[name] += first == greedy_ids
                ratio = walls["old"] / walls["new"]  # same tokens: tokens/s new / tokens/s old
                per_prompt[name].append(round(ratio, 4))
                line += f" {name}: {len(first)} tok, new/old {ratio:.3f}x"
            print(line, flush=True)

    summary = {}
    print(f"\n{'strategy':<20} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} "
          f"{'per-prompt median [IQR]':>26} {'identical':>10} {'acc/step':>9}")
    for name in names:
        o, nw = acc[name]["old"], acc[name]["new"]
        tps_o, tps_n = o["tokens"] / o["wall"], nw["tokens"] / nw["wall"]
        q1, med, q3 = quartiles(per_prompt[name])
        n_runs = o["runs"] + nw["runs"]
        n_prompts = len(per_prompt[name])
        summary[name] = dict(
            old=dict(wall_s=round(o["wall"], 4), tokens=o["tokens"], tokens_per_s=round(tps_o, 3),
                     forward_steps=o["steps"], compile_s_after_warmup=round(o["compile"], 3)),
            new=dict(wall_s=round(nw["wall"], 4), tokens=nw["tokens"], tokens_per_s=round(tps_n, 3),
                     forward_steps=nw["steps"], compile_s_after_warmup=round(nw["compile"], 3)),
            ratio_new_over_old=round(tps_n / tps_o, 4),
            per_prompt_ratio=dict(median=round(med, 4), q1=round(q1, 4), q3=round(q3, 4),
                                  min=min(per_prompt[name]), max=max(per_prompt[name]), values=per_prompt[name]),
            runs=n_runs, token_mismatches=mismatches[name],
            identical_to_greedy=f"{lossless[name]}/{n_prompts}",
        )
        acc_step = nw["tokens"] / max(nw["steps"], 1)
        print(f"{name:<20} {tps_o:>10.2f} {tps_n:>10.2f} {tps_n / tps_o:>7.3f}x "
              f"{f'{med:.3f}x [{q1:.3f}, {q3:.3f}]':>26} "
              f"{f'{n_runs - mismatches[name] - n_prompts}/{n_runs - n_prompts}':>10} {acc_step:>9.2f}")
    bad = {n: m for n, m in mismatches.items() if m}
    print("tokens: new == old in every run" if not bad else f"TOKEN MISMATCHES (runs differing from the "
          f"prompt's first run): {bad}")
    result = dict(revisions=revs, model=a.model, dtype=a.dtype, datasets=a.datasets, prompts_per_dataset=a.n,
                  max_new_tokens=a.max_new_tokens, stop_at_eos=True, smoke=a.smoke, order="ABBA per prompt and "
                  "strategy (old first on even prompts)", drafter="fresh TrieDrafter per run (cold trie)",
                  kernels=kernels, calibration=calibration, strategies=summary)
    save(result, a.out)
    tmp.cleanup()
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
