"""lollm.native: the hand-written int8 kernel against the same arithmetic done in float64 by torch.

Every compiled version of steps 2 and 3 is checked (AVX-512 VNNI where the CPU has it, AVX2,
plain C++): their integer sums must be exact, so they may differ from the reference only by the
order of float32 additions. Where no C++ compiler is installed the kernel tests skip, saying so;
CI installs one and sets LOLLM_REQUIRE_NATIVE=1, under which a kernel that does not build fails.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from lollm import native
from lollm.quantized import GEMM_MIN_ROWS, Int8Linear

#: (groups, N, group_size): per channel with an even and an odd number of blocks (a lone last
#: block), several groups of 64 and of 96, and groups of 32 (the head's layout) with N odd.
SHAPES = [(1, 48, 896), (1, 33, 96), (1, 17, 160), (3, 40, 64), (2, 19, 96), (28, 101, 32), (3, 7, 32)]


def q8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: x rounded to int8 per block of 32 (scale max|x| / 127), times w = q * s."""
    m, k = x.shape
    groups, n, group_size = codes.shape
    blocks = x.double().view(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0.0)  # ties to even, as nearbyint
    w = (codes.double() * scale.double()[..., None]).transpose(0, 1).reshape(n, k)
    return (xq * d).view(m, k) @ w.T


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


def test_every_version_computes_the_q8_product():
    gen = torch.Generator().manual_seed(0)
    names = []
    for name, op in versions():
        names.append(name)
        for groups, n, group_size in SHAPES:
            codes, scale = random_layer(groups, n, group_size, gen)
            for rows in (1, 2, 3, 4, 5, 9):
                x = torch.randn(rows, groups * group_size, generator=gen) * 3
                x[0, :32] = 0.0  # a block of zeros: scale 0, no division by it
                want = q8_reference(x, codes, scale)
                got = op(x, codes, scale).double()
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err < 1e-5, f"{name}: codes {tuple(codes.shape)}, {rows} rows: relative error {err:.2e}"
    print("versions checked:", names)


def test_instruction_sets_are_named():
    kernel()
    assert torch.ops.lollm_native.instruction_set() in ("AVX-512 VNNI", "AVX2", "portable C++")
    if platform.machine() in ("x86_64", "AMD64"):
        assert native.build_variant("avx2").instruction_set() == "AVX2"
        assert native.build_variant("portable").instruction_set() == "portable C++"


def test_a_non_finite_activation_makes_its_row_nan_and_no_other():
    op = kernel()
    gen = torch.Generator().manual_seed(1)
    for groups, n, group_size in [(1, 24, 96), (3, 9, 32)]:
        codes, scale = random_layer(groups, n, group_size, gen)
        x = torch.randn(3, groups * group_size, generator=gen)
        x[1, 40] = float("nan")
        x[2, 5] = float("inf")
        y = op(x, codes, scale)
        assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all(), "a NaN or inf input must not vanish into a number"
        assert torch.isfinite(y[0]).all()


def test_bad_arguments_name_the_operator():
    op = kernel()
    codes, scale = random_layer(1, 8, 64, torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="block_int8_linear: x must be"):
        op(torch.randn(2, 64, dtype=torch.float64), codes, scale)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(2, 96), codes, scale)
    with pytest.raises(RuntimeError, match="scale must be"):
        op(torch.randn(2, 64), codes, scale[:, :4])


def test_int8linear_takes_the_kernel_for_few_rows_within_the_activation_rounding():
    """Int8Linear's few-row route is the kernel, a row's output does not depend on the rows beside
    it (a batch of rows equals each row alone, bit for bit), and its error against the float product of the
    dequantized weights stays within what rounding x to int8 per block allows: each x moves by at
    most half a step (max|x| / 254 in its block), so |y - x·w| <= sum_k |w_k| * step_k / 2."""
    kernel()
    gen = torch.Generator().manual_seed(3)
    for groups, n, group_size in [(1, 64, 256), (1, 40, 96), (8, 64, 32)]:
        codes, scale = random_layer(groups, n, group_size, gen)
        layer = Int8Linear(codes, scale)
        assert layer.uses_native() and layer.gemm_rows() in (None, GEMM_MIN_ROWS)
        w = (codes.double() * scale.double()[..., None]).transpose(0, 1).reshape(n, -1)
        for rows in (1, 7, GEMM_MIN_ROWS - 1):
            x = torch.randn(rows, groups * group_size, generator=gen)
            y = layer(x)
            assert torch.equal(y, torch.ops.lollm_native.block_int8_linear(x, codes, scale))
            alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
            assert torch.equal(y, alone), "a row's output changed with the rows beside it"
            half_step = (x.double().view(rows, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(rows, -1)
            bound = half_step @ w.abs().T + 1e-4
            assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


FALLBACK = """
import torch
from lollm import native
from lollm.quantized import Int8Linear
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
