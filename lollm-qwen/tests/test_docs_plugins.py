"""Every command of docs/plugins.md's tutorial, run in order (the page's section "How this page is tested").

The ``console`` blocks of the page are read line by line (``$ COMMAND``) and run
in an empty folder that links the checkout's ``docs/``, so the page's paths work:

* ``lollm``, ``pytest``, ``python`` run with this test's Python;
* ``pip install -e "./X[test]"`` becomes an offline ``pip install --no-deps
  --no-build-isolation --no-index --upgrade --target SITE ./X``: a private folder the later
  commands see through PYTHONPATH, so this venv never changes;
* ``# not run by the tests: WHY`` skips a line (WHY must be given); ``# run in CI by
  nox -s SESSION`` skips a line that SESSION runs on the same files (it must exist).

Runs where lollm-qwen is installed and no ``llama`` family is (nox session ``qwen``):
the tutorial makes its own ``llama`` family.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "plugins.md"
NOT_RUN = re.compile(r"\s+# not run by the tests: (?P<why>\S.*)$")
IN_CI = re.compile(r"\s+# run in CI by nox -s (?P<session>\w+)$")


def console_commands(text: str) -> list[str]:
    """The ``$ `` lines of every ```console block, in page order."""
    commands, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```console"
            continue
        if inside:
            assert line.startswith("$ "), f"a console block line that is not a command: {line!r}"
            commands.append(line[2:])
    return commands


def test_the_page_has_the_tutorial_commands():
    commands = console_commands(PAGE.read_text(encoding="utf-8"))
    assert commands[0] == "lollm new-family llama --like qwen2"
    assert any(c.startswith("python -m build") for c in commands)
    assert any(c.startswith("twine upload") and NOT_RUN.search(c) for c in commands)


def _argv(command: str, site: Path) -> list[str] | None:
    """The argv that runs ``command`` here (None: run it through the shell as written)."""
    words = shlex.split(command)
    if words[:2] == ["pip", "install"]:
        targets = [w for w in words[2:] if w != "-e"]
        assert targets and all(not w.startswith("-") for w in targets), f"unexpected pip flags in {command!r}"
        paths = [re.sub(r"\[[\w,]+\]$", "", t) for t in targets]  # the extras' dependencies are already here
        return [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--upgrade",
                "--disable-pip-version-check", "--quiet", "--target", str(site), *paths]
    if words[0] == "lollm":
        return [sys.executable, "-m", "lollm.cli", *words[1:]]
    if words[0] == "pytest":
        return [sys.executable, "-m", "pytest", *words[1:], "-p", "no:cacheprovider"]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return None


def test_every_console_command_of_the_tutorial_runs(tmp_path):
    from lollm.load.plugins import build_registry

    installed = {f.family.name: f.distribution for f in build_registry().families}
    if "llama" in installed:
        pytest.fail(f"a llama family is installed here ({installed['llama']}); the tutorial makes its own: "
                    f"run this test where it is not (nox -s qwen)", pytrace=False)
    noxfile = (REPO / "noxfile.py").read_text(encoding="utf-8")
    work, site = tmp_path / "work", tmp_path / "site"
    work.mkdir()
    (work / "docs").symlink_to(REPO / "docs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
               NO_COLOR="1", COLUMNS="200", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    ran, skipped = [], []
    for command in console_commands(PAGE.read_text(encoding="utf-8")):
        if (m := NOT_RUN.search(command)) is not None:
            skipped.append(command)
            continue
        if (m := IN_CI.search(command)) is not None:
            assert f"def {m.group('session')}(" in noxfile, f"{command!r}: noxfile.py has no session {m.group('session')!r}"
            skipped.append(command)
            continue
        argv = _argv(command, site)
        done = subprocess.run(argv if argv is not None else command, shell=argv is None, cwd=work, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"$ {command}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        ran.append((command, done.stdout))
    outputs = dict(ran)
    assert "llama" in outputs["lollm families"] and "lollm-llama" in outputs["lollm families"]
    assert list((work / "lollm-llama" / "dist").glob("lollm_llama-0.1.0-py3-none-any.whl"))
    assert len(skipped) == 2 and len(ran) >= 10, (skipped, [c for c, _ in ran])
