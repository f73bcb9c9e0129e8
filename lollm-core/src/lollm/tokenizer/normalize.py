"""The normalizer: rewrite the text into a canonical form before it is split into words.

Unicode often has several byte sequences for what a reader sees as the same
text: "é" can be one code point (U+00E9) or "e" followed by a combining acute
accent (U+0065 U+0301). A normalizer picks one of them so that both spellings
get the same tokens. Qwen2's tokenizer, for instance, applies NFC (compose
characters where possible).

Only the Unicode normalization forms (and a ``Sequence`` of them) are
implemented; any other normalizer type in tokenizer.json is refused with a
:class:`~lollm.errors.TokenizerError` rather than silently skipped, because
skipping it would produce different token ids than the model was trained on.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Any

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
        steps = [build_normalizer(step, source) for step in spec.get("normalizers", [])]
        steps = [step for step in steps if step is not None]
        if not steps:
            return None

        def sequence(text: str) -> str:
            for step in steps:
                text = step(text)
            return text

        return sequence
    raise TokenizerError(f"{source}: normalizer type {kind!r} is not implemented by lollm")
