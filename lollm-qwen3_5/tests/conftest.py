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


# ---------------------------------------------------------------------------
# llama.cpp's own converter (the pinned llama-cpp-python sdist vendors it), for the GGUF tests
# ---------------------------------------------------------------------------

#: The pinned source distribution whose vendor/llama.cpp holds convert_hf_to_gguf.py and gguf-py.
LLAMA_CPP_PYTHON = ("llama-cpp-python", "0.3.36")


def converter_script() -> Path:
    """The path of llama.cpp's ``convert_hf_to_gguf.py`` in the pinned llama-cpp-python sdist.

    ``LOLLM_LLAMA_CPP_SRC``: a folder holding the unpacked sdist; else it is fetched once with
    ``pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36`` into
    ``~/.cache/lollm/llama-cpp-src/`` and unpacked there (pure Python is all we use: no compile).
    """
    import subprocess
    import tarfile

    name, version = LLAMA_CPP_PYTHON
    folder = f"{name.replace('-', '_')}-{version}"
    if os.environ.get("LOLLM_LLAMA_CPP_SRC"):
        root = Path(os.environ["LOLLM_LLAMA_CPP_SRC"])
    else:
        cache = Path.home() / ".cache" / "lollm" / "llama-cpp-src"
        root = cache / folder
        if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
            cache.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"{name}=={version}", "-d", str(cache)], check=True)
            with tarfile.open(cache / f"{folder}.tar.gz") as tar:
                tar.extractall(cache, filter="data")
    script = root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"no convert_hf_to_gguf.py under {root} (LOLLM_LLAMA_CPP_SRC: the unpacked {folder} sdist)")
    return script


def convert_with_llama_cpp(checkpoint: Path, out: Path, outtype: str) -> Path:
    """Run llama.cpp's converter on ``checkpoint`` (``--outtype`` f32 / f16 / bf16 / q8_0) into ``out``.

    A subprocess with the vendored gguf-py first on PYTHONPATH (and no ``NO_LOCAL_GGUF``, which
    would make the converter skip it), so the converter uses its own gguf-py, not an installed
    one. RuntimeError with the tail of its output when it fails.
    """
    import subprocess

    script = converter_script()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env.update(PYTHONPATH=str(script.parent / "gguf-py"), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(script), str(checkpoint), "--outtype", outtype, "--outfile", str(out)],
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {checkpoint} --outtype {outtype} failed:\n{(run.stdout + run.stderr)[-3000:]}")
    return out


@pytest.fixture(scope="session")
def convert_to_gguf():
    """``convert_to_gguf(checkpoint, out, outtype)``: :func:`convert_with_llama_cpp` (llama.cpp's own converter)."""
    return convert_with_llama_cpp
