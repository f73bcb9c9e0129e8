"""Loading: unknown, missing and unused tensors, the GGUF seam, and what each error names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _gemma_testing import load_ours
from safetensors.torch import load_file, save_file

from lollm.errors import ConfigError, WeightsError
from lollm.testing.loading import load_with


def _edited_copy(src: Path, dst: Path, *, drop: str | None = None, add: dict[str, torch.Tensor] | None = None,
                 config: dict | None = None) -> Path:
    """A copy of a checkpoint folder with one tensor dropped, tensors added, or config.json replaced."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    if drop is not None:
        del tensors[drop]
    tensors.update(add or {})
    save_file(tensors, str(dst / "model.safetensors"))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst


@pytest.mark.parametrize(
    "name,extra",
    [
        ("gemma2", "model.layers.0.self_attn.q_norm.weight"),  # gemma2 has no QK-norm
        ("gemma3-270m", "model.layers.1.mlp.bias"),
        ("gemma3-4b", "model.audio_tower.weight"),  # gemma3 has no audio tower
        ("gemma4-e2b-text", "model.layers.2.self_attn.v_norm.weight"),  # v_norm has no weight
        ("gemma4-e2b", "model.language_model.layers.0.router.proj.weight"),  # an MoE tensor
    ],
)
def test_unknown_tensor_raises_naming_it(tiny, tmp_path, name, extra):
    folder = _edited_copy(tiny(name, "transformers5"), tmp_path / "ckpt", add={extra: torch.zeros(4)})
    with pytest.raises(WeightsError, match=extra.replace(".", r"\.")):
        load_ours(folder)


@pytest.mark.parametrize(
    "name,missing",
    [
        ("gemma2", "model.layers.3.post_feedforward_layernorm.weight"),
        ("gemma3-270m", "model.layers.2.self_attn.k_norm.weight"),
        ("gemma4-e2b-text", "model.layers.7.layer_scalar"),  # a buffer, loaded like a weight
        ("gemma4-e2b-text", "model.embed_tokens_per_layer.weight"),
    ],
)
def test_missing_tensor_raises_naming_it(tiny, tmp_path, name, missing):
    folder = _edited_copy(tiny(name, "transformers5"), tmp_path / "ckpt", drop=missing)
    with pytest.raises(WeightsError, match=missing.replace(".", r"\.")):
        load_ours(folder)


def test_gemma4_unused_kv_weights_of_sharing_layers_are_skipped(tiny, tmp_path):
    """Checkpoints may carry k/v weights for the KV-sharing layers, which never use them."""
    src = tiny("gemma4-e2b-text", "transformers5")
    unused = {"model.layers.7.self_attn.k_proj.weight": torch.zeros(32, 64),
              "model.layers.9.self_attn.v_proj.weight": torch.zeros(64, 64)}
    folder = _edited_copy(src, tmp_path / "ckpt", add=unused)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    with torch.inference_mode():
        torch.testing.assert_close(load_ours(folder)(ids), load_ours(src)(ids))
    # ... but only there: a non-sharing layer's own k_proj stays required and unique
    folder = _edited_copy(src, tmp_path / "ckpt2", drop="model.layers.3.self_attn.k_proj.weight")
    with pytest.raises(WeightsError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight"):
        load_ours(folder)


def test_unknown_rope_type_in_a_checkpoint_raises(tiny, tmp_path):
    src = tiny("gemma3-270m", "transformers5")
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"]["full_attention"] = {"rope_type": "su", "rope_theta": 1e6}
    folder = _edited_copy(src, tmp_path / "ckpt", config=config)
    with pytest.raises(ConfigError, match="'su'"):
        load_ours(folder)


def test_gemma4_gguf_checks_the_architecture():
    """gemma4 reads GGUF (test_gemma_gguf.py); metadata of another architecture is refused by name."""
    from lollm_gemma.gemma4.weights import load

    class NoTensors:
        def names(self):
            return []

    with pytest.raises(ConfigError, match=r"gemma4: GGUF general.architecture is 'gemma3', expected 'gemma4'"):
        load_with(load, {"general.architecture": "gemma3"}, NoTensors(), "gguf")


def test_tied_output_head(tiny):
    model = load_ours(tiny("gemma3-270m", "transformers5"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
