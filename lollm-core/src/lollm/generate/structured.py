"""Structured output: constrain generation to a JSON schema, a regex or a grammar, one token mask per step.

The model still proposes logits over its whole vocabulary; before each token is
sampled, a *matcher* says which ids may come next without leaving the language of
the constraint, and every other id gets ``-inf``. docs/structured-output.md tells
the story (tokens that span grammar states, the bitmask, byte-level BPE); the work
itself is done by `llguidance <https://github.com/guidance-ai/llguidance>`_ (chosen
over xgrammar by the figures in that page), fed with lollm's *own* tokenizer data:
each id's bytes as :meth:`lollm.tokenizer.Tokenizer.token_bytes` decodes them, and
the special tokens.

The three pieces, in the order a request uses them::

    constraint = OutputConstraint.json_schema({"type": "object", ...})   # what the output must follow
    compiled = compile_constraint(constraint, tokenizer, vocab_size=model.vocab_size, stop_ids=stop_ids)
    matcher = compiled.matcher()          # per request: its own state
    for each step:
        logits = matcher.mask(logits)     # (V,): forbidden ids -> -inf   (generate.py does this)
        token = sample(logits)
        matcher.accept(token)             # advance; matcher.can_end says whether an end id is allowed

* :class:`OutputConstraint`: frozen, no torch, no library: a ``kind`` and its ``value``
  (``json_object``, ``json_schema``, ``regex``, ``grammar``). The CLI and the server
  build one; :meth:`OutputConstraint.lark` is its grammar in llguidance's Lark syntax.
* :func:`compile_constraint`: checks the constraint against the tokenizer (ConstraintError
  naming an unsupported schema keyword, a bad regex, a bad grammar) and returns a
  :class:`CompiledConstraint`, which makes one :class:`TokenMatcher` per request.
* :func:`json_rule` / :func:`tagged_json`: for tool calls, a wrapper text around JSON that
  follows a schema (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``),
  as a grammar constraint.

JSON is generated without free whitespace: ``", "`` between items and ``": "`` after keys,
nothing else between tokens of the syntax (a model cannot loop on spaces or newlines
inside an object). The end-of-sequence ids (``stop_ids``) are allowed exactly when the
output is complete; a grammar that is complete and cannot grow allows only them.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

import llguidance

from lollm.errors import LollmError

# Lazy imports below: numpy and torch, in TokenMatcher, so that the CLI can check a constraint
# (check_constraint, while it checks its flags) before torch is imported; the tokenizer package
# (jinja2 and all) is imported for the annotations only.
if TYPE_CHECKING:
    import numpy as np
    import torch

    from lollm.tokenizer import Tokenizer

#: The kinds of :class:`OutputConstraint`, with OpenAI's names for the first two.
KINDS = ("json_object", "json_schema", "regex", "grammar")

#: llguidance's JSON options for every schema: fixed separators, no free whitespace; keywords
#: it cannot enforce are an error (``lenient`` false), never ignored.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


class ConstraintError(LollmError):
    """A constraint that cannot be enforced: an unsupported JSON-schema keyword, a bad regex or grammar, no end id.

    ``reason``: the cause alone, without the constraint's description (``Unimplemented keys:
    ["uniqueItems"]``), for callers that name the constraint their own way.
    """

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason if reason is not None else message


@dataclass(frozen=True)
class OutputConstraint:
    """What the generated text must follow (the request's ``response_format``, ``--json-schema``, ...).

    kind:  ``"json_object"`` (any JSON object; value None), ``"json_schema"`` (value: the
           schema, a dict), ``"regex"`` (value: the pattern, str; the whole output must match
           it, Rust ``regex`` syntax), or ``"grammar"`` (value: a grammar in llguidance's Lark
           syntax, str: ``start: ...``; ``%json {schema}`` embeds a JSON schema, a special
           token is written ``<|im_end|>``).
    name:  the schema's name (OpenAI's ``json_schema.name``), for messages only.

    Build one with the class methods; ConstraintError for a value of the wrong type.
    Only :func:`compile_constraint` checks the value itself.
    """

    kind: str
    value: dict[str, object] | str | None = None
    name: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r} (known: {', '.join(KINDS)})")
        wanted = {"json_object": type(None), "json_schema": dict, "regex": str, "grammar": str}[self.kind]
        if not isinstance(self.value, wanted):
            what = "a JSON object (dict)" if wanted is dict else "no value" if wanted is type(None) else "a string"
            raise ConstraintError(f"a {self.kind} constraint takes {what}, got {type(self.value).__name__}")

    @classmethod
    def json_object(cls) -> OutputConstraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, object], name: str | None = None) -> OutputConstraint:
        """JSON following ``schema`` (a JSON Schema, as a mapping; copied); ``name`` for messages only."""
        return cls("json_schema", dict(schema), name)

    @classmethod
    def regex(cls, pattern: str) -> OutputConstraint:
        """Text that ``pattern`` (Rust ``regex`` syntax) matches as a whole."""
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, lark: str) -> OutputConstraint:
        """Text of the grammar ``lark`` (llguidance's Lark syntax, a ``start:`` rule)."""
        return cls("grammar", lark)

    def lark(self) -> str:
        """This constraint as one grammar in llguidance's Lark syntax (what :func:`compile_constraint` compiles)."""
        if self.kind == "json_object":
            return "start: " + json_rule({"type": "object"})
        if self.kind == "json_schema":
            return "start: " + json_rule(self.value)
        if self.kind == "regex":
            return "start: " + _lark_regex(self.value)
        return self.value

    def describe(self) -> str:
        """A short description for logs and errors: ``json_schema 'weather'``, ``regex '[0-9]+'``."""
        if self.kind == "json_schema" and self.name:
            return f"json_schema {self.name!r}"
        if self.kind in ("regex", "grammar"):
            text = self.value if len(self.value) <= 40 else self.value[:37] + "..."
            return f"{self.kind} {text!r}"
        return self.kind


def json_rule(schema: Mapping[str, object]) -> str:
    """The Lark item ``%json {...}`` for JSON following ``schema`` (a dict), with lollm's JSON options.

    Embed it in a grammar of your own (``"start: \\"<tool_call>\\" " + json_rule(s)``);
    ``x-guidance`` options the schema carries are replaced by :data:`JSON_OPTIONS`.
    ConstraintError when ``schema`` is not a mapping.
    """
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"a JSON schema must be a JSON object, got {type(schema).__name__}")
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def tagged_json(begin: str, schema: Mapping[str, object], end: str, *, min_count: int = 1, max_count: int | None = 1,
                separator: str = "\n") -> OutputConstraint:
    """A grammar constraint: ``begin``, JSON following ``schema``, ``end``; that block repeated.

    The block occurs ``min_count`` .. ``max_count`` times (None: no upper bound), blocks
    separated by ``separator``. For Qwen's tool calls::

        tagged_json("<tool_call>\\n", {"type": "object", "properties": {"name": {"const": "get_weather"},
                    "arguments": params}, "required": ["name", "arguments"]}, "\\n</tool_call>")

    ``begin`` / ``end`` are literal text; where the tokenizer has an id whose bytes are that
    text (Qwen's ``<tool_call>``, an added token that is not special) the model may emit that
    id or the text's ordinary pieces. ConstraintError for counts out of order.
    """
    if min_count < 0 or (max_count is not None and (max_count < max(min_count, 1))):
        raise ConstraintError(f"tagged_json: need 0 <= min_count <= max_count and max_count >= 1, got {min_count}, {max_count}")
    block = f"{json.dumps(begin)} body {json.dumps(end)}"
    more = "" if max_count == 1 else f"({json.dumps(separator)} block)" + ("*" if max_count is None else f"{{0,{max_count - 1}}}")
    start = "block " + more if min_count >= 1 else f"(block {more})?"
    return OutputConstraint.grammar(f"start: {start}\nblock: {block}\nbody: {json_rule(schema)}\n")


def open_object(schema: object, path: str = "") -> str | None:
    """The path (``.properties.user``, ``.items``, ``.anyOf[0]``; ``""`` the root) of the first object in ``schema``
    that lacks ``"additionalProperties": false``; None when every object has it.

    OpenAI's *strict* structured outputs require it of every object and refuse a schema
    without it; plain JSON Schema lets an object without it hold any extra key.
    """
    if isinstance(schema, list):
        return next((gap for i, item in enumerate(schema) if (gap := open_object(item, f"{path}[{i}]")) is not None), None)
    if not isinstance(schema, Mapping):
        return None
    kinds = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    if ("object" in kinds or "properties" in schema) and schema.get("additionalProperties") is not False:
        return path
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), Mapping) else ():
            if (gap := open_object(sub, f"{path}.{key}.{name}")) is not None:
                return gap
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else"):
        if key in schema and (gap := open_object(schema[key], f"{path}.{key}")) is not None:
            return gap
    return None


def _lark_regex(pattern: str) -> str:
    """A regex as a Lark terminal ``/.../`` (llguidance's own conversion escapes the slashes that need it)."""
    return "/" + llguidance.regex_to_lark(pattern) + "/"


# -- the compiled side: llguidance, fed with lollm's tokenizer ----------------------------------------


class _TokenizerData:
    """What llguidance reads from a tokenizer (its ``TokenizerWrapper`` protocol), built from lollm's own.

    tokens: each id's bytes (``Tokenizer.token_bytes``); special tokens as ``b"\\xff" + name``, which
    llguidance takes as "not text: only a grammar that names it allows it"; ids past the
    tokenizer (a model's padded embedding rows) as ``b""``, which no grammar allows.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]):
        self._tokenizer = tokenizer
        special = set(tokenizer.special_token_ids)
        self.tokens = [
            b"" if i >= tokenizer.vocab_size else
            b"\xff" + tokenizer.id_to_token(i).encode() if i in special else tokenizer.token_bytes(i)
            for i in range(vocab_size)
        ]
        self.eos_token_id = stop_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in special if i < vocab_size)

    def __call__(self, text: bytes | str) -> list[int]:
        """Token ids of a text (llguidance tokenizes forced text with it); special tokens stay text."""
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(text, add_special_tokens=False, parse_special=False)


#: tokenizer -> {(vocab_size, stop ids): llguidance.LLTokenizer}; building one reads every id (about 1 s).
_VOCABULARIES: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary())
_VOCABULARIES_LOCK = threading.Lock()  # the server prepares requests in several threads: build each one once


def _vocabulary(tokenizer: Tokenizer, vocab_size: int, stop_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` over the model's ``vocab_size`` ids, made once per tokenizer."""
    with _VOCABULARIES_LOCK:
        per_tokenizer = _VOCABULARIES.setdefault(tokenizer, {})
        key = (vocab_size, stop_ids)
        if key not in per_tokenizer:
            data = _TokenizerData(tokenizer, vocab_size, list(stop_ids))
            per_tokenizer[key] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(data), n_vocab=vocab_size,
                                                        eos_token=list(stop_ids))
        return per_tokenizer[key]


def compile_constraint(constraint: OutputConstraint, tokenizer: Tokenizer, *, vocab_size: int,
                       stop_ids: Iterable[int]) -> CompiledConstraint:
    """Check ``constraint`` and prepare it for ``tokenizer`` (a :class:`lollm.tokenizer.Tokenizer`).

    vocab_size: the model's vocabulary (its logits' length, ``model.vocab_size``; may exceed the
    tokenizer's). stop_ids: the end-of-sequence ids, allowed once the output is complete (at
    least one). The first call per tokenizer reads its whole vocabulary (about 1 s for 152k ids);
    later calls reuse it. Raises ConstraintError naming what cannot be enforced: an
    unsupported JSON-schema keyword (``Unimplemented keys: ["uniqueItems"]``), a regex or
    grammar that does not parse, no stop id, or a stop id outside the vocabulary.
    """
    stops = tuple(sorted(set(stop_ids)))
    if not stops:
        raise ConstraintError(f"{constraint.describe()}: constrained output needs an end-of-sequence id, and the model has none")
    if stops[0] < 0 or stops[-1] >= vocab_size:
        raise ConstraintError(f"{constraint.describe()}: the end-of-sequence ids {list(stops)} are not all ids of the "
                              f"model's vocabulary (0 .. {vocab_size - 1})")
    check_constraint(constraint)
    vocabulary = _vocabulary(tokenizer, vocab_size, stops)
    grammar = constraint.lark()
    _check_grammar(constraint, grammar, vocabulary)
    return CompiledConstraint(constraint, grammar, vocabulary, vocab_size)


def check_constraint(constraint: OutputConstraint) -> None:
    """ConstraintError when ``constraint`` cannot be enforced whatever the tokenizer (a quick check, no vocabulary).

    What :func:`compile_constraint` refuses, found before a model loads (``lollm run --json-schema``):
    an unsupported JSON-schema keyword, a regex or grammar that does not parse.
    """
    _check_grammar(constraint, constraint.lark(), None)


def _check_grammar(constraint: OutputConstraint, grammar: str, vocabulary: llguidance.LLTokenizer | None) -> None:
    """ConstraintError when llguidance refuses ``grammar`` (for ``vocabulary``; None: for any), with its reason."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocabulary)
    if failed:
        reason = _first_line(messages)
        raise ConstraintError(f"{constraint.describe()} cannot be enforced: {reason}", reason)


def _first_line(messages: list[str]) -> str:
    """llguidance's message on one line, without its echo of our grammar (the ``1 | start: ...`` and ``^`` lines),
    of a bad regex, or the position."""
    lines = [line for message in messages for line in message.splitlines()
             if not re.match(r"\s*\d+ \|", line) and not re.fullmatch(r"\s*\^+\s*", line)]
    text = re.sub(r"^at \d+\(\d+\): ", "", "\n".join(lines).strip())
    # a regex's parse error: "regex parse error:", the pattern echoed, "error: <cause>" -> one line
    text = re.sub(r"regex parse error:\n.*?\n\s*error: ", "regex parse error: ", text, flags=re.S)
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or "unknown error"


class CompiledConstraint:
    """A checked constraint bound to one vocabulary; :meth:`matcher` makes a fresh per-request matcher."""

    def __init__(self, constraint: OutputConstraint, grammar: str, vocabulary: llguidance.LLTokenizer, vocab_size: int):
        self.constraint, self.grammar, self._vocabulary, self.vocab_size = constraint, grammar, vocabulary, vocab_size

    def matcher(self) -> TokenMatcher:
        """A new :class:`TokenMatcher` at the start of the constraint (one per request)."""
        return TokenMatcher(self)


class TokenMatcher:
    """One request's position in the constraint: which ids may come next, and advancing by the chosen one.

    Not shared between requests (it holds the parse state). Every method raises
    ConstraintError if the matcher was driven off its language (a token accepted that the
    mask forbade): that is a bug in the caller, never silently ignored.
    """

    def __init__(self, compiled: CompiledConstraint):
        import numpy as np

        self.compiled = compiled
        self._matcher = llguidance.LLMatcher(compiled._vocabulary, compiled.grammar, log_level=0)
        self._check()
        self._words = np.zeros((compiled.vocab_size + 31) // 32, dtype=np.int32)  # one bit per id

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"{self.compiled.constraint.describe()}: {self._matcher.get_error()}")

    def bitmask(self) -> np.ndarray:
        """The ids allowed next, packed 32 to an int32 word: bit ``i % 32`` of word ``i // 32`` (ceil(V/32),)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self._check()
        return self._words

    def allowed(self) -> torch.Tensor:
        """The ids allowed next as a bool tensor (V,) on the CPU (the bitmask, unpacked)."""
        import numpy as np
        import torch

        bits = np.unpackbits(self.bitmask().view(np.uint8), bitorder="little")[: self.compiled.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (V,) any float dtype, with every id the constraint forbids set to ``-inf`` (a new tensor)."""
        allowed = self.allowed().to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance by the chosen ``token``; ConstraintError if the constraint forbids it."""
        if not self._matcher.consume_token(token):
            raise ConstraintError(f"{self.compiled.constraint.describe()}: token {token} is not allowed here "
                                  f"({self._matcher.get_error()})")

    @property
    def can_end(self) -> bool:
        """The output so far is complete: an end-of-sequence id is allowed now."""
        return self._matcher.is_accepting()

    @property
    def is_terminated(self) -> bool:
        """Nothing but an end-of-sequence id can follow (or one was accepted)."""
        return self._matcher.is_stopped()

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` accepted tokens."""
        if not self._matcher.rollback(count):
            self._check()

    def reset(self) -> None:
        """Back to the start, as a fresh matcher."""
        self._matcher.reset()
