"""The :class:`Tokenizer`: text <-> token ids, chat prompts, and streaming decode.

Encoding runs the same pipeline as the Hugging Face tokenizers library::

    text
      -> cut out added tokens (<|im_start|>, ...)       added_tokens.py
      -> normalize the text between them (NFC, ...)      normalize.py
      -> pre-tokenize it into words                      pretokenize.py
      -> BPE-encode each word                            bpe.py
      -> add the post-processor's bos/eos ids            (here)

Decoding goes backwards: each id becomes its token string, each token string
becomes bytes (decoders.py: GPT-2's byte table, or SentencePiece's "▁" and
``<0xNN>`` byte tokens), and the concatenated bytes are read as UTF-8.

The same class serves both vocabulary styles; what differs is plugged in: the
model (:class:`~lollm.tokenizer.bpe.BPE` by merge rank, or
:class:`~lollm.tokenizer.sentencepiece.SentencePieceBPE` by piece score), the
normalizer, the pre-tokenizer and the decoder.

A ``Tokenizer`` is built from files by :func:`lollm.tokenizer.load_tokenizer`
(a model folder) or :func:`lollm.tokenizer.load_gguf_tokenizer` (GGUF
metadata); it never imports torch.
"""

from __future__ import annotations

import operator
import secrets
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import regex

from lollm.errors import TokenizerError
from lollm.tokenizer.added_tokens import AddedVocabulary
from lollm.tokenizer.chat import ChatTemplate
from lollm.tokenizer.decoders import ByteLevelDecoder, Decoder
from lollm.tokenizer.pretokenize import PreTokenizer
from lollm.tokenizer.stream import StreamDecoder
from lollm.tokenizer.vocabulary import Vocabulary


#: Code points that are not Unicode scalar values, so they have no UTF-8 bytes.
_SURROGATE = regex.compile(r"[\ud800-\udfff]")


def _refuse_surrogates(text: str) -> None:
    """TokenizerError when ``text`` holds a surrogate code point (U+D800..U+DFFF), saying what it is.

    U+DC80..U+DCFF is how Python keeps a byte that is not valid UTF-8 in a ``str`` (the
    ``surrogateescape`` error handler, which decodes command-line arguments): such a text was
    invalid UTF-8, and the message gives the byte and its offset in the original bytes. Other
    surrogates are lone halves of a UTF-16 pair (JSON's ``"\\ud800"``).
    """
    found = _SURROGATE.search(text)
    if found is None:
        return
    code = ord(found.group())
    offset = len(text[: found.start()].encode("utf-8"))  # nothing before it is a surrogate
    if 0xDC80 <= code <= 0xDCFF:
        raise TokenizerError(
            f"the text is not valid UTF-8: byte 0x{code - 0xDC00:02X} at byte offset {offset} is not part of a valid UTF-8 "
            f"sequence (Python keeps such a byte as U+{code:04X}); give the text as UTF-8"
        )
    raise TokenizerError(
        f"the text holds the lone surrogate U+{code:04X} at character {found.start()} (byte offset {offset}): half of "
        "a UTF-16 pair, which is not valid Unicode and has no UTF-8 bytes"
    )


class Model(Protocol):
    """What the tokenizer needs from its model: the vocabulary and a way to encode one word."""

    vocab: Vocabulary

    def encode_word(self, word: str) -> list[int]: ...


class Tokenizer:
    """A BPE tokenizer (byte-level like GPT-2 / Qwen2 / Llama 3, or SentencePiece-style like
    Llama 2 / Gemma) with its special tokens and chat template.

    Public attributes:

    * ``vocab_size``: number of ids, added tokens included (largest id + 1).
    * ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``: ids of the tokens
      tokenizer_config.json names ``bos_token`` / ``eos_token`` / ``pad_token``
      (``None`` when it names none).
    * ``add_bos``: whether ``encode(text)`` (with ``add_special_tokens=True``)
      puts ``bos_token_id`` in front. Qwen: False; Llama 3: True.
    * ``special_token_ids``: ids of the added tokens marked special (control
      tokens that ``skip_special_tokens=True`` leaves out of decoded text).
    * ``chat_template``: the default chat template's Jinja source, or ``None``.
    """

    def __init__(
        self,
        *,
        model: Model,
        pre_tokenizer: PreTokenizer,
        added_vocabulary: AddedVocabulary,
        normalizer: Callable[[str], str] | None = None,
        prefix_ids: list[int] | None = None,
        suffix_ids: list[int] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, ChatTemplate] | None = None,
        decoder: Decoder | None = None,
    ) -> None:
        self._model = model
        #: how a token string becomes bytes (byte-level table, or "▁" + <0xNN> byte tokens)
        self._decoder = decoder if decoder is not None else ByteLevelDecoder()
        self._pre_tokenizer = pre_tokenizer
        self._added = added_vocabulary
        self._normalizer = normalizer
        #: ids the post-processor puts before / after the text's ids (e.g. [bos]).
        self._prefix_ids = list(prefix_ids or [])
        self._suffix_ids = list(suffix_ids or [])
        #: names -> text of the named special tokens ("bos_token": "<|endoftext|>", ...).
        self._special_tokens = dict(special_tokens or {})
        self._chat_templates = dict(chat_templates or {})

        # id -> token string: the model's vocabulary answers (flat arrays, no table per id here);
        # an added token's content wins.
        self._added_by_id: dict[int, str] = {added.id: added.content for added in added_vocabulary.tokens}
        self.vocab_size: int = max(model.vocab.size, max(self._added_by_id, default=-1) + 1)
        self._token_bytes_cache: dict[int, bytes] = {}

        self.bos_token_id: int | None = self._named_token_id("bos_token")
        self.eos_token_id: int | None = self._named_token_id("eos_token")
        self.pad_token_id: int | None = self._named_token_id("pad_token")
        self.add_bos: bool = self.bos_token_id is not None and self.bos_token_id in self._prefix_ids
        self.special_token_ids: frozenset[int] = frozenset(t.id for t in added_vocabulary.tokens if t.special)

    def _named_token_id(self, name: str) -> int | None:
        content = self._special_tokens.get(name)
        if content is None:
            return None
        token_id = self.token_to_id(content)
        if token_id is None:
            raise TokenizerError(f"{name} {content!r} is neither an added token nor in the vocabulary")
        return token_id

    @property
    def chat_template(self) -> str | None:
        """The Jinja source of the default chat template (``None`` when the model ships none)."""
        template = self._chat_templates.get("default")
        return template.source if template is not None else None

    # ----------------------------------------------------------------- encode

    def encode(self, text: str, *, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        Added tokens written in the text (``"<|im_end|>"``) become their single
        id. With ``add_special_tokens=True`` the post-processor's ids (``bos``
        for Llama 3; nothing for Qwen) are added around the text.

        ``parse_special=False`` encodes the text of *special* added tokens as
        ordinary text (``"<|im_end|>"`` becomes ``<``, ``|``, ``im``, ...), so a
        text from someone else cannot forge control tokens; non-special added
        tokens are still single ids. This equals transformers'
        ``tokenizer(text, split_special_tokens=True)``. The default (``True``)
        equals transformers' default.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        _refuse_surrogates(text)
        ids: list[int] = []
        for piece, added_id in self._added.split(text, self._normalizer, special=parse_special):
            if added_id is not None:
                ids.append(added_id)
            else:
                ids.extend(self._encode_plain(piece))
        if add_special_tokens:
            ids = self._prefix_ids + ids + self._suffix_ids
        return ids

    def _encode_plain(self, piece: str) -> list[int]:
        """Pre-tokenize and BPE-encode ordinary (already normalized) text."""
        words = self._pre_tokenizer.pre_tokenize(piece)  # encode() refused surrogates, which have no bytes
        ids: list[int] = []
        for word in words:
            ids.extend(self._model.encode_word(word))
        return ids

    # ----------------------------------------------------------------- lookups

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string as stored in the vocabulary (``'Ġhello'``, ``'<|im_end|>'``), or ``None``."""
        added = self._added.by_content.get(token)
        if added is not None:
            return added.id
        return self._model.vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string of an id (``'Ġhello'`` for " hello"); unknown ids are an error."""
        try:
            i = operator.index(token_id)  # an int, numpy or torch integer; not a float or a str
        except TypeError:
            i = -1
        if isinstance(token_id, bool):
            i = -1  # True is an int to Python, never a token id
        token = self._added_by_id.get(i)
        if token is None and i >= 0:
            token = self._model.vocab.piece(i)
        if token is None:
            raise TokenizerError(f"token id {token_id!r} is not in the vocabulary (vocab_size {self.vocab_size})")
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (b' hello' for 'Ġhello'; a piece of a character for a split emoji)."""
        cached = self._token_bytes_cache.get(token_id)
        if cached is None:
            cached = self._decoder.token_bytes(self.id_to_token(token_id))
            self._token_bytes_cache[token_id] = cached
        return cached

    # ----------------------------------------------------------------- decode

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """Text of a list of ids: the bytes of all tokens joined, read as UTF-8.

        Bytes that do not form valid UTF-8 (for example a generation cut in the
        middle of an emoji) become U+FFFD. ``skip_special_tokens`` leaves out
        the ids in :attr:`special_token_ids`. A SentencePiece tokenizer that
        adds a dummy "▁" prefix when encoding removes its space here.
        """
        data = b"".join(
            self.token_bytes(token_id)
            for token_id in ids
            if not (skip_special_tokens and token_id in self.special_token_ids)
        )
        for _ in range(self._decoder.strip_leading_spaces):
            data = data.removeprefix(b" ")
        return data.decode("utf-8", errors="replace")

    def pieces(self, ids: list[int]) -> list[str]:
        """Readable text of each id on its own, for showing a tokenization (``lollm tokenize``).

        A token that holds only part of a multi-byte character shows its bytes
        as ``\\xNN`` escapes (the two tokens of "鱻" show as ``'\\xe9\\xb1'`` and ``'\\xbb'``).
        """
        return [self.token_bytes(token_id).decode("utf-8", errors="backslashreplace") for token_id in ids]

    def stream_decoder(self, *, skip_special_tokens: bool = False, keep: frozenset[int] = frozenset()) -> StreamDecoder:
        """A fresh :class:`StreamDecoder` to print generated ids as they come.

        ``keep``: special ids written out even with ``skip_special_tokens``
        (Gemma 4's tool-call markers, which lollm.serve.tools reads in the text).
        """
        skip = self.special_token_ids - keep if skip_special_tokens else frozenset()
        return StreamDecoder(self.token_bytes, skip, strip_leading_spaces=self._decoder.strip_leading_spaces)

    # ----------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **template_kwargs: object,
    ) -> str:
        """Render ``messages`` into the prompt text with the model's chat template.

        ``add_generation_prompt`` appends the header of a new assistant turn
        (``<|im_start|>assistant\\n`` for Qwen) so the model answers next.
        Extra keywords (``enable_thinking=False``, ...) are passed to the template.
        """
        template = self._select_chat_template(tools)
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            special_tokens=self._special_tokens,
            **template_kwargs,
        )

    def encode_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = True, parse_special: bool = True,
        rewrite: Callable[[str], str] | None = None, **template_kwargs: object
    ) -> list[int]:
        """Token ids of the chat prompt: the rendered template encoded without adding bos/eos again.

        The template writes its own control tokens, so with the default
        ``parse_special=True`` this equals transformers'
        ``apply_chat_template(messages, tokenize=True)``: special-token text
        *inside a message* becomes control tokens too, so a user who writes
        ``<|im_end|>\n<|im_start|>system`` closes their turn and opens a
        system turn.

        ``parse_special=False`` keeps the template's control tokens and encodes
        special-token text found in the messages, ``tools`` and ``documents``
        as ordinary text: use it for text from anyone who is not trusted with
        the prompt format (a network client). These values are rendered with
        each such text hidden behind a placeholder the template cannot mistake
        for anything; the placeholders become the original text again only
        after the control tokens were cut out. Without special-token text in
        them the ids are the same as with ``parse_special=True``. A tokenizer
        that matches special tokens only after normalization cannot keep the
        two apart: it refuses (``TokenizerError``) instead of guessing.

        ``rewrite``: a function applied to the rendered text before it is encoded (lollm.serve.images
        expands each image placeholder the template wrote into the image's tokens there); with
        ``parse_special=False`` the special-token text of the messages is still hidden from it, so it
        sees only the template's own.
        """
        render = dict(add_generation_prompt=add_generation_prompt, **template_kwargs)
        rewrite = rewrite or (lambda text: text)
        if parse_special:
            return self.encode(rewrite(self.apply_chat_template(messages, **render)), add_special_tokens=False)
        # everything the caller's client wrote that the template may print
        untrusted = {"messages": messages, **{key: render[key] for key in _UNTRUSTED_KWARGS if render.get(key) is not None}}
        strings = list(_strings(untrusted))
        specials = sorted({t.content for t in self._added.tokens if t.special}, key=lambda c: (-len(c), c))
        found = [c for c in specials if any(c in text for text in strings)]
        if not found:
            return self.encode(rewrite(self.apply_chat_template(messages, **render)), add_special_tokens=False)
        late = [t.content for t in self._added.tokens if t.special and t.normalized]
        if late:
            raise TokenizerError(
                f"the messages contain special-token text ({found[0]!r}), and this tokenizer matches some special "
                f"tokens only after normalization ({late[0]!r}), so their text cannot be kept apart from the messages'"
            )
        while True:  # a placeholder no message contains: private-use characters around random digits
            nonce = str(secrets.randbelow(10**12))
            if not any(nonce in text for text in strings):
                break
        placeholder = {content: f"\ue000{nonce}.{i}\ue001" for i, content in enumerate(found)}
        literal = {mark: content for content, mark in placeholder.items()}
        hide = regex.compile("|".join(regex.escape(c) for c in found))
        hidden = _map_strings(untrusted, lambda text: hide.sub(lambda m: placeholder[m.group()], text))
        text = rewrite(self.apply_chat_template(hidden.pop("messages"), **{**render, **hidden}))
        show = regex.compile("|".join(regex.escape(m) for m in literal))
        ids: list[int] = []
        restore = lambda piece: show.sub(lambda m: literal[m.group()], piece)  # noqa: E731
        for piece, added_id in self._added.split(text, self._normalizer, restore=restore):
            if added_id is not None:
                ids.append(added_id)  # one of the template's own control tokens
            else:
                ids.extend(self._encode_plain(piece))
        return ids

    def tool_chat_template(self) -> str | None:
        """The source of the chat template used when tools are given (``tool_use`` if there is one), or None."""
        template = self._chat_templates.get("tool_use") or self._chat_templates.get("default")
        return template.source if template is not None else None

    def chat_template_reads(self, name: str) -> bool:
        """Whether the default chat template reads the variable ``name`` (False without a template)."""
        template = self._chat_templates.get("default")
        return template is not None and template.reads(name)

    def _select_chat_template(self, tools: object) -> ChatTemplate:
        # Like transformers: a template named "tool_use" is preferred when tools are given.
        if tools and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            names = ", ".join(sorted(self._chat_templates))
            raise TokenizerError(f"the tokenizer has chat templates named {names} but none named 'default'")
        raise TokenizerError(
            "this tokenizer has no chat template (a model folder has none in chat_template.jinja or "
            "tokenizer_config.json, a GGUF file none in 'tokenizer.chat_template'); use plain text completion instead"
        )


#: The chat-template arguments besides the messages whose text comes from the caller's client
#: (encode_chat(parse_special=False) keeps special-token text in them plain).
_UNTRUSTED_KWARGS = ("tools", "documents")

#: How deep messages, tools and documents may nest (a client's JSON; deeper ends in a TokenizerError,
#: not in a RecursionError).
_MAX_NESTING = 100


def _strings(value: object, depth: int = 0):
    """Every string inside messages (contents, content parts, names ...), depth first."""
    if depth > _MAX_NESTING:
        raise TokenizerError(f"chat messages nest deeper than {_MAX_NESTING} levels")
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _strings(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item, depth + 1)


def _map_strings(value: object, change: Callable[[str], str]) -> Any:
    """A copy of ``value`` with ``change`` applied to every string inside it (keys stay; depth checked by _strings)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, Mapping):
        return {key: _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(item, change) for item in value]
    return value
