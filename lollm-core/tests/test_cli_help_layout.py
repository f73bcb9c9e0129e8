"""How ``--help`` is laid out (issue 41): sections in the order of a user's day, whole first sentences,
no word broken at any terminal width, and every option's help true for the command it is on.

The commands are enumerated from the app, so a command added later is checked too.
"""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from lollm.cli import app
from lollm.cli.help import first_sentence

COMMANDS = dict(typer.main.get_command(app).commands)
#: The sections of ``lollm --help``, in the order a user meets them, and the commands of each.
DAY = {
    "Find and get a model": ["list", "pull"],
    "Use it": ["run", "chat", "serve"],
    "Look inside": ["inspect", "tokenize", "trace"],
    "Prove and measure": ["parity", "bench"],
    "Write a family": ["families", "new-family"],
}


def _help(*args: str, columns: int) -> str:
    """``lollm [COMMAND] --help`` as a terminal of ``columns`` columns shows it (through typer's runner)."""
    done = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(columns)})
    assert done.exit_code == 0, done.output
    return done.output


def _help_fast(group, name: str | None, columns: int, monkeypatch) -> str:
    """The same text from the click command built once (the runner rebuilds it from the app at every call)."""
    monkeypatch.setenv("COLUMNS", str(columns))
    with group.context_class(group, info_name="lollm") as parent:
        if name is None:
            return group.get_help(parent)
        command = group.get_command(parent, name)
        with command.context_class(command, info_name=name, parent=parent) as ctx:
            return command.get_help(ctx)


def test_the_top_level_list_is_grouped_in_the_order_of_a_users_day():
    text = _help(columns=120)
    headings = re.findall(r"^(\S[^:\n]*):$", text, re.M)
    assert headings == ["Options", *DAY], headings
    listed = re.findall(r"^  ([a-z][a-z-]*)  ", text.split("Find and get a model:")[1], re.M)
    assert listed == [name for names in DAY.values() for name in names]
    assert sorted(listed) == sorted(COMMANDS), "a command is missing from the sections of the test"


def test_the_top_level_list_gives_each_whole_first_sentence():
    text = " ".join(_help(columns=60).split("Find and get a model:")[1].split())
    assert "..." not in text
    for name, command in COMMANDS.items():
        sentence = first_sentence(command)
        assert sentence.endswith((".", "!", "?")) and len(sentence.split()) >= 4, (name, sentence)
        assert f"{name} {sentence}" in text, (name, sentence)
    assert "Generate text from a prompt (-p, or stdin)" in text  # not "a continuation of PROMPT": the prompt is -p


def test_no_flag_name_or_path_is_broken_at_any_width(monkeypatch):
    """Every help reads as the same words at every width from 60 to 200 columns: a word cut at a hyphen
    ("--draft-" / "tokens", "lollm-" / "core[triton]") would add two words that are not there at 200."""
    group = typer.main.get_command(app)
    assert _help_fast(group, "run", 90, monkeypatch).split()[2:] == _help("run", columns=90).split()[2:]  # after "Usage: prog"
    for name in (None, *sorted(COMMANDS)):
        wide = _help_fast(group, name, 200, monkeypatch).split()
        for columns in range(60, 201):
            words = _help_fast(group, name, columns, monkeypatch).split()
            if words != wide:
                at = next(i for i, (a, b) in enumerate(zip(words, wide)) if a != b)
                pytest.fail(f"lollm {name or ''} --help at COLUMNS={columns}: {words[at - 2:at + 3]} "
                            f"where 200 columns show {wide[at - 2:at + 3]}")


def test_every_flag_an_option_help_names_is_a_flag_of_that_command():
    """A help text that points to another flag (--draft-tokens "with --mtp") names one the command has;
    a command line quoted in backticks (a torchrun line) is another program's and is skipped."""
    wrong = []
    for name, command in COMMANDS.items():
        flags = {opt for param in command.params for opt in (*param.opts, *getattr(param, "secondary_opts", []))}
        for param in command.params:
            text = re.sub(r"`[^`]*`", "", getattr(param, "help", None) or "")
            wrong += [f"{name} {param.opts[0]}: {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)
                      if flag not in flags]
    assert not wrong, wrong


def test_draft_tokens_says_which_drafters_each_command_has():
    for name, drafters in (("run", "with --mtp or --prompt-lookup"), ("chat", "with --mtp."), ("serve", "with --mtp.")):
        [param] = [p for p in COMMANDS[name].params if "--draft-tokens" in p.opts]
        assert drafters in param.help, (name, param.help)
