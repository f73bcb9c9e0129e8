"""From a spec to a ready model: loader ─► router ─► family.load.

This is the path every command takes (``lollm run``, ``parity``, ``bench``)
and the one-call entry point for Python users::

    from lollm.load.pipeline import open_model
    loaded = open_model("path/to/qwen2-folder")
    ids = loaded.tokenizer.encode("Hello")
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lollm.attention import resolve_backend
from lollm.errors import LollmError, PluginError
from lollm.load.loader import Checkpoint, load_checkpoint
from lollm.load.options import LoadOptions
from lollm.load.plugins import InstalledFamily, get_registry
from lollm.load.quantized import Quantization

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
    tp: Any = None  # the lollm.load.tensor_parallel.Group of this rank under --tp N, else None
    options: LoadOptions = field(default_factory=LoadOptions)  # the resolved options it was loaded with

    @property
    def tokenizer(self):
        return self.checkpoint.tokenizer


def route(checkpoint: Checkpoint, family: str | None = None) -> InstalledFamily:
    """The installed family that serves this checkpoint (see :mod:`lollm.load.plugins`).

    safetensors checkpoints are routed by config.json's ``model_type``, GGUF files
    by their ``general.architecture``. ``family`` (``--family NAME``) chooses the
    family by name when several claim the type; it must declare the type.
    """
    if checkpoint.fmt == "gguf":
        return get_registry().route(gguf_architecture=checkpoint.model_type, family=family)
    return get_registry().route(checkpoint.model_type, family=family)


def pick_quantization(options: LoadOptions, fmt: str, device: torch.device) -> Quantization:
    """The :class:`~lollm.load.quantized.Quantization` for a load, from ``options.weights`` / ``options.quantize``.

    GGUF: packed unless ``weights == "float"``; ``quantize`` is refused (the file
    is quantized already). safetensors: float unless ``quantize`` is int8 or int4;
    ``weights="quantized"`` without ``quantize`` is refused. Packed weights run
    on the CPU only (torch's packed kernels used here are CPU kernels): ``auto``
    elsewhere loads float, an explicit request is refused. Raises LollmError naming the flag.
    """
    weights, quantize = options.weights_mode, options.quantize
    if weights == "float":
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
    return Quantization(mode, options.group_size)


def join_tensor_parallel(options: LoadOptions) -> LoadOptions:
    """Under ``tp > 1``: join torchrun's process group; return the options with this rank's device and group.

    Each rank computes on its own device (:func:`lollm.load.tensor_parallel.init`).
    One process (``tp == 1``) returns the options unchanged. Raises TensorParallelError.
    """
    if options.tp == 1 or options.tensor_parallel is not None:
        return options
    from lollm.load.tensor_parallel import init

    group = init(options.tp, pick_device(options.device))
    return options.replace(device=str(group.device), tensor_parallel=group)


def resolve_options(options: LoadOptions, checkpoint: Checkpoint) -> LoadOptions:
    """``options`` with every choice core makes decided for this checkpoint: what a family's ``load`` receives.

    device: ``auto`` becomes the device :func:`pick_device` picks; dtype: ``auto``
    becomes :func:`pick_dtype`'s choice, any alias its canonical name; attn: the
    backend :func:`lollm.attention.resolve_backend` checks; quantization: from
    :func:`pick_quantization`. ``tensor_parallel`` must already be joined
    (:func:`join_tensor_parallel`) when ``tp > 1``. Raises LollmError naming the option.
    """
    device = pick_device(options.device)
    if options.tp != 1 and options.tensor_parallel is None:
        raise LollmError(f"--tp {options.tp}: join the process group first (lollm.load.pipeline.join_tensor_parallel)")
    dtype = pick_dtype(options.dtype, device, checkpoint.config)
    return options.replace(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        attn=resolve_backend(options.attn, device),
        quantization=pick_quantization(options, checkpoint.fmt, device),
    )


def check_load_signature(load: Any, installed: InstalledFamily) -> None:
    """Raise PluginError when a family's ``load`` cannot be called as ``load(checkpoint, options)`` (contract 2).

    A family that says ``contract=2`` but kept contract 1's six-argument ``load`` would
    otherwise fail with a TypeError from inside the call; this names the contract instead.
    """
    try:
        signature = inspect.signature(load)
    except (TypeError, ValueError):  # a callable without a signature: let the call decide
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise PluginError(
            f"the load of family {installed.family.name!r} ({installed.family.load}) takes {signature}, but plugin "
            f"contract 2 calls load(checkpoint, options); see docs/plugins.md, 'Moving a family to contract 2'"
        ) from None


def open_model(spec: str | Checkpoint, options: LoadOptions | None = None) -> LoadedModel:
    """Locate the checkpoint, route it to its family and build the model. Raises LollmError subclasses.

    ``spec``: a folder, a .gguf file, a Hugging Face repo id, or a :class:`Checkpoint`
    already opened (the CLI opens it first to check flags against the family and the
    tokenizer before the weights load). ``options``: a :class:`lollm.load.options.LoadOptions`
    (None: the defaults, float weights on the best device); every field is checked
    before the weights load.

    The attention backend (``options.attn``) is kept in ``LoadedModel.attn``; the
    commands run the model inside ``lollm.attention.use_backend(loaded.attn)`` (so does
    ``generate(..., attn=loaded.attn)``). A direct ``loaded.model(ids)`` uses whatever
    backend is current: wrap it in that context manager to pick one. The model's
    ``weights_summary`` says what was kept packed.

    ``options.tp`` above 1 (docs/tensor-parallel.md): this process must be one of ``tp``
    started by torchrun; it joins the process group and loads only its share of the weights.
    """
    options = join_tensor_parallel(options or LoadOptions())
    resolve_backend(options.attn, pick_device(options.device))  # a typo costs nothing: checked before the files open
    checkpoint = spec if isinstance(spec, Checkpoint) else load_checkpoint(spec)
    installed = route(checkpoint, options.family)
    options = resolve_options(options, checkpoint)
    load = installed.family.resolve("load")
    check_load_signature(load, installed)
    start = time.perf_counter()
    model = load(checkpoint, options)
    group = options.tensor_parallel
    if group is not None and getattr(model, "tensor_parallel", None) is None:
        raise LollmError(f"--tp {options.tp}: the {installed.family.name} family declares no tensor-parallel plan (TP_PLAN); run it without --tp")
    return LoadedModel(checkpoint, installed, model, options.torch_device, options.torch_dtype,
                       time.perf_counter() - start, options.attn, group, options)
