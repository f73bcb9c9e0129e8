"""Quantized execution for gemma2/3/4: quantize-at-load on tiny checkpoints, and the real Gemma 3 270M GGUF kept
packed (accuracy against our float32 path, memory)."""

from __future__ import annotations

import pytest
from lollm.load.options import LoadOptions


@pytest.mark.parametrize("name", ["gemma2", "gemma3-270m", "gemma4-e2b-text"])
def test_quantize_at_load(tiny, name):
    from lollm.testing.quantized import check_quantize_at_load

    assert check_quantize_at_load(tiny(name), "int8") > 0


@pytest.mark.real
def test_real_gguf_quantized_agrees_with_float32():
    """The real Gemma 3 270M GGUF kept packed, against our float32 path on 256 tokens of text: top-1
    agreement >= 95% (the benchmark measures 97.4% over 685 tokens, where plain bfloat16 gives 97.1%),
    perplexity within 2%, the tied Q8_0 embedding and head one int8 matrix with the file's float16 block
    scales (float32 ones took 10.5 MB more): Q8_0 panels, or int8 groups of 32 where AMX tiles run; and
    the model no larger than the file."""
    import gc
    import os

    import torch
    from lollm.load.pipeline import open_model
    from lollm import native
    from lollm.load.quantized import Int8Embedding, Q8_0PanelEmbedding
    from lollm.testing.quantized import EVAL_TEXT, compare, logits_of
    from lollm.cli.real_models import fetch_gguf

    path = str(fetch_gguf("gemma-3-270m"))
    floats = open_model(path, LoadOptions(device="cpu", weights="float"))
    ids = floats.tokenizer.encode(EVAL_TEXT)[:256]
    reference = logits_of(floats.model, ids)
    del floats
    gc.collect()
    packed = open_model(path, LoadOptions(device="cpu", weights="auto"))
    model, summary = packed.model, packed.model.weights_summary
    agreement = compare(reference, logits_of(model, ids), ids)
    print(summary.line(), f"top-1 {agreement.top1_rate:.3f}, perplexity ratio {agreement.perplexity_ratio:.4f}")
    embedding, head = model.model.embed_tokens, model.lm_head
    if native.tile_min_rows():  # AMX tiles: int8 groups of 32, the layout they multiply
        assert isinstance(embedding, Int8Embedding) and embedding.codes is head.codes and embedding.scale is head.scale
        assert head.scale.dtype == torch.float16
    else:  # Q8_0 panels, the file's codes and float16 d
        assert isinstance(embedding, Q8_0PanelEmbedding) and embedding.codes is head.codes and embedding.d is head.d
        assert head.d.dtype == torch.float16
    assert summary.model_bytes <= os.path.getsize(path)  # 250 MB for the 253 MB file (261 with float32 head scales)
    assert agreement.top1_rate >= 0.95
    assert abs(agreement.perplexity_ratio - 1) <= 0.02
