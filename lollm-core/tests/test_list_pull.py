"""``lollm list`` and ``lollm pull``: what is cached on this machine, and fetching more.

The hub is never reached: ``list`` reads a fake Hugging Face cache laid out as
huggingface_hub writes it (``models--org--name/snapshots/COMMIT``, ``refs/main``, as
test_loader.py builds it) in a child process whose HF_HUB_CACHE points there; ``pull``
runs in this process with huggingface_hub's download functions replaced by fakes that
write files where the real ones would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_repo(hub: Path, repo_id: str) -> Path:
    """An empty snapshot folder of ``repo_id`` in a fake hub cache, with refs/main pointing at it."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def write_safetensors_checkpoint(folder: Path, model_type: str) -> int:
    """config.json and a float16 model.safetensors; returns the bytes written."""
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.float16),
               "model.norm.weight": torch.ones(4, dtype=torch.float16)}, str(folder / "model.safetensors"))
    return sum(p.stat().st_size for p in folder.iterdir())


def write_tiny_gguf(path: Path, arch: str) -> Path:
    """A GGUF whose bytes are mostly Q8_0, with one small F32 tensor."""
    from lollm.testing.tiny_gguf import write_gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(path, arch, {f"{arch}.block_count": 1},
                      {"token_embd.weight": (np.ones((16, 64), np.float32), "Q8_0"),
                       "output_norm.weight": (np.ones(64, np.float32), "F32")})


def expected_family(model_type: str, distribution: str) -> str:
    """What the router says in this venv: the family's name when its distribution is installed."""
    from lollm.load.plugins import get_registry

    entry = get_registry().by_model_type.get(model_type)
    return entry.family.name if entry else f"none installed (pip install ./{distribution})"


def run_lollm(tmp_path: Path, hub: Path, lollm_cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), HF_HUB_CACHE=str(hub),
               HF_HUB_DISABLE_TELEMETRY="1", LOLLM_CACHE=str(lollm_cache), NO_COLOR="1", COLUMNS="200", TERM="dumb")
    return subprocess.run([sys.executable, "-m", "lollm.cli", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


@pytest.fixture
def caches(tmp_path):
    """A hub cache holding a safetensors repo (qwen2) and a GGUF repo; lollm's cache holding a GGUF of an unknown
    architecture and two work folders."""
    hub, own = tmp_path / "hub", tmp_path / "lollm"
    size = write_safetensors_checkpoint(hub_repo(hub, "lollm-test-org/tiny-model"), "qwen2")
    gguf_repo = hub_repo(hub, "lollm-test-org/tiny-GGUF")
    write_tiny_gguf(gguf_repo / "tiny-Q8_0.gguf", "qwen2")
    write_tiny_gguf(own / "made-up" / "made-up.gguf", "nonesuch")
    # work folders of real_models (a join, a conversion under way) are not models yet
    write_tiny_gguf(own / "made-up" / "tmpab12" / "half.gguf", "qwen2")
    (own / "made-up" / "safetensors-x1y2").mkdir()
    write_safetensors_checkpoint(own / "made-up" / "safetensors-x1y2", "qwen2")
    return hub, own, size


def test_list_json_names_format_quant_size_and_family(tmp_path, caches):
    hub, own, size = caches
    done = run_lollm(tmp_path, hub, own, "list", "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    # the short names of lollm.load.local_names, each one what `lollm run NAME` takes as it is
    assert sorted(rows) == ["lollm-test-org/tiny-GGUF:Q8_0", "lollm-test-org/tiny-model", "made-up"]
    qwen2 = expected_family("qwen2", "lollm-qwen")
    st = rows["lollm-test-org/tiny-model"]
    assert (st["spec"], st["source"], st["fmt"], st["quant"], st["size"], st["family"]) == (
        "lollm-test-org/tiny-model", "hf", "safetensors", "F16", size, qwen2)
    gg = rows["lollm-test-org/tiny-GGUF:Q8_0"]
    assert (gg["spec"], gg["fmt"], gg["quant"], gg["family"]) == ("lollm-test-org/tiny-GGUF:Q8_0", "gguf", "Q8_0, F32", qwen2)
    assert Path(gg["path"]).is_file() and gg["size"] == Path(gg["path"]).stat().st_size
    mine = rows["made-up"]
    assert (mine["spec"], mine["source"], mine["fmt"], mine["family"]) == ("made-up", "lollm", "gguf", "none installed")
    assert Path(mine["path"]) == own / "made-up" / "made-up.gguf"


def test_list_table_shows_the_cached_repo_that_runs_offline(tmp_path, caches):
    """The repo test_loader.py's test_repo_id_served_from_the_local_cache runs offline is listed by its id."""
    hub, own, _ = caches
    done = run_lollm(tmp_path, hub, own, "list")
    assert done.returncode == 0, done.stderr
    line = next(row for row in done.stdout.splitlines() if "lollm-test-org/tiny-model" in row)
    assert "safetensors" in line and "F16" in line and "hf" in line
    assert any("made-up " in row and "none installed" in row for row in done.stdout.splitlines())


def test_list_with_empty_caches_says_how_to_fetch(tmp_path):
    done = run_lollm(tmp_path, tmp_path / "no-hub", tmp_path / "no-lollm", "list")
    assert done.returncode == 0, done.stderr
    assert "No model" in done.stdout and "lollm pull" in done.stdout


def test_list_reports_an_unreadable_file_and_a_cache_that_is_a_file(tmp_path):
    own = tmp_path / "lollm"
    own.mkdir()
    (own / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    done = run_lollm(tmp_path, tmp_path / "no-hub", own, "list", "--json")
    assert done.returncode == 0, done.stderr
    [row] = json.loads(done.stdout)
    assert row["name"] == "broken" and row["quant"].startswith("unreadable: ") and "broken.gguf" in row["quant"]
    (tmp_path / "hub-file").write_text("not a folder")
    done = run_lollm(tmp_path, tmp_path / "hub-file", own, "list")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: the Hugging Face cache cannot be read") and "hub-file" in done.stderr


# -- pull ------------------------------------------------------------------------------


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    import lollm.cli as cli

    monkeypatch.setattr(sys, "argv", ["lollm", *args])
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.fixture
def online(monkeypatch):
    """HF_HUB_OFFLINE unset, and the hub answers lollm.load.hub's probe (no socket is opened)."""
    import lollm.load.hub as hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "check_reachable", lambda spec, timeout=hub.PROBE_SECONDS: None)


def test_pull_repo_downloads_through_snapshot_download(tmp_path, monkeypatch, capsys, online):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, local_files_only=False, **kwargs):
        calls.append((repo_id, local_files_only))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        assert "*.safetensors" in allow_patterns and "*.gguf" not in allow_patterns
        folder = tmp_path / "snap"
        folder.mkdir()
        write_safetensors_checkpoint(folder, "qwen2")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    code, out, err = run_main(monkeypatch, capsys, "pull", "org/tiny")
    assert code == 0, err
    assert calls == [("org/tiny", True), ("org/tiny", False)]
    assert str(tmp_path / "snap") in out
    assert "lollm run org/tiny --prompt" in out


def fake_gguf_repo(monkeypatch, tmp_path, files):
    """huggingface_hub's listing and hf_hub_download replaced: the repo holds ``files``; downloads are recorded."""
    import huggingface_hub

    fetched = []

    class FakeApi:
        def list_repo_files(self, repo_id, **kwargs):
            return list(files)

    def fake_hf_hub_download(repo_id, filename, local_files_only=False, **kwargs):
        fetched.append((repo_id, filename))
        return str(write_tiny_gguf(tmp_path / "dl" / filename, "qwen2"))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_hf_hub_download)
    return fetched


def test_pull_quant_fetches_the_one_gguf_of_that_quant(tmp_path, monkeypatch, capsys, online):
    fetched = fake_gguf_repo(monkeypatch, tmp_path, ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-Q4_K_S.gguf"])
    code, out, err = run_main(monkeypatch, capsys, "pull", "org/m-GGUF:Q4_K_M")
    assert code == 0, err
    assert fetched == [("org/m-GGUF", "m-Q4_K_M.gguf")]
    assert str(tmp_path / "dl" / "m-Q4_K_M.gguf") in out and "lollm run org/m-GGUF:Q4_K_M" in out


def test_pull_missing_quant_is_one_line_listing_the_files(tmp_path, monkeypatch, capsys, online):
    fetched = fake_gguf_repo(monkeypatch, tmp_path, ["m-Q8_0.gguf", "m-F16.gguf"])
    code, out, err = run_main(monkeypatch, capsys, "pull", "org/m-GGUF:Q4_K_M")
    assert code == 2 and fetched == [] and "Traceback" not in err
    assert err.startswith("error: org/m-GGUF: no .gguf file carries the quant 'Q4_K_M'")
    assert "m-Q8_0.gguf" in err and "m-F16.gguf" in err


def test_pull_refuses_when_offline(monkeypatch, capsys):
    import huggingface_hub

    def must_not_run(*args, **kwargs):
        raise AssertionError("pull reached huggingface_hub while HF_HUB_OFFLINE is set")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", must_not_run)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", must_not_run)
    for spec in ("org/tiny", "org/tiny:Q4_K_M"):
        code, out, err = run_main(monkeypatch, capsys, "pull", spec)
        assert code == 2 and out == ""
        assert err.strip() == (f"error: {spec}: HF_HUB_OFFLINE is set, and lollm pull needs the network; "
                               f"unset it to download (lollm list shows what is already cached)")


@pytest.mark.parametrize("spec", ["./folder", "org/name:", "just-a-name", "a/b/c"])
def test_pull_refuses_what_is_not_a_repo_id(monkeypatch, capsys, online, spec):
    code, out, err = run_main(monkeypatch, capsys, "pull", spec)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"error: {spec}: lollm pull takes a Hugging Face repo id")


def test_pull_of_a_gguf_only_repo_without_quant_says_to_name_one(tmp_path, monkeypatch, capsys, online):
    import huggingface_hub

    def fake_snapshot_download(repo_id, allow_patterns=None, local_files_only=False, **kwargs):
        folder = tmp_path / "empty-snap"
        folder.mkdir(exist_ok=True)
        return str(folder)  # the allow-list matched nothing: a GGUF repo has no config.json

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    code, out, err = run_main(monkeypatch, capsys, "pull", "org/m-GGUF")
    assert code == 2 and "Traceback" not in err
    assert err.startswith("error: org/m-GGUF: no config.json with .safetensors weights") and "org/m-GGUF:Q4_K_M" in err


def test_a_near_miss_of_a_listed_name_is_refused_with_the_name(tmp_path, caches):
    """``NAME.gguf`` is not a path here, and lollm list shows ``NAME``: the error names it, before torch loads."""
    hub, own, _ = caches
    done = run_lollm(tmp_path, hub, own, "run", "made-up.gguf", "-p", "hi")
    assert done.returncode != 0
    assert "made-up.gguf: no such file or folder" in done.stderr and "did you mean made-up?" in done.stderr
    far = run_lollm(tmp_path, hub, own, "run", "zzzz", "-p", "hi")
    assert far.returncode != 0 and "no such file or folder" in far.stderr and "did you mean" not in far.stderr
