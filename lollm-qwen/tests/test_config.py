"""Parsing config.json: the real hub files, both schemas, and what is refused."""

from __future__ import annotations

import copy

import pytest
from lollm.errors import ConfigError

from lollm_qwen.qwen2.config import Qwen2Config
from lollm_qwen.qwen3.config import Qwen3Config

from _qwen_tiny import hub_configs_dir, real_config

CONFIGS = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}


def to_transformers5(raw: dict) -> dict:
    """The hub config as transformers 5 would write it: RoPE settings in rope_parameters."""
    out = copy.deepcopy(raw)
    params = dict(out.pop("rope_scaling", None) or {})
    if "type" in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = out.pop("rope_theta")
    out["rope_parameters"] = params
    out["layer_types"] = ["full_attention"] * out["num_hidden_layers"]
    return out


def test_qwen25_05b_hub_config():
    c = Qwen2Config.from_hf(real_config("qwen2"))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (896, 24, 14, 2)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (64, 4864, 151936)
    assert c.rope.rope_type == "default" and c.rope.theta == 1e6
    assert c.tie_word_embeddings is True
    assert c.eos_token_ids == (151643,)
    assert c.max_position_embeddings == 32768 and c.rms_norm_eps == 1e-6


def test_qwen25_7b_instruct_hub_config():
    path = hub_configs_dir() / "Qwen__Qwen2.5-7B-Instruct" / "config.json"
    if not path.exists():
        pytest.fail(f"{path} not found (is LOLLM_HUB_CONFIGS set to a wrong folder?)")
    import json

    c = Qwen2Config.from_hf(json.loads(path.read_text()))
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (3584, 28, 4, 128)
    assert c.tie_word_embeddings is False


def test_qwen3_06b_hub_config():
    c = Qwen3Config.from_hf(real_config("qwen3"))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (1024, 28, 16, 8)
    assert c.head_dim == 128  # explicit, != 1024 // 16
    assert c.attention_bias is False
    assert c.rope.rope_type == "default" and c.rope.theta == 1e6
    assert c.eos_token_ids == (151645,)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_both_schemas_give_the_same_config(family):
    raw = real_config(family)
    assert CONFIGS[family].from_hf(raw) == CONFIGS[family].from_hf(to_transformers5(raw))


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("spelling", ["type", "rope_type"])
def test_hub_rope_scaling_spellings(family, spelling):
    raw = dict(real_config(family), rope_scaling={spelling: "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    c = CONFIGS[family].from_hf(raw)
    assert (c.rope.rope_type, c.rope.factor, c.rope.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    assert c == CONFIGS[family].from_hf(to_transformers5(raw))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_eos_token_id_list(family):
    raw = dict(real_config(family), eos_token_id=[151645, 151643])
    assert CONFIGS[family].from_hf(raw).eos_token_ids == (151645, 151643)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_wrong_model_type(family):
    raw = dict(real_config(family), model_type="llama")
    with pytest.raises(ConfigError, match="llama"):
        CONFIGS[family].from_hf(raw)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_conflicting_rope_spellings(family):
    raw = dict(to_transformers5(real_config(family)), rope_scaling={"type": "linear", "factor": 2.0})
    with pytest.raises(ConfigError, match="rope_parameters.*rope_scaling"):
        CONFIGS[family].from_hf(raw)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_theta_inside_rope_parameters_wins(family):
    raw = to_transformers5(real_config(family))
    raw["rope_theta"] = 5.0  # transformers reads rope_parameters first
    assert CONFIGS[family].from_hf(raw).rope.theta == 1e6


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bad_head_counts(family):
    raw = dict(real_config(family), num_key_value_heads=3)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        CONFIGS[family].from_hf(raw)
