"""Real installed distributions: a third-party plugin is routed the moment it is installed.

Each throwaway distribution is built with setuptools and installed with
``pip install --target`` into a private folder; the lollm commands then run
in child processes with that folder on PYTHONPATH. Nothing here depends on
which other lollm distributions (lollm-qwen …) the test venv holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _core_helpers import pip_install, plugin_module, run_lollm, run_python, write_distribution

from lollm.family import CONTRACT_VERSION


@pytest.fixture(scope="session")
def sites(tmp_path_factory) -> dict[str, Path]:
    """One --target folder per throwaway distribution, installed once for the session."""
    root = tmp_path_factory.mktemp("dists")
    projects = {
        "alpha": write_distribution(
            root, "lollm-testplugin-alpha", "tp_alpha", plugin_module(("tp_alpha", ("tp_alpha", "tp_alpha_text")), package="tp_alpha")
        ),
        "dup1": write_distribution(
            root, "lollm-testplugin-dup-one", "tp_dup_one", plugin_module(("tp_dup_one", ("tp_shared",)), package="tp_dup_one")
        ),
        "dup2": write_distribution(
            root, "lollm-testplugin-dup-two", "tp_dup_two", plugin_module(("tp_dup_two", ("tp_shared",)), package="tp_dup_two")
        ),
        "broken": write_distribution(
            root, "lollm-testplugin-broken", "tp_broken",
            "raise RuntimeError('tp_broken cannot start: libfrobnicate.so is missing')\n",
        ),
    }
    return {key: pip_install(project, root / f"site-{key}") for key, project in projects.items()}


def families_json(*site_dirs: Path) -> dict:
    done = run_lollm("families", "--json", sites=site_dirs)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def tiny_checkpoint(folder: Path, model_type: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return folder


def test_an_installed_plugin_is_listed_with_its_distribution(sites):
    data = families_json(sites["alpha"])
    mine = [f for f in data["families"] if f["family"] == "tp_alpha"]
    assert mine == [
        {
            "family": "tp_alpha",
            "model_types": ["tp_alpha", "tp_alpha_text"],
            "gguf_architectures": [],
            "distribution": "lollm-testplugin-alpha",
            "version": "0.0.1",
            "plugin": "tp_alpha",
            "contract": CONTRACT_VERSION,  # the plugin contract the family speaks (a column of the table too)
            "description": "throwaway test family",
        }
    ]
    assert data["broken"] == [b for b in data["broken"] if not b["plugin"].startswith("tp_")]


def test_an_installed_plugin_is_routed_without_any_change_to_core(sites):
    done = run_python(
        """
        import sys
        from lollm.load.plugins import get_registry
        hit = get_registry().route("tp_alpha_text")
        print(hit.family.name, hit.distribution, hit.version, hit.family.load)
        print("torch imported:", "torch" in sys.modules)
        """,
        sites["alpha"],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "tp_alpha lollm-testplugin-alpha 0.0.1 tp_alpha.model:load"
    assert done.stdout.splitlines()[1] == "torch imported: False"


def test_without_the_plugin_its_type_is_unknown(sites, tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", "tp_alpha")
    done = run_lollm("run", "-m", str(ckpt), "-p", "hi", sites=())
    assert done.returncode == 2
    assert "error:" in done.stderr and "'tp_alpha'" in done.stderr and "Traceback" not in done.stderr


def test_the_table_lists_the_installed_plugin(sites):
    done = run_lollm("families", sites=(sites["alpha"],))
    assert done.returncode == 0, done.stderr
    assert "tp_alpha" in done.stdout and "lollm-testplugin-alpha" in done.stdout


def test_two_plugins_claiming_one_type_make_run_fail_naming_both(sites, tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", "tp_shared")
    done = run_lollm("run", "-m", str(ckpt), "-p", "hi", "--no-chat", sites=(sites["dup1"], sites["dup2"]))
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr
    assert "Traceback" not in err
    assert err.startswith("error:")
    assert "'tp_shared'" in err
    assert "lollm-testplugin-dup-one" in err and "lollm-testplugin-dup-two" in err
    assert "'tp_dup_one'" in err and "'tp_dup_two'" in err
    # both are still listed; neither is silently picked
    names = {f["family"] for f in families_json(sites["dup1"], sites["dup2"])["families"]}
    assert {"tp_dup_one", "tp_dup_two"} <= names


def test_a_plugin_that_fails_at_import_is_reported_and_the_others_work(sites):
    data = families_json(sites["alpha"], sites["broken"])
    assert "tp_alpha" in {f["family"] for f in data["families"]}
    broken = [b for b in data["broken"] if b["plugin"] == "tp_broken"]
    assert len(broken) == 1
    assert broken[0]["distribution"] == "lollm-testplugin-broken"
    assert "RuntimeError" in broken[0]["error"] and "libfrobnicate.so is missing" in broken[0]["error"]

    done = run_lollm("families", sites=(sites["alpha"], sites["broken"]))
    assert done.returncode == 0, done.stderr
    assert "tp_alpha" in done.stdout
    assert "tp_broken" in done.stderr and "libfrobnicate.so is missing" in done.stderr
    assert "Traceback" not in done.stderr

    done = run_python(
        """
        from lollm.load.plugins import get_registry
        print(get_registry().route("tp_alpha").family.name)
        """,
        sites["alpha"], sites["broken"],
    )
    assert done.returncode == 0 and done.stdout.strip() == "tp_alpha", done.stderr
