"""Q4_0, Q5_0, Q4_K, Q6_K and Q8_0 multiplied from the file's bits (block_kquants.cpp, lollm.load.packed_kquants).

Three promises, each checked on every build of the kernel this CPU runs (the native one, and the
test builds for AVX2 and plain C++, lollm.native.build_variant):

* the panel layout loses nothing: a layer's weights are the file's dequantized weights, bit for bit;
* a row's output is a function of that row alone: ``torch.equal`` to the same row inside calls of
  2 to 300 rows, and the same bits on every route (one canonical float32 order everywhere);
* the result is x rounded to int8 per block of 32 times the exact weights, within float32 sums.

Where no C++ compiler is installed these tests skip, saying so (LOLLM_REQUIRE_NATIVE=1 fails instead).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lollm import native
from lollm.gguf.quants import GGML_TYPES_BY_NAME, dequantize
from lollm.load.packed_kquants import PANEL_LAYERS, Q4_0Linear, Q4_KLinear, Q5_0Linear, Q6_KLinear, Q8_0Linear
from lollm.load.packed_linear import Int4Linear, Int8Linear
from lollm.load.packed_embedding import Int8Embedding, Q8_0PanelEmbedding
from lollm.load.quantized import Q5Linear, WeightsSummary, describe, linear_from_gguf, shared_embedding

TYPES = tuple(PANEL_LAYERS)
#: The float16 fields of each type's block (byte offsets): made small and finite in random blocks.
F16_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}
#: The row counts a lone row is compared inside (the issue's list): tiles of 4 rows, odd tails, many rows.
BATCHES = (2, 7, 8, 19, 20, 64, 255, 300)
QWEN = Path.home() / ".cache/lollm/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct.gguf"


def kernel() -> None:
    if native.block_int8_op() is None:
        if os.environ.get("LOLLM_REQUIRE_NATIVE") == "1":
            pytest.fail(native.status())
        pytest.skip(native.status())


def builds():
    """(name, ops namespace) for every build of the kernel this CPU runs."""
    kernel()
    yield "native", torch.ops.lollm_native
    if platform.machine() in ("x86_64", "AMD64"):  # the other builds are x86 instruction sets
        for variant in native.VARIANTS:
            yield variant, native.build_variant(variant)


def random_matrix(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A GGUF matrix's bytes ``(n, bytes a row)``: random blocks (every code and 6-bit scale occurs)
    whose float16 scales are small, finite and of either sign."""
    rng = np.random.default_rng(seed + sum(map(ord, type_name)))
    t = GGML_TYPES_BY_NAME[type_name]
    blocks = rng.integers(0, 256, size=(n * k // t.block_size, t.type_size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        scales = rng.uniform(0.0005, 0.004, size=(len(blocks), 1)) * rng.choice([-1, 1], size=(len(blocks), 1))
        blocks[:, at : at + 2] = scales.astype("<f2").view(np.uint8)
    return blocks.reshape(n, -1)


def layer_of(type_name: str, n: int, k: int, seed: int = 0):
    raw = random_matrix(type_name, n, k, seed)
    return PANEL_LAYERS[type_name].from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, k)), raw


def call(ops, layer, x: torch.Tensor) -> torch.Tensor:
    """The layer's operator from build ``ops`` (the layer's forward calls the native build's)."""
    parts = [getattr(layer, name) for name, _, _ in layer.PARTS]
    return getattr(ops, layer.OP)(x, *parts, layer.out_features)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it, in float64: rounded to int8 per block of 32 (scale max|x| / 127),
    in the kernel's own float32 steps (q = round(x * (127 / max|x|)), ties to even)."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0.0)
    return (torch.round(blocks * inverse).double() * (amax / 127).double()).view(m, k)


# -- the layout -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("n", [48, 37, 5])  # whole panels, a part-filled last panel, one part-filled panel
def test_the_panels_hold_the_file_bit_for_bit(type_name, n):
    kernel()
    k = 512
    layer, raw = layer_of(type_name, n, k)
    reference = torch.from_numpy(dequantize(raw.reshape(-1), type_name)).view(n, k)
    assert torch.equal(layer.dequantize(), reference)
    bits = sum(getattr(layer, name).numel() * getattr(layer, name).element_size() * 8 for name, _, _ in layer.PARTS)
    panels = -(-n // 16)
    assert bits / (16 * panels * k) == {"Q4_0": 4.5, "Q5_0": 5.5, "Q4_K": 4.625, "Q6_K": 6.5625, "Q8_0": 8.5}[type_name]  # about the file's size


# -- batch invariance and the routes --------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_alone_is_the_same_bits_in_any_batch_on_every_route(type_name):
    layer, _ = layer_of(type_name, 40, 512)
    g = torch.Generator().manual_seed(1)
    for name, ops in builds():
        for rows in BATCHES:
            x = torch.randn(rows, 512, generator=g) * torch.rand(rows, 1, generator=g) * 4
            picked = sorted({0, rows // 2, rows - 1})  # the first, a middle and the last row
            alone = torch.cat([call(ops, layer, x[i : i + 1]) for i in picked])
            together = call(ops, layer, x)[picked]
            assert torch.equal(alone, together), (name, rows)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q4_K"])
def test_the_threads_that_share_a_call_change_no_bit(type_name):
    """A call's rows are quantized, and its panels multiplied, over torch's threads in chunks that
    follow the thread count (rows: at least 32768 values a chunk); each row's output is the same bits
    on 1, 2 or 3 threads, at row counts that give several chunks."""
    kernel()
    layer, _ = layer_of(type_name, 40, 512)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = layer(x)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(layer(x), alone), threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("type_name", TYPES)
def test_every_route_gives_the_same_bits(type_name):
    layer, _ = layer_of(type_name, 37, 768, seed=2)
    x = torch.randn(23, 768, generator=torch.Generator().manual_seed(3))
    outputs = {name: call(ops, layer, x) for name, ops in builds()}
    first = outputs.pop("native")
    assert torch.equal(layer(x), first)
    for name, y in outputs.items():
        assert torch.equal(y, first), name


@pytest.mark.parametrize("type_name", TYPES)
def test_it_computes_int8_activations_times_the_exact_weights(type_name):
    """Against float64: x rounded as the kernel rounds it, times the dequantized weights. What is left is
    float32 rounding in step 3: at most one rounding of 2**-24 per block (two for Q4_K) and one for
    each xd * ws, relative to the sum of |products|."""
    layer, _ = layer_of(type_name, 37, 768, seed=4)
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(5))
    xq = q8_activations(x)
    w = layer.dequantize().double()
    reference, size = xq @ w.T, xq.abs() @ w.abs().T
    for name, ops in builds():
        assert ((call(ops, layer, x).double() - reference).abs() <= (2 * 768 // 32 + 2) * 2.0**-24 * size + 1e-30).all(), name


def test_q5_0_panels_give_the_bits_of_q5linear_on_every_route():
    """Q5_0Linear (panels, no sums across lanes) and Q5Linear (channel by channel, the layer the AMX tiles
    take) hold the same file and compute the same canonical order: the same bits, at 1 row and at many."""
    n, k = 37, 768
    raw = random_matrix("Q5_0", n, k, seed=7)
    panels = Q5_0Linear.from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, k))
    channels = Q5Linear.from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, k))
    assert torch.equal(panels.dequantize(), torch.from_numpy(dequantize(raw.reshape(-1), "Q5_0")).view(n, k))
    g = torch.Generator().manual_seed(8)
    for name, ops in builds():
        for rows in (1, 16, 70):
            x = torch.randn(rows, k, generator=g)
            want = getattr(ops, "block_q5_linear")(x, channels.nibbles, channels.high, channels.scale)
            assert torch.equal(call(ops, panels, x), want), (name, rows)


def test_q8_0_extreme_codes_are_exact_on_every_route():
    """Q8_0's codes -128 and 127 against x at +-127: the AVX-512 route reads q + 128 (up to 255, then takes
    128 * sum(xq) off), the AVX2 route |q| * (x with q's sign) so that no int16 pair saturates. Each block's
    sum must be exact: against float64 (every product and sum here is an integer times a power of two)."""
    kernel()
    n, k = 16, 64
    block = np.zeros((n, k // 32, 34), dtype=np.uint8)
    block[..., 0:2] = np.array([1.0], dtype="<f2").view(np.uint8)
    codes = np.where(np.arange(32) % 3 == 0, -128, 127).astype(np.int8)
    block[..., 2:34] = np.roll(codes, 1)[None, None, :].repeat(n, 0).repeat(k // 32, 1).view(np.uint8)
    block[1::2, :, 2:34] = np.full(32, -128, np.int8).view(np.uint8)  # odd channels: every code -128
    raw = block.reshape(n, -1)
    layer = Q8_0Linear.from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, k))
    x = torch.tensor([[127.0, -127.0] * (k // 2), [-127.0] * k, [127.0] * k])  # xq = +-127, xd = 1
    reference = x.double() @ layer.dequantize().double().T
    for name, ops in builds():
        assert torch.equal(call(ops, layer, x).double(), reference), name


#: Where each type keeps its codes' bits in a block (byte ranges): set to all ones, every code is the
#: largest the format has (Q4_0 and Q4_K 15, Q5_0 31, Q6_K 63).
CODE_BYTES = {"Q4_0": ((2, 18),), "Q5_0": ((2, 22),), "Q4_K": ((16, 144),), "Q6_K": ((0, 192),)}


@pytest.mark.parametrize("type_name", sorted(CODE_BYTES))
def test_the_largest_codes_against_x_at_127_stay_exact_on_every_route(type_name):
    """Every code at the format's largest value against xq = +127 (and -127): the AVX2 route adds
    vpmaddubsw's int16 pairs before widening them (four pairs of 4- and 5-bit codes, at most
    8 * 31 * 127 = 31496; two of Q6_K's 6-bit ones, 4 * 63 * 127 = 32004), so a pair sum that
    overflowed int16 would show here. Against float64: x at +-1 is exactly xq = +-127, xd = 1 / 127."""
    kernel()
    n, k = 16, 256
    raw = random_matrix(type_name, n, k, seed=11)
    t = GGML_TYPES_BY_NAME[type_name]
    blocks = raw.reshape(-1, t.type_size)
    for lo, hi in CODE_BYTES[type_name]:
        blocks[:, lo:hi] = 0xFF
    layer = PANEL_LAYERS[type_name].from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, k))
    x = torch.tensor([[1.0] * k, [-1.0] * k])
    xq = q8_activations(x)
    w = layer.dequantize().double()
    reference, size = xq @ w.T, xq.abs() @ w.abs().T
    for name, ops in builds():
        assert ((call(ops, layer, x).double() - reference).abs() <= (2 * k // 32 + 2) * 2.0**-24 * size).all(), name


def test_the_largest_block_sums_stay_exact():
    """Q6_K's worst block: every code 0 (q - 32 = -32), sub-scales -128, x at +127 everywhere:
    isum = 2 * (-128) * 16 * (-32) * 127 = 16,646,144, just under 2^24, exact in float32."""
    kernel()
    n, k = 16, 256
    block = np.zeros(210, dtype=np.uint8)
    block[192:208] = np.uint8(128)  # int8 -128
    block[208:210] = np.array([1.0], dtype="<f2").view(np.uint8)
    raw = np.tile(block, (n, 1))
    layer = Q6_KLinear.from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, k))
    x = torch.ones(1, k)  # each block: xq = 127, xd = 1 / 127
    expected = float(torch.tensor(k // 32 * 16646144 * (1 / 127), dtype=torch.float64))
    for name, ops in builds():
        assert torch.allclose(call(ops, layer, x).double(), torch.full((1, n), expected, dtype=torch.float64), rtol=1e-6), name


@pytest.mark.parametrize("type_name", TYPES)
def test_a_non_finite_input_makes_its_row_nan_and_leaves_the_others(type_name):
    layer, _ = layer_of(type_name, 20, 256)
    x = torch.randn(3, 256)
    x[1, 40] = float("inf")
    for name, ops in builds():
        y = call(ops, layer, x)
        assert y[1].isnan().all() and y[[0, 2]].isfinite().all(), name


def test_bad_inputs_are_refused_naming_the_operator_and_the_tensor():
    layer, _ = layer_of("Q4_K", 20, 256)
    parts = [getattr(layer, name) for name, _, _ in layer.PARTS]
    op = torch.ops.lollm_native.block_q4_k_linear
    with pytest.raises(RuntimeError, match="block_q4_k_linear: x must be a contiguous float32"):
        op(torch.randn(2, 256, dtype=torch.float64), *parts, 20)
    with pytest.raises(RuntimeError, match="block_q4_k_linear: x has 224 columns, not a positive multiple of 256"):
        op(torch.randn(2, 224), *parts, 20)
    with pytest.raises(RuntimeError, match=r"block_q4_k_linear: dmin must be contiguous Half \(2, 1, 16\)"):
        op(torch.randn(2, 256), *parts[:4], parts[4].float(), 20)
    with pytest.raises(RuntimeError, match="block_q4_k_linear: 40 output channels do not fill 2 panels"):
        op(torch.randn(2, 256), *parts, 40)
    q6, _ = layer_of("Q6_K", 20, 256)
    nibbles, high, sc, d = (getattr(q6, name) for name, _, _ in q6.PARTS)
    with pytest.raises(RuntimeError, match=r"block_q6_k_linear: nibbles must be contiguous Byte \(2, 8, 256\)"):
        torch.ops.lollm_native.block_q6_k_linear(torch.randn(1, 256), nibbles[:, :, :128].contiguous(), high, sc, d, 20)
    with pytest.raises(RuntimeError, match=r"block_q6_k_linear: sc must be contiguous Char \(2, 16, 16\)"):
        torch.ops.lollm_native.block_q6_k_linear(torch.randn(1, 256), nibbles, high, sc.view(torch.uint8), d, 20)
    q5, _ = layer_of("Q5_0", 20, 64)
    with pytest.raises(RuntimeError, match=r"block_q5_0_linear: fifth must be contiguous Byte \(2, 2, 64\)"):
        torch.ops.lollm_native.block_q5_0_linear(torch.randn(1, 64), q5.nibbles, q5.fifth[:, :, :32].contiguous(), q5.d, 20)
    q8, _ = layer_of("Q8_0", 20, 64)
    with pytest.raises(RuntimeError, match=r"block_q8_0_linear: codes must be contiguous Char \(2, 2, 512\)"):
        torch.ops.lollm_native.block_q8_0_linear(torch.randn(1, 64), q8.codes.view(torch.uint8), q8.d, 20)
    with pytest.raises(RuntimeError, match="block_q8_0_linear: 33 output channels do not fill 2 panels"):
        torch.ops.lollm_native.block_q8_0_linear(torch.randn(1, 64), q8.codes, q8.d, 33)


# -- the real file and the loader --------------------------------------------------------------------------------


@pytest.mark.skipif(not QWEN.exists(), reason=f"the real Qwen2.5-Coder-0.5B GGUF is not at {QWEN}")
@pytest.mark.parametrize("tensor", ["blk.2.ffn_down.weight", "blk.0.ffn_down.weight"])  # Q4_K, Q6_K
def test_the_real_qwen_ffn_down_runs_from_its_bits(tensor):
    """A real matrix loads into its panel layer, holds the file's weights exactly, and gives the float
    path's outputs within what rounding x to int8 can move them (half a step of each block's scale)."""
    from lollm.gguf.reader import GGUFTensorSource

    kernel()
    source = GGUFTensorSource(QWEN)
    stored, shape = source.dtype(tensor), tuple(source.shape(tensor))
    layer = linear_from_gguf(lambda a, b: source.read_raw(tensor, a, b), stored, shape, None)
    assert type(layer) is PANEL_LAYERS[stored]
    w = source.read(tensor).float()  # the float path's weights
    assert torch.equal(layer.dequantize(), w)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(6))
    y = layer(x)
    step = x.abs().view(5, -1, 32).amax(-1).repeat_interleave(32, dim=1) / 127 / 2  # |x - xq| at most
    assert ((y.double() - (x.double() @ w.double().T)).abs() <= step.double() @ w.double().abs().T * 1.001 + 1e-4).all()
    for rows in (2, 20, 64):  # invariance on the real weights too
        batch = torch.cat([x[:1], torch.randn(rows - 1, shape[1])])
        assert torch.equal(layer(batch)[:1], y[:1])


def test_the_loader_routes_q4_0_q5_0_q4_k_q6_k_q8_0_to_the_panels_and_a_tied_q8_0_head_too(monkeypatch):
    kernel()
    made = {t: linear_from_gguf(random_matrix(t, 32, 256).reshape(-1), t, (32, 256), None) for t in TYPES + ("Q8_0",)}
    assert type(made["Q4_0"]) is Q4_0Linear and type(made["Q4_K"]) is Q4_KLinear and type(made["Q6_K"]) is Q6_KLinear
    assert describe(made["Q4_K"]) == "Q4_K blocks (the file's bits, panels of 16 channels)"
    summary = WeightsSummary(requested="gguf")
    summary.add("Q4_K", describe(made["Q4_K"]))
    assert "Q4_K→Q4_K blocks (the file's bits, panels of 16 channels) ×1" in summary.line() and native.status() in summary.line()
    assert type(made["Q8_0"]) is Q8_0Linear
    untied = linear_from_gguf(random_matrix("Q8_0", 32, 256).reshape(-1), "Q8_0", (32, 256), None, grouped=True)
    assert type(untied) is Q8_0Linear  # an output head of its own: the panels
    monkeypatch.setattr(native, "tile_min_rows", lambda: 0)  # no AMX tiles: a tied Q8_0 head in panels too
    q8 = linear_from_gguf(random_matrix("Q8_0", 32, 256).reshape(-1), "Q8_0", (32, 256), None, grouped=True, tied=True)
    assert type(q8) is Q8_0Linear and type(shared_embedding(q8, 32, torch.float32)) is Q8_0PanelEmbedding
    monkeypatch.setattr(native, "tile_min_rows", lambda: 8)  # tiles: the int8 groups of 32 they multiply
    q8 = linear_from_gguf(random_matrix("Q8_0", 32, 256).reshape(-1), "Q8_0", (32, 256), None, grouped=True, tied=True)
    assert isinstance(q8, Int8Linear) and q8.group_size == 32 and q8.scale.dtype == torch.float16  # shared codes, the file's d
    assert type(shared_embedding(q8, 32, torch.float32)) is Int8Embedding
    monkeypatch.undo()
    bias = nn.Parameter(torch.randn(32), requires_grad=False)
    q4 = linear_from_gguf(random_matrix("Q4_0", 32, 256).reshape(-1), "Q4_0", (32, 256), bias, grouped=True)
    assert type(q4) is Q4_0Linear and torch.equal(q4(torch.zeros(1, 256))[0], bias)  # a 4-bit head; the bias added
    head = linear_from_gguf(random_matrix("Q6_K", 32, 256).reshape(-1), "Q6_K", (32, 256), None, grouped=True)
    assert isinstance(head, Int8Linear) and head.group_size == 32  # a head's int8 codes can be shared with its embedding
    assert type(made["Q5_0"]) is (Q5Linear if native.tile_min_rows() else Q5_0Linear)
    monkeypatch.setattr(native, "tile_min_rows", lambda: 0)  # no AMX tiles: Q5_0 in panels
    assert type(linear_from_gguf(random_matrix("Q5_0", 32, 256).reshape(-1), "Q5_0", (32, 256), None)) is Q5_0Linear
    monkeypatch.setattr(native, "tile_min_rows", lambda: 8)  # tiles from 8 rows: the layer they multiply
    assert type(linear_from_gguf(random_matrix("Q5_0", 32, 256).reshape(-1), "Q5_0", (32, 256), None)) is Q5Linear
    head = linear_from_gguf(random_matrix("Q5_0", 32, 256).reshape(-1), "Q5_0", (32, 256), None, grouped=True)
    assert isinstance(head, Int8Linear) and head.group_size == 32  # a Q5_0 head: exact codes in groups of 32
    monkeypatch.setattr(native, "_state", {"ops": None, "why": "off (test)"})  # no native kernel: today's layers
    assert isinstance(linear_from_gguf(random_matrix("Q4_K", 32, 256).reshape(-1), "Q4_K", (32, 256), None), Int4Linear)
    per_channel = linear_from_gguf(random_matrix("Q6_K", 32, 256).reshape(-1), "Q6_K", (32, 256), None)
    assert isinstance(per_channel, Int8Linear) and per_channel.codes.shape[0] == 1
    q8_off = linear_from_gguf(random_matrix("Q8_0", 32, 256).reshape(-1), "Q8_0", (32, 256), None)
    assert isinstance(q8_off, Int8Linear) and q8_off.codes.shape[0] == 1


@pytest.mark.parametrize("n", [32, 45])  # 45: the last panel padded with zero channels
def test_a_q8_0_panel_embedding_gives_the_files_rows_and_shares_the_heads_codes(n):
    """A tied Q8_0 head in panels and its embedding: one copy of the codes; each looked-up row is
    the file's dequantized row bit for bit (lollm.gguf.quants), in any order and any shape of ids."""
    raw = random_matrix("Q8_0", n, 256)
    head = Q8_0Linear.from_blocks(lambda a, b: raw[a:b].reshape(-1), (n, 256), None)
    embedding = shared_embedding(head, n, torch.float32)
    assert embedding.codes is head.codes and embedding.d is head.d
    rows = torch.from_numpy(dequantize(raw.reshape(-1), "Q8_0")).view(n, 256)
    ids = torch.tensor([[0, n - 1, 15, 16], [17, 3, n - 1, 0]])
    assert torch.equal(embedding(ids), rows[ids])
    assert embedding(ids).shape == (2, 4, 256) and embedding.embedding_dim == 256 and embedding.num_embeddings == n
    assert shared_embedding(head, n, torch.bfloat16)(ids).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="Q4_0Linear"):
        shared_embedding(linear_from_gguf(random_matrix("Q4_0", 32, 256).reshape(-1), "Q4_0", (32, 256), None), 32, torch.float32)
