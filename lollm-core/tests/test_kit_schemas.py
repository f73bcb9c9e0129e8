"""The kit's two spellings of config.json (lollm.testing.schemas) and its bfloat16 noise (issue 38).

No family here: transformers alone must read each respelling as the same model (the family's side is
the kit's test_both_config_schemas_give_the_same_logits, run by every family's conformance class; the
mutants it catches are in lollm-gemma/tests/test_gemma_conformance_mutants.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from lollm.cli.hub_configs import hub_config
from lollm.load.loader import load_checkpoint
from lollm.proof.parity import default_reference
from lollm.testing.reference import measure_bf16_noise
from lollm.testing.schemas import (NoOlderSchema, hub_schema_copy, other_schema, reference_logits_agree,
                                   respell_in_hub_schema, transformers_reads_it_the_same)
from lollm.testing.tiny import SENSITIVE_INIT_STD, kit_config, write_tiny_checkpoint

IDS = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(3))

#: hub config -> the older keys its respelling holds (those the hub's own config.json spells)
OLDER = {
    "Qwen__Qwen2.5-0.5B": {"rope_theta"},
    "Qwen__Qwen3-0.6B": {"rope_theta"},
    "google__gemma-2-2b-it": {"rope_theta"},
    "google__gemma-3-1b-it": {"rope_theta", "rope_local_base_freq", "sliding_window_pattern"},
}


def _kit_checkpoint(hub, folder):
    return write_tiny_checkpoint(kit_config(hub_config(hub)), folder, init_std=SENSITIVE_INIT_STD)


@pytest.mark.parametrize("hub", sorted(OLDER))
def test_the_kit_checkpoint_respelled_the_hub_way_is_the_same_model_to_transformers(hub, tmp_path):
    folder = _kit_checkpoint(hub, tmp_path / "kit")
    original = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in original  # transformers 5 wrote it
    schema, respelled = other_schema(original, {})
    assert schema == "the hub's older schema"
    assert "rope_parameters" not in respelled and "layer_types" not in respelled
    written = {k for k in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern") if k in respelled}
    assert written == OLDER[hub]
    assert written <= set(hub_config(hub)) | set(hub_config(hub).get("text_config", {}))  # keys the hub file has
    assert transformers_reads_it_the_same(original, respelled, {}) is None
    copy = hub_schema_copy(folder, tmp_path / "hub", respelled)
    assert reference_logits_agree(folder, copy, IDS, {}) is None


def test_a_hub_schema_checkpoint_is_respelled_the_transformers5_way(tmp_path):
    raw = kit_config(hub_config("google__gemma-3-1b-it"))
    folder = write_tiny_checkpoint(raw, tmp_path / "hub", schema="hub", init_std=SENSITIVE_INIT_STD)
    original = json.loads((folder / "config.json").read_text())
    schema, respelled = other_schema(original, {})
    assert schema == "the transformers-5 schema"
    assert set(respelled["rope_parameters"]) == {"sliding_attention", "full_attention"}
    assert transformers_reads_it_the_same(original, respelled, {}) is None


def test_a_wrong_respelling_is_seen_by_transformers(tmp_path):
    """The proof can fail: a local base swapped for the global one is another model to transformers."""
    folder = _kit_checkpoint("google__gemma-3-1b-it", tmp_path / "kit")
    original = json.loads((folder / "config.json").read_text())
    wrong = {**respell_in_hub_schema(original), "rope_local_base_freq": original["rope_parameters"]["full_attention"]["rope_theta"]}
    assert "rope_parameters" in transformers_reads_it_the_same(original, wrong, {})
    copy = hub_schema_copy(folder, tmp_path / "wrong", wrong)
    assert "logits differ" in reference_logits_agree(folder, copy, IDS, {})


@pytest.mark.parametrize(("hub", "reason"), [
    ("google__gemma-4-E2B-it", "transformers refuses the respelled config.json"),
    ("Qwen__Qwen3.5-0.8B", None),  # transformers reads rope_theta + rope_scaling for qwen3_5 as the same model
])
def test_model_types_born_with_rope_parameters(hub, reason, tmp_path):
    folder = _kit_checkpoint(hub, tmp_path / "kit")
    original = json.loads((folder / "config.json").read_text())
    _, respelled = other_schema(original, {})
    why = transformers_reads_it_the_same(original, respelled, {})
    assert (why is None) if reason is None else reason in why, why


def test_nothing_to_respell_is_said():
    with pytest.raises(NoOlderSchema, match="nothing to respell|older schema already"):
        respell_in_hub_schema({"model_type": "qwen2", "rope_theta": 10000.0})
    with pytest.raises(NoOlderSchema, match="not a plain default RoPE"):
        respell_in_hub_schema({"model_type": "x", "rope_parameters": {
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}})


def test_the_bf16_noise_is_measured_on_the_reference(tmp_path):
    """The bfloat16 bounds: the reference's bfloat16 error is real (> 0) and sets the mean bound (its noise
    in another blocking is 0 on the CPU); the max bound is twice that error's max."""
    checkpoint = load_checkpoint(_kit_checkpoint("google__gemma-3-1b-it", tmp_path / "kit"))
    noise = measure_bf16_noise(default_reference, checkpoint, IDS)
    assert noise.error_mean > 0 and noise.error_max > noise.error_mean
    assert noise.mean_bound == pytest.approx(max(5 * noise.noise_mean, 0.25 * noise.error_mean))
    assert noise.max_bound == pytest.approx(max(5 * noise.noise_max, 2 * noise.error_max))
