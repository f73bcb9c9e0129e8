"""LoadOptions: how to load a model, in one record from the command line to the family.

Every setting that changes how a checkpoint becomes a model travels in one
frozen :class:`LoadOptions`. The CLI builds it once from its flags
(:func:`lollm.cli.options.load_options`); a Python caller builds it directly::

    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model

    loaded = open_model("path/to/model.gguf", LoadOptions(weights="auto", progress=True))

Two kinds of fields:

* what the caller asks for (``device``, ``dtype``, ``attn``, ``weights``,
  ``quantize``, ``group_size``, ``tp``, ``family``, ``progress``), where
  ``"auto"`` and ``None`` leave the choice to core;
* what core decided (``quantization``, ``tensor_parallel``), filled by
  :func:`lollm.load.pipeline.prepare` once the checkpoint is open. A
  family's ``load`` only ever receives resolved options: ``device`` and
  ``dtype`` name a concrete device and dtype, ``quantization`` says what may
  stay packed, ``tensor_parallel`` is this rank's group under ``--tp`` (or None).

Nothing here imports torch: the CLI builds and checks the record before the
slow imports. The plugin contract that carries it is described in
docs/plugins.md ("Contract 2").
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from lollm.errors import LollmError

# Lazy imports below: torch, in torch_device and torch_dtype only, so that the CLI builds and checks its
# LoadOptions without importing torch.

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only
    from lollm.load.quantized import Quantization
    from lollm.load.process_group import Group

#: ``weights`` choices: ``auto`` keeps a GGUF's blocks packed and loads safetensors as float
#: (unless ``quantize``); ``float`` dequantizes everything; ``quantized`` insists on packing.
WEIGHTS_CHOICES = ("auto", "float", "quantized")

#: ``quantize`` choices for a float checkpoint (docs/quantized-execution.md).
QUANTIZE_CHOICES = ("int8", "int4")

#: Values per int4 group that ``group_size`` accepts (lollm.load.quantized's kernels).
GROUP_SIZES = (32, 64, 128, 256)

#: ``device`` spellings: torch's names of the three devices lollm runs on (``lollm run --device`` checks the same).
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")

#: dtype names the options accept, beside ``auto``.
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
#: The short names among :data:`DTYPE_NAMES`, each with torch's name of its dtype.
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint is loaded; ``"auto"`` / ``None`` fields are decided by core.

    Asked for by the caller (the flags of the same names):
      device:     ``"auto"`` (CUDA, then MPS, then CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"``.
      dtype:      ``"auto"`` (float32 on the CPU, the checkpoint's own dtype elsewhere) or a name
                  from :data:`DTYPE_NAMES`.
      attn:       attention backend (``sdpa``, ``eager``, ``triton``); None: ``$LOLLM_ATTN``, else ``sdpa``.
      weights:    one of :data:`WEIGHTS_CHOICES`; None means ``"float"`` (the reference path),
                  or ``"auto"`` when ``quantize`` is given. The CLI's ``run`` passes ``"auto"``.
      quantize:   ``"int8"`` / ``"int4"``: pack a float checkpoint at load; None: do not.
      group_size: values per int4 group (32, 64, 128 or 256).
      tp:         tensor-parallel degree; above 1 the process is one of ``tp`` started by torchrun.
      family:     the family's name when several installed plugins claim the checkpoint's type.
      progress:   show a progress bar while the weights stream in (only on a terminal).

    Decided by core (:func:`lollm.load.pipeline.prepare`), None until then:
      quantization:    :class:`lollm.load.quantized.Quantization`: which tensors may stay packed, and how.
      tensor_parallel: :class:`lollm.load.process_group.Group` of this rank under ``--tp``; None on one process.

    After resolution ``device`` is concrete (``"cpu"``, ``"cuda:0"`` …), ``dtype`` a
    canonical name (``"float32"``, ``"bfloat16"``, ``"float16"``) and ``attn`` the backend's name.
    Raises LollmError when built with a value outside the choices above, naming the flag
    of the same name (see :meth:`__post_init__`).
    """

    device: str = "auto"
    dtype: str = "auto"
    attn: str | None = None
    weights: str | None = None
    quantize: str | None = None
    group_size: int = 32
    tp: int = 1
    family: str | None = None
    progress: bool = False
    quantization: "Quantization | None" = None
    tensor_parallel: "Group | None" = None

    def __post_init__(self) -> None:
        """Refuse values no load could honour, naming the option (before any file is read).

        The attention backend's name is checked when the options are resolved
        (:func:`lollm.attention.resolve_backend` knows the backends and what each needs).
        """
        if not isinstance(self.device, str) or not DEVICE_PATTERN.match(self.device):
            raise LollmError(f"--device {self.device!r}: use auto, cpu, cuda, cuda:N or mps")
        if self.attn is not None and not isinstance(self.attn, str):
            raise LollmError(f"--attn {self.attn!r}: give a backend's name (sdpa, eager, triton)")
        if self.family is not None and (not isinstance(self.family, str) or not self.family):
            raise LollmError(f"--family {self.family!r}: give a family's name (lollm families lists them)")
        if not isinstance(self.progress, bool):
            raise LollmError(f"LoadOptions.progress must be True or False, got {self.progress!r}")
        if isinstance(self.group_size, bool) or self.group_size not in GROUP_SIZES:
            raise LollmError(f"int4 group size {self.group_size!r} (--group-size): use one of {', '.join(map(str, GROUP_SIZES))}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise LollmError(f"unknown dtype {self.dtype!r} (use auto, {', '.join(sorted(DTYPE_NAMES))})")
        if self.weights is not None and self.weights not in WEIGHTS_CHOICES:
            raise LollmError(f"--weights {self.weights!r}: use one of {', '.join(WEIGHTS_CHOICES)}")
        if self.quantize is not None and self.quantize not in QUANTIZE_CHOICES:
            raise LollmError(f"--quantize {self.quantize!r}: use int8 or int4")
        if self.weights == "float" and self.quantize is not None:
            raise LollmError("--quantize asks for packed weights, --weights float for float ones: give one of them")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise LollmError(f"--tp {self.tp!r}: give a whole number of processes, 1 or more")

    @property
    def resolved(self) -> bool:
        """Whether core has decided every choice (what a family's ``load`` may rely on)."""
        return self.quantization is not None and self.device != "auto" and self.dtype != "auto"

    @property
    def weights_mode(self) -> str:
        """``weights`` with its default applied: ``"auto"`` when ``quantize`` is given, else ``"float"``."""
        if self.weights is not None:
            return self.weights
        return "auto" if self.quantize else "float"

    @property
    def torch_device(self) -> Any:
        """``device`` as a ``torch.device`` (resolved options only)."""
        import torch

        return torch.device(self._require("device"))

    @property
    def torch_dtype(self) -> Any:
        """``dtype`` as a ``torch.dtype`` (resolved options only)."""
        import torch

        return getattr(torch, self._require("dtype"))

    def _require(self, key: str) -> str:
        value = getattr(self, key)
        if value == "auto":
            raise LollmError(f"LoadOptions.{key} is still 'auto': pass the options through "
                             f"lollm.load.pipeline.prepare (open_model does) before a family loads")
        return value

    def replace(self, **changes: Any) -> "LoadOptions":
        """A copy with ``changes`` applied (the record is frozen)."""
        return replace(self, **changes)


#: ``--threads`` is refused above this many threads per core the process may run on.
THREADS_PER_CORE = 4


def threads_limit() -> int:
    """The most ``--threads`` accepted: :data:`THREADS_PER_CORE` times the cores this process may run on.

    The cores are those of ``os.sched_getaffinity`` where the system has it (a
    container or ``taskset`` may allow fewer than the machine has), else
    ``os.cpu_count()``. More threads than cores only adds switching; a million
    exhausts the machine's thread limit before torch ever computes.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return THREADS_PER_CORE * max(cores, 1)


def check_threads(threads: int | None) -> None:
    """``--threads`` between 1 and :func:`threads_limit`, before torch sees it; LollmError naming the flag otherwise."""
    if threads is None:
        return
    if threads < 1:
        raise LollmError(f"--threads must be >= 1, got {threads}")
    limit = threads_limit()
    if threads > limit:
        raise LollmError(f"--threads {threads} is more than lollm allows here: at most {limit} ({THREADS_PER_CORE} per "
                         f"core, {limit // THREADS_PER_CORE} cores); leave it out for torch's default (one per core)")
