"""``lollm inspect MODEL --json``: the tensor table and per-type totals of a GGUF file and a safetensors folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def _inspect(target: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "lollm.cli", "inspect", str(target), "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.real
def test_real_qwen_gguf_counts_match_models_md():
    """/work/shared/models.md: 291 tensors: F32 121, Q5_0 133, Q8_0 13, Q6_K 12, Q4_K 12."""
    from lollm.cli.real_models import fetch_gguf

    path = fetch_gguf("qwen2.5-coder-0.5b-instruct")
    data = _inspect(path)
    assert data["format"] == "gguf"
    assert len(data["tensors"]) == 291
    assert {k: v["tensors"] for k, v in data["totals"].items()} == {"F32": 121, "Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}
    assert data["total_bytes"] == sum(t["bytes"] for t in data["tensors"])
    assert data["total_bytes"] < path.stat().st_size < data["total_bytes"] + 10_000_000  # the rest: metadata (vocab)
    assert data["metadata"]["general.architecture"] == "'qwen2'"
    row = next(t for t in data["tensors"] if t["name"] == "blk.0.attn_q.weight")
    assert row == {"name": "blk.0.attn_q.weight", "shape": [896, 896], "type": "Q5_0", "bytes": 896 * 896 // 32 * 22}


def test_tiny_gguf_table(tmp_path):
    from lollm.testing.tiny_gguf import write_gguf

    tensors = {
        "a.weight": (np.ones((4, 64), np.float32), "F32"),
        "b.weight": (np.ones((2, 64), np.float32), "F16"),
        "c.weight": (np.ones((3, 64), np.float32), "Q8_0"),
        "d.weight": (np.ones((1, 64), np.float32), "Q5_0"),
    }
    data = _inspect(write_gguf(tmp_path / "t.gguf", "qwen2", {"qwen2.block_count": 1}, tensors))
    assert [(t["name"], t["shape"], t["type"], t["bytes"]) for t in data["tensors"]] == [
        ("a.weight", [4, 64], "F32", 4 * 64 * 4),
        ("b.weight", [2, 64], "F16", 2 * 64 * 2),
        ("c.weight", [3, 64], "Q8_0", 3 * 2 * 34),
        ("d.weight", [1, 64], "Q5_0", 2 * 22),
    ]
    assert data["totals"]["Q8_0"] == {"tensors": 1, "bytes": 204}
    assert data["metadata"]["qwen2.block_count"] == "1"


def test_safetensors_folder_table_matches_the_file(tmp_path):
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {
        "model.embed_tokens.weight": torch.zeros(16, 8, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(8, dtype=torch.float32),
        "lm_head.weight": torch.zeros(16, 8, dtype=torch.float16),
        "position_ids": torch.arange(5, dtype=torch.int64),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    data = _inspect(tmp_path)
    assert data["format"] == "safetensors"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        expected = []
        for name in f.keys():
            t = f.get_tensor(name)
            expected.append({"name": name, "shape": list(t.shape), "bytes": t.numel() * t.element_size(),
                             "type": {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int64: "I64"}[t.dtype]})
    assert sorted(data["tensors"], key=lambda t: t["name"]) == sorted(expected, key=lambda t: t["name"])
    assert data["totals"]["BF16"] == {"tensors": 1, "bytes": 16 * 8 * 2}
    assert data["total_bytes"] == sum(e["bytes"] for e in expected)
    assert data["metadata"]["model_type"] == "'qwen2'"


@pytest.mark.real
def test_tokenize_reads_a_gguf_files_tokenizer(qwen25_dir):
    """`lollm tokenize FILE.gguf` builds the tokenizer from the GGUF metadata; ids equal the folder's."""
    from lollm.cli.real_models import fetch_gguf

    qwen25_gguf = fetch_gguf("qwen2.5-coder-0.5b-instruct")
    text = "def f(x):\n    return x * 2  # 双倍 🤖"
    runs = [
        subprocess.run([sys.executable, "-m", "lollm.cli", "tokenize", str(where), text, "--json"], capture_output=True, text=True)
        for where in (qwen25_gguf, qwen25_dir)
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr
    from_gguf, from_folder = (json.loads(done.stdout) for done in runs)
    assert from_gguf["ids"] == from_folder["ids"] and len(from_gguf["ids"]) > 5


# -- the summary first, natural order, --filter ----------------------------------------------

def _lollm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lollm.cli", *args], capture_output=True, text=True,
                          env={**__import__("os").environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def layered_gguf(tmp_path_factory) -> Path:
    """Eleven blocks' worth of names, written out of order: blk.10 before blk.2 as text sorts them."""
    from lollm.testing.tiny_gguf import write_gguf

    tensors = {"token_embd.weight": (np.ones((4, 64), np.float32), "F32")}
    for i in (10, 2, 1, 0):
        tensors[f"blk.{i}.attn_q.weight"] = (np.ones((2, 64), np.float32), "Q8_0")
        tensors[f"blk.{i}.attn_norm.weight"] = (np.ones(64, np.float32), "F32")
    return write_gguf(tmp_path_factory.mktemp("inspect") / "layers.gguf", "qwen2", {"qwen2.block_count": 11}, tensors)


def test_tensors_come_in_natural_order_and_the_summary_counts_them(layered_gguf):
    data = _inspect(layered_gguf)
    names = [t["name"] for t in data["tensors"]]
    assert names == [f"blk.{i}.{kind}.weight" for i in (0, 1, 2, 10) for kind in ("attn_norm", "attn_q")] + ["token_embd.weight"]
    assert data["summary"] == {"format": "gguf", "architecture": "qwen2", "tensors": 9,
                               "parameters": 4 * 64 + 4 * (2 * 64 + 64), "bytes": data["total_bytes"],
                               "types": {"F32": 5, "Q8_0": 4}}


def test_safetensors_layers_in_natural_order_and_their_model_type(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({f"model.layers.{i}.mlp.up_proj.weight": torch.zeros(2, 3) for i in (10, 2, 1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    data = _inspect(tmp_path)
    assert [t["name"] for t in data["tensors"]] == [f"model.layers.{i}.mlp.up_proj.weight" for i in (1, 2, 10)]
    assert data["summary"]["architecture"] == "qwen2" and data["summary"]["parameters"] == 18


def test_the_text_output_opens_with_the_summary(layered_gguf):
    done = _lollm("inspect", str(layered_gguf))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.index("architecture") < text.index("metadata") < text.index("blk.0.attn_norm.weight")
    assert "Q8_0 4 (" in text and "9 tensors" in text
    assert text.index("blk.2.attn_q.weight") < text.index("blk.10.attn_q.weight")


def test_filter_by_substring_and_by_glob(layered_gguf):
    by_text = _inspect_args(layered_gguf, "--filter", "attn_q")
    assert [t["name"] for t in by_text["tensors"]] == [f"blk.{i}.attn_q.weight" for i in (0, 1, 2, 10)]
    by_glob = _inspect_args(layered_gguf, "--filter", "blk.1*")  # a glob: the whole name, blk.1 and blk.10
    assert [t["name"] for t in by_glob["tensors"]] == [f"blk.{i}.{k}.weight" for i in (1, 10) for k in ("attn_norm", "attn_q")]
    assert by_glob["summary"]["tensors"] == 9  # the summary is the whole checkpoint's
    done = _lollm("inspect", str(layered_gguf), "--filter", "blk.1.*")
    assert done.returncode == 0 and "4 tensors" not in done.stdout and "2 tensors of 9 matching 'blk.1.*'" in done.stdout


@pytest.mark.parametrize("pattern", ["ffn_gate", "blk.99.*", ""])
def test_a_filter_that_matches_nothing_is_one_error_line_naming_it(layered_gguf, pattern):
    done = _lollm("inspect", str(layered_gguf), "--filter", pattern)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --filter") and "Traceback" not in done.stderr
    assert repr(pattern) in lines[0] or "empty" in lines[0]


def _inspect_args(target: Path, *args: str) -> dict:
    done = _lollm("inspect", str(target), "--json", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
