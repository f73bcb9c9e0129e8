"""Hostile checkpoints, third round (issue 22, classes 5 and 9): each ends in one error naming the
file and the key, entry or tensor, never a traceback; a file of many tensors reads in linear time.

* loader: a ``config.json`` that is a folder, a NUL or a ``.`` in a shard index's ``weight_map``,
  a tensor the safetensors header lists twice;
* tokenizer.json and tokenizer_config.json parts of the wrong JSON type;
* GGUF tokenizer errors name the file; text that is not UTF-8 is called that, with its offset;
* :class:`lollm.load.loader.TensorSource` reads each tensor from its offsets (the header is parsed
  once), so the work of opening and reading a file grows with its number of tensors, not its square.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lollm.errors import CheckpointError, TokenizerError
from lollm.load.loader import TensorSource, load_checkpoint

from _core_helpers import run_lollm, write_tiny_tokenizer
from conftest_gguf import ARRAY, INT32, STRING, GGUFBuilder
from test_loader import write_folder, write_sharded

# ------------------------------------------------------------------ loader


def test_a_config_json_that_is_a_folder_is_named(tmp_path):
    folder = write_folder(tmp_path / "ckpt")
    (folder / "config.json").unlink()
    (folder / "config.json").mkdir()
    with pytest.raises(CheckpointError, match=r"config.json is a folder, not a regular file"):
        load_checkpoint(folder)


def _index_with(folder: Path, shard) -> Path:
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = shard
    index.write_text(json.dumps(data))
    return index


@pytest.mark.parametrize(
    "shard,needle",
    [
        ("model-00001-of-00002.safetensors\0.txt", "holds a control character"),
        ("\0", "holds a control character"),
        (".", "is not a file name"),
        ("./", "is not a file name"),
        ("sub/", "is not a file name"),
        ("sub/.", "is not a file name"),
        ("a//model.safetensors", "is not a file name"),
    ],
)
def test_a_weight_map_entry_that_names_no_file_is_named(tmp_path, shard, needle):
    folder = write_sharded(tmp_path / "ckpt")
    (folder / "sub").mkdir()
    _index_with(folder, shard)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    message = str(err.value)
    assert "model.safetensors.index.json" in message and repr(shard) in message and needle in message, message


def test_a_weight_map_entry_that_is_a_folder_names_the_index_and_the_entry(tmp_path):
    folder = write_sharded(tmp_path / "ckpt")
    (folder / "sub").mkdir()
    _index_with(folder, "sub")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    assert "model.safetensors.index.json lists shard 'sub'" in str(err.value)
    assert "sub is a folder, not a regular file" in str(err.value)


def _raw_safetensors(path: Path, entries: list[tuple[str, dict]], data: bytes) -> Path:
    """A safetensors file written byte by byte (the library cannot write a name twice)."""
    body = "{" + ",".join(f"{json.dumps(name)}:{json.dumps(info)}" for name, info in entries) + "}"
    header = body.encode() + b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_a_tensor_listed_twice_in_the_header_is_named(tmp_path):
    folder = write_folder(tmp_path / "ckpt")
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    _raw_safetensors(folder / "model.safetensors",
                     [("model.norm.weight", entry), ("model.norm.weight", {**entry, "data_offsets": [8, 16]})], bytes(16))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    assert "model.safetensors: the header lists the tensor 'model.norm.weight' twice" in str(err.value)
    assert "incomplete metadata" not in str(err.value)


def test_a_header_written_by_hand_reads_like_the_library(tmp_path):
    entries = [("b", {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}),
               ("__metadata__", {"format": "pt"}),
               ("a", {"dtype": "I16", "shape": [1, 2], "data_offsets": [8, 12]})]
    data = struct.pack("<2f", 1.5, -2.0) + struct.pack("<2h", 7, -8)
    source = TensorSource([_raw_safetensors(tmp_path / "m.safetensors", entries, data)])
    assert source.names() == ["a", "b"]  # sorted, as safetensors' keys() gives them
    assert source.read("b").tolist() == [1.5, -2.0] and source.read("a").tolist() == [[7, -8]]


# --------------------------------------------- reading by offsets: same tensors as the library


def test_read_and_read_slice_match_the_library(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(6, 5, 4, generator=g),
        "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "i64": torch.arange(-5, 7, dtype=torch.int64).view(3, 4),
        "u8": torch.arange(10, dtype=torch.uint8),
        "bool": torch.tensor([[True, False], [False, True]]),
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(3.25),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    source, expected = TensorSource([path]), load_file(str(path))
    for name, tensor in expected.items():
        got = source.read(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
    full = expected["f32"]
    for dim in range(3):
        ranges = [(0, 1), (2, full.shape[dim])]
        want = torch.cat([full.narrow(dim, a, b - a) for a, b in ranges], dim=dim)
        assert torch.equal(source.read_slice("f32", dim, ranges), want), dim
    assert torch.equal(source.read_slice("bf16", 1, [(1, 3)]), expected["bf16"][:, 1:3])
    with pytest.raises(CheckpointError, match=r"tensor 'f32' of shape \(6, 5, 4\) has no slice"):
        source.read_slice("f32", 0, [(0, 7)])
    with pytest.raises(CheckpointError, match=r"no tensor named 'nope'"):
        source.read("nope")


def test_a_file_truncated_after_it_was_opened_is_named(tmp_path):
    folder = write_folder(tmp_path / "ckpt")
    source = load_checkpoint(folder).weights
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"model.safetensors: the file ends inside tensor"):
        for name in source.names():
            source.read(name)


# ---------------------------------------------------- many tensors: linear, not quadratic


def _many_tensors(path: Path, count: int) -> Path:
    save_file({f"model.layers.{i}.weight": torch.full((2,), float(i)) for i in range(count)}, str(path))
    return path


def _open_and_read_all(path: Path) -> float:
    """CPU seconds to build a TensorSource over ``path`` and read every tensor of it (best of 3)."""
    best = float("inf")
    for _ in range(3):
        gc.collect()
        start = time.process_time()
        source = TensorSource([path])
        for name in source.names():
            source.read(name)
        best = min(best, time.process_time() - start)
    return best


def test_the_header_is_parsed_once_however_many_tensors_are_read(tmp_path, monkeypatch):
    """Work bounded by counting: the safetensors library opens (and parses the header of) the file
    once; before, it did so again for every tensor's shape and every read, n + n times in all."""
    import safetensors

    path = _many_tensors(tmp_path / "m.safetensors", 500)
    opened = []
    real_open = safetensors.safe_open

    def counting_open(*args, **kwargs):
        opened.append(args[0])
        return real_open(*args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting_open)
    source = TensorSource([path])
    values = [source.read(name)[0].item() for name in source.names()]
    assert sorted(values) == [float(i) for i in range(500)]
    assert len(opened) == 1, f"the file was opened through safetensors {len(opened)} times for 500 tensors"


def test_reading_many_tensors_takes_time_linear_in_their_number(tmp_path):
    """4x the tensors may cost at most 8x the CPU time (linear: about 4x; the old quadratic read: 14x
    and more). CPU time, best of three runs, so other processes on the machine do not count."""
    small = _open_and_read_all(_many_tensors(tmp_path / "small.safetensors", 1000))
    large = _open_and_read_all(_many_tensors(tmp_path / "large.safetensors", 4000))
    assert large < 8 * small + 0.05, f"1,000 tensors: {small:.3f} s CPU; 4,000 tensors: {large:.3f} s CPU"


# ------------------------------------------------------------ tokenizer.json of the wrong shape


def _set(path: list, value):
    """A change to tokenizer.json: put ``value`` at ``path`` (keys and list indices)."""
    def change(data: dict) -> None:
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


#: (change to the tiny tokenizer.json, the text the error must hold besides the file's name)
TOKENIZER_JSON_CASES = {
    "model a list": (_set(["model"], [1, 2]), "'model' must be an object, not a list"),
    "vocab a string": (_set(["model", "vocab"], "abc"), "model: 'vocab' must be an object, not a string"),
    "merges an object": (_set(["model", "merges"], {"a": "b"}), "model: 'merges' must be a list, not an object"),
    "added_tokens an object": (_set(["added_tokens"], {"id": 5, "content": "<x>"}), "'added_tokens' must be a list, not an object"),
    "unk_token a list": (_set(["model", "unk_token"], ["<unk>"]), "model: 'unk_token' must be a string, not a list"),
    "byte_fallback a string": (_set(["model", "byte_fallback"], "false"), "'byte_fallback' must be true or false, not a string"),
    "added token special a string": (_set(["added_tokens", 0, "special"], "no"), "added_tokens[0]: 'special' must be true or false"),
    "added token content empty": (_set(["added_tokens", 0, "content"], ""), "added_tokens[0]: 'content' is empty"),
    "ByteLevel flag a string": (_set(["pre_tokenizer", "add_prefix_space"], "false"), "'add_prefix_space' must be true or false"),
    "normalizers a number": (_set(["normalizer"], {"type": "Sequence", "normalizers": 5}), "'normalizers' must be a list"),
    "pretokenizers a number": (_set(["pre_tokenizer"], {"type": "Sequence", "pretokenizers": 5}), "'pretokenizers' must be a list"),
    "processors a number": (_set(["post_processor"], {"type": "Sequence", "processors": 5}), "'processors' must be a list"),
    "template item a string": (
        _set(["post_processor"], {"type": "TemplateProcessing", "single": [{"Sequence": "A"}], "special_tokens": {}}),
        "post_processor template item {'Sequence': 'A'} is not understood",
    ),
    "template special token a string": (
        _set(["post_processor"], {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}},
                                                                           {"Sequence": {"id": "A"}}],
                                  "special_tokens": {"<s>": "1"}}),
        "post_processor uses special token '<s>' without its ids",
    ),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_JSON_CASES))
def test_tokenizer_json_parts_of_the_wrong_type_are_named(tmp_path, case):
    from lollm.tokenizer import load_tokenizer

    change, needle = TOKENIZER_JSON_CASES[case]
    folder = write_tiny_tokenizer(tmp_path / "tok")
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(folder)
    assert str(path) in str(err.value) and needle in str(err.value), str(err.value)


@pytest.mark.parametrize("key,value,needle", [
    ("add_bos_token", "yes", "'add_bos_token' must be true or false, not a string"),
    ("tokenizer_class", ["GPT2Tokenizer"], "'tokenizer_class' must be a string, not a list"),
    ("add_prefix_space", 1, "'add_prefix_space' must be true or false, not a number"),
])
def test_tokenizer_config_values_of_the_wrong_type_are_named(tmp_path, key, value, needle):
    """tokenizer_config.json; tokenizer_class and add_prefix_space matter to vocab.json + merges.txt."""
    from lollm.tokenizer import load_tokenizer

    folder = write_tiny_tokenizer(tmp_path / "tok")
    model = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"]), encoding="utf-8")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("\n".join(merges) + "\n", encoding="utf-8")
    (folder / "tokenizer.json").unlink()
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    load_tokenizer(folder)  # the GPT-2 style folder loads as it is
    config[key] = value
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(folder)
    assert str(config_path) in str(err.value) and needle in str(err.value), str(err.value)


# ------------------------------------------------------------------ GGUF tokenizers


def _gguf(path: Path, *kvs) -> Path:
    path.write_bytes(GGUFBuilder(kvs=[("general.architecture", STRING, "fake"), *kvs]).build())
    return path


def test_a_gguf_checkpoint_s_tokenizer_errors_name_the_file(tmp_path):
    path = _gguf(tmp_path / "model.gguf", ("tokenizer.ggml.model", STRING, "bert"))
    checkpoint = load_checkpoint(path)
    with pytest.raises(TokenizerError) as err:
        checkpoint.tokenizer
    assert str(err.value).startswith(f"GGUF file {path}: "), str(err.value)


def test_a_gguf_error_raised_deep_in_the_tokenizer_still_names_the_file(tmp_path):
    from lollm.tokenizer import load_gguf_tokenizer

    path = _gguf(tmp_path / "model.gguf", ("tokenizer.ggml.model", STRING, "gpt2"), ("tokenizer.ggml.pre", STRING, "qwen2"),
                 ("tokenizer.ggml.tokens", ARRAY, (STRING, ["", "a"])), ("tokenizer.ggml.token_type", ARRAY, (INT32, [3, 1])),
                 ("tokenizer.ggml.merges", ARRAY, (STRING, [])))
    for load in (lambda: load_gguf_tokenizer(path), lambda: load_checkpoint(path).tokenizer):
        with pytest.raises(TokenizerError) as err:
            load()
        assert str(err.value).startswith(f"GGUF file {path}: ") and "empty content" in str(err.value), str(err.value)


def test_gguf_token_types_and_scores_of_the_wrong_type_are_named(tmp_path):
    from lollm.tokenizer import load_gguf_tokenizer

    base = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"], "tokenizer.ggml.token_type": [2, 1]}
    for key, value, needle in (("tokenizer.ggml.token_type", ["2", "1"], "token_type must be a list of integers"),
                               ("tokenizer.ggml.scores", ["x", 0.0], "scores must be a list of finite numbers")):
        with pytest.raises(TokenizerError, match=needle):
            load_gguf_tokenizer({**base, key: value}, source="GGUF file m.gguf")


# ------------------------------------------------------------------ invalid UTF-8 in the text


def test_invalid_utf8_is_called_that_with_its_byte_offset(tmp_path):
    from lollm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(write_tiny_tokenizer(tmp_path / "tok"))
    text = os.fsdecode(b"h\xc3\xa9llo \xff world")  # how Python hands over a command-line argument
    with pytest.raises(TokenizerError) as err:
        tokenizer.encode(text)
    assert "not valid UTF-8: byte 0xFF at byte offset 7" in str(err.value) and "lone surrogate" not in str(err.value)
    with pytest.raises(TokenizerError, match=r"lone surrogate U\+D800 at character 4 \(byte offset 4\)"):
        tokenizer.encode("bad \ud800 text")  # a real lone surrogate (JSON "\ud800") keeps its name


@pytest.mark.skipif(sys.platform == "win32", reason="command-line arguments as bytes are POSIX's")
def test_the_cli_names_invalid_utf8_in_an_argument(tmp_path):
    folder = write_tiny_tokenizer(tmp_path / "tok")
    done = run_lollm("tokenize", str(folder), os.fsdecode(b"ok \xe2\x82 then"), timeout=120)
    assert done.returncode == 2, done.stderr
    assert "error: the text is not valid UTF-8: byte 0xE2 at byte offset 3" in done.stderr
    assert "Traceback" not in done.stderr
