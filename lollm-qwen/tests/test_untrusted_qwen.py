"""Untrusted config.json and GGUF metadata (qwen2, qwen3): every value checked before anything is built.

Two parts:

* one unit test per input class, each asserting the error names the key (or the tensor) and,
  through the family's ``load`` on a tiny checkpoint's real tensors, that nothing is built the
  weights do not back;
* properties (hypothesis): each example mutates the real (shrunk) hub config, or the metadata
  of a tiny converter-style GGUF (:func:`lollm.testing.fuzz.mutated`: junk values, near misses,
  removed and added keys, at any depth), then loads it and generates two tokens;
  :func:`lollm.testing.fuzz.check_clean` bounds each run's CPU time (5 s) and memory (4 GiB)
  and fails on any exception that is not a LollmError. CI runs a fixed, derandomized budget;
  ``nox -s fuzz`` runs many more random examples.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lollm.generate.memory as memory
from lollm.errors import ConfigError, GenerationError, WeightsError
from lollm.generate.loop import GenerationResult, generate
from lollm.generate.sampling import SamplingParams
from lollm.testing.fuzz import check_clean, fuzz_settings, load_and_generate, mutated
from lollm.testing.loading import load_with

from _qwen_tiny import FAMILIES, family_load, real_config
from test_gguf_qwen import hf_folder_to_gguf

FAMILY_NAMES = sorted(FAMILIES)


class Sources(dict):
    """family -> its tiny checkpoint's parts; a short repr keeps hypothesis' failure reports readable."""

    def __repr__(self) -> str:
        return f"<tiny {', '.join(self)} checkpoints>"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """family -> {"hub" / "safetensors": (config.json dict in that schema, tensors), "gguf": (metadata, tensors)}
    of a tiny untied checkpoint (transformers writes it from the shrunk hub config)."""
    from lollm.gguf import GGUFTensorSource
    from lollm.load.loader import load_checkpoint
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    out = Sources()
    for family in FAMILY_NAMES:
        hub = shrink_config(real_config(family), **FAMILIES[family]["overrides"], tie_word_embeddings=False)
        folder = write_tiny_checkpoint(hub, tmp_path_factory.mktemp(family))
        gguf_path = hf_folder_to_gguf(folder, tmp_path_factory.mktemp(family + "-gguf") / "tiny.gguf", family)
        gguf = GGUFTensorSource(gguf_path)
        out[family] = {
            "hub": (hub, load_checkpoint(folder).weights),  # config.json in the hub schema (rope_theta at the top)
            "safetensors": (json.loads((folder / "config.json").read_text()), load_checkpoint(folder).weights),
            "gguf": (dict(gguf.metadata), gguf),
        }
    return out


class Without:
    """A tensor source hiding some tensors of another (a checkpoint that lacks them)."""

    def __init__(self, source, *hidden: str):
        self.source, self.hidden = source, set(hidden)

    def names(self):
        return [n for n in self.source.names() if n not in self.hidden]

    def __getattr__(self, name):
        return getattr(self.source, name)


def load_mutated(sources, family: str, fmt: str, change, weights=None):
    """The family's ``load`` on the tiny checkpoint with ``change(raw)`` applied to its config (or GGUF metadata)."""
    raw, tensors = sources[family][fmt]
    raw = copy.deepcopy(raw)
    change(raw)
    return load_with(family_load(family), raw, weights or tensors, "gguf" if fmt == "gguf" else "safetensors")


def put(key, value):
    def change(raw):
        raw[key] = value
    return change


def put_rope(**values):
    def change(raw):
        raw.pop("rope_theta", None)
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6, **values}
    return change


#: (change to the hub-schema config.json, the text the error must hold), the issue's cases and more.
CONFIG_CASES = {
    "heads 0": (put("num_attention_heads", 0), "'num_attention_heads' is 0"),
    "kv heads a string": (put("num_key_value_heads", "2"), "'num_key_value_heads' is '2'"),
    "kv heads not dividing": (put("num_key_value_heads", 3), "'num_attention_heads' (4) is not a multiple of 'num_key_value_heads' (3)"),
    "vocab -1": (put("vocab_size", -1), "'vocab_size' is -1"),
    "theta a string": (put("rope_theta", "abc"), "'rope_theta' is 'abc'"),
    "theta 0": (put("rope_theta", 0), "'rope_theta' is 0"),
    "theta negative": (put("rope_theta", -1e6), "'rope_theta' is -1000000.0"),
    "theta NaN": (put("rope_theta", math.nan), "'rope_theta' is nan"),
    "theta true": (put("rope_theta", True), "'rope_theta' is True"),
    "theta in rope_parameters": (put_rope(rope_theta="abc"), "'rope_parameters' 'rope_theta' is 'abc'"),
    "scaling factor 0": (put_rope(rope_type="linear", factor=0), "'rope_parameters' 'factor' is 0"),
    "yarn beta negative": (put_rope(rope_type="yarn", factor=4.0, beta_fast=-1), "'beta_fast' is -1"),
    "eos with a null": (put("eos_token_id", [2, None]), "'eos_token_id' is [2, None]"),
    "rope_scaling a list": (put("rope_scaling", [1, 2]), "'rope_scaling' is [1, 2]"),
    "quantization_config a string": (put("quantization_config", "fp8"), "'quantization_config' is 'fp8'"),
    "quantization_config a list": (put("quantization_config", [1]), "'quantization_config' is [1]"),
    "eps -1": (put("rms_norm_eps", -1), "'rms_norm_eps' is -1"),
    "eps 0": (put("rms_norm_eps", 0), "'rms_norm_eps' is 0"),
    "layer_types too short": (put("layer_types", ["full_attention"]), "'layer_types' is ['full_attention']: expected a list of 2"),
    "layer_types unknown": (put("layer_types", ["full_attention", "linear_attention"]), "'layer_types' holds 'linear_attention'"),
    "bool as a string": (put("tie_word_embeddings", "false"), "'tie_word_embeddings' is 'false': expected true or false"),
    "sliding window as a string": (put("use_sliding_window", "true"), "'use_sliding_window' is 'true'"),
    "layers absurd": (put("num_hidden_layers", 10**9), "'num_hidden_layers' is 1000000000: expected an integer from 1 to 4096"),
    "layers not in the weights": (put("num_hidden_layers", 3), "'num_hidden_layers' is 3, but the weights hold 2 layers"),
    "hidden not in the weights": (put("hidden_size", 128), "'hidden_size' is 128, but the weights hold 'model.embed_tokens.weight'"),
    "vocab not in the weights": (put("vocab_size", 1024), "'vocab_size' is 1024, but the weights hold 'model.embed_tokens.weight'"),
    "mlp not in the weights": (put("intermediate_size", 256), "'intermediate_size' is 256, but the weights hold"),
    "context absurd": (put("max_position_embeddings", 10**12), "'max_position_embeddings' is 1000000000000"),
    "model_type missing": (lambda raw: raw.clear(), "has no 'model_type'"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_bad_config_value_is_refused_naming_the_key(sources, family, case):
    change, needle = CONFIG_CASES[case]
    if family == "qwen3" and case == "hidden not in the weights":
        needle = "'hidden_size' is 128"  # qwen3's head_dim is explicit: the embedding check names it
    with pytest.raises(ConfigError) as err:
        load_mutated(sources, family, "hub", change)
    assert needle in str(err.value) and str(err.value).startswith(f"{family}: config.json")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_untied_without_lm_head_is_refused_naming_the_tensor(sources, family):
    """tie_word_embeddings false and no lm_head.weight: an error, not a silently tied head."""
    _, tensors = sources[family]["hub"]
    with pytest.raises(WeightsError, match=r"'tie_word_embeddings' false\), but the checkpoint has no tensor for 'lm_head.weight'"):
        load_mutated(sources, family, "hub", put("tie_word_embeddings", False), Without(tensors, "lm_head.weight"))
    tied = load_mutated(sources, family, "hub", put("tie_word_embeddings", True), Without(tensors, "lm_head.weight"))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


#: (change to the GGUF metadata, the text the error must hold); ``{a}`` is the architecture.
GGUF_CASES = {
    "head_count 0": ({"{a}.attention.head_count": 0}, "'{a}.attention.head_count' is 0"),
    "block_count absurd": ({"{a}.block_count": 2**31}, "'{a}.block_count' is 2147483648"),
    "block_count not in the weights": ({"{a}.block_count": 5}, "'{a}.block_count' is 5, but the weights hold 2 layers"),
    "embedding_length not in the weights": ({"{a}.embedding_length": 32}, "'{a}.embedding_length' is 32"),
    "freq_base a string": ({"{a}.rope.freq_base": "abc"}, "'{a}.rope.freq_base' is 'abc'"),
    "freq_base NaN": ({"{a}.rope.freq_base": math.nan}, "'{a}.rope.freq_base' is nan"),
    "eps negative": ({"{a}.attention.layer_norm_rms_epsilon": -1.0}, "'{a}.attention.layer_norm_rms_epsilon' is -1.0"),
    "head_count_kv a list": ({"{a}.attention.head_count_kv": [2, 2]}, "'{a}.attention.head_count_kv' is [2, 2]"),
    "scaling factor 0": ({"{a}.rope.scaling.type": "linear", "{a}.rope.scaling.factor": 0.0}, "'{a}.rope.scaling.factor' is 0.0"),
    "eos a string": ({"tokenizer.ggml.eos_token_id": "2"}, "'tokenizer.ggml.eos_token_id' is '2'"),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_bad_gguf_value_is_refused_naming_the_key(sources, family, case):
    values, needle = GGUF_CASES[case]
    change = {k.format(a=family): v for k, v in values.items()}
    with pytest.raises(ConfigError) as err:
        load_mutated(sources, family, "gguf", lambda raw: raw.update(change))
    assert needle.format(a=family) in str(err.value) and str(err.value).startswith(f"{family}: GGUF")


def test_a_huge_context_and_many_new_tokens_end_before_the_cache_is_allocated(sources, monkeypatch):
    """max_position_embeddings 2**24 (the bound) and -n 2**24: the tiny model's cache would take 8 GiB."""
    model = load_mutated(sources, "qwen2", "hub", put("max_position_embeddings", 2**24))
    monkeypatch.setattr(memory, "free_memory", lambda device: 2**30)
    with pytest.raises(GenerationError, match=r"a cache for 16,777,216 positions .* needs 8\.0 GiB, but only 1\.0 GiB are free"):
        generate(model, [1, 2, 3], max_new_tokens=2**24, sampling=SamplingParams(temperature=0.0))


def test_a_prompt_id_past_the_embedding_is_a_generation_error(sources):
    model = load_mutated(sources, "qwen2", "hub", lambda raw: None)
    with pytest.raises(GenerationError, match="the prompt holds the token id 512, but the model's vocabulary has ids 0 .. 511"):
        generate(model, [1, 512], max_new_tokens=1, sampling=SamplingParams(temperature=0.0))


# ------------------------------------------------------------------ properties


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_unmutated_checkpoint_loads(sources, family, fmt):
    """The base of the mutations is a working checkpoint, so the properties below see real loads."""
    raw, weights = sources[family][fmt]
    assert isinstance(check_clean(lambda: load_and_generate(family_load(family), raw, weights, fmt)), GenerationResult)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@fuzz_settings(max_examples=30)
@given(data=st.data())
def test_mutated_config_json_loads_or_fails_cleanly(sources, family, data):
    raw, weights = sources[family]["safetensors"]
    config = data.draw(mutated(raw), label="config.json")
    check_clean(lambda: load_and_generate(family_load(family), config, weights, "safetensors"))


@pytest.mark.parametrize("family", FAMILY_NAMES)
@fuzz_settings(max_examples=25)
@given(data=st.data())
def test_mutated_gguf_metadata_loads_or_fails_cleanly(sources, family, data):
    metadata, weights = sources[family]["gguf"]
    # the keys the family reads (the tokenizer's long lists are left alone: lollm.tokenizer reads them)
    arch_keys = {k: v for k, v in metadata.items() if not k.startswith("tokenizer.") or k == "tokenizer.ggml.eos_token_id"}
    changed = data.draw(mutated(arch_keys, gguf=True, key_prefix=f"{family}."), label="GGUF metadata")
    merged = {k: v for k, v in metadata.items() if k not in arch_keys} | changed
    check_clean(lambda: load_and_generate(family_load(family), merged, weights, "gguf"))
