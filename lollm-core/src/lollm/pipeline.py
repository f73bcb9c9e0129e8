"""From a spec to a ready model: loader ─► router ─► family.load.

This is the path every command takes (``lollm run``, ``parity``, ``bench``)
and the one-call entry point for Python users::

    from lollm.pipeline import open_model
    loaded = open_model("path/to/qwen2-folder")
    ids = loaded.tokenizer.encode("Hello")
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from lollm.attention import resolve_backend
from lollm.errors import LollmError
from lollm.loader import Checkpoint, load_checkpoint
from lollm.plugins import InstalledFamily, get_registry
from lollm.quantized import Quantization

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def pick_device(name: str = "auto") -> torch.device:
    """``auto`` is CUDA when available, then Apple's MPS, then the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LollmError(f"unknown device {name!r} (use auto, cpu, cuda, cuda:N or mps)") from None
    if device.type not in ("cpu", "cuda", "mps"):  # torch knows more (meta, xpu, ...); lollm runs on these three
        raise LollmError(f"device {name!r} is not supported by lollm (use auto, cpu, cuda, cuda:N or mps)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LollmError(f"device {name!r}: this torch build has no usable CUDA device (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise LollmError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if device.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise LollmError(f"device {name!r}: Apple's MPS backend is not available in this torch build or machine")
    return device


def pick_dtype(name: str, device: torch.device, config: dict[str, Any]) -> torch.dtype:
    """``auto`` is float32 on the CPU (fast and exact there) and the checkpoint's own dtype elsewhere."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        stored = config.get("dtype") or config.get("torch_dtype") or "float16"  # GGUF: no stored float dtype
        return DTYPES.get(str(stored), torch.float32)
    if name not in DTYPES:
        raise LollmError(f"unknown dtype {name!r} (use auto, {', '.join(sorted(set(DTYPES)))})")
    return DTYPES[name]


@dataclass
class LoadedModel:
    """A checkpoint, the family that serves it, and the model it built."""

    checkpoint: Checkpoint
    family: InstalledFamily
    model: Any
    device: torch.device
    dtype: torch.dtype
    load_seconds: float
    attn: str = "sdpa"  # the attention backend the commands run it with (lollm.attention)
    tp: Any = None  # the lollm.tensor_parallel.Group of this rank under --tp N, else None

    @property
    def tokenizer(self):
        return self.checkpoint.tokenizer


def route(checkpoint: Checkpoint, family: str | None = None) -> InstalledFamily:
    """The installed family that serves this checkpoint (see :mod:`lollm.plugins`).

    safetensors checkpoints are routed by config.json's ``model_type``, GGUF files
    by their ``general.architecture``. ``family`` (``--family NAME``) chooses the
    family by name when several claim the type; it must declare the type.
    """
    if checkpoint.fmt == "gguf":
        return get_registry().route(gguf_architecture=checkpoint.model_type, family=family)
    return get_registry().route(checkpoint.model_type, family=family)


#: ``--weights`` choices: ``auto`` keeps a GGUF's blocks packed and loads safetensors as float
#: (unless ``--quantize``); ``float`` dequantizes everything; ``quantized`` insists on packing.
WEIGHTS_CHOICES = ("auto", "float", "quantized")


def pick_quantization(weights: str, quantize: str | None, group_size: int, fmt: str, device: torch.device) -> Quantization:
    """The :class:`~lollm.quantized.Quantization` for a load, from the ``--weights`` / ``--quantize`` flags.

    GGUF: packed unless ``weights == "float"``; ``--quantize`` is refused (the file
    is quantized already). safetensors: float unless ``--quantize int8|int4``;
    ``--weights quantized`` without ``--quantize`` is refused. Packed weights run
    on the CPU only (torch's packed kernels used here are CPU kernels): ``auto``
    elsewhere loads float, an explicit request is refused.
    """
    if weights not in WEIGHTS_CHOICES:
        raise LollmError(f"--weights {weights!r}: use one of {', '.join(WEIGHTS_CHOICES)}")
    if quantize not in (None, "int8", "int4"):
        raise LollmError(f"--quantize {quantize!r}: use int8 or int4")
    if weights == "float":
        if quantize is not None:
            raise LollmError("--quantize asks for packed weights, --weights float for float ones: give one of them")
        return Quantization("float")
    if fmt == "gguf":
        if quantize is not None:
            raise LollmError("--quantize is for float (safetensors) checkpoints; a GGUF file is quantized already "
                             "(its blocks stay packed by default; --weights float dequantizes them)")
        mode = "gguf"
    elif quantize is None:
        if weights == "quantized":
            raise LollmError("--weights quantized on a safetensors checkpoint needs --quantize int8 or int4")
        return Quantization("float")
    else:
        mode = quantize
    if device.type != "cpu":
        if weights == "auto" and quantize is None:
            return Quantization("float")  # auto: the packed kernels used here are CPU kernels
        raise LollmError(f"packed (quantized) weights run on the CPU only; on {device} use --weights float")
    return Quantization(mode, group_size)


def open_model(spec: str | Checkpoint, *, device: str = "auto", dtype: str = "auto", progress: bool = False,
               attn: str | None = None, weights: str | None = None, quantize: str | None = None,
               group_size: int = 32, family: str | None = None, tp: int = 1) -> LoadedModel:
    """Locate the checkpoint, route it to its family and build the model. Raises LollmError subclasses.

    ``spec`` may also be a :class:`Checkpoint` already opened (the CLI opens it
    first to check flags against the family and the tokenizer before the weights load).
    ``attn`` names the attention backend (``sdpa``, ``eager``, ``triton``; None: ``LOLLM_ATTN``,
    else ``sdpa``). It is checked before anything loads and kept in ``LoadedModel.attn``; the
    commands run the model inside ``lollm.attention.use_backend(loaded.attn)`` (so does
    ``generate(..., attn=loaded.attn)``). A direct ``loaded.model(ids)`` uses whatever backend
    is current: wrap it in that context manager to pick one.

    ``weights``/``quantize``/``group_size``: see :func:`pick_quantization`. The
    default here is ``"float"`` (the reference path), or ``"auto"`` when
    ``quantize`` is given; the CLI's ``run`` and ``bench`` default to ``"auto"``.
    The model's ``weights_summary`` says what was kept packed.

    ``family``: the family's name (``--family``), when several installed plugins claim the
    checkpoint's type; see :func:`route`.

    ``tp``: tensor-parallel degree (docs/tensor-parallel.md). Above 1 this process
    must be one of ``tp`` started by torchrun: it joins the process group
    (:func:`lollm.tensor_parallel.init`) and loads only its share of the weights.
    """
    if weights is None:
        weights = "auto" if quantize else "float"
    dev = pick_device(device)
    group = None
    if tp != 1:  # --tp N: join torchrun's process group; each rank computes on its own device
        from lollm.tensor_parallel import init

        group = init(tp, dev)
        dev = group.device
    backend = resolve_backend(attn, dev)
    checkpoint = spec if isinstance(spec, Checkpoint) else load_checkpoint(spec)
    installed = route(checkpoint, family)
    dt = pick_dtype(dtype, dev, checkpoint.config)
    checkpoint.weights.quantization = pick_quantization(weights, quantize, group_size, checkpoint.fmt, dev)
    checkpoint.weights.tensor_parallel = group  # read by lollm.tensor_parallel.sharding in the family's load
    load = installed.family.resolve("load")
    start = time.perf_counter()
    model = load(checkpoint.config, checkpoint.weights, checkpoint.fmt, dev, dt, progress)
    if group is not None and getattr(model, "tensor_parallel", None) is None:
        raise LollmError(f"--tp {tp}: the {installed.family.name} family declares no tensor-parallel plan (TP_PLAN); run it without --tp")
    return LoadedModel(checkpoint, installed, model, dev, dt, time.perf_counter() - start, backend, group)
