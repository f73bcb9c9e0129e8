"""``lollm chat``: a conversation with one model in the terminal, reusing its cache from turn to turn.

::

    >>> you type a message
        the chat template renders the whole conversation ─► token ids
        the prompt cache keeps what the last turn computed ─► only the new part is prefilled
        the answer streams out; Ctrl-C stops it (the conversation stays), Ctrl-D quits
    >>> /stats   tokens reused from the cache vs prefilled, for the last turn
    >>> /reset   start over        /quit   leave

:class:`ChatSession` holds the conversation (messages, template flags, a
:class:`~lollm.prompt_cache.PromptCache`); :func:`repl` reads lines and
prints answers. Line editing and history come from prompt_toolkit (the
``lollm-core[chat]`` extra) when the terminal is interactive; piped input is
read line by line without it.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TextIO

from lollm.errors import LollmError
from lollm.generate import GenerationResult, generate
from lollm.prompt_cache import PromptCache
from lollm.sampling import SamplingParams

#: The session context (``--ctx-size``) when none is given, capped by the model's own.
DEFAULT_CONTEXT = 4096

HELP = """commands:
  /stats   tokens of the last turn: reused from the cache, prefilled, generated; speed
  /reset   forget the conversation (the system message stays)
  /quit    leave (Ctrl-D too)
Ctrl-C stops an answer and keeps the conversation; the text so far stays in it."""


def thinking_flags(tokenizer: Any, think: bool | None, model: str) -> dict[str, bool]:
    """The template keyword for ``--think`` / ``--no-think``: ``{}`` or ``{"enable_thinking": think}``.

    Decided from the chat template itself: a template that does not read
    ``enable_thinking`` cannot be switched, and asking for it is an error naming the model.
    """
    if think is None:
        return {}
    if not tokenizer.chat_template_reads("enable_thinking"):
        raise LollmError(
            f"--think/--no-think: the chat template of {model} does not read enable_thinking, so thinking cannot be switched"
        )
    return {"enable_thinking": think}


class ChatSession:
    """One conversation with a loaded model (see :func:`lollm.pipeline.open_model`).

    sampling:           the :class:`SamplingParams` of every answer.
    stop_ids:           end-of-sequence ids (:func:`lollm.generate.stop_token_ids`).
    system:             a system message, kept across ``/reset``.
    template_flags:     extra template variables, e.g. ``{"enable_thinking": False}``.
    max_new_tokens:     most tokens per answer.
    speculative_tokens: draft tokens per step with the model's MTP head (0: off).
    context:            positions of the cache kept across turns (default
                        :data:`DEFAULT_CONTEXT`, at most the model's context).

    Raises LollmError when the tokenizer has no chat template.
    """

    def __init__(
        self,
        loaded: Any,
        *,
        sampling: SamplingParams,
        stop_ids: set[int],
        system: str | None = None,
        template_flags: dict[str, Any] | None = None,
        max_new_tokens: int = 512,
        speculative_tokens: int = 0,
        context: int | None = None,
    ):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        if self.tokenizer.chat_template is None:
            raise LollmError(
                f"{loaded.checkpoint.spec} has no chat template, so it cannot chat; "
                "use `lollm run --no-chat` for plain text completion"
            )
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.system = system
        self.template_flags = dict(template_flags or {})
        self.max_new_tokens = max_new_tokens
        self.speculative_tokens = speculative_tokens
        self.cache = PromptCache(loaded.model, context or min(DEFAULT_CONTEXT, loaded.model.max_context))
        self.messages: list[dict[str, str]] = []
        self.last: GenerationResult | None = None
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and the cache; the system message stays."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache.reset()
        self.last = None

    def reply(
        self,
        text: str,
        *,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Answer the user message ``text``; the message and the answer join the conversation.

        An answer stopped by ``should_stop`` joins it as far as it got. On an
        error (a conversation longer than the context, ...) the conversation is
        left as it was.
        """
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True, **self.template_flags)
        result = generate(
            self.loaded.model, ids, max_new_tokens=self.max_new_tokens, sampling=self.sampling, stop_ids=self.stop_ids,
            tokenizer=self.tokenizer, on_text=on_text, speculative_tokens=self.speculative_tokens,
            prompt_cache=self.cache, should_stop=should_stop,
        )
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        self.last = result
        return result

    def stats(self) -> str:
        """The last turn's token counts and speed, and how full the cache is."""
        if self.last is None or self.cache.last is None:
            return "no turn yet"
        r, reuse = self.last, self.cache.last
        cache = self.cache.cache
        return (
            f"last turn: prompt {reuse.prompt_tokens} tokens: {reuse.reused} reused from the cache ({reuse.how}), "
            f"{reuse.prefilled} prefilled; answer {len(r.new_ids)} tokens\n"
            f"speed: prefill {r.prefill_tokens_per_second:.1f} tok/s, decode {r.decode_tokens_per_second:.1f} tok/s; "
            f"stop: {r.stop_reason}\n"
            f"cache: {cache.length if cache is not None else 0} of {self.cache.max_tokens} positions, "
            f"{len(self.cache.snapshots)} snapshot(s)"
        )


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


def _line_reader(interactive: bool) -> Callable[[str], str]:
    """``read(prompt) -> line``; EOFError at the end (Ctrl-D), KeyboardInterrupt on Ctrl-C."""
    if not interactive:

        def read_piped(prompt: str) -> str:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line.rstrip("\n")

        return read_piped
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
    except ImportError:
        raise LollmError("lollm chat needs prompt_toolkit for line editing: pip install 'lollm-core[chat]'") from None
    session = PromptSession(history=InMemoryHistory())
    return lambda prompt: session.prompt(prompt)


def repl(session: ChatSession, *, out: TextIO = sys.stdout, note: Callable[[str], None] = print) -> None:
    """Read messages and commands until /quit or Ctrl-D; stream each answer to ``out``.

    ``note`` prints lines that are not part of an answer (statistics, notices).
    """
    interactive = sys.stdin.isatty() and out.isatty()
    read = _line_reader(interactive)
    note("/help for commands, Ctrl-C stops an answer, Ctrl-D quits")
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
            command = text.split()[0].lower()
            if command in ("/quit", "/exit", "/bye"):
                break
            if command == "/reset":
                session.reset()
                note("(the conversation is cleared)")
            elif command == "/stats":
                note(session.stats())
            elif command == "/help":
                note(HELP)
            else:
                note(f"unknown command {command}; /help lists them")
            continue

        def show(piece: str) -> None:
            out.write(piece)
            out.flush()

        try:
            with ctrl_c_stops() as stop:
                result = session.reply(line, on_text=show, should_stop=stop.is_set)
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
        reuse = session.cache.last
        stopped = " · stopped by Ctrl-C" if result.stop_reason == "cancelled" else f" · stop: {result.stop_reason}"
        note(
            f"[{len(result.new_ids)} tokens · prompt {reuse.prompt_tokens}: {reuse.reused} reused, {reuse.prefilled} "
            f"prefilled at {result.prefill_tokens_per_second:.1f} tok/s · decode {result.decode_tokens_per_second:.1f} "
            f"tok/s{stopped}]"
        )
