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

A template is untrusted code from the checkpoint, so every render is bounded
(:class:`BoundedSandbox`): CPU time, the size of the output and of every value
the template builds, integer sizes, how deep calls nest. A template that
exceeds a bound is a :class:`~lollm.errors.TokenizerError` naming it; a
template that stays within them renders exactly as in transformers.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import update_wrapper
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from jinja2.utils import _PassArg
from jinja2.visitor import NodeTransformer

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


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    """The ``tojson`` filter of transformers: plain ``json.dumps`` (no HTML escaping, UTF-8 kept as is).

    With ``indent`` the text can be far longer than the data, so it is built
    piece by piece and stops at :data:`MAX_OUTPUT_CHARS`.
    """
    if indent is None:
        return json.dumps(value, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        if size > MAX_OUTPUT_CHARS:
            raise _LimitExceeded(f"tojson(indent={indent!r}) would exceed {MAX_OUTPUT_CHARS:,} characters")
        pieces.append(piece)
    return "".join(pieces)


def _strftime_now(format: str) -> str:
    """The current local time formatted with ``format`` (e.g. ``"%d %b %Y"``)."""
    return datetime.now().strftime(format)


# ----------------------------------------------------------------- bounds of one render
#
# A template is a small program shipped by whoever published the checkpoint.
# jinja2's sandbox already keeps it away from Python internals; the bounds
# below keep it from running forever or filling memory. Real templates stay
# far inside every one of them (a few loops over the messages, a few KB of
# output), so they render exactly as in transformers.

#: CPU time one render may take, in seconds (of the rendering thread).
MAX_RENDER_SECONDS = 2.0
#: Longest output, and longest string, list or dict a template may build, in characters / items.
#: About two million tokens of text: far above any context window lollm serves.
MAX_OUTPUT_CHARS = 8_000_000
#: Largest width or count a template may pass to a padding, indenting or batching
#: operation (``indent(n)``, ``"%10s"``, ``ljust(n)``, ``batch(n)``), and most items of ``range()``.
MAX_WIDTH = 100_000
#: Largest integer (in bits) an arithmetic operation may produce; 2**65536 has about 20,000 digits.
MAX_INT_BITS = 65_536
#: How deep calls may nest (macros calling macros, recursive loops); real templates use a few levels.
MAX_CALL_DEPTH = 64


class _LimitExceeded(Exception):
    """A render went past one of the bounds; :meth:`ChatTemplate.render` names the template."""


class _Budget:
    """What one render has used so far: steps (with a CPU-time check every 256), call depth."""

    __slots__ = ("deadline", "steps", "depth")

    def __init__(self, seconds: float) -> None:
        self.deadline = time.thread_time() + seconds
        self.steps = 0
        self.depth = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps & 255 == 0 and time.thread_time() > self.deadline:
            raise _LimitExceeded(f"ran longer than {MAX_RENDER_SECONDS} s of CPU time (an endless or huge loop?)")


#: The budget of the render running in this thread (or asyncio task); None outside a render.
_BUDGET: ContextVar[_Budget | None] = ContextVar("lollm_chat_template_budget", default=None)


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()


def _sized(value: object, what: str) -> Any:
    """Return ``value`` unless it is a string or container longer than :data:`MAX_OUTPUT_CHARS`."""
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_OUTPUT_CHARS:
        unit = "characters" if isinstance(value, str) else "items"
        raise _LimitExceeded(f"{what} built a {type(value).__name__} of {len(value):,} {unit} (limit {MAX_OUTPUT_CHARS:,})")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise _LimitExceeded(f"{what} built an integer of {value.bit_length():,} bits (limit {MAX_INT_BITS:,})")
    return value


def _check_size(size: int, what: str) -> None:
    if size > MAX_OUTPUT_CHARS:
        raise _LimitExceeded(f"{what} would build {size:,} characters or items (limit {MAX_OUTPUT_CHARS:,})")


def _check_width(width: object, what: str) -> None:
    if isinstance(width, int) and not isinstance(width, bool) and abs(width) > MAX_WIDTH:
        raise _LimitExceeded(f"{what}: {width} is larger than the limit of {MAX_WIDTH:,}")


def _bits(value: object) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 0


def _check_binop(operator: str, left: object, right: object) -> None:
    """Refuse an operation whose result would be too big *before* computing it."""
    sized = (str, bytes, list, tuple)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if _bits(left) * right > MAX_INT_BITS:
            raise _LimitExceeded(f"{left} ** {right} would have about {_bits(left) * right:,} bits (limit {MAX_INT_BITS:,})")
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            if _bits(left) + _bits(right) > MAX_INT_BITS:
                raise _LimitExceeded(f"a product of {_bits(left) + _bits(right):,} bits exceeds the limit of {MAX_INT_BITS:,}")
        elif isinstance(left, sized) and isinstance(right, int):
            _check_size(len(left) * right, "repeating a sequence with '*'")
        elif isinstance(right, sized) and isinstance(left, int):
            _check_size(len(right) * left, "repeating a sequence with '*'")
    elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        _check_size(len(left) + len(right), "'+'")
    elif operator == "%" and isinstance(left, str):
        _check_printf(left)


# width and precision in a printf-style conversion: "%-10.3f", "%*d"
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str) -> None:
    for match in _PRINTF_FIELD.finditer(fmt):
        for number in match.groups():
            if number == "*":
                raise _LimitExceeded("'%*d'-style widths taken from the arguments are not allowed in chat templates")
            if number is not None:
                _check_width(int(number), f"the width in {match.group()!r}")


class _BoundedFormatter(SandboxedFormatter):
    """``str.format`` in the sandbox, refusing field widths and precisions above :data:`MAX_WIDTH`."""

    def format_field(self, value: object, format_spec: str) -> Any:
        for number in re.findall(r"\d+", format_spec):
            _check_width(int(number), f"the format spec {format_spec!r}")
        _step()
        return super().format_field(value, format_spec)


def _bounded_str_method(method: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a call of a string method whose result would be too big (padding, replace, join)."""
    text: str = method.__self__
    name = method.__name__
    if name in ("ljust", "rjust", "center", "zfill") and args:
        _check_width(args[0], f"str.{name}()")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        _check_width(tab, "str.expandtabs()")
        if isinstance(tab, int):
            _check_size(len(text) + text.count("\t") * max(tab, 0), "str.expandtabs()")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_size(_replaced_size(text, args[0], args[1]), "str.replace()")
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        parts = args[0]
        _check_size(sum(len(p) for p in parts if isinstance(p, str)) + len(text) * max(len(parts) - 1, 0), "str.join()")


def _replaced_size(text: str, old: str, new: str) -> int:
    count = text.count(old) if old else len(text) + 1
    return len(text) + count * (len(new) - len(old))


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap one of jinja2's filters: check its arguments before the call and its result after."""
    skip = 2 if _PassArg.from_obj(func) is not None else 1  # (context/environment,) value, arguments...

    def bounded(*args: object, **kwargs: object) -> Any:
        _refuse_outside_a_render()
        value, extra = args[skip - 1] if len(args) >= skip else None, args[skip:]
        for argument in (*extra, *kwargs.values()):
            _check_width(argument, f"filter {name!r}")
        if name == "indent" and isinstance(value, str):
            width = extra[0] if extra else kwargs.get("width", 4)
            per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            _check_size(len(value) + (value.count("\n") + 1) * per_line, "filter 'indent'")
        elif name == "format" and isinstance(value, str):
            _check_printf(value)
        elif name == "replace" and isinstance(value, str) and len(extra) >= 2:
            _check_size(_replaced_size(value, str(extra[0]), str(extra[1])), "filter 'replace'")
        _step()
        return _sized(func(*args, **kwargs), f"filter {name!r}")

    return update_wrapper(bounded, func)  # keeps jinja_pass_arg, so jinja2 passes the same arguments


def _refuse_outside_a_render() -> None:
    """Filters run only inside a render, under its budget.

    jinja2 folds a filter over constants at compile time (``{{ 'ab'|slice(99999)|list }}``
    would be computed, and written into the compiled code, before any budget
    exists); an exception there tells jinja2 the value is not a constant, so the
    filter runs at render time instead, bounded like everything else.
    """
    if _BUDGET.get() is None:
        raise _LimitExceeded("filters are not evaluated at compile time")


def _iterate(value: object) -> Iterator[Any]:
    """The iterable of every ``{% for %}``, one budget step per item (an empty loop body costs time too)."""
    budget = _BUDGET.get()
    for item in value:
        if budget is not None:
            budget.step()
        yield item


def _concat(parts: list[object]) -> str:
    """``a ~ b ~ c``: refused before it is built when the result would be too long."""
    _refuse_outside_a_render()
    texts = [str(part) for part in parts]
    _check_size(sum(len(t) for t in texts), "'~'")
    return "".join(texts)


class _GuardLoops(NodeTransformer):
    """Rewrite the parsed template: every loop iterates through :func:`_iterate`, every ``~`` is :func:`_concat`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "_lollm_iterate", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        parts = nodes.List(node.nodes, lineno=node.lineno)
        return nodes.Filter(parts, "_lollm_concat", [], [], None, None, lineno=node.lineno)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox plus bounds on time, size, integers and depth.

    Every place where a template can make Python do work goes through a check:
    attribute and item access, calls (macros, methods, globals), the operators
    ``+ * ** %`` (intercepted, so they are never folded at compile time either),
    every filter, every loop step and every piece of output. Sizes are checked
    *before* a big result is built where it can be predicted (``"x" * n``,
    ``indent(n)``, ``2 ** n``, format widths) and after otherwise. Time is the
    CPU time of the rendering thread, checked every 256 steps. Exceeding a
    bound raises an internal error that :meth:`ChatTemplate.render` turns into
    a TokenizerError naming the template.
    """

    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        for name, func in list(self.filters.items()):
            self.filters[name] = _bounded_filter(name, func)
        self.filters["_lollm_iterate"] = _iterate
        self.filters["_lollm_concat"] = _concat
        self.globals["range"] = self._range
        self.globals.pop("lipsum", None)  # generates text of any requested size; no chat template uses it

    @staticmethod
    def _range(*args: int) -> range:
        numbers = range(*args)
        if len(numbers) > MAX_WIDTH:
            raise _LimitExceeded(f"range() of {len(numbers):,} items exceeds the limit of {MAX_WIDTH:,}")
        return numbers

    def parse_bounded(self, source: str) -> nodes.Template:
        """Parse ``source`` and rewrite its loops and ``~`` (see :class:`_GuardLoops`)."""
        return _GuardLoops().visit(self.parse(source))

    def call_binop(self, context: Context, operator: str, left: object, right: object) -> Any:
        _step()
        _check_binop(operator, left, right)
        return _sized(super().call_binop(context, operator, left, right), f"{operator!r}")

    def getattr(self, obj: object, attribute: str) -> Any:
        _step()
        return _sized(super().getattr(obj, attribute), f"reading {attribute!r}")

    def getitem(self, obj: object, argument: object) -> Any:
        _step()
        return _sized(super().getitem(obj, argument), "reading an item")

    def call(__self, __context: Context, __obj: object, *args: object, **kwargs: object) -> Any:  # noqa: N805 (jinja2's signature)
        budget = _BUDGET.get()
        if isinstance(getattr(__obj, "__self__", None), str) and callable(__obj):
            _bounded_str_method(__obj, args, kwargs)
        if budget is None:
            return _sized(super().call(__context, __obj, *args, **kwargs), "a call")
        budget.step()
        if budget.depth >= MAX_CALL_DEPTH:
            raise _LimitExceeded(f"calls nest deeper than {MAX_CALL_DEPTH} levels (a macro that recurses without end?)")
        budget.depth += 1
        try:
            return _sized(super().call(__context, __obj, *args, **kwargs), "a call")
        finally:
            budget.depth -= 1

    def wrap_str_format(self, value: object) -> Callable[..., str] | None:
        # jinja2 hands out a safe wrapper of "...".format; ours also bounds the field widths.
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        text: str = value.__self__
        formatter = _BoundedFormatter(self)
        is_map = value.__name__ == "format_map"

        def bounded(*args: object, **kwargs: object) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            return _sized(type(text)(formatter.vformat(text, args, kwargs)), "str.format()")

        return update_wrapper(bounded, value)


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

            env = BoundedSandbox(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = _bounded_filter("tojson", _tojson)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                tree = env.parse_bounded(self.source)
                self._variables = frozenset(jinja2.meta.find_undeclared_variables(tree))
                self._compiled = env.from_string(tree)
            except jinja2.TemplateSyntaxError as error:
                raise TokenizerError(
                    f"chat template ({origin}) is not valid Jinja: {error.message} (template line {error.lineno})"
                ) from None
            except (RecursionError, SyntaxError, MemoryError) as error:
                # nesting deeper than jinja2's parser or Python's compiler can follow
                # ("too many statically nested blocks", a RecursionError in the parser)
                raise TokenizerError(
                    f"chat template ({origin}) nests too deeply to compile: {type(error).__name__}: {error}"
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
        **template_kwargs: object,
    ) -> str:
        """Render the prompt text for ``messages``.

        ``special_tokens`` maps names such as ``"bos_token"`` to their text;
        ``template_kwargs`` become template variables too and win over them.
        """
        variables: dict[str, object] = dict(special_tokens or {})
        variables.update(template_kwargs)
        variables.update(
            messages=prepare_messages(messages, self.origin),
            tools=_check_tools(tools, self.origin),
            documents=documents,
            add_generation_prompt=add_generation_prompt,
        )
        template = self._template()
        budget = _Budget(MAX_RENDER_SECONDS)
        token = _BUDGET.set(budget)
        try:
            pieces, size = [], 0
            for piece in template.generate(**variables):
                size += len(piece)
                if size > MAX_OUTPUT_CHARS:
                    raise _LimitExceeded(f"its output exceeds {MAX_OUTPUT_CHARS:,} characters")
                budget.step()
                pieces.append(piece)
            return "".join(pieces)
        except TokenizerError:
            raise
        except _LimitExceeded as error:
            raise TokenizerError(f"chat template ({self.origin}) stopped at a safety bound: {error}") from None
        except RecursionError:
            raise TokenizerError(
                f"chat template ({self.origin}) stopped at a safety bound: it nests too deeply (in its own code or in the data it walks)"
            ) from None
        except MemoryError:
            raise TokenizerError(f"chat template ({self.origin}) stopped: it ran out of memory") from None
        except jinja2.TemplateError as error:
            raise TokenizerError(f"chat template ({self.origin}) failed: {type(error).__name__}: {error}") from error
        except Exception as error:
            # Python errors raised by expressions inside the template ("a" + 1) or by the jinja2
            # filters it calls with bad arguments (truncate(0) fails an assert): the template's failure.
            raise TokenizerError(f"chat template ({self.origin}) failed: {type(error).__name__}: {error}") from error
        finally:
            _BUDGET.reset(token)


def prepare_messages(messages: object, origin: str = "chat template") -> list[dict]:
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


def _check_tools(tools: object, origin: str) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, Mapping) for tool in tools):
        raise TokenizerError(f"{origin}: tools must be a list of JSON-schema dicts")
    return list(tools)
