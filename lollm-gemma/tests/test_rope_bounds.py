"""RoPE numbers are bounded (issue 22): a scaling factor from 1 to 1,024 and a base above 1 and up
to 1e16 (lollm.load.checks). Every real Gemma config loads; an extreme value is an error naming the key."""

from __future__ import annotations

import pytest
from _gemma_testing import hub_config

from lollm.errors import ConfigError
from lollm_gemma.gemma2.config import Gemma2Config
from lollm_gemma.gemma3.config import Gemma3Config
from lollm_gemma.gemma4.config import Gemma4Config

F, S = "full_attention", "sliding_attention"
REAL = {
    Gemma2Config: ["google__gemma-2-2b-it"],
    Gemma3Config: ["google__gemma-3-1b-it", "google__gemma-3-270m-it", "google__gemma-3-4b-it"],
    Gemma4Config: ["google__gemma-4-E2B-it"],  # 26B-A4B is refused for its MoE block, not its RoPE
}


def test_every_real_config_is_accepted():
    for cls, names in REAL.items():
        for name in names:
            cls.from_hf(hub_config(name))
    assert Gemma3Config.from_hf(hub_config("google__gemma-3-4b-it")).rope_global.factor == 8.0
    # 26B-A4B is refused for its MoE block; its RoPE alone reads within the bounds
    from lollm.load.checks import ConfigReader
    from lollm_gemma.gemma4.config import _read_rope

    local, glob = _read_rope(ConfigReader(hub_config("google__gemma-4-26B-A4B")["text_config"], "gemma4"))
    assert (local.theta, glob.theta) == (10_000.0, 1_000_000.0)


def _set(name: str, *path, value) -> dict:
    raw = hub_config(name)
    target = raw.get("text_config", raw)
    for key in path[:-1]:
        target = target.setdefault(key, {})
    target[path[-1]] = value
    return raw


CASES = {
    "gemma2 factor tiny": (Gemma2Config, _set("google__gemma-2-2b-it", "rope_scaling", value={"rope_type": "linear", "factor": 1e-300}),
                           "gemma2: config.json 'rope_scaling' 'factor' is 1e-300: expected a finite number >= 1.0 and <= 1024.0"),
    "gemma2 theta huge": (Gemma2Config, _set("google__gemma-2-2b-it", "rope_theta", value=1e300),
                          "gemma2: config.json 'rope_theta' is 1e+300: expected a finite number > 1.0 and <= 1e+16"),
    "gemma3 factor huge": (Gemma3Config, _set("google__gemma-3-270m-it", "rope_scaling", value={"rope_type": "linear", "factor": 1e300}),
                           "'rope_scaling' 'factor' is 1e+300"),
    "gemma3 4b factor below 1": (Gemma3Config, _set("google__gemma-3-4b-it", "rope_scaling", "factor", value=0.125),
                                 "'rope_scaling' 'factor' is 0.125"),
    "gemma3 local base huge": (Gemma3Config, _set("google__gemma-3-1b-it", "rope_local_base_freq", value=1e39),
                               "'rope_local_base_freq' is 1e+39"),
    "gemma4 factor huge": (Gemma4Config, _set("google__gemma-4-E2B-it", "rope_parameters", F, "factor", value=1e300),
                           f"'{F}' 'factor' is 1e+300"),
    "gemma4 theta huge": (Gemma4Config, _set("google__gemma-4-E2B-it", "rope_parameters", S, "rope_theta", value=1e300),
                          f"'{S}' 'rope_theta' is 1e+300"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_extreme_rope_values_are_named(case):
    cls, raw, needle = CASES[case]
    with pytest.raises(ConfigError) as err:
        cls.from_hf(raw)
    assert needle in str(err.value), str(err.value)
