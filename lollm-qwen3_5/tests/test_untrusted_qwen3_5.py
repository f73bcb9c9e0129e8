"""Untrusted config.json (qwen3_5, qwen3_5_moe): every value checked before anything is built.

Two parts:

* one unit test per input class, each asserting the error names the key (or the tensor),
  through the family's ``load`` on a tiny checkpoint's real tensors (so the sizes are also
  checked against the weights before anything is built);
* properties (hypothesis): each example mutates the config.json of a tiny checkpoint made from
  a real hub config (:func:`lollm.testing.fuzz.mutated`: junk values, near misses, removed and
  added keys, at any depth, ``text_config`` and ``rope_parameters`` included), loads it against
  that checkpoint's real tensors and generates two tokens; :func:`lollm.testing.fuzz.check_clean`
  bounds each run's CPU time (5 s) and memory (4 GiB) and fails on any exception that is not a
  LollmError. (GGUF metadata: test_weights.py and test_gguf_qwen3_5.py.) CI runs a fixed,
  derandomized budget; ``nox -s fuzz`` runs many more random examples.
"""

from __future__ import annotations

import copy
import importlib
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lollm.errors import ConfigError, WeightsError
from lollm.generate.loop import GenerationResult
from lollm.testing.fuzz import check_clean, fuzz_settings, load_and_generate, mutated
from lollm.testing.loading import load_with

#: The multimodal configs' towers: never read by a text family, so no example spends a change there.
TOWERS = ("vision_config", "audio_config")
FAMILIES = ("qwen3_5", "qwen3_5_moe")


class Sources(dict):
    """family -> (config.json dict, tensors); a short repr keeps hypothesis' reports readable."""

    def __repr__(self) -> str:
        return f"<tiny {', '.join(self)} checkpoints>"


def family_load(family: str):
    return importlib.import_module(f"lollm_qwen3_5.{family}.weights").load


@pytest.fixture(scope="module")
def sources(tiny_checkpoint):
    from lollm.load.loader import load_checkpoint

    out = Sources()
    for family in FAMILIES:
        folder = tiny_checkpoint(family, "multimodal")
        out[family] = (json.loads((folder / "config.json").read_text()), load_checkpoint(folder).weights)
    return out


def load_mutated(sources, family: str, change, weights=None):
    """The family's ``load`` on the tiny checkpoint with ``change(raw)`` applied to its config.json."""
    raw, tensors = sources[family]
    raw = copy.deepcopy(raw)
    change(raw)
    return load_with(family_load(family), raw, weights or tensors, "safetensors")


def put(*path, value, top=False):
    """A change setting ``path`` (from ``text_config`` down; from the top with ``top``) to ``value``."""
    def change(raw):
        target = raw if top else raw["text_config"]
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value
    return change


def one_more_layer(raw):
    text = raw["text_config"]
    text.pop("full_attention_interval", None)
    text["num_hidden_layers"] += 1
    text["layer_types"] = text["layer_types"] + ["full_attention"]


class Without:
    """A tensor source hiding some tensors of another (a checkpoint that lacks them)."""

    def __init__(self, source, *hidden: str):
        self.source, self.hidden = source, set(hidden)

    def names(self):
        return [n for n in self.source.names() if n not in self.hidden]

    def __getattr__(self, name):
        return getattr(self.source, name)


#: (change, the text the error must hold) for both families; the issue's cases and more.
CASES = {
    "heads 0": (put("num_attention_heads", value=0), "'num_attention_heads' is 0"),
    "kv heads a string": (put("num_key_value_heads", value="2"), "'num_key_value_heads' is '2'"),
    "vocab -1": (put("vocab_size", value=-1), "'vocab_size' is -1"),
    "eps -1": (put("rms_norm_eps", value=-1), "'rms_norm_eps' is -1"),
    "eps 0": (put("rms_norm_eps", value=0), "'rms_norm_eps' is 0"),
    "theta a string": (put("rope_parameters", "rope_theta", value="abc"), "'rope_theta' is 'abc'"),
    "theta 0": (put("rope_parameters", "rope_theta", value=0), "'rope_theta' is 0"),
    "theta NaN": (put("rope_parameters", "rope_theta", value=math.nan), "'rope_theta' is nan"),
    "theta true": (put("rope_parameters", "rope_theta", value=True), "'rope_theta' is True"),
    "rotary factor 0": (put("rope_parameters", "partial_rotary_factor", value=0), "'partial_rotary_factor' is 0"),
    "rope_scaling a list": (put("rope_scaling", value=[1, 2]), "'rope_scaling' is [1, 2]"),
    "eos with a null": (put("eos_token_id", value=[2, None]), "'eos_token_id' is [2, None]"),
    "quantization_config a list": (put("quantization_config", value=[1], top=True), "'quantization_config' is [1]"),
    "layer_types too short": (put("layer_types", value=["full_attention"]), "'layer_types' is ['full_attention']: expected a list of 8"),
    "layer_types unknown": (put("layer_types", value=["sliding_attention"] * 8), "'layer_types' holds 'sliding_attention'"),
    "bool as a string": (put("tie_word_embeddings", value="true", top=True), "'tie_word_embeddings' is 'true': expected true or false"),
    "gate as a string": (put("attn_output_gate", value="true"), "'attn_output_gate' is 'true'"),
    "layers absurd": (put("num_hidden_layers", value=10**9), "'num_hidden_layers' is 1000000000: expected an integer from 1 to 4096"),
    "layers not in the weights": (one_more_layer, "'num_hidden_layers' is 9, but the weights hold 8 layers"),
    "hidden not in the weights": (put("hidden_size", value=128), "'hidden_size' is 128, but the weights hold 'model.embed_tokens.weight'"),
    "vocab not in the weights": (put("vocab_size", value=1024), "'vocab_size' is 1024, but the weights hold 'model.embed_tokens.weight'"),
    "value heads not dividing": (put("linear_num_value_heads", value=3), "'linear_num_value_heads' (3) is not a multiple of 'linear_num_key_heads' (2)"),
    "conv kernel a string": (put("linear_conv_kernel_dim", value="4"), "'linear_conv_kernel_dim' is '4'"),
    "conv kernel not in the weights": (put("linear_conv_kernel_dim", value=5), "'linear_conv_kernel_dim' is 5, but the weights hold"),
    "mtp layers -1": (put("mtp_num_hidden_layers", value=-1), "'mtp_num_hidden_layers' is -1"),
    "context absurd": (put("max_position_embeddings", value=10**12), "'max_position_embeddings' is 1000000000000"),
}
MOE_CASES = {
    "top-k 0": (put("num_experts_per_tok", value=0), "'num_experts_per_tok' is 0"),
    "top-k past the experts": (put("num_experts_per_tok", value=17), "'num_experts_per_tok' is 17: expected an integer from 1 to 16"),
    # the per-expert tensors are counted while they are fused, before the table is checked
    "experts not in the weights": (put("num_experts", value=32), "the checkpoint has no tensor model.language_model.layers.0.mlp.experts.16"),
    "dense layers": (put("mlp_only_layers", value=[1]), "'mlp_only_layers' is [1]"),
    "normalise as a string": (put("norm_topk_prob", value="yes"), "'norm_topk_prob' is 'yes'"),
}
ALL_CASES = [(f, c) for f in FAMILIES for c in sorted(CASES)] + [("qwen3_5_moe", c) for c in sorted(MOE_CASES)]


@pytest.mark.parametrize("family,case", ALL_CASES)
def test_a_bad_config_value_is_refused_naming_the_key(sources, family, case):
    change, needle = {**CASES, **MOE_CASES}[case]
    with pytest.raises(WeightsError if case == "experts not in the weights" else ConfigError) as err:
        load_mutated(sources, family, change)
    assert needle in str(err.value) and str(err.value).startswith(f"{family}:")


@pytest.mark.parametrize("family", FAMILIES)
def test_untied_without_lm_head_is_refused_naming_the_tensor(sources, family):
    _, tensors = sources[family]

    def untie(raw):
        raw["tie_word_embeddings"] = raw["text_config"]["tie_word_embeddings"] = False

    with pytest.raises(WeightsError, match=r"'tie_word_embeddings' false\), but the checkpoint has no tensor for 'lm_head.weight'"):
        load_mutated(sources, family, untie, Without(tensors, "lm_head.weight"))


# ------------------------------------------------------------------ properties


@pytest.mark.parametrize("family", FAMILIES)
def test_the_unmutated_checkpoint_loads(sources, family):
    """The base of the mutations is a working checkpoint, so the property below sees real loads."""
    raw, weights = sources[family]
    assert isinstance(check_clean(lambda: load_and_generate(family_load(family), raw, weights, "safetensors")), GenerationResult)


@pytest.mark.parametrize("family", FAMILIES)
@fuzz_settings(max_examples=25)
@given(data=st.data())
def test_mutated_config_json_loads_or_fails_cleanly(sources, family, data):
    raw, weights = sources[family]
    config = data.draw(mutated(raw, skip=TOWERS), label="config.json")
    check_clean(lambda: load_and_generate(family_load(family), config, weights, "safetensors"))
