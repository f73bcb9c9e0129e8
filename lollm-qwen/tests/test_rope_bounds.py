"""RoPE numbers are bounded (issue 22): a scaling factor from 1 to 1,024, YaRN's betas up to 1,024,
its cos/sin multipliers (attention_factor, mscale, mscale_all_dim) up to 16, a base up to 1e16
(lollm.load.checks). Every real config loads; an extreme one is an error naming the key and the value."""

from __future__ import annotations

import json

import pytest

from lollm.errors import ConfigError
from lollm.cli.hub_configs import available, hub_configs_dir

from _qwen_tiny import real_config


def _config_class(family: str):
    if family == "qwen2":
        from lollm_qwen.qwen2.config import Qwen2Config
        return Qwen2Config
    from lollm_qwen.qwen3.config import Qwen3Config
    return Qwen3Config


def _with_scaling(family: str, **scaling) -> dict:
    return {**real_config(family), "rope_scaling": scaling}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_every_real_config_and_published_scaling_is_accepted(family):
    cls = _config_class(family)
    for name in available():
        path = hub_configs_dir() / name / "config.json"
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if raw.get("model_type") == family:
            cls.from_hf(raw)
    published = [
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5's long-context recipe
        {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        {"rope_type": "linear", "factor": 1024.0},  # the bound itself
    ]
    for scaling in published:
        assert cls.from_hf(_with_scaling(family, **scaling)).rope.factor == scaling["factor"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("scaling,needle", [
    ({"rope_type": "linear", "factor": 1e-300}, "'rope_scaling' 'factor' is 1e-300: expected a finite number >= 1.0 and <= 1024.0"),
    ({"rope_type": "linear", "factor": 1e300}, "'rope_scaling' 'factor' is 1e+300"),
    ({"rope_type": "linear", "factor": 0.5}, "'rope_scaling' 'factor' is 0.5"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1e300}, "'rope_scaling' 'beta_fast' is 1e+300"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_slow": 1e-300}, "'rope_scaling' 'beta_slow' is 1e-300"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e30}, "'rope_scaling' 'attention_factor' is 1e+30: expected a finite number >= 0.0009765625 and <= 16.0"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 1e-30}, "'rope_scaling' 'mscale' is 1e-30"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 100}, "'rope_scaling' 'mscale_all_dim' is 100"),
    ({"rope_type": "default", "rope_theta": 1e300}, "'rope_scaling' 'rope_theta' is 1e+300"),
])
def test_extreme_rope_scaling_is_named(family, scaling, needle):
    with pytest.raises(ConfigError) as err:
        _config_class(family).from_hf(_with_scaling(family, **scaling))
    assert str(err.value).startswith(f"{family}: config.json ") and needle in str(err.value), str(err.value)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_an_extreme_top_level_rope_theta_is_named(family):
    with pytest.raises(ConfigError, match=r"config.json 'rope_theta' is 1e\+20: expected a finite number > 1.0 and <= 1e\+16"):
        _config_class(family).from_hf({**real_config(family), "rope_theta": 1e20})


def _gguf_metadata(family: str, **extra) -> dict:
    """The fewest metadata keys from_gguf reads (sizes of a tiny model; no tensor shapes needed)."""
    keys = {"block_count": 2, "context_length": 4096, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
            "attention.value_length": 16, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6,
            "vocab_size": 512}
    return {"general.architecture": family, **{f"{family}.{k}": v for k, v in {**keys, **extra}.items()}}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_extreme_gguf_rope_values_are_named(family):
    cls = _config_class(family)
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.original_context_length": 4096}
    assert cls.from_gguf(_gguf_metadata(family, **yarn, **{"rope.scaling.factor": 4.0})).rope.factor == 4.0
    for extra, key in (({**yarn, "rope.scaling.factor": 1e300}, "rope.scaling.factor"),
                       ({**yarn, "rope.scaling.factor": 1e-300}, "rope.scaling.factor"),
                       ({"rope.freq_base": 1e300}, "rope.freq_base")):
        with pytest.raises(ConfigError, match=rf"{family}: GGUF metadata '{family}\.{key}' is 1e[-+]300"):
            cls.from_gguf(_gguf_metadata(family, **extra))
