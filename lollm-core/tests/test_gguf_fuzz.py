"""Broken GGUF files: every one ends in GGUFError, fast, with bounded memory.

Three families of cases, all deterministic (fixed seeds):

* hand-made malicious headers: huge counts and lengths, offsets past the end,
  bad alignment, unknown value and tensor types, too many or zero or
  overflowing dimensions, duplicate names …;
* truncations of a small synthetic file at every byte of its header and at
  many points of its data, and of both real files at chosen points;
* random bit flips in the headers (a flip may leave a valid file: then it
  must open, and its tensors dequantize or raise GGUFError).

The bulk run happens in a child process whose heap is capped (RLIMIT_DATA:
its baseline plus 512 MB) so that an attempt to allocate gigabytes shows up
as a MemoryError instead of swapping the machine; the child reports, per
case, the outcome and the CPU time taken, and its peak-RSS growth.

The time bound is a hang detector, not a speed test: it counts the child's
CPU time (time.process_time), which a busy machine does not inflate the way
it inflates wall-clock time, and it sits far above what any case needs (the
slowest clean cases, which dequantize a real file, take one or two seconds).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest_gguf import (
    ARRAY,
    BOOL,
    FLOAT32,
    INT32,
    STRING,
    UINT8,
    UINT32,
    UINT64,
    GGUFBuilder,
    Tensor,
    gstr,
    kv,
    random_tensor_bytes,
    tensor_info,
    u32,
    u64,
)
from lollm.errors import GGUFError
from lollm.gguf import GGUFFile

pytest_plugins = ["conftest_gguf"]

#: CPU seconds one case may take before it counts as a hang (normal cases: well under 2 s).
MAX_CPU_SECONDS = 30.0
MAX_RSS_GROWTH_MB = 200


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + u32(version) + u64(n_tensors) + u64(n_kv)


def one_tensor(info: bytes, data_len: int = 64, n_kv: int = 0, kvs: bytes = b"", n_tensors: int = 1) -> bytes:
    """A file with the given tensor-info bytes, padded to 32, then ``data_len`` zero bytes of data."""
    head = header(n_tensors, n_kv) + kvs + info
    return head + b"\0" * (-len(head) % 32) + b"\0" * data_len


ARCH = kv("general.architecture", STRING, "x")


def malicious_cases() -> list[tuple[str, bytes, str]]:
    """(label, file bytes, regex the error message must match)."""
    deep = gstr("deep") + u32(ARRAY) + (u32(ARRAY) + u64(1)) * 10_000 + u32(UINT8) + u64(0)
    f32 = 0
    cases = [
        # header
        ("empty", b"", "truncated file: 0 bytes"),
        ("three_bytes", b"GGU", "truncated"),
        ("magic_only", b"GGUF", "truncated"),
        ("header_23_bytes", header(0, 0)[:23], "truncated"),
        ("bad_magic", b"GGUG" + header(0, 0)[4:], "not a GGUF file"),
        ("safetensors", b"\x08\0\0\0\0\0\0\0{}" + b"\0" * 30, "not a GGUF file"),
        ("version_0", header(0, 0, version=0), "version 0 is not supported"),
        ("version_1", header(0, 0, version=1), "version 1"),
        ("version_4", header(0, 0, version=4), "version 4 is not supported"),
        ("version_max", header(0, 0, version=2**32 - 1), "is not supported"),
        ("big_endian", b"GGUF" + (3).to_bytes(4, "big") + (0).to_bytes(8, "big") * 2, "big-endian"),
        # counts
        ("huge_tensor_count", header(2**64 - 1, 0), "claims 18446744073709551615 tensors"),
        ("huge_tensor_count_2", header(2**40, 1) + ARCH, "claims 1099511627776 tensors"),
        ("huge_kv_count", header(0, 2**63), "claims 9223372036854775808 metadata keys"),
        ("kv_count_too_big", header(0, 3) + ARCH, "truncated file: the length of metadata key 1"),
        ("tensor_count_too_big", header(2, 0) + tensor_info("a", [4], f32, 0), "claims 2 tensors, more than the 33 bytes left"),
        # strings and arrays
        ("huge_key_length", header(0, 1) + u64(2**62) + b"abc" * 5, "metadata key 0 needs 4611686018427387904 bytes"),
        ("huge_string_value", header(0, 1) + gstr("k") + u32(STRING) + u64(2**63) + b"x", "string value of 'k' needs"),
        ("huge_array_u8", header(0, 1) + gstr("k") + u32(ARRAY) + u32(UINT8) + u64(2**62) + b"\0" * 64,
         "array 'k' claims 4611686018427387904 elements of uint8"),
        ("huge_array_str", header(0, 1) + gstr("k") + u32(ARRAY) + u32(STRING) + u64(10**12) + gstr("a") * 3,
         "array 'k' claims 1000000000000 elements of string"),
        ("huge_array_nested", header(0, 1) + gstr("k") + u32(ARRAY) + u32(ARRAY) + u64(2**50) + b"\0" * 40,
         "array 'k' claims 1125899906842624 elements of array"),
        ("huge_string_in_array", header(0, 1) + gstr("k") + u32(ARRAY) + u32(STRING) + u64(2) + gstr("a") + u64(2**60) + b"zz",
         "string 1 of array 'k' claims 1152921504606846976 bytes"),
        ("deep_nesting", header(0, 1) + deep, "nests arrays more than 8 deep"),
        ("array_unknown_element_type", header(0, 1) + gstr("k") + u32(ARRAY) + u32(13) + u64(1) + b"\0" * 8,
         "array 'k' has unknown value type 13"),
        ("unknown_value_type", header(0, 1) + gstr("k") + u32(13) + b"\0" * 8, "'k' has unknown value type 13"),
        ("unknown_value_type_max", header(0, 1) + gstr("k") + u32(2**32 - 1) + b"\0" * 8, "unknown value type 4294967295"),
        ("bool_2", header(0, 1) + gstr("k") + u32(BOOL) + b"\x02", "bool value of 'k' is 2"),
        ("bool_array_2", header(0, 1) + gstr("k") + u32(ARRAY) + u32(BOOL) + u64(3) + b"\x01\x00\x07",
         "array 'k' holds a bool that is neither 0 nor 1"),
        ("utf8_key", header(0, 1) + gstr(b"\xff\xfe") + u32(UINT8) + b"\0", "metadata key 0 at offset 32 is not valid UTF-8"),
        ("utf8_value", header(0, 1) + gstr("k") + u32(STRING) + gstr(b"ok\xc3"), "string value of 'k'.*not valid UTF-8"),
        ("utf8_in_array", header(0, 1) + gstr("k") + u32(ARRAY) + u32(STRING) + u64(2) + gstr("a") + gstr(b"\x80"),
         "string 1 of array 'k'.*not valid UTF-8"),
        ("duplicate_key", header(0, 2) + kv("k", UINT8, 1) + kv("k", UINT8, 2), "metadata key 'k' appears twice"),
        ("truncated_scalar", header(0, 1) + gstr("k") + u32(UINT64) + b"\0\0\0", "the uint64 value of 'k' needs 8 bytes"),
        # alignment
        ("alignment_zero", header(0, 1) + kv("general.alignment", UINT32, 0), "general.alignment is 0, not a power of two"),
        ("alignment_3", header(0, 1) + kv("general.alignment", UINT32, 3), "general.alignment is 3"),
        ("alignment_2_31_plus_1", header(0, 1) + kv("general.alignment", UINT32, 2**31 + 1), "not a power of two"),
        ("alignment_float", header(0, 1) + kv("general.alignment", FLOAT32, 32.0), "must be a uint32, found a float32"),
        ("alignment_array", header(0, 1) + kv("general.alignment", ARRAY, (UINT32, [32])), "must be a uint32, found a array"),
        # tensor infos
        ("huge_tensor_name", one_tensor(u64(2**61) + b"ab"), "the name of tensor 0 needs 2305843009213693952 bytes"),
        ("utf8_tensor_name", one_tensor(tensor_info(b"w\xff", [4], f32, 0)), "the name of tensor 0 .*not valid UTF-8"),
        ("ndims_5", one_tensor(tensor_info("w", [1, 1, 1, 1, 1], f32, 0)), "'w' has 5 dimensions; ggml allows at most 4"),
        ("ndims_max", one_tensor(gstr("w") + u32(2**32 - 1) + u64(1) * 3), "'w' has 4294967295 dimensions"),
        ("zero_dim", one_tensor(tensor_info("w", [4, 0], f32, 0)), "'w' has dimension 1 = 0"),
        ("dim_over_int64", one_tensor(tensor_info("w", [2**63], f32, 0)), "'w' has dimension 0 = 9223372036854775808"),
        ("dim_max", one_tensor(tensor_info("w", [2**64 - 1], f32, 0)), "dimension 0 = 18446744073709551615"),
        ("product_overflow", one_tensor(tensor_info("w", [2**32, 2**32], f32, 0)), "product overflows int64"),
        ("product_overflow_4d", one_tensor(tensor_info("w", [2**16, 2**16, 2**16, 2**16], f32, 0)), "product overflows int64"),
        ("not_block_multiple", one_tensor(tensor_info("w", [100, 2], 12, 0)),
         "'w' is Q4_K.*first dimension 100 is not a multiple of 256"),
        ("scalar_quantized", one_tensor(tensor_info("w", [], 2, 0)), "'w' is a scalar stored as the block type Q4_0"),
        ("unknown_ggml_type_4", one_tensor(tensor_info("w", [32], 4, 0)), "'w' has unknown ggml type id 4"),
        ("unknown_ggml_type_31", one_tensor(tensor_info("w", [32], 31, 0)), "unknown ggml type id 31"),
        ("unknown_ggml_type_max", one_tensor(tensor_info("w", [32], 2**32 - 1, 0)), "unknown ggml type id 4294967295"),
        ("offset_unaligned", one_tensor(tensor_info("w", [4], f32, 4)),
         "'w' has data offset 4, not a multiple of the alignment 32"),
        ("offset_past_end", one_tensor(tensor_info("w", [4], f32, 2**20)),
         r"'w' \(F32, 16 bytes at offset \d+\) runs past the end"),
        ("offset_huge", one_tensor(tensor_info("w", [4], f32, 2**64 - 32)), "runs past the end of the file"),
        ("size_past_end", one_tensor(tensor_info("w", [2**40], f32, 0)), "4398046511104 bytes at offset"),
        ("size_past_end_by_one", one_tensor(tensor_info("w", [17], f32, 0)), r"68 bytes at offset \d+\) runs past the end"),
        ("duplicate_tensor", one_tensor(tensor_info("w", [4], f32, 0) + tensor_info("w", [4], f32, 32), n_tensors=2),
         "tensor 'w' appears twice"),
        ("overlapping_tensors", one_tensor(tensor_info("a", [16], f32, 0) + tensor_info("b", [4], f32, 32), n_tensors=2),
         "tensors 'a' and 'b' overlap"),
        ("tensor_info_truncated", header(1, 0) + gstr("wwww") + u32(2) + u64(4), "dimension 1 of tensor 'wwww' needs 8 bytes"),
    ]
    return cases


@pytest.mark.parametrize("label, data, pattern", malicious_cases(), ids=[c[0] for c in malicious_cases()])
def test_malicious_header(tmp_path, label, data, pattern):
    path = tmp_path / f"{label}.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=pattern) as exc:
        GGUFFile(path)
    assert str(exc.value).startswith(f"{path}: "), "the message must name the file"


def base_file() -> bytes:
    """A small valid file touching every part of the format (alignment 64, nested arrays, six tensor types)."""
    rng = np.random.default_rng(11)
    kvs = [
        ("general.architecture", STRING, "fuzz"),
        ("general.alignment", UINT32, 64),
        ("fuzz.n", UINT32, 3),
        ("fuzz.eps", FLOAT32, 1e-6),
        ("fuzz.flag", BOOL, 1),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, ["<s>", "</s>", "a", "bé"])),
        ("tokenizer.ggml.token_type", ARRAY, (INT32, [3, 3, 1, 1])),
        ("fuzz.nested", ARRAY, (ARRAY, [(UINT8, [1, 2]), (STRING, ["z"])])),
    ]
    tensors = [
        Tensor("a.f32", [8, 2], "F32", random_tensor_bytes(rng, "F32", 16)),
        Tensor("b.q8_0", [64, 2], "Q8_0", random_tensor_bytes(rng, "Q8_0", 128)),
        Tensor("c.q4_k", [256], "Q4_K", random_tensor_bytes(rng, "Q4_K", 256)),
        Tensor("d.iq2_xxs", [256], "IQ2_XXS", random_tensor_bytes(rng, "IQ2_XXS", 256)),
        Tensor("e.q6_k", [256], "Q6_K", random_tensor_bytes(rng, "Q6_K", 256)),
        Tensor("f.f16", [4], "F16", random_tensor_bytes(rng, "F16", 4)),
    ]
    return GGUFBuilder(kvs=kvs, tensors=tensors, alignment=64).build()


def test_base_file_is_valid(tmp_path):
    path = tmp_path / "base.gguf"
    path.write_bytes(base_file())
    f = GGUFFile(path)
    assert f.alignment == 64 and len(f.tensors) == 6
    assert f.metadata["fuzz.nested"] == [[1, 2], ["z"]]
    for name in f.tensors:
        if name != "d.iq2_xxs":
            assert np.isfinite(f.dequantize_numpy(name)).all()


def _write_cases(folder: Path, qwen: Path, gemma: Path) -> int:
    """Write every case file into ``folder``; return how many.

    The name says what must happen: ``err_`` a GGUFError; ``any_`` a GGUFError or a
    file that opens and whose tensors dequantize (or raise GGUFError); ``anyh_`` the
    same, header only (real files, too big to dequantize for every flip).
    """
    n = 0

    def put(kind: str, label: str, data: bytes) -> None:
        nonlocal n
        (folder / f"{kind}_{n:05d}_{label}.gguf").write_bytes(data)
        n += 1

    for label, data, _ in malicious_cases():
        put("err", label, data)

    base = base_file()
    (folder / "base.gguf").write_bytes(base)
    f = GGUFFile(folder / "base.gguf")
    end = max(t.offset + t.nbytes for t in f.tensors.values())  # cutting the final padding would leave a valid file
    (folder / "base.gguf").unlink()
    for cut in [*range(0, f.data_offset + 1), *range(f.data_offset + 1, end, 7), end - 1]:
        put("err", f"cut{cut}", base[:cut])
    rnd = random.Random(20240611)
    for i in range(1500):
        data = bytearray(base)
        for _ in range(rnd.randint(1, 3)):
            pos = rnd.randrange(f.data_offset)
            data[pos] ^= 1 << rnd.randrange(8)
        put("any", f"flip{i}", bytes(data))
    for i in range(100):  # whole random bytes in place of the header's second half
        data = bytearray(base)
        start = rnd.randrange(24, f.data_offset)
        data[start : start + 16] = rnd.randbytes(16)
        put("any", f"smash{i}", bytes(data))

    for real in (qwen, gemma):
        g = GGUFFile(real)
        head_len = g.data_offset
        end = max(t.offset + t.nbytes for t in g.tensors.values())
        with open(real, "rb") as fh:
            head = fh.read(head_len)
        cuts = [0, 10, 23, 24, 100, 1000, 100_000, head_len // 3, head_len // 2, head_len - 20_000, head_len - 1000,
                head_len - 1, head_len, head_len + 12_345, end // 2, end - 1]
        for cut in cuts:
            path = folder / f"err_{n:05d}_{real.stem}_cut{cut}.gguf"
            n += 1
            with open(path, "wb") as out:
                out.write(head[:cut])
                out.truncate(cut)  # past the header: a sparse file of the right length, nothing written
        for i in range(25):
            data = bytearray(head)
            data[rnd.randrange(24, head_len)] ^= 1 << rnd.randrange(8)
            path = folder / f"anyh_{n:05d}_{real.stem}_flip{i}.gguf"
            n += 1
            with open(path, "wb") as out:
                out.write(data)
                out.truncate(real.stat().st_size)
    return n


WORKER = textwrap.dedent(
    """
    import json, os, resource, sys, time

    def status_bytes(field):
        try:
            for line in open("/proc/self/status"):
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def peak_rss_mb():
        # VmHWM is this process's own peak; ru_maxrss would include the parent's peak before exec
        hwm = status_bytes("VmHWM")
        return hwm / 2**20 if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    import numpy as np
    from lollm.errors import GGUFError
    from lollm.gguf.reader import GGUFFile

    base = status_bytes("VmData")
    if base is not None:
        cap = base + (512 << 20)  # the heap may grow by 512 MB at most; file maps do not count
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    rss0 = peak_rss_mb()
    folder = sys.argv[1]
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        t0 = time.process_time()
        message = ""
        try:
            f = GGUFFile(path)
            outcome = "ok"
            if name.startswith("any_"):
                for tensor in f.tensors:
                    try:
                        f.dequantize_numpy(tensor)
                    except GGUFError:
                        pass
            del f
        except GGUFError as exc:
            outcome, message = "GGUFError", str(exc)
        except BaseException as exc:
            outcome, message = type(exc).__name__, repr(exc)[:300]
        print(json.dumps({"case": name, "outcome": outcome, "message": message[:300], "cpu_seconds": time.process_time() - t0}))
    print(json.dumps({"rss_growth_mb": peak_rss_mb() - rss0, "heap_capped": base is not None}))
    """
)


@pytest.mark.real
def test_fuzz_in_a_memory_capped_child(tmp_path, qwen25_gguf, gemma3_gguf):
    folder = tmp_path / "cases"
    folder.mkdir()
    n = _write_cases(folder, qwen25_gguf, gemma3_gguf)
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", WORKER, str(folder)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    summary, results = lines[-1], lines[:-1]
    assert len(results) == n
    bad, slow = [], []
    outcomes = {"ok": 0, "GGUFError": 0}
    for r in results:
        allowed = {"GGUFError"} if r["case"].startswith("err_") else {"GGUFError", "ok"}
        if r["outcome"] not in allowed:
            bad.append(r)
        else:
            outcomes[r["outcome"]] += 1
        if r["cpu_seconds"] > MAX_CPU_SECONDS:
            slow.append(r)
    assert not bad, f"{len(bad)} cases ended otherwise than allowed, e.g. {bad[:5]}"
    assert not slow, f"{len(slow)} cases took more than {MAX_CPU_SECONDS} s of CPU time (a hang?), e.g. {slow[:5]}"
    assert outcomes["GGUFError"] > 2000 and outcomes["ok"] > 0  # the flips produce both kinds
    assert summary["rss_growth_mb"] < MAX_RSS_GROWTH_MB, summary
    if sys.platform == "linux":
        assert summary["heap_capped"]
