"""qwen2 and qwen3 through the conformance kit that third-party families use (lollm.testing.conformance).

The tiny checkpoints are *sensitive* ones (docs/conformance-kit.md): weights drawn with a
wide spread and a large norm epsilon, so that a wrong RoPE base, epsilon or attention
scale moves the logits far past the kit's bounds (the kit checks that itself).
"""

from __future__ import annotations

import pytest

from lollm.testing.conformance import FamilyConformance
from lollm.testing.tiny import SENSITIVE_INIT_STD, SENSITIVE_NORM_EPS, shrink_config, write_tiny_checkpoint

from _qwen_tiny import real_config


class TestQwen2Conformance(FamilyConformance):
    reference_available = True
    gguf_types = ("F32", "F16", "Q8_0", "Q4_0")

    @pytest.fixture
    def family_name(self):
        return "qwen2"

    @pytest.fixture
    def checkpoint_dir(self, tmp_path):
        config = shrink_config(real_config("qwen2"), rms_norm_eps=SENSITIVE_NORM_EPS)
        return write_tiny_checkpoint(config, tmp_path / "qwen2", schema="transformers5", init_std=SENSITIVE_INIT_STD)


def sensitive_qwen2_yarn() -> dict:
    """tiny Qwen2.5 with YaRN RoPE scaling (the long-context setting of Qwen2.5's model cards), x4 over an
    original context of 8 positions, so that the scaling changes the angles inside the kit's prompt."""
    return shrink_config(real_config("qwen2"), rms_norm_eps=SENSITIVE_NORM_EPS,
                         rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})


class TestQwen2YarnConformance(TestQwen2Conformance):
    """qwen2 with YaRN RoPE scaling, so that the kit checks the scaling too."""

    gguf_types = ("Q8_0",)

    @pytest.fixture
    def checkpoint_dir(self, tmp_path):
        return write_tiny_checkpoint(sensitive_qwen2_yarn(), tmp_path / "qwen2", schema="hub", init_std=SENSITIVE_INIT_STD)


class TestQwen3Conformance(FamilyConformance):
    reference_available = True
    gguf_types = ("F16", "Q4_0")

    @pytest.fixture
    def family_name(self):
        return "qwen3"

    @pytest.fixture
    def checkpoint_dir(self, tmp_path):
        config = shrink_config(real_config("qwen3"), rms_norm_eps=SENSITIVE_NORM_EPS)
        return write_tiny_checkpoint(config, tmp_path / "qwen3", schema="hub", init_std=SENSITIVE_INIT_STD)
