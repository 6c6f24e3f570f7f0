"""What the commands' argument parsers share (`python -m lookahead_jax.generate`,
`python -m lookahead_jax.serve`): `--help` shows every option's default, and a bad
command line is one error line and a pointer to `--help`, not the whole usage block.

    ap = Parser(prog="python -m lookahead_jax.generate", description=...)

Host only: no jax.
"""

from __future__ import annotations

import argparse


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to the help of every option that has a default (not None,
    False or empty) and whose help does not speak of its default already."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        d = action.default
        shown = d is not None and d is not False and d is not argparse.SUPPRESS and d != [] and d != ()
        if action.option_strings and shown and "default" not in text.lower():
            text += (" " if text else "") + "(default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults (`DefaultsFormatter`) and whose errors
    are two lines: "PROG: error: MESSAGE" and "see PROG --help" (exit status 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")


def parse_mesh(ap, text) -> tuple:
    """--mesh "data=2,model=4" as sorted (axis, size) pairs (() when not given); a malformed
    value or another axis name is `ap.error` (one line, exit status 2)."""
    if not text:
        return ()
    try:
        mesh = tuple(sorted((k.strip(), int(v)) for k, v in (x.split("=") for x in text.split(","))))
    except ValueError:
        ap.error(f"--mesh must look like data=2,model=4, got {text!r}")
    if not {k for k, _ in mesh} <= {"data", "model"}:
        ap.error(f"--mesh axes are 'data' and 'model', got {text!r}")
    return mesh


def add_distributed_flags(ap) -> None:
    """--coordinator-address / --num-processes / --process-id / --distributed-auto /
    --stall-timeout: one command on every host of a multi-process run (`core.multihost`,
    docs/multihost.md; the stall timeout's default is `multihost.STALL_TIMEOUT_S`, written
    out here since this module imports no jax)."""
    g = ap.add_argument_group("several processes (hosts)", "run the same command on every host, each with its "
                              "--process-id; the mesh spans every process's devices (docs/multihost.md)")
    g.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help="process 0's address, that every process connects to (jax.distributed)")
    g.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1 (0 prints the answers)")
    g.add_argument("--distributed-auto", action="store_true",
                   help="let JAX detect the processes from the platform (a TPU pod slice, SLURM, Open MPI)")
    g.add_argument("--stall-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="end every process, naming it, when one stays alive but keeps the others waiting in a "
                   "collective this long (its main thread stuck in host code); give every process the same value; "
                   "0: never (docs/multihost.md)")
