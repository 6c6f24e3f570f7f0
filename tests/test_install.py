"""The README's command 2 installs no CUDA package on a CPU machine (issue 56).

PyPI's torch for Linux x86-64 is the CUDA build: it requires nvidia-* libraries, triton and
cuda-toolkit, gigabytes. The CPU build (`2.13.0+cpu`) is on PyTorch's own index only. So
command 2 first installs torch from https://download.pytorch.org/whl/cpu, then the test
extras, whose requirements on torch (the extras' pin; accelerate, guidellm,
sentence-transformers) that CPU build meets: pip keeps it.

* quick: command 2 has that shape, and its torch pin is every extra's pin.
* slow, needs PyPI: pip's resolver (`pip install --dry-run --ignore-installed --report`)
  resolves command 2's extras together with the CPU torch against PyPI alone: this
  machine's pip configuration (a find-links folder of local wheels, file:// indexes, a
  constraints file) is out of the way (PIP_CONFIG_FILE=os.devnull, no PIP_* variables but
  the certificate). The report must hold torch `X+cpu` and no nvidia-*, cuda-* or triton.
  The CPU torch comes from PyTorch's index (`--find-links` on its torch page) where that
  host answers; where it does not, from a local copy of the same wheel found in pip's
  configured find-links (a folder holding only that file; a warning says so); neither, or
  no PyPI: skip, with the reason. 190 packages: 3.7 min on this shared 2-core machine
  (1.4 min of CPU: PyPI's pages, three sdists' metadata builds for lm-eval's requirements),
  6 min beside another test process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")


def command_2() -> list[list[str]]:
    """The README's command 2 (the first bash block's line that runs pytest), as argvs."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^```bash\n(.*?)^```", text, re.M | re.S).group(1)
    line = next(ln for ln in block.splitlines() if "python -m pytest" in ln and not ln.startswith("#"))
    return [shlex.split(c) for c in line.split(" && ")]


def extras_pins() -> dict[str, str]:
    """extra -> its torch requirement, for the extras that name torch."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {name: r for name, reqs in extras.items() for r in reqs if re.match(r"torch\b", r)}


def torch_step() -> tuple[str, list[str]]:
    """(torch's version in command 2's CPU torch step, the extras its editable install names)."""
    steps = command_2()
    torch_i = next(i for i, a in enumerate(steps) if a[:2] == ["pip", "install"]
                   and any(x.startswith("torch==") for x in a))
    extras_i = next(i for i, a in enumerate(steps) if a[:2] == ["pip", "install"] and "-e" in a)
    assert torch_i < extras_i, "the CPU torch goes in before the extras, which would pull PyPI's"
    argv = steps[torch_i]
    assert argv[argv.index("--index-url") + 1] == CPU_INDEX, argv
    version = next(x for x in argv if x.startswith("torch==")).removeprefix("torch==")
    target = steps[extras_i][steps[extras_i].index("-e") + 1]
    return version, re.fullmatch(r"\.\[(.*)\]", target).group(1).split(",")


def test_command_2_installs_the_cpu_torch_first_with_the_extras_pin():
    version, extras = torch_step()
    assert extras == ["test", "clients"]
    pins = extras_pins()
    assert set(pins) >= {"test", "bench", "clients"}, pins
    assert set(pins.values()) == {f"torch=={version}"}, (version, pins)


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=15) as r:
            return r.status == 200
    except OSError:
        return False


def _local_cpu_wheel(version: str) -> Path | None:
    """torch-{version}+cpu for this Python in a find-links folder of pip's configuration."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    folders = re.findall(r"find-links='([^']*)'", out) + [os.environ.get("PIP_FIND_LINKS", "")]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in (f for fs in folders for f in fs.split()):
        for whl in sorted(Path(folder).glob(f"torch-{version}+cpu-{tag}-*.whl")) if Path(folder).is_dir() else ():
            return whl
    return None


@pytest.mark.slow
def test_command_2_resolves_no_cuda_package(tmp_path):
    if not _reachable("https://pypi.org/simple/pip/"):
        pytest.skip("pypi.org unreachable: command 2's resolution against PyPI is not checked")
    version, extras = torch_step()
    if _reachable(f"{CPU_INDEX}/torch/"):
        cpu_torch = f"{CPU_INDEX}/torch/"
    else:
        whl = _local_cpu_wheel(version)
        if whl is None:
            pytest.skip(f"{CPU_INDEX} unreachable and no local torch-{version}+cpu wheel in pip's find-links")
        cpu_torch = tmp_path / "cpu-torch"
        cpu_torch.mkdir()
        (cpu_torch / whl.name).symlink_to(whl)
        warnings.warn(f"{CPU_INDEX} unreachable: its torch {version}+cpu taken from {whl}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    report = tmp_path / "report.json"
    p = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
         "--report", str(report), "--index-url", "https://pypi.org/simple", "--find-links", str(cpu_torch),
         "-e", f"{ROOT}[{','.join(extras)}]", f"torch=={version}+cpu"],
        env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    got = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
           for i in json.loads(report.read_text())["install"]}
    assert got.get("torch") == f"{version}+cpu", got.get("torch")
    assert {"guidellm", "lm-eval", "sentence-transformers", "accelerate"} <= set(got), sorted(got)
    assert not sorted(n for n in got if CUDA.match(n)), sorted(n for n in got if CUDA.match(n))
