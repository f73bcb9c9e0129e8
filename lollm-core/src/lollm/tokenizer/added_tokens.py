"""Added tokens: strings such as ``<|im_start|>`` that are cut out of the text *before* BPE runs.

Why they need their own step
----------------------------
A chat model learns control tokens like ``<|im_start|>`` or ``<|endoftext|>``
as single ids. If the text went straight to the pre-tokenizer, ``<|im_start|>``
would be cut into ``<|``, ``im``, ``_start``, ``|>`` and encoded as several
ordinary tokens the model never saw in that role. So the tokenizer first scans
the raw text for every added token, emits its id directly, and runs the normal
pipeline (normalize, pre-tokenize, BPE) only on the text *between* them.

How the scan works (following the Hugging Face tokenizers library)
-------------------------------------------------------------------
* Matching is *leftmost-longest*: scanning from the left, the first position
  where some added token starts wins, and among the tokens starting there the
  longest wins. Matches never overlap.
* It happens in two passes. Tokens with ``normalized=False`` (all of Qwen's)
  are matched on the raw text. Then the remaining text is normalized and the
  tokens with ``normalized=True`` are matched on the normalized text.
* Per-token flags: ``single_word`` only accepts a match that is not glued to
  a word character on either side; ``lstrip`` / ``rstrip`` make the token
  swallow the whitespace on its left / right.
* ``special`` marks control tokens: ``decode(..., skip_special_tokens=True)``
  leaves them out. Special or not, they are matched in the text, unless the
  caller turns special tokens off (``split(..., special=False)``, the
  ``split_special_tokens`` of transformers): text that came from someone else,
  say a message sent to a server, must not be able to write ``<|im_end|>`` and
  forge the end of its turn. Then special tokens are ordinary text; the other
  added tokens are still matched. As in the tokenizers library (its
  ``encode_special_tokens``), the scan still finds a special token and only
  then skips it, so an added token hidden inside a special token's text is not
  matched there either.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import regex

from lollm.errors import TokenizerError

_ENDS_WITH_WORD_CHAR = regex.compile(r"\w\Z")
_STARTS_WITH_WORD_CHAR = regex.compile(r"\A\w")
_TRAILING_WHITESPACE = regex.compile(r"\s*\Z")
_LEADING_WHITESPACE = regex.compile(r"\A\s*")


@dataclass(frozen=True)
class AddedToken:
    """One added token with the flags of tokenizer.json's ``added_tokens`` entries."""

    id: int
    content: str
    special: bool = False
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False
    normalized: bool = True


#: One piece of text after the added-token scan: its text and, when the piece
#: is an added token, that token's id (``None`` for ordinary text).
Piece = tuple[str, "int | None"]


#: The most groups a prefix-tree pattern may nest (:func:`literal_pattern`); Python's ``re`` parses
#: nested groups recursively, so a deeper tree (tokens "a", "aa", "aaa", ...) is written flat.
MAX_TRIE_DEPTH = 100


def literal_pattern(contents: Iterable[str]) -> str:
    """One regex for many literal texts that matches the longest of them at a position: their prefix tree.

    The plain way is an alternation with the longest texts first, ``<unused10>|<unused1>|<pad>``:
    a regex tries its branches in order, so the longest text wins. Sharing the prefixes,
    ``<(?:pad|unused1(?:0|))``, finds the same texts: the branches of one node start with
    different characters, so at most one of them can go on, and the empty branch (a text
    that ends at this node) comes last, so it is taken only when no longer text matches.
    For Gemma 3's 6,414 added tokens the tree scans a text hundreds of times faster (one
    path per position instead of 6,414 branches). The tree is built and written without
    recursion; one that would nest more than :data:`MAX_TRIE_DEPTH` groups is written as
    the plain alternation instead.
    """
    contents = set(contents)
    root: dict = {}
    for text in contents:
        node = root
        for char in text:
            node = node.setdefault(char, {})
        node[None] = True  # a text ends here
    written: dict[int, tuple[str, int]] = {}  # id(node) -> (its pattern, groups nested in it), children first
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if not children_done:
            stack.append((node, True))
            stack.extend((child, False) for key, child in node.items() if key is not None)
            continue
        parts = [(re.escape(char), *written.pop(id(child)))
                 for char, child in sorted((k, v) for k, v in node.items() if k is not None)]
        branches = [char + pattern for char, pattern, _ in parts] + ([""] if None in node else [])
        depth = max((d for _, _, d in parts), default=0)
        written[id(node)] = ((branches[0], depth) if len(branches) == 1
                             else ("(?:" + "|".join(branches) + ")", depth + 1))
    pattern, depth = written[id(root)]
    if depth > MAX_TRIE_DEPTH:
        return "|".join(re.escape(c) for c in sorted(contents, key=lambda c: (-len(c), c)))
    return pattern


class AddedVocabulary:
    """All added tokens of a tokenizer, and the scan that cuts them out of a text."""

    def __init__(self, tokens: Iterable[AddedToken]) -> None:
        self.tokens: list[AddedToken] = list(tokens)
        self.by_content: dict[str, AddedToken] = {}
        self.by_id: dict[int, AddedToken] = {}
        for token in self.tokens:
            if token.content == "":
                raise TokenizerError(f"added token id {token.id} has empty content")
            self.by_content[token.content] = token
            self.by_id[token.id] = token
        self._raw_matcher = self._matcher([t for t in self.tokens if not t.normalized])
        self._normalized_matcher = self._matcher([t for t in self.tokens if t.normalized])

    @staticmethod
    def _matcher(tokens: list[AddedToken]) -> re.Pattern | None:
        """A regex that finds these tokens leftmost-longest (:func:`literal_pattern`).

        Python's own ``re``: for literal texts it needs nothing of ``regex``, whose compiled
        form of Gemma 3's 6,414 tokens took 7 MB where ``re``'s takes 0.2 MB.
        """
        if not tokens:
            return None
        return re.compile(literal_pattern(t.content for t in tokens))

    def split(
        self,
        text: str,
        normalizer: Callable[[str], str] | None = None,
        *,
        special: bool = True,
        restore: Callable[[str], str] | None = None,
    ) -> list[Piece]:
        """Cut ``text`` into ordinary text and added tokens; normalize the ordinary text on the way.

        Returns ``(text, None)`` for text that still has to be pre-tokenized
        and BPE-encoded, and ``(content, id)`` for each added token found.
        ``special=False``: special tokens are not looked for (they stay text).
        ``restore``: applied to each stretch of ordinary text found by the first
        (raw) pass, before it is normalized; special tokens are not looked for in
        what it returns (``Tokenizer.encode_chat`` puts back message text there).
        """
        pieces: list[Piece] = self._find(text, self._raw_matcher, special)
        out: list[Piece] = []
        for piece_text, token_id in pieces:
            if token_id is not None:
                out.append((piece_text, token_id))
                continue
            if restore is not None:
                piece_text = restore(piece_text)
            if normalizer is not None:
                piece_text = normalizer(piece_text)
            out.extend(self._find(piece_text, self._normalized_matcher, special and restore is None))
        return [(t, i) for t, i in out if i is not None or t]

    def _find(self, text: str, matcher: re.Pattern | None, special: bool) -> list[Piece]:
        if matcher is None or not text:
            return [(text, None)]
        pieces: list[Piece] = []
        done = 0  # everything before this offset is already in `pieces`
        for match in matcher.finditer(text):
            token = self.by_content[match.group()]
            start, stop = match.start(), match.end()
            if start < done:
                continue  # inside whitespace that an rstrip token already swallowed
            if token.special and not special:
                continue  # like the tokenizers library: the scan goes on after the skipped match
            if token.single_word:
                glued_left = start > 0 and _ENDS_WITH_WORD_CHAR.search(text[:start]) is not None
                glued_right = stop < len(text) and _STARTS_WITH_WORD_CHAR.search(text[stop:]) is not None
                if glued_left or glued_right:
                    continue  # e.g. "<mask>" inside "a<mask>b" is not a word of its own
            if token.lstrip:
                start = max(_TRAILING_WHITESPACE.search(text[:start]).start(), done)
            if token.rstrip:
                stop += _LEADING_WHITESPACE.match(text[stop:]).end()
            if start > done:
                pieces.append((text[done:start], None))
            pieces.append((text[start:stop], token.id))
            done = stop
        if done < len(text):
            pieces.append((text[done:], None))
        return pieces
