"""Dequantization: bit-exact against gguf-py's reference on random blocks and on every tensor of two real files."""

from __future__ import annotations

import numpy as np
import pytest
from conftest_gguf import F16_FIELDS
from lollm.errors import GGUFError
from lollm.gguf import GGUFFile, quants
from lollm.gguf.quants import GGML_TYPES, GGML_TYPES_BY_NAME, SUPPORTED_TYPES, dequantize

pytest_plugins = ["conftest_gguf"]

import gguf  # noqa: E402  (lollm-core[parity]; the reference, never used at run time)


def reference(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf.quants.dequantize of flat bytes, as a flat float32 array."""
    qtype = gguf.GGMLQuantizationType[type_name]
    t = GGML_TYPES_BY_NAME[type_name]
    data = raw if t.block_size == 1 else raw.reshape(-1, t.type_size)
    with np.errstate(all="ignore"):
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32).reshape(-1)


def assert_bit_exact(ours: np.ndarray, ref: np.ndarray, what: str, nan_equal: bool = False) -> None:
    assert ours.dtype == np.float32 and ours.shape == ref.shape, (what, ours.shape, ref.shape)
    same = ours.view(np.uint32) == ref.view(np.uint32)
    if nan_equal:
        same |= np.isnan(ours) & np.isnan(ref)
    if not same.all():
        i = int(np.flatnonzero(~same)[0])
        raise AssertionError(f"{what}: {(~same).sum()} values differ; first at {i}: ours {ours[i]!r}, gguf {ref[i]!r}")


def test_type_table_matches_ggml():
    """Every ggml type gguf-py knows is in our table with the same id, block size and bytes per block."""
    for qtype in gguf.GGMLQuantizationType:
        ours = GGML_TYPES.get(int(qtype))
        assert ours is not None, f"{qtype.name} (id {int(qtype)}) missing from GGML_TYPES"
        assert ours.name == qtype.name
        assert (ours.block_size, ours.type_size) == gguf.GGML_QUANT_SIZES[qtype], qtype.name
    assert set(GGML_TYPES) == {int(q) for q in gguf.GGMLQuantizationType}


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_random_blocks_bit_exact(type_name):
    """Random bytes with finite float16 scales: equal bit for bit to gguf.quants."""
    rng = np.random.default_rng(sum(map(ord, type_name)))
    t = GGML_TYPES_BY_NAME[type_name]
    if type_name in ("F32", "F16", "BF16"):
        raw = rng.standard_normal(4099).astype({"F32": "<f4", "F16": "<f2"}.get(type_name, "<f4"))
        if type_name == "BF16":
            raw = (raw.view("<u4") >> 16).astype("<u2")
        raw = raw.view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(1003, t.type_size), dtype=np.uint8)
        for off in F16_FIELDS[type_name]:
            raw[:, off : off + 2] = rng.uniform(-2.0, 2.0, size=(len(raw), 1)).astype("<f2").view(np.uint8)
        raw = raw.reshape(-1)
    ours = dequantize(raw, type_name)
    assert np.isfinite(ours).all()
    assert_bit_exact(ours, reference(raw, type_name), type_name)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_arbitrary_bytes_bit_exact_with_nan_equality(type_name):
    """Any bytes at all (NaN and inf scales included): equal to gguf.quants, NaN equal to NaN."""
    rng = np.random.default_rng(7 + sum(map(ord, type_name)))
    t = GGML_TYPES_BY_NAME[type_name]
    raw = rng.integers(0, 256, size=517 * t.type_size * (8 if t.block_size == 1 else 1), dtype=np.uint8)
    assert_bit_exact(dequantize(raw, type_name), reference(raw, type_name), type_name, nan_equal=True)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_K", "F16"])
def test_step_boundaries(monkeypatch, type_name):
    """Tensors are dequantized in steps of STEP_WEIGHTS; a ragged last step changes nothing."""
    rng = np.random.default_rng(3)
    t = GGML_TYPES_BY_NAME[type_name]
    raw = rng.integers(0, 256, size=(1000 if t.block_size > 1 else 40000) * t.type_size, dtype=np.uint8)
    whole = dequantize(raw, type_name)
    monkeypatch.setattr(quants, "STEP_WEIGHTS", 3 * 256 + 5)
    assert_bit_exact(dequantize(raw, type_name), whole, type_name, nan_equal=True)


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def test_q4_0_by_hand():
    """One Q4_0 block worked out by hand: d = 0.5, byte j = (hi << 4) | lo."""
    lo = np.arange(16, dtype=np.uint8)  # weights 0..15 get q = 0..15
    hi = (15 - np.arange(16)).astype(np.uint8)  # weights 16..31 get q = 15..0
    block = _f16(0.5) + (lo | (hi << 4)).tobytes()
    got = dequantize(np.frombuffer(block, np.uint8), "Q4_0")
    want = np.concatenate([(np.arange(16) - 8) * 0.5, (15 - np.arange(16) - 8) * 0.5]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_q8_0_by_hand():
    qs = np.arange(-16, 16, dtype=np.int8)
    block = _f16(0.25) + qs.tobytes()
    np.testing.assert_array_equal(dequantize(np.frombuffer(block, np.uint8), "Q8_0"), qs.astype(np.float32) * 0.25)


def test_q4_k_by_hand():
    """A Q4_K super-block: sub-block b has scale b+1 and min 2b (6-bit, packed), d = 1, dmin = 0.5, every q = 3."""
    sc = np.arange(1, 9)
    mn = np.arange(0, 16, 2)
    packed = np.zeros(12, dtype=np.uint8)
    packed[0:4] = sc[0:4] | ((sc[4:8] >> 4) << 6)
    packed[4:8] = mn[0:4] | ((mn[4:8] >> 4) << 6)
    packed[8:12] = (sc[4:8] & 0xF) | ((mn[4:8] & 0xF) << 4)
    qs = np.full(128, 0x33, dtype=np.uint8)
    block = _f16(1.0) + _f16(0.5) + packed.tobytes() + qs.tobytes()
    got = dequantize(np.frombuffer(block, np.uint8), "Q4_K").reshape(8, 32)
    want = (sc * 3.0 - 0.5 * mn).astype(np.float32)[:, None].repeat(32, axis=1)
    np.testing.assert_array_equal(got, want)


def test_iq4_nl_by_hand():
    idx = np.arange(16, dtype=np.uint8)
    block = _f16(2.0) + (idx | (idx << 4)).tobytes()
    grid = quants.KVALUES_IQ4NL.astype(np.float32) * 2
    np.testing.assert_array_equal(dequantize(np.frombuffer(block, np.uint8), "IQ4_NL"), np.concatenate([grid, grid]))


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "Q8_K", "TQ1_0", "I32", "F64"])
def test_unsupported_type_names_the_type_and_tensor(type_name):
    t = GGML_TYPES_BY_NAME[type_name]
    with pytest.raises(GGUFError, match=rf"blk\.3\.x.*{type_name}.*cannot dequantize"):
        dequantize(np.zeros(t.type_size, np.uint8), type_name, what="tensor 'blk.3.x'")


def test_unknown_type_name_and_partial_block():
    with pytest.raises(GGUFError, match="Q9_9"):
        dequantize(np.zeros(18, np.uint8), "Q9_9")
    with pytest.raises(GGUFError, match="whole number of Q4_0 blocks"):
        dequantize(np.zeros(19, np.uint8), "Q4_0")


@pytest.mark.real
def test_every_tensor_of_the_real_files_bit_exact(real_gguf, reference_reader):
    """Every tensor of both real files: our dequantization equals gguf.quants bit for bit, in the same shape."""
    f = GGUFFile(real_gguf)
    reader = reference_reader(real_gguf)
    assert [t.name for t in reader.tensors] == list(f.tensors)
    types = set()
    for rt in reader.tensors:
        ours = f.dequantize_numpy(rt.name)
        with np.errstate(all="ignore"):
            ref = np.asarray(gguf.quants.dequantize(rt.data, rt.tensor_type), dtype=np.float32)
        assert ours.shape == ref.shape, rt.name
        assert_bit_exact(ours.reshape(-1), ref.reshape(-1), f"{real_gguf.name}: {rt.name}")
        types.add(rt.tensor_type.name)
    assert {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= types
