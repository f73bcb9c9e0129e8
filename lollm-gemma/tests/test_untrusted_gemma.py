"""Untrusted config.json and GGUF metadata (gemma2, gemma3, gemma4): every value checked before anything is built.

Two parts:

* one unit test per input class, each asserting the error names the key (or the tensor),
  through the family's ``load`` on a tiny checkpoint's real tensors (so the sizes are also
  checked against the weights before anything is built);
* properties (hypothesis): each example mutates the config.json of a tiny checkpoint made from
  a real hub config, or the metadata of a tiny converter-style GGUF
  (:func:`lollm.testing.fuzz.mutated`: junk values, near misses, removed and added keys, at any
  depth), loads it against that checkpoint's real tensors and generates two tokens;
  :func:`lollm.testing.fuzz.check_clean` bounds each run's CPU time (5 s) and memory (4 GiB)
  and fails on any exception that is not a LollmError. Gemma 3 has no tiny GGUF writer here:
  its metadata is fuzzed through ``Gemma3Config.from_gguf`` on the real 270M file's keys. CI
  runs a fixed, derandomized budget; ``nox -s fuzz`` runs many more random examples.
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

from _gemma_testing import TINY, write_gemma2_gguf, write_gemma4_gguf
from test_gemma_gguf import _gemma3_metadata

#: family -> the tiny checkpoint (conftest ``tiny``) its config.json examples start from.
CHECKPOINTS = {"gemma2": "gemma2", "gemma3": "gemma3-4b", "gemma4": "gemma4-e2b"}
#: family -> (tiny checkpoint, writer) of its converter-style GGUF.
#: The multimodal configs' towers: never read by a text family, so no example spends a change there.
TOWERS = ("vision_config", "audio_config")
GGUF = {"gemma2": ("gemma2-gguf", write_gemma2_gguf), "gemma4": ("gemma4-e2b-text", write_gemma4_gguf)}


class Sources(dict):
    """(family, fmt) -> (config or metadata, tensors); a short repr keeps hypothesis' reports readable."""

    def __repr__(self) -> str:
        return f"<tiny checkpoints {sorted(self)}>"


def family_load(family: str):
    return importlib.import_module(f"lollm_gemma.{family}.weights").load


@pytest.fixture(scope="module")
def sources(tiny, tmp_path_factory):
    from lollm.gguf import GGUFTensorSource
    from lollm.load.loader import load_checkpoint

    out = Sources()
    for family, name in CHECKPOINTS.items():
        folder = tiny(name, "transformers5")
        out[family, "safetensors"] = (json.loads((folder / "config.json").read_text()), load_checkpoint(folder).weights)
        out[family, "hub"] = (TINY[name](), load_checkpoint(folder).weights)  # the hub spelling of the same model
    for family, (name, write) in GGUF.items():
        path = write(tiny(name, "transformers5"), tmp_path_factory.mktemp(family) / "tiny.gguf")
        source = GGUFTensorSource(path)
        out[family, "gguf"] = (dict(source.metadata), source)
    return out


def load_mutated(sources, family: str, fmt: str, change, weights=None):
    """The family's ``load`` on the tiny checkpoint with ``change(raw)`` applied to its config (or GGUF metadata)."""
    raw, tensors = sources[family, fmt]
    raw = copy.deepcopy(raw)
    change(raw)
    return load_with(family_load(family), raw, weights or tensors, "gguf" if fmt == "gguf" else "safetensors")


def decoder(raw: dict) -> dict:
    """The dict holding the decoder's keys: ``text_config`` in the multimodal layout."""
    return raw.get("text_config", raw)


def put(*path, value):
    """A change setting ``path`` (keys from the decoder's dict down) to ``value``."""
    def change(raw):
        target = decoder(raw)
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value
    return change


def one_more_layer(raw):
    text = decoder(raw)
    text["num_hidden_layers"] += 1
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"] + ["full_attention"]


#: family -> where its global layers' RoPE settings live in the tiny hub-spelled config
GLOBAL_ROPE = {"gemma2": (), "gemma3": (), "gemma4": ("rope_parameters", "full_attention")}

#: (change, the text the error must hold) for every family; the issue's cases and more.
CASES = {
    "heads 0": (put("num_attention_heads", value=0), "'num_attention_heads' is 0"),
    "kv heads a string": (put("num_key_value_heads", value="2"), "'num_key_value_heads' is '2'"),
    "kv heads not dividing": (put("num_key_value_heads", value=3), "'num_attention_heads' (4) is not a multiple of"),
    "vocab -1": (put("vocab_size", value=-1), "'vocab_size' is -1"),
    "eps -1": (put("rms_norm_eps", value=-1), "'rms_norm_eps' is -1"),
    "eps 0": (put("rms_norm_eps", value=0), "'rms_norm_eps' is 0"),
    "sliding window 0": (put("sliding_window", value=0), "'sliding_window' is 0"),
    "bool as a string": (put("tie_word_embeddings", value="false"), "'tie_word_embeddings' is 'false': expected true or false"),
    "eos with a null": (put("eos_token_id", value=[1, None]), "'eos_token_id' is [1, None]"),
    "quantization_config a string": (put("quantization_config", value="fp8"), "'quantization_config' is 'fp8'"),
    "layer_types too short": (put("layer_types", value=["full_attention"]), "'layer_types' is ['full_attention']: expected a list of"),
    "layer_types unknown": (lambda raw: decoder(raw).update(layer_types=["linear_attention"] * decoder(raw)["num_hidden_layers"]),
                            "'layer_types' holds 'linear_attention'"),
    "layers absurd": (put("num_hidden_layers", value=10**9), "'num_hidden_layers' is 1000000000: expected an integer from 1 to 4096"),
    "layers not in the weights": (one_more_layer, "layers (model.layers.0 .. model.layers."),
    "hidden not in the weights": (put("hidden_size", value=128), "'hidden_size' is 128, but the weights hold 'model.embed_tokens.weight'"),
    "vocab not in the weights": (put("vocab_size", value=1024), "'vocab_size' is 1024, but the weights hold 'model.embed_tokens.weight'"),
    "context absurd": (put("max_position_embeddings", value=10**12), "'max_position_embeddings' is 1000000000000"),
}
#: per family: rope and family-only keys
RoPE_CASES = {
    "theta a string": ("rope_theta", "abc", "'rope_theta' is 'abc'"),
    "theta 0": ("rope_theta", 0, "'rope_theta' is 0"),
    "theta NaN": ("rope_theta", math.nan, "'rope_theta' is nan"),
    "theta true": ("rope_theta", True, "'rope_theta' is True"),
}
FAMILY_CASES = {
    "gemma2": {
        "scaling factor 0": (put("rope_scaling", value={"rope_type": "linear", "factor": 0}), "'rope_scaling' 'factor' is 0"),
        "rope_scaling a list": (put("rope_scaling", value=[1, 2]), "'rope_scaling' is [1, 2]"),
        "soft-cap 0": (put("attn_logit_softcapping", value=0), "'attn_logit_softcapping' is 0"),
        "query scalar a string": (put("query_pre_attn_scalar", value="256"), "'query_pre_attn_scalar' is '256'"),
    },
    "gemma3": {
        "scaling factor 0": (put("rope_scaling", "factor", value=0), "'rope_scaling' 'factor' is 0"),
        "rope_scaling a list": (put("rope_scaling", value=[1, 2]), "'rope_scaling' is [1, 2]"),
        "pattern 0": (put("sliding_window_pattern", value=0), "'sliding_window_pattern' is 0"),
    },
    "gemma4": {
        "scaling factor 0": (put("rope_parameters", "full_attention", "factor", value=0), "'full_attention' 'factor' is 0"),
        "rope_parameters a list": (put("rope_parameters", value=[1, 2]), "'rope_parameters' is [1, 2]"),
        "shared layers -1": (put("num_kv_shared_layers", value=-1), "'num_kv_shared_layers' is -1"),
        "per-layer width a string": (put("hidden_size_per_layer_input", value="256"), "'hidden_size_per_layer_input' is '256'"),
        "k_eq_v as 1": (put("attention_k_eq_v", value=1), "'attention_k_eq_v' is 1: expected true or false"),
        "last layer sliding": (put("layer_types", value=["sliding_attention"] * 10), "Gemma 4's last layer must be 'full_attention'"),
    },
}
ALL_CASES = [(f, c) for f in sorted(CHECKPOINTS) for c in sorted(CASES) + sorted(RoPE_CASES) + sorted(FAMILY_CASES[f])]


@pytest.mark.parametrize("family,case", ALL_CASES)
def test_a_bad_config_value_is_refused_naming_the_key(sources, family, case):
    if case in RoPE_CASES:
        key, value, needle = RoPE_CASES[case]
        change = put(*GLOBAL_ROPE[family], key, value=value)
    else:
        change, needle = {**CASES, **FAMILY_CASES[family]}[case]
    with pytest.raises(ConfigError) as err:
        load_mutated(sources, family, "hub", change)
    assert needle in str(err.value) and str(err.value).startswith(f"{family}: config.json")


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_untied_without_lm_head_is_refused_naming_the_tensor(sources, family):
    """The tiny checkpoints have no lm_head.weight (tied, as every Gemma): saying they are untied is an error."""
    untie = (lambda raw: raw.update(tie_word_embeddings=False)) if family != "gemma2" else put("tie_word_embeddings", value=False)
    with pytest.raises(WeightsError, match=r"'tie_word_embeddings' false\), but the checkpoint has no tensor for 'lm_head.weight'"):
        load_mutated(sources, family, "hub", untie)


#: (family, change to its GGUF metadata, the text the error must hold)
GGUF_CASES = [
    ("gemma2", {"gemma2.attention.head_count": 0}, "'gemma2.attention.head_count' is 0"),
    ("gemma2", {"gemma2.block_count": 2**31}, "'gemma2.block_count' is 2147483648"),
    ("gemma2", {"gemma2.block_count": 5}, "'gemma2.block_count' is 5, but the weights hold 4 layers"),
    ("gemma2", {"gemma2.rope.freq_base": math.nan}, "'gemma2.rope.freq_base' is nan"),
    ("gemma2", {"gemma2.attn_logit_softcapping": -1.0}, "'gemma2.attn_logit_softcapping' is -1.0"),
    ("gemma4", {"gemma4.attention.head_count": 0}, "'gemma4.attention.head_count' is 0"),
    ("gemma4", {"gemma4.attention.sliding_window": 0}, "'gemma4.attention.sliding_window' is 0"),
    ("gemma4", {"gemma4.attention.shared_kv_layers": "5"}, "'gemma4.attention.shared_kv_layers' is '5'"),
    ("gemma4", {"gemma4.feed_forward_length": [0] * 10}, "'gemma4.feed_forward_length' is [0, 0"),
]


@pytest.mark.parametrize("family,change,needle", GGUF_CASES)
def test_a_bad_gguf_value_is_refused_naming_the_key(sources, family, change, needle):
    with pytest.raises(ConfigError) as err:
        load_mutated(sources, family, "gguf", lambda raw: raw.update(change))
    assert needle in str(err.value) and str(err.value).startswith(f"{family}: GGUF")


# ------------------------------------------------------------------ properties


@pytest.mark.parametrize("family,fmt", [(f, "safetensors") for f in CHECKPOINTS] + [(f, "gguf") for f in GGUF])
def test_the_unmutated_checkpoint_loads(sources, family, fmt):
    """The base of the mutations is a working checkpoint, so the properties below see real loads."""
    raw, weights = sources[family, fmt]
    assert isinstance(check_clean(lambda: load_and_generate(family_load(family), raw, weights, fmt)), GenerationResult)


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
@fuzz_settings(max_examples=25)
@given(data=st.data())
def test_mutated_config_json_loads_or_fails_cleanly(sources, family, data):
    raw, weights = sources[family, "safetensors"]
    config = data.draw(mutated(raw, skip=TOWERS), label="config.json")
    check_clean(lambda: load_and_generate(family_load(family), config, weights, "safetensors"))


@pytest.mark.parametrize("family", sorted(GGUF))
@fuzz_settings(max_examples=25)
@given(data=st.data())
def test_mutated_gguf_metadata_loads_or_fails_cleanly(sources, family, data):
    metadata, weights = sources[family, "gguf"]
    # the keys the family reads (the tokenizer's long lists are left alone: lollm.tokenizer reads them)
    read = {k: v for k, v in metadata.items() if not k.startswith("tokenizer.") or k.endswith(("eos_token_id", "eot_token_id"))}
    changed = data.draw(mutated(read, gguf=True, key_prefix=f"{family}."), label="GGUF metadata")
    merged = {k: v for k, v in metadata.items() if k not in read} | changed
    check_clean(lambda: load_and_generate(family_load(family), merged, weights, "gguf"))


@fuzz_settings(max_examples=40)
@given(metadata=mutated(_gemma3_metadata(), gguf=True, key_prefix="gemma3."))
def test_mutated_gemma3_gguf_metadata_parses_or_fails_cleanly(metadata):
    from lollm_gemma.gemma3.config import Gemma3Config

    check_clean(lambda: Gemma3Config.from_gguf(metadata, vocab_size=262144, tie_word_embeddings=True))
