"""Streaming weight load: from a checkpoint's tensors into a model built on the meta device.

A family builds its model under ``torch.device("meta")``: every parameter
then has a shape and a dtype but no storage, so building costs no memory.
:func:`load_weights` walks the checkpoint one tensor at a time, maps the
file's name to the model's name with the family's name map, checks the
shape, converts it to the target device and dtype, and puts it in place of
the meta tensor. The source tensor is dropped before the next one is read, so
the peak stays near one copy of the model (plus the largest single tensor).

It is strict: a tensor the model has no place for, a shape that does not
match, an integer (or boolean) tensor for a floating-point parameter, and a
parameter or buffer left without a value all raise
:class:`lollm.errors.WeightsError` naming the tensor.

Quantized weights (docs/quantized-execution.md): when the load's
:class:`lollm.load.quantized.Quantization` packs (``LoadOptions.quantization``, decided
by :func:`lollm.load.pipeline.prepare` from ``--weights`` / ``--quantize``), each
tensor the family's ``quantizable(model_name)`` accepts is not converted to
float: its ``nn.Linear`` is replaced by an :class:`~lollm.load.packed_linear.Int4Linear`
or :class:`~lollm.load.packed_linear.Int8Linear`, its ``nn.Embedding`` by a
:class:`~lollm.load.packed_embedding.BlockEmbedding` or :class:`~lollm.load.packed_embedding.Int8Embedding`,
built from the file's blocks a slice of rows at a time. The model's code does
not change: the new modules are called like the ones they replace.
"""

from __future__ import annotations

import sys
from typing import Callable, Mapping

import torch
from torch import nn

from lollm.errors import WeightsError
from lollm.gguf.quants import SUPPORTED_TYPES, dequantize
# Lazy imports below: tqdm (only when a progress bar is drawn) and ctypes (glibc's malloc_trim, Linux only).
from lollm.load.packed_embedding import BlockEmbedding, Int8Embedding
from lollm.load.packed_kquants import Q8_0Linear
from lollm.load.packed_linear import Int8Linear
from lollm.load.quantized import (
    FLOAT_TYPES,
    INT4_TYPES,
    INT8_TYPES,
    Quantization,
    WeightsSummary,
    describe,
    int8_from_float_rows,
    linear_from_float,
    linear_from_gguf,
    model_bytes,
    shared_embedding,
)

#: Stored types that hold integers or booleans (safetensors' and ggml's names): never the
#: values of a floating-point parameter, whatever a converter wrote.
INTEGER_TYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not (enabled and sys.stderr.isatty()), leave=False)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:  # pragma: no cover - guarded by the caller's lookup
        raise WeightsError(f"model has no parameter or buffer {name!r}")


def _release_freed_memory() -> None:
    """Hand memory freed by the packing's temporaries back to the OS (glibc's ``malloc_trim``; elsewhere nothing).

    glibc keeps freed blocks in its heap for reuse; packing frees a few MB per
    slice, which would otherwise pile up as resident memory and raise the load's
    peak by a tenth of the model's size (measured on the real Qwen2.5 GGUF).
    """
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
        try:
            _libc = ctypes.CDLL(name) if name else False
            _libc = _libc if _libc and hasattr(_libc, "malloc_trim") else False
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None


def _replace_module(model: nn.Module, module_name: str, new: nn.Module) -> None:
    parent_name, _, child = module_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _pack(model: nn.Module, source, file_name: str, target: str, quantization: Quantization,
          dtype: torch.dtype, summary: WeightsSummary, grouped: bool) -> bool:
    """Put tensor ``file_name`` into the model packed, if its module and stored type allow; True when done.

    Returns False when the tensor should take the float path instead (a float
    GGUF type, or a GGUF type with no packed form, which is recorded in
    ``summary.dequantized``).
    """
    module_name, _, leaf = target.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf != "weight" or not isinstance(module, (nn.Linear, nn.Embedding)):
        raise WeightsError(
            f"{target!r} is marked quantizable, but it is not the weight of an nn.Linear or nn.Embedding "
            f"(its module is {type(module).__name__}); only those can stay packed"
        )
    stored = source.dtype(file_name)
    gguf = source.fmt == "gguf"
    if gguf and stored in FLOAT_TYPES or not gguf and quantization.mode not in ("int8", "int4"):
        return False
    if gguf and isinstance(module, nn.Linear) and stored not in INT4_TYPES + INT8_TYPES:
        summary.dequantized.append(f"{file_name} ({stored})")
        return False

    if isinstance(module, nn.Linear):
        if gguf:
            shape = tuple(source.shape(file_name))

            def read_rows(start: int, stop: int):  # a slice of rows at a time: no copy of the whole tensor
                return source.read_raw(file_name, start, stop)

            new = linear_from_gguf(read_rows, stored, shape, module.bias, grouped=grouped)
        else:
            new = linear_from_float(source.read(file_name), quantization, module.bias)
    elif gguf:  # an embedding keeps the file's blocks, whatever their type (if we can dequantize it)
        if stored not in SUPPORTED_TYPES:
            return False  # the float path names the type it cannot read
        rows = source.shape(file_name)[0]
        new = BlockEmbedding(torch.from_numpy(source.read_raw(file_name)).view(rows, -1), stored, module.embedding_dim, dtype)
    else:
        weight = source.read(file_name)
        new = Int8Embedding(*int8_from_float_rows(*weight.shape, lambda a, b: weight[a:b]), dtype)
    _replace_module(model, module_name, new)
    summary.add(stored, describe(new))
    _release_freed_memory()
    return True


def _tie_packed(model: nn.Module, target: str, src: str, dtype: torch.dtype, summary: WeightsSummary,
                source, src_file: str | None) -> bool:
    """Tie output head ``target`` to a packed embedding ``src``; False when ``src`` is not packed.

    An int8 head and the embedding share one int8 matrix (:func:`shared_embedding`): a Q8_0 head
    in panels with a :class:`Q8_0PanelEmbedding`, or an :class:`Int8Linear` in groups of 32
    (exact for Q8_0 and Q5_0) with an :class:`Int8Embedding`. The embedding's blocks are dropped
    first and the matrix is read again from the file (``src_file``), a slice at a time, so the
    two forms are never in memory together. A 4-bit head is packed beside the embedding's
    blocks (two copies of 4.5 bits a weight).
    """
    src_name, target_name = src.rpartition(".")[0], target.rpartition(".")[0]
    embedding = model.get_submodule(src_name)
    if not isinstance(embedding, (BlockEmbedding, Int8Embedding)):
        return False
    head = model.get_submodule(target_name)
    if isinstance(embedding, Int8Embedding):
        _replace_module(model, target_name, Int8Linear(embedding.codes, embedding.scale, head.bias))
        summary.add("tied", describe(model.get_submodule(target_name)) + " (head)")
        return True

    ggml_type, shape, out_dtype = embedding.ggml_type, (embedding.num_embeddings, embedding.embedding_dim), embedding.dtype
    if ggml_type in INT8_TYPES and src_file is not None:
        del embedding
        _replace_module(model, src_name, nn.Identity())  # frees the blocks before the int8 copy is built
        _release_freed_memory()

        def read_rows(start: int, stop: int):
            return source.read_raw(src_file, start, stop)

        new = linear_from_gguf(read_rows, ggml_type, shape, head.bias, grouped=True, tied=True)  # its codes shared
        _replace_module(model, src_name, shared_embedding(new, shape[0], out_dtype))
        summary.counts[(ggml_type, "file blocks, rows dequantized on lookup")] -= 1
        summary.add(ggml_type, describe(new) + " (embedding, shared with the head)")
    else:
        blocks = embedding.blocks.numpy().reshape(-1)
        new = linear_from_gguf(blocks, ggml_type, shape, head.bias, grouped=True, tied=True)
        if new is None:  # a type with no packed form: the head is a float copy
            head.weight = nn.Parameter(torch.from_numpy(dequantize(blocks, ggml_type)).view(shape).to(dtype), requires_grad=False)
            summary.dequantized.append(f"{target} (tied, {ggml_type})")
            summary.add(ggml_type, f"{str(dtype).removeprefix('torch.')} (tied head)")
            return True
        if isinstance(new, (Int8Linear, Q8_0Linear)):  # one int8 copy serves both
            _replace_module(model, src_name, shared_embedding(new, shape[0], out_dtype))
            summary.counts[(ggml_type, "file blocks, rows dequantized on lookup")] -= 1
            summary.add(ggml_type, describe(new) + " (embedding, shared with the head)")
    _replace_module(model, target_name, new)
    summary.add("tied", describe(new) + " (head)")
    return True


def load_weights(
    model: nn.Module,
    source,
    name_map: Callable[[str], str | None],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    progress: bool = False,
    tied: Mapping[str, str] | None = None,
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    quantizable: Callable[[str], bool] | None = None,
    quantization: Quantization | None = None,
    sharding=None,
    grouped: tuple[str, ...] = ("lm_head.weight",),
) -> nn.Module:
    """Fill ``model`` (built on the meta device) from ``source``, one tensor at a time.

    Args:
      model:     the module tree; its parameters and persistent buffers are the slots.
      source:    a :class:`lollm.load.loader.TensorSource` (``names()``, ``shape(n)``, ``read(n)``).
      name_map:  file name -> model name, or ``None`` to skip a tensor the family
                 knowingly ignores (e.g. a vision tower). The family raises for
                 names it does not know; unknown *model* names raise here.
      device, dtype: where and in which floating dtype the weights live; integer
                 and bool tensors keep their dtype (and fill only integer slots).
      progress:  show a progress bar (only when stderr is a terminal).
      tied:      ``{target: source}`` model names to share when the checkpoint has
                 no tensor for ``target`` (``lm_head.weight`` -> ``model.embed_tokens.weight``).
      transform: optional ``(model_name, tensor) -> tensor`` applied after reading and
                 before the shape check (a converter quirk the family undoes). It is
                 not applied to packed tensors: a family never marks a tensor it
                 transforms as quantizable.
      quantizable: ``model_name -> bool``, the family's choice of the tensors that may
                 stay packed (weights of ``nn.Linear`` and ``nn.Embedding`` modules).
      quantization: the load's :class:`~lollm.load.quantized.Quantization` (``LoadOptions.quantization``);
                 None or ``"float"``: nothing stays packed. See the module docstring.
      sharding:  the :class:`lollm.load.tensor_parallel.Sharding` the model was built with under
                 ``--tp`` (docs/tensor-parallel.md): each split tensor is read as this rank's
                 slice only. None on one process.
      grouped:   model names whose 5- to 8-bit GGUF matrices keep a scale per group of 32
                 (exact for Q8_0 and Q5_0, one kernel call per group) instead of being
                 requantized per row: the output head, by far the most sensitive matrix
                 (docs/measurements.md gives the figure).

    The model gets a ``weights_summary`` attribute (:class:`lollm.load.quantized.WeightsSummary`):
    per stored type, how the tensors were kept.

    Raises WeightsError naming the tensor for an unexpected name, a shape
    mismatch, an integer or boolean tensor for a floating-point slot, a name
    given twice, or a slot left empty (meta) at the end.
    """
    quantization = quantization or Quantization()
    load = _Load(model, source, device, dtype, transform, sharding, WeightsSummary(requested=quantization.mode),
                 quantization if quantization.packs and quantizable is not None else None, quantizable, grouped)
    names = source.names()
    with _progress(len(names), progress, "loading weights") as bar:
        for file_name in names:
            target = name_map(file_name)
            bar.update(1)
            if target is not None:
                load.put(file_name, target)
    for target, src in (tied or {}).items():
        load.tie(target, src)
    _check_complete(model)
    load.summary.model_bytes = model_bytes(model)
    model.weights_summary = load.summary
    return model


class _Load:
    """The state of one :func:`load_weights` call: the slots, what is filled, what stayed packed."""

    def __init__(self, model, source, device, dtype, transform, sharding, summary, packing, quantizable, grouped):
        self.model, self.source, self.device, self.dtype = model, source, device, dtype
        self.transform, self.sharding, self.summary = transform, sharding, summary
        self.packing, self.quantizable, self.grouped = packing, quantizable, grouped
        self.slots: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self.slots.update(dict(model.named_buffers(remove_duplicate=False)))
        self.filled: set[str] = set()
        self.packed_from: dict[str, str] = {}  # model name -> file name of the packed tensors

    def _stored(self, file_name: str) -> str | None:
        return self.source.dtype(file_name) if hasattr(self.source, "dtype") else None

    def _check_shape(self, file_name: str, shape, target: str) -> None:
        expected = tuple(self.slots[target].shape)
        if tuple(shape) != expected:
            raise WeightsError(f"tensor {file_name!r} has shape {tuple(shape)}, but the model expects {expected} "
                               f"for {target!r} (does config.json match the weights?)")

    def put(self, file_name: str, target: str) -> None:
        """Read tensor ``file_name`` and put it in slot ``target``: packed when allowed, else float."""
        if target not in self.slots:
            raise WeightsError(f"unexpected tensor {file_name!r} in the checkpoint: the model has no slot {target!r}")
        if target in self.filled:
            raise WeightsError(f"tensor {file_name!r} fills {target!r}, which another tensor already filled")
        # a float parameter takes only a floating-point tensor (GGUF's quantized types are
        # floats; its I8..I64 types, like safetensors' I32, are not)
        needs_float = self.slots[target].is_floating_point()
        if needs_float and self._stored(file_name) in INTEGER_TYPES:
            raise WeightsError(f"tensor {file_name!r} is stored as {self._stored(file_name)}, an integer type, "
                               f"but {target!r} is a floating-point parameter")
        if self.packing is not None and self.quantizable(target):
            self._check_shape(file_name, self.source.shape(file_name), target)
            if _pack(self.model, self.source, file_name, target, self.packing, self.dtype, self.summary, target in self.grouped):
                self.filled.add(target)
                self.packed_from[target] = file_name
                return
        if self.sharding is not None:  # --tp: only this rank's slice (transform already applied)
            tensor = self.sharding.read(self.source, file_name, target, self.transform)
        else:
            tensor = self.source.read(file_name)
        if needs_float and not tensor.is_floating_point():
            raise WeightsError(f"tensor {file_name!r} holds {tensor.dtype}, an integer type, but {target!r} is a floating-point parameter")
        if self.transform is not None and self.sharding is None:
            tensor = self.transform(target, tensor)
        self._check_shape(file_name, tensor.shape, target)
        target_dtype = self.dtype if tensor.is_floating_point() else tensor.dtype
        value = tensor.to(device=self.device, dtype=target_dtype)
        del tensor  # drop the file copy before reading the next one
        _set_tensor(self.model, target, value)
        self.filled.add(target)
        self.summary.add(self._stored(file_name) or str(value.dtype).removeprefix("torch."), str(target_dtype).removeprefix("torch."))

    def tie(self, target: str, src: str) -> None:
        """Share ``src`` as ``target`` when the checkpoint had no ``target`` tensor."""
        for name in (target, src):
            if name not in self.slots or not isinstance(self.slots[name], nn.Parameter):
                raise WeightsError(f"tied {target!r} -> {src!r}: the model has no parameter {name!r}")
        if target in self.filled or src not in self.filled:
            return
        self.filled.add(target)
        if _tie_packed(self.model, target, src, self.dtype, self.summary, self.source, self.packed_from.get(src)):
            return
        module_name, _, leaf = target.rpartition(".")
        module = self.model.get_submodule(module_name) if module_name else self.model
        src_module_name, _, src_leaf = src.rpartition(".")
        src_module = self.model.get_submodule(src_module_name) if src_module_name else self.model
        module._parameters[leaf] = src_module._parameters[src_leaf]


def _check_complete(model: nn.Module) -> None:
    """Raise WeightsError naming the parameters and buffers still on the meta device (no tensor filled them)."""
    missing = [n for n, t in model.named_parameters(remove_duplicate=False) if t.is_meta]
    missing += [n for n, t in model.named_buffers(remove_duplicate=False) if t.is_meta]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise WeightsError(f"the checkpoint has no tensor for {shown}{more}")
