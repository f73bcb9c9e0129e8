"""The pieces of the kit's converter check (lollm.testing.converter_checks, section 12), each against
something that is not the piece itself: the shipped corpus is the held-in one, a relabelled GGUF read back
by lollm's reader, the tokenizer trained to exactly the vocabulary, the respelled config.json read by
transformers. The families' kit classes run the whole check (llama.cpp's converter on each family).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lollm.testing import converter_checks as cc

REPO = Path(__file__).resolve().parents[2]


def test_the_shipped_corpus_is_the_held_in_one():
    """One file: the tests' held-in corpus is a link to the copy the kit ships (no second copy to drift)."""
    held_in = REPO / "lollm-core" / "tests" / "data" / "hard_strings.json"
    assert held_in.resolve() == cc.CORPUS_PATH.resolve() and len(json.loads(cc.CORPUS_PATH.read_text(encoding="utf-8"))) > 300


def test_the_kit_tokenizer_has_exactly_the_vocabulary_and_encodes_every_text(tmp_path):
    import sentencepiece as spm

    for style, vocab in (("llama", 512), ("gemma", cc.MIN_VOCAB)):
        folder = cc.write_kit_tokenizer(tmp_path / style, vocab, style)
        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        assert sp.get_piece_size() == vocab
        for text in cc.corpus():  # characters left out of training come back through the byte pieces
            assert sp.decode(sp.encode(text)) == text
    with pytest.raises(pytest.fail.Exception, match="vocabulary .* is too small"):
        cc.write_kit_tokenizer(tmp_path / "small", cc.MIN_VOCAB - 1, "llama")


def test_respell_gives_transformers_the_reference_type_and_class():
    raw = {"model_type": "mine", "architectures": ["MineForCausalLM"], "text_config": {"model_type": "mine_text"},
           "hidden_size": 64}
    out = cc.respell(raw, {"mine": "qwen2", "mine_text": "gemma3_text"})
    assert out == {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                   "text_config": {"model_type": "gemma3_text"}, "hidden_size": 64}
    assert raw["model_type"] == "mine"  # a copy


def test_what_no_gguf_carries_is_set_as_llama_cpp_derives_it():
    text = {"head_dim": 16, "query_pre_attn_scalar": 32, "sliding_window_pattern": 2,
            "layer_types": ["sliding_attention", "full_attention"] * 4}
    cc._carried_by_gguf(text, "gemma3_text")
    assert text["query_pre_attn_scalar"] == 16 and text["sliding_window_pattern"] == 6
    assert [i for i, t in enumerate(text["layer_types"]) if t == "full_attention"] == [5]
    qwen = {"head_dim": 16, "layer_types": ["full_attention"] * 2}
    cc._carried_by_gguf(qwen, "qwen2")
    assert qwen == {"head_dim": 16, "layer_types": ["full_attention"] * 2}


def test_relabel_renames_the_architecture_and_its_keys_only(tmp_path):
    import gguf

    from lollm.gguf import GGUFFile, GGUFTensorSource

    src = tmp_path / "qwen2.gguf"
    writer = gguf.GGUFWriter(str(src), arch="qwen2")
    writer.add_block_count(2)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 0.1)
    writer.add_token_list(["a", "b", "qwen2."])
    writer.add_array("qwen2.attention.sliding_window_pattern", [True, False])
    weight = np.arange(64, dtype=np.float32).reshape(2, 32)
    writer.add_tensor("blk.0.attn_q.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = cc.relabel_gguf(src, tmp_path / "mine.gguf", "mine")
    with GGUFFile(src) as before, GGUFFile(out) as after:
        renamed = {k.replace("qwen2.", "mine.", 1) if k.startswith("qwen2.") else k: v
                   for k, v in before.metadata.items() if k != "general.architecture"}
        assert after.metadata["general.architecture"] == "mine"
        got = {k: v for k, v in after.metadata.items() if k != "general.architecture"}
        assert json.dumps(got, default=list, sort_keys=True) == json.dumps(renamed, default=list, sort_keys=True)
        assert list(after.metadata["tokenizer.ggml.tokens"]) == ["a", "b", "qwen2."]  # values untouched
        assert np.array_equal(GGUFTensorSource(after).read("blk.0.attn_q.weight").numpy(), weight)
