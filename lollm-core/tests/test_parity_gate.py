"""The parity gate's arithmetic, and run_parity end to end with a family defined in a temporary module."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors.torch import save_file

import lollm.load.pipeline as pipeline
from lollm.proof.parity import ParityReport, compare_logits, layer_cosines, run_parity
from lollm.load.plugins import build_registry


def test_compare_logits_statistics():
    ours = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [6.0, 5.0, 4.0, 3.0, 2.0, 1.0]])
    ref = ours.clone()
    ref[1, 0] = 0.0  # position 1: the argmax moves to id 1
    stats = compare_logits(ours, ref, [7, 8])
    assert [s.token_id for s in stats] == [7, 8]
    assert stats[0].ours_argmax == stats[0].ref_argmax == 5
    assert stats[0].cosine == pytest.approx(1.0) and stats[0].max_abs_diff == 0.0 and stats[0].top5_overlap == 5
    assert (stats[1].ours_argmax, stats[1].ref_argmax) == (0, 1)
    assert stats[1].max_abs_diff == 6.0 and stats[1].cosine < 0.99
    assert stats[1].top5_overlap == 4  # ours drops id 5, the reference drops id 0


def test_compare_logits_refuses_different_shapes():
    from lollm.errors import LollmError

    with pytest.raises(LollmError, match="shapes differ"):
        compare_logits(torch.zeros(2, 5), torch.zeros(3, 5), [1, 2])


def test_report_passes_only_with_every_argmax_and_the_cosine():
    ours = torch.eye(4, 8)
    ok = compare_logits(ours, ours.clone(), [0, 1, 2, 3])
    report = ParityReport("m", "f", "float32", "cpu", 4, 0.99999, positions=ok)
    assert report.passed and report.argmax_matches == 4
    assert json.loads(json.dumps(report.to_json()))["passed"] is True
    near = ours + 0.01 * torch.ones(4, 8)
    report = ParityReport("m", "f", "float32", "cpu", 4, 0.99999, positions=compare_logits(ours, near, [0, 1, 2, 3]))
    assert report.argmax_matches == 4 and not report.passed  # the cosine alone fails it


def test_layer_cosines_are_the_minimum_over_positions():
    a = [torch.ones(1, 3, 4), torch.ones(1, 3, 4)]
    b = [torch.ones(1, 3, 4), torch.ones(1, 3, 4)]
    b[1][0, 2] = torch.tensor([1.0, -1.0, 1.0, -1.0])
    cos = layer_cosines(a, b)
    assert cos[0] == pytest.approx(1.0) and cos[1] == pytest.approx(0.0)


FAMILY_MODULE = '''
import torch
from torch import nn
from lollm.family import CONTRACT_VERSION, Family
from lollm.hookspecs import hookimpl

NOISE = {"layer": None}  # which hidden state the reference perturbs (None: an exact reference)


class Cache:
    def __init__(self, n):
        self.length, self.max_tokens = 0, n


class TwoLayer(nn.Module):
    """embed -> relu(linear) -> linear -> lm_head: two layers and three hidden states."""

    def __init__(self, w):
        super().__init__()
        self.w = {k: v.float() for k, v in w.items()}
        self.anchor = nn.Parameter(torch.zeros(()))
        self.vocab_size, self.max_context, self.num_layers, self.eos_token_ids = w["embed"].shape[0], 64, 2, ()

    def new_cache(self, n):
        return Cache(n)

    def forward(self, ids, cache=None, *, logits_to_keep=0, hidden_states=None, noise_at=None):
        h = [self.w["embed"][ids]]
        h.append(torch.relu(h[-1] @ self.w["l0"]))
        h.append(h[-1] @ self.w["l1"])
        if noise_at is not None:
            for i in range(noise_at, len(h)):
                h[i] = h[i] + 0.5
        if hidden_states is not None:
            hidden_states.extend(h)
        logits = h[-1] @ self.w["embed"].T
        return logits[:, -logits_to_keep:] if logits_to_keep else logits


def load(checkpoint, options):
    return TwoLayer({n: checkpoint.weights.read(n) for n in checkpoint.weights.names()})


def reference(checkpoint, dtype):
    model = TwoLayer({n: checkpoint.weights.read(n) for n in checkpoint.weights.names()})

    def run(ids):
        hidden = []
        logits = model(ids, None, hidden_states=hidden, noise_at=NOISE["layer"])
        return logits[0], hidden

    return run


@hookimpl
def lollm_register_families(register):
    register(Family(name="twolayer", contract=CONTRACT_VERSION, model_types=("twolayer",),
                    load="lollm_test_twolayer:load", parity_reference="lollm_test_twolayer:reference"))
'''


@pytest.fixture
def twolayer(tmp_path, monkeypatch):
    (tmp_path / "lollm_test_twolayer.py").write_text(textwrap.dedent(FAMILY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import lollm_test_twolayer

    registry = build_registry(entry_points=[], extra_plugins=[("twolayer", lollm_test_twolayer)])
    monkeypatch.setattr(pipeline, "get_registry", lambda: registry)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "twolayer"}))
    g = torch.Generator().manual_seed(0)
    save_file({"embed": torch.randn(16, 8, generator=g), "l0": torch.randn(8, 8, generator=g),
               "l1": torch.randn(8, 8, generator=g)}, str(folder / "model.safetensors"))
    yield folder, lollm_test_twolayer
    monkeypatch.delitem(__import__("sys").modules, "lollm_test_twolayer")


def test_run_parity_passes_against_an_exact_reference(twolayer):
    folder, _ = twolayer
    report = run_parity(str(folder), ids=[1, 2, 3, 4, 5])
    assert report.passed and report.family == "twolayer" and report.num_tokens == 5
    assert report.min_cosine > 0.999999 and report.max_abs_diff < 1e-5
    assert len(report.layer_cosines) == 3 and report.first_diverging_layer is None


@pytest.mark.parametrize("layer", [1, 2])
def test_run_parity_names_the_first_diverging_hidden_state(twolayer, layer):
    folder, module = twolayer
    module.NOISE["layer"] = layer
    report = run_parity(str(folder), ids=[1, 2, 3, 4, 5])
    assert not report.passed
    assert report.first_diverging_layer == layer
