"""Quantized execution (lollm.load.quantized): packed weights unpack to our dequantizer's values, and the packed
linear layers equal a float matmul with those weights within the bounds stated here.

Tiny matrices of every GGUF type are made with gguf-py's own quantizer (``gguf.quants.quantize``) from random
float weights; our dequantizer of those bytes is the reference (it is itself bit-exact against gguf-py, see
test_gguf_quants.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lollm.errors import LollmError, WeightsError
from lollm.gguf.quants import GGML_TYPES_BY_NAME, SUPPORTED_TYPES, affine4, dequantize
from lollm.load.options import LoadOptions
from lollm.load.pipeline import pick_quantization
from lollm.load.packed_embedding import BlockEmbedding, Int8Embedding
from lollm.load.packed_linear import Int4Linear, Int8Linear, _pack_int4, exact_scale
from lollm.load.quantized import (
    INT4_TYPES,
    INT8_TYPES,
    Quantization,
    linear_from_float,
    linear_from_gguf,
    quantize_int4_groups,
    quantize_int8_rows,
)
from lollm.load.weights import load_weights
from lollm import native
@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    """These tests are about torch's packed kernels and their bounds: lollm's native kernel, whose
    own tests are tests/test_native.py, is off here (the load builds Int4Linear, Int8Linear calls torch)."""
    monkeypatch.setattr(native, "_state", {"ops": None, "why": "off (tests of torch's kernels)"})

from conftest_gguf import F16_FIELDS

N, K = 64, 512  # rows a multiple of 16 (int4 tiles), columns a multiple of 256 (K-quant super-blocks)
OTHER_TYPES = [t for t in SUPPORTED_TYPES if t not in INT4_TYPES + INT8_TYPES + ("F32", "F16", "BF16")]
BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: a rounding is off by at most 2**-9 of the value


def gguf_matrix(type_name: str, n: int = N, k: int = K, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF matrix: (raw bytes, our dequantization as (n, k) float32).

    Made by gguf-py's own quantizer from random weights with a few outliers per row,
    where gguf-py has one; else (K-quants, IQ4) random blocks with small finite
    float16 scales, as test_gguf_quants.py does.
    """
    import gguf

    rng = np.random.default_rng(seed + sum(map(ord, type_name)))
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, ::97] *= 8
    try:
        raw = np.asarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])).reshape(-1).view(np.uint8)
    except NotImplementedError:
        t = GGML_TYPES_BY_NAME[type_name]
        blocks = rng.integers(0, 256, size=(n * k // t.block_size, t.type_size), dtype=np.uint8)
        for off in F16_FIELDS[type_name]:
            scales = rng.uniform(0.0005, 0.004, size=(len(blocks), 1)) * rng.choice([-1, 1], size=(len(blocks), 1))
            blocks[:, off : off + 2] = scales.astype("<f2").view(np.uint8)
        raw = blocks.reshape(-1)
    return raw, dequantize(raw, type_name).reshape(n, k)


def kernel_weights(layer: nn.Module) -> torch.Tensor:
    """The weights a packed layer multiplies by, read back through its own kernel: layer(I) = W^T (bias-free layer)."""
    eye = torch.eye(layer.in_features)
    return layer(eye).T.float()


# -- exact parts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_affine4_form_is_bit_equal_to_the_dequantizer(type_name):
    """codes * scale + offset, computed in float32, equals dequantize() exactly (Q4_0: -0.0 may come out as +0.0)."""
    raw, ref = gguf_matrix(type_name)
    codes, scale, offset = affine4(raw, type_name)
    assert codes.min() >= 0 and codes.max() <= 15
    rebuilt = codes.reshape(-1, 32).astype(np.float32) * scale[:, None] + offset[:, None]
    np.testing.assert_array_equal(rebuilt.reshape(N, K), ref)
    if type_name != "Q4_0":
        np.testing.assert_array_equal(rebuilt.reshape(N, K).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("type_name", INT4_TYPES)
def test_int4_layer_keeps_the_file_codes_exactly(type_name):
    """Read through the kernel with scale 1 and zero 0, the packed buffer gives back q - 8 for every weight of the file."""
    raw, _ = gguf_matrix(type_name)
    layer = linear_from_gguf(raw, type_name, (N, K), None)
    assert isinstance(layer, Int4Linear)
    layer.scale_and_zero = torch.stack([torch.ones(K // 32, N), torch.zeros(K // 32, N)], -1).to(torch.bfloat16)
    codes, _, _ = affine4(raw, type_name)
    np.testing.assert_array_equal(kernel_weights(layer).numpy(), codes.reshape(N, K).astype(np.float32) - 8)


def test_int4_packing_by_slices_of_64_rows_equals_packing_at_once():
    codes = torch.randint(0, 16, (208, 128), dtype=torch.uint8)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(_pack_int4(codes), whole)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0"])
def test_grouped_int8_keeps_q8_0_and_q5_0_exactly(type_name):
    """The output head's form: codes * scale per group of 32 equals dequantize() bit for bit, the scales
    held in float16 as the file has them."""
    raw, ref = gguf_matrix(type_name)
    layer = linear_from_gguf(raw, type_name, (N, K), None, grouped=True)
    assert isinstance(layer, Int8Linear) and layer.group_size == 32 and layer.scale.dtype == torch.float16
    rebuilt = (layer.codes.float() * layer.scale[..., None]).transpose(0, 1).reshape(N, K)
    np.testing.assert_array_equal(rebuilt.numpy().view(np.uint32), ref.view(np.uint32))
    embedding = Int8Embedding(layer.codes, layer.scale)  # the tied lookup shares these tensors
    ids = torch.tensor([[3, 0, 63, 3]])
    assert torch.equal(embedding(ids)[0], torch.from_numpy(ref)[ids[0]])


def test_int8_scales_are_float16_only_where_that_loses_nothing():
    """exact_scale, the rule of Int8Linear and Int8Embedding: float16 kept; float32 values that are all
    float16 become float16; any value float16 would change (a requantized max|w| / 127, beyond 65504,
    below 2**-24, NaN) keeps the whole tensor float32, the same tensor; no float dtype is refused."""
    half = (torch.rand(3, 70, generator=torch.Generator().manual_seed(0)) * 0.02).half()
    assert exact_scale(half) is half
    assert exact_scale(half.float()).dtype == torch.float16 and torch.equal(exact_scale(half.float()), half)
    assert exact_scale(half.double()).dtype == torch.float16
    for odd in (1e-3, 70000.0, 2.0**-26, float("nan")):  # 1e-3 is no float16; the others are out of its reach
        single = half.float()
        single[1, 7] = odd
        assert exact_scale(single) is single, odd
    requantized = quantize_int8_rows(torch.randn(40, 64, generator=torch.Generator().manual_seed(1)))[1]
    assert exact_scale(requantized) is requantized
    q6_head = linear_from_gguf(gguf_matrix("Q6_K")[0], "Q6_K", (N, K), None, grouped=True)
    assert q6_head.scale.dtype == torch.float32  # another type's head: groups of 32 requantized
    with pytest.raises(WeightsError, match="must be floating point.*torch.int8"):
        Int8Linear(torch.zeros(1, 4, 32, dtype=torch.int8), torch.ones(1, 4, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_embedding_with_float16_scales_computes_in_float32(dtype):
    """An Int8Embedding over float16 scales keeps them (tied: one tensor with the head) and gives rows
    q * s computed in float32, then in its own dtype: a product in float16 would round (127 times an
    11-bit scale needs 18 bits)."""
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(-127, 128, (2, 10, 32), dtype=torch.int8, generator=gen)
    scale = (torch.rand(2, 10, generator=gen) * 0.03 + 0.001).half()
    head = Int8Linear(codes, scale)
    embedding = Int8Embedding(head.codes, head.scale, dtype)
    assert embedding.scale is head.scale and embedding.scale.dtype == torch.float16
    ids = torch.tensor([[4, 0, 9]])
    out = embedding(ids)
    want = (codes.float() * scale.float()[..., None]).transpose(0, 1).reshape(10, 64)[ids]
    assert out.dtype == dtype and out.shape == (1, 3, 64)
    assert torch.equal(out, want.to(dtype))
    assert not torch.equal((codes.half() * scale[..., None]).float().transpose(0, 1).reshape(10, 64)[ids], want)


@pytest.mark.parametrize("type_name", [t for t in SUPPORTED_TYPES if t not in ("F32", "F16", "BF16")])
def test_block_embedding_rows_equal_the_dequantizer(type_name):
    """The embedding keeps the file's blocks and dequantizes looked-up rows: bit-equal to the float path."""
    raw, ref = gguf_matrix(type_name, n=40, k=256)
    t = GGML_TYPES_BY_NAME[type_name]
    embedding = BlockEmbedding(torch.from_numpy(raw.copy()).view(40, 256 // t.block_size * t.type_size), type_name, 256)
    ids = torch.tensor([[5, 39, 0, 5, 17]])
    out = embedding(ids)
    assert out.shape == (1, 5, 256) and out.dtype == torch.float32
    assert torch.equal(out[0], torch.from_numpy(ref)[ids[0]])
    assert embedding.weight.dtype == torch.float32 and embedding.weight.numel() == 0


# -- bounded parts ----------------------------------------------------------------------------------------------


def weight_bound(layer: nn.Module, ref: np.ndarray) -> torch.Tensor:
    """Per-weight bound on |kernel weight - dequantized weight| for a packed layer (see docs/quantized-execution.md).

    int4: scale and zero rounded to bfloat16: |q - 8| |s| + |z| times 2**-9, written 2**-8 (8|s| + |z|).
    int8: requantization, at most half a step of the row's (or group's) scale, plus the bfloat16
    rounding of that scale times the code (<= 127 s 2**-9 < s / 4).
    Both: the kernel's bfloat16 output rounds each read-back weight by 2**-9 of its size.
    """
    w = torch.from_numpy(ref).abs()
    if isinstance(layer, Int4Linear):
        sz = layer.scale_and_zero.float()  # (G, N, 2)
        s = sz[..., 0].T.repeat_interleave(layer.group_size, 1)
        z = sz[..., 1].T.repeat_interleave(layer.group_size, 1)
        return BF16_EPS * (8 * s.abs() + z.abs()) + BF16_EPS * (w + 8 * s.abs() + z.abs())
    scale = layer.scale.T.repeat_interleave(layer.group_size, 1)  # (N, K)
    return 0.75 * scale + BF16_EPS * (w + scale)


@pytest.mark.parametrize("type_name", INT4_TYPES + INT8_TYPES)
def test_packed_weights_within_the_stated_bound(type_name):
    raw, ref = gguf_matrix(type_name)
    layer = linear_from_gguf(raw, type_name, (N, K), None)
    assert isinstance(layer, Int4Linear if type_name in INT4_TYPES else Int8Linear)
    err = (kernel_weights(layer) - torch.from_numpy(ref)).abs()
    bound = weight_bound(layer, ref)
    assert (err <= bound).all(), f"{type_name}: worst excess {float((err - bound).max()):.3g}"
    assert float(err.mean()) > 0  # requantization and bfloat16 do change the weights: the bound is not vacuous


@pytest.mark.parametrize("rows", [3, 40])
@pytest.mark.parametrize("type_name", INT4_TYPES + INT8_TYPES)
def test_packed_linear_equals_float_matmul_within_bound(type_name, rows):
    """y = x W^T + b for x of 2 x rows: |y - y_ref| <= |x| · bound(W) + 2**-7 |x| · |W| (x rounded to bfloat16, output too).

    Every row count takes the same kernel (there is no many-rows path: a row's output must not depend on
    the rows beside it, docs/native-kernel.md)."""
    raw, ref = gguf_matrix(type_name)
    bias = nn.Parameter(torch.randn(N), requires_grad=False)
    layer = linear_from_gguf(raw, type_name, (N, K), bias)
    x = torch.randn(2, rows, K)
    W = torch.from_numpy(ref)
    y = layer(x)
    assert y.shape == (2, rows, N) and y.dtype == torch.float32
    y_ref = x @ W.T + bias
    bound = x.abs() @ weight_bound(layer, ref).T + 2 * BF16_EPS * (x.abs() @ W.abs().T) + BF16_EPS * y_ref.abs()
    assert ((y - y_ref).abs() <= bound).all()


@pytest.mark.parametrize("type_name", OTHER_TYPES)
def test_types_without_a_packed_form_stay_float(type_name):
    raw, _ = gguf_matrix(type_name)
    assert linear_from_gguf(raw, type_name, (N, K), None) is None


def test_int4_rows_not_a_multiple_of_16_become_int8():
    raw, ref = gguf_matrix("Q4_0", n=24, k=256)
    layer = linear_from_gguf(raw, "Q4_0", (24, 256), None)
    assert isinstance(layer, Int8Linear)
    assert ((kernel_weights(layer) - torch.from_numpy(ref)).abs() <= weight_bound(layer, ref)).all()


def test_quantize_float_rows_and_groups_error_is_half_a_step():
    w = torch.randn(48, 256) * 0.1
    q, s = quantize_int8_rows(w)
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()
    codes, scale, offset = quantize_int4_groups(w, 128)
    rebuilt = (codes.float().view(48, 2, 128) * scale[..., None] + offset[..., None]).view(48, 256)
    assert codes.max() <= 15 and ((rebuilt - w).abs() <= scale.repeat_interleave(128, 1) / 2 + 1e-6).all()
    for mode, cls in (("int8", Int8Linear), ("int4", Int4Linear)):
        layer = linear_from_float(w, Quantization(mode, 128), None)
        assert isinstance(layer, cls)
        x = torch.randn(5, 256)
        assert torch.allclose(layer(x), x @ w.T, atol=0.05 * float((x.abs() @ w.abs().T).max()))


# -- the load --------------------------------------------------------------------------------------------------


class TinyGGUFSource:
    """A TensorSource over in-memory GGUF blocks: name -> (raw bytes, type, shape)."""

    fmt = "gguf"

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return self.tensors[name][2]

    def dtype(self, name):
        return self.tensors[name][1]

    def read_raw(self, name, start_row=0, stop_row=None):
        raw, _, shape = self.tensors[name]
        rows = raw.reshape(shape[0], -1)[start_row:stop_row]
        return rows.reshape(-1)

    def read(self, name):
        raw, type_name, shape = self.tensors[name]
        return torch.from_numpy(dequantize(raw, type_name).reshape(shape))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(N, 256)
        self.proj = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)
        self.lm_head = nn.Linear(256, N, bias=False)


def tiny_tensors(embed_type: str = "Q8_0") -> dict:
    embed_raw, _ = gguf_matrix(embed_type, n=N, k=256)
    proj_raw, _ = gguf_matrix("Q4_K", n=256, k=256)
    f32 = lambda *shape: (np.random.default_rng(1).standard_normal(shape).astype(np.float32).view(np.uint8).reshape(-1), "F32", shape)
    return {  # the bias comes before its weight, as in llama.cpp's files
        "embed.weight": (embed_raw, embed_type, (N, 256)),
        "proj.bias": f32(256),
        "proj.weight": (proj_raw, "Q4_K", (256, 256)),
        "norm.weight": f32(256),
        "norm.bias": f32(256),
    }


def matrices(name: str) -> bool:
    """The tiny model's quantizable tensors: its matrices (a family's QUANTIZABLE, in small)."""
    return name in ("embed.weight", "proj.weight", "lm_head.weight")


def load_tiny(mode: str, embed_type: str = "Q8_0", quantizable=matrices):
    with torch.device("meta"):
        model = TinyLM()
    source = TinyGGUFSource(tiny_tensors(embed_type))
    return load_weights(model, source, lambda n: n, device="cpu", dtype=torch.float32,
                        tied={"lm_head.weight": "embed.weight"}, quantizable=quantizable, quantization=Quantization(mode))


def test_load_keeps_the_chosen_tensors_packed_and_ties_the_head_to_the_embedding():
    model = load_tiny("gguf")
    assert isinstance(model.proj, Int4Linear) and model.proj.bias is not None and not model.proj.bias.is_meta
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.group_size == 32  # the head keeps Q8_0's groups
    assert isinstance(model.embed, Int8Embedding) and model.embed.codes is model.lm_head.codes  # one copy for both
    assert isinstance(model.norm, nn.LayerNorm)
    summary = model.weights_summary
    assert summary.counts[("Q4_K", "int4 groups of 32")] == 1 and summary.counts[("F32", "float32")] == 3
    assert summary.packed == 3 and "Q4_K→int4 groups of 32" in summary.line()
    reference = load_tiny("float")
    ids = torch.tensor([[1, 7, 63]])
    assert torch.equal(model.embed(ids), reference.embed(ids))  # Q8_0 lookups are exact
    x = torch.randn(1, 3, 256)
    for name in ("proj", "lm_head"):  # bfloat16 activations: about 2**-8 of the output's size
        ours, ref = getattr(model, name)(x), getattr(reference, name)(x)
        assert float((ours - ref).abs().max()) <= 0.02 * float(ref.abs().max()), name


def test_a_tied_4_bit_embedding_keeps_its_blocks_beside_an_int4_head():
    model = load_tiny("gguf", embed_type="Q4_0")
    assert isinstance(model.embed, BlockEmbedding) and isinstance(model.lm_head, Int4Linear)


def test_float_mode_and_families_that_choose_nothing_load_float():
    for model in (load_tiny("float"), load_tiny("gguf", quantizable=lambda name: False)):
        assert type(model.proj) is nn.Linear and type(model.embed) is nn.Embedding
        assert model.weights_summary.packed == 0


def test_a_quantizable_name_that_is_no_linear_weight_is_an_error():
    with pytest.raises(WeightsError, match="norm.weight.*not the weight of an nn.Linear"):
        load_tiny("gguf", quantizable=lambda name: name.endswith("weight"))


def test_a_packed_tensor_of_the_wrong_shape_names_it():
    with torch.device("meta"):
        model = TinyLM()
    tensors = tiny_tensors()
    raw, _ = gguf_matrix("Q4_K", n=128, k=256)
    tensors["proj.weight"] = (raw, "Q4_K", (128, 256))
    with pytest.raises(WeightsError, match=r"proj.weight.*\(128, 256\).*\(256, 256\)"):
        load_weights(model, TinyGGUFSource(tensors), lambda n: n, device="cpu", dtype=torch.float32,
                     tied={"lm_head.weight": "embed.weight"}, quantizable=matrices, quantization=Quantization("gguf"))


@pytest.mark.parametrize(
    "weights, quantize, fmt, message",
    [
        ("float", "int8", "safetensors", "give one of them"),
        ("auto", "int4", "gguf", "quantized already"),
        ("quantized", None, "safetensors", "needs --quantize"),
        ("packed", None, "gguf", "--weights 'packed'"),
        ("auto", "int3", "safetensors", "--quantize 'int3'"),
    ],
)
def test_weight_flags_are_checked(weights, quantize, fmt, message):
    with pytest.raises(LollmError, match=message):  # from LoadOptions itself, or once the format is known
        pick_quantization(LoadOptions(weights=weights, quantize=quantize), fmt, torch.device("cpu"))


def test_weight_flag_defaults():
    cpu = torch.device("cpu")
    pick = lambda fmt, **flags: pick_quantization(LoadOptions(**flags), fmt, cpu)
    assert pick("gguf", weights="auto").mode == "gguf"
    assert pick("safetensors", weights="auto").mode == "float"
    assert pick("safetensors", weights="auto", quantize="int4", group_size=128) == Quantization("int4", 128)
    assert pick("gguf", weights="float").mode == "float"
    assert pick("gguf").mode == "float"  # no flags: the reference path
    assert pick("safetensors", quantize="int8").mode == "int8"  # quantize alone means weights auto
    with pytest.raises(LollmError, match="group size 48"):
        pick("safetensors", weights="auto", quantize="int4", group_size=48)


