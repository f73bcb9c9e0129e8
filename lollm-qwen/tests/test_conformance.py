"""qwen2 and qwen3 through the conformance kit that third-party families use (lollm.testing.conformance)."""

from __future__ import annotations

import pytest

from lollm.testing.conformance import FamilyConformance
from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

from _qwen_tiny import real_config


class TestQwen2Conformance(FamilyConformance):
    reference_available = True

    @pytest.fixture
    def family_name(self):
        return "qwen2"

    @pytest.fixture
    def checkpoint_dir(self, tmp_path):
        return write_tiny_checkpoint(shrink_config(real_config("qwen2")), tmp_path / "qwen2", schema="transformers5")


class TestQwen3Conformance(FamilyConformance):
    reference_available = True

    @pytest.fixture
    def family_name(self):
        return "qwen3"

    @pytest.fixture
    def checkpoint_dir(self, tmp_path):
        return write_tiny_checkpoint(shrink_config(real_config("qwen3")), tmp_path / "qwen3", schema="hub")
