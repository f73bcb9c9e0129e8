"""Parsing a GGUF header's metadata: value types, the checked parser, and lazily decoded string arrays.

:class:`lollm.gguf.reader.GGUFFile` walks a file's header with the :class:`HeaderParser` here; every
length is checked against the bytes left before anything is allocated (docs/gguf.md).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lollm.errors import GGUFError

#: Arrays of arrays deeper than this are refused (no real file nests at all).
MAX_ARRAY_NESTING = 8
#: Numeric metadata arrays longer than this are returned as numpy arrays.
BIG_ARRAY_LEN = 1024


# GGUF metadata value types: id -> (name, numpy dtype, struct format) for the fixed-size ones.
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, tuple[str, str, str]] = {
    0: ("uint8", "<u1", "<B"),
    1: ("int8", "<i1", "<b"),
    2: ("uint16", "<u2", "<H"),
    3: ("int16", "<i2", "<h"),
    4: ("uint32", "<u4", "<I"),
    5: ("int32", "<i4", "<i"),
    6: ("float32", "<f4", "<f"),
    7: ("bool", "<u1", "<B"),  # one byte, 0 or 1
    10: ("uint64", "<u8", "<Q"),
    11: ("int64", "<i8", "<q"),
    12: ("float64", "<f8", "<d"),
}
_STRUCT = {type_id: struct.Struct(fmt) for type_id, (_, _, fmt) in _SCALARS.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def value_type_name(type_id: int) -> str:
    """The name of a GGUF metadata value type id (``4`` -> ``"uint32"``)."""
    if type_id in _SCALARS:
        return _SCALARS[type_id][0]
    return {_STRING: "string", _ARRAY: "array"}.get(type_id, f"unknown type {type_id}")


class HeaderParser:
    """Walks the header of a GGUF file, checking every length against the bytes left."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def fail(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    @property
    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> int:
        """Reserve ``n`` bytes for ``what``; return where they start. Raises when the file ends first."""
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated file: {what} needs {n} bytes at offset {self.pos}, but only {self.size - self.pos} are left"
            )
        start = self.pos
        self.pos += n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        start = self.take(n, what)
        try:
            return str(self.buf[start : start + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} at offset {start} is not valid UTF-8 ({exc.reason})") from None

    # -- metadata values ---------------------------------------------------

    def min_size(self, type_id: int, what: str) -> int:
        """The fewest bytes one value of this type can take (used to bound array lengths)."""
        if type_id in _SCALARS:
            return _STRUCT[type_id].size
        if type_id == _STRING:
            return 8  # the length field of an empty string
        if type_id == _ARRAY:
            return 4 + 8  # element type + length of an empty array
        raise self.fail(f"{what} has unknown value type {type_id} (known: 0-12)")

    def value(self, type_id: int, key: str, depth: int = 0) -> tuple[Any, str]:
        """Read one value of ``type_id``; return it and its type name (``"array[string]"`` …)."""
        if type_id in _SCALARS:
            name = _SCALARS[type_id][0]
            v = _STRUCT[type_id].unpack_from(self.buf, self.take(_STRUCT[type_id].size, f"the {name} value of {key!r}"))[0]
            if type_id == 7:
                if v > 1:
                    raise self.fail(f"the bool value of {key!r} is {v}, not 0 or 1")
                v = bool(v)
            return v, name
        if type_id == _STRING:
            return self.string(f"the string value of {key!r}"), "string"
        if type_id == _ARRAY:
            return self.array(key, depth)
        raise self.fail(f"metadata key {key!r} has unknown value type {type_id} (known: 0-12)")

    def array(self, key: str, depth: int) -> tuple[Any, str]:
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"metadata key {key!r} nests arrays more than {MAX_ARRAY_NESTING} deep")
        etype = self.u32(f"the element type of array {key!r}")
        n = self.u64(f"the length of array {key!r}")
        each = self.min_size(etype, f"array {key!r}")
        if n * each > self.left:
            raise self.fail(
                f"array {key!r} claims {n} elements of {value_type_name(etype)} (at least {n * each} bytes) "
                f"at offset {self.pos}, but only {self.left} bytes are left"
            )
        type_name = f"array[{value_type_name(etype)}]"
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            start = self.take(n * dtype.itemsize, f"array {key!r}")
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=start)
            if etype == 7:
                if n and int(arr.max()) > 1:
                    raise self.fail(f"array {key!r} holds a bool that is neither 0 nor 1")
                dtype = np.dtype(np.bool_)
            # a copy in native byte order (never a view into the file), or plain Python values
            values = arr.astype(dtype.newbyteorder("="))
            return (values if n > BIG_ARRAY_LEN else values.tolist()), type_name
        if etype == _STRING:
            return self.string_array(key, n), type_name
        # an array of arrays: each inner array carries its own element type
        return [self.array(f"{key}[{i}]", depth + 1)[0] for i in range(n)], type_name

    def string_array(self, key: str, n: int) -> list[str] | StringArray:
        """``n`` strings in a row; the hot loop of a tokenizer vocabulary (150k+ entries), kept tight.

        Every string is checked (its length, UTF-8). Up to :data:`BIG_ARRAY_LEN` of them come back
        as a list; more as a :class:`StringArray`, which decodes them again from the file when used."""
        buf, size, pos, unpack = self.buf, self.size, self.pos, _U64.unpack_from
        big = n > BIG_ARRAY_LEN
        out: list[str] = []
        starts = np.empty(n + 1 if big else 0, dtype=np.int64)
        keep = out.append
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"truncated file: string {i} of array {key!r} has no length at offset {pos}")
            length = unpack(buf, pos)[0]
            pos += 8
            if length > size - pos:
                raise self.fail(
                    f"string {i} of array {key!r} claims {length} bytes at offset {pos}, but only {size - pos} are left"
                )
            try:
                text = str(buf[pos : pos + length], "utf-8")
            except UnicodeDecodeError as exc:
                raise self.fail(f"string {i} of array {key!r} at offset {pos} is not valid UTF-8 ({exc.reason})") from None
            if big:
                starts[i] = pos
            else:
                keep(text)
            pos += length
        self.pos = pos
        if not big:
            return out
        starts[n] = pos + 8  # as if one more string followed: string i ends 8 bytes before starts[i + 1]
        return StringArray(buf, starts)


class StringArray(Sequence):
    """A GGUF metadata array of more than :data:`BIG_ARRAY_LEN` strings, decoded from the file when used.

    A tokenizer's vocabulary and merges are most of a GGUF's metadata (Qwen2.5: 151,643
    tokens and 151,387 merges, about 20 MB as Python strings), and they are read once, by
    the tokenizer, which keeps its own tables. So the reader checks every string when the
    file opens (a bad one is a GGUFError then) and keeps only where each one starts; each
    use decodes them again from the file's memory map. ``tolist()`` gives a list, as a
    numpy array's does; indexing, slicing, ``len``, iteration and ``==`` work as on a list.
    """

    def __init__(self, buf: memoryview, starts: np.ndarray):
        self._buf, self._starts = buf, starts  # starts[i]: string i's first byte; n + 1 entries

    def __len__(self) -> int:
        return len(self._starts) - 1

    def _string(self, i: int) -> str:
        start, stop = int(self._starts[i]), int(self._starts[i + 1]) - 8
        return str(self._buf[start:stop], "utf-8")

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._string(i) for i in range(*index.indices(len(self)))]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError(f"string array index {index} out of range ({len(self)} strings)")
        return self._string(i)

    #: Iteration turns this many offsets into Python ints at a time. All at once (10 MB of ints
    #: and list for Gemma 3's 262,144 strings) left 3-4 MB more resident after a tokenizer was built.
    ITER_CHUNK = 4096

    def __iter__(self):
        buf, n, chunk = self._buf, len(self), self.ITER_CHUNK
        for first in range(0, n, chunk):
            starts = self._starts[first : min(first + chunk, n) + 1].tolist()
            for start, stop in zip(starts, starts[1:]):
                yield str(buf[start : stop - 8], "utf-8")

    def tolist(self) -> list[str]:
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, StringArray)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"
