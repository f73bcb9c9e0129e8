"""The pre-tokenizer: cut the text into words before BPE sees it.

BPE never merges across the boundaries the pre-tokenizer draws, so these
boundaries shape the vocabulary: with GPT-2's rule " hello" and "world" are
separate words, a run of digits is one word, and "don't" ends in a "'t" word.
Qwen2 (and Llama 3) use a sharper regex that, among other things, cuts every
digit into its own word ("2024" -> "2", "0", "2", "4") and keeps a newline run
apart from the indentation that follows it.

A pre-tokenizer here is an ordered list of steps; each step turns a list of
pieces into a (longer) list of pieces:

* :class:`RegexSplit` cuts every piece at the matches of a regex (tokenizer.json's
  ``Split`` with behavior ``Isolated``: matches and the gaps between them both
  become pieces; ``Removed``: the matches are dropped; ``MergedWithPrevious``:
  each match is glued to the piece before it);
* :class:`ByteLevel` optionally adds a leading space, optionally splits with
  GPT-2's regex, and then rewrites each piece one character per UTF-8 byte (see
  :mod:`lollm.tokenizer.byte_level`), which is the alphabet the BPE vocabulary uses.

Qwen2's tokenizer.json has ``Sequence[Split(<its regex>, Isolated), ByteLevel(use_regex=false)]``;
GPT-2's has a single ``ByteLevel(use_regex=true)``. SentencePiece-style
tokenizers (Gemma) have no ByteLevel step: their vocabulary is made of real
characters, and the pre-tokenizer is null or a ``Split`` on spaces that finds
nothing to split (the normalizer already turned every space into "▁").

The patterns use Unicode classes (``\\p{L}`` letters, ``\\p{N}`` digits) that
Python's built-in ``re`` does not know, so we use the ``regex`` package. Its
``\\s`` is Unicode's White_Space property, like the Oniguruma engine the
Hugging Face tokenizers library uses (Python's ``re`` would also count the
information separators U+001C..U+001F as whitespace and split differently).
"""

from __future__ import annotations

from typing import Any

import regex

from lollm.errors import TokenizerError
from lollm.tokenizer.byte_level import text_to_byte_symbols

#: GPT-2's word-splitting regex (what ``ByteLevel(use_regex=true)`` uses): English
#: contractions, an optional space plus a run of letters, of digits or of other
#: symbols, and whitespace (all but the last space of a run, so that the space
#: can start the next word).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

#: Qwen2's regex (also used when Qwen2 is loaded from vocab.json + merges.txt):
#: case-insensitive contractions, letters with one optional leading non-letter,
#: single digits, punctuation runs with their trailing newlines, newline runs
#: with the whitespace before them, then the same whitespace rules as GPT-2.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _compile(pattern: str, source: str) -> regex.Pattern:
    try:
        return regex.compile(pattern)
    except regex.error as error:
        raise TokenizerError(f"{source}: cannot compile the pre-tokenizer regex {pattern!r}: {error}") from None


class RegexSplit:
    """Cut each piece at the matches of a regex.

    ``behavior="Isolated"`` keeps both the matches and the text between them as
    separate pieces; ``"Removed"`` keeps only the text between matches;
    ``"MergedWithPrevious"`` glues each match to the end of the text before it
    (``"a b c"`` split on ``" "`` gives ``"a "``, ``"b "``, ``"c"``), except
    when that text is itself a match. ``invert=True`` swaps the roles: the
    matches are what lies *between* the cuts.
    """

    BEHAVIORS = ("Isolated", "Removed", "MergedWithPrevious")

    def __init__(self, pattern: str, *, behavior: str = "Isolated", invert: bool = False, source: str = "") -> None:
        if behavior not in self.BEHAVIORS:
            raise TokenizerError(
                f"{source}: Split behavior {behavior!r} is not implemented by lollm (known: {', '.join(self.BEHAVIORS)})"
            )
        self.pattern = _compile(pattern, source)
        self.behavior = behavior
        self.invert = invert

    def __call__(self, pieces: list[str]) -> list[str]:
        out: list[str] = []
        for piece in pieces:
            segments = [(text, is_match != self.invert) for text, is_match in self._segments(piece)]
            if self.behavior == "Removed":
                segments = [(text, False) for text, is_match in segments if not is_match]
            elif self.behavior == "MergedWithPrevious":
                merged: list[tuple[str, bool]] = []
                previous_was_match = False
                for text, is_match in segments:
                    if is_match and not previous_was_match and merged:
                        merged[-1] = (merged[-1][0] + text, False)
                    else:
                        merged.append((text, False))
                    previous_was_match = is_match
                segments = merged
            # empty pieces are dropped, as in Hugging Face tokenizers
            out.extend(text for text, _ in segments if text)
        return out

    def _segments(self, text: str) -> list[tuple[str, bool]]:
        """``text`` as alternating (gap, False) and (match, True) segments, in order."""
        segments: list[tuple[str, bool]] = []
        end = 0
        for match in self.pattern.finditer(text):
            if match.start() > end:
                segments.append((text[end : match.start()], False))
            segments.append((match.group(), True))
            end = match.end()
        if end < len(text):
            segments.append((text[end:], False))
        return segments


class ByteLevel:
    """GPT-2's byte-level step: optional prefix space, optional GPT-2 split, then bytes -> stand-in characters.

    ``add_prefix_space`` puts a space before each piece that does not already
    start with one, so that the first word of a text is encoded like a word in
    the middle of a sentence ("Ġhello"). Qwen2 and GPT-2 leave it off.
    """

    def __init__(self, *, add_prefix_space: bool = False, use_regex: bool = True, source: str = "") -> None:
        self.add_prefix_space = add_prefix_space
        self.split = RegexSplit(GPT2_PATTERN, source=source) if use_regex else None

    def __call__(self, pieces: list[str]) -> list[str]:
        if self.add_prefix_space:
            pieces = [piece if piece.startswith(" ") else " " + piece for piece in pieces]
        if self.split is not None:
            pieces = self.split(pieces)
        return [text_to_byte_symbols(piece) for piece in pieces]


class PreTokenizer:
    """An ordered list of pre-tokenizer steps, applied one after the other."""

    def __init__(self, steps: list) -> None:
        self.steps = steps

    def pre_tokenize(self, text: str) -> list[str]:
        """Cut ``text`` into the words BPE will encode, in order (empty words are dropped)."""
        pieces = [text] if text else []
        for step in self.steps:
            pieces = step(pieces)
        return pieces

    def uses_byte_level(self) -> bool:
        """Whether some step maps text to byte symbols (byte-level BPE needs exactly that)."""
        return any(isinstance(step, ByteLevel) for step in self.steps)


def build_pre_tokenizer(spec: Any, source: str) -> PreTokenizer:
    """Build the pre-tokenizer described by tokenizer.json's ``pre_tokenizer`` entry."""
    return PreTokenizer(_build_steps(spec, source))


def _flag(spec: dict, key: str, default: bool, source: str) -> bool:
    """A true/false switch of a pre-tokenizer step (absent or null: ``default``); a string such as
    ``"false"`` is refused, never read as true."""
    value = spec.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TokenizerError(f"{source}: {spec.get('type')} pre-tokenizer {key!r} must be true or false, got {value!r}")
    return value


def _build_steps(spec: Any, source: str) -> list:
    if spec is None:
        return []
    if not isinstance(spec, dict) or "type" not in spec:
        raise TokenizerError(f"{source}: 'pre_tokenizer' must be null or an object with a 'type', got {spec!r}")
    kind = spec["type"]
    if kind == "Sequence":
        parts = spec.get("pretokenizers") or []
        if not isinstance(parts, list):
            raise TokenizerError(f"{source}: a Sequence pre-tokenizer's 'pretokenizers' must be a list, got {parts!r}")
        steps: list = []
        for sub in parts:
            steps.extend(_build_steps(sub, source))
        return steps
    if kind == "Split":
        pattern = spec.get("pattern")
        if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
            text = pattern["Regex"]
        elif isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
            text = regex.escape(pattern["String"])
        else:
            raise TokenizerError(f"{source}: Split pre-tokenizer has no 'pattern' {{'Regex'|'String': ...}}: {spec!r}")
        behavior = spec.get("behavior", "Isolated")
        return [RegexSplit(text, behavior=behavior, invert=_flag(spec, "invert", False, source), source=source)]
    if kind == "ByteLevel":
        return [
            ByteLevel(
                add_prefix_space=_flag(spec, "add_prefix_space", True, source),
                use_regex=_flag(spec, "use_regex", True, source),
                source=source,
            )
        ]
    raise TokenizerError(f"{source}: pre_tokenizer type {kind!r} is not implemented by lollm")
