"""What is inside a checkpoint: its metadata and its tensor table, without any model code.

``lollm inspect MODEL`` works the same for a GGUF file and a safetensors
checkpoint, so a learner can compare the two: which tensors exist, their
shapes, how each is stored (``F32``, ``BF16``, ``Q4_K`` …), how many bytes it
takes, and the totals per storage type. Long metadata arrays (a 150,000-entry
vocabulary) are summarized, not printed.

It reads the files the way loading does (:func:`lollm.load.loader.load_folder`, the GGUF
reader) but builds no model, so it lives with the command that prints it (``lollm inspect``,
and ``lollm list`` for the quantization of each model).
"""

from __future__ import annotations

import re
from collections import Counter
from fnmatch import fnmatchcase
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from lollm.errors import CheckpointError, LollmError

# Lazy imports below: numpy, the GGUF reader and the loader, only for the checkpoint being inspected,
# so that the CLI's start-up stays light.

#: Bytes per element of the safetensors dtypes.
SAFETENSORS_ELEMENT_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}


@dataclass
class TensorRow:
    name: str
    shape: tuple[int, ...]
    type: str  # storage type: safetensors dtype or ggml type name
    nbytes: int


class Summary(TypedDict):
    """:meth:`Inventory.summary`: the checkpoint at a glance (the first table of ``lollm inspect``)."""

    format: str  # "gguf" or "safetensors"
    architecture: str | None  # general.architecture, or config.json's model_type
    tensors: int
    parameters: int  # elements, over every tensor
    bytes: int
    types: dict[str, int]  # storage type -> number of tensors, most bytes first


@dataclass
class Inventory:
    """Metadata and tensor table of one checkpoint."""

    path: Path
    fmt: str
    metadata: dict[str, object] = field(default_factory=dict)  # GGUF key/values, or config.json
    tensors: list[TensorRow] = field(default_factory=list)

    def totals(self) -> dict[str, tuple[int, int]]:
        """Storage type -> (number of tensors, bytes)."""
        count: Counter[str] = Counter()
        size: Counter[str] = Counter()
        for t in self.tensors:
            count[t.type] += 1
            size[t.type] += t.nbytes
        return {k: (count[k], size[k]) for k in sorted(count, key=lambda k: -size[k])}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def summary(self) -> Summary:
        """The checkpoint at a glance: format, architecture, tensor count, parameters (elements), bytes, tensors per type.

        The architecture is GGUF's ``general.architecture``, or config.json's
        ``model_type`` (None when the file names none); types are ordered as
        :meth:`totals` (most bytes first).
        """
        key = "general.architecture" if self.fmt == "gguf" else "model_type"
        architecture = self.metadata.get(key)
        parameters = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            parameters += n
        return {"format": self.fmt, "architecture": architecture if isinstance(architecture, str) else None,
                "tensors": len(self.tensors), "parameters": parameters, "bytes": self.total_bytes,
                "types": {k: n for k, (n, _) in self.totals().items()}}

    def select(self, pattern: str | None) -> list[TensorRow]:
        """The tensors whose name matches ``pattern``, in natural order (``blk.2`` before ``blk.10``).

        ``pattern`` is a shell glob matched against the whole name (case-sensitive,
        as :func:`fnmatch.fnmatchcase`) when it holds ``*``, ``?`` or ``[``, else a
        substring of the name; None selects every tensor. Raises LollmError naming
        the pattern when it matches no tensor (or is empty).
        """
        rows = sorted(self.tensors, key=lambda t: natural_key(t.name))
        if pattern is None:
            return rows
        if not pattern:
            raise LollmError("--filter is empty: give a substring of tensor names (attn_q) or a glob (blk.1.*)")
        glob = any(c in pattern for c in "*?[")
        chosen = [t for t in rows if (fnmatchcase(t.name, pattern) if glob else pattern in t.name)]
        if not chosen:
            how = "the glob" if glob else "the substring"
            raise LollmError(f"--filter {pattern!r}: {how} matches none of the {len(rows)} tensors of {self.path}"
                             + ("" if glob else " (a glob such as 'blk.1.*' must match the whole name)"))
        return chosen


def natural_key(name: str) -> list[str | int]:
    """A sort key that orders the numbers inside a name by value: ``blk.2.x`` before ``blk.10.x``.

    The name is split into text and runs of digits (``["blk.", 10, ".x"]``); text
    sits at even positions and numbers at odd ones, so two keys always compare.
    """
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


def summarize(value: object, max_items: int = 8, max_chars: int = 120) -> str:
    """A one-line view of a metadata value; long arrays and strings are cut with their length shown."""
    try:
        import numpy as np

        if isinstance(value, np.ndarray):
            value = value.tolist()
    except ImportError:  # pragma: no cover
        pass
    from lollm.gguf.metadata import StringArray

    if isinstance(value, (list, tuple, StringArray)):
        if len(value) > max_items:
            head = ", ".join(summarize(v, 3, 40) for v in value[:max_items])
            return f"[{head}, …] ({len(value)} items)"
        return "[" + ", ".join(summarize(v, 3, 40) for v in value) + "]"
    if isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {summarize(v, 3, 40)}" for k, v in value.items()) + "}"
    else:
        text = repr(value)
    if len(text) > max_chars:
        return text[: max_chars - 1] + f"… ({len(text)} chars)"
    return text


def _inspect_gguf(path: Path) -> Inventory:
    from lollm.gguf import GGUFFile

    gguf = GGUFFile(path)
    inv = Inventory(path, "gguf", metadata={"GGUF.version": gguf.version, **gguf.metadata})
    for name, info in gguf.tensors.items():
        inv.tensors.append(TensorRow(name, tuple(info.shape), info.ggml_type, info.nbytes))
    return inv


def _inspect_folder(folder: Path) -> Inventory:
    from lollm.load.loader import load_folder

    checkpoint = load_folder(folder)
    inv = Inventory(folder, "safetensors", metadata=dict(checkpoint.config))
    source = checkpoint.weights
    for name in source.names():
        n = 1
        for d in source.shape(name):
            n *= d
        dtype = source.dtype(name)
        inv.tensors.append(TensorRow(name, source.shape(name), dtype, n * SAFETENSORS_ELEMENT_BYTES.get(dtype, 0)))
    return inv


def inspect_checkpoint(spec: str) -> Inventory:
    """The metadata and tensor table of a ``.gguf`` file or a safetensors checkpoint folder (a path, or a local name).

    Raises CheckpointError (GGUFError for a bad GGUF) naming the path.
    """
    from lollm.load.local_names import locate

    path = locate(spec) or Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _inspect_gguf(path)
    if path.is_file() and path.suffix == ".safetensors":
        path = path.parent
    if path.is_dir():
        return _inspect_folder(path)
    if not path.exists():
        raise CheckpointError(f"{spec}: no such file or folder")
    raise CheckpointError(f"{spec}: not a .gguf file or a checkpoint folder")
