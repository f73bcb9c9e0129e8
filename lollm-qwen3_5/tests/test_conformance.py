"""qwen3_5 and qwen3_5_moe through the conformance kit that third-party families use (lollm.testing.conformance).

The checkpoints are those the mutation suite judges these families on
(:func:`lollm.testing.mutation.kit_checkpoint`): the hub config that ``lollm
new-family --like`` takes for the family, shrunk by :func:`lollm.testing.tiny.kit_config`
(every kind of layer, a visible norm epsilon, a few narrow experts), weights spread
wide enough that a wrong RoPE, epsilon or scale moves the logits past the kit's bounds.
Besides parity and self-consistency, the kit's three engine tests hold every request of
a batched engine step to its run alone (and no prefix reuse: the DeltaNet state has no
snapshot at a block boundary).
"""

from __future__ import annotations

import pytest

from lollm.cli.new_family import find_hub_config
from lollm.testing.conformance import FamilyConformance
from lollm.cli.hub_configs import hub_config
from lollm.testing.tiny import SENSITIVE_INIT_STD, kit_config, write_tiny_checkpoint

from lollm_qwen3_5.qwen3_5 import MODEL_TYPES as DENSE_TYPES
from lollm_qwen3_5.qwen3_5_moe import MODEL_TYPES as MOE_TYPES


#: The kit's converter check (section 12). llama.cpp's converter reads a Qwen 3.5 tokenizer only as a byte-level
#: BPE tokenizer.json it knows by hash, so the checkpoint gets the real Qwen2.5 one (conftest.qwen_tokenizer_files:
#: the converter names its pre-tokenizer "qwen2") and the kit grows its vocabulary to 151,936 rows. q8_0 is not
#: run here: the kit's reference for it (the checkpoint Q8_0-rounded tensor by tensor, as stored) does not hold
#: for this architecture, where the converter keeps the routers in F32 and reorders the V heads of the linear
#: attention before it quantizes (blocks of 32 then straddle other columns); test_gguf_qwen3_5.py holds q8_0.
CONVERTER_OUTTYPES = ("f32", "f16", "bf16")


def _kit_checkpoint(tmp_path_factory, name: str, model_types: tuple[str, ...]):
    raw = hub_config(find_hub_config(model_types))
    config = kit_config(raw)
    if "intermediate_size" not in raw.get("text_config", raw):
        # shrink_config writes every TINY_DIMENSIONS key, a dense MLP width into a MoE config that has none
        # (Qwen3.5-35B-A3B's): transformers ignores it, llama.cpp's converter writes it as
        # qwen35moe.feed_forward_length, which the family refuses as a key it does not implement
        del config["intermediate_size"]
    return write_tiny_checkpoint(config, tmp_path_factory.mktemp(name), init_std=SENSITIVE_INIT_STD)


class TestQwen3_5Conformance(FamilyConformance):
    reference_available = True
    # Batch invariance: the routed experts, the router and the DeltaNet's decay and write gates
    # (in_proj_a, in_proj_b) stay float32 matmuls over the step's rows (weights.QUANTIZABLE), and the
    # chunked delta rule's float32 products run over chunks the token budget cuts: torch's float32
    # GEMM rounds a row differently with the rows beside it (docs/batch-invariance.md, "Batch invariance in attention"). With int8
    # weights, int8 activations magnify those last bits (0.02 to 0.07 in a logit of this sensitive
    # checkpoint), so the check runs on float32 weights: same tokens, within this bound.
    batch_invariance_weights = "float"
    batch_invariance_bound = 1e-4
    converter_outtypes = CONVERTER_OUTTYPES

    @pytest.fixture
    def converter_tokenizer_dir(self, qwen_tokenizer_files):
        return qwen_tokenizer_files[0].parent  # see CONVERTER_OUTTYPES

    @pytest.fixture
    def family_name(self):
        return "qwen3_5"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint_dir(cls, tmp_path_factory):
        return _kit_checkpoint(tmp_path_factory, "qwen3_5", DENSE_TYPES)


class TestQwen3_5MoeConformance(FamilyConformance):
    reference_available = True
    # Batch invariance: the routed experts, the router and the DeltaNet's decay and write gates
    # (in_proj_a, in_proj_b) stay float32 matmuls over the step's rows (weights.QUANTIZABLE), and the
    # chunked delta rule's float32 products run over chunks the token budget cuts: torch's float32
    # GEMM rounds a row differently with the rows beside it (docs/batch-invariance.md, "Batch invariance in attention"). With int8
    # weights, int8 activations magnify those last bits (0.02 to 0.07 in a logit of this sensitive
    # checkpoint), so the check runs on float32 weights: same tokens, within this bound.
    batch_invariance_weights = "float"
    batch_invariance_bound = 1e-4
    converter_outtypes = CONVERTER_OUTTYPES

    @pytest.fixture
    def converter_tokenizer_dir(self, qwen_tokenizer_files):
        return qwen_tokenizer_files[0].parent  # see CONVERTER_OUTTYPES

    @pytest.fixture
    def family_name(self):
        return "qwen3_5_moe"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint_dir(cls, tmp_path_factory):
        return _kit_checkpoint(tmp_path_factory, "qwen3_5_moe", MOE_TYPES)
