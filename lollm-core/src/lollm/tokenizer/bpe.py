"""The BPE model: turn one pre-tokenized word into token ids by applying learned merges.

Byte-pair encoding (BPE) in one paragraph
------------------------------------------
Training started from single characters and repeatedly glued together the
most frequent adjacent pair, writing each glue step down in order: that list is
the *merges* file, and the position of a pair in it is its *rank* (0 = learned
first = most frequent). Encoding replays the training on a new word: split the
word into single characters, then keep merging the adjacent pair with the
lowest rank until no adjacent pair appears in the merges list. Each remaining
symbol is a vocabulary entry, and its id is the token id.

Example with the merges ``[("l", "o"), ("lo", "w"), ("e", "r")]`` on "lower"::

    l o w e r   ->  (l,o) has rank 0    ->  lo w e r
    lo w e r    ->  (lo,w) has rank 1   ->  low e r
    low e r     ->  (e,r) has rank 2    ->  low er
    low er      ->  no ranked pair left ->  ids of "low" and "er"

This module knows nothing about bytes: a symbol is just a string. In a
byte-level tokenizer (GPT-2, Qwen, Llama 3) the words it receives were already
rewritten one character per UTF-8 byte by :mod:`lollm.tokenizer.byte_level`.

Two flavours of BPE share one merge loop
----------------------------------------
:func:`merge_symbols` is the loop itself: "merge the best adjacent pair, again
and again". Only the meaning of *best* differs:

* the Hugging Face flavour (:class:`BPE`, used by tokenizer.json) ranks a pair
  by its position in the merges list: lowest rank first;
* SentencePiece's flavour (:mod:`lollm.tokenizer.sentencepiece`) has no merges
  list; it ranks a pair by the *score* of the piece the two symbols would form:
  highest score first.

SentencePiece-style vocabularies (Llama 2, Gemma) do not contain every byte,
so a character missing from the vocabulary is spelled as its UTF-8 bytes with
the special tokens ``<0x00>`` .. ``<0xFF>``: that is *byte fallback*
(tokenizer.json's ``"byte_fallback": true``).
"""

from __future__ import annotations

import functools
import heapq
from array import array
from collections.abc import Callable, Iterable, Mapping

from lollm.errors import TokenizerError
from lollm.tokenizer.vocabulary import Vocabulary

#: How many distinct words :meth:`BPE.encode_word` remembers. Real text repeats
#: words a lot ("the", "Ġ=", "ĊĠĠĠ"), so most words are merged only once.
WORD_CACHE_SIZE = 100_000

#: Give the priority of merging two adjacent symbols (lower = merged first), or
#: ``None`` when the two can never be merged.
PairPriority = Callable[[str, str], "float | int | None"]


def byte_token(byte: int) -> str:
    """The byte-fallback token of one byte value: ``byte_token(0x0A) == "<0x0A>"`` (two upper-case hex digits)."""
    return f"<0x{byte:02X}>"


def merge_symbols(symbols: list[str], priority: PairPriority) -> list[str]:
    """The BPE merge loop: repeatedly merge the adjacent pair with the best (lowest) priority.

    Ties go to the leftmost pair. This is exactly what both reference
    implementations do (the Hugging Face tokenizers library and SentencePiece),
    and they do it the same way, which we follow here:

    * the symbols form a doubly linked list (``prev`` / ``next`` indices), so
      merging two of them is a constant-time relinking, not a list rebuild;
    * every candidate pair sits in a heap keyed by ``(priority, position)``;
      popping the heap gives the best pair, leftmost first;
    * merging changes the neighbours' pairs, so only the two new pairs (left
      neighbour + merged symbol, merged symbol + right neighbour) are pushed.
      Entries that went stale (one of their symbols was merged away since) are
      recognized when popped and skipped.

    ``priority`` is called exactly when SentencePiece would look a pair up: once
    for every initial pair from left to right, then for the two new pairs after
    each merge. (The SentencePiece engine relies on that order.)

    A textbook version rescans all pairs after each merge, which costs time
    proportional to the square of the word length. SentencePiece-style
    tokenizers give the merge loop a whole paragraph at once (they have no
    word-splitting regex), so the heap matters there.
    """
    n = len(symbols)
    if n < 2:
        return list(symbols)
    text: list[str | None] = list(symbols)  # None once a symbol was merged into its left neighbour
    prev = list(range(-1, n - 1))
    next_ = list(range(1, n + 1))
    next_[-1] = -1
    heap: list[tuple[float | int, int, str, str]] = []

    def consider(left: int) -> None:
        """Push the pair (symbol ``left``, the symbol after it) if it can be merged at all."""
        right = next_[left] if left >= 0 else -1
        if left < 0 or right < 0:
            return
        a, b = text[left], text[right]
        p = priority(a, b)
        if p is not None:
            heapq.heappush(heap, (p, left, a, b))

    for i in range(n - 1):
        consider(i)
    while heap:
        _, left, a, b = heapq.heappop(heap)
        right = next_[left]
        if text[left] != a or right < 0 or text[right] != b:
            continue  # stale: one of the two symbols has changed since this pair was pushed
        # merge the right symbol into the left one and unlink it
        text[left] = a + b
        text[right] = None
        next_[left] = next_[right]
        if next_[right] >= 0:
            prev[next_[right]] = left
        consider(prev[left])
        consider(left)
    return [t for t in text if t is not None]


class BPE:
    """A BPE vocabulary plus its ranked merges, able to encode single words (the Hugging Face flavour).

    ``vocab`` maps each token string to its id (non-negative ints; kept as a
    :class:`~lollm.tokenizer.vocabulary.Vocabulary`, flat arrays). ``merges``
    gives the learned pairs in training order (any iterable, read once); the
    first pair has rank 0. ``unk_token`` (with ``fuse_unk``) says what to do
    with a character that is not in the vocabulary; byte-level vocabularies
    contain all 256 byte symbols, so they never need it and leave it ``None``,
    in which case an unknown character is an error. ``byte_fallback``
    (SentencePiece-style vocabularies) spells such a character as its UTF-8
    bytes ``<0xE9><0xB1><0xBB>`` instead, and only falls back to ``unk_token``
    when a byte token is missing too. ``ignore_merges`` (Llama 3) looks the
    whole word up in the vocabulary first and skips the merge loop when it is
    there. ``source`` names the file the data came from, for error messages.
    """

    def __init__(
        self,
        vocab: Mapping[str, int],
        merges: Iterable[tuple[str, str]],
        *,
        unk_token: str | None = None,
        fuse_unk: bool = False,
        byte_fallback: bool = False,
        ignore_merges: bool = False,
        source: str = "the BPE model",
    ) -> None:
        self.vocab = vocab = Vocabulary.from_mapping(vocab, source=source)
        self.unk_token = unk_token
        self.fuse_unk = fuse_unk
        self.byte_fallback = byte_fallback
        self.ignore_merges = ignore_merges
        self.source = source
        if unk_token is not None and unk_token not in vocab:
            raise TokenizerError(f"{source}: unk_token {unk_token!r} is not in the vocabulary")

        self._index_merges(merges)
        # One cache per model instance (a module-level cache would mix vocabularies).
        self._encode_word_cached = functools.lru_cache(maxsize=WORD_CACHE_SIZE)(self._encode_word)

    def encode_word(self, word: str) -> list[int]:
        """Token ids of one pre-tokenized word (cached: each distinct word is merged only once)."""
        return list(self._encode_word_cached(word))

    def _encode_word(self, word: str) -> tuple[int, ...]:
        if self.ignore_merges and word in self.vocab:
            return (self.vocab[word],)
        symbols = self.merge(self._initial_symbols(word))
        return tuple(self.vocab[symbol] for symbol in symbols)

    def _initial_symbols(self, word: str) -> list[str]:
        """Split ``word`` into single characters; a character missing from the vocabulary becomes
        its byte tokens (``byte_fallback``) or ``unk_token``."""
        symbols: list[str] = []
        previous_was_unk = False
        for char in word:
            if char in self.vocab:
                symbols.append(char)
                previous_was_unk = False
                continue
            if self.byte_fallback:
                # Like the Hugging Face library: all bytes of the character, or none of them.
                byte_symbols = [byte_token(b) for b in char.encode("utf-8")]
                if all(symbol in self.vocab for symbol in byte_symbols):
                    symbols.extend(byte_symbols)
                    previous_was_unk = False
                    continue
            if self.unk_token is not None:
                # fuse_unk: a run of unknown characters becomes a single unk symbol.
                if not (self.fuse_unk and previous_was_unk):
                    symbols.append(self.unk_token)
                previous_was_unk = True
            else:
                raise TokenizerError(
                    f"{self.source}: the character {char!r} (U+{ord(char):04X}) is not in the vocabulary "
                    "and the model has no unk_token"
                )
        return symbols

    def _index_merges(self, merges: Iterable[tuple[str, str]]) -> None:
        """Record each merge under the token it forms: ``_rank[id]`` and ``_split[id]`` (the length of
        its left part; -1: none) as int32 arrays over the token ids.

        A dict keyed by ``(first, second)`` tuples cost 122 bytes a merge (the tuple, the rank's int
        object, the dict's slot): 18 MB for Qwen2.5's 151,387 merges. The two arrays cost 8 bytes a
        token (1.2 MB). Every merged pair is a token of the vocabulary, and the length of the left
        part tells apart the pairs that spell the same token, so ``(id, split)`` names the pair. A
        rare second merge of one token (another split) and the merges of tokens whose id lies far
        past the others go to ``_other_ranks``, keyed by the pair.
        """
        vocab = self.vocab
        size = min(vocab.size, 2 * len(vocab) + 1024)  # a few far ids (a sparse vocabulary) stay out of the arrays
        self._rank = array("i", bytes(4 * size))
        self._split = array("i", [-1]) * size
        self._other_ranks: dict[tuple[str, str], int] = {}
        find = vocab.get
        for rank, (first, second) in enumerate(merges):
            token_id, split = find(first + second), len(first)
            for part, found in ((first, find(first)), (second, find(second)), (first + second, token_id)):
                if found is None:
                    raise TokenizerError(
                        f"{self.source}: merge #{rank} ({first!r}, {second!r}) uses {part!r}, "
                        "which is not in the vocabulary"
                    )
            if token_id < size and self._split[token_id] in (-1, split):
                if self._split[token_id] == -1:  # a pair listed twice keeps its first (lowest) rank
                    self._rank[token_id], self._split[token_id] = rank, split
            else:
                self._other_ranks.setdefault((first, second), rank)

    def merge_rank(self, first: str, second: str) -> int | None:
        """The rank of the merge ``(first, second)`` (0 = learned first), or ``None`` when it is no merge."""
        token_id = self.vocab.get(first + second)
        if token_id is None:
            return None
        if token_id < len(self._split) and self._split[token_id] == len(first):
            return self._rank[token_id]
        return self._other_ranks.get((first, second))

    def merge(self, symbols: list[str]) -> list[str]:
        """Merge ``symbols`` by rank: repeatedly the adjacent pair learned earliest, leftmost first.

        ``a a a`` with the pair ``(a, a)`` becomes ``aa a``: the leftmost
        occurrence merges first and takes the middle ``a`` with it.
        """
        vocab, ranks, splits, others = self.vocab, self._rank, self._split, self._other_ranks
        size = len(splits)

        def rank(first: str, second: str) -> int | None:  # merge_rank, inlined: the hot lookup
            token_id = vocab.get(first + second)
            if token_id is None:
                return None
            if token_id < size and splits[token_id] == len(first):
                return ranks[token_id]
            return others.get((first, second)) if others else None

        return merge_symbols(symbols, rank)
