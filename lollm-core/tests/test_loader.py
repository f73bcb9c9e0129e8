"""The loader: folders, shards, hub repo ids (from a hand-made cache) and every refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lollm.errors import CheckpointError, ConfigError, LollmError
from lollm.load.loader import TensorSource, load_checkpoint, load_folder

CONFIG = {"model_type": "fake", "hidden_size": 4, "eos_token_id": 3}


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(8, 4, generator=g),
        "model.positions": torch.arange(5, dtype=torch.int64),
    }


def write_folder(folder: Path, config: dict | None = CONFIG, weights: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    save_file(weights if weights is not None else tensors(), str(folder / "model.safetensors"))
    return folder


def write_sharded(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    t = tensors()
    shards = {
        "model-00001-of-00002.safetensors": {k: t[k] for k in ("model.embed_tokens.weight", "model.norm.weight")},
        "model-00002-of-00002.safetensors": {k: t[k] for k in ("lm_head.weight", "model.positions")},
    }
    weight_map = {}
    for name, part in shards.items():
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def assert_error(exc_info, kind, *needles):
    exc = exc_info.value
    assert isinstance(exc, kind) and isinstance(exc, LollmError)
    for needle in needles:
        assert str(needle) in str(exc), f"{needle!r} not named in: {exc}"


# -- local folders -----------------------------------------------------------


def test_single_file_folder(tmp_path):
    folder = write_folder(tmp_path / "ckpt")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "eos_token_id": [3, 4]}))
    ck = load_checkpoint(folder)
    assert ck.path == folder and ck.fmt == "safetensors" and ck.spec == str(folder)
    assert ck.config == CONFIG and ck.model_type == "fake"
    assert ck.generation_config == {"temperature": 0.5, "eos_token_id": [3, 4]}
    w = ck.weights
    assert set(w.names()) == set(tensors()) and len(w) == 4 and "lm_head.weight" in w
    assert w.shape("model.embed_tokens.weight") == (8, 4)
    assert w.dtype("model.norm.weight") == "BF16" and w.dtype("model.positions") == "I64"
    for name, t in tensors().items():
        got = w.read(name)
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert w.file_of("lm_head.weight") == folder / "model.safetensors"
    assert w.nbytes() == 8 * 4 * 4 * 2 + 4 * 2 + 5 * 8


def test_generation_config_is_optional(tmp_path):
    assert load_checkpoint(write_folder(tmp_path / "c")).generation_config == {}


def test_a_safetensors_file_path_opens_its_folder(tmp_path):
    folder = write_folder(tmp_path / "ckpt")
    ck = load_checkpoint(folder / "model.safetensors")
    assert ck.path == folder and len(ck.weights) == 4


def test_sharded_folder(tmp_path):
    folder = write_sharded(tmp_path / "sharded")
    ck = load_checkpoint(str(folder))
    w = ck.weights
    assert set(w.names()) == set(tensors())
    assert w.file_of("model.norm.weight").name == "model-00001-of-00002.safetensors"
    assert w.file_of("model.positions").name == "model-00002-of-00002.safetensors"
    assert torch.equal(w.read("lm_head.weight"), tensors()["lm_head.weight"])


def test_shard_listed_in_index_but_missing(tmp_path):
    folder = write_sharded(tmp_path / "sharded")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, "model-00002-of-00002.safetensors", "model.safetensors.index.json")


def test_index_without_weight_map(tmp_path):
    folder = write_sharded(tmp_path / "sharded")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, "model.safetensors.index.json", "weight_map")


def test_same_tensor_in_two_shards(tmp_path):
    folder = tmp_path / "dup"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    save_file({"a.weight": torch.zeros(2)}, str(folder / "one.safetensors"))
    save_file({"a.weight": torch.zeros(2)}, str(folder / "two.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, "a.weight", "one.safetensors", "two.safetensors")


def test_reading_an_unknown_tensor(tmp_path):
    ck = load_checkpoint(write_folder(tmp_path / "c"))
    with pytest.raises(CheckpointError) as info:
        ck.weights.read("model.nope.weight")
    assert_error(info, CheckpointError, "model.nope.weight")


# -- refusals ----------------------------------------------------------------


def test_missing_folder(tmp_path):
    missing = tmp_path / "does" / "not" / "exist"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(missing)
    assert_error(info, CheckpointError, missing)


def test_missing_config_json(tmp_path):
    folder = write_folder(tmp_path / "c", config=None)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, folder / "config.json")


def test_config_without_model_type(tmp_path):
    folder = write_folder(tmp_path / "c", config={"hidden_size": 4})
    with pytest.raises(ConfigError) as info:
        load_checkpoint(folder)
    assert_error(info, ConfigError, folder / "config.json", "model_type")


@pytest.mark.parametrize("text", ["{not json", '{"model_type": "fake",}', ""])
def test_invalid_json(tmp_path, text):
    folder = write_folder(tmp_path / "c", config=None)
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, folder / "config.json", "not valid JSON")


def test_config_that_is_not_an_object(tmp_path):
    folder = write_folder(tmp_path / "c", config=None)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, folder / "config.json", "JSON object")


def test_config_that_is_not_utf8(tmp_path):
    folder = write_folder(tmp_path / "c", config=None)
    (folder / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, folder / "config.json")


def test_invalid_generation_config(tmp_path):
    folder = write_folder(tmp_path / "c")
    (folder / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, folder / "generation_config.json")


@pytest.mark.parametrize("keep", [0, 5, 40, 0.5])
def test_truncated_safetensors(tmp_path, keep):
    folder = write_folder(tmp_path / "c")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, path)


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, "pytorch_model.bin", "pickle", "safetensors")


def test_pickle_file_path_is_refused(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    for name in ("pytorch_model.bin", "model.pt", "weights.pth", "last.ckpt"):
        path = folder / name
        path.write_bytes(b"\x80\x04")
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        assert_error(info, CheckpointError, path, "pickle")


def test_folder_without_any_weights(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    assert_error(info, CheckpointError, folder, "model.safetensors")


def test_other_file_paths_are_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hi")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert_error(info, CheckpointError, path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(gguf)
    assert_error(info, CheckpointError, gguf, "GGUF")


def test_load_folder_rejects_a_file(tmp_path):
    folder = write_folder(tmp_path / "c")
    with pytest.raises(CheckpointError):
        load_folder(folder / "config.json")


def test_tensor_source_reports_an_unreadable_file(tmp_path):
    with pytest.raises(CheckpointError) as info:
        TensorSource([tmp_path / "absent.safetensors"])
    assert_error(info, CheckpointError, "absent.safetensors")


# -- hub repo ids (offline, in a child process: huggingface_hub reads its env at import) --


def run_offline(code: str, hub_cache: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_CACHE=str(hub_cache),
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )


def test_repo_id_offline_and_not_cached(tmp_path):
    done = run_offline(
        """
        from lollm.errors import CheckpointError
        from lollm.load.loader import load_checkpoint
        try:
            load_checkpoint("lollm-test-org/not-cached-model")
        except CheckpointError as exc:
            print("CheckpointError:", exc)
        """,
        tmp_path / "hub",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "CheckpointError:" in done.stdout
    assert "lollm-test-org/not-cached-model" in done.stdout
    assert "HF_HUB_OFFLINE" in done.stdout
    assert "if you meant a local file" not in done.stdout  # a plain repo id gets no path hint


def test_a_missing_local_gguf_that_reads_as_a_repo_id_says_so(tmp_path):
    """'models/x.gguf' is a valid repo id too; when neither exists, the error names the local path it looked for."""
    (tmp_path / "models").mkdir()
    done = run_offline(
        """
        from lollm.errors import CheckpointError
        from lollm.load.loader import load_checkpoint
        for spec in ("models/x.gguf", "models/out", "org/x.safetensors"):
            try:
                load_checkpoint(spec)
            except CheckpointError as exc:
                print("CheckpointError:", exc)
        """,
        tmp_path / "hub",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    hints = [line for line in done.stdout.splitlines() if line.startswith("(if you meant a local file or folder")]
    assert hints == [f"(if you meant a local file or folder: there is no {spec} under {tmp_path})"
                     for spec in ("models/x.gguf", "models/out", "org/x.safetensors")]


def test_repo_id_served_from_the_local_cache(tmp_path):
    hub = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "models--lollm-test-org--tiny-model"
    snapshot = repo / "snapshots" / commit
    write_folder(snapshot)
    (snapshot / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    done = run_offline(
        """
        import json
        from lollm.load.loader import load_checkpoint
        ck = load_checkpoint("lollm-test-org/tiny-model")
        print(json.dumps({"path": str(ck.path), "spec": ck.spec, "type": ck.model_type,
                          "gen": ck.generation_config, "names": sorted(ck.weights.names())}))
        """,
        hub,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(got["path"]).resolve() == snapshot.resolve()
    assert got["spec"] == "lollm-test-org/tiny-model"
    assert got["type"] == "fake" and got["gen"] == {"do_sample": False}
    assert got["names"] == sorted(tensors())


@pytest.mark.parametrize("value", [None, 3, ""])
def test_model_type_must_be_a_string(tmp_path, value):
    folder = write_folder(tmp_path / "c", config={"model_type": value})
    with pytest.raises(ConfigError) as info:
        load_checkpoint(folder)
    assert_error(info, ConfigError, folder / "config.json", "model_type")
