"""``lollm trace`` on qwen3_5 and qwen3_5_moe: the numbers, --compare, the page in a real browser.

Tiny random checkpoints (the session's ``tiny_checkpoint``, copied here with a small
byte-level tokenizer and the real Qwen3.5 chat template beside them). Besides what
every family gets, the Gated DeltaNet layers record their decay and write-strength
gates and the size of their state, and the MoE layers the experts their router
picked. The checks live in lollm.testing.trace_checks (shared by every family).
(A GGUF loads the same parameters as safetensors, test_gguf_qwen3_5.py, so its trace is this one.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lollm.load.options import LoadOptions
from lollm.testing import trace_checks
from lollm.testing.browser import Browser
from lollm.cli.hub_configs import hub_file
from lollm.testing.tiny import write_tiny_tokenizer
from lollm.cli.trace.run import run_trace

PROMPT = "The quick brown fox jumps over the lazy dog."
FAMILIES = ["qwen3_5", "qwen3_5_moe"]
GATES = {"decay exp(g)", "write strength beta", "state norm ||S||"}
OWN = {"qwen3_5": GATES, "qwen3_5_moe": GATES | {"routed experts"}}


@pytest.fixture(scope="module")
def folder(tiny_checkpoint, tmp_path_factory):
    made: dict[str, Path] = {}
    template = hub_file("Qwen__Qwen3.5-0.8B", "chat_template.jinja").read_text(encoding="utf-8")

    def get(family: str) -> Path:
        if family not in made:
            made[family] = shutil.copytree(tiny_checkpoint(family, "text"), tmp_path_factory.mktemp("trace") / family)
            write_tiny_tokenizer(made[family])
            config_path = made[family] / "tokenizer_config.json"  # the real Qwen3.5 template, which reads enable_thinking
            config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": template}))
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


@pytest.mark.parametrize("family", FAMILIES)
def test_trace_numbers_and_own_records(folder, family):
    loaded, ids = _open(folder(family))
    model = loaded.model
    trace = trace_checks.check_numbers(model, ids, pieces=loaded.tokenizer.pieces)
    assert {r.name for r in trace.internals} == OWN[family]
    types = model.config.layer_types
    deltanet = [i for i, t in enumerate(types) if t == "linear_attention"]
    assert [r.layer for r in trace.internals if r.name == "decay exp(g)"] == deltanet
    assert [a.layer for a in trace.attention] == [i for i, t in enumerate(types) if t == "full_attention"]
    T = len(ids)
    for r in trace.internals:
        if r.kind == "series":
            values = r.data["values"]
            assert values.shape == (T, model.config.linear_num_value_heads)
            if r.name != "state norm ||S||":
                assert ((values > 0) & (values <= 1)).all(), f"{r.name} outside (0, 1]"
        else:  # routed experts: k distinct experts per token, weights as the router gives them
            k, E = model.config.num_experts_per_tok, model.config.num_experts
            assert r.data["indices"].shape == (T, k) and r.labels == ("expert", E)
            assert all(len(set(row)) == k for row in r.data["indices"].tolist())
            if model.config.norm_topk_prob:
                assert torch.allclose(r.data["weights"].sum(-1), torch.ones(T), atol=1e-5)
    # the state norm of layer 0 after the last token is the norm of the state the model itself ends with
    cache = model.new_cache(T)
    with torch.inference_mode():
        model(torch.tensor([ids]), cache)
    slot = model.model.layers[deltanet[0]].linear_attn.slot
    final = cache.recurrent_state(slot).norm(dim=(-2, -1))
    recorded = next(r for r in trace.internals if r.name == "state norm ||S||" and r.layer == deltanet[0])
    assert torch.allclose(recorded.data["values"][-1], final, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_compare_is_clean_and_names_a_broken_layer(folder, family):
    _, ids = _open(folder(family))
    trace_checks.check_divergence(folder(family), ids, layer=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_page_in_a_browser(folder, family, browser, tmp_path):
    from typer.testing import CliRunner

    from lollm.cli import app

    out = tmp_path / "trace.html"
    done = CliRunner().invoke(app, ["trace", str(folder(family)), "-p", PROMPT, "--no-think", "-o", str(out)])
    assert done.exit_code == 0, done.output
    result = run_trace(str(folder(family)), prompt=PROMPT, think=False, output=tmp_path / "again.html")
    assert result.templated and "</think>" in "".join(result.trace.pieces)  # --no-think: the empty think block
    assert out.read_bytes() == result.path.read_bytes()
    trace_checks.check_page(browser, out, result.trace)
