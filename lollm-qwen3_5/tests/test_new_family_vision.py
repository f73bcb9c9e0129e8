"""``lollm new-family NAME --like qwen3_5 | qwen3_5_moe``: the copy takes the ViT beside its folder.

Both families load their tower from ``lollm_qwen3_5/vision_family.py`` (with ``vision.py`` and
``vision_preprocess.py``), beside the family folders; a copy takes those three files beside its own
folder, declares vision in its plugin, and its tests give the kit's vision check a VisionSetup (the
family's tiny image checkpoint, relabelled with the copy's model types). nox's new_family session
installs the copies and runs their whole kits, the vision check included (lollm-gemma's
test_new_family_vision.py does so for a copy of gemma4).
"""

from __future__ import annotations

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

