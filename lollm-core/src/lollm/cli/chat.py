"""The terminal of ``lollm chat``: read a line, answer it, print the statistics; Ctrl-C stops an answer.

::

    >>> you type a message          ─► ChatSession.reply (lollm.generate.conversation) streams the answer
    >>> /stats  /drop N  /reset     ─► commands on the session
    >>> /image PATH                 ─► an image for the next message (ChatSession.attach_image)
    Ctrl-C                          ─► the answer stops at its next token (the conversation stays)
    Ctrl-D or /quit                 ─► leave

:func:`repl` is the loop. Line editing and history come from prompt_toolkit (the
``lollm-core[chat]`` extra) when the terminal is interactive; piped input is read
line by line without it, each line bounded by :data:`MAX_LINE_CHARS`. The
conversation itself (messages, template flags, the prompt cache, the context shift)
is :class:`lollm.generate.conversation.ChatSession`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

from lollm.errors import LollmError
from lollm.generate.conversation import ChatSession
from lollm.generate.loop import GenerationResult

# Lazy imports below: prompt_toolkit, in _line_reader, the optional ``lollm-core[chat]`` extra
# (needed only for an interactive terminal).

HELP = """commands:
  /stats   tokens of the last turn: reused from the cache, prefilled, generated; speed
  /drop N  forget the oldest N turns (1 when left out); the system message stays
  /reset   forget the conversation (the system message stays)
  /image PATH  attach an image to your next message (a model with a vision tower; docs/vision.md)
  /quit    leave (Ctrl-D too)
Ctrl-C stops an answer and keeps the conversation; the text so far stays in it.
When the context is full, the oldest turns leave by themselves (unless --no-context-shift)."""



@contextmanager
def ctrl_c_stops() -> Iterator[threading.Event]:
    """While inside, the first Ctrl-C sets the yielded event (the answer stops at its next token);
    a second one raises KeyboardInterrupt as usual."""
    stop = threading.Event()

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


#: The longest line ``lollm chat`` reads from piped input (characters); a longer one ends the chat with an error.
MAX_LINE_CHARS = 2**20


def _line_reader(interactive: bool) -> Callable[[str], str]:
    """``read(prompt) -> line``; EOFError at the end (Ctrl-D), KeyboardInterrupt on Ctrl-C.

    Piped lines are bounded: one longer than :data:`MAX_LINE_CHARS` (``lollm chat < /dev/zero``)
    raises LollmError instead of filling the memory.
    """
    if not interactive:

        def read_piped(prompt: str) -> str:
            line = sys.stdin.readline(MAX_LINE_CHARS + 1)
            if not line:
                raise EOFError
            if len(line) > MAX_LINE_CHARS:
                raise LollmError(f"lollm chat: a line on stdin is longer than {MAX_LINE_CHARS:,} characters")
            return line.rstrip("\n")

        return read_piped
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
    except ImportError:
        raise LollmError("lollm chat needs prompt_toolkit for line editing: pip install 'lollm-core[chat]'") from None
    session = PromptSession(history=InMemoryHistory())
    return lambda prompt: session.prompt(prompt)


def _command(session: ChatSession, text: str, note: Callable[[str], None]) -> bool:
    """Run the chat command ``text`` (``/stats``, ``/drop N``, ...); False for one that leaves."""
    words = text.split()
    command = words[0].lower()
    if command in ("/quit", "/exit", "/bye"):
        return False
    if command == "/reset":
        session.reset()
        note("(the conversation is cleared)")
    elif command == "/drop":
        count = words[1] if len(words) > 1 else "1"
        if not count.isdigit() or len(words) > 2:
            note("usage: /drop N  (forget the oldest N turns; N a whole number, 1 when left out)")
        else:
            gone = session.drop_oldest(int(count))
            note(f"(dropped the oldest {gone} turn(s); {session.turns()} left)")
    elif command == "/image":
        _attach(session, text[len(words[0]):].strip(), note)
    elif command == "/stats":
        note(session.stats())
    elif command == "/help":
        note(HELP)
    else:
        note(f"unknown command {command}; /help lists them")
    return True


def _attach(session: ChatSession, path: str, note: Callable[[str], None]) -> None:
    """``/image PATH``: the image read, checked (lollm.vision.image) and encoded for the next message; an error is noted.

    PATH as a shell would take one word: surrounding quotes go (a path with spaces, pasted quoted), ``~`` expands.
    """
    if len(path) >= 2 and path[0] == path[-1] and path[0] in "'\"":
        path = path[1:-1]
    path = os.path.expanduser(path)
    if not path:
        note("usage: /image PATH  (attach an image to your next message)")
        return
    from lollm.vision.image import read_image_file

    try:
        waiting = session.attach_image(read_image_file(path))
    except LollmError as error:  # ImageError: a hostile image, a model without a tower
        note(f"error: {error}")
        return
    note(f"(image {path} attached: {waiting} image(s) go with your next message)")


def _turn_line(session: ChatSession, result: GenerationResult) -> str:
    """The statistics line after an answer, with a hint when the answer filled the context."""
    reuse = session.cache.last
    stopped = " · stopped by Ctrl-C" if result.stop_reason == "cancelled" else f" · stop: {result.stop_reason}"
    line = (f"[{len(result.new_ids)} tokens · prompt {reuse.prompt_tokens}: {reuse.reused} reused, {reuse.prefilled} "
            f"prefilled at {result.prefill_tokens_per_second:.1f} tok/s · decode {result.decode_tokens_per_second:.1f} "
            f"tok/s{stopped}]")
    if result.stop_reason == "context":
        then = ("the next message drops the oldest turns to make room" if session.context_shift
                else "/drop N or /reset makes room for the next message")
        line += f"\n(the answer reached the end of the context, {session.cache.max_tokens} positions: {then})"
    return line


def repl(session: ChatSession, *, out: TextIO | None = None, note: Callable[[str], None] = print) -> None:
    """Read messages and commands until /quit or Ctrl-D; stream each answer to ``out`` (default: sys.stdout as it is then).

    ``note`` prints lines that are not part of an answer (statistics, notices). An
    error in one turn (a message longer than the context, ...) is noted and the chat
    goes on; one from reading the input (a piped line over :data:`MAX_LINE_CHARS`) ends it.
    """
    out = sys.stdout if out is None else out
    interactive = sys.stdin.isatty() and out.isatty()
    read = _line_reader(interactive)
    note("/help for commands, Ctrl-C stops an answer, Ctrl-D quits")

    def show(piece: str) -> None:
        out.write(piece)
        out.flush()

    def dropped(n: int) -> None:
        note(f"(the context is full: the oldest {n} turn(s) leave the conversation; {session.turns() - n} stay)")

    while True:
        try:
            line = read(">>> ")
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt: a fresh line, as in a shell
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            if not _command(session, text, note):
                break
            continue
        try:
            with ctrl_c_stops() as stop:
                result = session.reply(line, on_text=show, should_stop=stop.is_set, on_drop=dropped)
        except KeyboardInterrupt:
            out.write("\n")
            note("[interrupted: this turn is dropped]")
            continue
        except LollmError as error:
            out.write("\n")
            note(f"error: {error}")
            continue
        out.write("\n")
        out.flush()
        note(_turn_line(session, result))

