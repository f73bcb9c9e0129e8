"""The plugin: two self-contained families, registered without importing torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lollm.family import CONTRACT_VERSION
from lollm.load.plugins import get_registry

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lollm_qwen3_5"


def _normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them (builds may write lollm-qwen3_5 or lollm-qwen3-5)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_both_families_are_registered():
    registry = get_registry(refresh=True)
    assert not [b for b in registry.broken if _normalized(b.distribution) == "lollm-qwen3-5"]
    expected = {
        "qwen3_5": (("qwen3_5", "qwen3_5_text"), ("qwen35",)),
        "qwen3_5_moe": (("qwen3_5_moe", "qwen3_5_moe_text"), ("qwen35moe",)),
    }
    for name, (types, archs) in expected.items():
        installed = next(f for f in registry.families if f.family.name == name)
        assert _normalized(installed.distribution) == "lollm-qwen3-5"
        family = installed.family
        assert family.contract == CONTRACT_VERSION
        assert family.model_types == types and family.gguf_architectures == archs
        assert family.capabilities.thinking_toggle and family.capabilities.speculative_head
        assert family.capabilities.vision and family.vision == "lollm_qwen3_5.vision_family:load_vision"
        for t in types:
            assert registry.route(t).family.name == name


def test_the_plugin_module_imports_no_torch():
    code = "import sys, lollm_qwen3_5.plugin as p; p.families(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("family,other", [("qwen3_5", "qwen3_5_moe"), ("qwen3_5_moe", "qwen3_5")])
def test_families_do_not_import_each_other(family, other):
    for path in (PACKAGE / family).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                assert other not in module.split("."), f"{path.name} imports {module}"
                # each family folder is self-contained (lollm new-family copies the folder alone): its M-RoPE
                # (mrope.py) is its own copy, as kv.py and blocks.py are
                assert node.level in (0, 1), f"{path.name}: import from outside its family folder"
                assert node.level == 1 or not module.startswith("lollm_qwen3_5"), f"{path.name} imports {module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("lollm_qwen3_5") for a in node.names), path.name
