"""Compile the Triton attention kernels for NVIDIA GPUs without a GPU, and print what each costs.

    python lollm-core/benchmarks/compile_attention_kernels.py            # sm_80 and sm_90
    python lollm-core/benchmarks/compile_attention_kernels.py --arch 90 --width 512 --dtype bfloat16

Triton compiles ahead of time for a named target (``GPUTarget("cuda", 90, 32)``)
with the ``ptxas`` its wheel ships, no driver needed. For every kernel, head width
(64, 128, 256, 512) and dtype (float32, float16, bfloat16), with the tiles the
launchers use (``PREFILL_TILES``, ``DECODE_TILES``, ``PAGED_TILES``), this prints the shared memory
the kernel asks for, and from ``cuobjdump -res-usage`` its registers per thread and
its stack (local memory: registers spilled). A kernel that does not compile, or asks
for more shared memory than the architecture has per block, ends the script with
status 1: the launch would fail on such a GPU.

What it cannot tell: speed, and whether the kernel computes the right thing on the
device (the interpreter tests and benchmarks/gpu_attention_check.sh do).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lollm.kernels.flash_decode import (
    BLOCK_R,
    DECODE_TILES,
    MAX_SPLITS,
    flash_decode_combine_kernel,
    flash_decode_split_kernel,
)
from lollm.kernels.flash_prefill import PREFILL_TILES, dot_precision, flash_prefill_kernel, head_block, tiles_for
from lollm.kernels.paged_attention import PAGED_TILES, paged_attention_kernel

#: Largest shared memory one block may use (opt-in maximum), bytes: A100 and H100/H200.
SHARED_LIMIT = {80: 166912, 90: 232448}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
POINTER = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
FLOAT_ARGS = {"softcap", "scale"}
FP32_BUFFERS = {"Acc", "M", "L"}  # the split kernels' partial results
INT32_BUFFERS = {"Tables", "Starts", "Counts", "Rows"}  # the paged kernel's block tables and sequence layout


def compile_kernel(fn, dtype: torch.dtype, constexprs: dict, arch: int, num_warps: int, num_stages: int):
    """Compile ``fn`` for sm_<arch>; returns Triton's compiled kernel (``.metadata.shared``, ``.asm["cubin"]``)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in FP32_BUFFERS:
            signature[name] = "*fp32"
        elif name in INT32_BUFFERS:
            signature[name] = "*i32"
        elif name in ("Q", "K", "V", "Out"):
            signature[name] = POINTER[dtype]
        elif name in FLOAT_ARGS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    source = ASTSource(fn, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def resource_usage(cubin: bytes) -> str:
    """``REG:n STACK:n`` of a cubin, read by the cuobjdump that Triton's wheel ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "REG:" in line:
            return " ".join(part for part in line.split() if part.startswith(("REG:", "STACK:")))
    return "?"


def cases(width: int, dtype: torch.dtype):
    """(name, kernel, constexprs, num_warps, num_stages) as the launchers set them, every feature on."""
    BLOCK_M, BLOCK_N, warps, stages = tiles_for(PREFILL_TILES, width)
    common = dict(HAS_WINDOW=True, HAS_SOFTCAP=True, DOT_PRECISION=dot_precision(dtype), BLOCK_D=head_block(width))
    yield "prefill", flash_prefill_kernel, dict(common, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N), warps, stages
    BLOCK_N, warps, stages = tiles_for(DECODE_TILES, width)
    yield "decode split", flash_decode_split_kernel, dict(common, RING=True, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N), warps, stages
    yield "decode combine", flash_decode_combine_kernel, dict(BLOCK_SPLITS=MAX_SPLITS, BLOCK_D=head_block(width)), 4, 2
    BLOCK_N, warps, stages = tiles_for(PAGED_TILES, width)
    yield "paged split", paged_attention_kernel, dict(common, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N), warps, stages


def build(arch: int, width: int, dtype: torch.dtype):
    """Compile every kernel for one (arch, width, dtype).

    Yields (kernel name, compiled kernel or None, problem or None); a problem is a
    compile error or more shared memory than sm_<arch> gives one block.
    """
    for name, fn, constexprs, warps, stages in cases(width, dtype):
        try:
            kernel = compile_kernel(fn, dtype, constexprs, arch, warps, stages)
        except Exception as exc:  # a compile error is the finding: report it and go on
            yield name, None, f"FAILED: {str(exc).splitlines()[-1][:200]}"
            continue
        over = kernel.metadata.shared > SHARED_LIMIT.get(arch, min(SHARED_LIMIT.values()))
        yield name, kernel, f"OVER sm_{arch}'s shared-memory limit" if over else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", help="compute capability as 80, 90 (default: both)")
    parser.add_argument("--width", type=int, action="append", help="head width (default: every row of PREFILL_TILES)")
    parser.add_argument("--dtype", action="append", choices=list(DTYPES), help="default: all three")
    args = parser.parse_args()
    if flash_prefill_kernel.__class__.__name__ == "InterpretedFunction":
        parser.error("TRITON_INTERPRET is set: kernels defined for the interpreter cannot be compiled; unset it")
    failed = 0
    print(f"{'arch':>5} {'kernel':>15} {'D':>4} {'dtype':>9} {'shared KB':>9}  registers")
    for arch in args.arch or [80, 90]:
        for width in args.width or sorted(PREFILL_TILES):
            for dtype in [DTYPES[name] for name in args.dtype or DTYPES]:
                for name, kernel, problem in build(arch, width, dtype):
                    failed += problem is not None
                    cost = "" if kernel is None else f"{kernel.metadata.shared / 1024:>9.0f}  {resource_usage(kernel.asm['cubin'])}"
                    print(f"sm_{arch} {name:>15} {width:>4} {str(dtype)[6:]:>9} {cost}  {problem or ''}", flush=True)
    print("all compiled within limits" if not failed else f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
