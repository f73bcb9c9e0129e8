"""``lollm new-family`` against hostile names and targets (issue 22, class 4).

Each refusal is one ``error:`` line (exit 2) and leaves nothing behind: a NAME whose
distribution is a first-party or installed one (``lollm-core`` would replace the
real one when installed), an over-long NAME, ``--into`` a file or an unwritable
folder, a symlink where the work folder or the target would be, a write that fails
half-way.

The write-stage cases run :func:`lollm.cli.new_family.render` in this process with a
registry holding a throwaway reference family (a package in ``tmp_path``), so they
need no family distribution installed.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _core_helpers import child_env, write_site
from lollm.family import CONTRACT_VERSION, Family
from lollm.hookspecs import hookimpl
from lollm.cli.new_family import MAX_NAME_LENGTH, NewFamilyError, render


def new_family(*args: str, cwd: Path, sites: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lollm.cli", "new-family", *args], cwd=cwd, capture_output=True,
                          text=True, env=child_env(*sites), timeout=120)


def assert_one_error_line(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("name, dist", [("core", "lollm-core"), ("gemma", "lollm-gemma"), ("qwen", "lollm-qwen"),
                                        ("qwen3_5", "lollm-qwen3_5")])
def test_a_first_party_distribution_name_is_refused(tmp_path, name, dist):
    done = new_family(name, "--like", "qwen2", cwd=tmp_path)
    assert_one_error_line(done, f"NAME {name!r} would write the distribution {dist}")
    assert list(tmp_path.iterdir()) == []


def test_the_name_of_any_installed_distribution_is_refused(tmp_path):
    site = write_site(tmp_path / "site", "Lollm_Zebra", "1.2", {}, {})
    out = tmp_path / "out"
    out.mkdir()
    done = new_family("zebra", "--like", "qwen2", cwd=out, sites=(site,))
    assert_one_error_line(done, "would write the distribution lollm-zebra, and Lollm_Zebra 1.2 is installed")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("name, needle", [
    ("a" * 250, f"has 250 characters; use at most {MAX_NAME_LENGTH}"),
    ("a" * (MAX_NAME_LENGTH + 1), f"use at most {MAX_NAME_LENGTH}"),
    ("mine_", "not ending in '_'"),
])
def test_bad_names_are_refused(tmp_path, name, needle):
    done = new_family(name, "--like", "qwen2", cwd=tmp_path)
    assert_one_error_line(done, needle)
    assert list(tmp_path.iterdir()) == []


def test_into_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("keep me")
    for into in ("afile", "afile/below"):
        done = new_family("mine", "--like", "qwen2", "--into", into, cwd=tmp_path)
        assert_one_error_line(done, "afile is not a folder")
    assert [p.name for p in tmp_path.iterdir()] == ["afile"] and (tmp_path / "afile").read_text() == "keep me"


# -- the write stage, with a throwaway reference family ------------------------------------------


class Plugin:
    @hookimpl
    def lollm_register_families(self, register):
        register(Family(name="toyref", contract=CONTRACT_VERSION, model_types=("qwen2",),
                        load="lollm_toyref.toyref.weights:load"))


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A registry whose one family, ``toyref``, copies a tiny self-contained package."""
    from lollm.load.plugins import build_registry

    pkg = tmp_path / "ref" / "lollm_toyref" / "toyref"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text('"""The toyref family."""\nMODEL_TYPES = ("qwen2",)\nGGUF_ARCHITECTURES = ("toyref",)\n')
    (pkg / "weights.py").write_text("def load(*args):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path / "ref"))
    return build_registry(entry_points=[], extra_plugins=[("toyref", Plugin())])


def write(into: Path, registry) -> Path:
    return render("mine", "toyref", into, model_type="mine", registry=registry).folder


def test_the_throwaway_reference_renders(tmp_path, registry):
    """The write-stage tests below reach the write: the same call succeeds on a plain folder."""
    folder = write(tmp_path / "out", registry)
    assert (folder / "src" / "lollm_mine" / "mine" / "weights.py").is_file()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["lollm-mine"]


def test_a_symlinked_work_folder_is_refused_and_never_followed(tmp_path, registry):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lollm-mine.partial").symlink_to(victim)
    with pytest.raises(NewFamilyError, match=r"\.lollm-mine\.partial exists and is a symlink"):
        write(out, registry)
    assert [p.name for p in victim.iterdir()] == ["precious.txt"]
    assert sorted(p.name for p in out.iterdir()) == [".lollm-mine.partial"]  # the link itself is left alone


def test_a_dangling_symlink_as_work_folder_is_refused(tmp_path, registry):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lollm-mine.partial").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NewFamilyError, match="is a symlink"):
        write(out, registry)
    assert not (tmp_path / "elsewhere").exists() and not (out / "lollm-mine").exists()


@pytest.mark.parametrize("points_to", ["nowhere", "a_folder"])
def test_a_symlinked_target_is_refused(tmp_path, registry, points_to):
    (tmp_path / "a_folder").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "lollm-mine").symlink_to(tmp_path / points_to)
    with pytest.raises(NewFamilyError, match=r"lollm-mine already exists \(a symlink\)"):
        write(out, registry)
    assert sorted(p.name for p in out.iterdir()) == ["lollm-mine"] and (out / "lollm-mine").is_symlink()
    assert list((tmp_path / "a_folder").iterdir()) == []


def test_a_leftover_work_folder_of_an_interrupted_run_is_replaced(tmp_path, registry):
    out = tmp_path / "out"
    (out / ".lollm-mine.partial" / "src").mkdir(parents=True)
    assert (write(out, registry) / "pyproject.toml").is_file()
    assert [p.name for p in out.iterdir()] == ["lollm-mine"]


def test_an_unwritable_folder_is_one_error(registry):
    # sysfs refuses new folders to every user, root included (chmod does not stop root)
    assert Path("/sys").is_dir(), "this test needs Linux's /sys"
    with pytest.raises(NewFamilyError, match=r"--into /sys: cannot make /sys/\.lollm-mine\.partial: .*nothing was written"):
        write(Path("/sys"), registry)


def test_a_write_that_fails_half_way_leaves_nothing(tmp_path, registry, monkeypatch):
    import lollm.cli.new_family as nf

    real = nf._write

    def full_disk(work, **kwargs):
        real(work, **kwargs)  # every file written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(work / "README.md"))

    monkeypatch.setattr(nf, "_write", full_disk)
    out = tmp_path / "out"
    with pytest.raises(NewFamilyError, match=r"cannot write .*lollm-mine: No space left on device .*nothing was written"):
        write(out, registry)
    assert list(out.iterdir()) == []
