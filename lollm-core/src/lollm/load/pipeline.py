"""From a spec to a ready model: loader ─► router ─► family.load.

This is the path every command takes (``lollm run``, ``parity``, ``bench``)
and the one-call entry point for Python users::

    from lollm.load.pipeline import open_model
    loaded = open_model("path/to/qwen2-folder")
    ids = loaded.tokenizer.encode("Hello")
"""

from __future__ import annotations

import inspect
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from lollm.attention import resolve_backend
from lollm.errors import LollmError, PluginError
from lollm.load.loader import Checkpoint, load_checkpoint
from lollm.load.options import DTYPE_ALIASES, DTYPE_NAMES, LoadOptions
from lollm.load.plugins import get_registry
from lollm.load.registry import InstalledFamily
from lollm.load.quantized import Quantization
from lollm.load import process_group
from lollm.load.threads import apply_threads
from lollm.tokenizer import Tokenizer


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of :data:`lollm.load.options.DTYPE_NAMES` (``bf16`` is ``torch.bfloat16``)."""
    return getattr(torch, DTYPE_ALIASES.get(name, name))


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
        return torch_dtype(str(stored)) if str(stored) in DTYPE_NAMES else torch.float32
    if name not in DTYPE_NAMES:
        raise LollmError(f"unknown dtype {name!r} (use auto, {', '.join(sorted(DTYPE_NAMES))})")
    return torch_dtype(name)


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
    tp: Any = None  # the lollm.load.process_group.Group of this rank under --tp N, else None
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


def join_tensor_parallel(options: LoadOptions, *, timeout: float | None = None) -> LoadOptions:
    """Under ``tp > 1``: join torchrun's process group; return the options with this rank's device and group.

    Each rank computes on its own device (:func:`lollm.load.process_group.init`; ``timeout``: seconds a
    collective may wait, None for its default). One process (``tp == 1``) returns the options unchanged.
    Raises TensorParallelError.
    """
    if options.tp == 1 or options.tensor_parallel is not None:
        return options
    group = process_group.init(options.tp, pick_device(options.device), timeout=timeout)
    return options.replace(device=str(group.device), tensor_parallel=group)


@dataclass(frozen=True)
class Prepared:
    """A checkpoint opened, and every choice core makes for it decided once, before the weights load.

    checkpoint:     configs, tokenizer and tensor table (:class:`lollm.load.loader.Checkpoint`).
    options:        the resolved :class:`LoadOptions`: a concrete ``device`` and ``dtype``, the attention
                    backend ``attn``, the ``quantization``, the routed ``family``'s name, and this rank's
                    ``tensor_parallel`` group under ``--tp``; :func:`open_model` takes them as they are.
    family:         the installed family that serves the checkpoint (routed once).
    template_flags: the chat template's keywords for ``think`` (``{}`` or ``{"enable_thinking": bool}``).
    """

    checkpoint: Checkpoint
    options: LoadOptions
    family: InstalledFamily
    template_flags: dict[str, bool] = field(default_factory=dict)

    def __iter__(self) -> Iterator[object]:
        """``checkpoint, family, template_flags = open_checkpoint(...)``: the 3-tuple it returned before 0.2 (until 0.3)."""
        return iter((self.checkpoint, self.family.family, self.template_flags))


def prepare(spec: str | Checkpoint, options: LoadOptions | None = None, *, think: bool | None = None,
            tp_timeout: float | None = None) -> Prepared:
    """Open the checkpoint and decide, each exactly once, every choice of the load: the path of every command.

    In order: the device (:func:`pick_device`), under ``tp > 1`` this rank's process group (its device;
    ``tp_timeout``: seconds a collective may wait), the attention backend on that device
    (:func:`lollm.attention.resolve_backend`, before the files open: a typo costs nothing), the checkpoint
    (``spec``: a folder, a .gguf file, a repo id, or a :class:`Checkpoint` already open), its family
    (:func:`route`, by ``options.family`` when given), the dtype (:func:`pick_dtype`), the packed weights
    (:func:`pick_quantization`) and the chat template's ``think`` flag (:func:`template_flags`).
    Raises LollmError subclasses naming the flag or the file.
    """
    options = options or LoadOptions()
    device = pick_device(options.device)
    group = options.tensor_parallel
    if options.tp != 1 and group is None:
        group = process_group.init(options.tp, device, timeout=tp_timeout)
        device = group.device
    attn = resolve_backend(options.attn, device)
    checkpoint = spec if isinstance(spec, Checkpoint) else load_checkpoint(spec)
    installed = route(checkpoint, options.family)
    resolved = options.replace(
        device=str(device), dtype=str(pick_dtype(options.dtype, device, checkpoint.config)).removeprefix("torch."),
        attn=attn, quantization=pick_quantization(options, checkpoint.fmt, device),
        family=installed.family.name, tensor_parallel=group,
    )
    model = spec if isinstance(spec, str) else str(checkpoint.path)
    flags = {} if think is None else template_flags(checkpoint.tokenizer, think, model)  # the tokenizer read only then
    return Prepared(checkpoint, resolved, installed, flags)


def open_checkpoint(model: str | Checkpoint, options: LoadOptions | None = None, *, threads: int | None = None,
                    think: bool | None = None, mtp: bool = False, note: Callable[[str], None] | None = None,
                    tp_timeout: float | None = None) -> Prepared:
    """Step 2 of ``lollm run``, ``chat``, ``serve`` and of :class:`lollm.engine.llm.LLM`: the checkpoint, its family
    and every choice of the load (:func:`prepare`), with the checks that need them, before the weights load.

    First sets torch's thread count (``threads``, else the cores free now: :mod:`lollm.load.threads`); when
    the machine is busy, its one-line advice goes to ``note`` (None: stderr, on a terminal only). ``mtp``: the
    family must have a speculative (MTP) head. Returns the :class:`Prepared` record (it still unpacks as
    ``checkpoint, family, template_flags``). Raises LollmError naming the flag.
    """
    advice = apply_threads(threads).note
    if advice is not None and sys.stderr.isatty():  # advice for a person at a terminal, not a line in a log or a pipe
        (note or (lambda line: print(line, file=sys.stderr)))(advice)
    prepared = prepare(model, options, think=think, tp_timeout=tp_timeout)
    if mtp and not prepared.family.family.capabilities.speculative_head:
        raise LollmError(f"--mtp: the family {prepared.family.family.name!r} has no speculative (MTP) head")
    return prepared


def template_flags(tokenizer: Tokenizer, think: bool | None, model: str) -> dict[str, bool]:
    """The chat template's keyword for ``--think`` / ``--no-think``: ``{}`` or ``{"enable_thinking": think}``.

    Decided from the chat template itself: a template that does not read ``enable_thinking`` cannot be
    switched, and asking for it is a LollmError naming ``model`` (the spec as the user gave it). The one
    place this is decided: :func:`prepare` for ``run``, ``chat``, ``serve`` and ``LLM``, and directly
    ``tokenize --chat`` (a tokenizer without a model) and ``trace`` (:func:`lollm.cli.trace.run.prompt_ids`).
    """
    if think is None:
        return {}
    if not tokenizer.chat_template_reads("enable_thinking"):
        raise LollmError(
            f"--think/--no-think: the chat template of {model} does not read enable_thinking, so thinking cannot be switched"
        )
    return {"enable_thinking": think}


def taken_as_they_are(options: LoadOptions | None) -> bool:
    """Whether ``options`` were resolved by :func:`prepare` (every choice made): :func:`open_model` decides nothing again."""
    return (options is not None and options.resolved and options.attn is not None and options.family is not None
            and (options.tp == 1 or options.tensor_parallel is not None))


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
    already opened. ``options``: a :class:`lollm.load.options.LoadOptions` (None: the defaults,
    float weights on the best device). Options resolved by :func:`prepare` with the checkpoint
    it opened (what the CLI does, to check its flags against the family and the tokenizer
    before the weights load) are taken as they are; any others are decided here, once
    (:func:`prepare`), before the weights load.

    The attention backend (``options.attn``) is kept in ``LoadedModel.attn``; the
    commands run the model inside ``lollm.attention.use_backend(loaded.attn)`` (so does
    ``generate(..., attn=loaded.attn)``). A direct ``loaded.model(ids)`` uses whatever
    backend is current: wrap it in that context manager to pick one. The model's
    ``weights_summary`` says what was kept packed.

    ``options.tp`` above 1 (docs/tensor-parallel.md): this process must be one of ``tp``
    started by torchrun; it joins the process group and loads only its share of the weights.
    """
    if isinstance(spec, Checkpoint) and taken_as_they_are(options):
        checkpoint, installed = spec, get_registry().family_named(options.family)
    else:
        prepared = prepare(spec, options)
        checkpoint, options, installed = prepared.checkpoint, prepared.options, prepared.family
    load = installed.family.resolve("load")
    check_load_signature(load, installed)
    start = time.perf_counter()
    model = load(checkpoint, options)
    group = options.tensor_parallel
    if group is not None and getattr(model, "tensor_parallel", None) is None:
        raise LollmError(f"--tp {options.tp}: the {installed.family.name} family declares no tensor-parallel plan (TP_PLAN); run it without --tp")
    return LoadedModel(checkpoint, installed, model, options.torch_device, options.torch_dtype,
                       time.perf_counter() - start, options.attn, group, options)
