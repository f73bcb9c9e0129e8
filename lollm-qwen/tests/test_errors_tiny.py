"""Bad input fails loudly, naming what is wrong: config keys, RoPE types, tensors, formats."""

from __future__ import annotations

import json
import shutil

import pytest
from lollm.errors import ConfigError, WeightsError
from lollm.testing.loading import load_with
from safetensors.torch import load_file, save_file

from _qwen_tiny import family, family_load, load_ours, tiny_checkpoint, torch  # noqa: F401


@pytest.fixture
def folder(tiny_checkpoint, family, tmp_path):
    """A private copy of a tiny checkpoint (hub schema, untied), free to damage."""
    src = tiny_checkpoint(family, "hub", tie_word_embeddings=False)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


DELETE = object()  # edit_config(folder, key=DELETE) removes the key


def edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})



# -- config.json --------------------------------------------------------------
@pytest.mark.parametrize(
    "key, spelling",
    [("rope_scaling", "type"), ("rope_scaling", "rope_type"), ("rope_parameters", "rope_type")],
)
@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "llama3"])
def test_unknown_rope_type_names_type_and_key(folder, family, key, spelling, rope_type):
    value = {spelling: rope_type, "factor": 2.0}
    if key == "rope_parameters":
        value["rope_theta"] = 10000.0
    edit_config(folder, **{key: value})
    with pytest.raises(ConfigError, match=rf"{key}.*{rope_type}"):
        load_ours(folder, family)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta"])
def test_missing_key_is_named(folder, family, key):
    edit_config(folder, **{key: DELETE})
    with pytest.raises(ConfigError, match=key):
        load_ours(folder, family)


def test_qwen3_needs_head_dim(tiny_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3", "hub"), dst)
    edit_config(dst, head_dim=DELETE)
    with pytest.raises(ConfigError, match="head_dim"):
        load_ours(dst, "qwen3")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_scaling": {"type": "linear"}}, "factor"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}}, "low_freq_factor"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ],
)
def test_unimplemented_settings_are_refused(folder, family, changes, named):
    edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=named):
        load_ours(folder, family)


# -- tensors ------------------------------------------------------------------
def test_wrong_shape_names_the_tensor(folder, family):
    name = "model.layers.1.mlp.up_proj.weight"
    edit_tensors(folder, lambda t: t.__setitem__(name, t[name][:-1].clone()))
    with pytest.raises(WeightsError, match=rf"{name}.*shape"):
        load_ours(folder, family)


def test_missing_tensor_is_named(folder, family):
    name = "model.layers.0.post_attention_layernorm.weight"
    edit_tensors(folder, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=name):
        load_ours(folder, family)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.extra_proj.weight",  # a name no qwen weight has
        "model.layers.7.mlp.up_proj.weight",  # a layer the config does not have
        "vision_tower.patch_embed.weight",
    ],
)
def test_unexpected_tensor_is_named(folder, family, name):
    edit_tensors(folder, lambda t: t.__setitem__(name, torch.zeros(4, 4)))
    with pytest.raises(WeightsError, match=name.replace(".", r"\.")):
        load_ours(folder, family)


def test_qwen3_bias_without_attention_bias_is_unexpected(tiny_checkpoint, tmp_path):
    """qwen3 has no q/k/v biases unless config.json says so; a stray one must not be dropped silently."""
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3", "hub"), folder)
    name = "model.layers.0.self_attn.q_proj.bias"
    edit_tensors(folder, lambda t: t.__setitem__(name, torch.zeros(4 * 32)))
    with pytest.raises(WeightsError, match=name.replace(".", r"\.")):
        load_ours(folder, "qwen3")


def test_old_rotary_buffers_in_the_file_are_skipped(folder, family):
    """Old exports saved RoPE's inv_freq; the model computes its own, so the file's copy is ignored."""
    edit_tensors(folder, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    model = load_ours(folder, family)
    assert not torch.equal(model.model.rotary_emb.inv_freq[:8], torch.ones(8))


def test_gguf_format_needs_gguf_metadata(folder, family):
    """fmt="gguf" reads llama.cpp's metadata keys: a config.json dict has none, and the error says which."""
    from lollm.load.loader import load_checkpoint

    ckpt = load_checkpoint(folder)
    with pytest.raises(ConfigError, match="general.architecture"):
        load_with(family_load(family), ckpt.config, ckpt.weights, "gguf")
