"""``lollm serve --memory-budget`` with ``--quantize int8/int4``: a safetensors model is estimated at its packed size.

Before it loads, a model's weights are estimated (lollm.serve.models.weight_bytes); the estimate is
held to what the load keeps, measured on the loaded model (lollm.load.quantized.model_bytes), for a
tiny Qwen2 (its own lm_head) and a tiny Gemma 3 (the head tied to the embedding), in both modes.
Counted at float size, a quantized model was refused by a budget it fits in.
"""

from __future__ import annotations

import pytest

from lollm.cli.hub_configs import hub_config
from lollm.load.options import LoadOptions
from lollm.load.quantized import Quantization
from lollm.serve.models import quantized_matrix_bytes, weight_bytes
from lollm.testing import serving
from lollm.testing.tiny import shrink_config, write_tiny_checkpoint, write_tiny_tokenizer

# installed together in the CI session that runs core's tests with the families (nox -s everything)
pytest.importorskip("lollm_qwen", reason="lollm-qwen loads the tiny qwen2")
pytest.importorskip("lollm_gemma", reason="lollm-gemma loads the tiny gemma3")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    site = tmp_path_factory.mktemp("quantized")
    raw = shrink_config(hub_config("google__gemma-3-1b-it"), num_hidden_layers=2, sliding_window=8, vocab_size=512,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return {"qwen": serving.write_chat_checkpoint(site / "qwen"),
            "gemma": write_tiny_tokenizer(write_tiny_checkpoint(raw, site / "gemma", schema="hub"), vocab_size=512)}


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_a_quantized_safetensors_model_is_estimated_within_10_percent_of_its_loaded_size(folders, name, mode):
    from lollm.load.pipeline import open_model
    from lollm.load.quantized import model_bytes

    loaded = open_model(str(folders[name]), LoadOptions(device="cpu", dtype="float32", quantize=mode))
    assert loaded.options.quantization.mode == mode
    held, weights = model_bytes(loaded.model), loaded.checkpoint.weights
    estimate = weight_bytes(weights, 4, quantization=loaded.options.quantization)
    assert abs(estimate - held) <= 0.10 * held, (estimate, held)
    assert weight_bytes(weights, 4) > 2.5 * held  # the float32 count it was before


def test_each_matrix_counts_the_bytes_of_its_packed_form():
    int8, int4 = Quantization("int8"), Quantization("int4", group_size=32)
    assert quantized_matrix_bytes("model.layers.0.mlp.up_proj.weight", (128, 64), int8) == 128 * 64 + 4 * 128
    # int4: two codes a byte, a bfloat16 scale and zero per 32 weights of a row
    assert quantized_matrix_bytes("model.layers.0.mlp.up_proj.weight", (128, 64), int4) == 128 * 32 + 2 * 128 * 4
    assert quantized_matrix_bytes("model.embed_tokens.weight", (512, 64), int4) == 512 * 64 + 4 * 512  # stays int8
    assert quantized_matrix_bytes("model.layers.0.mlp.up_proj.weight", (120, 64), int4) == 120 * 64 + 4 * 120  # no tile
    for name, shape in [("model.norm.weight", (64,)), ("model.layers.0.self_attn.q_proj.bias", (64,)),
                        ("model.vision_tower.encoder.layers.0.mlp.fc1.weight", (64, 64)),
                        ("model.visual.blocks.0.attn.qkv.weight", (96, 32)), ("conv1d.weight", (64, 1, 4))]:
        assert quantized_matrix_bytes(name, shape, int4) is None, name  # stays float
