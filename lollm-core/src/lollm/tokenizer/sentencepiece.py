"""SentencePiece, written out: the ``tokenizer.model`` file, its normalizer and its BPE.

SentencePiece is the tokenizer library of Llama 1/2, Gemma, T5 and many others.
Three ideas set it apart from GPT-2's byte-level BPE:

1. **Spaces are characters.** Before anything else the normalizer writes every
   space as "▁" (U+2581). There is no word-splitting regex: the whole text is
   one sequence of characters, and "▁world" is simply a piece that starts with
   the space marker. Optionally (``add_dummy_prefix``, Llama 2 yes, Gemma no) a
   "▁" is put in front of the text, so that its first word is spelled like a
   word in the middle of a sentence.
2. **Merges by score, not by a merges list.** Every piece of the vocabulary has
   a score (for BPE models: minus its position in training order). Encoding
   repeatedly merges the adjacent pair whose concatenation is the piece with
   the *highest score*; ties go to the leftmost pair.
3. **Byte fallback.** The vocabulary holds real characters, not bytes, so a
   rare character may be missing. With ``byte_fallback`` the model has 256
   extra pieces ``<0x00>`` .. ``<0xFF>`` and spells such a character as its
   UTF-8 bytes (鱻 -> ``<0xE9><0xB1><0xBB>``); without it, the character
   becomes the unknown piece ``<unk>``.

The file: a protocol buffer
---------------------------
``tokenizer.model`` is a serialized ``ModelProto`` message (see
sentencepiece_model.proto in the SentencePiece sources). Instead of depending
on the protobuf library we read the wire format directly; it is small:

* a message is a list of fields; each field starts with a *key*, a varint
  holding ``field_number << 3 | wire_type``;
* wire type 0 is a varint (ints, bools, enums), 1 a fixed 8 bytes, 2 a
  length-delimited run of bytes (strings, bytes, nested messages), 5 a fixed
  4 bytes (floats);
* a varint stores 7 bits per byte, least significant group first; the high bit
  of each byte says "more bytes follow";
* fields we do not need are skipped; a field absent from the file has its
  default value.

The fields we read::

    ModelProto       1 pieces (repeated SentencePiece)   2 trainer_spec   3 normalizer_spec
                     5 denormalizer_spec
    SentencePiece    1 piece (string)   2 score (float)   3 type (enum, default NORMAL)
    TrainerSpec      3 model_type (UNIGRAM=1 default, BPE=2, WORD=3, CHAR=4)
                     24 treat_whitespace_as_suffix   35 byte_fallback
                     40 unk_id (0)   41 bos_id (1)   42 eos_id (2)   43 pad_id (-1)
    NormalizerSpec   1 name   2 precompiled_charsmap   3 add_dummy_prefix (true)
                     4 remove_extra_whitespaces (true)   5 escape_whitespaces (true)

Piece types (the same numbers as GGUF's ``tokenizer.ggml.token_type``):
NORMAL 1, UNKNOWN 2, CONTROL 3 (``<s>``, ``</s>``), USER_DEFINED 4 (always one
piece, never split), UNUSED 5, BYTE 6 (``<0xNN>``).

Not implemented (each raises :class:`~lollm.errors.TokenizerError` naming it):
Unigram, WORD and CHAR models, a ``precompiled_charsmap`` normalization rule
(such as the default ``nmt_nfkc``; LLM tokenizers use ``identity``), and
``treat_whitespace_as_suffix``.
"""

from __future__ import annotations

import functools
import os
import struct
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import regex

from lollm.errors import TokenizerError
from lollm.tokenizer.bpe import byte_token, merge_symbols
from lollm.tokenizer.decoders import SPACE_MARKER
from lollm.tokenizer.vocabulary import Vocabulary

# Piece types, as in sentencepiece_model.proto (and GGUF's token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
PIECE_TYPE_NAMES = {NORMAL: "NORMAL", UNKNOWN: "UNKNOWN", CONTROL: "CONTROL", USER_DEFINED: "USER_DEFINED",
                    UNUSED: "UNUSED", BYTE: "BYTE"}
# TrainerSpec.model_type
MODEL_TYPE_NAMES = {1: "UNIGRAM", 2: "BPE", 3: "WORD", 4: "CHAR"}
BPE_MODEL = 2

#: How many distinct texts :meth:`SentencePieceBPE.encode_word` remembers. A
#: SentencePiece "word" is a whole stretch of text, so repeats are rarer than
#: in byte-level BPE; chat prompts still repeat their short segments a lot.
TEXT_CACHE_SIZE = 4096


# ------------------------------------------------------------------ protobuf


class _ProtoReader:
    """Reads the fields of one protobuf message from ``data[start:end]``."""

    def __init__(self, data: bytes, source: str, start: int = 0, end: int | None = None) -> None:
        self.data = data
        self.source = source
        self.pos = start
        self.end = len(data) if end is None else end

    def _fail(self, what: str) -> TokenizerError:
        return TokenizerError(f"{self.source}: not a valid SentencePiece model file ({what} at byte {self.pos})")

    def varint(self) -> int:
        result = shift = 0
        while True:
            if self.pos >= self.end:
                raise self._fail("truncated varint")
            byte = self.data[self.pos]
            self.pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise self._fail("varint longer than 10 bytes")

    def fields(self):
        """Yield ``(field_number, wire_type, value)``; a length-delimited value is a ``(start, end)`` span."""
        while self.pos < self.end:
            key = self.varint()
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                value = self.varint()
            elif wire_type == 1:
                value = self._take(8)
            elif wire_type == 2:
                length = self.varint()
                if self.pos + length > self.end:
                    raise self._fail(f"field {number} claims {length} bytes but the message ends sooner")
                value = (self.pos, self.pos + length)
                self.pos += length
            elif wire_type == 5:
                value = self._take(4)
            else:
                raise self._fail(f"field {number} has wire type {wire_type}, which SentencePiece never writes")
            yield number, wire_type, value

    def _take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise self._fail("truncated fixed-size field")
        value = self.data[self.pos : self.pos + n]
        self.pos += n
        return value

    def sub(self, span: tuple[int, int]) -> _ProtoReader:
        return _ProtoReader(self.data, self.source, span[0], span[1])

    def text(self, span: tuple[int, int]) -> str:
        try:
            return self.data[span[0] : span[1]].decode("utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"{self.source}: a string field at byte {span[0]} is not valid UTF-8") from None


def _compact(scores: array) -> array:
    """``scores`` (an ``array("d")``) as an ``array("f")`` when that holds every score exactly, else unchanged.

    Float32 halves the table (1 MB for 262,144 pieces); merge priorities compare
    exactly as before because no value changes (ties included).
    """
    single = array("f", scores)
    return single if single == scores else scores


def _int32(value: int) -> int:
    """A varint read as protobuf ``int32``: negative numbers are stored as 64-bit two's complement."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _expect(wire_type: int, expected: int, name: str, reader: _ProtoReader) -> None:
    if wire_type != expected:
        raise TokenizerError(f"{reader.source}: field {name} has wire type {wire_type}, expected {expected}")


@dataclass
class NormalizerSpec:
    """The normalizer settings of a model (defaults as in sentencepiece_model.proto)."""

    name: str = ""
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


@dataclass
class SentencePieceModel:
    """What lollm reads from a ``tokenizer.model`` file."""

    #: (piece, score, type) for every id, in id order
    pieces: list[tuple[str, float, int]] = field(default_factory=list)
    model_type: int = 1
    byte_fallback: bool = False
    treat_whitespace_as_suffix: bool = False
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    normalizer: NormalizerSpec = field(default_factory=NormalizerSpec)
    denormalizer: NormalizerSpec | None = None


def parse_model_proto(data: bytes, source: str = "tokenizer.model") -> SentencePieceModel:
    """Read the fields lollm needs from the bytes of a serialized ``ModelProto``."""
    model = SentencePieceModel()
    top = _ProtoReader(data, source)
    for number, wire_type, value in top.fields():
        if number == 1:
            _expect(wire_type, 2, "ModelProto.pieces", top)
            model.pieces.append(_parse_piece(top.sub(value), len(model.pieces)))
        elif number == 2:
            _expect(wire_type, 2, "ModelProto.trainer_spec", top)
            _parse_trainer_spec(top.sub(value), model)
        elif number == 3:
            _expect(wire_type, 2, "ModelProto.normalizer_spec", top)
            model.normalizer = _parse_normalizer_spec(top.sub(value))
        elif number == 5:
            _expect(wire_type, 2, "ModelProto.denormalizer_spec", top)
            model.denormalizer = _parse_normalizer_spec(top.sub(value))
        # 4 (self_test_data) and unknown fields are skipped
    if not model.pieces:
        raise TokenizerError(f"{source}: the SentencePiece model has no pieces")
    return model


def _parse_piece(reader: _ProtoReader, index: int) -> tuple[str, float, int]:
    piece, score, kind = None, 0.0, NORMAL
    for number, wire_type, value in reader.fields():
        if number == 1:
            _expect(wire_type, 2, "SentencePiece.piece", reader)
            piece = reader.text(value)
        elif number == 2:
            _expect(wire_type, 5, "SentencePiece.score", reader)
            score = struct.unpack("<f", value)[0]
        elif number == 3:
            _expect(wire_type, 0, "SentencePiece.type", reader)
            kind = _int32(value)
    if not piece:
        raise TokenizerError(f"{reader.source}: piece #{index} is empty")
    if kind not in PIECE_TYPE_NAMES:
        raise TokenizerError(f"{reader.source}: piece #{index} {piece!r} has unknown type {kind}")
    return piece, score, kind


def _parse_trainer_spec(reader: _ProtoReader, model: SentencePieceModel) -> None:
    for number, wire_type, value in reader.fields():
        if wire_type != 0:
            continue  # strings and floats of the trainer spec are training settings
        if number == 3:
            model.model_type = _int32(value)
        elif number == 24:
            model.treat_whitespace_as_suffix = bool(value)
        elif number == 35:
            model.byte_fallback = bool(value)
        elif number == 40:
            model.unk_id = _int32(value)
        elif number == 41:
            model.bos_id = _int32(value)
        elif number == 42:
            model.eos_id = _int32(value)
        elif number == 43:
            model.pad_id = _int32(value)


def _parse_normalizer_spec(reader: _ProtoReader) -> NormalizerSpec:
    spec = NormalizerSpec()
    for number, wire_type, value in reader.fields():
        if number == 1 and wire_type == 2:
            spec.name = reader.text(value)
        elif number == 2 and wire_type == 2:
            spec.precompiled_charsmap = reader.data[value[0] : value[1]]
        elif number == 3 and wire_type == 0:
            spec.add_dummy_prefix = bool(value)
        elif number == 4 and wire_type == 0:
            spec.remove_extra_whitespaces = bool(value)
        elif number == 5 and wire_type == 0:
            spec.escape_whitespaces = bool(value)
    return spec


def read_model_file(path: str | os.PathLike) -> SentencePieceModel:
    """Parse a ``tokenizer.model`` file; every failure names the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise TokenizerError(f"cannot read {path}: {error.strerror or error}") from None
    return parse_model_proto(data, str(path))


# ---------------------------------------------------------------- normalizer


class SentencePieceNormalizer:
    """SentencePiece's text normalization for the ``identity`` rule (no character mapping).

    In order:

    1. ``remove_extra_whitespaces``: drop spaces at the start and the end and
       squeeze every run of spaces into one;
    2. ``add_dummy_prefix``: put one space in front of a non-empty text;
    3. ``escape_whitespaces``: write every space as "▁".

    Only U+0020 counts as a space here ("\\t" and "\\n" are ordinary characters).
    """

    def __init__(self, *, add_dummy_prefix: bool, remove_extra_whitespaces: bool, escape_whitespaces: bool) -> None:
        self.add_dummy_prefix = add_dummy_prefix
        self.remove_extra_whitespaces = remove_extra_whitespaces
        self.escape_whitespaces = escape_whitespaces
        self._space = SPACE_MARKER if escape_whitespaces else " "

    def __call__(self, text: str) -> str:
        if self.remove_extra_whitespaces:
            text = text.lstrip(" ")
        if not text:
            return ""
        if self.remove_extra_whitespaces:
            text = regex.sub(" {2,}", " ", text)
        if self.add_dummy_prefix:
            text = " " + text
        if self.escape_whitespaces:
            text = text.replace(" ", SPACE_MARKER)
        if self.remove_extra_whitespaces:
            # after escaping, like SentencePiece: a literal "▁" at the end goes too
            text = text.rstrip(self._space)
        return text


def build_normalizer(spec: NormalizerSpec, source: str) -> SentencePieceNormalizer:
    """The normalizer of a model file; refuses the character-mapping rules we do not implement."""
    if spec.precompiled_charsmap:
        raise TokenizerError(
            f"{source}: the SentencePiece normalization rule {spec.name or '(unnamed)'!r} maps characters with a "
            "precompiled_charsmap, which lollm does not implement (only 'identity')"
        )
    return SentencePieceNormalizer(
        add_dummy_prefix=spec.add_dummy_prefix,
        remove_extra_whitespaces=spec.remove_extra_whitespaces,
        escape_whitespaces=spec.escape_whitespaces,
    )


# ----------------------------------------------------------------------- BPE


class SentencePieceBPE:
    """SentencePiece's BPE: merge the adjacent pair that forms the highest-scoring piece.

    ``pieces`` gives ``(text, score, type)`` for every id, in id order (any
    iterable, read once, so ``zip(texts, scores, types)`` builds no list of
    tuples). ``mergeable_types`` says which pieces the merge loop may form:
    SentencePiece itself uses NORMAL, USER_DEFINED and UNUSED pieces;
    llama.cpp (GGUF) any token.
    ``byte_fallback`` spells a leftover unknown character as its byte pieces;
    without it, unknown characters become ``unk_id`` (a run of them one
    ``unk_id``). ``resegment_unused`` (SentencePiece) splits a piece of type
    UNUSED that the merges produced back into the two pieces it was made of.

    Encoding one text (already normalized, spaces written as "▁"):

    1. split it into single characters (Python ``str`` items);
    2. run the merge loop with priority ``-score(left + right)`` (lowest first,
       so the highest score wins; ties go to the leftmost pair) over pairs whose
       concatenation is a mergeable piece;
    3. look every remaining symbol up; a symbol that is not a piece is a single
       unknown character: byte pieces, or ``<unk>``.

    The tables: ``vocab`` (piece -> id, a :class:`~lollm.tokenizer.vocabulary.Vocabulary`:
    flat arrays, not a dict), ``scores`` (an ``array`` of one float per id) and
    ``types`` (``bytes``, one type per id). The priority of a pair is found
    through ``vocab`` and ``scores``; a second dict piece -> priority cost 14 MB
    for Gemma 3's 262,144 pieces.
    """

    def __init__(
        self,
        pieces: Iterable[tuple[str, float, int]],
        *,
        byte_fallback: bool,
        unk_id: int | None,
        mergeable_types: frozenset[int] = frozenset({NORMAL, USER_DEFINED, UNUSED}),
        resegment_unused: bool = False,
        source: str = "the SentencePiece model",
    ) -> None:
        self.source = source
        scores = array("d")
        types = bytearray()

        def texts() -> Iterator[str]:  # the pieces' texts, for the vocabulary; scores and types on the side
            for token_id, (text, score, kind) in enumerate(pieces):
                if kind not in PIECE_TYPE_NAMES:
                    raise TokenizerError(f"{source}: piece #{token_id} {text!r} has unknown type {kind}")
                scores.append(score)
                types.append(kind)
                yield text

        #: piece -> id (and id -> piece), flat arrays (:class:`~lollm.tokenizer.vocabulary.Vocabulary`)
        self.vocab = Vocabulary(texts(), source=source)
        #: score of each id (float32 when every score is one: a model file's and a GGUF's are)
        self.scores: array = _compact(scores)
        #: type of each id (NORMAL ... BYTE), one byte each
        self.types: bytes = bytes(types)
        #: which types the merge loop may form; None: all of them (llama.cpp), no check needed
        self._mergeable: frozenset[int] | None = (
            None if set(PIECE_TYPE_NAMES) <= mergeable_types else frozenset(mergeable_types)
        )
        self.unk_id = unk_id
        if unk_id is not None and not 0 <= unk_id < len(self.types):
            raise TokenizerError(f"{source}: the unknown piece id {unk_id} is outside the vocabulary")
        self.byte_fallback = byte_fallback
        self._byte_ids: list[int] = []
        if byte_fallback:
            missing = [byte_token(b) for b in range(256) if byte_token(b) not in self.vocab]
            if missing:
                raise TokenizerError(
                    f"{source}: byte_fallback needs all 256 byte pieces <0x00>..<0xFF>; missing {missing[:4]}"
                    f"{' ...' if len(missing) > 4 else ''}"
                )
            self._byte_ids = [self.vocab[byte_token(b)] for b in range(256)]
        elif unk_id is None:
            raise TokenizerError(f"{source}: the model has neither byte_fallback nor an unknown piece")
        self.resegment_unused = resegment_unused
        self._encode_cached = functools.lru_cache(maxsize=TEXT_CACHE_SIZE)(self._encode)

    def encode_word(self, text: str) -> list[int]:
        """Token ids of one normalized text (SentencePiece has no word splitting: this is a whole segment)."""
        return list(self._encode_cached(text))

    def _encode(self, text: str) -> tuple[int, ...]:
        vocab, scores, types, mergeable = self.vocab, self.scores, self.types, self._mergeable
        resegment = self.resegment_unused
        # SentencePiece remembers how each UNUSED piece was formed, to split it
        # back afterwards ("resegment"); the merge loop asks for the priority
        # of a pair exactly when SentencePiece records it.
        how_formed: dict[str, tuple[str, str]] = {}

        def priority(left: str, right: str) -> float | None:
            """Minus the score of the piece ``left + right``; None when that is no mergeable piece."""
            piece = left + right
            token_id = vocab.get(piece)
            if token_id is None or (mergeable is not None and types[token_id] not in mergeable):
                return None
            if resegment and types[token_id] == UNUSED:
                how_formed[piece] = (left, right)
            return -scores[token_id]

        symbols = merge_symbols(list(text), priority)
        ids: list[int] = []
        previous_was_unk = False
        for symbol in symbols:
            for piece in self._resegment(symbol, how_formed):
                token_id = self.vocab.get(piece)
                if token_id is not None and token_id != self.unk_id:
                    ids.append(token_id)
                    previous_was_unk = False
                elif self.byte_fallback:
                    ids.extend(self._byte_ids[b] for b in piece.encode("utf-8"))
                    previous_was_unk = False
                else:
                    if not previous_was_unk:  # a run of unknown characters is one <unk>
                        ids.append(self.unk_id)
                    previous_was_unk = True
        return tuple(ids)

    def _resegment(self, piece: str, how_formed: dict[str, tuple[str, str]]) -> list[str]:
        """``[piece]``, or for an UNUSED piece the pieces it was merged from (recursively)."""
        if not how_formed:
            return [piece]
        token_id = self.vocab.get(piece)
        if token_id is None or self.types[token_id] != UNUSED or piece not in how_formed:
            return [piece]
        left, right = how_formed[piece]
        return self._resegment(left, how_formed) + self._resegment(right, how_formed)
