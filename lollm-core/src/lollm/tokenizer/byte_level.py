"""The GPT-2 byte-to-unicode table: how byte-level BPE turns any byte into a printable character.

Why this exists
---------------
A byte-level BPE tokenizer works on the UTF-8 *bytes* of the text, so it can
encode any string with a base vocabulary of only 256 symbols and never meets an
"unknown character". But its vocabulary and merges are stored as *strings* in
JSON/text files, and raw bytes such as ``0x0A`` (newline) or ``0x20`` (space)
would be invisible or ambiguous there (merges.txt even uses a space as its
separator). GPT-2 therefore maps each of the 256 byte values to one printable
Unicode character:

* the 188 bytes that are already printable and not whitespace (``!`` .. ``~``,
  ``¡`` .. ``¬``, ``®`` .. ``ÿ``) map to the character with the same code point;
* the other 68 bytes (control characters, space, DEL, NBSP, soft hyphen, ...)
  map, in order, to code points 256, 257, 258, ... (``Ā``, ``ā``, ``Ă``, ...).

That is why a space shows up as ``Ġ`` (byte 0x20 is the 33rd non-printable
byte: 256 + 32 = U+0120 'Ġ') and a newline as ``Ċ`` (U+010A) in Qwen, GPT-2 and
Llama 3 vocabularies. The table is a bijection, so decoding maps each character
of a token back to its byte.
"""

from __future__ import annotations


def bytes_to_unicode() -> dict[int, str]:
    """Build GPT-2's table from each byte value (0..255) to the printable character that stands for it."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {byte: chr(byte) for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(next_code_point)
            next_code_point += 1
    return table


#: byte value -> its stand-in character, e.g. ``BYTE_TO_UNICODE[0x20] == "Ġ"``.
BYTE_TO_UNICODE: dict[int, str] = bytes_to_unicode()
#: stand-in character -> byte value, e.g. ``UNICODE_TO_BYTE["Ċ"] == 0x0A``.
UNICODE_TO_BYTE: dict[str, int] = {char: byte for byte, char in BYTE_TO_UNICODE.items()}

def text_to_byte_symbols(text: str) -> str:
    """Rewrite ``text`` as its UTF-8 bytes, one stand-in character per byte ('hé!' -> 'hÃ©!')."""
    # A speed trick: decoding the bytes as Latin-1 gives one character per byte
    # with the same code point (0..255), and str.translate then swaps each of
    # them for its stand-in (BYTE_TO_UNICODE is keyed by those code points) in
    # one pass written in C.
    return text.encode("utf-8").decode("latin-1").translate(BYTE_TO_UNICODE)


def byte_symbols_to_bytes(token: str) -> bytes:
    """Turn a byte-level token string back into the bytes it stands for ('Ġhello' -> b' hello').

    Like the Hugging Face ``ByteLevel`` decoder, a token containing a character
    that is not in the table (an added token such as ``'héllo wörld'``, which
    was never byte-mapped) is returned as its own UTF-8 encoding instead.
    """
    try:
        return bytes(UNICODE_TO_BYTE[char] for char in token)
    except KeyError:
        return token.encode("utf-8")
