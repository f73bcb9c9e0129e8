"""Read a tokenizer from the files of a Hugging Face model folder.

Which files, and who wins
-------------------------
* ``tokenizer.json`` (written by the Hugging Face tokenizers library) describes
  the whole pipeline: ``normalizer``, ``pre_tokenizer``, ``model`` (vocab and
  merges), ``post_processor``, ``decoder`` and the ``added_tokens``.
* Older or slimmer folders only have GPT-2's format: ``vocab.json`` (token ->
  id) and ``merges.txt`` (one merge per line). The rest of the pipeline is then
  implied by tokenizer_config.json's ``tokenizer_class`` (GPT-2 or Qwen2).
* SentencePiece models ship ``tokenizer.model`` (read by
  :mod:`lollm.tokenizer.sentencepiece`); it is used when there is no
  tokenizer.json.
* ``tokenizer_config.json`` (written by transformers) names the special tokens
  (``bos_token``, ``eos_token``, ``pad_token``, ...), may list extra added
  tokens in ``added_tokens_decoder``, may switch on ``add_bos_token`` /
  ``add_eos_token``, and may hold the ``chat_template``.
* ``chat_template.jinja`` (written by transformers 5) holds the chat template
  and wins over the one in tokenizer_config.json; templates in
  ``additional_chat_templates/<name>.jinja`` are kept under their names.

tokenizer.json comes in two styles, told apart by its decoder: byte-level
(decoder ``ByteLevel``; GPT-2, Qwen2, Llama 3) and SentencePiece-style
(decoder ``Replace("▁", " ")`` + ``ByteFallback`` + ``Fuse``; Llama 2, Gemma).

Anything we do not implement (a model type other than BPE, an unknown
normalizer, pre-tokenizer, post-processor or decoder) raises
:class:`~lollm.errors.TokenizerError` naming the file: silently skipping a step
would produce token ids the model was not trained on. ``truncation`` and
``padding`` in tokenizer.json are batch settings with no effect on the ids of
one text and are ignored.
"""

from __future__ import annotations

import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lollm.errors import TokenizerError
from lollm.files import read_file
from lollm.tokenizer import sentencepiece
from lollm.tokenizer.added_tokens import AddedToken, AddedVocabulary
from lollm.tokenizer.bpe import BPE
from lollm.tokenizer.chat import ChatTemplate
from lollm.tokenizer.decoders import ByteLevelDecoder, Decoder, SentencePieceDecoder, build_decoder
from lollm.tokenizer.fields import file_present, max_bytes_for, optional_field, read_json_object, read_text, require_field
from lollm.tokenizer.normalize import Normalizer, build_normalizer
from lollm.tokenizer.pretokenize import (
    QWEN2_PATTERN,
    ByteLevel,
    PreTokenizer,
    RegexSplit,
    build_pre_tokenizer,
)
from lollm.tokenizer.tokenizer import Tokenizer

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
VOCAB_JSON = "vocab.json"
MERGES_TXT = "merges.txt"
TOKENIZER_MODEL = "tokenizer.model"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"

#: The special-token names transformers knows; their text is given to chat templates.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass
class _Pipeline:
    """The parts of a tokenizer read from tokenizer.json, tokenizer.model or vocab.json + merges.txt."""

    model: BPE | sentencepiece.SentencePieceBPE
    pre_tokenizer: PreTokenizer
    #: the file(s) read, for error messages
    source: str
    normalizer: Normalizer | None = None
    added_tokens: list[AddedToken] = field(default_factory=list)
    #: (prefix ids, suffix ids) of the post-processor; None = the file has no post-processor.
    post_processor: tuple[list[int], list[int]] | None = None
    decoder: Decoder = field(default_factory=ByteLevelDecoder)


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """Build the :class:`Tokenizer` of a model folder (see the module docstring for the files read)."""
    folder = Path(folder)
    if not folder.is_dir():
        hint = "; a GGUF file's tokenizer comes from load_gguf_tokenizer(path)" if folder.suffix == ".gguf" else ""
        raise TokenizerError(f"tokenizer folder {folder} does not exist or is not a folder{hint}")

    config_path = folder / TOKENIZER_CONFIG_JSON
    config = read_json_object(config_path) if file_present(config_path) else {}

    tokenizer_json = folder / TOKENIZER_JSON
    vocab_json, merges_txt = folder / VOCAB_JSON, folder / MERGES_TXT
    if file_present(tokenizer_json):
        pipeline = _read_tokenizer_json(tokenizer_json)
        class_defaults: dict[str, str] = {}
    elif file_present(folder / TOKENIZER_MODEL):
        pipeline, class_defaults = _read_sentencepiece_model(folder / TOKENIZER_MODEL, config, config_path)
    elif file_present(vocab_json) and file_present(merges_txt):
        pipeline, class_defaults = _read_vocab_and_merges(vocab_json, merges_txt, config, config_path)
    elif file_present(vocab_json) or file_present(merges_txt):
        missing = MERGES_TXT if file_present(vocab_json) else VOCAB_JSON
        raise TokenizerError(f"{folder} has no {TOKENIZER_JSON}, and its GPT-2 style tokenizer lacks {missing}")
    else:
        raise TokenizerError(
            f"no tokenizer files in {folder}: expected {TOKENIZER_JSON}, {TOKENIZER_MODEL}, "
            f"or {VOCAB_JSON} + {MERGES_TXT}"
        )

    special_tokens = _named_special_tokens(config, config_path, class_defaults)
    added_tokens = _collect_added_tokens(pipeline, config, config_path, special_tokens)
    prefix_ids, suffix_ids = _post_processor_ids(pipeline, config, config_path, special_tokens, added_tokens)
    return Tokenizer(
        model=pipeline.model,
        pre_tokenizer=pipeline.pre_tokenizer,
        added_vocabulary=AddedVocabulary(added_tokens),
        normalizer=pipeline.normalizer,
        prefix_ids=prefix_ids,
        suffix_ids=suffix_ids,
        special_tokens=special_tokens,
        chat_templates=_read_chat_templates(folder, config, config_path),
        decoder=pipeline.decoder,
    )


# ------------------------------------------------------------ tokenizer.json


def _read_tokenizer_json(path: Path) -> _Pipeline:
    data = read_json_object(path)
    where = str(path)
    model_spec = require_field(data, "model", dict, where)
    model = _build_bpe(model_spec, where)
    normalizer = build_normalizer(data.get("normalizer"), where)
    pre_tokenizer = build_pre_tokenizer(data.get("pre_tokenizer"), where)
    decoder = build_decoder(data.get("decoder"), where)
    # The decoder tells the style; the rest of the pipeline must agree with it.
    if isinstance(decoder, ByteLevelDecoder):
        if model.byte_fallback:
            raise TokenizerError(
                f"{where}: BPE byte_fallback in a byte-level tokenizer (ByteLevel decoder) is not implemented by "
                "lollm: byte fallback belongs to SentencePiece-style tokenizers"
            )
        if not pre_tokenizer.uses_byte_level():
            raise TokenizerError(
                f"{where}: the decoder is ByteLevel, but the pre_tokenizer has no ByteLevel step to match it"
            )
    elif pre_tokenizer.uses_byte_level():
        raise TokenizerError(
            f"{where}: the pre_tokenizer has a ByteLevel step, but the decoder is SentencePiece-style"
        )
    entries = optional_field(data, "added_tokens", list, where, [])
    added = [_added_token(entry, f"{where} added_tokens[{i}]") for i, entry in enumerate(entries)]
    post = _parse_post_processor(data.get("post_processor"), where) if data.get("post_processor") is not None else None
    return _Pipeline(
        model=model, pre_tokenizer=pre_tokenizer, source=where, normalizer=normalizer, added_tokens=added,
        post_processor=post, decoder=decoder,
    )


def _build_bpe(spec: dict, where: str) -> BPE:
    kind = spec.get("type")
    if kind is None:
        raise TokenizerError(f"{where}: 'model' has no 'type'")
    if kind != "BPE":
        raise TokenizerError(f"{where}: model type {kind!r} is not implemented by lollm (only BPE)")
    if spec.get("dropout") not in (None, 0, 0.0):
        raise TokenizerError(f"{where}: BPE dropout {spec['dropout']!r} is a training-time option lollm does not implement")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if spec.get(key):
            raise TokenizerError(f"{where}: BPE {key} {spec[key]!r} is not implemented by lollm")
    vocab = _check_vocab(require_field(spec, "vocab", dict, f"{where} model"), f"{where} model.vocab")
    raw_merges = require_field(spec, "merges", list, f"{where} model")
    merges = []
    for i, merge in enumerate(raw_merges):
        # Two spellings exist: ["Ġ", "t"] (tokenizers >= 0.20) and "Ġ t" (older files).
        if isinstance(merge, str):
            parts = merge.split(" ")
        elif isinstance(merge, list):
            parts = merge
        else:
            parts = []
        if len(parts) != 2 or not all(isinstance(p, str) for p in parts):
            raise TokenizerError(f"{where}: model.merges[{i}] is not a pair of tokens: {merge!r}")
        merges.append((parts[0], parts[1]))
    return BPE(
        vocab,
        merges,
        unk_token=optional_field(spec, "unk_token", str, f"{where} model"),
        fuse_unk=optional_field(spec, "fuse_unk", bool, f"{where} model", False),
        byte_fallback=optional_field(spec, "byte_fallback", bool, f"{where} model", False),
        ignore_merges=optional_field(spec, "ignore_merges", bool, f"{where} model", False),
        source=where,
    )


def _check_vocab(vocab: dict, where: str) -> dict[str, int]:
    for token, token_id in vocab.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise TokenizerError(f"{where}: token {token!r} has id {token_id!r}, not a non-negative integer")
    return vocab


def _added_token(entry: Any, where: str) -> AddedToken:
    if not isinstance(entry, dict):
        raise TokenizerError(f"{where}: must be an object, got {entry!r}")
    content = require_field(entry, "content", str, where)
    if not content:
        raise TokenizerError(f"{where}: 'content' is empty; an added token needs some text")
    special = optional_field(entry, "special", bool, where, False)
    return AddedToken(
        id=require_field(entry, "id", int, where),
        content=content,
        special=special,
        lstrip=optional_field(entry, "lstrip", bool, where, False),
        rstrip=optional_field(entry, "rstrip", bool, where, False),
        single_word=optional_field(entry, "single_word", bool, where, False),
        # tokenizers' default: special tokens are matched on the raw text.
        normalized=optional_field(entry, "normalized", bool, where, not special),
    )


def _parse_post_processor(spec: Any, where: str) -> tuple[list[int], list[int]]:
    """The ids a post-processor puts before and after the text of a single sequence."""
    if not isinstance(spec, dict):
        raise TokenizerError(f"{where}: 'post_processor' must be an object, got {spec!r}")
    kind = spec.get("type")
    if kind == "ByteLevel":
        return [], []  # it only adjusts character offsets, never ids
    if kind == "Sequence":
        prefix: list[int] = []
        suffix: list[int] = []
        for sub in optional_field(spec, "processors", list, f"{where} post_processor", []):
            sub_prefix, sub_suffix = _parse_post_processor(sub, where)
            # each processor wraps the result of the previous one
            prefix, suffix = sub_prefix + prefix, suffix + sub_suffix
        return prefix, suffix
    if kind == "TemplateProcessing":
        return _template_ids(spec, where)
    raise TokenizerError(f"{where}: post_processor type {kind!r} is not implemented by lollm")


def _template_ids(spec: dict, where: str) -> tuple[list[int], list[int]]:
    """The ids a ``TemplateProcessing`` post-processor's ``single`` template puts around ``$A``."""
    single = require_field(spec, "single", list, f"{where} post_processor")
    special = optional_field(spec, "special_tokens", dict, f"{where} post_processor", {})
    prefix, suffix = [], []
    seen_sequence = False
    for item in single:
        piece = item.get("Sequence", item.get("SpecialToken")) if isinstance(item, dict) and len(item) == 1 else None
        if not isinstance(piece, dict):
            raise TokenizerError(f"{where}: post_processor template item {item!r} is not understood")
        if "Sequence" in item:
            if piece.get("id") != "A" or seen_sequence:
                raise TokenizerError(f"{where}: post_processor 'single' template must contain $A once: {single!r}")
            seen_sequence = True
            continue
        name = piece.get("id")
        token = special.get(name) if isinstance(name, str) else None
        ids = token.get("ids") if isinstance(token, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise TokenizerError(f"{where}: post_processor uses special token {name!r} without its ids (a list of token ids)")
        (suffix if seen_sequence else prefix).extend(ids)
    if not seen_sequence:
        raise TokenizerError(f"{where}: post_processor 'single' template has no $A: {single!r}")
    return prefix, suffix


# ------------------------------------------------------ vocab.json + merges.txt


def _gpt2_pipeline(add_prefix_space: bool) -> tuple[Normalizer | None, PreTokenizer]:
    return None, PreTokenizer([ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)])


def _qwen2_pipeline(add_prefix_space: bool) -> tuple[Normalizer | None, PreTokenizer]:
    steps = [RegexSplit(QWEN2_PATTERN), ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)]
    return (lambda text: unicodedata.normalize("NFC", text)), PreTokenizer(steps)


#: tokenizer_class -> (pipeline builder, the special tokens transformers' class
#: uses when tokenizer_config.json does not name them). The vocab.json +
#: merges.txt format stores no pipeline, so it must come from this table.
_GPT2_STYLE_CLASSES = {
    "GPT2Tokenizer": (_gpt2_pipeline, {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}),
    "Qwen2Tokenizer": (_qwen2_pipeline, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}),
}


def _read_vocab_and_merges(
    vocab_path: Path, merges_path: Path, config: dict, config_path: Path
) -> tuple[_Pipeline, dict[str, str]]:
    # GPT-2's own folder has no tokenizer_class at all: the format *is* GPT-2's.
    class_name = optional_field(config, "tokenizer_class", str, str(config_path)) or "GPT2Tokenizer"
    class_name = class_name.removesuffix("Fast")
    if class_name not in _GPT2_STYLE_CLASSES:
        raise TokenizerError(
            f"{config_path}: tokenizer_class {class_name!r} with {VOCAB_JSON} + {MERGES_TXT} is not implemented "
            f"by lollm (known: {', '.join(sorted(_GPT2_STYLE_CLASSES))})"
        )
    build, defaults = _GPT2_STYLE_CLASSES[class_name]
    normalizer, pre_tokenizer = build(optional_field(config, "add_prefix_space", bool, str(config_path), False))

    vocab_data = read_json_object(vocab_path)
    vocab = _check_vocab(vocab_data, str(vocab_path))
    merges = []
    for line_no, line in enumerate(read_text(merges_path).split("\n"), start=1):
        line = line.rstrip("\r")
        if not line or (line_no == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"{merges_path} line {line_no}: expected two tokens separated by one space, got {line!r}")
        merges.append((parts[0], parts[1]))
    model = BPE(vocab, merges, source=f"{vocab_path} + {merges_path}")
    return _Pipeline(model=model, pre_tokenizer=pre_tokenizer, source=model.source, normalizer=normalizer), defaults


# ------------------------------------------------------------ tokenizer.model

#: tokenizer_class values whose transformers class puts bos in front of every
#: text unless tokenizer_config.json says ``"add_bos_token": false``.
_BOS_BY_DEFAULT_CLASSES = ("LlamaTokenizer", "GemmaTokenizer", "CodeLlamaTokenizer")


def _read_sentencepiece_model(path: Path, config: dict, config_path: Path) -> tuple[_Pipeline, dict[str, str]]:
    """A SentencePiece ``tokenizer.model`` (BPE type) as a pipeline.

    Compared with SentencePiece itself, one thing is added, as transformers and
    llama.cpp do: control pieces (``<s>``, ``</s>``, ``<start_of_turn>``)
    written in the text are matched as single tokens (SentencePiece would spell
    them out character by character). User-defined pieces are matched in the
    normalized text, exactly as SentencePiece does.
    """
    where = str(path)
    sp = sentencepiece.parse_model_proto(read_file(path, max_bytes=max_bytes_for(path), error=TokenizerError), where)
    if sp.model_type != sentencepiece.BPE_MODEL:
        name = sentencepiece.MODEL_TYPE_NAMES.get(sp.model_type, str(sp.model_type))
        raise TokenizerError(f"{where}: SentencePiece model type {name} is not implemented by lollm (only BPE)")
    if sp.treat_whitespace_as_suffix:
        raise TokenizerError(f"{where}: SentencePiece treat_whitespace_as_suffix is not implemented by lollm")
    if sp.denormalizer is not None and sp.denormalizer.precompiled_charsmap:
        raise TokenizerError(f"{where}: a SentencePiece denormalizer rule is not implemented by lollm")
    normalizer = sentencepiece.build_normalizer(sp.normalizer, where)
    kinds = [kind for _, _, kind in sp.pieces]
    unknown = [i for i, kind in enumerate(kinds) if kind == sentencepiece.UNKNOWN]
    if len(unknown) != 1:
        raise TokenizerError(f"{where}: a SentencePiece model needs exactly one UNKNOWN piece, found {len(unknown)}")
    if not sp.byte_fallback and sentencepiece.BYTE in kinds:
        raise TokenizerError(f"{where}: the model has byte pieces although byte_fallback is false")
    model = sentencepiece.SentencePieceBPE(
        sp.pieces, byte_fallback=sp.byte_fallback, unk_id=unknown[0], resegment_unused=True, source=where
    )
    added = [
        AddedToken(
            id=i,
            content=text,
            special=kind != sentencepiece.USER_DEFINED,
            normalized=kind == sentencepiece.USER_DEFINED,
        )
        for i, (text, _, kind) in enumerate(sp.pieces)
        if kind in (sentencepiece.CONTROL, sentencepiece.UNKNOWN, sentencepiece.USER_DEFINED)
    ]
    # The trainer spec names unk/bos/eos/pad by id; tokenizer_config.json may override them.
    defaults = {}
    for name, token_id in (("unk_token", sp.unk_id), ("bos_token", sp.bos_id), ("eos_token", sp.eos_id),
                           ("pad_token", sp.pad_id)):
        if 0 <= token_id < len(sp.pieces):
            defaults[name] = sp.pieces[token_id][0]
    post_processor = None
    class_name = (optional_field(config, "tokenizer_class", str, str(config_path)) or "").removesuffix("Fast")
    if class_name in _BOS_BY_DEFAULT_CLASSES:
        bos = _token_content(config.get("bos_token"), f"{config_path} 'bos_token'") or defaults.get("bos_token")
        if bos is None or bos not in model.vocab:
            raise TokenizerError(f"{config_path}: {class_name} adds a bos token, but the model has none")
        post_processor = ([model.vocab[bos]], [])
    decoder = SentencePieceDecoder(
        byte_fallback=sp.byte_fallback, strip_leading_spaces=1 if sp.normalizer.add_dummy_prefix else 0
    )
    pipeline = _Pipeline(
        model=model, pre_tokenizer=PreTokenizer([]), source=where, normalizer=normalizer, added_tokens=added,
        post_processor=post_processor, decoder=decoder,
    )
    return pipeline, defaults


# --------------------------------------------------------- tokenizer_config.json


def _token_content(value: Any, where: str) -> str | None:
    """A special token in tokenizer_config.json is a string, an AddedToken object, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: expected a token string or {{'content': ...}}, got {value!r}")


def _named_special_tokens(config: dict, config_path: Path, class_defaults: dict[str, str]) -> dict[str, str]:
    """name -> text of the named special tokens (only those that are set)."""
    named = {}
    for name in SPECIAL_TOKEN_NAMES:
        if name in config:
            content = _token_content(config[name], f"{config_path} {name!r}")
        else:
            content = class_defaults.get(name)
        if content is not None:
            named[name] = content
    return named


def _collect_added_tokens(
    pipeline: _Pipeline, config: dict, config_path: Path, special_tokens: dict[str, str]
) -> list[AddedToken]:
    """tokenizer.json's added tokens + tokenizer_config.json's added_tokens_decoder + named special tokens."""
    by_id: dict[int, AddedToken] = {}
    by_content: dict[str, AddedToken] = {}
    vocab = pipeline.model.vocab

    def add(token: AddedToken, where: str) -> None:
        same_id, same_content = by_id.get(token.id), by_content.get(token.content)
        if same_content is None:
            _check_added_token_id(token, vocab, by_id, where)
        if same_id is not None and same_id.content != token.content:
            raise TokenizerError(
                f"{where}: id {token.id} is {token.content!r}, but it is already the added token {same_id.content!r}"
            )
        if same_content is not None and same_content.id != token.id:
            raise TokenizerError(
                f"{where}: {token.content!r} has id {token.id}, but it is already an added token with id {same_content.id}"
            )
        if same_id is None:
            by_id[token.id] = by_content[token.content] = token

    for i, token in enumerate(pipeline.added_tokens):
        add(token, f"{pipeline.source} added_tokens[{i}]")

    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise TokenizerError(f"{config_path}: 'added_tokens_decoder' must be an object of id -> token")
    entries = []
    for key, entry in decoder.items():
        where = f"{config_path} added_tokens_decoder[{key!r}]"
        try:
            entries.append((int(key), entry, where))
        except ValueError:
            raise TokenizerError(f"{where}: the key must be a token id") from None
    for token_id, entry, where in sorted(entries, key=lambda item: item[0]):
        if not isinstance(entry, dict):
            raise TokenizerError(f"{where}: must be an object, got {entry!r}")
        add(_added_token({**entry, "id": token_id}, where), where)

    # Special tokens named in the config (bos_token, additional_special_tokens, ...)
    # are matched in the text like added tokens, as transformers does.
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    if isinstance(extra, dict):
        extra = list(extra.values())
    if not isinstance(extra, list):
        raise TokenizerError(f"{config_path}: 'additional_special_tokens' must be a list")
    contents = list(special_tokens.items()) + [
        (f"additional_special_tokens[{i}]", _token_content(value, f"{config_path} additional_special_tokens[{i}]"))
        for i, value in enumerate(extra)
    ]
    for name, content in contents:
        if content is None or content in by_content:
            continue
        token_id = pipeline.model.vocab.get(content)
        if token_id is None:
            raise TokenizerError(
                f"{config_path}: {name} {content!r} is neither in the vocabulary nor an added token"
            )
        add(AddedToken(id=token_id, content=content, special=True, normalized=False), f"{config_path} {name}")
    return list(by_id.values())


def _check_added_token_id(token: AddedToken, vocab: dict[str, int], added_ids: dict[int, AddedToken], where: str) -> None:
    """An added token's id must be the one Hugging Face would give it, or the file is inconsistent.

    A token already in the vocabulary keeps its vocabulary id; a new one gets
    the next id after the vocabulary and the added tokens so far. The Hugging
    Face libraries silently renumber a token whose stored id disagrees; we
    refuse the file instead of guessing which of the two ids the model uses.
    """
    if token.content in vocab:
        expected = vocab[token.content]
    else:
        highest = max(added_ids, default=None)
        expected = len(vocab) if highest is None or highest < len(vocab) else highest + 1
    if token.id != expected:
        raise TokenizerError(
            f"{where}: added token {token.content!r} has id {token.id}, but its id must be {expected} "
            f"({'its id in the vocabulary' if token.content in vocab else 'the next id after the vocabulary and the added tokens before it'})"
        )


def _post_processor_ids(
    pipeline: _Pipeline,
    config: dict,
    config_path: Path,
    special_tokens: dict[str, str],
    added_tokens: list[AddedToken],
) -> tuple[list[int], list[int]]:
    """Which ids ``encode(..., add_special_tokens=True)`` puts around the text.

    Like transformers 5: an explicit ``add_bos_token`` / ``add_eos_token`` in
    tokenizer_config.json (or a tokenizer without a post-processor) means
    "[bos] text [eos]" with each part switched on by its flag (default off);
    otherwise tokenizer.json's post-processor decides.
    """
    explicit = "add_bos_token" in config or "add_eos_token" in config
    if pipeline.post_processor is not None and not explicit:
        return pipeline.post_processor
    ids = {t.content: t.id for t in added_tokens}
    prefix, suffix = [], []
    for flag, name, target in (("add_bos_token", "bos_token", prefix), ("add_eos_token", "eos_token", suffix)):
        if optional_field(config, flag, bool, str(config_path), False):
            content = special_tokens.get(name)
            if content is None:
                raise TokenizerError(f"{config_path}: {flag} is true but no {name} is named")
            target.append(ids[content])
    return prefix, suffix


def _read_chat_templates(folder: Path, config: dict, config_path: Path) -> dict[str, ChatTemplate]:
    templates: dict[str, ChatTemplate] = {}
    value = config.get("chat_template")
    if isinstance(value, str):
        templates["default"] = ChatTemplate(value, f"{config_path} 'chat_template'")
    elif isinstance(value, list):
        # Several named templates: [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        for i, entry in enumerate(value):
            where = f"{config_path} chat_template[{i}]"
            if not isinstance(entry, dict):
                raise TokenizerError(f"{where}: must be an object with 'name' and 'template'")
            name = require_field(entry, "name", str, where)
            templates[name] = ChatTemplate(require_field(entry, "template", str, where), f"{where} ({name!r})")
    elif value is not None:
        raise TokenizerError(f"{config_path}: 'chat_template' must be a string or a list, got {type(value).__name__}")

    jinja_path = folder / CHAT_TEMPLATE_JINJA
    if file_present(jinja_path):
        templates["default"] = ChatTemplate(read_text(jinja_path), str(jinja_path))
    extra_dir = folder / ADDITIONAL_CHAT_TEMPLATES_DIR
    if (extra_dir.exists() or extra_dir.is_symlink()) and not extra_dir.is_dir():
        raise TokenizerError(f"{extra_dir} is not a folder; it should hold one <name>.jinja chat template per file")
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = ChatTemplate(read_text(path), str(path))
    return templates
