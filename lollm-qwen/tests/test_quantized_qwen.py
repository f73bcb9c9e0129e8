"""Quantized execution for qwen2/qwen3: quantize-at-load on tiny checkpoints, the real Qwen2.5 GGUF kept packed
(accuracy against our float32 path, memory), and the benchmark / parity paths that go with it."""

from __future__ import annotations

import shutil

import pytest
import torch

from _qwen_tiny import family, tiny_checkpoint  # noqa: F401  (fixtures)
from test_gguf_qwen import tiny_gguf  # noqa: F401  (fixture)
from lollm.load.options import LoadOptions
from lollm.errors import LollmError


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_at_load(tiny_checkpoint, family, mode):
    from lollm.testing.quantized import check_quantize_at_load

    folder = tiny_checkpoint(family, hidden_size=128, intermediate_size=256)  # int4 tiles need rows in 16s
    assert check_quantize_at_load(folder, mode) > 0


def test_bench_without_transformers_prints_our_figures(tiny_checkpoint, monkeypatch):
    import importlib.util

    from lollm.proof.bench import NO_REFERENCE, run_bench

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real_find_spec(name, *a))
    result = run_bench(str(tiny_checkpoint("qwen2")), ids=list(range(3, 11)), new_tokens=2, rounds=2, threads=1)
    assert [e.name for e in result.engines] == ["lollm"] and result.note == NO_REFERENCE
    assert len(result.engines[0].decode_tok_s) == 2 and result.engines[0].median("decode_tok_s") > 0


def test_bench_alternates_rounds_and_reports_per_round_ratios(tiny_checkpoint):
    from lollm.proof.bench import run_bench

    result = run_bench(str(tiny_checkpoint("qwen2")), ids=list(range(3, 11)), new_tokens=2, rounds=3, threads=1)
    assert [e.name for e in result.engines] == ["lollm", "transformers"]
    for key in ("prefill_tok_s", "decode_tok_s"):
        ratios = result.ratios("lollm", "transformers", key)
        assert len(ratios) == 3 and result.ratio("lollm", "transformers", key) == sorted(ratios)[1]


def test_parity_and_bench_refuse_weights_transformers_would_not_read(tiny_checkpoint, tmp_path):
    from lollm.proof.bench import run_bench
    from lollm.proof.parity import run_parity

    folder = tmp_path / "renamed"
    shutil.copytree(tiny_checkpoint("qwen2"), folder)
    (folder / "model.safetensors").rename(folder / "weights.safetensors")  # lollm reads it; transformers would not
    for run in (lambda: run_parity(str(folder), ids=[3, 4, 5]), lambda: run_bench(str(folder), ids=[3, 4, 5], new_tokens=1)):
        with pytest.raises(LollmError, match="weights.safetensors.*transformers reads only model.safetensors"):
            run()


@pytest.mark.real
def test_real_gguf_quantized_agrees_with_float32():
    """The real Qwen2.5-Coder GGUF kept packed, against our float32 path on 256 tokens of text:
    top-1 agreement >= 95% (the benchmark measures 98% over 678 tokens), perplexity within 2%,
    and the model holds at most 1.3x the file's bytes (at most the file's size where lollm's native kernel
    keeps every matrix in the file's own bits: Q5_0, Q4_K, Q6_K, and Q8_0 with its float16 block scales)."""
    import gc
    import os

    from lollm import native
    from lollm.load.pipeline import open_model
    from lollm.testing.quantized import EVAL_TEXT, compare, decode_logits_of, logits_of
    from lollm.cli.real_models import fetch_gguf

    path = str(fetch_gguf("qwen2.5-coder-0.5b-instruct"))
    floats = open_model(path, LoadOptions(device="cpu", weights="float"))
    ids = floats.tokenizer.encode(EVAL_TEXT)[:256]
    reference = logits_of(floats.model, ids)
    del floats
    gc.collect()
    packed = open_model(path, LoadOptions(device="cpu", weights="auto"))  # GGUF: packed (the CLI's default)
    summary = packed.model.weights_summary
    agreement = compare(reference, logits_of(packed.model, ids), ids)
    print(summary.line(), f"top-1 {agreement.top1_rate:.3f}, perplexity ratio {agreement.perplexity_ratio:.4f}")
    stepped = compare(reference[:128], decode_logits_of(packed.model, ids[:128]), ids[:128])  # the decode route
    print(f"one position at a time (128): top-1 {stepped.top1_rate:.3f}, perplexity ratio {stepped.perplexity_ratio:.4f}")
    assert stepped.top1_rate >= 0.95 and abs(stepped.perplexity_ratio - 1) <= 0.02
    assert summary.model_bytes <= 1.3 * os.path.getsize(path)
    if native.block_q5_op() is None:  # torch's kernels: Q4_K as int4 groups, Q6_K and Q8_0 requantized per channel
        assert summary.counts[("Q4_K", "int4 groups of 32")] == 12 and summary.counts[("Q8_0", "int8 groups of 32")] == 1
    else:  # every matrix in the file's own bits: the model is no larger than the file
        panels = "blocks (the file's bits, panels of 16 channels)"
        q5 = "Q5_0 blocks (5-bit codes)" if native.tile_min_rows() else f"Q5_0 {panels}"  # Q5Linear where the AMX tiles run
        assert summary.counts[("Q5_0", q5)] == 132
        assert summary.counts[("Q4_K", f"Q4_K {panels}")] == 12 and summary.counts[("Q6_K", f"Q6_K {panels}")] == 12
        assert summary.counts[("Q8_0", f"Q8_0 {panels}")] == 13  # the head (untied here) and every attn_v
        assert summary.model_bytes <= os.path.getsize(path)  # 486 MB for the 491 MB file (the same with Q5_0 in panels: 5.5 bits a weight either way)
    head = packed.model.lm_head  # the file's float16 d: a Q8_0Linear's d, or an Int8Linear's group scales
    assert (head.d if native.block_q5_op() is not None else head.scale).dtype == torch.float16
    assert agreement.top1_rate >= 0.95
    assert abs(agreement.perplexity_ratio - 1) <= 0.02
    assert isinstance(packed.model.model.embed_tokens(torch.tensor([[1, 2]])), torch.Tensor)


def test_parity_with_quantized_weights_uses_the_looser_gate(tiny_checkpoint):
    from lollm.proof.parity import QUANTIZED_MIN_COSINE, QUANTIZED_MIN_TOP1, run_parity

    folder = tiny_checkpoint("qwen2", hidden_size=128, intermediate_size=256)
    report = run_parity(str(folder), ids=list(range(3, 40)), options=LoadOptions(quantize="int8"))
    assert report.weights == "int8"
    assert report.min_top1_required == QUANTIZED_MIN_TOP1 and report.min_cosine_required == QUANTIZED_MIN_COSINE
    assert report.to_json()["weights"] == "int8"
    float_report = run_parity(str(folder), ids=list(range(3, 40)))
    assert float_report.weights == "float" and float_report.min_top1_required == 1.0 and float_report.passed


@pytest.mark.parametrize(("family", "tied"), [("qwen2", True), ("qwen3", False)])
def test_tiny_gguf_runs_packed_and_passes_the_quantized_gate(tiny_gguf, family, tied):
    """A tiny GGUF (F32/F16/Q8_0 tensors) loads packed where its types allow, and its logits pass the
    quantized parity gate against transformers' float32 reading of the same file."""
    from lollm.proof.parity import run_parity
    from lollm.load.pipeline import open_model
    from lollm import native
    from lollm.load.quantized import Int8Embedding, Int8Linear, Q8_0Linear, Q8_0PanelEmbedding

    path = str(tiny_gguf(family, tied))
    model = open_model(path, LoadOptions(device="cpu", weights="quantized")).model
    summary = model.weights_summary
    q8_0 = Q8_0Linear if native.block_int8_op() is not None else Int8Linear  # the panels where the native kernel is built
    assert type(model.model.layers[0].mlp.up_proj) is q8_0  # Q8_0 ffn_up
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # F16 attn_q stays float
    if tied:  # the Q8_0 embedding and the head share one int8 matrix: panels, or groups of 32 where AMX tiles run
        lookup = Int8Embedding if q8_0 is Int8Linear or native.tile_min_rows() else Q8_0PanelEmbedding
        assert type(model.model.embed_tokens) is lookup and model.model.embed_tokens.codes is model.lm_head.codes
    assert summary.counts[("F16", "float32")] > 0 and summary.packed > 0
    report = run_parity(path, options=LoadOptions(weights="quantized"))
    assert report.weights == "gguf" and report.passed, report.to_json()
