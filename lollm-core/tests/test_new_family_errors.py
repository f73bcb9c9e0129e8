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
