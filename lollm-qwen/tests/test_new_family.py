"""``lollm new-family NAME --like qwen2``: the distribution it writes installs and passes its own tests.

The rendered distribution is pip-installed (offline, ``--no-deps --no-build-isolation``)
into a private ``--target`` folder that a child process sees through PYTHONPATH,
so this venv never changes; its own tests (the conformance kit, parity with
transformers included) then run in that child. nox's ``new_family`` session does
the same in a clean venv with a plain ``pip install ./lollm-mine``.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lollm.cli.new_family import NewFamilyError, describe, render


def _run(args: list[str], cwd: Path, site: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_new_family_installs_and_passes_its_own_tests(tmp_path):
    made = _run([sys.executable, "-m", "lollm.cli", "new-family", "mine", "--like", "qwen2"], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    dist = tmp_path / "lollm-mine"
    assert f"wrote {dist.name}/" in made.stdout
    for rel in ("pyproject.toml", "README.md", ".github/workflows/ci.yml", "src/lollm_mine/plugin.py",
                "src/lollm_mine/mine/modeling_mine.py", "src/lollm_mine/mine/parity.py", "tests/test_conformance.py"):
        assert (dist / rel).is_file(), rel
    # the copy is its own: no import of the reference distribution, a model type of its own
    for path in (dist / "src").rglob("*.py"):
        text = path.read_text()
        assert "import lollm_qwen" not in text and "from lollm_qwen" not in text, path
    manifest = (dist / "src/lollm_mine/mine/__init__.py").read_text()
    assert "MODEL_TYPES = ('mine',)" in manifest and "REFERENCE_MODEL_TYPES = {'mine': 'qwen2'}" in manifest

    site = tmp_path / "site"
    pip = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                "--disable-pip-version-check", "--quiet", "--target", str(site), str(dist)], cwd=tmp_path)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    listed = _run([sys.executable, "-m", "lollm.cli", "families", "--json"], cwd=tmp_path, site=site)
    assert '"family": "mine"' in listed.stdout and '"distribution": "lollm-mine"' in listed.stdout, listed.stdout + listed.stderr
    tests = _run([sys.executable, "-m", "pytest", "tests", "-q", "-rs", "-p", "no:cacheprovider"], cwd=dist, site=site)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    # every kit test runs (coverage, the three batched-engine tests and the converter's GGUF included: llama.cpp's
    # converter writes the file under qwen2, the kit relabels it "mine", the copy's own GGUF reader reads it); the
    # one skip is the GGUF mode of lollm's writer, off in a copy (no GGUF writer knows its architecture); two are
    # the kit's vision check, for a family that declares no vision (a copy reads text only)
    assert "27 passed, 3 skipped" in tests.stdout, tests.stdout[-2000:]
    assert "declares no vision (Capabilities.vision is False)" in tests.stdout, tests.stdout[-2000:]
    assert "gguf_types = (): the GGUF mode of lollm's writer is off" in tests.stdout, tests.stdout[-2000:]
    assert "llama.cpp's own converter writes this family's GGUF files" in tests.stdout, tests.stdout[-2000:]


def test_a_copy_of_qwen3_passes_its_own_tests(tmp_path):
    """Any installed family can be the start: qwen3 (explicit head_dim, QK-norm, thinking toggle)."""
    made = _run([sys.executable, "-m", "lollm.cli", "new-family", "my_qwen3", "--like", "qwen3"], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    dist = tmp_path / "lollm-my_qwen3"
    plugin = (dist / "src/lollm_my_qwen3/plugin.py").read_text()
    assert "Capabilities(thinking_toggle=True)" in plugin  # the reference's capabilities are kept
    site = tmp_path / "site"
    pip = _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                "--disable-pip-version-check", "--quiet", "--target", str(site), str(dist)], cwd=tmp_path)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    tests = _run([sys.executable, "-m", "pytest", "tests", "-q", "-rs", "-p", "no:cacheprovider"], cwd=dist, site=site)
    assert tests.returncode == 0 and "27 passed, 3 skipped" in tests.stdout, tests.stdout[-4000:] + tests.stderr[-2000:]


def test_model_type_option_and_class_names(tmp_path):
    rendered = render("my_llama", "qwen2", tmp_path, model_type="my-llama-type")
    pkg = rendered.folder / "src/lollm_my_llama/my_llama"
    assert "MODEL_TYPES = ('my-llama-type',)" in (pkg / "__init__.py").read_text()
    assert "GGUF_ARCHITECTURES = ('my_llama',)" in (pkg / "__init__.py").read_text()
    modeling = (pkg / "modeling_my_llama.py").read_text()
    assert "class MyLlamaForCausalLM" in modeling and "Qwen2ForCausalLM(" not in modeling
    assert 'my_llama = "lollm_my_llama.plugin"' in (rendered.folder / "pyproject.toml").read_text()
    # qwen2 runs batched (cache_layers()), so does the copy: no note; a reference without it gets one
    assert rendered.batched and "cache_layers" in modeling and "note:" not in describe(rendered)
    assert "has no cache_layers() yet" in describe(dataclasses.replace(rendered, batched=False))


@pytest.mark.parametrize("args, message", [
    (["new-family", "Mine", "--like", "qwen2"], "NAME 'Mine' is not a valid family name"),
    (["new-family", "class", "--like", "qwen2"], "NAME 'class' is not a valid family name"),
    (["new-family", "mine", "--like", "nope"], "--like 'nope': no installed family has that name (installed: "),
    (["new-family", "qwen3", "--like", "qwen2"], "NAME 'qwen3' is already the name of an installed family"),
    (["new-family", "mine", "--like", "qwen2", "--model-type", "qwen3"], "model type 'qwen3' is already claimed"),
])
def test_bad_arguments_are_one_error_line(tmp_path, args, message):
    done = _run([sys.executable, "-m", "lollm.cli", *args], cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_existing_folder_is_refused(tmp_path):
    (tmp_path / "lollm-mine").mkdir()
    with pytest.raises(NewFamilyError, match="lollm-mine already exists"):
        render("mine", "qwen2", tmp_path)
    assert list((tmp_path / "lollm-mine").iterdir()) == []
