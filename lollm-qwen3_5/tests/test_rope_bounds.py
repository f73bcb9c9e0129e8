"""RoPE numbers are bounded (issue 22). qwen3_5 and qwen3_5_moe implement plain RoPE only (a scaling
'factor' is refused as a key), so their RoPE number is the base: above 1 and at most 1e16
(lollm.load.checks.MAX_ROPE_THETA). Every real config loads; an extreme base is an error naming the key."""

from __future__ import annotations

import importlib

import pytest

import qwen3_5_tiny as tiny
from lollm.errors import ConfigError

REAL = {"qwen3_5": ["Qwen__Qwen3.5-0.8B", "Qwen__Qwen3.5-27B"],
        "qwen3_5_moe": ["Qwen__Qwen3.5-35B-A3B", "Qwen__Qwen3.6-35B-A3B", "Qwen__Qwen3.5-122B-A10B", "Qwen__Qwen3.5-397B-A17B"]}


def _config_class(family):
    module = importlib.import_module(f"lollm_qwen3_5.{family}.config")
    return module.Qwen3_5Config if family == "qwen3_5" else module.Qwen3_5MoeConfig


@pytest.mark.parametrize("family", sorted(REAL))
def test_every_real_config_is_accepted(family):
    for name in REAL[family]:
        assert _config_class(family).from_hf(tiny.hub_config(family, name)).rope_theta == 1e7


@pytest.mark.parametrize("family", sorted(REAL))
@pytest.mark.parametrize("where,theta", [("rope_parameters", 1e300), ("rope_parameters", 1e17), ("top", 1e39)])
def test_an_extreme_rope_base_is_named(family, where, theta):
    raw = tiny.hub_config(family)
    text = raw["text_config"]
    if where == "top":
        del text["rope_parameters"]["rope_theta"]
        text["rope_theta"] = theta
    else:
        text["rope_parameters"]["rope_theta"] = theta
    key = "'rope_theta'" if where == "top" else "'rope_parameters' 'rope_theta'"
    with pytest.raises(ConfigError) as err:
        _config_class(family).from_hf(raw)
    assert f"{key} is {theta!r}: expected a finite number > 1.0 and <= 1e+16" in str(err.value), str(err.value)
    assert str(err.value).startswith(family), str(err.value)
