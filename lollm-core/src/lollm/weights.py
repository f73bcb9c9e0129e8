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
"""

from __future__ import annotations

import sys
from typing import Callable, Mapping

import torch
from torch import nn

from lollm.errors import WeightsError

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
) -> nn.Module:
    """Fill ``model`` (built on the meta device) from ``source``, one tensor at a time.

    Args:
      model:     the module tree; its parameters and persistent buffers are the slots.
      source:    a :class:`lollm.loader.TensorSource` (``names()``, ``shape(n)``, ``read(n)``).
      name_map:  file name -> model name, or ``None`` to skip a tensor the family
                 knowingly ignores (e.g. a vision tower). The family raises for
                 names it does not know; unknown *model* names raise here.
      device, dtype: where and in which floating dtype the weights live; integer
                 and bool tensors keep their dtype (and fill only integer slots).
      progress:  show a progress bar (only when stderr is a terminal).
      tied:      ``{target: source}`` model names to share when the checkpoint has
                 no tensor for ``target`` (``lm_head.weight`` -> ``model.embed_tokens.weight``).
      transform: optional ``(model_name, tensor) -> tensor`` applied after reading and
                 before the shape check (a converter quirk the family undoes).

    Raises WeightsError naming the tensor for an unexpected name, a shape
    mismatch, an integer or boolean tensor for a floating-point slot, a name
    given twice, or a slot left empty (meta) at the end.
    """
    slots: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    slots.update(dict(model.named_buffers(remove_duplicate=False)))
    filled: set[str] = set()
    names = source.names()
    with _progress(len(names), progress, "loading weights") as bar:
        for file_name in names:
            target = name_map(file_name)
            bar.update(1)
            if target is None:
                continue
            if target not in slots:
                raise WeightsError(
                    f"unexpected tensor {file_name!r} in the checkpoint: the model has no slot {target!r}"
                )
            if target in filled:
                raise WeightsError(f"tensor {file_name!r} fills {target!r}, which another tensor already filled")
            # the dtype each slot needs: a float parameter takes only a floating-point tensor
            # (GGUF's quantized types are floats; its I8..I64 types, like safetensors' I32, are not)
            needs_float = slots[target].is_floating_point()
            stored = source.dtype(file_name) if hasattr(source, "dtype") else None
            if needs_float and stored in INTEGER_TYPES:
                raise WeightsError(f"tensor {file_name!r} is stored as {stored}, an integer type, but {target!r} is a floating-point parameter")
            tensor = source.read(file_name)
            if needs_float and not tensor.is_floating_point():
                raise WeightsError(f"tensor {file_name!r} holds {tensor.dtype}, an integer type, but {target!r} is a floating-point parameter")
            if transform is not None:
                tensor = transform(target, tensor)
            expected = tuple(slots[target].shape)
            if tuple(tensor.shape) != expected:
                raise WeightsError(
                    f"tensor {file_name!r} has shape {tuple(tensor.shape)}, but the model expects {expected} "
                    f"for {target!r} (does config.json match the weights?)"
                )
            target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            value = tensor.to(device=device, dtype=target_dtype)
            del tensor  # drop the file copy before reading the next one
            _set_tensor(model, target, value)
            filled.add(target)

    for target, src in (tied or {}).items():
        for name in (target, src):
            if name not in dict(model.named_parameters(remove_duplicate=False)):
                raise WeightsError(f"tied {target!r} -> {src!r}: the model has no parameter {name!r}")
        if target not in filled and src in filled:
            module_name, _, leaf = target.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            src_module_name, _, src_leaf = src.rpartition(".")
            src_module = model.get_submodule(src_module_name) if src_module_name else model
            module._parameters[leaf] = src_module._parameters[src_leaf]
            filled.add(target)

    missing = [n for n, t in model.named_parameters(remove_duplicate=False) if t.is_meta]
    missing += [n for n, t in model.named_buffers(remove_duplicate=False) if t.is_meta]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise WeightsError(f"the checkpoint has no tensor for {shown}{more}")
    return model
