"""lollm's native CPU kernel: a packed int8 linear layer with int8 activations (``block_int8.cpp``).

A packed decode step is a matrix-vector product per layer, and its cost is
reading the weights. torch's ``_weight_int8pack_mm`` reads them at about half the
rate llama.cpp's hand-written dot products reach on the same core, and its time
grows with every row (token) it is given. ``block_int8.cpp`` is our own kernel,
written to be read (docs/native-kernel.md): the activations become int8 in
blocks of 32 with one scale each (llama.cpp's Q8_0 activations), each block of 32
weights meets them in integer dot-product instructions (AVX-512 VNNI's vpdpbusd,
or AVX2's vpmaddubsw), and each block's exact int32 sum is scaled and added in
float32 in one fixed order. Every route (AMX tiles, AVX-512 VNNI, AVX2, portable
C++) does the same float32 operations in the same order, so each gives the same
bits as every other, and a row gives the same bits alone as in any batch.

The route: ``LOLLM_ISA`` picks the build (:data:`ISAS`): ``native`` (the default:
the best this CPU has, AMX tiles included where Linux lends them), ``avx512``
(the AVX-512 VNNI loops, no tiles), ``avx2`` or ``portable``. Each is the same
source compiled for that instruction set; CI forces each one in turn. The layers
reach the chosen build through :func:`ops`.

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
#: The one that picks the instruction set the kernel is built for (the route).
ISA_ENV = "LOLLM_ISA"
#: LOLLM_ISA's values -> the build each loads (None: the native one, built with -march=native).
ISAS = {"native": None, "avx512": "vnni", "avx2": "avx2", "portable": "portable"}
#: The /proc/cpuinfo flags each forced route needs, and the instruction set its build must then name.
_NEEDS = {"avx512": (("avx512f", "avx512bw", "avx512dq", "avx512_vnni"), "AVX-512 VNNI"),
          "avx2": (("avx2", "fma"), "AVX2"), "portable": ((), "portable C++")}
_OFF, _ON = ("0", "off", "false", "no"), ("", "1", "on", "true", "yes")
#: The C++ sources built into the one library (every ``.cpp`` beside this file), and the headers they share.
SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops" (the namespace or None) and "why" (one line), once decided


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


#: The other versions of steps 2 and 3 (flags added to -march=native): built by the tests beside the
#: native one, and loaded instead of it where LOLLM_ISA asks (:data:`ISAS`).
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
    """Load or compile the sources for the route LOLLM_ISA picks; returns (ops or None, one line).
    LollmError for a value of LOLLM_NATIVE or LOLLM_AMX that is neither on nor off, and for a
    LOLLM_ISA that is not one of :data:`ISAS` or names a route this CPU lacks."""
    choice = _switch(ENV)
    if choice == "off":
        return None, f"off ({ENV}={os.environ[ENV]})"
    tiles_off = _switch(AMX_ENV) == "off"
    isa = isa_choice()
    variant = ISAS[isa] if _x86() else None  # elsewhere the native build is the portable C++ already
    namespace = "lollm_native" if variant is None else f"lollm_native_{variant}"
    name = f"{namespace}_{_cpu_tag()}"
    missing = None if _cached(name) else _missing_tool()
    if missing:
        return None, f"not built: {missing}"
    try:
        _compile(name, [] if variant is None else [*VARIANTS[variant], f"-DLOLLM_NATIVE_NAMESPACE={namespace}"])
    except (RuntimeError, OSError, ImportError, ValueError, subprocess.SubprocessError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
        first = next((line for line in lines if "error" in line.lower() and line is not lines[0]), lines[0])
        print(f"lollm: the native kernel did not build ({first}); torch's kernels run instead "
              f"({ENV}=0 skips the try)", file=sys.stderr, flush=True)
        return None, f"not built: {first}"
    built = getattr(torch.ops, namespace)
    named = built.instruction_set()
    if isa != "native" and not named.startswith(_NEEDS[isa][1]):
        raise LollmError(f"{ISA_ENV}={os.environ[ISA_ENV]!r}: this CPU has no {_NEEDS[isa][1]} (its build runs {named})")
    notes = [f"{ISA_ENV}={isa}"] if isa != "native" else []
    if tiles_off:
        notes.append(f"AMX tiles off: {AMX_ENV}={os.environ[AMX_ENV]}")
    return built, f"on ({'; '.join([named, *notes])})"


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def _cpu_flags() -> set[str] | None:
    """This CPU's feature flags from /proc/cpuinfo, or None where it cannot be read (not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def isa_choice() -> str:
    """The route LOLLM_ISA asks for (unset: ``native``), checked against this CPU.

    Raises LollmError naming the variable and the allowed values for any other value, and saying
    what is missing where this CPU lacks the instructions of the route asked for.
    """
    value = os.environ.get(ISA_ENV, "native")
    isa = value.strip().lower() or "native"
    if isa not in ISAS:
        raise LollmError(f"{ISA_ENV}={value!r}: use one of {', '.join(ISAS)}")
    if isa in ("avx512", "avx2"):
        flags = _cpu_flags() if _x86() else set()
        lacking = [flag for flag in _NEEDS[isa][0] if flags is not None and flag not in flags]
        if lacking:
            raise LollmError(f"{ISA_ENV}={value!r}: this CPU ({platform.machine()}) has no {_NEEDS[isa][1]} "
                             f"(missing: {', '.join(lacking)}); use native or portable")
    return isa


def _switch(name: str) -> str:
    """"on" or "off" from environment variable ``name`` (unset: on). LollmError for any other value."""
    value = os.environ.get(name, "1")
    if value.strip().lower() in _OFF:
        return "off"
    if value.strip().lower() in _ON:
        return "on"
    raise LollmError(f"{name}={value!r}: use 0 (off) or 1 (on)")


def build_variant(variant: str):
    """The ops of another version of steps 2 and 3 (a key of :data:`VARIANTS`: ``"vnni"``, ``"avx2"``,
    ``"portable"``), built for the tests and benchmarks beside the route in force.

    Returns the namespace ``torch.ops.lollm_native_<variant>`` (``block_int8_linear``,
    ``instruction_set``, ...). Raises RuntimeError where it cannot be built.
    """
    namespace = f"lollm_native_{variant}"
    _compile(f"{namespace}_{_cpu_tag()}", [*VARIANTS[variant], f"-DLOLLM_NATIVE_NAMESPACE={namespace}"])
    return getattr(torch.ops, namespace)


def ops():
    """The built kernel's operators for the route in force (``torch.ops.lollm_native`` or the
    namespace of the build LOLLM_ISA picked), or None where the kernel is off or cannot be built.

    Its operators: ``block_int8_linear`` (:func:`block_int8_op`), ``block_q5_linear``
    (:func:`block_q5_op`), ``instruction_set()`` and ``tile_min_rows()``, and those of the other
    sources beside block_int8.cpp. The layers call this at each forward instead of naming
    ``torch.ops.lollm_native``, so every layer runs the route LOLLM_ISA chose.

    The first call decides, under a lock, once per process: it compiles or loads the build.
    LollmError for a bad LOLLM_NATIVE, LOLLM_AMX or LOLLM_ISA (:func:`isa_choice`).
    """
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                _state["ops"], _state["why"] = _build()
    return _state["ops"]


def block_int8_op():
    """The kernel as a callable ``(x, codes, scale) -> y``, or None where it is off or cannot be built.

    x: ``(M, K)`` float32, contiguous, CPU; codes: ``(groups, N, group_size)`` int8,
    ``group_size`` a multiple of 32; scale: ``(groups, N)`` float32 or float16 (where every
    scale is a float16 value, such as a Q8_0 file's block scales, :class:`lollm.load.packed_linear.Int8Linear`
    keeps them so), contiguous. Returns
    ``(M, N)`` float32, ``y[m, n] = sum_k x[m, k] * codes[k // gs, n, k % gs] * scale[k // gs, n]``
    with x rounded to int8 per block of 32 (scale max|x| / 127), each block's int32 sum scaled and
    added in the canonical order (docs/native-kernel.md, section 1): row m of y depends on row m of
    x and the weights alone, bit for bit, on every route. The scales are read as float32
    either way: float16 ones give the same y, bit for bit, as the same values in float32. Any
    other dtype, shape or layout raises RuntimeError naming the operator (and the dtype).
    """
    built = ops()
    return None if built is None else built.block_int8_linear


def block_q5_op():
    """The Q5_0 kernel ``(x, nibbles, high, scale) -> y``, or None where the native build is off or missing.

    x: ``(M, K)`` float32, K a multiple of 64; nibbles ``(N, K / 2)`` and high ``(N, K / 8)``
    uint8, scale ``(N, K / 32)`` float16: a Q5_0 matrix in the pairs of blocks that
    :class:`lollm.load.packed_linear.Q5Linear` holds (block_int8.cpp, above ``unpack_q5_pair``).
    Returns ``(M, N)`` float32, x rounded to int8 per block of 32 as for
    :func:`block_int8_op`. Built with it, in the same library.
    """
    built = ops()
    return None if built is None else built.block_q5_linear


def paged_attention_op():
    """The CPU paged attention kernel (``attention.cpp``), or None where the native build is off or missing.

    ``(q, k_pool, v_pool, tables, starts, counts, window, softcap, scale) -> out``: q ``(N, H, D)``
    float32; the pools ``(blocks, block_size, K, D)`` float32, bfloat16 or float16; tables
    ``(B, max_blocks)`` int64 (-1: no block), starts and counts ``(B,)`` int64; window an int or
    None, softcap a float or None, scale a float. Returns ``(N, H, D)`` float32, each query's row
    computed alone (docs/batch-invariance.md, "Batch invariance in attention"). :func:`lollm.native.paged.paged_attention` calls
    it for an engine step. Built with :func:`block_int8_op`, in the same library.
    """
    built = ops()
    return None if built is None else built.paged_attention


def tile_min_rows() -> int:
    """From how many rows the kernel multiplies with AMX tiles instead of its vector loops; 0 where it never does.

    The tiles run on CPUs with AMX-INT8 (Intel Xeon since Sapphire Rapids) where Linux lends
    them to the process, unless ``LOLLM_AMX=0`` or ``LOLLM_ISA`` picks another route. The tiles
    and the loops give the same bits (the canonical order, docs/native-kernel.md, section 9): the
    count changes the speed, never a result. 0 also where the kernel is off or not built.
    """
    built = ops()
    return 0 if built is None else int(built.tile_min_rows())


def status() -> str:
    """One line: whether the kernel runs and on which route (LOLLM_ISA and LOLLM_AMX named where set), or why not."""
    ops()
    return f"native kernel: {_state['why']}"
