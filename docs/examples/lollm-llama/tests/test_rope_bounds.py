"""RoPE numbers are bounded (issue 22, lollm.load.checks): a scaling factor from 1 to 1,024, Llama 3's
low/high_freq_factor and YaRN's betas from 2**-10 to 1,024, YaRN's cos/sin multipliers up to 16, a
base up to 1e16. The published Llama configs load; an extreme value is an error naming the key."""

from __future__ import annotations

import pytest

from lollm.errors import ConfigError

from _llama_tiny import LLAMA2_7B, LLAMA32_1B

from lollm_llama.llama.config import LlamaConfig


def test_the_published_configs_are_accepted():
    assert LlamaConfig.from_hf(LLAMA32_1B).rope.factor == 32.0
    assert LlamaConfig.from_hf(dict(LLAMA2_7B, rope_scaling={"rope_type": "linear", "factor": 4.0})).rope.factor == 4.0


LLAMA3 = LLAMA32_1B["rope_scaling"]


@pytest.mark.parametrize("scaling,needle", [
    (dict(LLAMA3, factor=1e-300), "'rope_scaling' 'factor' is 1e-300: expected a finite number >= 1.0 and <= 1024.0"),
    (dict(LLAMA3, factor=1e300), "'rope_scaling' 'factor' is 1e+300"),
    (dict(LLAMA3, low_freq_factor=1e-300), "'rope_scaling' 'low_freq_factor' is 1e-300"),
    (dict(LLAMA3, high_freq_factor=1e300), "'rope_scaling' 'high_freq_factor' is 1e+300"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1e300}, "'rope_scaling' 'beta_fast' is 1e+300"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e300}, "'rope_scaling' 'attention_factor' is 1e+300"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1e-300}, "'rope_scaling' 'mscale_all_dim' is 1e-300"),
    ({"rope_type": "linear", "factor": 4.0, "rope_theta": 1e300}, "'rope_scaling' 'rope_theta' is 1e+300"),
])
def test_extreme_rope_scaling_is_named(scaling, needle):
    with pytest.raises(ConfigError) as err:
        LlamaConfig.from_hf(dict(LLAMA32_1B, rope_scaling=scaling))
    assert str(err.value).startswith("llama: config.json ") and needle in str(err.value), str(err.value)


def _gguf_metadata(**extra) -> dict:
    keys = {"block_count": 2, "context_length": 4096, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
            "rope.freq_base": 5e5, "vocab_size": 512}
    return {"general.architecture": "llama", **{f"llama.{k}": v for k, v in {**keys, **extra}.items()}}


def test_extreme_gguf_rope_values_are_named():
    linear = {"rope.scaling.type": "linear"}
    assert LlamaConfig.from_gguf(_gguf_metadata(**linear, **{"rope.scaling.factor": 4.0})).rope.factor == 4.0
    for extra, key in (({**linear, "rope.scaling.factor": 1e300}, "rope.scaling.factor"),
                       ({**linear, "rope.scaling.factor": 1e-300}, "rope.scaling.factor"),
                       ({"rope.freq_base": 1e300}, "rope.freq_base")):
        with pytest.raises(ConfigError, match=rf"llama: GGUF metadata 'llama\.{key}' is 1e[-+]300"):
            LlamaConfig.from_gguf(_gguf_metadata(**extra))
