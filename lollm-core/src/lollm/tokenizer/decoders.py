"""Decoders: what bytes each token stands for, in the two vocabulary styles lollm reads.

Decoding always works the same way (see :meth:`lollm.tokenizer.Tokenizer.decode`):
each id becomes its token string, each token string becomes *bytes*, all the
bytes are joined and then read as UTF-8. Only the middle step depends on how
the vocabulary spells its tokens:

* **byte-level** (GPT-2, Qwen2, Llama 3): every character of a token stands
  for one byte through GPT-2's table (``"Ġworld"`` -> ``b" world"``), see
  :mod:`lollm.tokenizer.byte_level`;
* **SentencePiece style** (Llama 2, Gemma): tokens are real text in which "▁"
  (U+2581) stands for a space (``"▁world"`` -> ``b" world"``), and the 256
  byte-fallback tokens ``<0x00>`` .. ``<0xFF>`` stand for one raw byte each
  (``"<0xE9>"`` -> ``b"\\xe9"``). A rare character is spelled by several of them,
  and joining the bytes before reading UTF-8 puts it back together.

Some SentencePiece tokenizers add a "▁" in front of the text when encoding
(``add_dummy_prefix``); their decoder removes the space it becomes from the
start of the decoded text again (tokenizer.json's ``Strip(" ", 1, 0)``).

tokenizer.json describes the decoder as a list of small steps; we accept the
combinations that mean one of the two styles above and refuse anything else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from lollm.errors import TokenizerError
from lollm.tokenizer.byte_level import byte_symbols_to_bytes

#: SentencePiece's visible stand-in for a space.
SPACE_MARKER = "\u2581"

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class ByteLevelDecoder:
    """Byte-level vocabularies: each character of a token is one byte through GPT-2's table."""

    #: How many spaces to remove from the start of the decoded text (never for byte-level).
    strip_leading_spaces: int = 0

    def token_bytes(self, token: str) -> bytes:
        return byte_symbols_to_bytes(token)


@dataclass(frozen=True)
class SentencePieceDecoder:
    """SentencePiece-style vocabularies: "▁" is a space, ``<0xNN>`` is one raw byte (``byte_fallback``).

    ``strip_leading_spaces`` removes up to that many spaces from the start of
    the whole decoded text: the space of the "▁" that ``add_dummy_prefix`` /
    ``Prepend("▁")`` put in front of the text when encoding.
    """

    byte_fallback: bool = True
    strip_leading_spaces: int = 0

    def token_bytes(self, token: str) -> bytes:
        if self.byte_fallback:
            match = _BYTE_TOKEN.fullmatch(token)
            if match is not None:
                return bytes([int(match.group(1), 16)])
        return token.replace(SPACE_MARKER, " ").encode("utf-8")


Decoder = ByteLevelDecoder | SentencePieceDecoder


def build_decoder(spec: Any, where: str) -> Decoder:
    """The decoder described by tokenizer.json's ``decoder`` entry.

    Accepted: ``ByteLevel``; or a ``Sequence`` of ``Replace("▁", " ")``,
    ``ByteFallback`` and ``Fuse`` (in any order), optionally followed by
    ``Strip(" ", n, 0)`` (what transformers writes for Llama 2 and Gemma).
    """
    if spec is None:
        raise TokenizerError(f"{where}: 'decoder' is missing; lollm needs to know how tokens become text")
    if not isinstance(spec, dict):
        raise TokenizerError(f"{where}: 'decoder' must be an object, got {spec!r}")
    kind = spec.get("type")
    steps = spec.get("decoders") if kind == "Sequence" else [spec]
    if not isinstance(steps, list) or not all(isinstance(step, dict) for step in steps):
        raise TokenizerError(f"{where}: decoder Sequence must hold a list of decoder objects, got {spec!r}")
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"]:
        return ByteLevelDecoder()

    replace = byte_fallback = fuse = False
    strip = 0
    for step in steps:
        step_kind = step.get("type")
        if strip:
            raise TokenizerError(f"{where}: decoder {kinds!r}: lollm only implements Strip as the last step")
        if step_kind == "Replace" and step.get("pattern") == {"String": SPACE_MARKER} and step.get("content") == " ":
            replace = True
        elif step_kind == "ByteFallback":
            byte_fallback = True
        elif step_kind == "Fuse":
            fuse = True
        elif step_kind == "Strip":
            if step.get("content") != " " or step.get("stop", 0) != 0 or not isinstance(step.get("start"), int):
                raise TokenizerError(f"{where}: decoder Strip {step!r} is not implemented by lollm (only Strip(' ', n, 0))")
            if not fuse:
                # Before Fuse, Strip would cut a space off *every* token.
                raise TokenizerError(f"{where}: decoder {kinds!r}: Strip before Fuse is not implemented by lollm")
            strip = step["start"]
        elif step_kind in ("ByteLevel", "Replace", "Strip", "Fuse", "ByteFallback", "Sequence"):
            raise TokenizerError(f"{where}: decoder {step!r} inside {kinds!r} is not implemented by lollm")
        else:
            raise TokenizerError(f"{where}: decoder type {step_kind!r} is not implemented by lollm")
    if not replace:
        raise TokenizerError(
            f"{where}: decoder {kinds!r} is not implemented by lollm: expected ByteLevel, or Replace('▁', ' ') "
            "with ByteFallback / Fuse / Strip"
        )
    return SentencePieceDecoder(byte_fallback=byte_fallback, strip_leading_spaces=strip)
