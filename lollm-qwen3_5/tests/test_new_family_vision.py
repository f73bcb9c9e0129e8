"""``lollm new-family NAME --like qwen3_5 | qwen3_5_moe``: the copy takes the ViT beside its folder, and its kit checks it.

Both families load their tower from ``lollm_qwen3_5/vision_family.py`` (with ``vision.py`` and
``vision_preprocess.py``), beside the family folders; a copy takes those three files beside its own
folder, declares vision in its plugin, and its tests give the kit's vision check a VisionSetup (the
family's tiny image checkpoint, relabelled with the copy's model types). The qwen3_5_moe copy is
pip-installed into a private folder and its vision check run (nox's new_family session runs every
copy's whole kit).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lollm.cli.new_family import render


@pytest.mark.parametrize("like", ["qwen3_5", "qwen3_5_moe"])
def test_a_copy_takes_the_tower_beside_its_folder(like, tmp_path):
    rendered = render(f"my_{like}", like, tmp_path)
    src = rendered.folder / f"src/lollm_my_{like}"
    assert sorted(p.name for p in src.glob("vision*.py")) == ["vision.py", "vision_family.py", "vision_preprocess.py"]
    assert f'VISION = "lollm_my_{like}.vision_family:load_vision"' in (src / f"my_{like}/__init__.py").read_text(encoding="utf-8")
    plugin = (src / "plugin.py").read_text(encoding="utf-8")
    assert "vision=True" in plugin and f"vision=my_{like}.VISION," in plugin
    assert f"FIRST_PARTY_VISION['{like}'], relabel=relabel" in (rendered.folder / "tests/test_conformance.py").read_text(encoding="utf-8")


def test_a_copy_of_qwen3_5_moe_passes_the_vision_check(tmp_path):
    rendered = render("my_qwen3_5_moe", "qwen3_5_moe", tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--disable-pip-version-check", "--quiet", "--target", str(site), str(rendered.folder)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-rs", "-p", "no:cacheprovider", "-k", "vision"],
                         cwd=rendered.folder, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-4000:] + run.stderr[-2000:]
