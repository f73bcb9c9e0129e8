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

    @pytest.fixture
    def family_name(self):
        return "qwen3_5"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint_dir(cls, tmp_path_factory):
        return _kit_checkpoint(tmp_path_factory, "qwen3_5", DENSE_TYPES)


class TestQwen3_5MoeConformance(FamilyConformance):
    reference_available = True

    @pytest.fixture
    def family_name(self):
        return "qwen3_5_moe"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint_dir(cls, tmp_path_factory):
        return _kit_checkpoint(tmp_path_factory, "qwen3_5_moe", MOE_TYPES)
