"""The loader's GGUF paths: a local file, split files, and ``org/name:QUANT`` from a Hugging Face cache.

The GGUF files are tiny ones written with gguf-py's GGUFWriter
(:mod:`lollm.testing.tiny_gguf`); the hub tests lay out a Hugging Face cache by
hand and resolve against it with ``HF_HUB_OFFLINE=1`` in a child process (so
``HF_HUB_CACHE`` is read fresh by huggingface_hub).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lollm.errors import CheckpointError
from lollm.hookspecs import hookimpl


def tiny_qwen2_gguf(path: Path, name: str = "tiny") -> Path:
    """A minimal GGUF that says it is a qwen2 model (metadata and one tensor; enough to open and route)."""
    from lollm.testing.tiny_gguf import write_gguf

    meta = {"general.name": name, "qwen2.block_count": 1, "qwen2.embedding_length": 32}
    return write_gguf(path, "qwen2", meta, {"token_embd.weight": (np.ones((8, 32), np.float32), "Q8_0")})


class _GGUFOnlyPlugin:
    """A stand-in plugin that serves the GGUF architecture 'qwen2' (core's tests run without lollm-qwen)."""

    @staticmethod
    @hookimpl
    def lollm_register_families(register):
        from lollm.family import CONTRACT_VERSION, Family

        register(Family(name="stand_in", contract=CONTRACT_VERSION, model_types=("stand_in",),
                        gguf_architectures=("qwen2",), load="stand_in:load"))


def test_local_gguf_opens_and_routes_by_architecture(tmp_path, monkeypatch):
    from lollm.load import plugins
    from lollm.load.loader import load_checkpoint
    from lollm.load.pipeline import route

    monkeypatch.setattr(plugins, "_REGISTRY", plugins.build_registry(entry_points=[], extra_plugins=[("stand_in", _GGUFOnlyPlugin)]))

    path = tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    ckpt = load_checkpoint(str(path))
    assert ckpt.fmt == "gguf" and ckpt.model_type == "qwen2" and ckpt.path == tmp_path
    assert ckpt.config["qwen2.block_count"] == 1
    assert ckpt.weights.names() == ["token_embd.weight"]
    assert ckpt.weights.dtype("token_embd.weight") == "Q8_0"
    assert ckpt.weights.read("token_embd.weight").shape == (8, 32)
    assert route(ckpt).family.name == "stand_in"  # routed by general.architecture, not by a model_type


def test_gguf_without_architecture_is_refused(tmp_path):
    import gguf

    from lollm.errors import ConfigError
    from lollm.load.loader import load_checkpoint

    path = tmp_path / "noarch.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.kv_data[0].pop("general.architecture")
    writer.add_tensor("x", np.ones(32, np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ConfigError, match="general.architecture"):
        load_checkpoint(str(path))


def test_split_file_is_refused_naming_the_merge_step(tmp_path):
    from lollm.load.loader import load_checkpoint

    path = tiny_qwen2_gguf(tmp_path / "x-00001-of-00002.gguf")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(str(path))
    message = str(info.value)
    assert "part 1 of a GGUF split into 2 files" in message
    assert "llama-gguf-split --merge" in message


# ------------------------------------------------------------------ org/name:QUANT from a hand-made HF cache

REVISION = "0123456789abcdef0123456789abcdef01234567"


def _hub_repo(cache: Path, repo_id: str, files: list[str]) -> None:
    """Lay out ``models--org--name`` with refs/main and one snapshot holding ``files``."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    for name in files:
        tiny_qwen2_gguf(snapshot / name, name=name)


RESOLVE = textwrap.dedent("""
    import json, sys
    from lollm.load.loader import load_checkpoint
    out = {}
    for spec in sys.argv[1:]:
        try:
            ckpt = load_checkpoint(spec)
            out[spec] = {"ok": ckpt.config["general.name"], "fmt": ckpt.fmt, "path": str(ckpt.weights.gguf.path)}
        except Exception as exc:
            out[spec] = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("hf-cache")
    _hub_repo(cache, "org/name", ["name-Q8_0.gguf", "name-F16.gguf"])
    _hub_repo(cache, "org/several", ["several-Q8_0.gguf", "several-Q8_0-imat.gguf", "several-F16.gguf"])
    _hub_repo(cache, "org/split", ["split-Q4_K_M-00001-of-00002.gguf", "split-Q4_K_M-00002-of-00002.gguf"])
    specs = ["org/name:Q8_0", "org/name:f16", "org/name:Q4_K_M", "org/several:Q8_0", "org/split:Q4_K_M", "org/absent:Q8_0"]
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent)}
    done = subprocess.run([sys.executable, "-c", RESOLVE, *specs], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hub_quant_picks_the_matching_file(resolved):
    got = resolved["org/name:Q8_0"]
    assert got.get("ok") == "name-Q8_0.gguf", got
    assert got["fmt"] == "gguf" and got["path"].endswith("name-Q8_0.gguf")


def test_hub_quant_is_case_insensitive(resolved):
    assert resolved["org/name:f16"].get("ok") == "name-F16.gguf", resolved["org/name:f16"]


def test_hub_quant_without_match_lists_the_files(resolved):
    got = resolved["org/name:Q4_K_M"]
    assert got.get("error") == "CheckpointError", got
    assert "no .gguf file carries the quant 'Q4_K_M'" in got["message"]
    assert "name-Q8_0.gguf" in got["message"] and "name-F16.gguf" in got["message"]


def test_hub_quant_with_several_matches_lists_them(resolved):
    got = resolved["org/several:Q8_0"]
    assert got.get("error") == "CheckpointError", got
    assert "several .gguf files carry the quant 'Q8_0'" in got["message"]
    for name in ("several-Q8_0.gguf", "several-Q8_0-imat.gguf", "several-F16.gguf"):
        assert name in got["message"]


def test_hub_quant_of_a_split_file_names_the_merge_step(resolved):
    got = resolved["org/split:Q4_K_M"]
    assert got.get("error") == "CheckpointError", got
    assert "llama-gguf-split --merge" in got["message"]


def test_hub_repo_absent_from_the_offline_cache(resolved):
    got = resolved["org/absent:Q8_0"]
    assert got.get("error") == "CheckpointError", got
    assert "org/absent" in got["message"] and "HF_HUB_OFFLINE" in got["message"]
