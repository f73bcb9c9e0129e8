"""Shared helpers and fixtures of the lollm-qwen tiny-checkpoint tests.

(Named ``_qwen_tiny`` rather than conftest.py, which holds the real-model fixtures,
and rather than a generic ``helpers`` name, which would clash with other
distributions' test helpers when all tests run in one pytest session.)
Test modules import what they use: ``from _qwen_tiny import tiny_checkpoint, ...``.

Every model test starts from a REAL hub config.json (so every key the real
model has is present), shrinks its dimensions, and lets transformers write a
tiny random checkpoint (``lollm.testing.tiny``). Our model is then loaded the
way lollm loads it (``lollm.load.loader.load_checkpoint`` + the family's ``load``)
and compared against transformers on the same folder, in float32 on the CPU.

The hub configs are read from ``$LOLLM_HUB_CONFIGS``, by default
the copy shipped with lollm-core (:mod:`lollm.cli.hub_configs`).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

import torch
from lollm.testing.loading import load_with

REPO = Path(__file__).resolve().parents[2]

#: family -> the hub config it is tested on, and the overrides its tiny version needs.
FAMILIES = {
    "qwen2": {"hub_config": "Qwen__Qwen2.5-0.5B", "overrides": {}},
    # Qwen3's head_dim is explicit and H * head_dim != hidden_size (16*128 vs 1024): keep that.
    "qwen3": {"hub_config": "Qwen__Qwen3-0.6B", "overrides": {"head_dim": 32}},
}

PROMPT_LENGTH = 40
COSINE_MIN = 0.99999
MAX_ABS_DIFF = 1e-4


def hub_configs_dir() -> Path:
    from lollm.cli.hub_configs import hub_configs_dir as packaged

    return packaged()


def real_config(family: str) -> dict:
    """The unmodified hub config.json the family is tested on."""
    path = hub_configs_dir() / FAMILIES[family]["hub_config"] / "config.json"
    if not path.exists():
        pytest.fail(f"hub config {path} not found (is LOLLM_HUB_CONFIGS set to a wrong folder?)")
    return json.loads(path.read_text(encoding="utf-8"))


def family_load(family: str):
    """The family's ``load`` function, imported the way core resolves it."""
    return importlib.import_module(f"lollm_qwen.{family}.weights").load


def load_ours(folder: Path, family: str):
    from lollm.load.loader import load_checkpoint

    ckpt = load_checkpoint(folder)
    return load_with(family_load(family), ckpt.config, ckpt.weights, ckpt.fmt)


def load_reference(folder: Path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def prompt(vocab_size: int, length: int = PROMPT_LENGTH, seed: int = 0) -> torch.Tensor:
    """A random (1, length) int64 prompt."""
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str = "logits") -> None:
    """Same argmax at every position, cosine >= COSINE_MIN per position, small max |diff|.

    The cosine is computed in float64: in float32 the rounding of a long dot
    product alone can push the cosine of two *identical* vectors below 0.99999.
    """
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    ours, ref = ours.reshape(-1, ours.shape[-1]).double(), ref.reshape(-1, ref.shape[-1]).double()
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    worst = int(cosine.argmin())
    assert cosine.min() >= COSINE_MIN, f"{what}: cosine {cosine.min().item():.8f} at position {worst}"
    differ = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    assert not differ, f"{what}: argmax differs at positions {differ}"
    max_diff = (ours - ref).abs().max().item()
    assert max_diff <= MAX_ABS_DIFF, f"{what}: max |diff| {max_diff:.3g}"


#: checkpoints written in this session, shared by every test module that imports the fixture
_MADE: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A factory ``(family, schema="transformers5", seed=0, **overrides) -> folder``, cached per session."""
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    import transformers  # noqa: F401  (the reference; lollm-core[parity])

    def make(family: str, schema: str = "transformers5", seed: int = 0, **overrides) -> Path:
        key = json.dumps([family, schema, seed, overrides], sort_keys=True)
        if key not in _MADE:
            raw = shrink_config(real_config(family), **{**FAMILIES[family]["overrides"], **overrides})
            folder = tmp_path_factory.mktemp(f"{family}-{schema}")
            _MADE[key] = write_tiny_checkpoint(raw, folder, schema=schema, seed=seed)
        return _MADE[key]

    return make


@pytest.fixture(params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory) -> Path:
    """A tiny qwen2 that chats: varied greedy output (untied head, larger weights), a 512-id ChatML tokenizer
    whose end-of-text id 0 is the model's eos. For `lollm serve` and `lollm chat` tests."""
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint, write_tiny_tokenizer

    raw = shrink_config(real_config("qwen2"), vocab_size=512, bos_token_id=0, eos_token_id=0,
                        initializer_range=0.1, tie_word_embeddings=False)
    folder = write_tiny_checkpoint(raw, tmp_path_factory.mktemp("chat-qwen2"))
    return write_tiny_tokenizer(folder, vocab_size=512)
