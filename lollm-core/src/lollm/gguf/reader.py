"""Read a GGUF file: header, metadata, tensor table, and tensor bytes through a memory map.

The layout (all integers little-endian; docs/gguf.md draws it)::

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count   x  (key: string, value_type: u32, value)
    tensor_count x (name: string, n_dims: u32, ne[n_dims]: u64, ggml_type: u32, offset: u64)
    padding up to a multiple of the alignment
    tensor data: each tensor at data_start + offset

    string = length u64 + that many UTF-8 bytes (no terminating zero)

Nothing in the file is trusted before it is checked. Every count and length
is compared with the bytes actually left in the file *before* anything is
allocated or read, so a truncated or corrupted file fails fast, with a small
and bounded amount of memory, and with a :class:`~lollm.errors.GGUFError`
whose message names the file and the field or tensor at fault.

Decisions this reader makes (see docs/gguf.md):

* versions 2 and 3 are read; version 1 (2023, 32-bit counts) and versions
  from the future are refused, and so are big-endian files;
* a tensor whose type *id* ggml does not know fails at open: without its
  block size we cannot even check that it lies inside the file. A type ggml
  knows but lollm cannot dequantize (IQ2_XXS, Q8_K, …) opens fine, ``raw()``
  works, and only ``dequantize()`` of that tensor raises;
* tensors must lie inside the file, start at a multiple of the alignment and
  not overlap one another;
* numeric arrays in the metadata of more than :data:`lollm.gguf.metadata.BIG_ARRAY_LEN` elements
  (token types, scores) come back as numpy arrays, string arrays that long
  (tokens, merges) as a :class:`StringArray` that decodes them from the file
  when used (every string is checked when the file opens), smaller ones and
  nested arrays as Python lists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lollm.errors import GGUFError
from lollm.gguf.metadata import HeaderParser
# Moved to lollm.gguf.metadata; still importable from here until lollm-core 0.3 (docs/plugins.md, 10).
from lollm.gguf.metadata import StringArray  # noqa: F401
from lollm.gguf.quants import GGML_TYPES, GGML_TYPES_BY_NAME, GGMLType
from lollm.gguf.quants import dequantize as _dequantize

# Lazy imports below: torch (only to hand a tensor over; the reader itself is numpy) and mmap.
if TYPE_CHECKING:  # pragma: no cover
    import torch

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
INT64_MAX = 2**63 - 1
_HEADER_BYTES = 4 + 4 + 8 + 8


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table.

    Fields:
      name:      the tensor's name as the file spells it (``blk.0.attn_q.weight``).
      shape:     the shape in PyTorch order, i.e. ggml's ``ne`` reversed: a
                 ``[out_features, in_features]`` weight is stored with ``ne = [in, out]``.
      ggml_type: the ggml type name (``"Q4_K"``, ``"F32"`` …).
      offset:    absolute byte offset of the tensor's data in the file.
      nbytes:    bytes the tensor takes in the file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    offset: int
    nbytes: int

    @property
    def ne(self) -> tuple[int, ...]:
        """The dimensions in ggml order (fastest-varying first), as written in the file."""
        return tuple(reversed(self.shape))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def type_info(self) -> GGMLType:
        return GGML_TYPES_BY_NAME[self.ggml_type]


class GGUFFile:
    """An open GGUF file: its metadata, its tensor table, and its tensors through a read-only memory map.

    Attributes:
      path:           the file.
      version:        2 or 3.
      metadata:       key -> Python value (int, float, bool, str, list; numpy array
                      for numeric arrays of more than BIG_ARRAY_LEN elements, and a
                      :class:`StringArray`, read from the file when used, for string
                      arrays that long), in file order.
      metadata_types: key -> GGUF value type name (``"uint32"``, ``"array[string]"`` …), for
                      callers that must refuse a key written with an unexpected type.
      tensors:        name -> :class:`GGUFTensorInfo`, in file order.
      alignment:      ``general.alignment`` or 32.
      data_offset:    where the tensor data section starts.

    Opening reads and checks the whole header (all of it is validated before
    this constructor returns) but no tensor data. Raises GGUFError.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._map: np.memmap | None = None
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot read: {exc}") from None
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: not a file")
        if size < _HEADER_BYTES:
            head = self.path.read_bytes()[:4]
            if head and not GGUF_MAGIC.startswith(head):
                raise GGUFError(f"{self.path}: not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r})")
            raise GGUFError(f"{self.path}: truncated file: {size} bytes, shorter than the {_HEADER_BYTES}-byte GGUF header")
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise GGUFError(f"{self.path}: cannot map the file: {exc}") from None
        self.file_size = size
        # a memoryview slices fastest; it is not released explicitly, so that an
        # error raised mid-parse (with arrays still viewing it) stays a GGUFError
        self._parse(HeaderParser(memoryview(self._map), self.path))

    # -- parsing -------------------------------------------------------------

    def _parse(self, p: HeaderParser) -> None:
        magic = bytes(p.buf[0:4])
        if magic != GGUF_MAGIC:
            raise p.fail(f"not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
        p.pos = 4
        version = p.u32("the version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if version & 0xFFFF == 0 and swapped in SUPPORTED_VERSIONS:
                raise p.fail(f"a big-endian GGUF file (version {swapped}); lollm reads little-endian files only")
            if version == 1:
                raise p.fail("GGUF version 1 (the 2023 format with 32-bit counts) is not supported; "
                             "re-convert the model with a current llama.cpp")
            raise p.fail(f"GGUF version {version} is not supported (lollm reads versions 2 and 3)")
        self.version = version
        n_tensors = p.u64("the tensor count")
        n_kv = p.u64("the metadata key count")
        # the smallest key-value pair is 13 bytes (empty key, type, one byte), the smallest tensor info 24
        if n_kv * 13 > p.left:
            raise p.fail(f"the header claims {n_kv} metadata keys, more than the {p.left} bytes left can hold")
        if n_tensors * 24 > p.left:
            raise p.fail(f"the header claims {n_tensors} tensors, more than the {p.left} bytes left can hold")

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, str] = {}
        for i in range(n_kv):
            key = p.string(f"metadata key {i}")
            if key in self.metadata:
                raise p.fail(f"metadata key {key!r} appears twice")
            type_id = p.u32(f"the value type of {key!r}")
            self.metadata[key], self.metadata_types[key] = p.value(type_id, key)

        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            if self.metadata_types["general.alignment"] != "uint32":
                raise p.fail(f"general.alignment must be a uint32, found a {self.metadata_types['general.alignment']}")
            a = self.metadata["general.alignment"]
            if a == 0 or a & (a - 1):
                raise p.fail(f"general.alignment is {a}, not a power of two")
            self.alignment = a

        infos = [self._tensor_info(p, i) for i in range(n_tensors)]
        self.data_offset = -(-p.pos // self.alignment) * self.alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, ne, t, rel in infos:
            if name in self.tensors:
                raise p.fail(f"tensor {name!r} appears twice in the tensor table")
            nbytes = t.nbytes(_product(ne))
            start = self.data_offset + rel
            if start + nbytes > self.file_size:
                raise p.fail(
                    f"tensor {name!r} ({t.name}, {nbytes} bytes at offset {start}) runs past the end of the "
                    f"file ({self.file_size} bytes): truncated file?"
                )
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(ne)), t.name, start, nbytes)
        by_offset = sorted(self.tensors.values(), key=lambda ti: ti.offset)
        for a, b in zip(by_offset, by_offset[1:], strict=False):
            if a.offset + a.nbytes > b.offset:
                raise p.fail(f"tensors {a.name!r} and {b.name!r} overlap in the data section")

    def _tensor_info(self, p: HeaderParser, i: int) -> tuple[str, list[int], GGMLType, int]:
        name = p.string(f"the name of tensor {i}")
        n_dims = p.u32(f"the dimension count of tensor {name!r}")
        if n_dims > GGML_MAX_DIMS:
            raise p.fail(f"tensor {name!r} has {n_dims} dimensions; ggml allows at most {GGML_MAX_DIMS}")
        ne = [p.u64(f"dimension {k} of tensor {name!r}") for k in range(n_dims)]
        n = 1
        for k, d in enumerate(ne):
            if d == 0 or d > INT64_MAX:
                raise p.fail(f"tensor {name!r} has dimension {k} = {d}; each must be between 1 and 2**63 - 1")
            n *= d
            if n > INT64_MAX:
                raise p.fail(f"tensor {name!r} has dimensions {ne} whose product overflows int64")
        type_id = p.u32(f"the type of tensor {name!r}")
        t = GGML_TYPES.get(type_id)
        if t is None:
            raise p.fail(f"tensor {name!r} has unknown ggml type id {type_id}")
        if ne and ne[0] % t.block_size:
            raise p.fail(
                f"tensor {name!r} is {t.name}, whose blocks hold {t.block_size} weights, but its first "
                f"dimension {ne[0]} is not a multiple of {t.block_size}"
            )
        if not ne and t.block_size > 1:
            raise p.fail(f"tensor {name!r} is a scalar stored as the block type {t.name}")
        offset = p.u64(f"the data offset of tensor {name!r}")
        if offset % self.alignment:
            raise p.fail(f"tensor {name!r} has data offset {offset}, not a multiple of the alignment {self.alignment}")
        return name, ne, t, offset

    # -- access ----------------------------------------------------------------

    def _info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor ``name`` as stored: a read-only uint8 view into the memory map (no copy)."""
        info = self._info(name)
        if self._map is None:
            raise GGUFError(f"{self.path}: the file is closed")
        return self._map[info.offset : info.offset + info.nbytes].view(np.ndarray)

    def read_raw(self, name: str, start_row: int = 0, stop_row: int | None = None) -> np.ndarray:
        """The bytes of tensor ``name`` as stored, read into a new uint8 array (not through the memory map).

        ``start_row``/``stop_row`` select rows of the first (PyTorch) dimension:
        each row is a whole number of blocks. A streaming load reads each tensor
        this way, a slice of rows at a time: the copy is freed once converted,
        and no page of the file stays mapped into the process, so the file's
        size is not added to the resident memory.
        """
        info = self._info(name)
        rows = info.shape[0] if info.shape else 1
        row_bytes = info.nbytes // rows
        stop_row = rows if stop_row is None else min(stop_row, rows)
        count = max(0, stop_row - start_row) * row_bytes
        try:
            with open(self.path, "rb") as f:
                f.seek(info.offset + start_row * row_bytes)
                data = np.fromfile(f, dtype=np.uint8, count=count)
        except OSError as exc:
            raise GGUFError(f"{self.path}: reading tensor {name!r} failed: {exc}") from None
        if data.size != count:
            raise GGUFError(f"{self.path}: tensor {name!r} is cut short ({data.size} of {count} bytes): truncated file?")
        return data

    def dequantize_numpy(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a new float32 numpy array in PyTorch shape order."""
        info = self._info(name)
        flat = _dequantize(self.raw(name), info.ggml_type, what=f"{self.path}: tensor {name!r}")
        return flat.reshape(info.shape)

    def dequantize(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` dequantized into a new torch tensor (float32 unless ``dtype`` says otherwise).

        The shape is in PyTorch order (ggml's ``ne`` reversed), as transformers
        and gguf-py reshape it. GGUFError for a type lollm cannot dequantize,
        naming the type and the tensor.
        """
        import torch

        t = torch.from_numpy(self.dequantize_numpy(name))
        return t if dtype is None or dtype == torch.float32 else t.to(dtype)

    def release_header_pages(self) -> int:
        """Take the header's pages (the metadata: a tokenizer's strings, scores, merges) out of this
        process's resident memory; returns how many bytes were released (0 where the OS cannot).

        The header is read through the memory map, so the pages it touched count in the
        process's resident memory (6.5 MB for Gemma 3's 262,144 tokens) for as long as the
        map lives. Once the tokenizer has its own tables nothing reads them; Linux's
        ``madvise(MADV_DONTNEED)`` on a read-only file mapping drops them from the process
        and leaves them in the OS's page cache. A later read (a :class:`StringArray` used
        again) faults them back in: nothing breaks, and nothing is copied.
        """
        import mmap

        raw_map = getattr(self._map, "_mmap", None)  # numpy's memmap keeps its mmap.mmap here
        advice = getattr(mmap, "MADV_DONTNEED", None)
        length = self.data_offset - self.data_offset % mmap.PAGESIZE
        if raw_map is None or advice is None or length <= 0:
            return 0
        try:
            raw_map.madvise(advice, 0, length)
        except (OSError, ValueError):
            return 0
        return length

    def close(self) -> None:
        """Drop this object's memory map (views from :meth:`raw` keep theirs alive until they go)."""
        self._map = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        arch = self.metadata.get("general.architecture", "?")
        return f"GGUFFile({str(self.path)!r}, version={self.version}, architecture={arch!r}, tensors={len(self.tensors)})"


def _product(dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


class GGUFTensorSource:
    """The loader's TensorSource interface over a GGUF file, so a family can stream-load it.

    Names are the file's own (``blk.0.attn_q.weight``): the family owns the
    name map. Nothing is dequantized before :meth:`read`, which returns a new
    float32 tensor each call. ``dtype(name)`` is the ggml type name as stored.
    """

    fmt = "gguf"

    def __init__(self, gguf: GGUFFile | str | os.PathLike):
        self.gguf = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)

    @property
    def metadata(self) -> dict[str, Any]:
        return self.gguf.metadata

    def names(self) -> list[str]:
        """All tensor names, in file order."""
        return list(self.gguf.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.gguf.tensors

    def __len__(self) -> int:
        return len(self.gguf.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape in PyTorch order."""
        return self.gguf._info(name).shape

    def dtype(self, name: str) -> str:
        """The ggml type name as stored (``"Q4_K"``, ``"F32"`` …)."""
        return self.gguf._info(name).ggml_type

    def file_of(self, name: str) -> Path:
        self.gguf._info(name)
        return self.gguf.path

    def read(self, name: str) -> torch.Tensor:
        """Dequantize one tensor into a new float32 CPU tensor (read with file I/O, not through the map)."""
        import torch

        info = self.gguf._info(name)
        flat = _dequantize(self.gguf.read_raw(name), info.ggml_type, what=f"{self.gguf.path}: tensor {name!r}")
        return torch.from_numpy(flat.reshape(info.shape))

    def read_slice(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Dequantize only ``ranges`` (``[(start, stop), …]`` along ``dim``) of one tensor, float32.

        Along the first (PyTorch) dimension each range is a run of whole rows,
        read and dequantized alone (a tensor-parallel rank's row slice,
        docs/tensor-parallel.md); along another dimension the tensor is read
        whole and cut (ggml blocks run along the last dimension).
        """
        import torch

        info = self.gguf._info(name)
        if dim != 0 or len(info.shape) == 0:
            whole = self.read(name)
            return torch.cat([whole.narrow(dim, a, b - a) for a, b in ranges], dim=dim).clone()
        parts = []
        for start, stop in ranges:
            flat = _dequantize(self.gguf.read_raw(name, start, stop), info.ggml_type, what=f"{self.gguf.path}: tensor {name!r}")
            parts.append(torch.from_numpy(flat.reshape((stop - start, *info.shape[1:]))))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def read_raw(self, name: str, start_row: int = 0, stop_row: int | None = None) -> np.ndarray:
        """The tensor's bytes as stored (a new uint8 array; rows ``start_row .. stop_row``), for loads that keep blocks packed."""
        return self.gguf.read_raw(name, start_row, stop_row)

    def nbytes(self) -> int:
        """Total size of the tensors as stored in the file, in bytes."""
        return sum(t.nbytes for t in self.gguf.tensors.values())
