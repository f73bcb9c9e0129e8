"""The normalizer: rewrite the text into a canonical form before it is split into words.

Unicode often has several byte sequences for what a reader sees as the same
text: "é" can be one code point (U+00E9) or "e" followed by a combining acute
accent (U+0065 U+0301). A normalizer picks one of them so that both spellings
get the same tokens. Qwen2's tokenizer, for instance, applies NFC (compose
characters where possible).

SentencePiece-style tokenizers (Llama 2, Gemma) use the normalizer for another
job: they write every space as "▁" (U+2581, "lower one eighth block"), so that
a space is an ordinary visible character of the vocabulary (``"▁world"``).
tokenizer.json spells this ``Replace(" ", "▁")``, sometimes after
``Prepend("▁")`` (Llama 2 puts a "▁" in front of the text, so that the first
word is spelled like a word in the middle of a sentence).

Implemented: the Unicode normalization forms, ``Replace``, ``Prepend`` and a
``Sequence`` of them. Any other normalizer type in tokenizer.json is refused
with a :class:`~lollm.errors.TokenizerError` rather than silently skipped,
because skipping it would produce different token ids than the model was
trained on.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

import regex

from lollm.errors import TokenizerError

#: A normalizer is any function from text to text.
Normalizer = Callable[[str], str]

_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def build_normalizer(spec: Any, source: str) -> Normalizer | None:
    """Build the normalizer described by tokenizer.json's ``normalizer`` entry (``None`` = no normalization)."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or "type" not in spec:
        raise TokenizerError(f"{source}: 'normalizer' must be null or an object with a 'type', got {spec!r}")
    kind = spec["type"]
    if kind in _UNICODE_FORMS:
        return lambda text: unicodedata.normalize(kind, text)
    if kind == "Sequence":
        parts = spec.get("normalizers") or []
        if not isinstance(parts, list):
            raise TokenizerError(f"{source}: a Sequence normalizer's 'normalizers' must be a list, got {parts!r}")
        steps = [build_normalizer(step, source) for step in parts]
        steps = [step for step in steps if step is not None]
        if not steps:
            return None

        def sequence(text: str) -> str:
            for step in steps:
                text = step(text)
            return text

        return sequence
    if kind == "Replace":
        return _replace(spec, source)
    if kind == "Prepend":
        prefix = spec.get("prepend")
        if not isinstance(prefix, str):
            raise TokenizerError(f"{source}: Prepend normalizer needs a string 'prepend', got {spec!r}")
        # Like the Hugging Face library: an empty text stays empty.
        return lambda text: prefix + text if text else text
    raise TokenizerError(f"{source}: normalizer type {kind!r} is not implemented by lollm")


def _replace(spec: dict, source: str) -> Normalizer:
    """``Replace``: every match of ``pattern`` (a plain string or a regex) becomes ``content``."""
    pattern, content = spec.get("pattern"), spec.get("content")
    if not isinstance(content, str):
        raise TokenizerError(f"{source}: Replace normalizer needs a string 'content', got {spec!r}")
    if isinstance(pattern, dict) and isinstance(pattern.get("String"), str) and pattern["String"]:
        old = pattern["String"]
        return lambda text: text.replace(old, content)
    if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
        try:
            compiled = regex.compile(pattern["Regex"])
        except regex.error as error:
            raise TokenizerError(f"{source}: cannot compile the Replace regex {pattern['Regex']!r}: {error}") from None
        # A function as replacement: `content` is inserted literally (no backslash escapes).
        return lambda text: compiled.sub(lambda _match: content, text)
    raise TokenizerError(f"{source}: Replace normalizer has no 'pattern' {{'String'|'Regex': ...}}: {spec!r}")
