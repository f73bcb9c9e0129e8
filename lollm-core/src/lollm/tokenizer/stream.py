"""Streaming decode: print generated text token by token without ever showing half a character.

The problem
-----------
A byte-level token is a run of *bytes*, not of characters. Many characters
take several UTF-8 bytes (é = 2, 中 = 3, 😀 = 4), and BPE happily splits the
rarer ones: Qwen encodes the character "鱻" as two tokens, one holding the
bytes ``E9 B1`` and one holding ``BB``. Decoding each token on its own would
print two U+FFFD replacement characters instead of one character.

The fix
-------
Keep the bytes that do not yet form a complete character and wait for the
next token. Python's *incremental* UTF-8 decoder does exactly that: fed bytes
piece by piece, it returns every character that is complete, keeps an
unfinished multi-byte sequence for later, and (with ``errors="replace"``)
turns bytes that can never become valid UTF-8 into U+FFFD at once. At the end,
:meth:`StreamDecoder.flush` releases whatever is left, so the concatenation of
all outputs equals ``Tokenizer.decode`` of all ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class StreamDecoder:
    """Turn token ids into text one id at a time; the printed pieces join up to ``decode(ids)``.

    Made by :meth:`lollm.tokenizer.Tokenizer.stream_decoder`; ``token_bytes``
    gives the bytes of one id and ``skip_ids`` are ids to leave out (special
    tokens when ``skip_special_tokens=True``).
    """

    def __init__(
        self,
        token_bytes: Callable[[int], bytes],
        skip_ids: frozenset[int] = frozenset(),
        *,
        strip_leading_spaces: int = 0,
    ) -> None:
        self._token_bytes = token_bytes
        self._skip_ids = skip_ids
        #: spaces still to remove from the start of the text (a SentencePiece dummy prefix)
        self._strip = strip_leading_spaces
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete (may be ``""`` while a character is unfinished)."""
        if token_id in self._skip_ids:
            return ""
        data = self._token_bytes(token_id)
        while self._strip and data:
            if data.startswith(b" "):
                data = data[1:]
                self._strip -= 1
            else:
                self._strip = 0  # the text has started: nothing more to strip
        return self._utf8.decode(data)

    def flush(self) -> str:
        """End of the stream: return what is left, with an unfinished character shown as U+FFFD."""
        return self._utf8.decode(b"", final=True)
