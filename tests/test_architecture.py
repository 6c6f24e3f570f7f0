"""The package's shape, checked from its source with `ast` (no imports executed):

* imports run one way: no circle between the package's modules (function-level imports
  included: a lazy import is still a dependency; so is `from . import X` / `from .. import X`
  of a name that a package's `__init__` holds: that is an import of the `__init__`);
* no module imports another module's private (`_name`) names;
* nothing imports the CLI (`lookahead_jax.cli`) but the `python -m` entry modules;
* the core (`lookahead_jax.core`) imports no plug-in (drafters, strategies, knnlm,
  retrieval): a plug-in's cache is its own store type (`core.engine.Stores`);
* `models/` and `convert/` are imported under one name only (`lookahead_jax.models`,
  `lookahead_jax.convert`), never as top-level `models` / `convert`;
* `models/` imports nothing from the package above it (the rest of `lookahead_jax`);
* the host/device split: the trie and the draft containers import no jax;
* no code tells errors apart by their text (`"..." in str(e)`): by their type;
* a request's options are checked in one place (`core.params.GenerationParams`): no other
  module words an error about one of its fields, and the server's protocol puts no range
  on them;
* package files stay readable: none over MAX_LINES lines.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lookahead_jax": ROOT / "lookahead_jax", "lookahead_jax.models": ROOT / "models",
            "lookahead_jax.convert": ROOT / "convert"}
MAX_LINES = 600
HOST_ONLY = ("lookahead_jax.drafters.ngram_trie", "lookahead_jax.drafters.ngram_counts", "lookahead_jax.drafters.suffix",
             "lookahead_jax.drafters.trie_drafts", "lookahead_jax.core.drafts", "lookahead_jax.prompts",
             "lookahead_jax.retrieval.remote", "lookahead_jax.retrieval.server", "lookahead_jax.core.params",
             "lookahead_jax.core.prefix_cache")


def _modules() -> dict:
    """{module name: (path, is package)} for every .py file of the package."""
    out = {}
    for pkg, d in PACKAGES.items():
        for p in sorted(d.rglob("*.py")):
            parts = list(p.relative_to(d).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            out[".".join([pkg] + parts)] = (p, is_pkg)
    return out


MODULES = _modules()


@functools.lru_cache(maxsize=None)
def _parsed(path: Path):
    return ast.parse(path.read_text(), str(path))


def _imports(name: str):
    """(target module, imported names, line) for every import in module `name`, relative
    imports resolved; `from pkg import sub` names the submodule when it is one."""
    path, is_pkg = MODULES[name]
    tree = _parsed(path)
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = base[:len(base) - node.level + 1]
                target = ".".join(up + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if subs:
                for s in subs:
                    yield s, [], node.lineno
                rest = [n for n in names if f"{target}.{n}" not in MODULES]
                if rest:
                    yield target, rest, node.lineno
            else:
                yield target, names, node.lineno


def _graph() -> dict:
    return {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def _parents(m: str) -> set:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first: those are edges too."""
    parts = m.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))} & set(MODULES)


def test_no_import_circles():
    graph = _graph()
    # strongly connected components (Tarjan), over imports and their parent packages'
    # __init__ (a package importing its own submodules is how packages work: the __init__
    # of a module's own packages, run before it, is not counted as a parent of what it
    # imports). An import that names a package's __init__ itself counts, the module's own
    # package included: `from . import X` (X not a submodule: `_imports` resolves it to the
    # package) in a submodule that the __init__ imports is a circle, lazy or not.
    edges = {m: {t for t in deps if t != m}
             | {t for t in set().union(*(_parents(d) for d in deps)) if not m.startswith(t + ".")}
             for m, deps in graph.items()}
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_private_name_imports():
    bad = [f"{m}:{line} imports {t}.{n}" for m in MODULES for t, names, line in _imports(m)
           for n in names if n.startswith("_") and not n.startswith("__") and t.startswith("lookahead_jax")]
    assert not bad, "\n".join(bad)


PLUGINS = ("lookahead_jax.drafters", "lookahead_jax.strategies", "lookahead_jax.knnlm", "lookahead_jax.retrieval")


def test_core_imports_no_plugin():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith("lookahead_jax.core")
           for t, _, line in _imports(m) if any(t == p or t.startswith(p + ".") for p in PLUGINS)]
    assert not bad, "the core imports plug-ins:\n" + "\n".join(bad)


def test_nothing_imports_the_cli():
    entry = ("__main__",)
    bad = [f"{m}:{line}" for m in MODULES for t, _, line in _imports(m)
           if t == "lookahead_jax.cli" and m.rsplit(".", 1)[-1] not in entry]
    assert not bad, f"modules importing the CLI: {bad}"


def test_models_and_convert_have_one_import_name():
    files = [p for p, _ in MODULES.values()] + sorted((ROOT / "tests").glob("*.py")) + sorted(
        (ROOT / "bench").glob("*.py"))
    bad = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{p.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in ("models", "convert")]
    assert not bad, "import lookahead_jax.models / lookahead_jax.convert instead:\n" + "\n".join(bad)


def test_models_import_nothing_from_the_package_above():
    """`models/` (installed as lookahead_jax.models) stands on its own: no module of it
    imports a lookahead_jax module outside it (convert/ and the package build on models,
    never the other way)."""
    models = ["lookahead_jax", "models"]
    bad = [f"{m}:{line} imports {t}" for m in MODULES if m.split(".")[:2] == models
           for t, _, line in _imports(m) if t.split(".")[0] == "lookahead_jax" and t.split(".")[:2] != models]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", HOST_ONLY)
def test_host_modules_import_no_jax(name):
    graph = _graph()
    seen, todo = set(), [name]
    while todo:  # everything it imports, transitively, inside the package
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += graph[m]
    jax_users = [f"{m} imports {t}" for m in seen for t, _, _ in _imports(m) if t.split(".")[0] in ("jax", "flax")]
    assert not jax_users, jax_users


def _mentions(node, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def test_nothing_matches_error_text():
    """Inside `except ... as e:`, no test of e's text (`"x" in str(e)`, `str(e).startswith`,
    `== str(e)`): an error another part must tell apart is a type of its own (e.g.
    `core.slots.NeedsOwnSlots`), so rewording a message never changes behaviour."""
    bad = []
    for m, (p, _) in MODULES.items():
        for handler in ast.walk(ast.parse(p.read_text(), str(p))):
            if not isinstance(handler, ast.ExceptHandler) or not handler.name:
                continue
            for node in (n for stmt in handler.body for n in ast.walk(stmt)):
                text = isinstance(node, ast.Compare) and _mentions(node, handler.name) and any(
                    isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq)) for op in node.ops)
                prefix = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                          and node.func.attr in ("startswith", "endswith") and _mentions(node.func.value, handler.name))
                if text or prefix:
                    bad.append(f"{m}:{node.lineno}")
    assert not bad, "errors told apart by their text: " + ", ".join(bad)


def test_files_stay_short():
    long = {m: n for m, (p, _) in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_every_package_import_resolves():
    """Every import of a lookahead_jax module (lazy ones inside functions included) names a
    module that exists: a relative import left behind by a move fails here, not at the
    first call that reaches it."""
    bad = [f"{m}:{line} imports {t}" for m in MODULES for t, _, line in _imports(m)
           if t.startswith("lookahead_jax") and t not in MODULES]
    assert not bad, "\n".join(bad)


def _option_spellings() -> list:
    """Every name a request option goes by: `GenerationParams`' fields, their CLI flags
    and the OpenAI fields the server maps onto them (read from the source, not imported)."""
    tree = ast.parse((PACKAGES["lookahead_jax"] / "core" / "params.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerationParams")
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert "max_new_tokens" in fields and "temperature" in fields, fields
    return [f for f in fields if f != "n"] + ["--" + f.replace("_", "-") for f in fields] + [
        "max_tokens", "max_completion_tokens", "min_tokens"]  # (a bare "n" names other things too)


# modules whose field of the same name is not a request's option
OTHER_MEANING = {"lookahead_jax.knnlm.build": "max_tokens (the datastore's token budget)"}


def _docstrings(tree) -> set:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_request_options_are_checked_in_one_place():
    """No module but `core/params.py` words an error about a request option (a string
    such as "max_new_tokens must ..." or "--top-p must ..."), and the server's pydantic
    protocol declares their types only (no ge / le / gt / lt on them): a second check of
    the same field could drift from the first."""
    import re

    names = _option_spellings()
    pattern = re.compile(r"(^|[\s`'\"(])(" + "|".join(map(re.escape, names)) + r")(`|'|\")? must\b")
    bad = []
    for m, (p, _) in MODULES.items():
        if m == "lookahead_jax.core.params" or m in OTHER_MEANING:
            continue
        tree = ast.parse(p.read_text(), str(p))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and pattern.search(node.value):
                bad.append(f"{m}:{node.lineno}: {node.value.strip()[:80]!r}")
    assert not bad, "request options checked outside core/params.py:\n" + "\n".join(bad)
    tree = ast.parse((PACKAGES["lookahead_jax"] / "serve" / "protocol.py").read_text())
    ranged = [f"protocol.py:{n.lineno}: {n.target.id}" for n in ast.walk(tree)
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id in names
              and isinstance(n.value, ast.Call) and any(k.arg in ("ge", "gt", "le", "lt") for k in n.value.keywords)]
    assert not ranged, f"the protocol puts ranges on request options: {ranged}"
