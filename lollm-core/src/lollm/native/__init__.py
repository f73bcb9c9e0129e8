"""lollm's native CPU kernel: a packed int8 linear layer with int8 activations (``block_int8.cpp``).

A packed decode step is a matrix-vector product per layer, and its cost is
reading the weights. torch's ``_weight_int8pack_mm`` reads them at about half the
rate llama.cpp's hand-written dot products reach on the same core, and its time
grows with every row (token) it is given. ``block_int8.cpp`` is our own kernel,
written to be read (docs/native-kernel.md): the activations become int8 in
blocks of 32 with one scale each (llama.cpp's Q8_0 activations), each block of 32
weights meets them in integer dot-product instructions (AVX-512 VNNI's vpdpbusd,
or AVX2's vpmaddubsw), and the int32 sums are scaled in float32.

It is compiled on first use with ``torch.utils.cpp_extension`` (a C++ compiler
and ninja are needed; ninja comes with lollm-core), for this CPU
(``-march=native``), and cached under torch's extension folder
(``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), one build per
CPU model. Where it cannot be built, :class:`lollm.load.packed_linear.Int8Linear` keeps
torch's kernel, and :func:`status` says why. ``LOLLM_NATIVE=0`` turns it off. A build
already in the folder is loaded without a compiler.

Model math stays PyTorch: this file computes ``x @ w.T`` for a layer whose
weights the loader already holds as int8 codes and scales, nothing else.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

from lollm.errors import LollmError

# Lazy imports below: torch.utils.cpp_extension and ninja, only when the kernel is built (on first use).

#: The environment variable that turns the kernel off ("0", "off", "false", "no") or on (unset, "1", "on", "true", "yes").
ENV = "LOLLM_NATIVE"
#: The one that turns its AMX tiles off (the same values; block_int8.cpp reads it too, once).
AMX_ENV = "LOLLM_AMX"
_OFF, _ON = ("0", "off", "false", "no"), ("", "1", "on", "true", "yes")
#: The C++ sources built into the one library (every ``.cpp`` beside this file), and the headers they share.
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))

_lock = threading.Lock()
_state: dict[str, object] = {}  # "op" (the callable or None) and "why" (one line), once decided


def _cpu_tag() -> str:
    """A digest of what the build depends on: the source, this CPU's features, torch's version."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(platform.machine().encode())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                digest.update(line.encode())
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        digest.update(platform.processor().encode())
    return digest.hexdigest()[:12]


def _missing_tool() -> str | None:
    """Why a build cannot start here, or None. Puts the ninja that lollm-core installs on PATH
    (a venv's bin folder is not on it when its scripts are run by their full path)."""
    from torch.utils import cpp_extension

    try:
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass  # a ninja on PATH serves as well

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not found; set CXX or install g++)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


#: The other versions of steps 2 and 3, built by the tests beside the native one (flags added to -march=native).
VARIANTS = {"vnni": ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"], "avx2": ["-mno-avx512f"],
            "portable": ["-mno-avx2", "-mno-avx512f"]}


def _cached(name: str) -> Path | None:
    """The built library of extension ``name`` in torch's extension folder, if it is there."""
    from torch.utils import cpp_extension

    library = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
    return library if library.exists() else None


def _compile(name: str, flags: list[str]) -> None:
    """Load the cached build of extension ``name`` (its name carries the sources' and the CPU's digest,
    so a library of that name is these sources built for this CPU), or compile :data:`SOURCES` into it.
    Raises what torch raises."""
    from torch.utils import cpp_extension

    library = _cached(name)
    if library is not None:
        torch.ops.load_library(str(library))
        return
    if sys.stderr.isatty():  # on a terminal only: logs and tests stay clean
        print("lollm: compiling the native kernel for this CPU (once, a few seconds to a minute)", file=sys.stderr, flush=True)
    cpp_extension.load(
        name=name, sources=[str(path) for path in SOURCES], is_python_module=False, verbose=False,
        extra_cflags=["-O3", "-march=native", "-fopenmp", *flags], extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(Path(__file__).parent)],
    )


def _build():
    """Load or compile block_int8.cpp; returns (op or None, one line). LollmError for a value of
    LOLLM_NATIVE or LOLLM_AMX that is neither on nor off."""
    choice = _switch(ENV)
    if choice == "off":
        return None, f"off ({ENV}={os.environ[ENV]})"
    tiles_off = _switch(AMX_ENV) == "off"
    name = f"lollm_native_{_cpu_tag()}"
    missing = None if _cached(name) else _missing_tool()
    if missing:
        return None, f"not built: {missing}"
    try:
        _compile(name, [])
    except (RuntimeError, OSError, ImportError, ValueError, subprocess.SubprocessError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        first = next((line for line in lines if "error" in line.lower() and line is not lines[0]), lines[0])
        print(f"lollm: the native kernel did not build ({first}); torch's kernels run instead "
              f"({ENV}=0 skips the try)", file=sys.stderr, flush=True)
        return None, f"not built: {first}"
    ops = torch.ops.lollm_native
    return ops.block_int8_linear, f"on ({ops.instruction_set()}{f'; AMX tiles off: {AMX_ENV}={os.environ[AMX_ENV]}' if tiles_off else ''})"


def _switch(name: str) -> str:
    """"on" or "off" from environment variable ``name`` (unset: on). LollmError for any other value."""
    value = os.environ.get(name, "1")
    if value.strip().lower() in _OFF:
        return "off"
    if value.strip().lower() in _ON:
        return "on"
    raise LollmError(f"{name}={value!r}: use 0 (off) or 1 (on)")


def build_variant(variant: str):
    """The ops of another version of steps 2 and 3 (``"avx2"``, ``"portable"``), built for the tests.

    Returns the namespace ``torch.ops.lollm_native_<variant>`` (``block_int8_linear``,
    ``instruction_set``). Raises RuntimeError where it cannot be built.
    """
    namespace = f"lollm_native_{variant}"
    _compile(f"{namespace}_{_cpu_tag()}", [*VARIANTS[variant], f"-DLOLLM_NATIVE_NAMESPACE={namespace}"])
    return getattr(torch.ops, namespace)


def block_int8_op():
    """The kernel as a callable ``(x, codes, scale) -> y``, or None where it is off or cannot be built.

    x: ``(M, K)`` float32, contiguous, CPU; codes: ``(groups, N, group_size)`` int8,
    ``group_size`` a multiple of 32; scale: ``(groups, N)`` float32 or float16 (where every
    scale is a float16 value, such as a Q8_0 file's block scales, :class:`lollm.load.packed_linear.Int8Linear`
    keeps them so), contiguous. Returns
    ``(M, N)`` float32, ``y[m, n] = sum_k x[m, k] * codes[k // gs, n, k % gs] * scale[k // gs, n]``
    with x rounded to int8 per block of 32 (scale max|x| / 127). The scales are read as float32
    either way: float16 ones give the same y, bit for bit, as the same values in float32. Any
    other dtype, shape or layout raises RuntimeError naming the operator (and the dtype).

    The first call decides, under a lock, once per process: it compiles or loads the build.
    """
    if "op" not in _state:
        with _lock:
            if "op" not in _state:
                _state["op"], _state["why"] = _build()
    return _state["op"]


def block_q5_op():
    """The Q5_0 kernel ``(x, nibbles, high, scale) -> y``, or None where the native build is off or missing.

    x: ``(M, K)`` float32, K a multiple of 64; nibbles ``(N, K / 2)`` and high ``(N, K / 8)``
    uint8, scale ``(N, K / 32)`` float16: a Q5_0 matrix in the pairs of blocks that
    :class:`lollm.load.packed_linear.Q5Linear` holds (block_int8.cpp, above ``unpack_q5_pair``).
    Returns ``(M, N)`` float32, x rounded to int8 per block of 32 as for
    :func:`block_int8_op`. Built with it, in the same library.
    """
    return None if block_int8_op() is None else torch.ops.lollm_native.block_q5_linear


def paged_attention_op():
    """The CPU paged attention kernel (``attention.cpp``), or None where the native build is off or missing.

    ``(q, k_pool, v_pool, tables, starts, counts, window, softcap, scale) -> out``: q ``(N, H, D)``
    float32; the pools ``(blocks, block_size, K, D)`` float32, bfloat16 or float16; tables
    ``(B, max_blocks)`` int64 (-1: no block), starts and counts ``(B,)`` int64; window an int or
    None, softcap a float or None, scale a float. Returns ``(N, H, D)`` float32, each query's row
    computed alone (docs/batching.md, section 9). :func:`lollm.native.paged.paged_attention` calls
    it for an engine step. Built with :func:`block_int8_op`, in the same library.
    """
    return None if block_int8_op() is None else torch.ops.lollm_native.paged_attention


def tile_min_rows() -> int:
    """From how many rows the kernel multiplies with AMX tiles instead of its vector loops; 0 where it never does.

    The tiles run on CPUs with AMX-INT8 (Intel Xeon since Sapphire Rapids) where Linux lends
    them to the process, unless ``LOLLM_AMX=0``. Each route gives a row the same output whatever
    rows are beside it; the two routes round the float32 sums in a different order
    (docs/native-kernel.md, section 9). 0 also where the kernel is off or not built.
    """
    return 0 if block_int8_op() is None else int(torch.ops.lollm_native.tile_min_rows())


def status() -> str:
    """One line: whether the kernel runs, and why not (it decides first, as :func:`block_int8_op` does)."""
    block_int8_op()
    return f"native kernel: {_state['why']}"
