"""``--help`` of every command reads clean: no type labels (``<bool>``, ``<int>``, INTEGER, TEXT as a type), one metavar per flag.

The commands are enumerated from the Typer app itself, so a command added later is checked
without editing this file.
"""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from lollm.cli import app

#: What typer and click print for a parameter's type when no metavar is given.
TYPE_NOISE = re.compile(r"<[a-z]+(\[[a-z]+\])?( range)?>|\b(INTEGER|FLOAT|BOOLEAN|PATH_TYPE|FILENAME)\b|\[bool\]")


def _group():
    return typer.main.get_command(app)


def _commands() -> dict:
    return dict(_group().commands)


def _help(*args: str) -> str:
    done = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    return done.output


def test_the_commands_are_enumerated_from_the_app():
    names = set(_commands())
    assert {"run", "chat", "serve", "inspect", "tokenize", "new-family"} <= names, names


@pytest.mark.parametrize("args", [(), *((name,) for name in sorted(_commands()))], ids=lambda a: " ".join(a) or "lollm")
def test_help_shows_no_type_noise(args):
    text = _help(*args)
    noise = [m.group(0) for m in TYPE_NOISE.finditer(text)]
    assert not noise, f"lollm {' '.join(args)} --help shows type labels {noise}:\n{text}"
    assert "╭" not in text  # click's plain help: literal text, no rich markup to eat "[triton]"


def test_every_valued_option_declares_its_metavar_and_flags_declare_none():
    """A valued option without a metavar would print typer's ``<type>``; a flag takes no value to name."""
    missing = []
    for name, command in _commands().items():
        for param in command.params:
            flag = getattr(param, "is_flag", False)
            if param.param_type_name == "option" and (param.metavar is None) != flag:
                missing.append(f"{name} {param.opts[0]}")
            if param.param_type_name == "argument" and not (param.metavar or param.name.upper()).isupper():
                missing.append(f"{name} argument {param.name}")  # shown as its metavar, else its name in capitals
    assert not missing, missing


def test_one_flag_one_metavar_across_commands():
    seen: dict[str, dict[str, str]] = {}
    for name, command in _commands().items():
        for param in command.params:
            if param.metavar is not None:
                for opt in param.opts:
                    seen.setdefault(opt if param.param_type_name == "option" else "argument " + param.name, {})[name] = param.metavar
    disagree = {flag: where for flag, where in seen.items() if len(set(where.values())) > 1}
    assert not disagree, disagree
    assert seen["--model"] and set(seen["--model"].values()) == {"MODEL"}


def test_the_help_text_is_printed_as_written():
    """Square brackets in help text are text, not markup: the triton extra keeps its name."""
    text = _help("run")
    assert "lollm-core[triton]" in text
    assert re.search(r"-n, --max-new-tokens N\s", text) and re.search(r"--prompts-file FILE\s", text)
    assert re.search(r"^\s+--no-chat\s+Use the prompt", text, re.M)  # a flag: no value to name
    assert re.search(r"^\s+MODEL\s+Checkpoint folder", text, re.M)
