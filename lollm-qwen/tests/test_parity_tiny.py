"""Our qwen2 / qwen3 against transformers on tiny random checkpoints that transformers wrote.

Logits of every position (same argmax, cosine >= 0.99999, small max |diff|)
and hidden states (transformers' ``output_hidden_states`` order), in both
config.json schemas, with tied and untied embeddings, scaled RoPE, and
several GQA shapes.
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from lollm.load.options import LoadOptions

from _qwen_tiny import (  # noqa: F401  (family and tiny_checkpoint are fixtures)
    assert_logits_close,
    family,
    load_ours,
    load_reference,
    prompt,
    tiny_checkpoint,
    torch,
)

SCHEMAS = ("hub", "transformers5")


def run_both(folder, family_name):
    """(our logits, our hidden states, reference logits, reference hidden states) on a 40-token prompt."""
    ours, ref = load_ours(folder, family_name), load_reference(folder)
    ids = prompt(ours.vocab_size)
    hidden: list = []
    with torch.inference_mode():
        logits = ours(ids, hidden_states=hidden)
        out = ref(ids, output_hidden_states=True)
    return logits, hidden, out.logits, out.hidden_states


@pytest.mark.parametrize("schema", SCHEMAS)
def test_logits_and_hidden_states_match_transformers(tiny_checkpoint, family, schema):
    folder = tiny_checkpoint(family, schema)
    config_text = (folder / "config.json").read_text()
    assert ("rope_parameters" in config_text) == (schema == "transformers5")

    logits, hidden, ref_logits, ref_hidden = run_both(folder, family)
    assert logits.shape == (1, 40, 512)
    assert_logits_close(logits, ref_logits)
    assert len(hidden) == len(ref_hidden) == 3  # embeddings, layer 0, final-normed layer 1
    for i, (h, r) in enumerate(zip(hidden, ref_hidden)):
        assert torch.allclose(h, r, atol=1e-5, rtol=1e-4), f"hidden state {i} differs by {(h - r).abs().max():.3g}"


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embeddings(tiny_checkpoint, family, tie):
    folder = tiny_checkpoint(family, "hub", tie_word_embeddings=tie)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tie)

    model = load_ours(folder, family)
    shared = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shared == tie
    logits, _, ref_logits, _ = run_both(folder, family)
    assert_logits_close(logits, ref_logits)


ROPE_SCALINGS = {
    "linear-hub": ("hub", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    "linear-t5": ("transformers5", {"rope_scaling": {"rope_type": "linear", "factor": 2.5}}),
    # positions run past original_max_position_embeddings (40 > 16): both ramps matter
    "yarn-hub": ("hub", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                         "max_position_embeddings": 64}),
    # beta_fast / beta_slow chosen so that the ramp's ends move against the defaults (32 / 1)
    "yarn-t5-params": ("transformers5", {
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 16.0, "beta_slow": 4.0, "attention_factor": 1.3},
        "max_position_embeddings": 32768}),
    "yarn-mscale": ("hub", {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
        "max_position_embeddings": 64}),
}


@pytest.mark.parametrize("case", sorted(ROPE_SCALINGS))
def test_rope_scaling_matches_transformers(tiny_checkpoint, family, case):
    schema, overrides = ROPE_SCALINGS[case]
    folder = tiny_checkpoint(family, schema, **overrides)
    logits, _, ref_logits, _ = run_both(folder, family)
    assert_logits_close(logits, ref_logits)

    # the scaling really changes the model (so this test would notice it being ignored)
    plain = tiny_checkpoint(family, schema)
    with torch.inference_mode():
        plain_logits = load_ours(plain, family)(prompt(512))
    assert not torch.allclose(plain_logits, logits, atol=1e-3)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_mqa_and_mha_shapes(tiny_checkpoint, family, kv_heads):
    """GQA with one shared K/V head (MQA) and with one K/V head per query head (plain MHA), 3 layers."""
    folder = tiny_checkpoint(family, "transformers5", num_key_value_heads=kv_heads, num_hidden_layers=3)
    logits, hidden, ref_logits, ref_hidden = run_both(folder, family)
    assert_logits_close(logits, ref_logits)
    assert len(hidden) == len(ref_hidden) == 4


def test_qwen3_attention_bias(tiny_checkpoint):
    """``attention_bias: true`` gives qwen3 biases on q/k/v/o (as transformers builds it)."""
    folder = tiny_checkpoint("qwen3", "hub", attention_bias=True)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.self_attn.o_proj.bias" in f.keys()
    logits, _, ref_logits, _ = run_both(folder, "qwen3")
    assert_logits_close(logits, ref_logits)


def test_logits_to_keep(tiny_checkpoint, family):
    model = load_ours(tiny_checkpoint(family), family)
    ids = prompt(model.vocab_size)
    with torch.inference_mode():
        full = model(ids)
        last = model(ids, logits_to_keep=1)
        last3 = model(ids, logits_to_keep=3)
    assert last.shape == (1, 1, 512) and last3.shape == (1, 3, 512)
    assert torch.allclose(last, full[:, -1:], atol=1e-6)
    assert torch.allclose(last3, full[:, -3:], atol=1e-6)


def test_protocol_attributes(tiny_checkpoint, family):
    folder = tiny_checkpoint(family, "hub")
    raw = json.loads((folder / "config.json").read_text())
    model = load_ours(folder, family)
    assert model.vocab_size == 512
    assert model.num_layers == 2
    assert model.max_context == raw["max_position_embeddings"]
    eos = raw["eos_token_id"]
    assert model.eos_token_ids == ((eos,) if isinstance(eos, int) else tuple(eos))
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"


@pytest.mark.parametrize("schema", SCHEMAS)
def test_parity_gate_passes_on_random_checkpoints(tiny_checkpoint, family, schema):
    """The gate `lollm parity` runs (lollm.proof.parity.run_parity), on a random checkpoint in each config schema."""
    from lollm.proof.parity import run_parity

    folder = tiny_checkpoint(family, schema)
    ids = prompt(512)[0].tolist()  # tiny checkpoints have no tokenizer: the gate takes ids directly
    report = run_parity(str(folder), ids=ids, options=LoadOptions(dtype="float32", device="cpu"))
    assert report.family == family and report.num_tokens == len(ids) >= 30
    assert report.argmax_matches == report.num_tokens
    assert report.min_cosine >= 0.99999 and report.passed
