"""The conformance kit's own machinery, without any family: chunk schedules, the reference's
sensitivity to its checkpoint, the tiny GGUF writer (lollm.testing.conformance, .gguf_writer).

The kit run on real families, and the mutants it must fail, are tested in each family's
distribution (lollm-qwen/tests/test_conformance*.py, lollm-gemma/tests/test_gemma_conformance*.py).
"""

from __future__ import annotations

import pytest
import torch

from lollm.testing.conformance import reference_sensitivity
from lollm.testing.schedules import chunk_schedules, sliding_window_of
from lollm.cli.hub_configs import hub_config
from lollm.testing.tiny import SENSITIVE_INIT_STD, SENSITIVE_NORM_EPS, shrink_config, write_tiny_checkpoint


@pytest.mark.parametrize(("T", "window"), [(32, None), (20, 6), (32, 6), (5, 6), (9, 2)])
def test_schedules_cover_the_prompt_and_cross_the_window(T, window):
    schedules = chunk_schedules(T, window)
    assert all(sum(s) == T and min(s) >= 1 for s in schedules), schedules
    assert [1] * T in schedules
    if window and window + 1 < T:
        # a prefill past the window, then decodes; a chunk ending on W - 1, a decode on the edge, a straddling chunk
        assert [window + 1] + [1] * (T - window - 1) in schedules
        assert any(s[:3] == [window - 1, 1, window + 1] for s in schedules), schedules


def test_sliding_window_is_read_unless_turned_off():
    assert sliding_window_of({"sliding_window": 6}) == 6
    assert sliding_window_of({"text_config": {"sliding_window": 4}}) == 4
    assert sliding_window_of({"sliding_window": 32768, "use_sliding_window": False}) is None
    assert sliding_window_of({"sliding_window": None}) is None


def _qwen2(folder, **kw):
    config = shrink_config(hub_config("Qwen__Qwen2.5-0.5B"), **kw.pop("config", {}))
    return write_tiny_checkpoint(config, folder, schema="hub", **kw)


def test_default_init_is_blind_and_the_sensitive_checkpoint_is_not(tmp_path):
    """transformers' default initialisation hides a doubled RoPE base below 1e-2 (10 x the kit's
    bound); the spread weights and large epsilon of lollm.testing.tiny make every perturbation show."""
    from lollm.load.loader import load_checkpoint

    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(0))
    blind = reference_sensitivity(load_checkpoint(_qwen2(tmp_path / "blind")), ids)
    assert set(blind) == {"rope_theta", "norm_eps", "attention_scale"}  # no scaling, no sliding layer
    assert blind["rope_theta"] < 1e-2 and blind["norm_eps"] < 1e-2, blind
    sensitive = reference_sensitivity(load_checkpoint(_qwen2(
        tmp_path / "sensitive", init_std=SENSITIVE_INIT_STD, config={"rms_norm_eps": SENSITIVE_NORM_EPS})), ids)
    assert min(sensitive.values()) > 1e-2, sensitive


def test_tiny_gguf_holds_the_converter_names_and_the_reference_its_numbers(tmp_path):
    import gguf
    from safetensors.torch import load_file

    from lollm.gguf import GGUFFile
    from lollm.testing.gguf_writer import write_tiny_gguf

    folder = _qwen2(tmp_path / "ckpt", init_std=SENSITIVE_INIT_STD)
    path = write_tiny_gguf(folder, tmp_path / "tiny.gguf", "Q4_0", reference_dir=tmp_path / "ref")
    file = GGUFFile(path)
    types = {name: t.ggml_type for name, t in file.tensors.items()}
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["token_embd.weight"] == "Q4_0"
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q.bias"] == "F32"
    original = load_file(str(folder / "model.safetensors"))
    held = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert set(held) == set(original)
    q = original["model.layers.0.self_attn.q_proj.weight"]
    expected = gguf.quants.dequantize(gguf.quants.quantize(q.numpy(), gguf.GGMLQuantizationType.Q4_0),
                                      gguf.GGMLQuantizationType.Q4_0)
    torch.testing.assert_close(held["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(expected).reshape(q.shape))
    assert not torch.equal(held["model.layers.0.self_attn.q_proj.weight"], q)  # Q4_0 really changed it
    torch.testing.assert_close(held["model.norm.weight"], original["model.norm.weight"], rtol=0, atol=0)


def test_tiny_gguf_refuses_what_a_gguf_cannot_say(tmp_path):
    from lollm.testing.gguf_writer import write_tiny_gguf

    folder = _qwen2(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="ggml_type"):
        write_tiny_gguf(folder, tmp_path / "x.gguf", "Q5_K")
    gemma = shrink_config(hub_config("google__gemma-3-1b-it"), num_hidden_layers=6, sliding_window=6)
    gemma_dir = write_tiny_checkpoint(gemma, tmp_path / "gemma3", schema="hub")
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):  # 256 in the hub config, head_dim 16 here
        write_tiny_gguf(gemma_dir, tmp_path / "g.gguf", "F32")
    assert not (tmp_path / "g.gguf").exists()
