"""The distribution as a plugin: registration, routing, no torch at listing time, no cross-family imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import lollm_gemma

PACKAGE = Path(lollm_gemma.__file__).parent
FAMILIES = ("gemma2", "gemma3", "gemma4")


def test_entry_point_registers_the_three_families():
    from lollm.load.plugins import build_registry

    registry = build_registry()
    assert not [b for b in registry.broken if b.distribution == "lollm-gemma"]
    routes = {
        "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "gemma4_text": "gemma4", "gemma4": "gemma4",
    }
    for model_type, family in routes.items():
        installed = registry.route(model_type)
        assert installed.family.name == family and installed.distribution == "lollm-gemma"
    for arch in FAMILIES:
        assert registry.route(gguf_architecture=arch).family.name == arch


def test_plugin_module_imports_no_torch():
    code = "import sys, lollm_gemma.plugin as p; p.families(); assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("family", FAMILIES)
def test_families_do_not_import_each_other(family):
    others = {f"lollm_gemma.{f}" for f in FAMILIES if f != family}
    for path in (PACKAGE / family).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not any(name == o or name.startswith(o + ".") for o in others), f"{path.name} imports {name}"
