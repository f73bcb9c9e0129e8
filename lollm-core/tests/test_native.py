"""lollm.native: the hand-written int8 kernel against the same arithmetic done in float64 by torch.

Every compiled version of steps 2 and 3 is checked (AMX tiles and AVX-512 VNNI where the CPU has
them, AVX2, plain C++): their integer sums must be exact, so they may differ from the float64
reference only by float32 rounding (and from each other not at all: tests/test_invariance_rows.py).
Where no C++ compiler is installed the kernel tests skip, saying so; CI installs one and sets
LOLLM_REQUIRE_NATIVE=1, under which a kernel that does not build fails.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

import numpy as np

from lollm import native
from lollm.gguf.quants import dequantize
from lollm.load.quantized import Int8Linear, Q5Linear, linear_from_gguf

#: (groups, N, group_size): per channel with an even and an odd number of blocks (a lone last
#: block), several groups of 64 and of 96, and groups of 32 (the head's layout) with N odd.
SHAPES = [(1, 48, 896), (1, 33, 96), (1, 17, 160), (3, 40, 64), (2, 19, 96), (28, 101, 32), (3, 7, 32)]
#: Row counts: the lone-row loop, the turned weights' groups of 4 rows, and (where AMX runs, from 8 rows) one and two groups of 16.
ROWS = (1, 2, 3, 4, 5, 9, 16, 19)


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per block of 32 (scale max|x| / 127), back in float64: what the kernel multiplies.

    Step 1 in the kernel's own float32 arithmetic (q = round(x * (127 / max|x|)), ties to even), so
    that a value landing near half a step rounds the same way here as there."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0.0)
    xq = torch.round(blocks * inverse)
    return (xq.double() * (amax / 127).double()).view(m, k)


def tie_slack(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(M, N): what one code step of every activation within 1e-4 of a rounding tie can move each output.

    Step 1 is the same C++ in every version, but compilers may round ``x * (127 / max|x|)`` there in
    other ways (a vectorized loop, a division); at a near-tie the code then differs by one."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    v = (blocks * torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0.0)).double()
    near = ((v - v.floor() - 0.5).abs() < 1e-4).double()
    return (near * (amax / 127).double()).view(m, k) @ w.double().abs().T


def q8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: x rounded to int8 per block of 32, times w = q * s."""
    groups, n, group_size = codes.shape
    w = (codes.double() * scale.double()[..., None]).transpose(0, 1).reshape(n, groups * group_size)
    return q8_activations(x) @ w.T


def kernel():
    op = native.block_int8_op()
    if op is None:
        if os.environ.get("LOLLM_REQUIRE_NATIVE") == "1":
            pytest.fail(native.status())
        pytest.skip(native.status())
    return op


def versions():
    yield "native", kernel()
    if platform.machine() not in ("x86_64", "AMD64"):
        return  # the other versions are x86 instruction sets
    for variant in native.VARIANTS:
        yield variant, native.build_variant(variant).block_int8_linear


def random_layer(groups, n, group_size, gen):
    codes = torch.randint(-128, 128, (groups, n, group_size), dtype=torch.int8, generator=gen)  # -128 included
    codes[0, 0, :] = -128  # a whole block at the extreme (the AVX2 version's |w| must hold 128)
    scale = torch.rand(groups, n, generator=gen) * 0.02
    return codes, scale


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_every_version_computes_the_q8_product(scale_dtype):
    """Every route against the float64 reference, with float32 scales and with float16 ones (a Q8_0
    file's d, as Int8Linear keeps them for the head): the reference reads the same values."""
    gen = torch.Generator().manual_seed(0)
    names = []
    for name, op in versions():
        names.append(name)
        for groups, n, group_size in SHAPES:
            codes, scale = random_layer(groups, n, group_size, gen)
            scale = scale.to(scale_dtype)
            for rows in ROWS:
                x = torch.randn(rows, groups * group_size, generator=gen) * 3
                x[0, :32] = 0.0  # a block of zeros: scale 0, no division by it
                want = q8_reference(x, codes, scale)
                got = op(x, codes, scale).double()
                w = (codes.double() * scale.double()[..., None]).transpose(0, 1).reshape(n, -1)
                err = (((got - want).abs() - tie_slack(x, w)).clamp(min=0).max() / want.abs().max()).item()
                assert err < 1e-5, f"{name}: codes {tuple(codes.shape)}, {rows} rows: relative error {err:.2e}"
    print("versions checked:", names)


def test_float16_scales_give_the_float32_outputs_bit_for_bit_and_other_dtypes_are_refused():
    """The kernel reads float16 scales as float32 (exactly) and then does the same arithmetic: on every
    route and row count, the same values in either dtype give the same outputs, bit for bit (so holding
    the head's scales in float16 changes no logit). A scale of any other dtype is refused, named."""
    gen = torch.Generator().manual_seed(4)
    for name, op in versions():
        for groups, n, group_size in SHAPES:
            codes, scale = random_layer(groups, n, group_size, gen)
            half = scale.half()
            for rows in ROWS:
                x = torch.randn(rows, groups * group_size, generator=gen)
                assert torch.equal(op(x, codes, half), op(x, codes, half.float())), f"{name}: {tuple(codes.shape)}, {rows} rows"
        for dtype, named in ((torch.bfloat16, "BFloat16"), (torch.float64, "Double"), (torch.int32, "Int")):
            with pytest.raises(RuntimeError, match=f"block_int8_linear: scale must be float32 or float16, not {named}"):
                op(x, codes, scale.to(dtype))


def test_instruction_sets_are_named():
    kernel()
    tiles = native.tile_min_rows()
    named = native.ops().instruction_set()
    assert named in ("AVX-512 VNNI", "AVX2", "portable C++") or named == f"AVX-512 VNNI, AMX tiles from {tiles} rows"
    assert (tiles > 0) == ("AMX" in named)
    if platform.machine() in ("x86_64", "AMD64"):
        assert native.build_variant("vnni").instruction_set() in ("AVX-512 VNNI", "AVX2", "portable C++")
        assert native.build_variant("avx2").instruction_set() == "AVX2"
        assert native.build_variant("portable").instruction_set() == "portable C++"


def test_a_non_finite_activation_makes_its_row_nan_and_no_other():
    op = kernel()
    gen = torch.Generator().manual_seed(1)
    for groups, n, group_size in [(1, 24, 96), (3, 9, 32)]:
        codes, scale = random_layer(groups, n, group_size, gen)
        for rows in (3, 17):  # the vector loops, and the tiles where they run
            x = torch.randn(rows, groups * group_size, generator=gen)
            x[1, 40] = float("nan")
            x[2, 5] = float("inf")
            y = op(x, codes, scale)
            assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all(), "a NaN or inf input must not vanish into a number"
            assert torch.isfinite(y[0]).all() and torch.isfinite(y[3:]).all()


def rows_alone(layer, x: torch.Tensor) -> torch.Tensor:
    """Each row of x computed alone (the lone-row loop, whatever route the batch took)."""
    return torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])


def test_the_threads_that_share_a_call_change_no_bit():
    """Int8Linear and Q5Linear quantize a call's rows over torch's threads, in chunks that follow the
    thread count; each row's output is the same bits on 1, 2 or 3 threads (300 rows: several chunks)."""
    kernel()
    gen = torch.Generator().manual_seed(5)
    layers = [Int8Linear(*random_layer(16, 48, 32, gen)), q5_layer(48, 512, gen)[0]]
    x = torch.randn(300, 512, generator=gen)
    before = torch.get_num_threads()
    try:
        for layer in layers:
            torch.set_num_threads(1)
            alone = layer(x)
            for threads in (2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(layer(x), alone), (type(layer).__name__, threads)
    finally:
        torch.set_num_threads(before)


def test_bad_arguments_name_the_operator():
    op = kernel()
    codes, scale = random_layer(1, 8, 64, torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="block_int8_linear: x must be"):
        op(torch.randn(2, 64, dtype=torch.float64), codes, scale)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(2, 96), codes, scale)
    with pytest.raises(RuntimeError, match="scale must be"):
        op(torch.randn(2, 64), codes, scale[:, :4])


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_int8linear_takes_the_kernel_at_every_row_count_within_the_activation_rounding(scale_dtype):
    """Int8Linear runs the kernel at every row count, a row's output does not depend on the rows beside
    it (a batch of rows equals each row alone, bit for bit), and its error against the float product of the
    dequantized weights stays within what rounding x to int8 per block allows: each x moves by at
    most half a step (max|x| / 254 in its block), so |y - x·w| <= sum_k |w_k| * step_k / 2.
    With float16 scales (a Q8_0 head's) the layer keeps them so and the kernel reads them as they are."""
    kernel()
    gen = torch.Generator().manual_seed(3)
    for groups, n, group_size in [(1, 64, 256), (1, 40, 96), (8, 64, 32)]:
        codes, scale = random_layer(groups, n, group_size, gen)
        scale = scale.to(scale_dtype)
        layer = Int8Linear(codes, scale)
        assert layer.scale.dtype == scale_dtype
        assert layer.uses_native()
        w = (codes.double() * scale.double()[..., None]).transpose(0, 1).reshape(n, -1)
        for rows in (1, 7, 8, 19, 20, 70):
            x = torch.randn(rows, groups * group_size, generator=gen)
            y = layer(x)
            assert torch.equal(y, native.ops().block_int8_linear(x, codes, scale))
            assert torch.equal(y, rows_alone(layer, x)), "a row's output changed with the rows beside it"
            half_step = (x.double().view(rows, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(rows, -1)
            bound = half_step @ w.abs().T + 1e-4
            assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


FALLBACK = """
import torch
from lollm import native
from lollm.load.quantized import Int8Linear
layer = Int8Linear(torch.randint(-127, 128, (1, 16, 64), dtype=torch.int8), torch.rand(1, 16))
y = layer(torch.randn(1, 64))
print(native.status(), layer.uses_native(), tuple(y.shape))
"""


def status_line(**env) -> str:
    result = run_python(FALLBACK, **env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_off_switch_and_a_missing_or_broken_compiler_fall_back_to_torch(tmp_path):
    assert status_line(LOLLM_NATIVE="0") == "native kernel: off (LOLLM_NATIVE=0) False (1, 16)"
    assert status_line(LOLLM_NATIVE="off") == "native kernel: off (LOLLM_NATIVE=off) False (1, 16)"
    fresh = {"LOLLM_NATIVE": "1", "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")}  # nothing built there yet
    out = status_line(CXX="/nonexistent/c++", **fresh)
    assert out.startswith("native kernel: not built: no C++ compiler ('/nonexistent/c++' not found") and out.endswith("False (1, 16)")
    out = status_line(CXX="false", **fresh)  # a "compiler" that fails every command, its --version check included
    assert out.startswith("native kernel: not built: ") and out.endswith("False (1, 16)")


def test_a_cached_build_loads_without_a_compiler_and_a_bad_switch_is_refused():
    kernel()  # built (and cached) in this process's extension folder
    assert status_line(LOLLM_NATIVE="1", CXX="/nonexistent/c++").startswith("native kernel: on (")
    result = run_python(FALLBACK, LOLLM_NATIVE="maybe")
    assert result.returncode != 0 and "LOLLM_NATIVE='maybe': use 0 (off) or 1 (on)" in result.stderr


TILES = "from lollm import native; print(native.status(), native.tile_min_rows())"


def test_the_amx_switch_turns_the_tiles_off_says_so_and_refuses_a_bad_value():
    """LOLLM_AMX=0 (any spelling of off, in any case) keeps the vector loops, and the status line names
    the switch; a value that is neither on nor off is refused, as LOLLM_NATIVE's is."""
    kernel()
    for value in ("0", " OFF "):
        result = run_python(TILES, LOLLM_AMX=value)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().endswith(f"; AMX tiles off: LOLLM_AMX={value}) 0")
    result = run_python(TILES, LOLLM_AMX="1")
    tiles = native.tile_min_rows()
    assert result.returncode == 0 and result.stdout.strip().endswith(f") {tiles}")
    assert ("AMX tiles from" in result.stdout) == (tiles > 0)
    result = run_python(TILES, LOLLM_AMX="banana")
    assert result.returncode != 0 and "LOLLM_AMX='banana': use 0 (off) or 1 (on)" in result.stderr


# ---------------------------------------------------------------- Q5_0 in its own 5-bit codes


def random_q5_rows(n: int, k: int, gen: torch.Generator) -> np.ndarray:
    """A Q5_0 matrix as a GGUF file holds it: (n, K / 32 * 22) bytes, blocks of d (float16), qh, qs.
    Block 0 of row 0 has every code at 31 (qh all ones, qs 0xFF), block 1 every code at 0 (w = -16 d),
    and the last block of the last row a zero scale."""
    blocks = torch.randint(0, 256, (n, k // 32, 22), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    d[-1, -1] = 0.0
    blocks[..., 0:2] = d.view(torch.uint8).view(n, k // 32, 2)
    blocks[0, 0, 2:] = 255
    blocks[0, 1, 2:] = 0
    return blocks.view(n, -1).numpy()


def q5_layer(n: int, k: int, gen: torch.Generator) -> tuple[Q5Linear, torch.Tensor, np.ndarray]:
    """(the layer, the file's weights dequantized by lollm.gguf in float32 (n, K), the file's bytes)."""
    rows = random_q5_rows(n, k, gen)
    w = torch.from_numpy(dequantize(rows.reshape(-1), "Q5_0")).view(n, k)
    return Q5Linear.from_blocks(lambda a, b: rows[a:b].reshape(-1), (n, k)), w, rows


def test_a_q5_layer_holds_the_files_bits_and_gives_back_its_weights():
    layer, w, rows = q5_layer(40, 192, torch.Generator().manual_seed(10))
    assert torch.equal(layer.dequantize(), w), "the codes were rearranged, not changed"
    assert torch.equal(layer.dequantize(8, 24), w[8:24])
    held = sum(b.numel() * b.element_size() for b in (layer.nibbles, layer.high, layer.scale))
    assert held == rows.nbytes, "5.5 bits a weight, as in the file"


def q5_versions():
    yield "native", kernel() and native.block_q5_op()
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    for variant in native.VARIANTS:
        yield variant, native.build_variant(variant).block_q5_linear


def test_every_version_computes_the_q5_product():
    gen = torch.Generator().manual_seed(11)
    for name, linear in q5_versions():
        for n, k in [(48, 896), (17, 64), (33, 192)]:
            layer, w, _ = q5_layer(n, k, gen)
            for rows in ROWS:
                x = torch.randn(rows, k, generator=gen) * 3
                x[0, :32] = 0.0
                want = q8_activations(x) @ w.double().T
                got = linear(x, layer.nibbles, layer.high, layer.scale).double()
                err = (((got - want).abs() - tie_slack(x, w)).clamp(min=0).max() / want.abs().max()).item()
                assert err < 1e-5, f"{name}: Q5_0 ({n}, {k}), {rows} rows: relative error {err:.2e}"


def test_q5linear_rows_alone_within_the_activation_rounding_at_every_row_count():
    kernel()
    gen = torch.Generator().manual_seed(12)
    layer, w, _ = q5_layer(64, 256, gen)
    w = w.double()
    for rows in (1, 7, 8, 19, 20, 70):
        x = torch.randn(rows, 256, generator=gen)
        y = layer(x)
        assert torch.equal(y, rows_alone(layer, x)), "a row's output changed with the rows beside it"
        half_step = (x.double().view(rows, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(rows, -1)
        assert ((y.double() - x.double() @ w.T).abs() <= half_step @ w.abs().T + 1e-4).all()


def test_q5_a_non_finite_activation_makes_its_row_nan_and_bad_arguments_name_the_operator():
    kernel()
    layer, _, _ = q5_layer(16, 128, torch.Generator().manual_seed(13))
    for rows in (3, 17):
        x = torch.randn(rows, 128)
        x[1, 70] = float("nan")
        y = native.ops().block_q5_linear(x, layer.nibbles, layer.high, layer.scale)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2:]).all()
    op = native.ops().block_q5_linear
    with pytest.raises(RuntimeError, match="block_q5_linear: x's 96 columns are not whole pairs"):
        op(torch.randn(2, 96), layer.nibbles, layer.high, layer.scale)
    with pytest.raises(RuntimeError, match="block_q5_linear: high must be"):
        op(x, layer.nibbles, layer.high[:, :4], layer.scale)
    with pytest.raises(RuntimeError, match="block_q5_linear: scale must be contiguous float16"):
        op(x, layer.nibbles, layer.high, layer.scale.float())
    with pytest.raises(RuntimeError, match="block_q5_linear: nibbles must be"):
        op(x, layer.nibbles.to(torch.int8), layer.high, layer.scale)


def test_gguf_q5_0_matrices_become_q5linear_where_the_tiles_run(monkeypatch):
    """Where the AMX tiles run, Q5_0 becomes Q5Linear (the tiles multiply its many-row calls); elsewhere
    Q5_0Linear in panels (tests/test_native_kquants.py), which gives the same bits."""
    import lollm.load.quantized as quantized

    kernel()
    monkeypatch.setattr(native, "tile_min_rows", lambda: 8)
    rows = random_q5_rows(32, 128, torch.Generator().manual_seed(14))
    raw = rows.reshape(-1)
    assert isinstance(linear_from_gguf(raw, "Q5_0", (32, 128), None), Q5Linear)
    assert isinstance(linear_from_gguf(raw, "Q5_0", (32, 128), None, grouped=True), Int8Linear)  # the head's layout
    odd = random_q5_rows(32, 96, torch.Generator().manual_seed(15)).reshape(-1)  # 3 blocks a row: no whole pairs
    assert isinstance(linear_from_gguf(odd, "Q5_0", (32, 96), None), Int8Linear)
    monkeypatch.setattr(quantized, "_native_q5", lambda: False)  # no native kernel: int8 per channel
    assert isinstance(linear_from_gguf(raw, "Q5_0", (32, 128), None), Int8Linear)
