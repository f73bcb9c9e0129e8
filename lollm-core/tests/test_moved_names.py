"""The old flat module names still import, as the same module, with a warning naming the new place."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from lollm._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_is_the_new_module_with_a_deprecation_warning(old):
    code = ("import importlib, warnings, sys\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            f"    old = importlib.import_module({old!r})\n"
            f"new = importlib.import_module({MOVED[old]!r})\n"
            "assert old is new, (old, new)\n"
            "messages = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
            f"assert any({MOVED[old]!r} in m for m in messages), messages\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_from_lollm_import_an_old_module_name_works():
    with pytest.warns(DeprecationWarning, match="lollm.load.options"):
        from lollm import options  # noqa: F401  (an old name, on purpose)
    assert options is importlib.import_module("lollm.load.options")


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lollm.no_such_module")


def test_the_loop_keeps_its_package_level_names():
    from lollm.generate import GenerationResult, generate
    from lollm.generate.loop import GenerationResult as Result, generate as loop_generate
    assert generate is loop_generate and GenerationResult is Result


def test_docs_plugins_lists_every_moved_module():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text(encoding="utf-8")
    missing = [old for old, new in MOVED.items() if f"| `{old}` | `{new}` |" not in page]
    assert not missing, f"docs/plugins.md, section 'Names that moved', lacks: {missing}"


@pytest.mark.parametrize("name", ["lollm.cli.real_models", "lollm.load.real_models", "lollm.testing.real_models"])
def test_python_m_runs_real_models_under_its_new_and_old_names(name):
    done = subprocess.run([sys.executable, "-W", "default", "-m", name, "--help"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "usage: python -m lollm.cli.real_models" in done.stdout, done.stderr
    # run once, as __main__: importing the package lollm.cli must not have imported it already (runpy warns)
    assert "RuntimeWarning" not in done.stderr, done.stderr
    assert ("DeprecationWarning" in done.stderr) == (name == "lollm.load.real_models"), done.stderr
