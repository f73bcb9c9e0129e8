"""Batch invariance of the native kernel, bit for bit: a row's output is a function of that row and
the weights alone, on every route, whatever rows share the call.

Every route (the native build: AMX tiles where the CPU lends them, else AVX-512 VNNI or what this
CPU has; and on x86 the test builds: AVX-512 VNNI without tiles, AVX2, portable C++) computes each
block's exact int32 sum and then the same float32 operations in the same order, the canonical order
of docs/native-kernel.md, section 1:

    acc = 0;  for each block b in order:  acc = fmaf(float(isum_b), xd_b * ws_b, acc)

So every comparison here is ``torch.equal``, never a tolerance: one row alone against the same row
inside calls of 2 to 300 random rows (the AMX tiles take 8 rows and more, the VNNI loops turn the
weights from 2 rows, a chunk holds 64 rows: these counts cross each boundary), every route against
every other, and the layers (``Int8Linear``, ``Q5Linear``) at every row count on every route. The
tolerance lives in one place: the check that the canonical order computes the right product, against
float64 (:func:`test_every_route_computes_the_product_within_float32_rounding`).
"""

from __future__ import annotations

import os
import platform

import pytest
import torch

from lollm import native
from lollm.errors import LollmError
from lollm.load.quantized import Int8Linear, Q5Linear

from test_native import q5_layer, q8_activations, random_layer, run_python, tie_slack

#: Row counts a lone row is placed among: below and across the tiles' 8, the chunk's 64, and 255 / 300.
COUNTS = (2, 7, 8, 19, 20, 64, 255, 300)


def routes():
    """(name, ops) for every route buildable here: the route in force, then the x86 test builds."""
    built = native.ops()
    if built is None:
        if os.environ.get("LOLLM_REQUIRE_NATIVE") == "1":
            pytest.fail(native.status())
        pytest.skip(native.status())
    yield "native", built
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    for variant in native.VARIANTS:
        yield variant, native.build_variant(variant)


def layouts(gen: torch.Generator):
    """name -> (operator name, weights, K): int8 per channel (an even and an odd number of blocks),
    int8 in groups of 32 with float32 and float16 scales (the head), and Q5_0 in its own bits."""
    per_channel = random_layer(1, 300, 1024, gen)
    odd = random_layer(1, 70, 288, gen)  # 9 blocks: a lone last block
    groups32 = random_layer(8, 257, 32, gen)  # N odd: a last task of one channel
    q5, _, _ = q5_layer(96, 512, gen)
    return {
        "int8 per channel": ("block_int8_linear", per_channel, 1024),
        "int8 per channel, 9 blocks": ("block_int8_linear", odd, 288),
        "int8 groups of 32, float32 scales": ("block_int8_linear", groups32, 256),
        "int8 groups of 32, float16 scales": ("block_int8_linear", (groups32[0], groups32[1].half()), 256),
        "Q5_0": ("block_q5_linear", (q5.nibbles, q5.high, q5.scale), 512),
    }


LAYOUTS = ("int8 per channel", "int8 per channel, 9 blocks", "int8 groups of 32, float32 scales",
           "int8 groups of 32, float16 scales", "Q5_0")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_row_alone_equals_the_same_row_in_any_batch_on_every_route(layout):
    gen = torch.Generator().manual_seed(20)
    op_name, weights, k = layouts(gen)[layout]
    row = torch.randn(1, k, generator=gen) * 2
    row[0, :32] = 0.0  # a block of zeros (scale 0) in the row followed
    for name, ops in routes():
        op = getattr(ops, op_name)
        alone = op(row, *weights)[0]
        for count in COUNTS:
            batch = torch.randn(count, k, generator=gen) * torch.rand(count, 1, generator=gen) * 10  # rows of every size
            at = int(torch.randint(0, count, (1,), generator=gen))
            batch[at] = row[0]
            assert torch.equal(op(batch, *weights)[at], alone), f"{name}, {layout}: row {at} of {count} differs from the row alone"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_route_gives_the_same_bits(layout):
    gen = torch.Generator().manual_seed(21)
    op_name, weights, k = layouts(gen)[layout]
    for rows in (1, 3, 70):  # the lone-row loop, the turned weights, two chunks (and the tiles where they run)
        x = torch.randn(rows, k, generator=gen) * 3
        outputs = {name: getattr(ops, op_name)(x, *weights) for name, ops in routes()}
        first, want = next(iter(outputs.items()))
        for name, got in outputs.items():
            assert torch.equal(got, want), f"{layout}, {rows} rows: {name} differs from {first}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_route_computes_the_product_within_float32_rounding(layout):
    """The canonical order is also the right product: against x rounded to int8 per block, times
    the weights, in float64 (the only tolerance in this file: float32 sums of 8 to 32 blocks)."""
    gen = torch.Generator().manual_seed(22)
    op_name, weights, k = layouts(gen)[layout]
    if op_name == "block_q5_linear":
        layer = Q5Linear(*weights)
        w = layer.dequantize().double()
    else:
        codes, scale = weights
        groups, n, group_size = codes.shape
        w = (codes.double() * scale.double()[..., None]).transpose(0, 1).reshape(n, groups * group_size)
    x = torch.randn(19, k, generator=gen) * 3
    x[0, :32] = 0.0
    want = q8_activations(x) @ w.T
    for name, ops in routes():
        got = getattr(ops, op_name)(x, *weights).double()
        err = (((got - want).abs() - tie_slack(x, w)).clamp(min=0).max() / want.abs().max()).item()
        assert err < 1e-5, f"{name}, {layout}: relative error {err:.2e}"


def layer_cases(gen: torch.Generator):
    """(name, layer, K): Int8Linear per channel (float32 scales), in groups of 32 (float16 scales, a
    Q8_0 head's), and Q5Linear."""
    codes, scale = random_layer(1, 96, 512, gen)
    head_codes, head_scale = random_layer(16, 130, 32, gen)
    q5, _, _ = q5_layer(64, 256, gen)
    return [("Int8Linear per channel", Int8Linear(codes, scale), 512),
            ("Int8Linear groups of 32", Int8Linear(head_codes, head_scale.half()), 512),
            ("Q5Linear", q5, 256)]


def test_layers_give_a_row_the_same_bits_at_every_row_count_on_every_route(monkeypatch):
    """forward runs the kernel at every row count (no bfloat16 path from some count on), through
    ``lollm.native.ops()``: each route forced in turn, a row alone equals the row among others."""
    gen = torch.Generator().manual_seed(23)
    cases = layer_cases(gen)
    for route, ops in list(routes()):
        monkeypatch.setattr(native, "ops", lambda ops=ops: ops)
        for name, layer, k in cases:
            assert not isinstance(layer, Int8Linear) or layer.uses_native()
            row = torch.randn(1, 1, k, generator=gen)  # (batch, tokens, K), as a model calls it
            alone = layer(row)[0, 0]
            for count in COUNTS:
                batch = torch.randn(1, count, k, generator=gen)
                at = count // 2
                batch[0, at] = row[0, 0]
                assert torch.equal(layer(batch)[0, at], alone), f"{route}: {name}, row {at} of {count}"


ISA = "from lollm import native; print(native.status())"


def test_lollm_isa_forces_a_route_names_it_and_refuses_a_bad_value():
    if native.ops() is None:
        pytest.skip(native.status())
    result = run_python(ISA, LOLLM_ISA="portable")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "native kernel: on (portable C++; LOLLM_ISA=portable)"
    if platform.machine() in ("x86_64", "AMD64"):
        result = run_python(ISA, LOLLM_ISA=" AVX2 ")
        assert result.returncode == 0 and result.stdout.strip() == "native kernel: on (AVX2; LOLLM_ISA=avx2)", result.stderr
    result = run_python(ISA, LOLLM_ISA="native")
    assert result.returncode == 0 and result.stdout.strip() == native.status()
    result = run_python(ISA, LOLLM_ISA="sse9")
    assert result.returncode != 0
    assert "LOLLM_ISA='sse9': use one of native, avx512, avx2, portable" in result.stderr


def test_a_route_this_cpu_lacks_is_refused_saying_so(monkeypatch):
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"fpu", "sse2", "avx2", "fma"})  # a CPU without AVX-512
    monkeypatch.setattr(native, "_x86", lambda: True)
    monkeypatch.setenv("LOLLM_ISA", "avx512")
    with pytest.raises(LollmError, match=r"LOLLM_ISA='avx512': this CPU \(.*\) has no AVX-512 VNNI \(missing: avx512f, "):
        native.isa_choice()
    monkeypatch.setenv("LOLLM_ISA", "avx2")
    assert native.isa_choice() == "avx2"
    monkeypatch.setattr(native, "_cpu_flags", lambda: {"fpu", "sse2"})
    with pytest.raises(LollmError, match="has no AVX2"):
        native.isa_choice()
    monkeypatch.setenv("LOLLM_ISA", "portable")
    assert native.isa_choice() == "portable"  # every CPU runs plain C++
