"""The ``lollm`` command line: help, tokenize, and clean one-line errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from _core_helpers import run_lollm, write_tiny_tokenizer

SUBCOMMANDS = ["run", "families", "tokenize", "parity", "bench", "trace"]


def test_the_console_script_is_installed():
    assert (Path(sys.executable).parent / "lollm").exists()


def test_help_lists_every_subcommand():
    done = run_lollm("--help")
    assert done.returncode == 0, done.stderr
    for name in SUBCOMMANDS:
        assert name in done.stdout


@pytest.mark.parametrize("name, needle", [
    ("run", "--model"), ("families", "--json"), ("tokenize", "--chat"), ("parity", "--min-cosine"), ("bench", "--no-reference"),
    ("trace", "--compare"),
])
def test_each_subcommand_has_help(name, needle):
    done = run_lollm(name, "--help")
    assert done.returncode == 0, done.stderr
    assert needle in done.stdout


def test_usage_errors_exit_2_without_traceback():
    done = run_lollm("run")  # --model is required
    assert done.returncode == 2
    assert "--model" in done.stderr and "Traceback" not in done.stderr
    done = run_lollm("no-such-command")
    assert done.returncode == 2 and "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


def test_tokenize_prints_ids_and_pieces(tokenizer_dir):
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode("hello world, lazy fox!").ids
    done = run_lollm("tokenize", str(tokenizer_dir), "hello world, lazy fox!", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["ids"] == reference
    assert "".join(data["pieces"]) == "hello world, lazy fox!"
    assert data["text"] == "hello world, lazy fox!"

    table = run_lollm("tokenize", str(tokenizer_dir), "hello world")
    assert table.returncode == 0, table.stderr
    assert "tokens" in table.stdout and str(data["ids"][0]) in table.stdout


def test_tokenize_chat_applies_the_template(tokenizer_dir):
    done = run_lollm("tokenize", str(tokenizer_dir), "hi", "--chat", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["text"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert data["pieces"][0] == "<|im_start|>" and data["ids"][0] == 1


def test_tokenize_think_follows_the_template(tmp_path_factory, tokenizer_dir):
    thinking = write_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "thinking", thinking=True)
    texts = {}
    for flag in ("--think", "--no-think"):
        done = run_lollm("tokenize", str(thinking), "hi", "--chat", flag, "--json")
        assert done.returncode == 0, done.stderr
        texts[flag] = json.loads(done.stdout)["text"]
    assert texts["--no-think"] == texts["--think"] + "<think>\n\n</think>\n\n"
    # a template that does not read enable_thinking: a clear error, not a silently ignored flag
    done = run_lollm("tokenize", str(tokenizer_dir), "hi", "--chat", "--think")
    assert done.returncode == 2 and "does not read enable_thinking" in done.stderr and "Traceback" not in done.stderr
    done = run_lollm("tokenize", str(thinking), "hi", "--think")
    assert done.returncode == 2 and "add --chat" in done.stderr


# -- clean errors ------------------------------------------------------------------


def assert_clean_error(done, *needles):
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{done.stderr}"
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert str(needle) in lines[0]
    assert done.stdout == ""


def test_error_missing_folder(tmp_path):
    missing = tmp_path / "nothing-here"
    assert_clean_error(run_lollm("run", "-m", str(missing), "-p", "hi"), missing)


def test_error_config_without_model_type(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    assert_clean_error(run_lollm("run", "-m", str(folder), "-p", "hi"), "model_type", folder / "config.json")


def test_error_pickle_checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    assert_clean_error(run_lollm("run", "-m", str(folder), "-p", "hi"), "pytorch_model.bin", "pickle")
    assert_clean_error(run_lollm("run", "-m", str(folder / "pytorch_model.bin"), "-p", "hi"), "pickle")


def test_error_tokenize_missing_folder(tmp_path):
    done = run_lollm("tokenize", str(tmp_path / "none"), "hi")
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stderr.startswith("error:")


# -- exit statuses of parity, in process ---------------------------------------------


@pytest.mark.parametrize("passed", [True, False])
def test_parity_exit_status_follows_the_gate(monkeypatch, capsys, passed):
    import lollm.cli as cli
    import lollm.proof.parity as parity

    def fake_run_parity(spec, **kwargs):
        report = parity.ParityReport(model=spec, family="fake", dtype="float32", device="cpu", num_tokens=2,
                                     min_cosine_required=0.99999)
        report.positions = [
            parity.PositionStats(0, 5, 1, 1, 5, 1.0, 0.0),
            parity.PositionStats(1, 6, 2, 2 if passed else 3, 4, 1.0 if passed else 0.5, 0.1),
        ]
        return report

    monkeypatch.setattr(parity, "run_parity", fake_run_parity)
    monkeypatch.setattr(sys, "argv", ["lollm", "parity", "some/model", "--json"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == (0 if passed else 1)
    assert json.loads(capsys.readouterr().out)["passed"] is passed


def test_lollm_error_inside_a_command_is_one_line_and_status_2(monkeypatch, capsys):
    import lollm.cli as cli
    import lollm.proof.parity as parity
    from lollm.errors import ConfigError

    def broken(spec, **kwargs):
        raise ConfigError("config.json: rope_scaling type 'yarn' is not implemented")

    monkeypatch.setattr(parity, "run_parity", broken)
    monkeypatch.setattr(sys, "argv", ["lollm", "parity", "x"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: config.json: rope_scaling type 'yarn' is not implemented"


def test_serve_and_chat_name_their_extra_when_it_is_missing(monkeypatch):
    import subprocess

    # uvicorn blocked: `lollm serve` stops before loading anything, naming the extra
    code = "import sys; sys.modules['uvicorn'] = None; sys.argv = ['lollm', 'serve', 'no-such-model']; " \
           "from lollm.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "NO_COLOR": "1", "COLUMNS": "200"})
    assert done.returncode == 2 and "lollm-core[serve]" in done.stderr and "Traceback" not in done.stderr, done.stderr

    from lollm.cli.chat import _line_reader
    from lollm.errors import LollmError

    monkeypatch.setitem(sys.modules, "prompt_toolkit", None)
    with pytest.raises(LollmError, match=r"lollm-core\[chat\]"):
        _line_reader(interactive=True)
    assert _line_reader(interactive=False)  # piped input needs no line editor
