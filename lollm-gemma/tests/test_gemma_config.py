"""Parsing the real hub config.json files of every family, and refusing what we do not implement."""

from __future__ import annotations

import copy

import pytest
from _gemma_testing import hub_config

from lollm.errors import ConfigError
from lollm_gemma.gemma2.config import Gemma2Config
from lollm_gemma.gemma3.config import Gemma3Config
from lollm_gemma.gemma4.config import Gemma4Config

S, F = "sliding_attention", "full_attention"


def test_gemma2_2b_hub_config():
    c = Gemma2Config.from_hf(hub_config("google__gemma-2-2b-it"))
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim, c.num_key_value_heads) == (2304, 26, 256, 4)
    assert c.layer_types[:4] == (S, F, S, F) and len(c.layer_types) == 26  # alternating, sliding first
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert (c.sliding_window, c.query_pre_attn_scalar, c.rope.theta) == (4096, 256.0, 10000.0)
    assert c.eos_token_ids == (1, 107) and c.tie_word_embeddings


def test_gemma3_1b_hub_config_pattern():
    c = Gemma3Config.from_hf(hub_config("google__gemma-3-1b-it"))
    assert [i for i, t in enumerate(c.layer_types) if t == F] == [5, 11, 17, 23]
    assert (c.rope_local.theta, c.rope_global.theta) == (10_000.0, 1_000_000.0)
    assert c.rope_global.rope_type == "default" and c.sliding_window == 512
    assert not c.multimodal


def test_gemma3_270m_hub_config_layer_types():
    c = Gemma3Config.from_hf(hub_config("google__gemma-3-270m-it"))
    assert c.layer_types == tuple(([S] * 5 + [F]) * 3)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (4, 1, 256, 262144)


def test_gemma3_4b_multimodal_config_uses_transformers_defaults():
    c = Gemma3Config.from_hf(hub_config("google__gemma-3-4b-it"))
    assert c.multimodal
    # not in the file's text_config: transformers' Gemma3TextConfig defaults
    assert (c.vocab_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (262208, 8, 4, 256)
    assert c.rope_global.rope_type == "linear" and c.rope_global.factor == 8.0
    assert c.rope_local.rope_type == "default" and c.rope_local.theta == 10_000.0
    assert c.sliding_window == 1024 and c.num_hidden_layers == 34
    assert c.eos_token_ids == (1, 106)


def test_gemma3_transformers5_schema():
    raw = hub_config("google__gemma-3-270m-it")
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling", "_sliding_window_pattern"):
        raw.pop(key)
    raw["rope_parameters"] = {
        F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 2e6},
        S: {"rope_type": "default", "rope_theta": 5e3},
    }
    c = Gemma3Config.from_hf(raw)
    assert (c.rope_global.rope_type, c.rope_global.factor, c.rope_global.theta) == ("linear", 4.0, 2e6)
    assert (c.rope_local.rope_type, c.rope_local.theta) == ("default", 5e3)


def test_gemma4_e2b_config():
    c = Gemma4Config.from_hf(hub_config("google__gemma-4-E2B-it"))
    assert c.multimodal and c.num_hidden_layers == 35 and c.first_kv_shared_layer == 15
    assert (c.head_dim_for(S), c.head_dim_for(F)) == (256, 512)
    assert (c.kv_heads_for(S), c.kv_heads_for(F)) == (1, 1)
    assert c.kv_source(14) == 14 and c.kv_source(15) == 13 and c.kv_source(19) == 14 and c.kv_source(34) == 14
    assert (c.intermediate_size_for(14), c.intermediate_size_for(15)) == (6144, 12288)
    assert (c.rope_global.rope_type, c.rope_global.rotary_fraction, c.rope_global.theta) == ("proportional", 0.25, 1e6)
    assert (c.hidden_size_per_layer_input, c.final_logit_softcapping) == (256, 30.0)
    assert c.eos_token_ids == (1, 106)


def test_gemma4_moe_is_refused_by_name():
    with pytest.raises(ConfigError, match="enable_moe_block"):
        Gemma4Config.from_hf(hub_config("google__gemma-4-26B-A4B"))


def _with_text(raw: dict, **changes) -> dict:
    raw = copy.deepcopy(raw)
    (raw["text_config"] if "text_config" in raw else raw).update(changes)
    return raw


@pytest.mark.parametrize(
    "parse,raw,changes,named",
    [
        # unknown RoPE types, in both schemas
        (Gemma2Config.from_hf, "google__gemma-2-2b-it", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        (Gemma2Config.from_hf, "google__gemma-2-2b-it", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "dynamic"),
        (Gemma3Config.from_hf, "google__gemma-3-1b-it", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        (Gemma3Config.from_hf, "google__gemma-3-4b-it", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
        (Gemma3Config.from_hf, "google__gemma-3-270m-it",
         {"rope_parameters": {F: {"rope_type": "yarn", "rope_theta": 1e6}, S: {"rope_type": "default", "rope_theta": 1e4}}}, "yarn"),
        (Gemma4Config.from_hf, "google__gemma-4-E2B-it",
         {"rope_parameters": {F: {"rope_type": "yarn", "rope_theta": 1e6}, S: {"rope_type": "default", "rope_theta": 1e4}}}, "yarn"),
        # a RoPE key the type does not implement
        (Gemma3Config.from_hf, "google__gemma-3-1b-it", {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}}, "low_freq_factor"),
        # math-changing keys we do not implement
        (Gemma2Config.from_hf, "google__gemma-2-2b-it", {"hidden_activation": "silu"}, "hidden_activation"),
        (Gemma2Config.from_hf, "google__gemma-2-2b-it", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (Gemma3Config.from_hf, "google__gemma-3-1b-it", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        (Gemma3Config.from_hf, "google__gemma-3-1b-it", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        (Gemma3Config.from_hf, "google__gemma-3-1b-it", {"attention_bias": True}, "attention_bias"),
        (Gemma3Config.from_hf, "google__gemma-3-270m-it", {"sliding_window_pattern": 4}, "sliding_window_pattern"),
        (Gemma4Config.from_hf, "google__gemma-4-E2B-it", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        (Gemma4Config.from_hf, "google__gemma-4-E2B-it", {"layer_types": [S] * 35}, "full_attention"),
        (Gemma4Config.from_hf, "google__gemma-4-E2B-it", {"per_layer_config": {"4": {"intermediate_size": 8}}}, "intermediate_size"),
        (Gemma4Config.from_hf, "google__gemma-4-E2B-it", {"num_kv_shared_layers": 34}, "num_kv_shared_layers"),
    ],
)
def test_unimplemented_settings_raise_naming_them(parse, raw, changes, named):
    with pytest.raises(ConfigError, match=named):
        parse(_with_text(hub_config(raw), **changes))


def test_wrong_model_type():
    with pytest.raises(ConfigError, match="qwen2"):
        Gemma3Config.from_hf({**hub_config("google__gemma-3-1b-it"), "model_type": "qwen2"})
