"""Thinking, kept apart from the answer: ``<think> ... </think>`` out of the content, and constraints after it.

A thinking model (Qwen3, Qwen3.5) writes its reasoning before its answer, between two
markers its chat template knows::

    <|im_start|>assistant\\n<think>\\nThe user wants JSON. Paris is ...\\n</think>\\n\\n{"city": "Paris"}
                             ^ reasoning (message.reasoning_content)    ^ content (message.content)

Three pieces here, each small:

* :func:`opening` reads where the prompt leaves the model: ``"start"`` (the answer may open
  with ``<think>``: Qwen3), ``"inside"`` (the template opened the thinking itself: Qwen3.5 with
  ``enable_thinking``), ``"answer"`` (the template closed it: ``enable_thinking=False``).
  None when the template writes no thinking markers at all: nothing is separated.
* :class:`ReasoningSplitter` splits the generated text, piece by piece as it streams, into
  reasoning and content; the whole answer is the same splitter fed the whole text, so a
  stream and a whole answer always agree.
* :func:`after_thinking` wraps an output constraint (``response_format``, a forced tool
  call) so that it binds only what follows ``</think>``: the model thinks freely, then
  answers in the constrained form.

:func:`thinking_switch` reads a request's on/off for thinking (``reasoning_effort``, the
Responses API's ``reasoning.effort``, the Messages API's ``thinking``), which becomes the
template's ``enable_thinking`` flag.

Gemma 4's thinking channel is not read here. Its model writes
``<|channel>thought\n`` + thinking + ``<channel|>`` + answer, and both markers are special
tokens of its tokenizer (``soc_token``, ``eoc_token``), which generated text leaves out: a
Gemma 4 client gets ``thought``, a newline, the thinking and the answer run together in the
content, and no reasoning field (docs/serving.md, "Thinking, kept apart"). Splitting it needs
the decoder to keep those two ids (as :class:`lollm.serve.tools.MarkerText` keeps the tool-call
markers) and the splitter to take each template's markers in place of :data:`OPEN` / :data:`CLOSE`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from lollm.generate.structured import OutputConstraint
from lollm.tokenizer import Tokenizer

#: The markers around the thinking, as Qwen3 and Qwen3.5 templates write them.
OPEN, CLOSE = "<think>", "</think>"
#: The states of :class:`ReasoningSplitter` (and of :func:`opening`), in the order text passes them.
STATES = ("start", "inside", "gap", "answer")
#: What the templates write between ``</think>`` and the answer (the constrained grammar writes the same).
GAP = "\n\n"
#: Reasoning efforts (OpenAI's ``reasoning_effort``, ``reasoning.effort``): "none" turns thinking off, any
#: other turns it on (an effort sets no budget: the model ends its thinking, within the token limit; the
#: Messages API's ``thinking.budget_tokens`` is a budget, kept by lollm.serve.thinking_budget).
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def separates(template_source: str | None) -> bool:
    """Whether a chat template writes thinking markers (then the answer's thinking is separated)."""
    return bool(template_source) and OPEN in template_source and CLOSE in template_source


def opening(tokenizer: Tokenizer, ids: list[int]) -> str | None:
    """Where the prompt ``ids`` leaves the model: ``"start"``, ``"inside"`` or ``"answer"`` (see the module's text).

    None when the chat template writes no thinking markers (:func:`separates`). Read
    from the text of the prompt's last tokens, as the template rendered it.
    """
    if not separates(tokenizer.chat_template):
        return None
    tail = tokenizer.decode(ids[-8:]).rstrip()
    if tail.endswith(OPEN):
        return "inside"
    if tail.endswith(CLOSE):
        return "answer"
    return "start"


@dataclass
class ReasoningSplitter:
    """Splits generated text, fed piece by piece, into ``("reasoning", text)`` and ``("content", text)`` events.

    state: where the text begins (:func:`opening`). ``"start"``: leading whitespace, then either
    ``<think>`` (thinking follows) or anything else (all of it is content). ``"inside"``: reasoning
    until ``</think>``; the whitespace around the reasoning is dropped. ``"gap"``: the whitespace
    after ``</think>`` is dropped. ``"answer"``: everything is content. Text that could still be the
    start of a marker waits in the buffer until it is decided; :meth:`finish` gives out the rest.
    """

    state: str
    buffer: str = ""
    fresh: bool = True  # inside: no reasoning given out yet (its leading whitespace is dropped)
    events: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self):
        if self.state not in STATES:
            raise ValueError(f"unknown state {self.state!r} (known: {', '.join(STATES)})")

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.buffer += piece
        while self._step():
            pass
        return self._take()

    def finish(self) -> list[tuple[str, str]]:
        """The rest at the end of the generation: held text, as what it would have been."""
        if self.state == "inside":
            self._emit("reasoning", self.buffer.rstrip())
        elif self.state in ("start", "answer"):
            self._emit("content", self.buffer)
        self.buffer = ""
        return self._take()

    def _take(self) -> list[tuple[str, str]]:
        events, self.events = self.events, []
        return events

    def _emit(self, kind: str, text: str) -> None:
        if kind == "reasoning" and self.fresh:
            text = text.lstrip()
            self.fresh = not text
        if text:
            self.events.append((kind, text))

    def _step(self) -> bool:
        """Handle what the buffer holds; True when the state changed and the buffer should be looked at again."""
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.buffer, self.state = head[len(OPEN):], "inside"
                return True
            if OPEN.startswith(head):  # empty, whitespace, or a part of the marker: wait
                return False
            self.state = "answer"
            return True
        if self.state == "inside":
            end = self.buffer.find(CLOSE)
            if end >= 0:
                self._emit("reasoning", self.buffer[:end].rstrip())
                self.buffer, self.state = self.buffer[end + len(CLOSE):], "gap"
                return True
            keep = _held_tail(self.buffer, CLOSE)
            self._emit("reasoning", self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        if self.state == "gap":
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            self.state = "answer"
        self._emit("content", self.buffer)
        self.buffer = ""
        return False


def _held_tail(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` must wait: a possible start of ``marker``, and whitespace before it."""
    partial = next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)
    head = text[:len(text) - partial]
    return partial + len(head) - len(head.rstrip())


def split(state: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole generated ``text`` that began in ``state``."""
    splitter = ReasoningSplitter(state)
    events = splitter.feed(text) + splitter.finish()
    return "".join(t for k, t in events if k == "reasoning"), "".join(t for k, t in events if k == "content")


# -- constraints after the thinking ------------------------------------------------------------------

_START = re.compile(r"^start(\s*):", re.M)


def after_thinking(constraint: OutputConstraint, state: str | None) -> OutputConstraint:
    """``constraint`` bound to what follows the thinking, for a generation that begins in ``state``.

    ``"answer"`` or None: the constraint as it is. ``"inside"``: any text up to the first
    ``</think>``, then :data:`GAP`, then the constraint. ``"start"``: the same, opened by
    ``<think>``, or the constraint at once (the model may not think). Built as one grammar in
    llguidance's Lark syntax: the constraint's own grammar (:meth:`OutputConstraint.lark`),
    its ``start`` rule renamed ``lollm_answer``, and a lazy lexeme for the thinking, which ends
    at the first ``</think>``. A grammar that refers to its own ``start`` rule elsewhere fails to
    compile (ConstraintError: its rule is undefined).
    """
    if state in (None, "answer"):
        return constraint
    answer = _START.sub(r"lollm_answer\1:", constraint.lark(), count=1)
    thinking = f"lollm_thinking {json.dumps(GAP)}"
    opened = {"inside": thinking, "start": f'("<think>" {thinking})?'}[state]
    lark = f"start: {opened} lollm_answer\nlollm_thinking[lazy]: /(?s:.*)<\\/think>/\n{answer}\n"

    return OutputConstraint.grammar(lark)
