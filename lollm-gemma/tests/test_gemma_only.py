"""lollm-core + lollm-gemma alone: gemma runs, and a qwen2 checkpoint is refused naming lollm-qwen.

Run it in a virtual environment holding only those two distributions (the nox session
``gemma``; by hand: ``python -m venv v && v/bin/pip install torch==<pinned> &&
v/bin/pip install -e 'lollm-core[parity,test]' -e lollm-gemma``), with
``pytest lollm-gemma/tests -m gemma_only``. In an environment where lollm-qwen is
installed the test FAILS (it proves nothing there) instead of skipping.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from _gemma_testing import tiny_gemma3_270m

pytestmark = pytest.mark.gemma_only


def _lollm(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lollm")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600)


def _family_distributions() -> set[str]:
    return {ep.dist.name for ep in entry_points(group="lollm.families") if ep.dist is not None}


def test_only_gemma_is_installed():
    others = _family_distributions() - {"lollm-gemma"}
    assert not others, (
        f"family distributions {sorted(others)} are installed beside lollm-gemma: this test needs an "
        f"environment with lollm-core and lollm-gemma only; run it in the nox 'gemma' session"
    )


def test_gemma_runs_and_qwen2_is_refused_naming_lollm_qwen(tmp_path):
    assert "lollm-qwen" not in _family_distributions(), (
        "lollm-qwen is installed: run this test in the nox 'gemma' session (lollm-core + lollm-gemma only)"
    )
    from lollm.cli.real_models import derive_safetensors
    from lollm.testing.tiny import write_tiny_checkpoint

    # a tiny random gemma3 with the real Gemma 3 tokenizer (its 262144-piece vocabulary)
    real = derive_safetensors("gemma-3-270m")
    vocab = json.loads((real / "config.json").read_text())["vocab_size"]
    gemma = tmp_path / "tiny-gemma3"
    write_tiny_checkpoint({**tiny_gemma3_270m(), "vocab_size": vocab}, gemma, schema="transformers5")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real / name, gemma / name)
    done = _lollm("run", "-m", str(gemma), "-p", "The capital of France is", "--temperature", "0", "--no-chat", "-n", "8")
    assert done.returncode == 0, done.stderr[-3000:]

    qwen = tmp_path / "qwen2"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    }))
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(512, 64)}, str(qwen / "model.safetensors"))
    done = _lollm("run", "-m", str(qwen), "-p", "hi", "--no-chat", "-n", "4")
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert "qwen2" in done.stderr and "lollm-qwen" in done.stderr, done.stderr[-3000:]
