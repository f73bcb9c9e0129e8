"""The family ``llama`` through lollm's conformance kit (lollm.testing.conformance).

Each class is one tiny random checkpoint (``_llama_tiny``): Llama 2 (plain RoPE,
no GQA, hub schema), Llama 3.2 (llama3 RoPE scaling, GQA, tied head, transformers-5
schema), and the Llama 3.2 shape with attention and MLP biases and an untied
head (linear RoPE scaling is tested in test_llama_gguf.py). Parity runs against transformers'
LlamaForCausalLM on the same files (the family's ``parity_reference``, which for
safetensors is transformers' own load).
"""

from __future__ import annotations

import pytest

from lollm.testing.conformance import FamilyConformance

from _llama_tiny import write_tiny


class _Llama(FamilyConformance):
    reference_available = True
    kind = ""
    schema = "hub"

    @pytest.fixture
    def family_name(self):
        return "llama"

    @pytest.fixture
    def checkpoint_dir(self, tmp_path):
        return write_tiny(self.kind, tmp_path / self.kind, schema=self.schema)


class TestLlama2(_Llama):
    kind = "llama2"


class TestLlama3(_Llama):
    kind = "llama3"
    schema = "transformers5"


class TestLlama3WithBiases(_Llama):
    kind = "llama3-bias"
