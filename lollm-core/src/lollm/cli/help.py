"""How ``lollm --help`` and every command's ``--help`` are laid out: plain text that never breaks a word.

click writes help as plain text (no rich markup, so ``lollm-core[triton]`` stays as written), but its
wrapper breaks lines at hyphens: ``--draft-`` on one line and ``tokens`` on the next. The
:class:`HelpFormatter` here wraps at spaces only, so a flag name or a path stays whole at any
terminal width (``tests/test_cli_help.py`` checks 60 to 200 columns); a word longer than the line
runs past it instead of being cut.

:class:`Group` lays out the top-level list: the commands in sections, in the order of a user's day
(each command's ``rich_help_panel``, typer's way to name its section, set where the app registers
it), and each command with the whole first sentence of its description, never cut with ``...``.
"""

from __future__ import annotations

import re
import textwrap
from typing import Iterable

import typer

#: click's plain help formatter as typer carries it (typer vendors its own click: the classes of the ``click``
#: package would not be the ones typer's commands use; typer.Context, its context, is public and names it).
ClickHelpFormatter = typer.Context.formatter_class

#: Where a description's first sentence ends: ., ! or ? before whitespace ("blk.2" has none after its dot).
SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def wrap(text: str, width: int, indent: str = "", first_indent: str | None = None) -> list[str]:
    """``text`` in lines of at most ``width`` columns, broken at spaces only (a longer word keeps its own line).

    Paragraphs (separated by a blank line) stay apart, with an empty line between them.
    ``first_indent`` (default ``indent``) starts the first line.
    """
    wrapper = textwrap.TextWrapper(width=max(width, 1), break_long_words=False, break_on_hyphens=False,
                                   initial_indent=indent if first_indent is None else first_indent,
                                   subsequent_indent=indent)
    lines: list[str] = []
    for number, paragraph in enumerate(p for p in re.split(r"\n\s*\n", text) if p.strip()):
        if number:
            lines.append("")
            wrapper.initial_indent = indent
        lines += wrapper.wrap(" ".join(paragraph.split()))
    return lines


class HelpFormatter(ClickHelpFormatter):
    """click's plain help formatter, wrapping at spaces only (see the module's docstring)."""

    def write_usage(self, prog: str, args: str = "", prefix: str | None = None) -> None:
        """``Usage: lollm run [OPTIONS] [MODEL]``, the arguments wrapped under each other."""
        head = f"{prefix if prefix is not None else 'Usage: ':>{self.current_indent}}{prog} "
        lines = wrap(args, self.width, indent=" " * len(head), first_indent=head) if args else [head.rstrip()]
        self.write("\n".join(lines) + "\n")

    def write_text(self, text: str) -> None:
        """A description, its paragraphs kept, indented to the current level."""
        margin = " " * self.current_indent
        self.write("\n".join(wrap(text, max(self.width, len(margin) + 20), indent=margin)) + "\n")

    def write_dl(self, rows: Iterable[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        """Terms and their help in two columns; a term wider than ``col_max`` puts its help on the next line."""
        rows = list(rows)
        if not rows:
            return
        first = min(max(len(term) for term, _ in rows), col_max) + col_spacing
        margin = " " * self.current_indent
        hang = margin + " " * first
        for term, help_text in rows:
            lines = wrap(help_text, max(self.width, len(hang) + 20), indent=hang)
            if not lines:
                self.write(f"{margin}{term}\n")
            elif len(term) + col_spacing <= first:
                self.write(f"{margin}{term.ljust(first)}{lines[0].lstrip()}\n" + "".join(f"{line}\n" for line in lines[1:]))
            else:
                self.write(f"{margin}{term}\n" + "".join(f"{line}\n" for line in lines))


class Context(typer.Context):
    """typer's context, whose help is written by :class:`HelpFormatter`."""

    formatter_class = HelpFormatter


def first_sentence(command: typer.core.TyperCommand) -> str:
    """The whole first sentence of a command's description (its ``short_help`` when it has one)."""
    text = " ".join((command.short_help or command.help or "").split())
    return SENTENCE_END.split(text, maxsplit=1)[0]


class Group(typer.core.TyperGroup):
    """The ``lollm`` group: commands listed by section (``rich_help_panel``), in registration order, each with its first sentence."""

    context_class = Context

    def format_commands(self, ctx: typer.Context, formatter: ClickHelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is None or command.hidden:
                continue
            section = getattr(command, "rich_help_panel", None) or "Commands"
            sections.setdefault(section, []).append((name, first_sentence(command)))
        width = max((len(name) for rows in sections.values() for name, _ in rows), default=0)
        for section, rows in sections.items():
            with formatter.section(section):
                formatter.write_dl(rows, col_max=width)
