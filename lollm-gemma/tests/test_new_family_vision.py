"""``lollm new-family NAME --like gemma3 | gemma4``: the copy keeps its vision tower, and its kit checks it.

gemma3 keeps its SigLIP inside its family folder (``gemma3/vision.py``); gemma4 keeps its tower
beside it (``lollm_gemma/gemma4_vision*.py``), so the copy takes those files beside its own folder.
Either way the copy's plugin declares vision (``Capabilities(vision=True)``, ``vision=``) and its
tests give the kit's vision check a VisionSetup (gemma's tiny image checkpoint, relabelled with the
copy's model types). The gemma4 copy is pip-installed into a private folder and its vision check run
(nox's new_family session runs every copy's whole kit).
"""

from __future__ import annotations

import os
import subprocess
import sys

from lollm.cli.new_family import render


def test_a_copy_of_gemma3_declares_the_tower_of_its_folder(tmp_path):
    rendered = render("my_gemma3", "gemma3", tmp_path)
    src = rendered.folder / "src/lollm_my_gemma3"
    plugin = (src / "plugin.py").read_text(encoding="utf-8")
    assert "Capabilities(vision=True)" in plugin and "vision=my_gemma3.VISION," in plugin
    assert 'VISION = "lollm_my_gemma3.my_gemma3.vision:load_vision"' in (src / "my_gemma3/__init__.py").read_text(encoding="utf-8")
    assert (src / "my_gemma3/vision.py").is_file() and not list(src.glob("*vision*.py"))  # nothing beside the folder
    assert "FIRST_PARTY_VISION['gemma3'], relabel=relabel" in (rendered.folder / "tests/test_conformance.py").read_text(encoding="utf-8")


def test_a_copy_of_gemma4_takes_its_tower_and_passes_the_vision_check(tmp_path):
    rendered = render("my_gemma4", "gemma4", tmp_path)
    src = rendered.folder / "src/lollm_my_gemma4"
    assert sorted(p.name for p in src.glob("*vision*.py")) == [
        "my_gemma4_vision.py", "my_gemma4_vision_contract.py", "my_gemma4_vision_preprocess.py", "my_gemma4_vision_weights.py"]
    assert "from .my_gemma4.blocks import" in (src / "my_gemma4_vision.py").read_text(encoding="utf-8")
    assert 'VISION = "lollm_my_gemma4.my_gemma4_vision_contract:load_vision"' in (src / "my_gemma4/__init__.py").read_text(encoding="utf-8")
    assert "vision=my_gemma4.VISION," in (src / "plugin.py").read_text(encoding="utf-8")

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
