"""lollm-core's install hint for each type this distribution serves names this distribution.

When lollm-qwen3_5 is not installed, nothing of it can speak: the error for one of its
checkpoints gets its "pip install lollm-qwen3_5" from lollm-core's small first-party
table (lollm.load.registry.FIRST_PARTY_MODEL_TYPES / FIRST_PARTY_GGUF_ARCHITECTURES).
This test reads the families this distribution registers through its own
entry points, so a type added here without its row in core (or a row left in
core for a type removed here) fails.
"""

from __future__ import annotations

import importlib.metadata as md

from lollm.hookspecs import ENTRY_POINT_GROUP
from lollm.load.plugins import FIRST_PARTY_GGUF_ARCHITECTURES, FIRST_PARTY_MODEL_TYPES, build_registry

DIST = "lollm-qwen3_5"


def test_core_first_party_hints_match_the_families_this_distribution_registers():
    eps = [ep for ep in md.distribution(DIST).entry_points if ep.group == ENTRY_POINT_GROUP]
    assert eps, f"{DIST} declares no {ENTRY_POINT_GROUP!r} entry point"
    registry = build_registry(entry_points=eps, allowlist=DIST)
    assert registry.broken == [] and registry.families
    model_types = {t for f in registry.families for t in f.family.model_types}
    architectures = {a for f in registry.families for a in f.family.gguf_architectures}
    assert {t for t, dist in FIRST_PARTY_MODEL_TYPES.items() if dist == DIST} == model_types
    assert {a for a, dist in FIRST_PARTY_GGUF_ARCHITECTURES.items() if dist == DIST} == architectures
