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
