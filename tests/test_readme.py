"""README.md's commands, run, so that the README cannot rot.

The README's ```bash blocks are parsed (backslash continuations joined, `&&` chains split):

* the first block holds the two commands of a fresh machine (install + generate, install +
  the test suite). CI runs those (`.ci/run`); here they must equal `.ci/run`'s, verbatim.
* every other `python -m lookahead_jax...` command is parsed by its own command line here
  (fast: a renamed flag or a missing data file fails the default run), and run in a
  subprocess, block by block, in the README's order, with small settings (`slow`: CI):
  `--max-new-tokens 4`, the first 2 prompts of a `--prompts-file`, `--max-passages 2`, and
  the Qwen presets replaced by the default SmolLM2-135M (target and draft alike: CI does not
  install the Qwen packages). Every generate command gets `--json`, so that the outputs the
  README calls equal (greedy / lookahead, ralm / ralmspec, knnlm / speculative knnlm) are
  compared token for token. No command may print a warning (`warning:`, any case: ours, or a
  library's `...Warning:`): the README's commands run clean as written.
* the ```python block (the API) runs in a subprocess with `max_new_tokens=4`;
* the server command runs (`--max-batch 2`, a free port, no warm-up) and its ```sh curl
  example and ```py `openai` client example are sent to it; SIGINT stops it.
* the inline commands (in the text, not a block: the retrieval server and the
  `--retriever remote:...` that reaches it) run too: the ralm command of its block, with the
  remote retriever, gives the local index's answer.

The subprocesses see a fresh LOOKAHEAD_JAX_CACHE whose entries link to the real cache (the
converted model, GGUF files, kernels, compiled steps: nothing is downloaded or converted
again) except `retrieval/` and `knnlm/`, so the index and datastore builds really run, into
a temporary directory. On this 2-core CPU, shared, the slow part took 15 min (4 min of CPU).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEFAULT_MODEL = "smollm2-135m"
# heavy_memory: the README's commands run as subprocesses (a server and its clients, a
# retrieval server, generate with a draft model) beside this worker: with a notebook's
# kernel beside them the suite passed 8 GB (7.95 GiB), so the two never run together
pytestmark = pytest.mark.heavy_memory
FRESH = ("retrieval", "knnlm")  # cache entries the subprocesses build themselves
SKIPPED = ("pip install ", "python3.11 -m venv ", ". .venv/bin/activate")  # setup: CI does it


def blocks(lang: str) -> list[str]:
    """The README's ```lang blocks, dedented, in order."""
    pat = re.compile(rf"^([ \t]*)```{lang}\n(.*?)^\1```", re.M | re.S)
    return [textwrap.dedent(m.group(2)) for m in pat.finditer(README.read_text())]


def commands(block: str) -> list[str]:
    """The commands of a bash block: comments dropped, `\\` continuations joined, `&&` split."""
    text = re.sub(r"\\\n\s*", " ", block)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [c.strip() for ln in lines for c in ln.split(" && ")]


def ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [ln for ln in lines if ln.startswith(("pip ", "python "))]


def is_ours(argv: list[str]) -> bool:
    return argv[:2] == ["python", "-m"] and len(argv) > 2 and argv[2].startswith("lookahead_jax")


def run_blocks() -> list[list[list[str]]]:
    """The bash blocks after the first, as argv lists of their lookahead_jax commands."""
    out = []
    for block in blocks("bash")[1:]:
        argvs = [shlex.split(c) for c in commands(block) if not c.startswith(SKIPPED)]
        if argvs:
            out.append(argvs)
    return out


def block_id(argvs: list[list[str]]) -> str:
    names = [a[a.index("--strategy") + 1] if "--strategy" in a else "greedy"
             for a in argvs if a[2] == "lookahead_jax.generate"]
    return "+".join(dict.fromkeys(names))


BLOCKS = run_blocks()


# ----------------------------------------------------------------------------- fast checks
def test_top_commands_are_ci():
    """The first bash block is the README's first content and holds exactly `.ci/run`'s two
    commands (install + fetch + generate; install the test extras + the whole suite)."""
    text = README.read_text()
    assert text.index("```bash") < text.index("\n## ")
    top = [ln for ln in blocks("bash")[0].splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(top) == 2 and top == ci_commands(), (top, ci_commands())
    assert top[0].startswith("pip install -q -e . && python -m lookahead_jax.fetch smollm2-135m && ")
    assert "python -m pytest" in top[1]


def test_commands_are_known():
    unknown = [shlex.join(a) for argvs in BLOCKS for a in argvs if not is_ours(a)]
    assert not unknown, f"README commands of an unknown kind (teach tests/test_readme.py to run them): {unknown}"


def test_every_strategy_has_a_command():
    from lookahead_jax.strategies import REGISTRY

    shown = {s for argvs in BLOCKS for s in block_id(argvs).split("+")}
    assert shown >= set(REGISTRY), f"strategies without a README command: {set(REGISTRY) - shown}"


def test_commands_parse():
    """Each command is accepted by its own parser (flags, choices, prompt files), and the
    builds come before the commands that need them."""
    from lookahead_jax import cli, presets
    from lookahead_jax.knnlm.cli import _parser as knn_parser
    from lookahead_jax.retrieval.cli import _parser as ret_parser

    built = set()
    for argvs in BLOCKS:
        for argv in argvs:
            module, args = argv[2], argv[3:]
            if module == "lookahead_jax.fetch":
                assert len(args) == 1 and args[0] in presets.PRESETS, argv
            elif module == "lookahead_jax.retrieval":
                a = ret_parser().parse_args(args)
                assert (ROOT / a.corpus).exists(), argv
                built.add(("retrieval", a.retriever, a.corpus))
            elif module == "lookahead_jax.knnlm":
                a = knn_parser().parse_args(args)
                assert (ROOT / a.corpus).exists() and a.max_passages, argv  # never a whole-corpus build
                built.add(("knnlm", a.model, a.corpus))
            elif module == "lookahead_jax.serve":
                from lookahead_jax.serve.__main__ import parse as serve_parse

                cfg = serve_parse(args)
                assert cfg.model in presets.PRESETS, argv
            else:
                assert module == "lookahead_jax.generate", argv
                cwd = os.getcwd()
                try:
                    os.chdir(ROOT)  # prompt files are relative to the repository
                    cfg = cli.parse_args(args)
                finally:
                    os.chdir(cwd)
                opts = dict(cfg.options)
                if cfg.strategy in ("ralm", "ralmspec"):
                    assert ("retrieval", opts["retriever"], opts["corpus"]) in built, argv
                if cfg.strategy == "knnlm":
                    assert ("knnlm", cfg.model, opts["corpus"]) in built, argv


def test_quick_run_names_what_it_deselected():
    """The quick run's (-m 'not slow') closing line counts the slow tests it left out by kind
    (tests/conftest.py; under xdist the workers hand their ids to the controller)."""
    from conftest import slow_deselected_line

    ids = [f"tests/test_readme.py::test_{i}" for i in range(8)] + ["tests/test_lossless.py::test_x[a]"]
    assert slow_deselected_line(ids) == (
        "9 tests deselected as slow: 8 run the README's commands (tests/test_readme.py), 1 larger grids "
        "and real-model runs elsewhere; run them with -m slow, or everything with -m 'slow or not slow' "
        "(as CI does)")
    assert slow_deselected_line([]) == ""


def test_python_block_compiles():
    (code,) = blocks("python")
    compile(code, "README.md", "exec")


# ----------------------------------------------------------------------------- running them
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Environment of the subprocesses: a temporary cache linking to the real one's model,
    GGUF, kernels and compiled steps, with empty retrieval/ and knnlm/."""
    from lookahead_jax.presets import cache_root

    real = cache_root()
    cache = tmp_path_factory.mktemp("cache")
    for entry in real.iterdir() if real.is_dir() else ():  # none: the first subprocess converts the model
        if entry.name not in FRESH:
            (cache / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return {**os.environ, "LOOKAHEAD_JAX_CACHE": str(cache)}


def small(argv: list[str], tmp: Path) -> list[str]:
    """The command with small settings (see the module docstring)."""
    argv = [sys.executable] + argv[1:]
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--model", "--draft-model") and argv[i + 1].startswith("qwen"):
            out += [a, DEFAULT_MODEL]  # CI has only the default model: SmolLM2 is target and draft
        elif a == "--max-new-tokens":
            out += [a, "4"]
        elif a == "--max-passages":
            out += [a, "2"]
        elif a == "--prompts-file":
            src = ROOT / argv[i + 1]
            dst = tmp / src.name
            dst.write_text("".join(src.read_text().splitlines(keepends=True)[:2]))
            out += [a, str(dst)]
        else:
            out.append(a)
            i += 1
            continue
        i += 2
    if argv[2] == "lookahead_jax.generate" and "--json" not in out:
        out.append("--json")
    return out


def run(argv: list[str], env: dict) -> str:
    """The command's stdout; it must succeed and print no warning (a README command runs clean)."""
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{shlex.join(argv)}\nexit {p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
    assert_no_warning(argv, p.stdout + p.stderr)
    return p.stdout


# what only this test's stand-ins cause (`small`: SmolLM2 as SpecInfer's target and draft
# where the README names two Qwen models), not the command as the README writes it
SUBSTITUTED = "is not smaller than the target"


def assert_no_warning(argv, output: str):
    same = "--draft-model" in argv and argv[argv.index("--draft-model") + 1] == DEFAULT_MODEL \
        and "--model" in argv and argv[argv.index("--model") + 1] == DEFAULT_MODEL
    warned = [ln for ln in output.splitlines() if "warning:" in ln.lower() and not (same and SUBSTITUTED in ln)]
    assert not warned, f"{shlex.join(argv)} warns:\n" + "\n".join(warned)


@pytest.mark.slow
@pytest.mark.parametrize("argvs", BLOCKS, ids=[block_id(b) or b[0][-1] for b in BLOCKS])
def test_readme_block_runs(argvs, env, tmp_path):
    rows = {}  # strategy (+ ":spec" for --speculative) -> token ids per answer
    for argv in argvs:
        if argv[2] == "lookahead_jax.fetch":
            continue  # only the Qwen presets are fetched in these blocks, and they are replaced
        if argv[2] == "lookahead_jax.serve":
            continue  # a server runs until stopped: tests/test_serve.py starts it and sends requests
        cmd = small(argv, tmp_path)
        stdout = run(cmd, env)
        if argv[2] != "lookahead_jax.generate":
            assert Path(stdout.strip().splitlines()[-1]).is_dir(), stdout  # the index / datastore built
            continue
        lines = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
        answers = [ln for ln in lines if "summary" not in ln]
        n_prompts = 2 if "--prompts-file" in cmd else 1
        assert len(answers) == n_prompts and lines[-1].keys() == {"summary"}, stdout
        assert all(0 < a["new_tokens"] <= 4 for a in answers), answers
        name = block_id([argv]) + (":spec" if "--speculative" in argv else "")
        rows[name] = [a["token_ids"] for a in answers]
    # what the README says is the same, is
    for a, b in (("greedy", "lookahead"), ("ralm", "ralmspec"), ("knnlm", "knnlm:spec")):
        if a in rows and b in rows:
            assert rows[a] == rows[b], (a, b, rows)


@pytest.mark.slow
def test_readme_python_block_runs(env):
    (code,) = blocks("python")
    small_code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=4", code)
    assert small_code != code
    p = subprocess.run([sys.executable, "-c", small_code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr[-4000:]}"
    assert_no_warning(["python", "-c", "<README's python block>"], p.stdout + p.stderr)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_readme_server_and_its_clients_run(env):
    """The README's server command really serves: started as written (`--max-batch 2`, a
    free port, no warm-up: small settings), its curl example (where curl exists) and its
    `openai` client example get answers; Ctrl-C (SIGINT) stops it."""
    import signal
    import time
    import urllib.request

    (argv,) = [a for argvs in BLOCKS for a in argvs if a[2] == "lookahead_jax.serve"]
    port = _free_port()
    cmd = [sys.executable] + argv[1:]
    cmd[cmd.index("--max-batch") + 1] = "2"
    cmd += ["--port", str(port), "--warmup", "none"]
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"{shlex.join(cmd)} exited {server.returncode}:\n{server.stdout.read()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the README's server did not come up in 10 min"
            time.sleep(1)
        (curl,) = [b for b in blocks("sh") if "curl " in b]
        if shutil.which("curl"):
            p = subprocess.run(["sh", "-c", curl.replace(":8000", f":{port}")], capture_output=True, text=True,
                               timeout=600)
            assert p.returncode == 0, p.stderr
            reply = json.loads(p.stdout)
            assert reply["choices"][0]["message"]["role"] == "assistant", reply
            assert reply["usage"]["completion_tokens"] > 0, reply
        (client,) = [b for b in blocks("py") if "OpenAI(" in b]
        p = subprocess.run([sys.executable, "-c", client.replace(":8000", f":{port}")], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"{p.stdout}\n{p.stderr[-4000:]}"
        assert p.stdout.strip(), "the openai example printed no answer"
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
                raise
    assert server.returncode in (0, 130, -signal.SIGINT), server.stdout.read()[-4000:]


def inline_commands() -> list[str]:
    """The README's inline commands (outside code blocks), whitespace joined: spans of
    `python -m lookahead_jax... --flags` or `--retriever remote:...` (a bare module name
    such as `python -m lookahead_jax.distill` names the tool, it is not a command)."""
    text = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    spans = [" ".join(m.group(1).split()) for m in re.finditer(r"`((?:python -m lookahead_jax|--)[^`]*)`", text)]
    return [c for c in spans if c.startswith("--retriever remote:") or (c.startswith("python -m") and " --" in c)]


def test_inline_commands_are_known():
    """Every inline command is one test_readme_remote_retriever_runs runs (teach it the others)."""
    known = ("python -m lookahead_jax.retrieval serve ", "--retriever remote:")
    assert all(c.startswith(known) for c in inline_commands()), inline_commands()


@pytest.mark.slow
def test_readme_remote_retriever_runs(env, tmp_path):
    """The README's inline retrieval server command, started as written (a free port), and
    the ralm command of its block with the inline `--retriever remote:...` in place of the
    local index: the same answer as the local index's."""
    import select
    import signal
    import time

    from lookahead_jax.retrieval.server import READY

    (serve,) = [c for c in inline_commands() if c.startswith("python -m lookahead_jax.retrieval serve ")]
    (remote,) = [c for c in inline_commands() if c.startswith("--retriever remote:")]
    (ralm,) = [a for argvs in BLOCKS for a in argvs if "--strategy" in a and a[a.index("--strategy") + 1] == "ralm"]
    serve_argv = shlex.split(serve)
    corpus = serve_argv[serve_argv.index("--corpus") + 1]
    build = [sys.executable, "-m", "lookahead_jax.retrieval", "build", "--corpus", corpus,
             "--retriever", serve_argv[serve_argv.index("--retriever") + 1]]
    run(build, env)
    local = run(small(ralm, tmp_path), env)
    host = remote.split()[1].removeprefix("remote:").rpartition(":")[0]  # the README's host, a free port
    port = str(_free_port())
    server = subprocess.Popen([sys.executable] + serve_argv[1:] + ["--port", port], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None and time.monotonic() < deadline, \
                f"{serve} did not come up: {server.stderr.read() if server.poll() is not None else 'timeout'}"
            if select.select([server.stdout], [], [], 1.0)[0] and server.stdout.readline().startswith(READY):
                break
        argv = list(ralm)
        argv[argv.index("--retriever") + 1] = f"remote:{host}:{port}"
        remote_out = run(small(argv, tmp_path), env)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()

    def answers(stdout):
        return [json.loads(ln)["token_ids"] for ln in stdout.splitlines() if ln.startswith("{") and "summary" not in ln]

    assert answers(remote_out) == answers(local) and answers(local)
