"""Tool calls: the functions a client offers, how a chat template shows them, how the model's calls are read.

An OpenAI client sends ``tools`` (functions with a JSON schema of their
parameters) and gets back ``message.tool_calls``. The model in between never
sees JSON requests: its chat template writes the tools into the system turn,
and the model answers with text in the format it was fine-tuned on::

    Qwen2.5, Qwen3   <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    Qwen3.5          <tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>
    Gemma 4          <|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>

Each format is one :class:`~lollm.serve.tool_formats.ToolCallFormat` (its start and end markers, how to
read the text between them, and the grammar a constrained generation follows),
chosen by :func:`format_of` from the template's own source: the template that
writes the calls of earlier turns is the authority on their format. A template
with none (Gemma 2, Gemma 3) cannot take tools: :class:`ToolRequestError`.

:class:`ToolCallParser` reads the generated text piece by piece: text outside
the markers is content (streamed as it comes, minus a tail that could still be
the start of a marker); a call is given out whole once its end marker arrives
and its text parses, so a streamed call is never half-sent and then withdrawn.
A block that does not parse (bad JSON, a function the client did not offer, no
end marker before the generation stopped) stays content, as the model wrote it.
The non-streamed answer is the same parser fed the whole text at once, so the
two always agree.

Sources: OpenAI's chat-completions API reference (``tools``, ``tool_choice``,
``parallel_tool_calls``, ``message.tool_calls``, streamed ``delta.tool_calls``);
the formats as the Qwen2.5 / Qwen3 / Qwen3.5 and Gemma 4 chat templates write
them (lollm.cli.hub_configs holds copies). docs/structured-output.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Union

from lollm.generate.structured import ConstraintError, OutputConstraint, check_constraint
from lollm.serve.tool_formats import FORMATS, Schemas, ToolCall, ToolCallFormat, ToolRequestError, format_of
from lollm.tokenizer import StreamDecoder, Tokenizer

#: OpenAI's rule for a function name.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
#: The schema of a function declared without ``parameters``: OpenAI reads it as taking none, so its
#: arguments are ``{}`` (an empty schema ``{}`` would admit any arguments at all).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


# -- reading the generated text ----------------------------------------------------------------

Event = Union[str, ToolCall]  # content text, or one whole call


@dataclass
class ToolCallParser:
    """Splits generated text, fed piece by piece, into content and :class:`ToolCall`\\ s (see the module's text).

    ``feed(piece)`` and ``finish()`` return the events ready so far, in order.
    Whatever the pieces, the events concatenate to the same content and calls.
    Whitespace right before a call's start marker or right after its end marker
    is dropped (templates put newlines there). ``max_calls``: after that many
    calls, later text is content (``parallel_tool_calls: false`` stops the
    generation at the first end marker before that happens).
    """

    fmt: ToolCallFormat
    tools: Schemas  # function name -> its parameters' JSON schema
    max_calls: int | None = None
    buffer: str = ""
    inside: bool = False  # after a start marker, waiting for the end marker
    after_call: bool = False  # just after a call: leading whitespace is dropped
    calls: int = 0
    events: list[Event] = field(default_factory=list)

    def feed(self, piece: str) -> list[Event]:
        self.buffer += piece
        while self._step():
            pass
        return self._take()

    def finish(self, closed: bool = False) -> list[Event]:
        """The rest at the end of the generation: held text, or an unfinished call, as content.

        ``closed``: the generation stopped on the end marker as a stop string
        (:meth:`ToolRequest.stops`), which the text does not hold: a call still
        open is closed by it.
        """
        if self.inside and closed:
            self.buffer += self.fmt.end
            while self._step():
                pass
        if self.inside:
            self.buffer = self.fmt.start + self.buffer
        if self.buffer and not (self.after_call and not self.buffer.strip()):
            self.events.append(self.buffer)
        self.buffer, self.inside = "", False
        return self._take()

    def _take(self) -> list[Event]:
        events, self.events = self.events, []
        return events

    def _step(self) -> bool:
        """Handle what the buffer holds; True when it changed state and should be looked at again."""
        if self.inside:
            end = self.buffer.find(self.fmt.end)
            if end < 0:
                return False
            body, self.buffer, self.inside = self.buffer[:end], self.buffer[end + len(self.fmt.end):], False
            call = self.fmt.read(body, self.tools)
            if call is None:
                self.events.append(self.fmt.start + body + self.fmt.end)
                self.after_call = False
            else:
                self.events.append(call)
                self.calls, self.after_call = self.calls + 1, True
            return True
        if self.after_call:
            stripped = self.buffer.lstrip()
            if not stripped:
                self.buffer = ""
                return False
            self.buffer, self.after_call = stripped, False
        start = self.buffer.find(self.fmt.start)
        if self.max_calls is not None and self.calls >= self.max_calls:
            start = -1
        if start >= 0:
            self._content(self.buffer[:start].rstrip())
            self.buffer, self.inside = self.buffer[start + len(self.fmt.start):], True
            return True
        keep = self._held_tail()
        self._content(self.buffer[:len(self.buffer) - keep])
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return False

    def _held_tail(self) -> int:
        """How many characters at the end of the buffer must wait: a possible start of a marker, and whitespace."""
        text = self.buffer
        partial = next((n for n in range(min(len(self.fmt.start) - 1, len(text)), 0, -1)
                        if self.fmt.start.startswith(text[-n:])), 0)
        head = text[:len(text) - partial]
        return partial + len(head) - len(head.rstrip())

    def _content(self, text: str) -> None:
        if text:
            self.events.append(text)


class MarkerText:
    """A tokenizer as :func:`lollm.generate.loop.generate` uses it, whose decoder keeps the special ids ``keep``.

    Gemma 4's call markers are special tokens, which generated text leaves out;
    a request with tools decodes them, so that :class:`ToolCallParser` sees them.
    Everything else is the tokenizer's own.
    """

    def __init__(self, tokenizer: Tokenizer, keep: frozenset[int]):
        self.tokenizer, self.keep = tokenizer, keep

    def __getattr__(self, name: str) -> Any:  # any attribute of the tokenizer, as it is
        return getattr(self.tokenizer, name)

    def stream_decoder(self, *, skip_special_tokens: bool = False) -> StreamDecoder:
        return self.tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens, keep=self.keep)


def split_calls(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """(the content, the calls) of a parser's events."""
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


# -- a request's tools -------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked.

    tools:    the request's tool entries as sent (what the chat template receives).
    schemas:  function name -> its parameters' JSON schema (:data:`NO_PARAMETERS` when none are declared).
    choice:   ``"auto"``, ``"required"`` or ``"function"`` (then ``name`` is the function).
    parallel: whether an answer may hold more than one call (never with a named function: it forces one call).
    fmt:      the chat template's :class:`ToolCallFormat`.
    keep:     the format's markers that are special tokens of the model's tokenizer (:meth:`ToolCallFormat.marker_ids`).
    grammar:  what the generation must follow: for ``required`` and a named function, only calls, each
              argument object following its function's schema (lollm.generate.structured enforces it, or refuses
              a keyword it cannot enforce, so the arguments always validate); None for ``auto``.
    """

    tools: list[dict[str, object]]
    schemas: Schemas
    choice: str
    name: str | None
    parallel: bool
    fmt: ToolCallFormat
    keep: frozenset[int] = frozenset()
    grammar: OutputConstraint | None = None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.fmt, self.schemas, max_calls=None if self.parallel else 1)

    def stops(self) -> list[str]:
        """Stop strings the generation needs: the end marker when only one call is allowed.

        Not when the markers are special tokens (Gemma 4): only this process
        decodes them (:meth:`text_of`), not the other ranks of ``--tp``, which
        must stop where it stops; the parser then reads the first call only.
        """
        return [] if self.parallel or self.keep else [self.fmt.end]

    def text_of(self, tokenizer: Tokenizer) -> Tokenizer | MarkerText:
        """The tokenizer to decode the answer with: one that writes the special markers out (:class:`MarkerText`)."""
        return MarkerText(tokenizer, self.keep) if self.keep else tokenizer

    def answer(self, text: str, stop_reason: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole generated ``text`` that ended for ``stop_reason`` (lollm.generate.loop's)."""
        parser = self.parser()
        events = parser.feed(text)
        return split_calls(events + parser.finish(closed=self.closed_by(stop_reason)))

    def closed_by(self, stop_reason: str) -> bool:
        """Whether a generation that ended for ``stop_reason`` ended on the end marker (see :meth:`stops`)."""
        return stop_reason == "stop_string" and bool(self.stops())


def read_tools(body: dict[str, object], template_source: str | None, tokenizer: Tokenizer | None = None) -> ToolRequest | None:
    """The request's tools, checked; None when it offers none or ``tool_choice`` is ``"none"``.

    Raises :class:`ToolRequestError` for a malformed ``tools`` list (OpenAI's
    shape: ``{"type": "function", "function": {"name", "description",
    "parameters"}}``), a ``tool_choice`` naming a function not offered, or a
    chat template that writes no tool calls (:func:`format_of`) or no chat template
    at all, ``required`` or a named function on a format without a grammar, or a
    forced function whose parameters' schema the grammar cannot enforce (param
    ``tools[i].function.parameters``; under ``auto`` nothing is enforced, so
    nothing is checked). A named function forces exactly one call, whatever
    ``parallel_tool_calls`` says (OpenAI's rule). ``tokenizer`` (the model's)
    tells which markers are special tokens.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError(f"'parallel_tool_calls' must be true or false, got {parallel!r:.80}", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ToolRequestError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    schemas = _schemas(tools)
    mode, name = _choice(choice, schemas)
    if mode == "none":
        return None
    if not template_source:
        raise ToolRequestError("this model has no chat template; use /v1/completions with a plain prompt", "messages")
    fmt = format_of(template_source)
    if fmt is None:
        raise ToolRequestError("this model's chat template does not render tools (it has no tool-call format that "
                               f"lollm knows: {', '.join(f.name for f in FORMATS)}); send the request without 'tools'",
                               "tools")
    keep = fmt.marker_ids(tokenizer) if tokenizer is not None else frozenset()
    parallel = parallel is not False and name is None  # a named function: exactly one call
    grammar = None
    if mode != "auto":  # a format without a grammar refuses here (ToolRequestError)
        forced = schemas if name is None else {name: schemas[name]}
        grammar = fmt.constraint(forced, parallel)
        _check_forced(forced, list(schemas))
    return ToolRequest(list(tools), schemas, mode, name, parallel, fmt, keep, grammar)


def _check_forced(forced: Schemas, names: list[str]) -> None:
    """ToolRequestError naming ``tools[i].function.parameters`` whose schema the call grammar cannot enforce."""
    for name, schema in forced.items():
        where = f"tools[{names.index(name)}].function.parameters"
        try:
            check_constraint(OutputConstraint.json_schema({"type": "object", **schema}))
        except ConstraintError as error:
            raise ToolRequestError(f"{where} (function {name!r}) cannot be enforced by the grammar of a forced call: "
                                   f"{error.reason}; remove the keyword, or use tool_choice 'auto'", where) from None


def _schemas(tools: object) -> Schemas:
    if not isinstance(tools, list) or len(tools) > 128:
        raise ToolRequestError("'tools' must be a list of at most 128 tools", "tools")
    schemas: Schemas = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolRequestError(f'{where} must be {{"type": "function", "function": {{"name": ..., '
                                   f'"parameters": ...}}}}', where)
        name, parameters = function.get("name"), function.get("parameters", NO_PARAMETERS)
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolRequestError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}",
                                   f"{where}.function.name")
        if name in schemas:
            raise ToolRequestError(f"{where}: two tools are named {name!r}", f"{where}.function.name")
        if not isinstance(parameters, dict):
            raise ToolRequestError(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        if not isinstance(function.get("description", ""), str):
            raise ToolRequestError(f"{where}.function.description must be a string", f"{where}.function.description")
        schemas[name] = parameters
    return schemas


def _choice(choice: object, schemas: Schemas) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in CHOICES:
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)):
        raise ToolRequestError('\'tool_choice\' must be "none", "auto", "required" or {"type": "function", '
                               f'"function": {{"name": ...}}}}, got {choice!r:.80}', "tool_choice")
    if function.get("name") not in schemas:
        raise ToolRequestError(f"'tool_choice' names the function {function.get('name')!r:.80}, which 'tools' does "
                               f"not offer ({', '.join(schemas)})", "tool_choice")
    return "function", function["name"]


# -- tool messages -----------------------------------------------------------------------------


def template_tool_calls(value: object, where: str) -> list[dict[str, object]]:
    """An assistant message's ``tool_calls`` as chat templates read them: arguments as a dict, not JSON text.

    OpenAI clients send ``arguments`` as a JSON string; templates print it with
    ``tojson`` (Qwen2.5), iterate over it (Qwen3.5) or sort its keys (Gemma 4),
    all of which need the object. Raises :class:`ToolRequestError` for a
    malformed entry or arguments that are not a JSON object.
    """
    if not isinstance(value, list):
        raise ToolRequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolRequestError(f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                                   f'"arguments": ...}}}}', at)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as error:
                raise ToolRequestError(f"{at}.function.arguments is not valid JSON: {error}", f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise ToolRequestError(f"{at}.function.arguments must be a JSON object", f"{at}.function.arguments")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        calls.append(entry)
    return calls
