"""The vocabulary, piece <-> id, in flat arrays instead of one Python object per piece.

The obvious vocabulary is a dict ``{piece: id}``. For Gemma 3's 262,144 pieces it
costs about 35 MB: each piece is a ``str`` object (49 bytes of header before its
characters), each id above 256 an ``int`` object (28 bytes), and the dict's table
about 30 bytes a piece. The pieces' own text is 2.3 MB of UTF-8.

:class:`Vocabulary` holds the same mapping in four arrays, 6.5 MB for Gemma 3::

    utf8     every piece's UTF-8 bytes, end to end, in id order        "<pad><eos>...▁the..."
    starts   (n + 1,) uint32: piece i is utf8[starts[i]:starts[i + 1]]
    hashes   (n,) uint32: the low 32 bits of hash(piece i), Python's own string hash
    slots    (2^k,) int32, 2^k >= 2n: a hash table of piece numbers, -1 where empty

* **piece -> id** (``vocab.get("▁the")``): hash the text, start at slot
  ``hash & (2^k - 1)`` and walk forward ("linear probing") until an empty slot.
  A piece found on the way whose hash is equal has its bytes compared with the
  text, because two different texts may share a hash. The table is at most half
  full, so a search looks at one or two slots on average. About half a
  microsecond, two to five times a dict's; the tokenizers' merge loops
  feel it only in part, since each word or segment is merged once and then cached.
* **id -> piece** (``vocab.piece(42)``): slice the piece's bytes and decode them.

Ids are the positions 0 .. n-1 in the usual case. A vocabulary whose ids have holes
or lie far apart (a tokenizer.json may say ``"zz": 1000000``) keeps one more array,
``ids``, sorted, and finds an id's piece by binary search in it.

Python salts its string hash per process (``PYTHONHASHSEED``), so the hashes are
computed when the tokenizer is built and never stored on disk.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping

from lollm.errors import TokenizerError


#: The hash bits kept per piece: enough to skip nearly every piece that is not the one looked for.
LOW_32 = 0xFFFF_FFFF
#: The most UTF-8 bytes all pieces together may take (their offsets are uint32).
MAX_TEXT_BYTES = 0xFFFF_FFFF


class Vocabulary(Mapping):
    """A read-only mapping piece (``str``) -> token id (``int``), stored as flat arrays (see the module).

    ``pieces`` gives the texts in id order (any iterable, read once); ``ids``, when given,
    their ids (strictly increasing, non-negative), else 0 .. n-1. Raises
    :class:`~lollm.errors.TokenizerError`, naming ``source``, for a piece that is not a
    string or not encodable as UTF-8, a piece that appears twice, or ids out of order.

    It answers as a dict would (``get``, ``[]``, ``in``, ``len``, iteration over the
    pieces in id order, ``items()``) plus ``piece(id)`` and ``size`` (largest id + 1).
    """

    #: str -> int: the hash the table is built on (Python's; a test swaps in one that collides often)
    hash_text = hash

    def __init__(self, pieces: Iterable[str], ids: Iterable[int] | None = None, *, source: str = "the vocabulary") -> None:
        self.source = source
        utf8, starts, hashes = bytearray(), array("I", [0]), array("I")
        for index, piece in enumerate(pieces):
            if not isinstance(piece, str):
                raise TokenizerError(f"{source}: token #{index} is a {type(piece).__name__}, not a string")
            try:
                utf8 += piece.encode("utf-8")
            except UnicodeEncodeError:
                raise TokenizerError(f"{source}: token #{index} {piece!r} has no UTF-8 spelling") from None
            if len(utf8) > MAX_TEXT_BYTES:
                raise TokenizerError(f"{source}: the tokens' text passes {MAX_TEXT_BYTES} bytes at token #{index}")
            starts.append(len(utf8))
            hashes.append(self.hash_text(piece) & LOW_32)
        self._utf8, self._starts = bytes(utf8), starts
        self._ids: array | None = None
        if ids is not None:
            self._ids = array("q", ids)
            self._check_ids()
        self._hashes = hashes
        self._build_slots()

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, int], *, source: str = "the vocabulary") -> Vocabulary:
        """The vocabulary of a ``{piece: id}`` mapping (a tokenizer.json's ``model.vocab``); the same object
        when it already is one. Ids must be distinct non-negative ints."""
        if isinstance(mapping, Vocabulary):
            return mapping
        pairs = sorted(mapping.items(), key=lambda pair: pair[1])
        dense = all(token_id == index for index, (_, token_id) in enumerate(pairs))
        return cls((piece for piece, _ in pairs), None if dense else (token_id for _, token_id in pairs), source=source)

    def _check_ids(self) -> None:
        ids = self._ids
        if len(ids) != len(self._starts) - 1:
            raise TokenizerError(f"{self.source}: {len(ids)} ids for {len(self._starts) - 1} tokens")
        for index, token_id in enumerate(ids):
            if token_id < 0:
                raise TokenizerError(f"{self.source}: token {self._text(index)!r} has the negative id {token_id}")
            if index and token_id == ids[index - 1]:
                raise TokenizerError(f"{self.source}: tokens {self._text(index - 1)!r} and {self._text(index)!r} "
                                     f"share the id {token_id}")
            if index and token_id < ids[index - 1]:
                raise TokenizerError(f"{self.source}: the ids are not in increasing order ({ids[index - 1]} "
                                     f"before {token_id})")

    def _build_slots(self) -> None:
        """Put every piece in the hash table; a piece listed under two ids is an error (found on the way:
        equal texts have equal hashes, so only pieces with the same hash have their texts compared)."""
        n = len(self._hashes)
        self._mask = (1 << max(3, (2 * n - 1).bit_length())) - 1  # 2^k - 1, with 2^k >= 2n
        self._slots = slots = array("i", [-1]) * (self._mask + 1)
        hashes, mask = self._hashes, self._mask
        for entry, h in enumerate(hashes):
            i = h & mask
            while (other := slots[i]) >= 0:
                if hashes[other] == h and self._text(other) == self._text(entry):
                    raise TokenizerError(f"{self.source}: token {self._text(entry)!r} appears twice "
                                         f"(ids {self._id_of(other)} and {self._id_of(entry)})")
                i = (i + 1) & mask
            slots[i] = entry

    # ------------------------------------------------------------ piece -> id

    def get(self, piece: str, default: int | None = None) -> int | None:
        """The id of ``piece``, or ``default`` when it is not in the vocabulary."""
        h = self.hash_text(piece) & LOW_32
        slots, hashes, mask = self._slots, self._hashes, self._mask
        i = h & mask
        while (entry := slots[i]) >= 0:  # an empty slot ends the search: the piece is not here
            if hashes[entry] == h:  # most likely the piece; its bytes decide
                start, end = self._starts[entry], self._starts[entry + 1]
                data = piece.encode("utf-8", "surrogatepass")  # a lone surrogate spells no piece, and must not raise
                if end - start == len(data) and self._utf8.startswith(data, start):
                    return entry if self._ids is None else self._ids[entry]
            i = (i + 1) & mask
        return default

    def __getitem__(self, piece: str) -> int:
        token_id = self.get(piece) if isinstance(piece, str) else None
        if token_id is None:
            raise KeyError(piece)
        return token_id

    def __contains__(self, piece: object) -> bool:
        return isinstance(piece, str) and self.get(piece) is not None

    # ------------------------------------------------------------ id -> piece

    def piece(self, token_id: int) -> str | None:
        """The text of id ``token_id``, or None when no piece has that id."""
        if self._ids is None:
            entry = token_id if 0 <= token_id < len(self._starts) - 1 else -1
        else:
            entry = bisect_left(self._ids, token_id)
            entry = entry if entry < len(self._ids) and self._ids[entry] == token_id else -1
        return None if entry < 0 else self._text(entry)

    def _text(self, entry: int) -> str:
        return self._utf8[self._starts[entry] : self._starts[entry + 1]].decode("utf-8")

    def _id_of(self, entry: int) -> int:
        return entry if self._ids is None else self._ids[entry]

    @property
    def size(self) -> int:
        """Largest id + 1 (0 for an empty vocabulary): how many ids an id -> piece table needs."""
        if self._ids is None:
            return len(self._starts) - 1
        return self._ids[-1] + 1 if self._ids else 0

    # ------------------------------------------------------------ as a mapping

    def __len__(self) -> int:
        return len(self._starts) - 1

    def __iter__(self) -> Iterator[str]:
        """The pieces, in id order."""
        return (self._text(entry) for entry in range(len(self)))

    def items(self) -> Iterator[tuple[str, int]]:  # type: ignore[override]
        """(piece, id) in id order, read straight from the arrays (no lookup per piece)."""
        return ((self._text(entry), self._id_of(entry)) for entry in range(len(self)))

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} pieces, {len(self._utf8)} bytes of text)"
