"""Whether a cache fits: its size, measured without allocating it, against the device's free memory.

The generate loop preallocates the family's cache for every position it may
need: ``min(prompt + max_new_tokens, max_context)``. A checkpoint may declare
a huge context and a user may ask for many tokens, so before allocating the
loop asks :func:`check_cache_fits`. The rule:

1. Build the cache the family would build, but on the *meta* device (every
   tensor has its shape and dtype and no storage): while ``new_cache`` runs,
   the mode :class:`_AllocateOnMeta` sends every tensor constructor (``torch.zeros``,
   ``torch.empty``, ...) to the meta device, whatever device the family asks
   for. Then add up the bytes of the tensors the cache holds. This is exact for
   any family (sliding-window layers that keep fewer positions included) and
   costs no memory. (PyTorch's ``FakeTensorMode`` would do the same, but it
   imports ``torch._dynamo``: 150 MB of resident memory for one sum.)
2. Compare with the memory free on the model's device: CUDA's
   ``mem_get_info``; on the CPU (and Apple's unified memory) Linux's
   ``MemAvailable``, lowered to a cgroup v2 limit when the process runs under
   one, else the physical memory.
3. More than that is a :class:`lollm.errors.GenerationError` that says how
   much was asked and how much is free, before anything is allocated.

When either number cannot be told (a cache that cannot be built from fake
tensors, a device whose free memory is unknown), the check is skipped and the
allocation itself decides.
"""

from __future__ import annotations

import os

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors  # torch.device(...)'s own list

from lollm.errors import GenerationError
from lollm.model import CausalLM


def tensor_bytes(obj: object, depth: int = 4) -> int:
    """Bytes of the tensors ``obj`` holds: in its attributes, lists, tuples and dicts, ``depth`` levels down.

    Each tensor counts once (``numel * element_size``, whatever its device, meta included),
    however many times it is reached.
    """
    seen: set[int] = set()

    def walk(item: object, level: int) -> int:
        if isinstance(item, torch.Tensor):
            if id(item) in seen:
                return 0
            seen.add(id(item))
            return item.numel() * item.element_size()
        if level == 0 or isinstance(item, (str, bytes, int, float, bool, type(None))):
            return 0
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = list(item)
        elif hasattr(item, "__dict__"):
            children = list(vars(item).values())
        else:
            return 0
        return sum(walk(child, level - 1) for child in children)

    return walk(obj, depth)


# torch.zeros_like(t) of a meta tensor runs through torch's Python reference ops, which import
# sympy (40 MB); the plain constructor of the same shape and dtype does not.
_LIKE = {torch.zeros_like: torch.zeros, torch.ones_like: torch.ones, torch.empty_like: torch.empty}


class _AllocateOnMeta(TorchFunctionMode):
    """Inside ``with _AllocateOnMeta():`` every tensor constructor puts its tensor on the meta device."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _LIKE and isinstance(args[0], torch.Tensor) and not kwargs.get("memory_format"):
            source = args[0]
            return _LIKE[func](source.shape, dtype=kwargs.get("dtype") or source.dtype, device="meta")
        if func in _device_constructors():
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def cache_bytes(model: CausalLM, positions: int) -> int | None:
    """Bytes ``model.new_cache(positions)`` would allocate, measured on meta tensors (None: cannot tell)."""
    try:
        with _AllocateOnMeta():
            return tensor_bytes(model.new_cache(positions))
    except Exception:  # a cache that cannot be built on the meta device: let the allocation decide
        return None


def free_memory(device: torch.device | str) -> int | None:
    """Bytes free for new tensors on ``device`` (a torch.device or its name); None when it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type not in ("cpu", "mps"):
        return None
    free = None
    try:
        with open("/proc/meminfo") as f:
            free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError):
        pass
    try:  # a container's cgroup v2 limit
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                left = int(limit) - int(g.read())
                free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    if free is None:
        try:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None
    return free


def _size(n: int) -> str:
    """``n`` bytes for a reader: ``"1.5 GiB"``, ``"96.0 MiB"``, ``"512 bytes"``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def check_cache_fits(model: CausalLM, positions: int) -> None:
    """GenerationError when a cache for ``positions`` needs more memory than the model's device has free.

    The device is that of the model's first parameter (a family's model is an ``nn.Module``).
    Nothing is checked when either number cannot be told (see the module's docstring).
    """
    need = cache_bytes(model, positions)
    if need is None:
        return
    device = next(model.parameters()).device
    free = free_memory(device)
    if free is not None and need > free:
        raise GenerationError(
            f"a cache for {positions:,} positions (the prompt plus the new tokens, at most the model's context of "
            f"{model.max_context:,}) needs {_size(need)}, but only {_size(free)} are free on "
            f"{device}; ask for fewer new tokens (--max-new-tokens) or give a shorter prompt"
        )
