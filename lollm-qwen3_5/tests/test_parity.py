"""Parity against transformers: same tiny random checkpoint, same ids, fp32, every position.

Both families x both layouts (text-only ForCausalLM, multimodal
ForConditionalGeneration with a vision tower and, here, MTP tensors that
transformers ignores), with prompts longer than two delta-rule chunks (64) so
the chunked form crosses chunk boundaries and pads the last chunk.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

import qwen3_5_tiny as tiny
from lollm.load.options import LoadOptions

PROMPT_TOKENS = 150  # > 2 chunks of 64; not a multiple of 64
MIN_COSINE = 0.99999


def _reference(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), "argmax differs at some position"
    return float(cos.min()), float((ours - ref).abs().max())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("layout,mtp", [("text", False), ("multimodal", True)])
def test_logits_match_transformers(family, layout, mtp, tiny_checkpoint, load_ours):
    folder = tiny_checkpoint(family, layout, mtp)
    ids = torch.tensor([tiny.random_ids(PROMPT_TOKENS, tiny.TINY_TEXT["vocab_size"], seed=1)])
    model = load_ours(folder)
    assert type(model).__module__.startswith(f"lollm_qwen3_5.{family}.")
    assert model.has_draft_head is mtp
    ours_hidden: list[torch.Tensor] = []
    with torch.inference_mode():
        ours = model(ids, hidden_states=ours_hidden)[0]
        out = _reference(folder)(ids, output_hidden_states=True, use_cache=False)
    min_cos, max_diff = _compare(ours, out.logits[0])
    assert min_cos >= MIN_COSINE, (min_cos, max_diff)
    # hidden states in transformers' order: embeddings, each layer's output but the last, the final-normed output
    assert len(ours_hidden) == len(out.hidden_states) == model.num_layers + 1
    for i, (a, b) in enumerate(zip(ours_hidden, out.hidden_states)):
        cos = torch.nn.functional.cosine_similarity(a[0].double(), b[0].double(), dim=-1).min()
        assert cos >= MIN_COSINE, f"hidden state {i} diverges: cosine {float(cos)}"


def test_parity_gate_passes(tiny_checkpoint, qwen_tokenizer_files, tmp_path):
    """lollm's own parity gate (what `lollm parity` runs) on a tiny multimodal MoE checkpoint with MTP tensors."""
    from lollm.proof.parity import run_parity

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("qwen3_5_moe", "multimodal", True), folder)
    for f in qwen_tokenizer_files:
        shutil.copy(f, folder)
    ids = tiny.random_ids(PROMPT_TOKENS, tiny.TINY_TEXT["vocab_size"], seed=2)
    report = run_parity(str(folder), ids=ids, options=LoadOptions(dtype="float32", device="cpu"))
    assert report.family == "qwen3_5_moe"
    assert report.passed, report.to_json()
    assert report.argmax_matches == PROMPT_TOKENS and report.min_cosine >= 0.9999
    assert len(report.layer_cosines) == tiny.TINY_TEXT["num_hidden_layers"] + 1


def test_vision_and_mtp_tensors_do_not_change_the_decoder(tiny_checkpoint, load_ours):
    """The multimodal checkpoint's vision tower is skipped by name and MTP tensors only add the draft head."""
    folder = tiny_checkpoint("qwen3_5", "multimodal", True)
    model = load_ours(folder)
    names = {n for n, _ in model.named_parameters()}
    assert not any("visual" in n for n in names)
    assert any(n.startswith("mtp.") for n in names)
    assert all(n.startswith(("model.", "lm_head", "mtp.")) for n in names)


def test_attention_bias_is_loaded_and_used(tmp_path, load_ours):
    """No release sets attention_bias, but transformers implements it: so do we (q/k/v/o biases)."""
    folder = tiny.write_tiny("qwen3_5", "text", tmp_path / "bias", attention_bias=True)
    ids = torch.tensor([tiny.random_ids(70, tiny.TINY_TEXT["vocab_size"], seed=4)])
    model = load_ours(folder)
    assert model.model.layers[3].self_attn.o_proj.bias is not None
    with torch.inference_mode():
        ours = model(ids)[0]
        ref = _reference(folder)(ids, use_cache=False).logits[0]
    min_cos, max_diff = _compare(ours, ref)
    assert min_cos >= MIN_COSINE, (min_cos, max_diff)
