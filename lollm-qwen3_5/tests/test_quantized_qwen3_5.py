"""Quantized execution for qwen3_5 / qwen3_5_moe (no GGUF path): quantize-at-load on tiny checkpoints."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_at_load(tiny_checkpoint, family, mode):
    from lollm.testing.quantized import check_quantize_at_load

    assert check_quantize_at_load(tiny_checkpoint(family, "text"), mode, group_size=32) > 0
