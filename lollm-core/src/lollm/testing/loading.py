"""Calling a family's ``load`` in a test, the way :func:`lollm.load.pipeline.open_model` calls it (plugin contract 2).

Tests often hold a config dict and a tensor source rather than a folder (a mutated
config, a source that lies about a shape). :func:`load_with` wraps them in a
:class:`lollm.load.loader.Checkpoint` and passes resolved :class:`lollm.load.options.LoadOptions`,
float32 on the CPU unless ``options`` says otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from lollm.load.loader import Checkpoint, TensorSource
from lollm.load.options import LoadOptions
from lollm.load.pipeline import pick_quantization
from lollm.model import CausalLM

#: What the tests load with: float32 float weights on the CPU, SDPA attention.
TEST_OPTIONS = LoadOptions(device="cpu", dtype="float32", attn="sdpa", weights="float")


def test_checkpoint(config: dict, weights: TensorSource, fmt: str) -> Checkpoint:
    """A Checkpoint around ``config`` and ``weights`` (no folder behind it; its tokenizer cannot be read)."""
    return Checkpoint(spec="<test>", path=Path("."), fmt=fmt, config=config, generation_config={}, weights=weights)


def resolved(options: LoadOptions | None = None) -> LoadOptions:
    """``options`` (default :data:`TEST_OPTIONS`) resolved as core resolves them, without a checkpoint: CPU only.

    The quantization comes from ``options.weights_mode``/``options.quantize`` for a
    safetensors checkpoint (a GGUF test that wants packed weights passes ``quantization``).
    """
    options = options or TEST_OPTIONS
    if options.quantization is None:
        options = options.replace(quantization=pick_quantization(options, "safetensors", torch.device("cpu")))
    return options.replace(device="cpu" if options.device == "auto" else options.device,
                           dtype="float32" if options.dtype == "auto" else options.dtype)


def load_with(load: Callable[[Checkpoint, LoadOptions], CausalLM], config: dict, weights: TensorSource, fmt: str,
              options: LoadOptions | None = None) -> CausalLM:
    """``load(checkpoint, options)`` on ``config`` and ``weights`` of format ``fmt``: the model it returns."""
    return load(test_checkpoint(config, weights, fmt), resolved(options))
