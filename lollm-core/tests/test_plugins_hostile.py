"""Hostile plugins (issue 22, class 6): each failure is one line naming the plugin, never a traceback or a silent pass.

* a family ``load()`` that raises: one ``error:`` line naming the family, the plugin
  and its distribution, the exception and the plugin's line; ``LOLLM_DEBUG=1`` keeps
  the traceback;
* ``LOLLM_PLUGIN_IMPORT_TIMEOUT`` out of bounds (``1e309`` is inf, nan, negative, huge):
  a clear error naming the variable;
* an entry point of the group ``lollm.families`` that is not a lollm plugin: broken,
  and ``lollm families --strict`` fails;
* a third-party family named like a first-party one: the third party is broken, the
  first-party distribution is not, whatever the entry points' order;
* a plugin whose import hangs costs the wait once: later commands do not import it
  again (``lollm families`` does).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _core_helpers import child_env, run_lollm, write_site, write_toy_checkpoint
from lollm import hookspecs
from lollm.errors import GenerationError, PluginError
from lollm.family import CONTRACT_VERSION, Family
from lollm.hookspecs import hookimpl
from lollm.load.plugins import build_registry


def fam(name: str, *types: str, load: str | None = None) -> Family:
    return Family(name=name, contract=CONTRACT_VERSION, model_types=types or (name,),
                  load=load or f"nowhere_{name}.weights:load")


class Plugin:
    def __init__(self, *families: Family):
        self.families = families

    @hookimpl
    def lollm_register_families(self, register):
        for family in self.families:
            register(family)


def entry_points_of(site: Path) -> list[md.EntryPoint]:
    return [ep for dist in md.distributions(path=[str(site)]) for ep in dist.entry_points
            if ep.group == hookspecs.ENTRY_POINT_GROUP]


FAMILY_PLUGIN = """
    from lollm.family import CONTRACT_VERSION, Family
    from lollm.hookspecs import hookimpl

    @hookimpl
    def lollm_register_families(register):
        register(Family(name={name!r}, contract=CONTRACT_VERSION, model_types=({model_type!r},), load={load!r}))
"""


# -- a family load() that raises --------------------------------------------------------------


LOAD_RAISES = {
    "__init__.py": "",
    "plugin.py": FAMILY_PLUGIN.format(name="toy_raises", model_type="lollm_toy", load="lollm_toy_raises.model:load"),
    "model.py": """
        def load(checkpoint, options):
            table = {}
            return table["layers"]  # a plugin bug: KeyError
    """,
}


@pytest.fixture(scope="module")
def raising_site(tmp_path_factory) -> Path:
    return write_site(tmp_path_factory.mktemp("raises"), "lollm-toy-raises", "0.3.0",
                      {"raises": "lollm_toy_raises.plugin"}, {"lollm_toy_raises": LOAD_RAISES})


@pytest.fixture(scope="module")
def toy_ckpt(tmp_path_factory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("ckpt"))


def test_a_family_load_that_raises_is_one_line_naming_the_plugin(raising_site, toy_ckpt, monkeypatch):
    args = ("run", str(toy_ckpt), "-p", "hi", "-n", "2", "--device", "cpu")
    monkeypatch.delenv("LOLLM_DEBUG", raising=False)
    done = run_lollm(*args, sites=(raising_site,))
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and done.stderr.strip().endswith(errors[0]), done.stderr
    line = errors[0]
    assert "Traceback" not in done.stderr
    for needle in ("load of family 'toy_raises'", "plugin 'raises' (lollm-toy-raises 0.3.0)",
                   "KeyError: 'layers'", "lollm_toy_raises/model.py:4, in load", "LOLLM_DEBUG=1"):
        assert needle in line, (needle, line)

    done = run_lollm("--debug", *args, sites=(raising_site,))  # the traceback, for the plugin's author
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr, done.stderr
    assert "KeyError: 'layers'" in done.stderr and 'model.py", line 4, in load' in done.stderr

    monkeypatch.setenv("LOLLM_DEBUG", "1")  # the same through the environment
    done = run_lollm(*args, sites=(raising_site,))
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr, done.stderr
    assert "KeyError: 'layers'" in done.stderr and 'model.py", line 4, in load' in done.stderr


def write_module(folder: Path, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(source)


def test_the_guard_keeps_lollm_errors_and_interrupts_and_wraps_the_rest(tmp_path, monkeypatch):
    write_module(tmp_path, "lollm_hostile_loads", "\n".join([
        "from lollm.errors import GenerationError",
        "def value_error(*a): raise ValueError('bad shape')",
        "def lollm_error(*a): raise GenerationError('prompt too long')",
        "def interrupted(*a): raise KeyboardInterrupt",
        "def exits(*a): raise SystemExit(3)",
        "def fine(*a): return 'model'",
    ]) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("LOLLM_DEBUG", raising=False)
    reg = build_registry(entry_points=[], extra_plugins=[
        (f"p_{fn}", Plugin(fam(f"f_{fn}", load=f"lollm_hostile_loads:{fn}")))
        for fn in ("value_error", "lollm_error", "interrupted", "exits", "fine")])
    load = {f.family.name: f.family.resolve() for f in reg.families}
    assert load["f_fine"]() == "model"
    with pytest.raises(PluginError) as info:
        load["f_value_error"]({}, None, "safetensors")
    assert "load of family 'f_value_error' of plugin 'p_value_error'" in str(info.value)
    assert "ValueError: bad shape" in str(info.value) and "lollm_hostile_loads.py:2" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(GenerationError, match="prompt too long"):
        load["f_lollm_error"]()
    with pytest.raises(KeyboardInterrupt):
        load["f_interrupted"]()
    with pytest.raises(PluginError, match="SystemExit: 3"):
        load["f_exits"]()
    monkeypatch.setenv("LOLLM_DEBUG", "1")
    with pytest.raises(ValueError, match="bad shape"):
        load["f_value_error"]()


# -- LOLLM_PLUGIN_IMPORT_TIMEOUT ------------------------------------------------------------


@pytest.mark.parametrize("value", ["1e309", "inf", "-inf", "nan", "1e12", "3601", "-0.5"])
def test_an_import_timeout_out_of_bounds_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("LOLLM_PLUGIN_IMPORT_TIMEOUT", value)
    with pytest.raises(PluginError, match=r"LOLLM_PLUGIN_IMPORT_TIMEOUT must be more than 0 and at most 3600"):
        build_registry(entry_points=[], extra_plugins=[("good", Plugin(fam("good")))])


def test_an_import_timeout_in_bounds_is_used(monkeypatch):
    monkeypatch.setenv("LOLLM_PLUGIN_IMPORT_TIMEOUT", "3600")
    reg = build_registry(entry_points=[], extra_plugins=[("good", Plugin(fam("good")))])
    assert [f.family.name for f in reg.families] == ["good"] and reg.broken == []


def test_families_with_an_infinite_timeout_is_one_error_line():
    env = child_env(LOLLM_PLUGIN_IMPORT_TIMEOUT="1e309")
    done = subprocess.run([sys.executable, "-m", "lollm.cli", "families"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: LOLLM_PLUGIN_IMPORT_TIMEOUT"), done.stderr
    assert "Traceback" not in done.stderr


# -- an entry point that is not a lollm plugin ------------------------------------------------


@pytest.fixture
def odd_site(tmp_path, monkeypatch) -> Path:
    site = write_site(tmp_path / "site", "lollm-odd", "1.0", {
        "stdlib": "json",                          # a module with no hook at all
        "object": "lollm_odd.plugin:NOT_A_PLUGIN",  # an object that is no plugin
        "nothing": "lollm_odd.plugin",             # implements the hook, registers nothing
        "good": "lollm_odd.good",
    }, {"lollm_odd": {
        "__init__.py": "",
        "plugin.py": """
            from lollm.hookspecs import hookimpl

            NOT_A_PLUGIN = 42

            @hookimpl
            def lollm_register_families(register):
                pass
        """,
        "good.py": FAMILY_PLUGIN.format(name="odd_good", model_type="odd_good", load="lollm_odd.model:load"),
    }})
    monkeypatch.syspath_prepend(str(site))
    return site


def test_an_entry_point_that_is_not_a_plugin_is_broken(odd_site):
    reg = build_registry(entry_points=entry_points_of(odd_site), allowlist=None)
    broken = {b.plugin: b for b in reg.broken}
    assert set(broken) == {"stdlib", "object", "nothing"}, reg.broken
    assert "'stdlib = json' is not a lollm plugin: it implements none of the hooks" in broken["stdlib"].error
    assert "is not a lollm plugin" in broken["object"].error
    assert "registered no family and no install hint" in broken["nothing"].error
    assert all(b.distribution == "lollm-odd" for b in reg.broken)
    assert [f.family.name for f in reg.families] == ["odd_good"]


def test_families_strict_fails_on_an_entry_point_that_is_not_a_plugin(odd_site):
    done = run_lollm("families", "--json", "--strict", sites=(odd_site,))
    assert done.returncode == 1, done.stderr
    broken = {b["plugin"] for b in json.loads(done.stdout)["broken"]}
    assert {"stdlib", "object", "nothing"} <= broken


# -- a third-party family named like a first-party one -----------------------------------------


@pytest.mark.parametrize("third_party_first", [True, False])
def test_a_name_clash_with_a_first_party_family_breaks_the_third_party(tmp_path, monkeypatch, third_party_first):
    site = tmp_path / "site"
    write_site(site, "lollm-qwen", "9.9.9", {"qwen": "fp_fake_qwen.plugin"}, {"fp_fake_qwen": {
        "__init__.py": "",
        "plugin.py": FAMILY_PLUGIN.format(name="qwen2", model_type="qwen2", load="fp_fake_qwen.m:load"),
    }})
    write_site(site, "lollm-impostor", "1.0", {"impostor": "tp_impostor.plugin"}, {"tp_impostor": {
        "__init__.py": "",
        "plugin.py": FAMILY_PLUGIN.format(name="qwen2", model_type="impostor_qwen2", load="tp_impostor.m:load"),
    }})
    monkeypatch.syspath_prepend(str(site))
    eps = sorted(entry_points_of(site), key=lambda ep: (ep.name != "impostor") == third_party_first)
    assert (eps[0].name == "impostor") == third_party_first
    reg = build_registry(entry_points=eps, allowlist=None)
    assert [(b.plugin, b.distribution) for b in reg.broken] == [("impostor", "lollm-impostor")], reg.broken
    assert "taken by the first-party family 'qwen2' of plugin 'qwen' (lollm-qwen 9.9.9)" in reg.broken[0].error
    assert reg.route("qwen2").distribution == "lollm-qwen"


# -- a plugin whose import hangs costs the wait once ---------------------------------------------


HANGS = """
import os, threading
with open(os.environ["LOLLM_TEST_HANG_MARKS"], "a") as f:
    f.write("imported\\n")
threading.Event().wait()
"""

REGISTRY_JSON = """
import json
from lollm.load.plugins import build_registry
reg = build_registry()
print(json.dumps({"broken": {b.plugin: b.error for b in reg.broken}, "families": [f.family.name for f in reg.families]}))
"""


def test_a_hanging_import_is_remembered_and_not_tried_again(tmp_path):
    site = write_site(tmp_path / "site", "lollm-hangs", "0.1", {"hangs": "lollm_hangs.plugin"},
                      {"lollm_hangs": {"__init__.py": "", "plugin.py": HANGS}})
    marks = tmp_path / "marks"
    env = child_env(site, LOLLM_CACHE=str(tmp_path / "cache"), LOLLM_TEST_HANG_MARKS=str(marks),
                    LOLLM_PLUGIN_IMPORT_TIMEOUT="1", LOLLM_LOAD_PLUGINS="lollm-hangs")

    def registry(timeout: str = "1") -> dict:
        done = subprocess.run([sys.executable, "-c", REGISTRY_JSON], capture_output=True, text=True,
                              env={**env, "LOLLM_PLUGIN_IMPORT_TIMEOUT": timeout}, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    first = registry()
    assert "did not finish within 1 s" in first["broken"]["hangs"]
    assert marks.read_text().count("imported") == 1
    memory = json.loads((tmp_path / "cache" / "plugin-timeouts.json").read_text())
    assert memory == {"lollm-hangs==0.1:hangs=lollm_hangs.plugin": 1.0}

    # a later command does not import it again: it is broken at once, saying why and how to retry
    again = registry()
    assert marks.read_text().count("imported") == 1
    error = again["broken"]["hangs"]
    assert "did not finish within 1 s on an earlier run" in error and "lollm families" in error, error

    # lollm families tries it again; so does a longer time limit
    done = subprocess.run([sys.executable, "-m", "lollm.cli", "families", "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert marks.read_text().count("imported") == 2
    registry(timeout="1.5")
    assert marks.read_text().count("imported") == 3
