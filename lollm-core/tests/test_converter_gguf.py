"""lollm.testing.converter's own pieces, against references that are not ours (no converter run here).

The families' tests run llama.cpp's converter itself (lollm-qwen, lollm-gemma, the Llama example:
test_converter_gguf_*.py). Here: the Q8_0 round trip that their q8_0 reference rests on equals
gguf-py's own Q8_0 quantize and dequantize; the Llama Q/K un-permutation inverts llama.cpp's
permutation; the errors name what is wrong or missing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lollm.testing import converter
from lollm.testing.converter import ConverterError, _unpermute, agreement, q8_0_round_trip


def test_q8_0_round_trip_is_gguf_py_s():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.3
    weight[3, :32] = 0  # an all-zero block: scale 0, codes 0
    weight[5, 7] = 2.5  # one large value sets its block's scale
    packed = quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    expected = torch.from_numpy(dequantize(packed, GGMLQuantizationType.Q8_0).copy())
    assert torch.equal(q8_0_round_trip(weight), expected)
    assert not torch.equal(q8_0_round_trip(weight), weight)  # it does round


def test_unpermute_inverts_llama_cpp_s_permutation():
    heads, head_dim, hidden = 4, 8, 16
    weight = torch.arange(heads * head_dim * hidden, dtype=torch.float32).reshape(heads * head_dim, hidden)
    # llama.cpp's LlamaModel.permute: inside each head, rows (2, D/2) stored as (D/2, 2)
    permuted = weight.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(weight.shape)
    assert not torch.equal(permuted, weight)
    assert torch.equal(_unpermute(permuted, heads), weight)


def test_agreement_figures():
    ref = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 1.0]])
    ours = torch.tensor([[0.0, 1.0, 2.0], [0.0, 3.0, 1.0]])
    result = agreement(ours, ref)
    assert (result.positions, result.argmax_agree, result.max_abs_diff) == (2, 1, 3.0)
    assert result.min_cosine == pytest.approx(float(np.dot([3, 0, 1], [0, 3, 1]) / 10))
    with pytest.raises(ConverterError, match="shapes differ"):
        agreement(ours[:1], ref)


def test_errors_name_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("LOLLM_LLAMA_CPP_SRC", str(tmp_path))
    with pytest.raises(ConverterError, match="LOLLM_LLAMA_CPP_SRC=.*no vendor/llama.cpp/convert_hf_to_gguf.py"):
        converter.converter_source()
    with pytest.raises(ConverterError, match="outtype 'q4_k'"):
        converter.convert(tmp_path, tmp_path / "x.gguf", "q4_k")
    with pytest.raises(ConverterError, match="quantize kind 'Q2_K'"):
        converter.quantize(tmp_path / "x.gguf", tmp_path / "y.gguf", "Q2_K")


def test_quantize_without_llama_cpp_names_both_missing(tmp_path, monkeypatch):
    def missing():
        raise ConverterError("llama-cpp-python is not importable (ImportError: test)")

    monkeypatch.setattr(converter, "_llama_cpp", missing)
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConverterError, match="cannot quantize to Q6_K: llama-cpp-python is not importable.*no llama-quantize"):
        converter.quantize(tmp_path / "x.gguf", tmp_path / "y.gguf", "Q6_K")
