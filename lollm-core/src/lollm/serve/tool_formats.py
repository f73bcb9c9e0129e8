"""The tool-call formats: how each kind of chat template writes a call, and how lollm reads one back.

One :class:`ToolCallFormat` per format (:data:`QWEN_JSON`, :data:`QWEN_XML`, :data:`GEMMA4`),
chosen by :func:`format_of` from the template's own source; :mod:`lollm.serve.tools` (its
module text tells the whole story) reads a request's tools and the generated text with them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from lollm.errors import LollmError
from lollm.generate.structured import OutputConstraint, json_rule, tagged_json
from lollm.tokenizer import Tokenizer

#: A function's parameters as a JSON schema (``{"type": "object", "properties": {...}}``).
JsonSchema = dict[str, object]
#: The functions a request offers: name -> its parameters' :data:`JsonSchema`.
Schemas = dict[str, JsonSchema]


class ToolRequestError(LollmError):
    """A request's ``tools``, ``tool_choice`` or tool messages refused; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: an id (``call_...``), the function's name, its arguments as JSON text."""

    id: str
    name: str
    arguments: str

    def message_entry(self) -> dict[str, object]:
        """The call in ``message.tool_calls`` of an answer."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self, index: int) -> list[dict[str, object]]:
        """The call as streamed ``delta.tool_calls`` entries: id and name first, then the arguments.

        Concatenating the ``arguments`` of the entries of one ``index`` gives
        :attr:`arguments` exactly (OpenAI clients accumulate them that way).
        """
        return [{"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}},
                {"index": index, "function": {"arguments": self.arguments}}]


def new_call(name: str, arguments: dict[str, object]) -> ToolCall:
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(arguments, ensure_ascii=False))


# -- the formats -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCallFormat:
    """How one kind of chat template writes a call: ``start`` body ``end``.

    name:     the format's name (shown in errors and docs).
    start:    the marker that opens a call; ``end`` the one that closes it.
    sign:     a piece of template source that only templates of this format contain.
    """

    name: str
    start: str
    end: str
    sign: str
    #: other marker texts the format's calls use (Gemma 4's string quote)
    extra_markers: tuple[str, ...] = ()

    def marker_ids(self, tokenizer: Tokenizer) -> frozenset[int]:
        """The special-token ids among the format's markers: the decoder must write them out for the parser."""
        ids = set()
        for marker in (self.start, self.end, *self.extra_markers):
            encoded = tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] in tokenizer.special_token_ids:
                ids.add(encoded[0])
        return frozenset(ids)

    def parse(self, body: str, tools: Schemas) -> tuple[str, dict[str, object]]:
        """The (function name, arguments) that ``body`` (the text between the markers) states; ValueError if none."""
        raise NotImplementedError

    def constraint(self, schemas: Schemas, parallel: bool) -> OutputConstraint:
        """The grammar of an answer that is only calls, to functions of ``schemas``, arguments following each schema.

        ``parallel``: one call or more, else exactly one. ToolRequestError where
        lollm has no grammar for the format (its calls are then only read, never forced).
        """
        raise ToolRequestError(f"tool_choice 'required' or a named function needs a grammar of the {self.name} call "
                               "format, which lollm does not have yet; use tool_choice 'auto'", "tool_choice")

    def read(self, body: str, tools: Schemas) -> ToolCall | None:
        """The call of ``body``, or None when it does not parse or names a function not offered."""
        try:
            name, arguments = self.parse(body, tools)
        except (ValueError, TypeError, KeyError, RecursionError):
            return None
        if name not in tools or not isinstance(arguments, dict):
            return None
        return new_call(name, arguments)


class JsonCalls(ToolCallFormat):
    """Qwen2.5 and Qwen3 ("hermes"): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    def constraint(self, schemas, parallel):
        # one JSON schema per function: its name as a constant, its parameters' schema for the arguments
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"type": "object", **schema}},
                  "required": ["name", "arguments"], "additionalProperties": False} for name, schema in schemas.items()]
        body = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return tagged_json(self.start + "\n", body, "\n" + self.end, max_count=None if parallel else 1)

    def parse(self, body, tools):
        data = json.loads(body)
        if not isinstance(data, dict) or set(data) != {"name", "arguments"} or not isinstance(data["name"], str):
            raise ValueError("not {name, arguments}")
        return data["name"], data["arguments"]


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


class XmlCalls(ToolCallFormat):
    """Qwen3.5 ("qwen3_coder"): one ``<parameter=NAME>`` block per argument, inside ``<function=NAME>``.

    A value is raw text; the parameter's schema says how to read it: ``string``
    keeps the text as is, any other type reads it as JSON (``42``, ``true``,
    ``{"a": 1}``), as the template writes them (``tojson`` for objects and lists).
    A parameter the schema does not type is JSON when it reads as JSON, else text.
    """

    def constraint(self, schemas, parallel):
        # Lark, one rule per function and parameter, in the order the schema lists the properties
        rules, calls = [], []
        for i, (name, schema) in enumerate(schemas.items()):
            required = set(schema.get("required", []))
            parameters = []
            for j, (key, spec) in enumerate(schema.get("properties", {}).items()):
                value = self._value(name, key, spec)
                if value is None:  # text, ended by the first closing tag: a lazy lexeme stops at the first match
                    length = f"{{{spec.get('minLength', 0)},{spec.get('maxLength', '')}}}"
                    rules.append(f"f{i}_v{j}[lazy]: /(?s:.{length})" + r"\n<\/parameter>\n/")
                    value = f"f{i}_v{j}"
                rules.append(f"f{i}_p{j}: {json.dumps(f'<parameter={key}>' + chr(10))} {value}")
                parameters.append(f"f{i}_p{j}" + ("" if key in required else "?"))
            head = json.dumps(f"{self.start}\n<function={name}>\n")
            rules.append(f"f{i}: {head} {' '.join(parameters)} {json.dumps('</function>' + chr(10) + self.end)}")
            calls.append(f"f{i}")
        more = ' ("\\n" block)*' if parallel else ""
        return OutputConstraint.grammar("\n".join([f"start: block{more}", f"block: {' | '.join(calls)}", *rules]) + "\n")

    def _value(self, function: str, key: str, spec: object) -> str | None:
        """The Lark of one parameter's value and its closing tag: JSON, a string's enum, or None (text, bounded
        by the schema's minLength / maxLength; other string keywords are refused, never ignored)."""
        close = json.dumps("\n</parameter>\n")
        if not isinstance(spec, dict) or "type" not in spec:
            raise ToolRequestError(f"tools: the parameter {key!r} of {function!r} has no 'type': the {self.name} call "
                                   "format writes values as bare text, which only the type can tell how to read",
                                   "tools")
        if spec["type"] != "string":
            return f"{json_rule(spec)} {close}"
        if isinstance(spec.get("enum"), list) and all(isinstance(v, str) for v in spec["enum"]):
            return "(" + " | ".join(json.dumps(v) for v in spec["enum"]) + f") {close}"
        others = sorted(set(spec) - {"type", "description", "title", "examples", "default", "minLength", "maxLength"})
        if others:
            raise ToolRequestError(f"tools: the string parameter {key!r} of {function!r} uses {', '.join(others)}, which "
                                   f"the {self.name} call format's grammar cannot enforce (its strings are bare text)",
                                   "tools")
        return None

    def parse(self, body, tools):
        function = _XML_FUNCTION.fullmatch(body)
        if function is None:
            raise ValueError("no <function=...> block")
        name, inner = function.group(1), function.group(2)
        properties = tools.get(name, {}).get("properties", {})
        arguments, at = {}, 0
        for match in _XML_PARAMETER.finditer(inner):
            if inner[at:match.start()].strip():
                raise ValueError("text between parameters")
            key, text = match.group(1), match.group(2)
            kind = properties.get(key, {}).get("type") if isinstance(properties.get(key), dict) else None
            arguments[key] = text if kind == "string" else _json_or_text(text) if kind is None else json.loads(text)
            at = match.end()
        if inner[at:].strip():
            raise ValueError("text after the parameters")
        return name, arguments


def _json_or_text(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


class Gemma4Calls(ToolCallFormat):
    """Gemma 4: ``<|tool_call>call:NAME{key:value,...}<tool_call|>``.

    Strings are written between ``<|"|>`` marks and unescaped; numbers,
    ``true``/``false``/``null``, lists ``[...]`` and objects ``{key:value}``
    (keys bare) as in JSON.
    """

    QUOTE = '<|"|>'

    def parse(self, body, tools):
        match = re.fullmatch(r"call:([A-Za-z0-9_-]+)(\{.*\})", body, re.S)
        if match is None:
            raise ValueError("not call:NAME{...}")
        value, at = self._value(match.group(2), 0)
        if at != len(match.group(2)):
            raise ValueError("text after the arguments")
        return match.group(1), value

    def _value(self, text: str, at: int) -> tuple[object, int]:
        if text.startswith(self.QUOTE, at):
            close = text.find(self.QUOTE, at + len(self.QUOTE))
            if close < 0:
                raise ValueError("an unclosed string")
            return text[at + len(self.QUOTE):close], close + len(self.QUOTE)
        if text.startswith("{", at) or text.startswith("[", at):
            return self._container(text, at)
        scalar = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null").match(text, at)
        if scalar is None:
            raise ValueError(f"no value at {at}")
        return json.loads(scalar.group()), scalar.end()

    def _container(self, text: str, at: int) -> tuple[dict[str, object] | list[object], int]:
        is_object, close = text[at] == "{", "}" if text[at] == "{" else "]"
        items: dict[str, object] | list[object] = {} if is_object else []
        at += 1
        while not text.startswith(close, at):
            if items:
                if not text.startswith(",", at):
                    raise ValueError(f"',' expected at {at}")
                at += 1
            if is_object:
                key = re.compile(r'<\|"\|>(.*?)<\|"\|>|([A-Za-z0-9_-]+)', re.S).match(text, at)
                if key is None or not text.startswith(":", key.end()):
                    raise ValueError(f"a key expected at {at}")
                items[key.group(1) if key.group(1) is not None else key.group(2)], at = self._value(text, key.end() + 1)
            else:
                value, at = self._value(text, at)
                items.append(value)
        return items, at + 1


QWEN_JSON = JsonCalls("qwen-json", "<tool_call>", "</tool_call>", sign='"arguments": ')
QWEN_XML = XmlCalls("qwen-xml", "<tool_call>", "</tool_call>", sign="<function=")
GEMMA4 = Gemma4Calls("gemma4", "<|tool_call>", "<tool_call|>", sign="<|tool_call>call:", extra_markers=('<|"|>',))
#: Every known format, the most specific sign first (a Qwen3.5 template also holds '<tool_call>').
FORMATS = (GEMMA4, QWEN_XML, QWEN_JSON)


def format_of(template_source: str | None) -> ToolCallFormat | None:
    """The call format of the chat template ``template_source``; None when it writes no calls.

    Decided from the template's text: the template writes the calls of earlier
    assistant turns, so it holds the format's markers (and its :attr:`sign`).
    """
    if not template_source:
        return None
    for fmt in FORMATS:
        if fmt.start in template_source and fmt.sign in template_source:
            return fmt
    return None
