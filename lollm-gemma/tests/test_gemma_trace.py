"""``lollm trace`` on gemma2, gemma3 and gemma4: the numbers, --compare, the page in a real browser, GGUF.

Tiny random checkpoints from the real hub configs (the session's ``tiny`` fixture,
copied here with a small byte-level tokenizer beside them), sliding windows of
6 positions, so the page's windows are visible in a 40-token prompt. gemma2 and
gemma4 also record their final-logit soft-cap, gemma4 its per-layer embeddings.
The checks live in lollm.testing.trace_checks (shared by every family).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _gemma_testing import write_gemma2_gguf
from lollm.load.options import LoadOptions
from lollm.testing import trace_checks
from lollm.testing.browser import Browser
from lollm.testing.tiny import write_tiny_tokenizer
from lollm.cli.trace.run import run_trace

PROMPT = "The quick brown fox jumps over the lazy dog."
CHECKPOINTS = {"gemma2": "gemma2", "gemma3": "gemma3-1b", "gemma4": "gemma4-e2b-text"}
#: What each family records of its own (lollm.trace.record_*).
OWN = {"gemma2": {"final-logit soft-cap"}, "gemma3": set(), "gemma4": {"final-logit soft-cap", "per-layer embedding"}}


@pytest.fixture(scope="module")
def folder(tiny, tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = shutil.copytree(tiny(CHECKPOINTS[family]), tmp_path_factory.mktemp("trace") / family)
            write_tiny_tokenizer(made[family], chat_template=False)
        return made[family]

    return get


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def _open(folder: Path):
    from lollm.load.pipeline import open_model

    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    return loaded, loaded.tokenizer.encode(PROMPT)


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_trace_numbers(folder, family):
    loaded, ids = _open(folder(family))
    trace = trace_checks.check_numbers(loaded.model, ids, pieces=loaded.tokenizer.pieces)
    assert {r.name for r in trace.internals} == OWN[family]
    windows = {a.window for a in trace.attention}
    assert windows == {None, 6}, f"sliding and global layers, got windows {windows}"
    if family == "gemma4":  # one per-layer embedding record per layer
        assert [r.layer for r in trace.internals if r.name == "per-layer embedding"] == list(range(trace.num_layers))


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_compare_is_clean_and_names_a_broken_layer(folder, family):
    _, ids = _open(folder(family))
    trace_checks.check_divergence(folder(family), ids[:24], layer=1)


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_page_in_a_browser(folder, family, browser, tmp_path):
    result = run_trace(str(folder(family)), prompt=PROMPT, output=tmp_path / "trace.html")
    assert not result.templated  # no chat template here: the raw prompt
    trace_checks.check_page(browser, result.path, result.trace, click=20)
    if "final-logit soft-cap" in OWN[family]:
        points = browser.js("return Chart.getChart(document.querySelector("
                            "'.family-record[data-name=\"final-logit soft-cap\"] canvas')).data.datasets[2].data")
        rec = next(r for r in result.trace.internals if r.kind == "softcap")
        assert [p["id"] for p in points] == rec.data["ids"][20].tolist()
        assert all(abs(p["y"]) < rec.labels[0] for p in points)  # after the cap, inside (-cap, cap)


def test_trace_from_gguf(folder, browser, tmp_path):
    gguf = write_gemma2_gguf(folder("gemma2"), tmp_path / "tiny-gemma2.gguf")
    result = run_trace(str(gguf), prompt="the quick brown fox", output=tmp_path / "gguf.html")
    assert result.trace.meta["format"] == "gguf"
    assert any(p.startswith(" ") and len(p) > 1 for p in result.trace.pieces), result.trace.pieces  # "▁qu" read as " qu"
    trace_checks.check_page(browser, result.path, result.trace, click=2)
