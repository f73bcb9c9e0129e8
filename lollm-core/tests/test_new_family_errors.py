"""``lollm new-family``'s refusals, wherever lollm-core runs (core alone or with families).

That the distribution it writes installs and passes its own tests is proven where a
family to copy is installed: lollm-qwen/tests/test_new_family.py and nox's new_family session.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, message", [
    (["Mine", "--like", "qwen2"], "NAME 'Mine' is not a valid family name"),
    (["9lives", "--like", "qwen2"], "NAME '9lives' is not a valid family name"),
    (["mine", "--like", "no_such_family"], "--like 'no_such_family': no installed family has that name (installed: "),
])
def test_refusals_are_one_error_line_and_write_nothing(tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "lollm.cli", "new-family", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_is_refused(tmp_path):
    from lollm.cli.new_family import NewFamilyError, render

    (tmp_path / "lollm-mine").mkdir()
    with pytest.raises(NewFamilyError, match="already exists"):
        render("mine", "qwen2", tmp_path)


def _fake_distribution(root, tower_imports: str):
    """A package ``fakedist`` with a family folder ``fam/``, another folder ``other/``, a tower module beside them."""
    for folder in ("fakedist", "fakedist/fam", "fakedist/other"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").write_text("")
    (root / "fakedist/helper.py").write_text("from .fam.blocks import norm\n")
    (root / "fakedist/tower.py").write_text(tower_imports)


def test_the_vision_files_beside_a_family_folder_are_found_and_a_tower_that_is_not_self_contained_is_refused(
        tmp_path, monkeypatch):
    """vision_files: the module Family.vision names, plus each sibling it imports relatively, in turn; a tower
    importing another family's folder, or kept outside the distribution's package, is refused by name."""
    from types import SimpleNamespace

    from lollm.cli.new_family import NewFamilyError, vision_files

    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_distribution(tmp_path, "from .helper import norm\nfrom .fam.blocks import rope\n")
    family = SimpleNamespace(name="fam", vision="fakedist.tower:load_vision")
    assert [p.name for p in vision_files(family, "fakedist.fam", "fakedist")] == ["helper.py", "tower.py"]
    inside = SimpleNamespace(name="fam", vision="fakedist.fam.vision:load_vision")
    assert vision_files(inside, "fakedist.fam", "fakedist") == []  # copied with the folder
    assert vision_files(SimpleNamespace(name="fam", vision=None), "fakedist.fam", "fakedist") == []

    (tmp_path / "fakedist/tower.py").write_text("from .other.blocks import rope\n")
    with pytest.raises(NewFamilyError, match=r"tower.py imports \.other, another part of fakedist"):
        vision_files(family, "fakedist.fam", "fakedist")
    with pytest.raises(NewFamilyError, match="loads its vision tower from 'elsewhere.tower', outside fakedist"):
        vision_files(SimpleNamespace(name="fam", vision="elsewhere.tower:load_vision"), "fakedist.fam", "fakedist")
