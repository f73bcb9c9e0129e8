"""Untrusted checkpoint files: only regular files inside the folder are opened, JSON is bounded,
a local ``file.gguf:QUANT`` never goes to the hub. Each refusal names the file."""

from __future__ import annotations

import json
import os
import resource
import sys

import pytest

from lollm.errors import CheckpointError, TokenizerError
from lollm.load.loader import MAX_JSON_BYTES, MAX_JSON_DEPTH, load_checkpoint, read_json

from _core_helpers import write_tiny_tokenizer
from test_loader import write_folder, write_sharded

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs and /dev/zero as Linux has them")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@linux_only
def test_config_json_linked_to_dev_zero_is_refused_at_once(tmp_path):
    folder = write_folder(tmp_path / "ckpt")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")
    start = cpu_seconds()
    with pytest.raises(CheckpointError, match=r"config.json is a character device, not a regular file"):
        load_checkpoint(folder)
    assert cpu_seconds() - start < 5  # a hang guard, far above the normal figure: nothing was read


@linux_only
def test_config_json_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    folder = write_folder(tmp_path / "ckpt")
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # nobody writes to it: opening it for reading would block forever
    with pytest.raises(CheckpointError, match=r"config.json is a FIFO \(named pipe\), not a regular file"):
        load_checkpoint(folder)


def test_a_folder_in_the_place_of_a_checkpoint_file_is_refused(tmp_path):
    folder = write_folder(tmp_path / "ckpt")
    (folder / "generation_config.json").mkdir()
    with pytest.raises(CheckpointError, match=r"generation_config.json is a folder, not a regular file"):
        load_checkpoint(folder)


def test_a_directory_named_tokenizer_config_json_is_an_error_not_a_dropped_template(tmp_path):
    from lollm.tokenizer import load_tokenizer

    folder = write_tiny_tokenizer(tmp_path / "tok")
    assert load_tokenizer(folder).chat_template  # the template is read from tokenizer_config.json
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").mkdir()
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json is a folder, not a regular file"):
        load_tokenizer(folder)


def test_a_broken_link_is_named(tmp_path):
    from lollm.tokenizer import load_tokenizer

    folder = write_tiny_tokenizer(tmp_path / "tok")
    (folder / "chat_template.jinja").symlink_to(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match=r"chat_template.jinja is a broken link"):
        load_tokenizer(folder)


def test_links_to_regular_files_are_followed(tmp_path):
    """The Hugging Face cache is built of links into its blobs folder: those keep working."""
    elsewhere = write_folder(tmp_path / "blobs")
    folder = tmp_path / "snapshot"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(elsewhere / name)
    assert load_checkpoint(folder).config["model_type"] == "fake"


@pytest.mark.parametrize(
    "shard,needle",
    [
        ("../outside.safetensors", "is not inside the checkpoint folder"),
        ("/etc/outside.safetensors", "is not inside the checkpoint folder"),
        ("sub/../../outside.safetensors", "is not inside the checkpoint folder"),
        (1, "names the shard 1; expected a file name"),
        (None, "names the shard None; expected a file name"),
        (["a.safetensors"], "expected a file name"),
    ],
)
def test_a_shard_index_may_name_only_files_inside_the_folder(tmp_path, shard, needle):
    folder = write_sharded(tmp_path / "ckpt")
    write_folder(tmp_path / "outside-folder")  # a real safetensors file the index could point at
    os.link(tmp_path / "outside-folder" / "model.safetensors", tmp_path / "outside.safetensors")
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    assert "model.safetensors.index.json" in str(err.value) and needle in str(err.value)


def test_json_nested_100000_deep_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(CheckpointError, match=r"config.json: its JSON nests too deeply"):
        read_json(path, what="checkpoint config")


def test_json_nested_past_the_limit_but_parseable_is_refused(tmp_path):
    path = tmp_path / "config.json"
    depth = MAX_JSON_DEPTH + 5
    path.write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(CheckpointError, match=rf"config.json: its JSON nests more than {MAX_JSON_DEPTH} levels deep"):
        read_json(path, what="checkpoint config")


def test_a_huge_json_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "config.json"
    with open(path, "wb") as f:  # sparse: takes no disk, and nothing of it is read
        f.truncate(MAX_JSON_BYTES + 1)
    with pytest.raises(CheckpointError, match=rf"config.json is {MAX_JSON_BYTES + 1:,} bytes; lollm reads at most {MAX_JSON_BYTES:,}"):
        read_json(path, what="checkpoint config")


def test_a_local_gguf_with_a_quant_suffix_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    import lollm.load.loader as loader

    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(loader, "hub_gguf_file", no_hub)
    monkeypatch.setattr(loader, "download_repo", no_hub)
    models = tmp_path / "models"
    models.mkdir()
    (models / "file.gguf").write_bytes(b"GGUF")
    for spec in (f"{models / 'file.gguf'}:Q8_0", "models/file.gguf:Q8_0", "models/missing.gguf:Q4_K_M"):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(CheckpointError, match=r"is a local path, and ':Q\w+' picks a quant only among the files of a hub repo"):
            load_checkpoint(spec)
