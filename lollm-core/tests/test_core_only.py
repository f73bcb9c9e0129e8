"""lollm-core alone: no family is installed, and the user is told which distribution to install;
nor is the optional extra lollm-core[triton], and ``--attn triton`` says so.

These tests mean something only in a virtual environment where lollm-core is
the only lollm distribution (the nox session ``core_only``); anywhere else
they fail on purpose instead of passing for the wrong reason. Deselect them
there with ``-m "not core_only"``.
"""

from __future__ import annotations

import importlib.metadata as md
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _core_helpers import run_lollm

pytestmark = pytest.mark.core_only


def require_core_only() -> None:
    installed = [f"{ep.name} = {ep.value} ({ep.dist.metadata['Name'] if ep.dist else '?'})"
                 for ep in md.entry_points(group="lollm.families")]
    if installed:
        pytest.fail(
            "test_core_only.py needs a venv where lollm-core is the only lollm distribution, but these "
            f"lollm.families entry points are installed: {'; '.join(installed)}. Run it in the core-only "
            "nox session (nox -s core_only), or deselect it here with -m 'not core_only'.",
            pytrace=False,
        )


def test_no_family_plugin_is_installed():
    require_core_only()
    assert [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] in {"lollm-qwen", "lollm-gemma", "lollm-qwen3_5"}] == []


def test_families_lists_none():
    require_core_only()
    done = run_lollm("families", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"families": [], "broken": [], "conflicts": {}, "install_hints": [],
                                       "load_plugins": None, "skipped": [], "warnings": []}
    done = run_lollm("families")
    assert done.returncode == 0, done.stderr
    assert "No family plugin is installed" in done.stdout


def test_run_on_a_qwen2_checkpoint_names_the_type_and_the_distribution(tmp_path: Path):
    require_core_only()
    folder = tmp_path / "qwen2-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 32,
    }))
    save_file({"model.embed_tokens.weight": torch.zeros(32, 8)}, str(folder / "model.safetensors"))
    done = run_lollm("run", "-m", str(folder), "-p", "hi")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("error:")
    assert "'qwen2'" in done.stderr
    assert "lollm-qwen" in done.stderr and "pip install ./lollm-qwen" in done.stderr
    assert "No family plugin is installed" in done.stderr


def test_attn_triton_without_the_extra_names_it(tmp_path: Path, monkeypatch):
    """Triton really absent here (the nox core_only session installs lollm-core[parity,test] only)."""
    import importlib.util

    require_core_only()
    assert importlib.util.find_spec("triton") is None, "triton is installed: run this test in the core_only nox session"
    for args, env in ((["--attn", "triton"], None), ([], "triton")):
        if env:
            monkeypatch.setenv("LOLLM_ATTN", env)
        done = run_lollm("run", "-m", str(tmp_path / "missing"), "-p", "hi", *args)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("error: ") and "pip install 'lollm-core[triton]'" in line, line
