"""gemma2 and gemma3 through the conformance kit that third-party families use (lollm.testing.conformance).

The tiny checkpoints are *sensitive* ones (docs/conformance-kit.md): real hub configs
shrunk with a sliding window of a few positions, weights drawn with a wide spread and
a large norm epsilon, so that a wrong RoPE base or scaling, epsilon, attention scale
or window moves the logits far past the kit's bounds (the kit checks that itself).
"""

from __future__ import annotations

import pytest

from lollm.testing.conformance import FamilyConformance
from lollm.testing.tiny import SENSITIVE_INIT_STD, SENSITIVE_NORM_EPS, write_tiny_checkpoint

from _gemma_testing import hub_config, tiny_gemma2, tiny_gemma3_1b


def sensitive_gemma3() -> dict:
    """tiny gemma-3-1b-it with the linear RoPE scaling (x8, global layers) of gemma-3-4b-it's decoder.

    ``query_pre_attn_scalar`` = head_dim, as in every real Gemma but 27B: a GGUF does not carry
    it (llama.cpp derives it from head_dim), and the kit's GGUF mode writes this checkpoint as one.
    """
    cfg = tiny_gemma3_1b()
    scaling = hub_config("google__gemma-3-4b-it")["text_config"]["rope_scaling"]
    return {**cfg, "rope_scaling": scaling, "rms_norm_eps": SENSITIVE_NORM_EPS, "query_pre_attn_scalar": cfg["head_dim"]}


def sensitive_gemma2() -> dict:
    cfg = tiny_gemma2()
    return {**cfg, "rms_norm_eps": SENSITIVE_NORM_EPS, "query_pre_attn_scalar": cfg["head_dim"]}


class TestGemma2Conformance(FamilyConformance):
    reference_available = True
    #: the GGUF mode needs query_pre_attn_scalar = head_dim (a GGUF does not carry it); the wrong
    #: scale is the mutation suite's (lollm.testing.mutation), on a checkpoint where they differ
    coverage_waivers = {"query_pre_attn_scalar": "a GGUF cannot carry it: llama.cpp derives the scale from head_dim"}
    gguf_types = ("F32", "Q8_0")

    @pytest.fixture
    def family_name(self):
        return "gemma2"

    @pytest.fixture
    def checkpoint_dir(self, tmp_path):
        return write_tiny_checkpoint(sensitive_gemma2(), tmp_path / "gemma2", schema="hub", init_std=SENSITIVE_INIT_STD)


class TestGemma3Conformance(FamilyConformance):
    reference_available = True
    #: the GGUF mode needs query_pre_attn_scalar = head_dim (a GGUF does not carry it); the wrong
    #: scale is the mutation suite's (lollm.testing.mutation), on a checkpoint where they differ
    coverage_waivers = {"query_pre_attn_scalar": "a GGUF cannot carry it: llama.cpp derives the scale from head_dim"}
    gguf_types = ("F32", "F16", "Q8_0", "Q4_0")

    @pytest.fixture
    def family_name(self):
        return "gemma3"

    @pytest.fixture
    def checkpoint_dir(self, tmp_path):
        return write_tiny_checkpoint(sensitive_gemma3(), tmp_path / "gemma3", schema="hub", init_std=SENSITIVE_INIT_STD)
