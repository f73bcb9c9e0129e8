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
A SentencePiece-style BPE (``byte_fallback``) would add its fallback step in
:meth:`BPE._initial_symbols` and reuse the same merge loop.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from lollm.errors import TokenizerError

#: How many distinct words :meth:`BPE.encode_word` remembers. Real text repeats
#: words a lot ("the", "Ġ=", "ĊĠĠĠ"), so most words are merged only once.
WORD_CACHE_SIZE = 100_000


class BPE:
    """A BPE vocabulary plus its ranked merges, able to encode single words.

    ``vocab`` maps each token string to its id. ``merges`` lists the learned
    pairs in training order; the first pair has rank 0. ``unk_token`` (with
    ``fuse_unk``) says what to do with a character that is not in the
    vocabulary; byte-level vocabularies contain all 256 byte symbols, so they
    never need it and leave it ``None``, in which case an unknown character is
    an error. ``ignore_merges`` (Llama 3) looks the whole word up in the
    vocabulary first and skips the merge loop when it is there. ``source``
    names the file the data came from, for error messages.
    """

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Iterable[tuple[str, str]],
        *,
        unk_token: str | None = None,
        fuse_unk: bool = False,
        ignore_merges: bool = False,
        source: str = "the BPE model",
    ) -> None:
        self.vocab = vocab
        self.unk_token = unk_token
        self.fuse_unk = fuse_unk
        self.ignore_merges = ignore_merges
        self.source = source
        if unk_token is not None and unk_token not in vocab:
            raise TokenizerError(f"{source}: unk_token {unk_token!r} is not in the vocabulary")

        # pair -> rank. A dict keyed by the pair makes "what is the rank of
        # (a, b)?" one hash lookup, which is the hot operation of the loop.
        self.merge_ranks: dict[tuple[str, str], int] = {}
        for rank, (first, second) in enumerate(merges):
            for part in (first, second, first + second):
                if part not in vocab:
                    raise TokenizerError(
                        f"{source}: merge #{rank} ({first!r}, {second!r}) uses {part!r}, "
                        "which is not in the vocabulary"
                    )
            # If a pair is listed twice, its first (lowest) rank is the one that counts.
            self.merge_ranks.setdefault((first, second), rank)

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
        """Split ``word`` into single characters, replacing the ones missing from the vocabulary by unk_token."""
        symbols: list[str] = []
        previous_was_unk = False
        for char in word:
            if char in self.vocab:
                symbols.append(char)
                previous_was_unk = False
            elif self.unk_token is not None:
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

    def merge(self, symbols: list[str]) -> list[str]:
        """The BPE merge loop: repeatedly merge the adjacent pair with the lowest rank.

        Each round finds the best-ranked adjacent pair, then merges every
        occurrence of it from left to right (``a a a`` with the pair ``(a, a)``
        becomes ``aa a``). A merged symbol can only take part in merges learned
        after it, so the result is the same as merging one occurrence at a time
        in (rank, position) order, which is what the Hugging Face tokenizers
        library does with a priority queue.
        """
        ranks = self.merge_ranks
        while len(symbols) > 1:
            best_rank = None
            best_pair = None
            for pair in zip(symbols, symbols[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best_pair = rank, pair
            if best_pair is None:
                break  # no adjacent pair was ever learned: the word is fully merged
            first, second = best_pair
            merged: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == first and symbols[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return symbols
