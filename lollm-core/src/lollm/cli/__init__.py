"""The ``lollm`` command line.

Commands, in the order of a user's day (the sections of ``lollm --help``)::

    find and get a model
    lollm list      [--json]                 the models on this machine, by the names the commands take
    lollm pull      REPO[:QUANT]             download a model through huggingface_hub
    use it
    lollm run       MODEL --prompt TEXT      generate text, streamed to stdout (--prompts-file: many, batched)
    lollm chat      MODEL                    a conversation in the terminal (the cache carries over)
    lollm serve     MODEL                    an OpenAI-compatible HTTP server, and a chat page at /
    look inside
    lollm inspect   MODEL [--filter PATTERN] a summary, the metadata and the tensors (natural order) of a GGUF file or safetensors folder
    lollm tokenize  MODEL TEXT [--chat]      how text becomes token ids
    lollm trace     MODEL --prompt TEXT      one forward pass, drawn as a self-contained HTML page
    prove and measure
    lollm parity    MODEL                    our logits against transformers'
    lollm bench     MODEL                    prefill/decode speed and memory, beside transformers
                    (--concurrency 1,4,16: the batched engine's throughput and latency per level)
    write a family
    lollm families                           the installed family plugins
    lollm new-family NAME --like FAMILY      a new family distribution, copied from an installed one

MODEL is a path (a checkpoint folder, a ``.gguf`` file), the name ``lollm list`` shows for a model
on this machine (:mod:`lollm.load.local_names`), or a Hugging Face repo id (:mod:`lollm.load.hub`).

Every command that takes a model accepts it either way: ``lollm CMD MODEL``
or ``lollm CMD -m MODEL`` (see :func:`lollm.cli.options.which_model`).

Any :class:`lollm.errors.LollmError` is printed as one ``error:`` line on
stderr with exit status 2; ``parity`` exits 1 when the gate fails; Ctrl-C
exits 130 (``run`` first ends its output and prints the statistics of what
it generated). Flags are checked before torch is imported or a checkpoint
is read, so a typo costs nothing; what needs no model (the extras a command imports, serve's
port, trace's output path, a --json-schema) is checked before the model loads.

This module holds the app, lists the commands in the order ``lollm --help`` shows them (laid
out by :mod:`lollm.cli.help`), and runs them (:func:`main`). The commands live beside it, one module per group: ``run`` and
``chat`` in :mod:`lollm.cli.run`; ``serve`` in :mod:`lollm.cli.serve_command`; ``parity``,
``trace`` and ``bench`` in :mod:`lollm.cli.measure`; ``families``, ``tokenize``, ``inspect``,
``list``, ``pull`` and ``new-family`` in :mod:`lollm.cli.info`. Their plumbing: the shared
flags and the LoadOptions made of them in :mod:`lollm.cli.options`, the checks before the
weights load in :mod:`lollm.cli.checks` (the choices themselves are made once, by
:func:`lollm.load.pipeline.prepare`), the prompts and files read in :mod:`lollm.cli.inputs`,
and what is printed in :mod:`lollm.cli.report`. Under ``--tp N`` the commands keep their
ranks in step through :mod:`lollm.load.ranks`.
"""

from __future__ import annotations

import errno
import os
import sys
from importlib.metadata import version
from typing import TextIO

import typer
from rich.markup import escape

from lollm.cli import info, measure, run, serve_command
from lollm.cli.options import App
from lollm.cli.report import err, out
from lollm.errors import LollmError
from lollm.family import CONTRACT_VERSION, DEBUG_ENV

# rich_markup_mode=None: click's plain help, read literally ("lollm-core[triton]" stays as written; rich markup ate it)
app = App(
    help="lollm: a study-first LLM inference engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        core = version("lollm-core")
        out.print(f"lollm {core} (lollm-core {core}, plugin contract {CONTRACT_VERSION}, Python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version of lollm and exit."),
    debug: bool = typer.Option(False, "--debug", help="Let a plugin's exception through with its traceback instead of one error line (as LOLLM_DEBUG=1)."),
) -> None:
    """lollm: a study-first LLM inference engine."""
    if debug:
        # an environment variable, not a global: the plugin guard reads it, and torchrun's ranks inherit it
        os.environ[DEBUG_ENV] = "1"


# The commands, in the order ``lollm --help`` lists them: the sections of a user's day (typer's rich_help_panel
# names each command's section; lollm.cli.help lays them out). (Registered by module, so that ``lollm.cli.run``,
# ``lollm.cli.new_family`` and ``lollm.cli.trace`` stay the modules of those names, not the command functions.)
FIND, USE, LOOK, PROVE, BUILD = ("Find and get a model", "Use it", "Look inside", "Prove and measure",
                                 "Write a family")
app.command("list", rich_help_panel=FIND)(info.list_)
app.command(rich_help_panel=FIND)(info.pull)
app.command(rich_help_panel=USE)(run.run)
app.command(rich_help_panel=USE)(run.chat)
app.command(rich_help_panel=USE)(serve_command.serve)
app.command(rich_help_panel=LOOK)(info.inspect)
app.command(rich_help_panel=LOOK)(info.tokenize)
app.command(rich_help_panel=LOOK)(measure.trace)
app.command(rich_help_panel=PROVE)(measure.parity)
app.command(rich_help_panel=PROVE)(measure.bench)
app.command(rich_help_panel=BUILD)(info.families)
app.command("new-family", rich_help_panel=BUILD)(info.new_family)


class _WatchedStdout:
    """sys.stdout, remembering a failed write: main() then knows the OSError came from the output."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def main() -> None:
    """Console-script entry point: run the Typer app, turning LollmError into one clean line."""
    # Standalone mode: click itself prints usage errors (status 2), --help, and
    # turns typer.Exit(code) into that exit status; our own errors pass through it.
    stdout = sys.stdout = _WatchedStdout(sys.stdout)
    try:
        try:
            app()
        finally:
            sys.stdout.flush()  # inside the try: a failing last write is reported like any other
    except LollmError as exc:
        err.quiet = False  # a --tp rank other than 0 still reports its error
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except OSError as exc:
        if exc is not stdout.error:
            raise
        # stdout cannot take the output (a full disk, /dev/full, a closed pipe): point it at
        # /dev/null so the interpreter's own last flush cannot fail again, and say so once.
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        if exc.errno == errno.EPIPE:
            sys.exit(1)  # the reader went away (| head): nothing to report, as click does
        err.print(f"[red]error:[/red] cannot write the output to stdout: {escape(exc.strerror or str(exc))}",
                  highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()