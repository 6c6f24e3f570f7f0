"""The commands' argument parsers (`lookahead_jax.argparsing`): `--help` of
`python -m lookahead_jax.generate` and `python -m lookahead_jax.serve` shows every option's
default, and a bad command line is one error line and a pointer to `--help` (exit status 2).
Host only: the parsers are built, no model is loaded."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from lookahead_jax.strategies import REGISTRY


def _parsers():
    from lookahead_jax.cli import build_parser
    from lookahead_jax.serve.__main__ import parser

    return {"generate": build_parser()[0], "serve": parser()}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_shows_every_default(command, capsys):
    """`--help` of both commands: every option that has a default (not None / False /
    empty) says it in its help line."""
    ap = _parsers()[command]
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--help"])
    assert e.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # the help, line wrapping (and spaces) undone
    fmt = ap._get_formatter()
    missing = []
    for action in ap._actions:
        d = action.default
        if not action.option_strings or d is None or d is False or d == [] or d == argparse.SUPPRESS:
            continue
        shown = "".join(fmt._expand_help(action).split()) if action.help else ""  # its help as printed
        if "default" not in shown.lower() or shown not in text:
            missing.append(action.option_strings[-1])
    assert not missing, f"no default shown for {missing}"


@pytest.mark.parametrize("command,argv", [("generate", ["--prompt", "x", "--max-new-tokens", "many"]),
                                          ("generate", ["--prompt", "x", "--max-new-tokens", "0"]),
                                          ("serve", ["--max-batch", "eight"])])
def test_a_bad_command_line_is_one_error_line(command, argv, capsys):
    """A bad command line: exit status 2, the error on one line and a pointer to --help
    (not argparse's usage block)."""
    ap = _parsers()[command]
    with pytest.raises(SystemExit) as e:
        if command == "generate":
            from lookahead_jax.cli import parse_args

            parse_args(argv)
        else:
            ap.parse_args(argv)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2
    assert len(err) == 2 and ": error: " in err[0] and err[1].endswith("--help"), err


def test_strategy_flags_show_their_defaults(capsys):
    """The strategy flags (argparse default None: unset means the strategy's own default)
    name the strategy's field default in their help: --sampler mss, --speculation-stride
    ralmspec auto / knnlm 4. Fields without one (None: required, e.g. --draft-model) are
    left out."""
    ap = _parsers()["generate"]
    helps = {a.option_strings[-1]: "".join(ap._get_formatter()._expand_help(a).split())
             for a in ap._actions if a.option_strings and a.help}
    missing = []
    for cls in REGISTRY.values():
        for field in dataclasses.fields(cls):
            if field.default is None:
                continue
            flag = "--" + cls.cli_names.get(field.name, field.name.replace("_", "-"))
            text = helps[flag].lower()
            if "default" not in text:
                missing.append(f"{cls.name}.{field.name}")
    assert not missing, f"no default in the help of {missing}"
    assert "(default:ralmspecauto,knnlm4)" in helps["--speculation-stride"], helps["--speculation-stride"]
