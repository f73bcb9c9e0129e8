"""The GGUF reader: metadata of every value type, the tensor table, alignment, errors, the TensorSource view."""

from __future__ import annotations

import sys

import gguf  # noqa: E402  (lollm-core[parity]; an independent writer and reader to compare with)
import numpy as np
import pytest
import torch
from conftest_gguf import (
    ARRAY,
    BOOL,
    FLOAT32,
    FLOAT64,
    INT8,
    INT16,
    INT32,
    INT64,
    STRING,
    UINT8,
    UINT16,
    UINT32,
    UINT64,
    GGUFBuilder,
    Tensor,
    random_tensor_bytes,
    write,
)
from lollm.errors import CheckpointError, GGUFError, LollmError
from lollm.gguf import GGUFFile, GGUFTensorInfo, GGUFTensorSource
from lollm.gguf import reader as reader_module
from lollm.gguf.metadata import BIG_ARRAY_LEN

pytest_plugins = ["conftest_gguf"]


ALL_TYPES_KVS = [
    ("general.architecture", STRING, "testarch"),
    ("t.u8", UINT8, 255),
    ("t.i8", INT8, -128),
    ("t.u16", UINT16, 65535),
    ("t.i16", INT16, -32768),
    ("t.u32", UINT32, 2**32 - 1),
    ("t.i32", INT32, -(2**31)),
    ("t.f32", FLOAT32, 0.1),
    ("t.bool", BOOL, 1),
    ("t.str", STRING, "héllo ✓ 世界"),
    ("t.empty_str", STRING, ""),
    ("t.u64", UINT64, 2**64 - 1),
    ("t.i64", INT64, -(2**63)),
    ("t.f64", FLOAT64, 0.1),
    ("t.arr_i32", ARRAY, (INT32, [1, -2, 3])),
    ("t.arr_bool", ARRAY, (BOOL, [1, 0, 1])),
    ("t.arr_f32", ARRAY, (FLOAT32, [0.5, -1.25])),
    ("t.arr_str", ARRAY, (STRING, ["a", "", "ünï"])),
    ("t.arr_empty", ARRAY, (UINT64, [])),
    ("t.arr_nested", ARRAY, (ARRAY, [(INT16, [1, 2]), (STRING, ["x"]), (ARRAY, [(UINT8, [7])])])),
    ("t.arr_big", ARRAY, (INT32, list(range(BIG_ARRAY_LEN + 1)))),
    ("t.arr_big_bool", ARRAY, (BOOL, [1, 0] * BIG_ARRAY_LEN)),
]


def test_every_metadata_value_type(tmp_path):
    path = write(tmp_path, "all.gguf", GGUFBuilder(kvs=ALL_TYPES_KVS).build())
    f = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    for key in f.metadata:
        if key != "t.arr_nested":  # gguf-py flattens nested arrays
            ours = f.metadata[key]
            assert (ours.tolist() if isinstance(ours, np.ndarray) else ours) == ref.fields[key].contents(), key
    m = f.metadata
    assert f.version == 3 and f.tensors == {}
    assert list(m) == [k for k, _, _ in ALL_TYPES_KVS]
    assert (m["t.u8"], m["t.i8"], m["t.u16"], m["t.i16"]) == (255, -128, 65535, -32768)
    assert (m["t.u32"], m["t.i32"], m["t.u64"], m["t.i64"]) == (2**32 - 1, -(2**31), 2**64 - 1, -(2**63))
    assert m["t.f32"] == float(np.float32(0.1)) and m["t.f64"] == 0.1
    assert m["t.bool"] is True
    assert m["t.str"] == "héllo ✓ 世界" and m["t.empty_str"] == ""
    assert m["t.arr_i32"] == [1, -2, 3] and m["t.arr_bool"] == [True, False, True]
    assert m["t.arr_f32"] == [0.5, -1.25] and m["t.arr_str"] == ["a", "", "ünï"] and m["t.arr_empty"] == []
    assert m["t.arr_nested"] == [[1, 2], ["x"], [[7]]]
    big = m["t.arr_big"]
    assert isinstance(big, np.ndarray) and big.dtype == np.int32 and big.tolist() == list(range(BIG_ARRAY_LEN + 1))
    assert m["t.arr_big_bool"].dtype == np.bool_ and m["t.arr_big_bool"][:4].tolist() == [True, False, True, False]
    types = f.metadata_types
    assert types["t.u8"] == "uint8" and types["t.f64"] == "float64" and types["t.str"] == "string"
    assert types["t.arr_str"] == "array[string]" and types["t.arr_nested"] == "array[array]"
    assert types["t.arr_big"] == "array[int32]"


def test_agrees_with_gguf_writer_and_reader(tmp_path):
    """A file written by gguf-py (an independent writer): same metadata and tensors as gguf-py's own reader."""
    rng = np.random.default_rng(0)
    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("t.flag", False)
    w.add_string("t.name", "tiny")
    w.add_array("t.ints", [3, 1, 2])
    w.add_array("t.strs", ["<s>", "</s>", "▁a"])
    arrays = {
        "a.f32": rng.standard_normal((3, 5, 7, 2)).astype(np.float32),
        "b.f16": rng.standard_normal((4, 6)).astype(np.float16),
        "c.vec": rng.standard_normal(10).astype(np.float32),
    }
    for name, a in arrays.items():
        w.add_tensor(name, a)
    q8 = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("d.q8", gguf.quants.quantize(q8, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    bf = rng.standard_normal((2, 3)).astype(np.float32)
    w.add_tensor("e.bf16", gguf.quants.quantize(bf, gguf.GGMLQuantizationType.BF16), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    f = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    assert_same_as_reference(f, ref)
    for name, a in arrays.items():
        assert f.tensors[name].shape == a.shape
        np.testing.assert_array_equal(f.dequantize(name).numpy(), a.astype(np.float32))
    assert f.tensors["d.q8"].shape == (8, 64) and f.tensors["d.q8"].ggml_type == "Q8_0"
    np.testing.assert_allclose(f.dequantize("d.q8").numpy(), q8, atol=0.05)
    assert f.tensors["e.bf16"].ggml_type == "BF16"
    np.testing.assert_allclose(f.dequantize("e.bf16").numpy(), bf, rtol=1e-2)


def assert_same_as_reference(f: GGUFFile, ref) -> None:
    """Our metadata and tensor table against gguf.GGUFReader's."""
    fields = {k: v for k, v in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(f.metadata) == list(fields)
    assert f.version == ref.fields["GGUF.version"].contents()
    for key, field in fields.items():
        ours = f.metadata[key]
        theirs = field.contents()
        if isinstance(ours, np.ndarray):
            ours = ours.tolist()
        assert ours == theirs, key
        ref_type = field.types[0].name.lower()
        if ref_type == "array":
            ref_type = f"array[{field.types[-1].name.lower()}]"
        assert f.metadata_types[key] == ref_type, key
    assert f.alignment == ref.alignment and f.data_offset == ref.data_offset
    assert list(f.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = f.tensors[t.name]
        assert info.ne == tuple(int(d) for d in t.shape), t.name
        assert info.shape == tuple(reversed(info.ne))
        assert info.ggml_type == t.tensor_type.name
        assert (info.offset, info.nbytes, info.n_elements) == (t.data_offset, t.n_bytes, t.n_elements), t.name


@pytest.mark.real
def test_real_file_header_matches_gguf_reader(real_gguf, reference_reader):
    f = GGUFFile(real_gguf)
    ref = reference_reader(real_gguf)
    assert_same_as_reference(f, ref)
    # the raw bytes are the very bytes gguf-py maps
    for t in ref.tensors[:40]:
        assert np.array_equal(f.raw(t.name), t.data.reshape(-1).view(np.uint8)), t.name


@pytest.mark.real
def test_real_files_facts(qwen25_gguf, gemma3_gguf):
    """The facts docs/models.md states about the two files, read by our reader."""
    q = GGUFFile(qwen25_gguf)
    assert q.metadata["general.architecture"] == "qwen2" and q.version == 3
    assert q.metadata["qwen2.block_count"] == 24 and q.metadata["qwen2.attention.head_count_kv"] == 2
    assert len(q.metadata["tokenizer.ggml.tokens"]) == 151936
    assert q.tensors["token_embd.weight"].shape == (151936, 896)
    assert q.tensors["blk.0.ffn_down.weight"].shape == (896, 4864)
    counts: dict[str, int] = {}
    for t in q.tensors.values():
        counts[t.ggml_type] = counts.get(t.ggml_type, 0) + 1
    assert counts == {"F32": 121, "Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}
    g = GGUFFile(gemma3_gguf)
    assert g.metadata["general.architecture"] == "gemma3" and len(g.tensors) == 236
    assert g.metadata["gemma3.attention.sliding_window"] == 512
    assert "output.weight" not in g.tensors  # tied to token_embd.weight
    assert g.tensors["token_embd.weight"].shape == (262144, 640)


@pytest.mark.real
def test_tensor_source_is_lazy_and_streams(qwen25_gguf, monkeypatch):
    calls: list[str] = []
    real = reader_module._dequantize

    def counting(raw, type_name, *, what):
        calls.append(what)
        return real(raw, type_name, what=what)

    monkeypatch.setattr(reader_module, "_dequantize", counting)
    src = GGUFTensorSource(qwen25_gguf)
    assert src.fmt == "gguf" and len(src) == 291 and "output_norm.weight" in src
    names = src.names()
    assert names == list(src.gguf.tensors)
    assert src.shape("blk.0.attn_q.weight") == (896, 896) and src.dtype("blk.0.attn_q.weight") == "Q5_0"
    assert src.dtype("blk.0.ffn_down.weight") == "Q6_K" and src.file_of("output_norm.weight") == qwen25_gguf
    assert src.nbytes() == sum(t.nbytes for t in src.gguf.tensors.values())
    assert src.nbytes() < qwen25_gguf.stat().st_size
    assert calls == []  # nothing dequantized before read()
    w = src.read("blk.0.attn_k.weight")
    assert calls and w.dtype == torch.float32 and tuple(w.shape) == (128, 896) and w.is_contiguous()
    w[0, 0] = 1.0  # a tensor of its own, writable, not a view of the file
    norm = src.read("blk.0.attn_norm.weight")
    stored = np.array(src.gguf.raw("blk.0.attn_norm.weight").view("<f4"))
    assert norm.shape == (896,) and torch.equal(norm, torch.from_numpy(stored))
    with pytest.raises(GGUFError, match="no tensor named 'nope'"):
        src.read("nope")


@pytest.mark.real
def test_dequantize_dtype(qwen25_gguf):
    f = GGUFFile(qwen25_gguf)
    a = f.dequantize("blk.1.attn_v.weight")
    b = f.dequantize("blk.1.attn_v.weight", dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16 and torch.equal(b, a.to(torch.bfloat16))


def test_known_type_we_cannot_dequantize_opens_and_fails_only_on_dequantize(tmp_path):
    rng = np.random.default_rng(1)
    b = GGUFBuilder(tensors=[
        Tensor("ok", [32], "Q8_0", random_tensor_bytes(rng, "Q8_0", 32)),
        Tensor("blk.0.weird", [256, 2], "IQ2_XXS", random_tensor_bytes(rng, "IQ2_XXS", 512)),
    ])
    f = GGUFFile(write(tmp_path, "x.gguf", b.build()))
    assert f.tensors["blk.0.weird"].ggml_type == "IQ2_XXS" and f.tensors["blk.0.weird"].shape == (2, 256)
    assert f.raw("blk.0.weird").nbytes == 2 * 66
    f.dequantize("ok")
    with pytest.raises(GGUFError, match=r"x\.gguf.*'blk\.0\.weird'.*IQ2_XXS.*cannot dequantize"):
        f.dequantize("blk.0.weird")


def test_version_2_reads_and_others_are_refused(tmp_path):
    kvs = [("general.architecture", STRING, "a")]
    assert GGUFFile(write(tmp_path, "v2.gguf", GGUFBuilder(kvs=kvs, version=2).build())).version == 2
    with pytest.raises(GGUFError, match="version 1 .*not supported"):
        GGUFFile(write(tmp_path, "v1.gguf", GGUFBuilder(kvs=kvs, version=1).build()))
    with pytest.raises(GGUFError, match="version 4 is not supported"):
        GGUFFile(write(tmp_path, "v4.gguf", GGUFBuilder(kvs=kvs, version=4).build()))


def test_big_endian_is_refused(tmp_path):
    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("llama.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="big-endian"):
        GGUFFile(path)


def test_custom_alignment(tmp_path):
    rng = np.random.default_rng(2)
    data = random_tensor_bytes(rng, "F32", 5)
    tensors = [Tensor("a", [5], "F32", data), Tensor("b", [5], "F32", data)]
    b = GGUFBuilder(kvs=[("general.alignment", UINT32, 256)], tensors=tensors, alignment=256)
    f = GGUFFile(write(tmp_path, "al.gguf", b.build()))
    assert f.alignment == 256 and f.data_offset % 256 == 0
    assert f.tensors["b"].offset == f.data_offset + 256
    np.testing.assert_array_equal(f.dequantize("b").numpy(), np.frombuffer(data, "<f4"))


@pytest.mark.parametrize("value, type_id, match", [
    (48, UINT32, "general.alignment is 48, not a power of two"),
    (0, UINT32, "general.alignment is 0, not a power of two"),
    (64, UINT64, "general.alignment must be a uint32, found a uint64"),
    ("32", STRING, "general.alignment must be a uint32, found a string"),
])
def test_bad_alignment(tmp_path, value, type_id, match):
    with pytest.raises(GGUFError, match=match):
        GGUFFile(write(tmp_path, "bad.gguf", GGUFBuilder(kvs=[("general.alignment", type_id, value)]).build()))


def test_errors_name_the_file_and_are_checkpoint_errors(tmp_path):
    missing = tmp_path / "missing.gguf"
    with pytest.raises(GGUFError, match="missing.gguf: no such file") as exc:
        GGUFFile(missing)
    assert isinstance(exc.value, CheckpointError) and isinstance(exc.value, LollmError)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(write(tmp_path, "st.gguf", b"PK\x03\x04" + b"\0" * 100))
    with pytest.raises(GGUFError, match="not a file"):
        GGUFFile(tmp_path)
    with pytest.raises(GGUFError, match=r"e\.gguf: truncated file: 0 bytes"):
        GGUFFile(write(tmp_path, "e.gguf", b""))


def test_closed_file(tmp_path):
    rng = np.random.default_rng(4)
    data = GGUFBuilder(tensors=[Tensor("a", [4], "F32", random_tensor_bytes(rng, "F32", 4))]).build()
    f = GGUFFile(write(tmp_path, "c.gguf", data))
    view = f.raw("a")
    with f:
        pass
    assert view.nbytes == 16  # views taken before close stay valid
    with pytest.raises(GGUFError, match="closed"):
        f.raw("a")


def test_tensor_info_fields():
    info = GGUFTensorInfo("x", (3, 64), "Q8_0", 96, 3 * 2 * 34)
    assert info.ne == (64, 3) and info.n_elements == 192 and info.type_info.block_size == 32


def test_a_long_string_array_is_checked_at_open_and_decoded_from_the_file_when_used(tmp_path):
    """More than BIG_ARRAY_LEN strings (a vocabulary) come back as a StringArray: checked when the file
    opens, then decoded from the memory map on each use, and equal to the list gguf-py reads."""
    from lollm.gguf.reader import StringArray

    words = [f"tok{i}" if i % 7 else "ünï ✓" for i in range(BIG_ARRAY_LEN + 5)] + [""]
    path = write(tmp_path, "vocab.gguf", GGUFBuilder(kvs=[("t.vocab", ARRAY, (STRING, words))]).build())
    f = GGUFFile(path)
    vocab = f.metadata["t.vocab"]
    assert isinstance(vocab, StringArray) and len(vocab) == len(words)
    assert vocab == words and vocab.tolist() == words and list(vocab) == gguf.GGUFReader(path).fields["t.vocab"].contents()
    assert (vocab[0], vocab[7], vocab[-1], vocab[-2], vocab[3:6]) == (words[0], words[7], "", words[-2], words[3:6])
    with pytest.raises(IndexError):
        vocab[len(words)]
    for chunk in (1, 7, len(words) - 1, len(words), len(words) + 1):  # iteration reads the offsets in chunks
        vocab.ITER_CHUNK = chunk
        assert list(vocab) == words, chunk
    f.close()  # the array keeps its own view of the map
    assert vocab[-2] == words[-2]

    bad = list(words)
    bad[BIG_ARRAY_LEN + 2] = b"h\xffllo"  # not UTF-8, past the first BIG_ARRAY_LEN strings
    path = write(tmp_path, "bad.gguf", GGUFBuilder(kvs=[("t.vocab", ARRAY, (STRING, bad))]).build())
    with pytest.raises(GGUFError, match=rf"string {BIG_ARRAY_LEN + 2} of array 't.vocab' at offset \d+ is not valid UTF-8"):
        GGUFFile(path)


def _rss_file_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_the_header_pages_leave_the_resident_set_and_come_back_when_read(tmp_path):
    """release_header_pages drops the pages the header's reading touched (a 2.6 MB vocabulary) from this
    process's resident memory; the strings still read right afterwards (the pages fault back in)."""
    words = [f"token number {i:07d}" for i in range(130_000)]
    path = write(tmp_path, "vocab.gguf", GGUFBuilder(kvs=[("t.vocab", ARRAY, (STRING, words))]).build())
    f = GGUFFile(path)
    assert f.metadata["t.vocab"] == words  # every page of the header read through the map
    before = _rss_file_kib()
    released = f.release_header_pages()
    after = _rss_file_kib()
    assert released >= f.data_offset - 4096 and released > 2_000_000
    assert before - after >= 0.8 * released / 1024, (before, after, released)
    assert f.metadata["t.vocab"] == words and f.metadata["t.vocab"][-1] == words[-1]
    f.close()
    assert f.release_header_pages() == 0  # a closed file has no map to advise
