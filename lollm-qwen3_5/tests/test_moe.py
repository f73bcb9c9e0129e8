"""The MoE pieces of qwen3_5_moe: the router against transformers, and the two forms of stored experts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import qwen3_5_tiny as tiny
from lollm.errors import WeightsError
from lollm.load.loader import load_checkpoint
from lollm.testing.loading import load_with
from lollm_qwen3_5.qwen3_5_moe.blocks import Qwen3_5MoeRouter
from lollm_qwen3_5.qwen3_5_moe.config import Qwen3_5MoeConfig
from lollm_qwen3_5.qwen3_5_moe.weights import load


@pytest.mark.parametrize("hub_name", ["Qwen__Qwen3.5-35B-A3B", "Qwen__Qwen3.6-35B-A3B", "Qwen__Qwen3.5-122B-A10B"])
def test_router_picks_the_same_experts_as_transformers(hub_name):
    """Real router sizes (256 experts, top 8, hidden 2048+), one batch of 96 tokens."""
    raw = tiny.hub_config("qwen3_5_moe", hub_name)
    ours = Qwen3_5MoeRouter(Qwen3_5MoeConfig.from_hf(raw))
    ref_config = transformers.Qwen3_5MoeTextConfig.from_dict(raw["text_config"])
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    ref = Qwen3_5MoeTopKRouter(ref_config)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(ref.weight.shape, generator=g) * 0.05
    with torch.no_grad():
        ref.weight.copy_(weight)
        ours.weight.copy_(weight)
        x = torch.randn(96, raw["text_config"]["hidden_size"], generator=g)
        _, ref_weights, ref_experts = ref(x)
        experts, weights = ours(x)
    assert experts.shape == (96, raw["text_config"]["num_experts_per_tok"])
    assert torch.equal(experts, ref_experts)  # same experts, in the same order
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(weights.sum(-1), torch.ones(96))  # normalised top-k weights


def _logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0]


def test_fused_and_per_expert_checkpoints_load_the_same_model(tiny_checkpoint, tmp_path):
    """transformers writes experts one by one; a fused checkpoint (experts.gate_up_proj) must give the same model."""
    src = tiny_checkpoint("qwen3_5_moe", "multimodal", True)
    per_expert = load_checkpoint(src)
    assert any(".mlp.experts.0.gate_proj.weight" in n for n in per_expert.weights.names())
    E = per_expert.config["text_config"]["num_experts"]

    fused_dir = tmp_path / "fused"
    shutil.copytree(src, fused_dir)
    tensors = load_file(str(src / "model.safetensors"))
    prefixes = sorted({n.split(".experts.")[0] for n in tensors if ".experts.0.gate_proj" in n})
    for prefix in prefixes:
        gate_up = [torch.cat((tensors.pop(f"{prefix}.experts.{e}.gate_proj.weight"),
                              tensors.pop(f"{prefix}.experts.{e}.up_proj.weight"))) for e in range(E)]
        down = [tensors.pop(f"{prefix}.experts.{e}.down_proj.weight") for e in range(E)]
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.experts.down_proj"] = torch.stack(down)
    save_file(tensors, str(fused_dir / "model.safetensors"), metadata={"format": "pt"})
    assert len(prefixes) == tiny.TINY_TEXT["num_hidden_layers"] + 1  # every layer and the MTP head

    a = load_with(load, per_expert.config, per_expert.weights, "safetensors")  # float32 on the CPU
    fused = load_checkpoint(fused_dir)
    b = load_with(load, fused.config, fused.weights, "safetensors")
    ids = tiny.random_ids(40, tiny.TINY_TEXT["vocab_size"], seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    # equal weights; the logits may differ in the last bit only (BLAS picks kernels by memory alignment)
    torch.testing.assert_close(_logits(a, ids), _logits(b, ids), rtol=1e-6, atol=1e-6)


def test_a_missing_expert_is_named(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_5_moe", "text")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    ckpt = load_checkpoint(broken)
    with pytest.raises(WeightsError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_with(load, ckpt.config, ckpt.weights, "safetensors")


def test_a_dense_config_is_refused_by_the_moe_family():
    from lollm.errors import ConfigError

    raw = tiny.hub_config("qwen3_5")
    raw["model_type"] = "qwen3_5_moe"
    raw["text_config"]["model_type"] = "qwen3_5_moe_text"
    with pytest.raises(ConfigError, match="num_experts"):
        Qwen3_5MoeConfig.from_hf(json.loads(json.dumps(raw)))
