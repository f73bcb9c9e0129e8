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


def _kit_checkpoint(tmp_path_factory, name: str, model_types: tuple[str, ...]):
    return write_tiny_checkpoint(kit_config(hub_config(find_hub_config(model_types))), tmp_path_factory.mktemp(name),
                                 init_std=SENSITIVE_INIT_STD)


class TestQwen3_5Conformance(FamilyConformance):
    reference_available = True
    # Batch invariance: the routed experts, the router and the DeltaNet's decay and write gates
    # (in_proj_a, in_proj_b) stay float32 matmuls over the step's rows (weights.QUANTIZABLE), and the
    # chunked delta rule's float32 products run over chunks the token budget cuts: torch's float32
    # GEMM rounds a row differently with the rows beside it (docs/batching.md, section 9). With int8
    # weights, int8 activations magnify those last bits (0.02 to 0.07 in a logit of this sensitive
    # checkpoint), so the check runs on float32 weights: same tokens, within this bound.
    batch_invariance_weights = "float"
    batch_invariance_bound = 1e-4

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
    # GEMM rounds a row differently with the rows beside it (docs/batching.md, section 9). With int8
    # weights, int8 activations magnify those last bits (0.02 to 0.07 in a logit of this sensitive
    # checkpoint), so the check runs on float32 weights: same tokens, within this bound.
    batch_invariance_weights = "float"
    batch_invariance_bound = 1e-4

    @pytest.fixture
    def family_name(self):
        return "qwen3_5_moe"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint_dir(cls, tmp_path_factory):
        return _kit_checkpoint(tmp_path_factory, "qwen3_5_moe", MOE_TYPES)
