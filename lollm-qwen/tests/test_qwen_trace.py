"""``lollm trace`` on qwen2 and qwen3: the numbers, --compare, the page in a real browser, safetensors and GGUF.

Tiny random checkpoints from the real hub configs (as in the parity tests), with a
small byte-level tokenizer beside them (lollm.testing.tiny.write_tiny_tokenizer).
The checks themselves live in lollm.testing.trace_checks (shared by every family).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from _qwen_tiny import FAMILIES, real_config
from lollm.load.options import LoadOptions
from lollm.testing import trace_checks
from lollm.testing.browser import Browser
from lollm.testing.tiny import shrink_config, write_tiny_checkpoint, write_tiny_tokenizer
from lollm.cli.trace.run import run_trace

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"trace-{family}")
            write_tiny_checkpoint(shrink_config(real_config(family), **FAMILIES[family]["overrides"]), folder)
            write_tiny_tokenizer(folder)
            made[family] = folder
        return made[family]

    return make


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def _ids(folder: Path) -> tuple[object, list[int]]:
    from lollm.load.pipeline import open_model

    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    return loaded, loaded.tokenizer.encode(PROMPT)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_trace_numbers(tiny, family):
    loaded, ids = _ids(tiny(family))
    trace_checks.check_numbers(loaded.model, ids, pieces=loaded.tokenizer.pieces)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_compare_is_clean_and_names_a_broken_layer(tiny, family):
    _, ids = _ids(tiny(family))
    trace_checks.check_divergence(tiny(family), ids, layer=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_cli_page_in_a_browser(tiny, family, browser, tmp_path):
    from lollm.cli import app

    out = tmp_path / "trace.html"
    done = CliRunner().invoke(app, ["trace", "-m", str(tiny(family)), "-p", PROMPT, "-o", str(out)])
    assert done.exit_code == 0, done.output
    assert f"wrote {out}" in done.output
    assert "loading " in done.output and "forward pass:" in done.output  # a line before each long step
    # the same trace in-process, to know what the page must show
    result = run_trace(str(tiny(family)), prompt=PROMPT, output=tmp_path / "again.html")
    assert result.trace.pieces[0] == "<|im_start|>" and "\n" in result.trace.pieces  # chat template, readable pieces
    assert out.read_bytes() == result.path.read_bytes()
    trace_checks.check_page(browser, out, result.trace)


def test_trace_from_gguf(tiny, browser, tmp_path):
    from test_gguf_qwen import hf_folder_to_gguf

    gguf = hf_folder_to_gguf(tiny("qwen2"), tmp_path / "tiny-qwen2.gguf", "qwen2")
    result = run_trace(str(gguf), prompt=PROMPT, output=tmp_path / "gguf.html", chat=False)
    assert result.trace.meta["format"] == "gguf" and not result.templated
    assert " qu" in result.trace.pieces  # the byte-level "Ġqu" read back as text
    trace_checks.check_page(browser, result.path, result.trace)


def test_cli_errors_are_one_line(tiny, tmp_path, monkeypatch, capsys):
    from lollm.cli import main

    folder = str(tiny("qwen2"))
    capsys.readouterr()
    for args, needle in [
        ((folder, "-p", "x", "-o", str(tmp_path / "no" / "t.html")), "does not exist"),
        ((folder, "-p", PROMPT, "--max-tokens", "3"), "more than --max-tokens 3"),
        ((folder, "-p", "x", "--think"), "does not read enable_thinking"),
    ]:
        monkeypatch.setattr("sys.argv", ["lollm", "trace", *args])
        with pytest.raises(SystemExit) as done:
            main()
        err = capsys.readouterr().err  # (loading progress bars may come first)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert done.value.code == 2 and len(errors) == 1 and needle in errors[0] and "Traceback" not in err, err
    # naming the model twice is a usage error, as on every command that takes MODEL
    monkeypatch.setattr("sys.argv", ["lollm", "trace", folder, "-m", folder, "-p", "x"])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    # click's usage box wraps at the terminal's width (a long tmp path, an xdist worker's 80 columns): unwrap it
    unwrapped = " ".join(err.replace("│", " ").split())
    assert done.value.code == 2 and "one argument too many" in unwrapped and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())  # no half-written page anywhere


REAL_PROMPT = ("Complete the function so that it returns the n-th Fibonacci number: def fib(n): if n < 2: return n; "
               "else: return fib(n - 1) + fib(n - 2). Then explain in one sentence why this version is slow. "
               "What does fib(10) return? Answer with the number only, please. Thanks!")


def test_real_qwen25_page_stays_small(qwen25_dir, browser, tmp_path):
    """The real Qwen2.5-Coder-0.5B-Instruct (24 layers x 14 heads) after a 100-token chat prompt: under 3 MB, and it works."""
    result = run_trace(str(qwen25_dir), prompt=REAL_PROMPT, output=tmp_path / "real.html")
    T = len(result.trace.ids)
    print(f"\nreal Qwen2.5 trace: {T} tokens, {result.size / 1e6:.2f} MB")
    assert 100 <= T <= 110, T
    assert result.size < 3_000_000, f"{result.size / 1e6:.2f} MB for {T} tokens"
    assert result.trace.pieces[:3] == ["<|im_start|>", "system", "\n"]
    trace_checks.check_page(browser, result.path, result.trace)
