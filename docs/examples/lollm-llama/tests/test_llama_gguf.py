"""What the conformance kit does not see: llama3 RoPE, GGUF (Q/K permutation, rope_freqs), the parity gate, errors.

GGUF files are written from tiny transformers checkpoints the way llama.cpp's
converter writes them (``_llama_tiny.hf_to_gguf``). Ours, loaded from the GGUF,
is compared with transformers on the *source safetensors* (F32: nothing but
the converter's transforms stands between them), and ``lollm parity`` is run on
F32 and Q8_0 files through the family's own ``parity_reference``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lollm.errors import ConfigError, WeightsError
from lollm.load.loader import load_checkpoint

from _llama_tiny import converter_permute, hf_to_gguf, llama3_rope_factors, tiny_config, write_tiny

from lollm_llama.llama import weights as llama_weights
from lollm_llama.llama.blocks import rope_inverse_frequencies
from lollm_llama.llama.config import LlamaConfig
from lollm.testing.loading import load_with

POSITIONS = 96  # long enough for the slow RoPE pairs (the ones llama3 scaling changes) to matter


def _ours(path: Path):
    ckpt = load_checkpoint(path)
    return load_with(llama_weights.load, ckpt.config, ckpt.weights, ckpt.fmt)


def _transformers(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()


def _ids(n: int = POSITIONS) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(7))


def _cosine_and_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()), float((a - b).abs().max())


_MADE: dict[str, Path] = {}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``(kind, matrix_type) -> (safetensors folder, gguf path)``, written once per module."""

    def make(kind: str, matrix_type: str = "F32") -> tuple[Path, Path]:
        folder = _MADE.get(kind)
        if folder is None:
            folder = _MADE[kind] = write_tiny(kind, tmp_path_factory.mktemp(kind), tokenizer=True)
        key = f"{kind}-{matrix_type}"
        if key not in _MADE:
            _MADE[key] = hf_to_gguf(folder, tmp_path_factory.mktemp(key) / f"{key}.gguf", matrix_type)
        return folder, _MADE[key]

    return make


# ============================================================ RoPE


def test_llama3_inverse_frequencies_equal_transformers():
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = tiny_config("llama3")
    ours, scale = rope_inverse_frequencies(LlamaConfig.from_hf(raw).rope, raw["head_dim"])
    hf = HFConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version", "torch_dtype")})
    ref, ref_scale = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert scale == ref_scale == 1.0
    plain, _ = rope_inverse_frequencies(LlamaConfig.from_hf(dict(raw, rope_scaling=None)).rope, raw["head_dim"])
    # the tiny config has pairs in all three regimes: kept, blended, divided by factor
    ratio = (plain / ours).tolist()
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(32.0) and any(1.0 < r < 32.0 for r in ratio), ratio


def test_rope_freqs_of_the_converter_give_the_llama3_frequencies():
    raw = tiny_config("llama3")
    rope = LlamaConfig.from_hf(raw).rope
    factors = llama3_rope_factors(raw["rope_scaling"], raw["rope_theta"], raw["head_dim"])
    from_gguf, _ = rope_inverse_frequencies(
        type(rope)(rope_type="factors", theta=rope.theta, freq_factors=tuple(factors)), raw["head_dim"])
    from_config, _ = rope_inverse_frequencies(rope, raw["head_dim"])
    torch.testing.assert_close(from_gguf, from_config, rtol=1e-6, atol=0)


# ============================================================ the Q/K permutation


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_unpermute_rows_inverts_the_converter(heads):
    D = 16
    weight = torch.randn(heads * D, 24)
    bias = torch.randn(heads * D)
    permuted = converter_permute(weight, heads)
    assert not torch.equal(permuted, weight)
    assert torch.equal(llama_weights.unpermute_rows(permuted, heads), weight)
    assert torch.equal(llama_weights.unpermute_rows(converter_permute(bias, heads), heads), bias)


# ============================================================ GGUF against transformers on the source safetensors


@pytest.mark.parametrize("kind", ["llama3", "llama3-bias", "llama2-linear"])
def test_gguf_f32_equals_transformers_on_the_source_checkpoint(made, kind):
    folder, gguf_path = made(kind)
    ids = _ids()
    with torch.inference_mode():
        ours = _ours(gguf_path)(ids)[0]
        ref = _transformers(folder)(ids).logits[0]
    cosine, diff = _cosine_and_diff(ours, ref)
    assert cosine >= 0.99999 and diff <= 1e-4, (cosine, diff)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_gguf_without_the_unpermute_fails(made, monkeypatch):
    """The test above can fail: loading the GGUF rows as they are gives another model."""
    folder, gguf_path = made("llama3")
    monkeypatch.setattr(llama_weights, "gguf_transform", lambda config: (lambda name, t: t))
    with torch.inference_mode():
        cosine, _ = _cosine_and_diff(_ours(gguf_path)(_ids())[0], _transformers(folder)(_ids()).logits[0])
    assert cosine < 0.99, cosine


def test_gguf_without_rope_freqs_fails(made, monkeypatch):
    """... and so does ignoring rope_freqs.weight (plain RoPE instead of llama3's)."""
    folder, gguf_path = made("llama3")
    monkeypatch.setattr(llama_weights, "read_rope_freqs", lambda weights, config: config)
    with torch.inference_mode():
        cosine, _ = _cosine_and_diff(_ours(gguf_path)(_ids())[0], _transformers(folder)(_ids()).logits[0])
    assert cosine < 0.999, cosine


@pytest.mark.parametrize("kind, agrees", [("llama2", True), ("llama3", False), ("llama2-bias", False),
                                          ("llama2-linear", False)])
def test_transformers_own_gguf_loader_falls_short(made, kind, agrees):
    """Why the family has a parity_reference: transformers' GGUF loader, on the same file, gives a model
    far from transformers on the checkpoint the file was converted from as soon as the file has
    rope_freqs.weight (llama3), biases or linear RoPE scaling; on a plain Llama 2 file it agrees."""
    from lollm.proof.parity import default_reference

    folder, gguf_path = made(kind)
    ids = _ids()
    theirs = default_reference(load_checkpoint(gguf_path), torch.float32)(ids)[0]
    with torch.inference_mode():
        cosine, _ = _cosine_and_diff(theirs, _transformers(folder)(ids).logits[0])
    assert (cosine >= 0.99999) if agrees else (cosine < 0.99), cosine


# ============================================================ the parity gate, as a user runs it


def _lollm(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="200", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "lollm.cli", *args], capture_output=True, text=True, env=env, timeout=600)


def test_lollm_parity_command_passes_on_a_llama3_q8_0_gguf(made):
    """The command a user runs: the family's parity_reference builds transformers' model from the GGUF."""
    _, gguf_path = made("llama3", "Q8_0")
    done = _lollm("parity", str(gguf_path), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["family"] == "llama" and report["passed"], {k: report[k] for k in report if k != "positions"}


@pytest.mark.parametrize("kind, fmt", [("llama3", "F32"), ("llama3-bias", "Q8_0"), ("llama2-linear", "F32"),
                                       ("llama3", "safetensors")])
def test_parity_gate_passes(made, kind, fmt):
    """The same gate in this process (lollm.proof.parity.run_parity, what `lollm parity` calls)."""
    from lollm.proof.parity import run_parity

    folder, gguf_path = made(kind, "F32" if fmt == "safetensors" else fmt)
    report = run_parity(str(folder if fmt == "safetensors" else gguf_path))
    assert report.family == "llama" and report.num_tokens > 20
    assert report.passed, f"min cosine {report.min_cosine}, argmax {report.argmax_matches}/{report.num_tokens}, " \
                          f"first diverging layer {report.first_diverging_layer}"


# ============================================================ errors


def test_rope_freqs_of_the_wrong_length_is_refused(made, tmp_path):
    import numpy as np

    from lollm.testing.tiny_gguf import write_gguf
    import gguf

    _, gguf_path = made("llama3")
    reader = gguf.GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in reader.fields.items()
            if not k.startswith(("GGUF.", "general.architecture")) and not k.startswith("tokenizer.ggml.")}
    tensors = {t.name: (np.array(t.data).reshape([int(n) for n in reversed(t.shape.tolist())]), "F32") for t in reader.tensors}
    tensors["rope_freqs.weight"] = (np.ones(3, dtype=np.float32), "F32")
    bad = write_gguf(tmp_path / "bad.gguf", "llama", meta, tensors)
    with pytest.raises(WeightsError, match="rope_freqs.weight has shape"):
        _ours(bad)


@pytest.mark.parametrize("edit, message", [
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192}}, "high_freq_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_keys_not_implemented_are_refused(edit, message):
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf(dict(tiny_config("llama3"), **edit))
