"""Fixtures of lollm-gemma's tests; the helpers live in _gemma_testing.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import pytest
from _gemma_testing import TINY

# --attn triton in these tests runs Triton's kernels in its CPU interpreter. Triton reads the
# variable when a kernel is defined (when lollm.kernels is imported), so it is set here, first.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Callable[[str, str], Path]:
    """``tiny(name, schema)`` -> folder of a tiny random checkpoint, written once per session.

    schema "hub": config.json is the shrunk hub file itself (the hub spelling of
    RoPE and the layer pattern); "transformers5": config.json as transformers 5's
    ``save_pretrained`` writes it (``rope_parameters``, ``layer_types``).
    """
    from lollm.testing.tiny import write_tiny_checkpoint

    made: dict[tuple[str, str], Path] = {}

    def get(name: str, schema: str = "transformers5") -> Path:
        key = (name, schema)
        if key not in made:
            raw = TINY[name]()
            folder = tmp_path_factory.mktemp(f"{name}-{schema}")
            # write_tiny_checkpoint's "hub" mode rewrites a flat rope_parameters only; the
            # gemma hub files are already in hub form, so write them verbatim.
            write_tiny_checkpoint(raw, folder, schema="transformers5")
            if schema == "hub":
                (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
            made[key] = folder
        return made[key]

    return get
