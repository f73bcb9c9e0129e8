"""The plugin: both families register through lollm-core, and listing them imports no torch."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import textwrap

import pytest
from lollm.family import CONTRACT_VERSION, import_target
from lollm.load.plugins import build_registry

import lollm_qwen.plugin


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)


def test_plugin_imports_no_torch():
    done = run_python(
        """
        import sys
        import lollm_qwen.plugin
        from lollm.load.plugins import build_registry
        registry = build_registry(entry_points=[], extra_plugins=[("qwen", lollm_qwen.plugin)])
        assert [f.family.name for f in registry.families] == ["qwen2", "qwen3"], registry
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "lollm_qwen.qwen2.", "lollm_qwen.qwen3.")))
        print(heavy)
        assert not heavy, heavy
        """
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_families_register_and_route():
    registry = build_registry(entry_points=[], extra_plugins=[("qwen", lollm_qwen.plugin)])
    assert not registry.broken, registry.broken
    qwen2 = registry.route("qwen2").family
    qwen3 = registry.route("qwen3").family
    assert registry.route(gguf_architecture="qwen2").family is qwen2
    assert (qwen2.name, qwen2.contract, qwen2.load) == ("qwen2", CONTRACT_VERSION, "lollm_qwen.qwen2.weights:load")
    assert (qwen3.name, qwen3.contract, qwen3.load) == ("qwen3", CONTRACT_VERSION, "lollm_qwen.qwen3.weights:load")
    assert qwen2.model_types == ("qwen2",) and qwen3.model_types == ("qwen3",)
    assert qwen3.capabilities.thinking_toggle and not qwen2.capabilities.thinking_toggle
    assert qwen2.sampling_defaults["temperature"] == 0.7 and qwen3.sampling_defaults["temperature"] == 0.6
    assert qwen2.description and qwen3.description
    for family in (qwen2, qwen3):
        assert callable(family.resolve("load"))


def test_installed_entry_point():
    eps = [ep for ep in md.entry_points(group="lollm.families") if ep.value == "lollm_qwen.plugin"]
    if not eps:
        pytest.fail("lollm-qwen is not installed (pip install -e lollm-qwen)")
    registry = build_registry(entry_points=eps)
    assert registry.route("qwen2").distribution == "lollm-qwen"
    assert registry.route("qwen3").distribution == "lollm-qwen"


@pytest.mark.parametrize("family, other", [("qwen3", "qwen2"), ("qwen2", "qwen3")])
def test_families_are_self_contained(family, other):
    """Loading one family imports none of its neighbour's modules."""
    done = run_python(
        f"""
        import sys
        from lollm.family import import_target
        import_target("lollm_qwen.{family}.weights:load", what="test")
        leaked = sorted(m for m in sys.modules if m.startswith("lollm_qwen.{other}"))
        assert not leaked, leaked
        """
    )
    assert done.returncode == 0, done.stdout + done.stderr
