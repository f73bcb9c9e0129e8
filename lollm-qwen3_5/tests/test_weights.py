"""Loading: name maps of both layouts, vision tensors skipped, unknown tensors named, bad GGUF metadata named.

(GGUF files written by llama.cpp's converter: test_gguf_qwen3_5.py.)"""

from __future__ import annotations

import importlib
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lollm.errors import ConfigError, WeightsError
from lollm.load.loader import load_checkpoint
from lollm.load.options import LoadOptions
from lollm.load.plugins import get_registry
from lollm.testing.loading import load_with

FAMILIES = ["qwen3_5", "qwen3_5_moe"]


def _load(family):
    return importlib.import_module(f"lollm_qwen3_5.{family}.weights").load


@pytest.mark.parametrize("family,arch", [("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe")])
def test_gguf_routes_to_the_family(family, arch):
    installed = get_registry().route(gguf_architecture=arch)
    assert installed.family.name == family


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unknown_tensor_is_named(family, tiny_checkpoint, tmp_path):
    src = tiny_checkpoint(family, "multimodal")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.language_model.layers.1.linear_attn.extra_bias"] = torch.zeros(4)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    ckpt = load_checkpoint(broken)
    with pytest.raises(WeightsError, match=r"model\.language_model\.layers\.1\.linear_attn\.extra_bias"):
        load_with(_load(family), ckpt.config, ckpt.weights, "safetensors")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tensor_on_the_wrong_kind_of_layer_is_named(family, tiny_checkpoint, tmp_path):
    """Layer 3 is full attention: a DeltaNet tensor there has no slot."""
    src = tiny_checkpoint(family, "text")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.3.linear_attn.A_log"] = tensors["model.layers.0.linear_attn.A_log"].clone()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    ckpt = load_checkpoint(broken)
    with pytest.raises(WeightsError, match=r"model\.layers\.3\.linear_attn\.A_log"):
        load_with(_load(family), ckpt.config, ckpt.weights, "safetensors")


def test_a_missing_output_head_is_an_error_when_not_tied(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen3_5_moe", "text")  # the MoE releases do not tie
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    ckpt = load_checkpoint(broken)
    with pytest.raises(WeightsError, match="lm_head.weight"):
        load_with(_load("qwen3_5_moe"), ckpt.config, ckpt.weights, "safetensors")


def test_tied_output_head_shares_the_embedding(tiny_checkpoint, load_ours):
    model = load_ours(tiny_checkpoint("qwen3_5", "multimodal"))  # Qwen3.5-0.8B ties its embeddings
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("family,arch", [("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe")])
@pytest.mark.parametrize("extra", [None, "rope.scaling.type"])
def test_a_gguf_file_with_bad_metadata_is_refused_end_to_end(family, arch, extra, tmp_path):
    """A .gguf file (written by gguf-py) goes loader -> router -> this family, which names the missing
    key (``{arch}.embedding_length``) or a key it does not implement (``{arch}.rope.scaling.type``)."""
    import gguf
    import numpy as np

    from lollm.load.pipeline import open_model

    path = tmp_path / f"tiny-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if extra:
        writer.add_string(f"{arch}.{extra}", "yarn")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    key = re.escape(f"{arch}.{extra or 'embedding_length'}")
    with pytest.raises(ConfigError, match=rf"{family}: .*{key}"):
        open_model(str(path), LoadOptions(device="cpu", dtype="float32"))
