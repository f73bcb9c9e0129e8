"""Config parsing on the real hub configs of Qwen3.5 / Qwen3.6, both layouts, and the hard failures."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import qwen3_5_tiny as tiny
from lollm.errors import ConfigError

DENSE = ["Qwen__Qwen3.5-0.8B", "Qwen__Qwen3.5-27B"]
MOE = ["Qwen__Qwen3.5-35B-A3B", "Qwen__Qwen3.6-35B-A3B", "Qwen__Qwen3.5-122B-A10B", "Qwen__Qwen3.5-397B-A17B"]


def _config_class(family):
    module = importlib.import_module(f"lollm_qwen3_5.{family}.config")
    return module.Qwen3_5Config if family == "qwen3_5" else module.Qwen3_5MoeConfig


def _cases():
    return [("qwen3_5", h) for h in DENSE] + [("qwen3_5_moe", h) for h in MOE]


@pytest.mark.parametrize("family,hub_name", _cases())
def test_hub_configs_parse_in_both_layouts(family, hub_name):
    raw = tiny.hub_config(family, hub_name)
    text = raw["text_config"]
    Config = _config_class(family)
    multimodal = Config.from_hf(raw)
    flat = dict(text, model_type=f"{family}_text", tie_word_embeddings=raw.get("tie_word_embeddings", False))
    assert Config.from_hf(flat) == multimodal
    c = multimodal
    assert c.num_hidden_layers == len(c.layer_types) == text["num_hidden_layers"]
    assert c.full_attention_layers == list(range(3, c.num_hidden_layers, 4))  # full_attention_interval 4
    assert c.rotary_dim == 64 and c.head_dim == 256  # partial_rotary_factor 0.25
    assert c.rope_theta == 1e7
    assert c.linear_conv_kernel_dim == 4 and c.mtp_num_hidden_layers == 1
    assert c.eos_token_ids == (248044,)
    assert c.tie_word_embeddings is bool(raw["tie_word_embeddings"])


def test_layer_pattern_from_the_interval_alone():
    raw = tiny.hub_config("qwen3_5")
    text = copy.deepcopy(raw["text_config"])
    del text["layer_types"]
    text["model_type"] = "qwen3_5_text"
    c = _config_class("qwen3_5").from_hf(text)
    assert c.layer_types == tuple(raw["text_config"]["layer_types"])
    text["full_attention_interval"] = 2
    assert _config_class("qwen3_5").from_hf(text).full_attention_layers == list(range(1, 24, 2))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t["rope_parameters"].update(rope_type="yarn", factor=4.0), "'yarn'"),
        (lambda t: t["rope_parameters"].update(beta_fast=32), "'beta_fast'"),
        (lambda t: t.update(layer_types=["linear_attention"] * 24), "full_attention_interval"),
        (lambda t: t.update(layer_types=["sliding_attention"] * 24, full_attention_interval=None), "sliding_attention"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
        (lambda t: t.update(attn_output_gate=False), "attn_output_gate"),
        (lambda t: t.update(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (lambda t: t.update(tie_word_embeddings=False), "tie_word_embeddings"),
        (lambda t: t.update(mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings"),
        (lambda t: t.update(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype"),
        (lambda t: t.pop("linear_key_head_dim"), "linear_key_head_dim"),
        (lambda t: t.update(linear_num_value_heads=24), "linear_num_value_heads"),
    ],
)
def test_settings_we_do_not_implement_raise(change, message):
    raw = tiny.hub_config("qwen3_5")
    raw["text_config"]["full_attention_interval"] = raw["text_config"].get("full_attention_interval")
    change(raw["text_config"])
    with pytest.raises(ConfigError, match=message):
        _config_class("qwen3_5").from_hf(raw)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.update(mlp_only_layers=[0, 4]), "mlp_only_layers"),
        (lambda t: t.update(decoder_sparse_step=2), "decoder_sparse_step"),
        (lambda t: t.update(num_experts_per_tok=300), "num_experts_per_tok"),
    ],
)
def test_moe_settings_we_do_not_implement_raise(change, message):
    raw = tiny.hub_config("qwen3_5_moe")
    change(raw["text_config"])
    with pytest.raises(ConfigError, match=message):
        _config_class("qwen3_5_moe").from_hf(raw)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_text_positions_of_mrope_are_plain_partial_rope(family):
    """transformers' interleaved M-RoPE with (t, h, w) = (p, p, p), at the real 0.8B / 35B dims, equals our 1-D partial RoPE."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

    blocks = importlib.import_module(f"lollm_qwen3_5.{family}.blocks")
    raw = tiny.hub_config(family)
    ours = blocks.RotaryEmbedding(_config_class(family).from_hf(raw))
    ref_config = transformers.CONFIG_MAPPING[raw["text_config"]["model_type"]].from_dict(raw["text_config"])
    ref = Qwen3_5TextRotaryEmbedding(ref_config)
    T, D = 300, raw["text_config"]["head_dim"]
    x = torch.randn(1, 4, T, D, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T)
    cos, sin = ours(positions, torch.float32)
    ref_cos, ref_sin = ref(x, positions.view(1, 1, T).expand(3, 1, T))  # three identical position rows
    expected, _ = apply_rotary_pos_emb(x, x, ref_cos, ref_sin)
    torch.testing.assert_close(blocks.apply_partial_rope(x, cos, sin), expected, rtol=1e-5, atol=1e-5)
    assert cos.shape == (T, 64)
