"""Build a tokenizer from GGUF metadata (the ``tokenizer.ggml.*`` keys llama.cpp writes).

A GGUF file has no tokenizer.json. llama.cpp's converter stores the tokenizer
as metadata instead, and llama.cpp's ``llama-vocab.cpp`` is the reference for
what those keys mean. The keys:

====================================  ==================================================
``tokenizer.ggml.model``              ``"gpt2"`` (byte-level BPE), ``"llama"`` (SentencePiece BPE)
                                      or ``"gemma4"`` (BPE by rank over SentencePiece-style pieces)
``tokenizer.ggml.pre``                gpt2 only: which word-splitting regex (:data:`PRE_TOKENIZERS`)
``tokenizer.ggml.tokens``             the vocabulary, one string per id
``tokenizer.ggml.token_type``         per id: 1 normal, 2 unknown, 3 control, 4 user-defined,
                                      5 unused, 6 byte
``tokenizer.ggml.scores``             llama only: per id, the SentencePiece score
``tokenizer.ggml.merges``             gpt2 and gemma4: ``"Ġ t"`` strings, in rank order
``tokenizer.ggml.bos_token_id``       and ``eos_``, ``unknown_``, ``padding_``, ...: special ids
``tokenizer.ggml.add_bos_token``      put bos in front of an encoded text (default: llama yes,
                                      gpt2 no except the llama3 pre-tokenizers)
``tokenizer.ggml.add_eos_token``      put eos after it (default no)
``tokenizer.ggml.add_space_prefix``   llama only: SentencePiece's dummy "▁" prefix (default yes)
``tokenizer.chat_template``           the Jinja chat template
====================================  ==================================================

How each part maps onto lollm's pipeline:

* **Special tokens first.** Tokens of type control (``<|im_start|>``,
  ``<start_of_turn>``), user-defined (Gemma's ``\\n\\n``, ``<table>``) and
  unknown become added tokens: they are cut out of the raw text before
  anything else, as llama.cpp does (``tokenizer_st_partition``). Control and
  unknown tokens are *special* (``skip_special_tokens`` drops them when
  decoding); user-defined ones are ordinary text. Gemma's user-defined runs of
  spaces get their SentencePiece spelling back ("▁▁") and are matched after
  the spaces of the text became "▁" (see :func:`_respell_space_tokens`).
* **gpt2**: the byte-level BPE of :class:`~lollm.tokenizer.bpe.BPE` with the
  merges of the file, split into words by the regexes of ``tokenizer.ggml.pre``.
* **llama**: SentencePiece's BPE (:class:`~lollm.tokenizer.sentencepiece.SentencePieceBPE`)
  with the scores of the file. Every stretch of text between special tokens
  gets its spaces written as "▁" and, with ``add_space_prefix``, one "▁" in
  front. Like llama.cpp, the merge loop may form any token of the vocabulary,
  and a leftover character that is no token is spelled with the byte tokens
  ``<0xNN>``.
* **gemma4**: Gemma 4's tokenizer.json is a BPE with ranked merges over
  SentencePiece-style pieces ("▁" for a space, ``<0xNN>`` byte fallback), and
  llama.cpp reads it so: :class:`~lollm.tokenizer.bpe.BPE` with the file's
  merges, every space written as "▁", no "▁" in front, and the text not cut into
  words (as transformers runs Gemma 4's tokenizer.json; llama.cpp cuts it between runs
  of newlines and the rest, and so spells "\\r\\n" as two tokens).

Anything else (another ``tokenizer.ggml.model``, an unknown pre-tokenizer, a
key we do not know, a switch we do not implement) raises
:class:`~lollm.errors.TokenizerError` naming it.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lollm.errors import TokenizerError
from lollm.gguf.metadata import StringArray
from lollm.gguf.reader import GGUFFile
from lollm.tokenizer.added_tokens import AddedToken, AddedVocabulary
from lollm.tokenizer.bpe import BPE, byte_token
from lollm.tokenizer.chat import ChatTemplate
from lollm.tokenizer.decoders import SPACE_MARKER, ByteLevelDecoder, SentencePieceDecoder
from lollm.tokenizer.pretokenize import GPT2_PATTERN, QWEN2_PATTERN, ByteLevel, PreTokenizer, RegexSplit
from lollm.tokenizer.sentencepiece import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED, SentencePieceBPE
from lollm.tokenizer.tokenizer import Tokenizer
from lollm.tokenizer.vocabulary import Vocabulary

PREFIX = "tokenizer.ggml."

# ------------------------------------------------- pre-tokenizers (gpt2 only)

#: Llama 3's regex: like Qwen2's, but numbers are cut into groups of up to three digits.
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: Qwen3.5's regex: Qwen2's, with combining marks (\p{M}) kept inside words.
QWEN35_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: llama.cpp's spelling of GPT-2's regex (no final ``|\s+``: llama.cpp keeps the
#: text between matches as words too, so the result is the same).
_GPT2_LLAMA_CPP = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""


@dataclass(frozen=True)
class GGUFPreTokenizer:
    """One row of llama.cpp's pre-tokenizer table.

    ``regexes`` are applied one after the other, each cutting the pieces left by
    the previous one (matches and the text between them both stay).
    ``ignore_merges``: a word that is a token as a whole is emitted directly.
    ``add_bos``: llama.cpp's default for ``tokenizer.ggml.add_bos_token``.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = GGUFPreTokenizer((GPT2_PATTERN,))
_LLAMA3 = GGUFPreTokenizer((LLAMA3_PATTERN,), ignore_merges=True, add_bos=True)
_QWEN2 = GGUFPreTokenizer((QWEN2_PATTERN,))
_STARCODER = GGUFPreTokenizer((r"\p{N}", _GPT2_LLAMA_CPP))

#: ``tokenizer.ggml.pre`` -> how llama.cpp splits words, transcribed from
#: llama.cpp's src/llama-vocab.cpp (the name -> LLAMA_VOCAB_PRE_TYPE_* table in
#: ``llama_vocab::impl::load`` and the regexes of ``llm_tokenizer_bpe``).
#: Where llama.cpp rewrites a tokenizer.json regex for its own regex engine
#: (``'[sS]`` for ``(?i:'s)``) we keep the original, which it quotes. Only
#: names whose whole row (regexes and switches) is reproduced here are listed;
#: the others raise.
PRE_TOKENIZERS: dict[str, GGUFPreTokenizer] = {
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes applied in turn
    "default": GGUFPreTokenizer(
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_LLAMA_CPP, r"\p{N}+", r"[0-9][0-9][0-9]")
    ),
    # LLAMA_VOCAB_PRE_TYPE_GPT2 / MPT / OLMO share GPT-2's regex
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3, with ignore_merges and add_bos
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    # DBRX and SMAUG: Llama 3's regex without its switches
    "dbrx": GGUFPreTokenizer((LLAMA3_PATTERN,)),
    "smaug-bpe": GGUFPreTokenizer((LLAMA3_PATTERN,)),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2 (and STABLELM2, which shares its regex)
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "stablelm2": _QWEN2,
    # LLAMA_VOCAB_PRE_TYPE_QWEN35
    "qwen35": GGUFPreTokenizer((QWEN35_PATTERN,)),
    # LLAMA_VOCAB_PRE_TYPE_STARCODER / REFACT / SMOLLM: single digits, then GPT-2's regex
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "smollm": _STARCODER,
}

# ------------------------------------------------------------------ the keys

#: name in tokenizer_config.json -> GGUF key of its id
SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
    "sep_token": "seperator_token_id",  # sic: llama.cpp's spelling
    "cls_token": "cls_token_id",
    "mask_token": "mask_token_id",
}

#: Keys that only name tokens for llama.cpp's own use (end of turn, fill-in-the-middle):
#: they change no id of an encoded text.
_INFORMATIONAL_KEYS = {
    "token_type_count", "eot_token_id", "eom_token_id", "prefix_token_id", "suffix_token_id", "middle_token_id",
    "fim_pre_token_id", "fim_suf_token_id", "fim_mid_token_id", "fim_pad_token_id", "fim_rep_token_id",
    "fim_sep_token_id",
}
_KNOWN_KEYS = {
    "model", "pre", "tokens", "token_type", "scores", "merges", "add_bos_token", "add_eos_token", "add_sep_token",
    "add_space_prefix", "remove_extra_whitespaces", "precompiled_charsmap",
    *SPECIAL_TOKEN_KEYS.values(), *_INFORMATIONAL_KEYS,
}
_TOKEN_TYPES = {NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE}


def load_gguf_tokenizer(metadata: Mapping[str, object] | str | os.PathLike, *, source: str | None = None) -> Tokenizer:
    """The :class:`Tokenizer` described by a GGUF file's metadata.

    ``metadata`` is the key -> value dict of :attr:`lollm.gguf.GGUFFile.metadata`
    (arrays as lists or numpy arrays), or the path of a .gguf file. ``source`` names
    where the metadata came from in errors (``"GGUF file model.gguf"``); a path names itself.
    Raises TokenizerError, whose message always starts with that name.
    """
    if isinstance(metadata, (str, os.PathLike)):
        with GGUFFile(metadata) as gguf:
            return _build_named(gguf.metadata, source or f"GGUF file {os.fspath(metadata)}")
    if not isinstance(metadata, Mapping):
        raise TypeError(f"load_gguf_tokenizer() needs the metadata dict or a path, got {type(metadata).__name__}")
    return _build_named(metadata, source or "GGUF metadata")


def _build_named(metadata: Mapping[str, object], source: str) -> Tokenizer:
    """:func:`_build`, with every TokenizerError's message made to start with ``source`` (a
    check deeper down, such as the added-token scan's, may not know which file it reads)."""
    try:
        return _build(metadata, source)
    except TokenizerError as exc:
        if str(exc).startswith(source):
            raise
        raise TokenizerError(f"{source}: {exc}") from None


def _build(metadata: Mapping[str, object], source: str) -> Tokenizer:
    model_name = _get(metadata, "model", str, source)
    if model_name is None:
        raise TokenizerError(f"{source}: has no {PREFIX}model, so it describes no tokenizer")
    unknown = sorted(k for k in metadata if k.startswith(PREFIX) and k[len(PREFIX):] not in _KNOWN_KEYS)
    if unknown:
        raise TokenizerError(f"{source}: tokenizer key(s) {', '.join(unknown)} are not implemented by lollm")
    tokens = _get(metadata, "tokens", list, source, lazy=True)  # a GGUF's StringArray stays in the file
    if not tokens or not (isinstance(tokens, StringArray) or all(isinstance(t, str) for t in tokens)):
        raise TokenizerError(f"{source}: {PREFIX}tokens must be a non-empty list of strings")
    types = _array(metadata, "token_type", len(tokens), source)
    if types is not None and not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise TokenizerError(f"{source}: {PREFIX}token_type must be a list of integers (one type per token)")
    if types is None:
        types = [NORMAL] * len(tokens)
    bad = sorted({t for t in types if t not in _TOKEN_TYPES})
    if bad:
        raise TokenizerError(f"{source}: {PREFIX}token_type holds unknown type(s) {bad} (known: 1..6)")
    types = bytes(types)  # one byte a token, not a list of 262,144 references
    if _get(metadata, "add_sep_token", bool, source):
        raise TokenizerError(f"{source}: {PREFIX}add_sep_token (BERT-style [SEP]) is not implemented by lollm")
    if PREFIX + "precompiled_charsmap" in metadata:
        raise TokenizerError(f"{source}: {PREFIX}precompiled_charsmap (T5-style normalization) is not implemented by lollm")

    # Control, unknown and user-defined tokens are cut out of the raw text first.
    added = [
        AddedToken(id=i, content=tokens[i], special=types[i] != USER_DEFINED, normalized=False)
        for i in range(len(tokens))
        if types[i] in (CONTROL, UNKNOWN, USER_DEFINED)
    ]
    if model_name == "gpt2":
        model, pre_tokenizer, normalizer, decoder, default_bos = _gpt2(metadata, tokens, source)
    elif model_name == "llama":
        respelled, added = _respell_space_tokens(tokens, types, added)
        model, pre_tokenizer, normalizer, decoder, default_bos = _llama(metadata, tokens, respelled, types, source)
    elif model_name == "gemma4":
        model, pre_tokenizer, normalizer, decoder, default_bos = _gemma4(metadata, tokens, source)
    else:
        raise TokenizerError(
            f"{source}: {PREFIX}model {model_name!r} is not implemented by lollm (known: 'gpt2', 'llama', 'gemma4')"
        )
    special_tokens = {}
    for name, key in SPECIAL_TOKEN_KEYS.items():
        token_id = _get(metadata, key, int, source)
        if token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise TokenizerError(f"{source}: {PREFIX}{key} = {token_id} is outside the vocabulary of {len(tokens)}")
            special_tokens[name] = model.vocab.piece(token_id)
    prefix_ids, suffix_ids = [], []
    add_bos = _get(metadata, "add_bos_token", bool, source)
    add_eos = _get(metadata, "add_eos_token", bool, source)
    for flag, default, key, target in (
        (add_bos, default_bos, "bos_token_id", prefix_ids),
        (add_eos, False, "eos_token_id", suffix_ids),
    ):
        if flag if flag is not None else default:
            token_id = _get(metadata, key, int, source)
            if token_id is None:
                raise TokenizerError(f"{source}: the tokenizer adds {key.split('_')[0]} but {PREFIX}{key} is missing")
            target.append(token_id)

    return Tokenizer(
        model=model,
        pre_tokenizer=pre_tokenizer,
        added_vocabulary=AddedVocabulary(added),
        normalizer=normalizer,
        prefix_ids=prefix_ids,
        suffix_ids=suffix_ids,
        special_tokens=special_tokens,
        chat_templates=_chat_templates(metadata, source),
        decoder=decoder,
    )


def _gpt2(metadata: Mapping[str, object], tokens: list[str], source: str):
    """Byte-level BPE: the vocabulary and merges of the file, the regexes of ``tokenizer.ggml.pre``."""
    pre_name = _get(metadata, "pre", str, source)
    known = ", ".join(sorted(PRE_TOKENIZERS))
    if pre_name is None:
        raise TokenizerError(
            f"{source}: {PREFIX}pre is missing; it names the word-splitting regex of a gpt2 tokenizer "
            f"(llama.cpp would guess 'default'; lollm refuses to guess). Known: {known}"
        )
    if pre_name not in PRE_TOKENIZERS:
        raise TokenizerError(f"{source}: {PREFIX}pre {pre_name!r} is not implemented by lollm (known: {known})")
    pre = PRE_TOKENIZERS[pre_name]
    if _get(metadata, "add_space_prefix", bool, source):
        raise TokenizerError(f"{source}: {PREFIX}add_space_prefix with a gpt2 tokenizer is not implemented by lollm")
    merges = _get(metadata, "merges", list, source, lazy=True)
    if merges is None:
        raise TokenizerError(f"{source}: a gpt2 tokenizer needs {PREFIX}merges")
    model = BPE(Vocabulary(tokens, source=source), _split_merges(merges, source), ignore_merges=pre.ignore_merges,
                source=source)
    steps = [RegexSplit(pattern, source=source) for pattern in pre.regexes]
    steps.append(ByteLevel(add_prefix_space=False, use_regex=False, source=source))
    return model, PreTokenizer(steps), None, ByteLevelDecoder(), pre.add_bos


def _split_merges(merges: Iterable[object], source: str) -> Iterator[tuple[str, str]]:
    """``(first, second)`` of each ``"Ġ t"`` merge string, one at a time (the BPE keeps no string of them).

    llama.cpp cuts a merge at the first space after its first character.
    """
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1) if isinstance(merge, str) else -1
        if cut < 0:
            raise TokenizerError(f"{source}: {PREFIX}merges[{rank}] = {merge!r} is not two tokens separated by a space")
        yield merge[:cut], merge[cut + 1 :]


def _gemma4(metadata: Mapping[str, object], tokens: list[str], source: str):
    """Gemma 4: BPE by rank over SentencePiece-style pieces, as llama.cpp's ``llama-vocab.cpp`` reads it.

    The file's merges rank the pairs (as gpt2's do); spaces become "▁" (no "▁" in front:
    the converter writes ``add_space_prefix`` false); a character that is no token is spelled
    with the byte tokens ``<0xNN>``. The text is not cut into words: Gemma 4's tokenizer.json
    splits on " " after every space became "▁", which cuts nothing. (llama.cpp's pre-tokenizer
    "gemma4" cuts between runs of newlines and the rest, so it spells "\\r\\n" as two tokens where
    transformers has one; lollm follows transformers.)"""
    pre_name = _get(metadata, "pre", str, source)
    if pre_name not in (None, "gemma4"):
        raise TokenizerError(f"{source}: {PREFIX}pre {pre_name!r} with a gemma4 tokenizer is not implemented by lollm")
    if _get(metadata, "add_space_prefix", bool, source):
        raise TokenizerError(f"{source}: {PREFIX}add_space_prefix with a gemma4 tokenizer is not implemented by lollm")
    merges = _get(metadata, "merges", list, source, lazy=True)
    if merges is None:
        raise TokenizerError(f"{source}: a gemma4 tokenizer needs {PREFIX}merges")
    byte_tokens = {token for token in tokens if len(token) == 6 and token.startswith("<0x")}
    byte_fallback = all(byte_token(b) in byte_tokens for b in range(256))
    model = BPE(Vocabulary(tokens, source=source), _split_merges(merges, source), byte_fallback=byte_fallback, source=source)

    def escape_spaces(text: str) -> str:
        return text.replace(" ", SPACE_MARKER)

    decoder = SentencePieceDecoder(byte_fallback=byte_fallback, strip_leading_spaces=0)
    return model, PreTokenizer([]), escape_spaces, decoder, True


def _llama(metadata: Mapping[str, object], tokens: Sequence[str], respelled: dict[int, str], types: bytes, source: str):
    """SentencePiece BPE by score, spaces as "▁", byte fallback, optional "▁" prefix.

    ``respelled``: id -> the spelling that replaces the file's (see :func:`_respell_space_tokens`)."""
    scores = _array(metadata, "scores", len(tokens), source)
    if scores is not None and not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
        raise TokenizerError(f"{source}: {PREFIX}scores must be a list of finite numbers (one score per token)")
    if scores is None:
        scores = itertools.repeat(0.0)
    if _get(metadata, "remove_extra_whitespaces", bool, source):
        raise TokenizerError(f"{source}: {PREFIX}remove_extra_whitespaces is not implemented by lollm for 'llama'")
    add_space_prefix = _get(metadata, "add_space_prefix", bool, source)
    if add_space_prefix is None:
        add_space_prefix = True  # llama.cpp's default for SentencePiece vocabularies
    # llama.cpp spells a character that is no token with the byte tokens <0xNN>.
    byte_tokens = {token for token in tokens if len(token) == 6 and token.startswith("<0x")}
    byte_fallback = all(byte_token(b) in byte_tokens for b in range(256))
    unk_id = _get(metadata, "unknown_token_id", int, source)
    texts = (respelled.get(i, token) for i, token in enumerate(tokens)) if respelled else tokens
    model = SentencePieceBPE(
        zip(texts, scores, types),
        byte_fallback=byte_fallback,
        unk_id=unk_id,
        mergeable_types=frozenset(_TOKEN_TYPES),  # llama.cpp merges into any token
        source=source,
    )

    prefix = SPACE_MARKER if add_space_prefix else ""

    def escape_spaces(text: str) -> str:
        # llama.cpp: a space in front of each stretch of text that starts the
        # text or follows a special token (with add_space_prefix), then every
        # space written as "▁".
        return prefix + text.replace(" ", SPACE_MARKER) if text else text

    decoder = SentencePieceDecoder(byte_fallback=byte_fallback, strip_leading_spaces=1 if add_space_prefix else 0)
    return model, PreTokenizer([]), escape_spaces, decoder, True


def _respell_space_tokens(
    tokens: Sequence[str], types: bytes, added: list[AddedToken]
) -> tuple[dict[int, str], list[AddedToken]]:
    """Give Gemma's whitespace tokens back their SentencePiece spelling ("▁▁" rather than "  ").

    Gemma's vocabulary has user-defined pieces made of 2 to 31 "▁". llama.cpp's
    converter writes them with real spaces, and llama.cpp matches them in the
    raw text. SentencePiece matches "▁▁" in the text *after* spaces became "▁"
    (longest first, like any user-defined piece), and so do we: same ids on
    ordinary text, and also right on text that itself contains "▁" characters.

    Returns the new spellings by id (the vocabulary takes them as it is built) and the
    added tokens with them.
    """
    respelled: dict[int, str] = {}
    new_added = []
    for token in added:
        if types[token.id] == USER_DEFINED and " " in token.content:
            content = respelled[token.id] = token.content.replace(" ", SPACE_MARKER)
            token = AddedToken(id=token.id, content=content, special=False, normalized=True)
        new_added.append(token)
    return respelled, new_added


def _chat_templates(metadata: Mapping[str, object], source: str) -> dict[str, ChatTemplate]:
    templates = {}
    for key, value in metadata.items():
        if key == "tokenizer.chat_template":
            name = "default"
        elif key.startswith("tokenizer.chat_template."):
            name = key.removeprefix("tokenizer.chat_template.")
        else:
            continue
        if not isinstance(value, str):
            raise TokenizerError(f"{source}: {key} must be a string, got {type(value).__name__}")
        templates[name] = ChatTemplate(value, f"{source} {key!r}")
    return templates


# ------------------------------------------------------------------ helpers


def _get(metadata: Mapping[str, object], key: str, kind: type, source: str, *, lazy: bool = False) -> Any:
    """``metadata["tokenizer.ggml." + key]`` checked to be of type ``kind``, or None when absent.

    A numpy array becomes a list; with ``lazy``, a GGUF :class:`~lollm.gguf.metadata.StringArray`
    stays one (its strings are then decoded one at a time as the caller iterates).
    """
    value = metadata.get(PREFIX + key)
    if value is None:
        return None
    if kind is list and hasattr(value, "tolist"):
        if lazy and isinstance(value, Sequence):
            return value  # a StringArray (a numpy array is no Sequence)
        value = value.tolist()  # a numpy array, or a StringArray read all at once
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise TokenizerError(f"{source}: {PREFIX}{key} should be {kind.__name__}, got {type(value).__name__}")
    return value


def _array(metadata: Mapping[str, object], key: str, length: int, source: str) -> list | None:
    values = _get(metadata, key, list, source)
    if values is not None and len(values) != length:
        raise TokenizerError(f"{source}: {PREFIX}{key} has {len(values)} entries for {length} tokens")
    return values
