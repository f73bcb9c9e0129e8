"""Chat templates: turn a list of chat messages into the one prompt string the model was trained on.

A chat model never sees "messages"; it sees text with control tokens, e.g. for Qwen::

    <|im_start|>system
    You are a helpful assistant.<|im_end|>
    <|im_start|>user
    hi<|im_end|>
    <|im_start|>assistant

Each model family formats this differently, so the model ships its format as a
Jinja template (in ``chat_template.jinja`` or in tokenizer_config.json's
``chat_template``). We render it the way Hugging Face transformers does, so
that our prompt is byte-for-byte the one the model was fine-tuned on:

* a sandboxed, immutable Jinja environment (templates come from the internet:
  they must not reach Python internals or modify our data), with
  ``trim_blocks`` and ``lstrip_blocks`` (a ``{% ... %}`` tag line leaves no
  newline or indentation behind) and the ``loopcontrols`` extension
  (``{% break %}``, ``{% continue %}``);
* the ``{% generation %}...{% endgeneration %}`` tag (transformers uses it to
  mark assistant text for training masks) renders its body unchanged;
* the helpers templates expect: ``raise_exception(message)`` (a template's way
  to reject input; it raises :class:`~lollm.errors.TokenizerError`),
  ``strftime_now(format)`` (today's date, some templates print it) and a
  ``tojson`` filter that, unlike Jinja's own, does not escape HTML characters
  or non-ASCII text;
* the variables ``messages``, ``tools``, ``documents``,
  ``add_generation_prompt``, the special tokens by name (``bos_token``,
  ``eos_token``, ...) and any extra keyword given by the caller (for example
  ``enable_thinking``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lollm.errors import TokenizerError

# Names under which a message's reasoning text may arrive. transformers copies
# the first one present to "reasoning_content" (what templates read) and to
# "thinking" (what gpt-oss templates read); we do the same.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}`` renders ``body`` as if the tags were not there."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        # A Scope keeps `{% set %}` inside the block local to it, as a call block would.
        return nodes.Scope(body, lineno=lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter of transformers: plain ``json.dumps`` (no HTML escaping, UTF-8 kept as is)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """The current local time formatted with ``format`` (e.g. ``"%d %b %Y"``)."""
    return datetime.now().strftime(format)


class ChatTemplate:
    """One compiled chat template; ``origin`` says where it came from (used in every error message)."""

    def __init__(self, source: str, origin: str) -> None:
        if not isinstance(source, str):
            raise TokenizerError(f"{origin}: the chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.origin = origin
        self._compiled: jinja2.Template | None = None
        self._variables: frozenset[str] | None = None

    def _template(self) -> jinja2.Template:
        # Compiled on first use, so that a broken template only stops chat, not plain text completion.
        if self._compiled is None:
            origin = self.origin

            def raise_exception(message: str) -> None:
                raise TokenizerError(f"chat template ({origin}) rejected the input: {message}")

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._compiled = env.from_string(self.source)
                self._variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(self.source)))
            except jinja2.TemplateSyntaxError as error:
                raise TokenizerError(
                    f"chat template ({origin}) is not valid Jinja: {error.message} (template line {error.lineno})"
                ) from None
        return self._compiled

    def reads(self, name: str) -> bool:
        """Whether the template reads the variable ``name`` (e.g. ``enable_thinking``).

        Decided from the template's syntax tree (the names it uses without
        setting them), not from a family's declaration: a flag works exactly
        where the template looks at it.
        """
        self._template()
        return name in self._variables

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render the prompt text for ``messages``.

        ``special_tokens`` maps names such as ``"bos_token"`` to their text;
        ``template_kwargs`` become template variables too and win over them.
        """
        variables: dict[str, Any] = dict(special_tokens or {})
        variables.update(template_kwargs)
        variables.update(
            messages=prepare_messages(messages, self.origin),
            tools=_check_tools(tools, self.origin),
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
        template = self._template()
        try:
            return template.render(**variables)
        except TokenizerError:
            raise
        except jinja2.TemplateError as error:
            raise TokenizerError(f"chat template ({self.origin}) failed: {type(error).__name__}: {error}") from error
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as error:
            # Python errors raised by expressions inside the template (e.g. "a" + 1).
            raise TokenizerError(f"chat template ({self.origin}) failed: {type(error).__name__}: {error}") from error


def prepare_messages(messages: Any, origin: str = "chat template") -> list[dict]:
    """Copy the messages into the shape templates expect, as transformers does.

    Each message must be a mapping. Keys whose value is ``None`` are dropped
    (APIs often send ``"tool_calls": None``; templates test for presence), and
    reasoning text given as ``thinking`` or ``reasoning`` is also made
    available as ``reasoning_content``.
    """
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"{origin}: messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise TokenizerError(f"{origin}: cannot apply a chat template to an empty list of messages")
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"{origin}: message #{index} must be a dict, got {type(message).__name__}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _check_tools(tools: Any, origin: str) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, Mapping) for tool in tools):
        raise TokenizerError(f"{origin}: tools must be a list of JSON-schema dicts")
    return list(tools)
