"""Tiny random checkpoints of every family, layout and config schema against transformers (fp32).

The prompts are several sliding windows long (the tiny window is 6 tokens),
so the sliding-window mask, both RoPE bases, the global layers and (gemma4)
the KV-sharing layers are all exercised. Parity: the same argmax at every
position and cosine >= 0.9999 of the logits, and of every hidden state
(which also checks our hidden_states follow transformers' order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _gemma_testing import WINDOW, assert_close_logits, load_ours, prompt_ids, reference_logits

CASES = [
    ("gemma2", "hub"),
    ("gemma2", "transformers5"),
    ("gemma3-1b", "hub"),  # sliding_window_pattern, rope_local_base_freq
    ("gemma3-270m", "hub"),  # layer_types beside the hub RoPE keys
    ("gemma3-270m", "transformers5"),  # rope_parameters per layer type
    ("gemma3-4b", "hub"),  # multimodal, text_config with defaults, linear RoPE x8 on global layers
    ("gemma3-4b", "transformers5"),
    ("gemma4-e2b-text", "hub"),  # global_head_dim
    ("gemma4-e2b-text", "transformers5"),  # per_layer_config
    ("gemma4-e2b", "hub"),  # multimodal: vision and audio towers skipped
    ("gemma4-k-eq-v", "transformers5"),  # values = keys on global layers
]

PROMPT_LEN = 4 * WINDOW + 3


@pytest.mark.parametrize("name,schema", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_parity_with_transformers(tiny, name, schema):
    folder = tiny(name, schema)
    ids = prompt_ids(PROMPT_LEN)
    model = load_ours(folder)
    hidden: list[torch.Tensor] = []
    with torch.inference_mode():
        ours = model(torch.tensor([ids]), None, hidden_states=hidden)[0]
    ref, ref_hidden = reference_logits(folder, ids)

    assert ours.shape == ref.shape == (PROMPT_LEN, model.vocab_size)
    assert_close_logits(ours, ref, ids)
    assert len(hidden) == len(ref_hidden) == model.num_layers + 1
    for i, (a, b) in enumerate(zip(hidden, ref_hidden)):
        cos = torch.nn.functional.cosine_similarity(a[0].double(), b[0].double(), dim=-1).min()
        assert cos >= 0.9999, f"hidden state {i}: cosine {float(cos):.6f}"


@pytest.mark.parametrize("name", ["gemma2", "gemma3-270m", "gemma4-e2b-text"])
def test_window_convention_is_the_one_transformers_uses(tiny, name):
    """A query at position p sees keys p-W+1 .. p. One more or one fewer key breaks parity,
    so the parity test above would catch an off-by-one in the window."""
    folder = tiny(name, "transformers5")
    ids = prompt_ids(PROMPT_LEN)
    ref, _ = reference_logits(folder, ids)
    model = load_ours(folder)
    for window, should_match in ((WINDOW - 1, False), (WINDOW, True), (WINDOW + 1, False)):
        model.config = dataclasses.replace(model.config, sliding_window=window)
        with torch.inference_mode():
            ours = model(torch.tensor([ids]))[0]
        cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1).min()
        assert (cos >= 0.9999) == should_match, f"window {window}: min cosine {float(cos):.6f}"


def test_logits_to_keep(tiny):
    folder = tiny("gemma3-270m", "transformers5")
    model = load_ours(folder)
    ids = torch.tensor([prompt_ids(PROMPT_LEN)])
    with torch.inference_mode():
        full = model(ids)
        last3 = model(ids, logits_to_keep=3)
    assert last3.shape == (1, 3, model.vocab_size)
    torch.testing.assert_close(last3, full[:, -3:])
