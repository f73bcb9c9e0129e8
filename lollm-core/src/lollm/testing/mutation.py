"""Mutation tests of the conformance kit: a copy of a family with one deliberate bug must fail it.

A kit that passes a wrong model proves nothing, so each family's tests break a
*copy* of the family on purpose (RoPE scaling ignored, the RoPE base off by a
factor, the norm epsilon ignored, the sliding window off by one, a cached
decode that drops a position) and check that the kit fails it; the unchanged
copy must pass, so each such test can fail::

    from lollm.testing.mutation import copy_family, run_kit

    copy = copy_family("lollm_gemma.gemma3", tmp_path / "src", "mutant_gemma3",
                       {"blocks.py": [("inv_freq = inv_freq / rope.factor", "inv_freq = inv_freq")]})
    run = run_kit("lollm_gemma.gemma3", copy, "gemma3", checkpoint_dir, tmp_path / "kit")
    assert "test_parity_with_the_reference" in run.failed

:func:`copy_family` copies the family's package folder (its modules import
each other relatively, as the design asks) under a new name and replaces
exact pieces of its source, refusing when a piece is not there exactly once
(so a refactor of the family breaks the test loudly instead of making it
test nothing). :func:`run_kit` runs :class:`~lollm.testing.conformance.FamilyConformance`
on the copy, in this process, with ``pytest.main``, and returns each kit
test's outcome and failure message.
"""

from __future__ import annotations

import dataclasses
import importlib
import shutil
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest

from lollm.hookspecs import hookimpl
from lollm.plugins import Registry, build_registry

__all__ = ["KitRun", "copy_family", "mutant_registry", "run_kit", "NUMERIC_TESTS"]

#: The kit tests that can see a wrong number (the others check registration, loading, shapes).
NUMERIC_TESTS = ("test_parity_with_the_reference", "test_cached_decode_matches_the_reference",
                 "test_prefill_all_equals_prefill_then_decode", "test_reference_checkpoint_is_sensitive")


def copy_family(package: str, folder: str | Path, name: str,
                edits: Mapping[str, Sequence[tuple[str, str]]] | None = None) -> str:
    """Copy the family package ``package`` (e.g. ``"lollm_gemma.gemma3"``) to ``folder/name``; return ``name``.

    Every mention of ``package`` in the copy's sources (its manifest's ``LOAD``
    target) becomes ``name``. ``edits``: file name inside the package -> pairs
    ``(old, new)``; each ``old`` must occur exactly once in that file (ValueError
    naming the file and the text otherwise), and is replaced by ``new``.
    """
    source = Path(importlib.import_module(package).__file__).parent
    target = Path(folder) / name
    if target.exists():
        raise ValueError(f"{target} exists already; give each copy its own name")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in target.rglob("*.py"):
        path.write_text(path.read_text(encoding="utf-8").replace(package, name), encoding="utf-8")
    for filename, pairs in (edits or {}).items():
        path = target / filename
        if not path.is_file():
            raise ValueError(f"{package} has no file {filename!r} to edit")
        text = path.read_text(encoding="utf-8")
        for old, new in pairs:
            count = text.count(old)
            if count != 1:
                raise ValueError(f"{package}/{filename}: the text to replace occurs {count} times, not once: {old!r}")
            text = text.replace(old, new)
        path.write_text(text, encoding="utf-8")
    return name


def mutant_registry(package: str, family_name: str, copy: str, folder: str | Path) -> Registry:
    """A registry holding only the installed family ``family_name`` with its loader taken from the copy.

    The copy (made by :func:`copy_family` in ``folder``) is put on ``sys.path``;
    the Family record is the installed one with ``package`` replaced by ``copy``
    in its ``load`` target (and ``parity_reference``, when the family has one
    inside its package).
    """
    folder = str(Path(folder))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.invalidate_caches()
    installed = next((f for f in build_registry().families if f.family.name == family_name), None)
    if installed is None:
        raise LookupError(f"no installed family is named {family_name!r}")
    family = installed.family
    family = dataclasses.replace(
        family, load=family.load.replace(package, copy),
        parity_reference=None if family.parity_reference is None else family.parity_reference.replace(package, copy),
    )
    plugin = types.ModuleType(f"{copy}_plugin")

    @hookimpl
    def lollm_register_families(register):
        register(family)

    plugin.lollm_register_families = lollm_register_families
    return build_registry(entry_points=[], extra_plugins=[(f"{copy}_plugin", plugin)])


@dataclass
class KitRun:
    """The outcome of each kit test on one copy: name -> ("passed" | "failed" | "skipped", message)."""

    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def failed(self) -> dict[str, str]:
        """Failed kit tests -> their failure text (the assertion message, with pytest's report around it)."""
        return {k: text for k, (outcome, text) in self.outcomes.items() if outcome == "failed"}

    @property
    def passed(self) -> list[str]:
        return [k for k, (outcome, _) in self.outcomes.items() if outcome == "passed"]


class _Collector:
    def __init__(self) -> None:
        self.run = KitRun()

    def pytest_runtest_logreport(self, report: Any) -> None:
        name = report.nodeid.split("::")[-1]
        if report.failed:
            self.run.outcomes[name] = ("failed", report.longreprtext)
        elif report.skipped:
            self.run.outcomes[name] = ("skipped", report.longreprtext)
        elif report.when == "call" and name not in self.run.outcomes:
            self.run.outcomes[name] = ("passed", "")


_TEST_FILE = '''
from pathlib import Path

import pytest

from lollm.testing.conformance import FamilyConformance
from lollm.testing.mutation import mutant_registry


class TestCopy(FamilyConformance):
    reference_available = True
{attributes}
    @pytest.fixture
    def registry(self):
        return mutant_registry({package!r}, {family_name!r}, {copy!r}, {folder!r})

    @pytest.fixture
    def family_name(self):
        return {family_name!r}

    @pytest.fixture
    def checkpoint_dir(self):
        return Path({checkpoint!r})
'''


def run_kit(package: str, copy: str, family_name: str, checkpoint_dir: str | Path, workdir: str | Path, *,
            tests: Sequence[str] = NUMERIC_TESTS, attributes: Mapping[str, Any] | None = None) -> KitRun:
    """Run the kit's ``tests`` on the copy ``copy`` of the family package ``package``.

    ``copy`` must have been made by ``copy_family(package, workdir / "src", copy, ...)``. The
    kit runs with ``reference_available = True`` and the class ``attributes`` given
    (e.g. ``{"parity_max_abs_diff": 1e-3}``; each value is written into the test file with
    ``repr``, so plain literals only), on ``checkpoint_dir``, through a nested
    ``pytest.main`` in this process (temporary files under ``workdir``).
    """
    workdir = Path(workdir)
    folder = workdir / "src"
    attrs = "".join(f"    {k} = {v!r}\n" for k, v in (attributes or {}).items())
    test_file = workdir / f"test_kit_on_{copy}.py"
    test_file.write_text(_TEST_FILE.format(attributes=attrs, package=package, family_name=family_name, copy=copy,
                                           folder=str(folder), checkpoint=str(Path(checkpoint_dir))), encoding="utf-8")
    (workdir / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    collector = _Collector()
    args = [str(test_file), "-q", "-p", "no:cacheprovider", "--import-mode=importlib", "--rootdir", str(workdir),
            "-c", str(workdir / "pytest.ini"), "--basetemp", str(workdir / "tmp"), "-k", " or ".join(tests)]
    code = pytest.main(args, plugins=[collector])
    missing = [t for t in tests if t not in collector.run.outcomes]
    if missing:
        raise RuntimeError(f"the kit run on {copy} (pytest exit code {int(code)}, test file {test_file}) did not "
                           f"report {missing}; outcomes: {collector.run.outcomes}")
    return collector.run
