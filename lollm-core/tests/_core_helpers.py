"""Helpers shared by lollm-core's tests.

* Real distributions: build one, pip-install it into a folder, run lollm there.
  Every install goes to a private ``--target`` folder made visible with
  PYTHONPATH in a child process, so the test venv itself never changes. pip
  runs with ``--no-index --no-deps --no-build-isolation``: it uses the
  setuptools of this venv and never touches the network.
* A tiny byte-level BPE tokenizer folder, trained with the ``tokenizers``
  library (lollm-core's ``test`` extra): :func:`lollm.testing.tiny.write_tiny_tokenizer`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "{version}"
dependencies = ["lollm-core"]

[project.entry-points."lollm.families"]
{ep_name} = "{package}.plugin"

[tool.setuptools.packages.find]
where = ["src"]
"""


def plugin_module(*families: tuple[str, tuple[str, ...]], package: str) -> str:
    """Source of a plugin module registering ``(family name, model types)`` pairs; it imports no torch."""
    records = ",\n        ".join(
        f"Family(name={name!r}, contract=CONTRACT_VERSION, model_types={types!r}, "
        f"load={package + '.model:load'!r}, description='throwaway test family')"
        for name, types in families
    )
    return textwrap.dedent(
        f"""\
        from lollm.family import CONTRACT_VERSION, Family
        from lollm.hookspecs import hookimpl


        @hookimpl
        def lollm_register_families(register):
            for family in [
                {records}
            ]:
                register(family)
        """
    )


def write_distribution(root: Path, dist: str, package: str, plugin_source: str, *, ep_name: str | None = None,
                       version: str = "0.0.1", extra_files: dict[str, str] | None = None) -> Path:
    """A project folder for distribution ``dist`` with ``src/<package>/plugin.py`` = ``plugin_source``."""
    project = root / dist
    pkg = project / "src" / package
    pkg.mkdir(parents=True)
    (project / "pyproject.toml").write_text(
        PYPROJECT.format(dist=dist, version=version, ep_name=ep_name or package, package=package)
    )
    (pkg / "__init__.py").write_text("")
    (pkg / "plugin.py").write_text(plugin_source)
    for name, text in (extra_files or {}).items():
        (pkg / name).write_text(text)
    return project


def pip_install(project: Path, target: Path) -> Path:
    """``pip install --target`` one project folder (offline); returns ``target``."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(target), str(project)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"pip install {project} failed:\n{done.stdout}\n{done.stderr}"
    return target


def child_env(*sites: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process that sees the given --target folders."""
    env = dict(os.environ)
    paths = [str(s) for s in sites] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["NO_COLOR"] = "1"
    env["COLUMNS"] = "200"
    env["TERM"] = "dumb"
    env.update(extra)
    return env


def run_python(code: str, *sites: Path, cwd: Path | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=child_env(*sites), cwd=cwd, timeout=timeout)


def run_lollm(*args: str, sites: tuple[Path, ...] = (), cwd: Path | None = None, timeout: int = 300,
              stdin: str | None = None) -> subprocess.CompletedProcess:
    """``python -m lollm.cli ARGS`` in a child process seeing ``sites``."""
    return subprocess.run([sys.executable, "-m", "lollm.cli", *args], capture_output=True, text=True,
                          env=child_env(*sites), cwd=cwd, timeout=timeout, input=stdin)


# the tiny tokenizer lives in lollm.testing.tiny, for the family distributions' tests too
from lollm.testing.tiny import CHAT_TEMPLATE, write_tiny_tokenizer  # noqa: E402,F401


# -- hang and memory guards for in-process tests ------------------------------------


class CpuTimeExceeded(Exception):
    """Raised inside a test that used more CPU time than :func:`cpu_time_limit` allows."""


@contextlib.contextmanager
def cpu_time_limit(seconds: float):
    """Fail (CpuTimeExceeded) instead of hanging once the process has used ``seconds`` of CPU time here.

    A hang guard, not a speed test: SIGPROF fires after ``seconds`` of CPU time
    (all threads of the process), which a loaded machine does not inflate the
    way it inflates wall-clock time. Main thread, Linux and macOS.
    """
    def expired(signum, frame):
        raise CpuTimeExceeded(f"more than {seconds} s of CPU time")

    previous = signal.signal(signal.SIGPROF, expired)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@contextlib.contextmanager
def peak_python_memory(limit_mb: float):
    """Fail (AssertionError) when the Python allocations made here peak above ``limit_mb`` (tracemalloc)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        if started:
            tracemalloc.stop()
    assert (peak - base) / 2**20 < limit_mb, f"Python allocations peaked at {(peak - base) / 2**20:.0f} MB (limit {limit_mb} MB)"


def write_site(site: Path, dist: str, version: str, entry_points: dict[str, str], packages: dict[str, Path | dict[str, str]]) -> Path:
    """A folder importlib.metadata reads as an installed distribution, without pip (fast).

    ``entry_points`` maps entry-point names of the group ``lollm.families`` to
    their targets; ``packages`` maps package names to a folder to copy or to
    ``{file name: source}``. Put ``site`` on PYTHONPATH (see :func:`child_env`).
    """
    import shutil

    site.mkdir(parents=True, exist_ok=True)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = ["[lollm.families]"] + [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for name, content in packages.items():
        if isinstance(content, Path):
            shutil.copytree(content, site / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (site / name).mkdir()
            for file, source in content.items():
                (site / name / file).write_text(textwrap.dedent(source))
    return site


def write_toy_checkpoint(folder: Path) -> Path:
    """A tiny lollm-toy checkpoint in ``folder/toy`` (the example plugin's config and weights, a tiny tokenizer)."""
    import json

    from safetensors.torch import save_file

    from test_example_plugin import CONFIG, toy_tensors

    checkpoint = folder / "toy"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(CONFIG))
    save_file(toy_tensors(CONFIG), str(checkpoint / "model.safetensors"))
    write_tiny_tokenizer(checkpoint, vocab_size=CONFIG["vocab_size"], chat_template=False)
    return checkpoint
