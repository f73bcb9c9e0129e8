"""What the user controls about plugin loading (docs/plugin-loading.md).

* ``$LOLLM_LOAD_PLUGINS``: an allowlist of distributions, PEP 503 names; a
  plugin left out is never imported; a listed name that matches no plugin is
  a warning with a "did you mean".
* ``--family NAME``: settles a type two plugins claim, is checked against what
  the family declares, and is on every command that loads a model.
* A misspelled hook name gets a "did you mean" (difflib).
* Install hints: declared by plugins through ``lollm_register_install_hints``,
  plus core's first-party table.

Throwaway distributions are hand-written ``.dist-info`` folders
(:func:`_core_helpers.write_site`), read in this process through
``importlib.metadata.distributions(path=...)`` or in a child process.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
from pathlib import Path

import pytest

from _core_helpers import run_lollm, write_site, write_toy_checkpoint
from lollm import hookspecs
from lollm.errors import DuplicateModelType, PluginError, UnknownFamily, UnknownModelType
from lollm.family import CONTRACT_VERSION, Family
from lollm.hookspecs import hookimpl
from lollm.load.plugins import build_registry
from lollm.load.registry import (FIRST_PARTY_GGUF_ARCHITECTURES, FIRST_PARTY_MODEL_TYPES, LOAD_PLUGINS_ENV, normalize_name,
                                 read_allowlist)


def fam(name: str, *types: str, gguf: tuple[str, ...] = ()) -> Family:
    return Family(name=name, contract=CONTRACT_VERSION, model_types=types or (name,), gguf_architectures=gguf,
                  load=f"nowhere_{name}.weights:load")


class Plugin:
    """Registers ``families`` and calls ``register`` of the hints hook with each of ``hints`` (kwargs dicts)."""

    def __init__(self, *families: Family, hints: tuple[dict, ...] = ()):
        self.families, self.hints = families, hints

    @hookimpl
    def lollm_register_families(self, register):
        for family in self.families:
            register(family)

    @hookimpl
    def lollm_register_install_hints(self, register):
        for hint in self.hints:
            register(**hint)


def plugin_source(family: str, *types: str) -> dict[str, str]:
    """A plugin package whose import is visible: it sets ``sys.lollm_imported_<family>``."""
    return {
        "__init__.py": "",
        "plugin.py": f"""
            import sys
            from lollm.family import CONTRACT_VERSION, Family
            from lollm.hookspecs import hookimpl

            setattr(sys, "lollm_imported_{family}", True)

            @hookimpl
            def lollm_register_families(register):
                register(Family(name={family!r}, contract=CONTRACT_VERSION, model_types={types or (family,)!r},
                                load="nowhere.x:load"))
            """,
    }


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """One folder holding two installed distributions: lollm-testload-alpha and Lollm_TestLoad.Beta."""
    root = tmp_path_factory.mktemp("site")
    write_site(root, "lollm-testload-alpha", "1.0", {"alpha": "tl_alpha.plugin"},
               {"tl_alpha": plugin_source("tl_alpha", "tl_alpha", "tl_shared")})
    write_site(root, "Lollm_TestLoad.Beta", "2.0", {"beta": "tl_beta.plugin"},
               {"tl_beta": plugin_source("tl_beta", "tl_beta", "tl_shared")})
    return root


@pytest.fixture
def eps(site, monkeypatch):
    """The entry points of ``site`` (with their distributions), importable in this process."""
    monkeypatch.syspath_prepend(str(site))
    for name in ("tl_alpha", "tl_beta"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delitem(sys.modules, f"{name}.plugin", raising=False)
        monkeypatch.delattr(sys, f"lollm_imported_{name}", raising=False)
    return [ep for dist in md.distributions(path=[str(site)]) for ep in dist.entry_points
            if ep.group == hookspecs.ENTRY_POINT_GROUP]


# -- LOLLM_LOAD_PLUGINS ----------------------------------------------------------------


def test_names_are_compared_as_pep_503_normalises_them():
    assert normalize_name("Lollm_TestLoad.Beta") == normalize_name("lollm-testload--beta") == "lollm-testload-beta"
    assert read_allowlist("lollm_Qwen, LOLLM.gemma,,") == {"lollm-qwen": "lollm_Qwen", "lollm-gemma": "LOLLM.gemma"}
    assert read_allowlist("") == {} and read_allowlist(" , ") == {}


def test_unset_loads_every_plugin(eps, monkeypatch):
    monkeypatch.delenv(LOAD_PLUGINS_ENV, raising=False)
    reg = build_registry(entry_points=eps)
    assert sorted(f.family.name for f in reg.families) == ["tl_alpha", "tl_beta"]
    assert reg.skipped == [] and reg.warnings() == [] and reg.allowlist is None


def test_a_plugin_left_out_is_never_imported(eps):
    reg = build_registry(entry_points=eps, allowlist="lollm-testload-alpha")
    assert [f.family.name for f in reg.families] == ["tl_alpha"]
    assert [(s.plugin, s.distribution, s.version) for s in reg.skipped] == [("beta", "Lollm_TestLoad.Beta", "2.0")]
    assert getattr(sys, "lollm_imported_tl_alpha", False)
    assert not getattr(sys, "lollm_imported_tl_beta", False)
    # the shared type is no longer a clash: only alpha claims it
    assert reg.route("tl_shared").family.name == "tl_alpha"
    assert reg.warnings() == []


def test_the_allowlist_matches_whatever_spelling_pip_accepts(eps):
    reg = build_registry(entry_points=eps, allowlist=" LOLLM-TESTLOAD__BETA ")
    assert [f.family.name for f in reg.families] == ["tl_beta"]
    assert [s.distribution for s in reg.skipped] == ["lollm-testload-alpha"]


def test_an_empty_allowlist_loads_nothing_but_explicit_plugins(eps):
    reg = build_registry(entry_points=eps, extra_plugins=[("local", Plugin(fam("local")))], allowlist="")
    assert [f.family.name for f in reg.families] == ["local"]  # extra plugins are not subject to it
    assert {s.plugin for s in reg.skipped} == {"alpha", "beta"}
    with pytest.raises(UnknownModelType) as info:
        reg.route("tl_alpha")
    msg = str(info.value)
    assert f"left out by {LOAD_PLUGINS_ENV}=''" in msg
    assert "Lollm_TestLoad.Beta" in msg and "lollm-testload-alpha" in msg


def test_the_variable_is_read_when_no_text_is_given(eps, monkeypatch):
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "lollm_testload_beta")
    assert [f.family.name for f in build_registry(entry_points=eps).families] == ["tl_beta"]


def test_a_listed_name_that_matches_no_plugin_is_a_warning_with_a_guess(eps):
    reg = build_registry(entry_points=eps, allowlist="lollm-testload-alpah,beta,lollm-nothing-like-it,pluggy")
    assert [f.family.name for f in reg.families] == []
    warnings = reg.warnings()
    assert warnings == [
        f"{LOAD_PLUGINS_ENV}: no distribution 'lollm-testload-alpah' is installed; "
        "did you mean the distribution 'lollm-testload-alpha'?",
        # the entry point's name, not the distribution's: the distribution is suggested
        f"{LOAD_PLUGINS_ENV}: no distribution 'beta' is installed; did you mean the distribution 'Lollm_TestLoad.Beta'?",
        f"{LOAD_PLUGINS_ENV}: no distribution 'lollm-nothing-like-it' is installed",
        f"{LOAD_PLUGINS_ENV}: 'pluggy' is installed but has no 'lollm.families' entry point (it is not a lollm plugin)",
    ]
    with pytest.raises(UnknownModelType) as info:  # and routing says it again
        reg.route("tl_alpha")
    assert "no distribution 'lollm-testload-alpah' is installed" in str(info.value)


@pytest.mark.parametrize("text", ["lollm qwen", "lollm-qwen;rm", "-lollm", "lollm-qwen==1.0"])
def test_a_malformed_allowlist_is_an_error_naming_the_variable_and_the_entry(text):
    with pytest.raises(PluginError) as info:
        build_registry(entry_points=[], allowlist=f"lollm-gemma,{text}")
    assert str(info.value).startswith(f"{LOAD_PLUGINS_ENV}: {text!r} is not a distribution name")


# -- --family ----------------------------------------------------------------------------


def clash():
    return build_registry(entry_points=[], extra_plugins=[
        ("first-plugin", Plugin(fam("first", "shared", gguf=("sharedarch",)))),
        ("second-plugin", Plugin(fam("second", "shared", "second_only", gguf=("sharedarch",)))),
    ])


def test_a_clash_names_the_claimants_and_the_flag_that_settles_it():
    reg = clash()
    with pytest.raises(DuplicateModelType) as info:
        reg.route("shared")
    msg = str(info.value)
    assert "choose with --family NAME ('first' or 'second')" in msg
    assert "'first-plugin'" in msg and "'second-plugin'" in msg
    assert reg.route("shared", family="first").family.name == "first"
    assert reg.route("shared", family="second").plugin == "second-plugin"
    assert reg.route(gguf_architecture="sharedarch", family="second").family.name == "second"


def test_an_unknown_family_names_the_installed_ones_and_the_closest():
    with pytest.raises(UnknownFamily) as info:
        clash().route("shared", family="secnd")
    msg = str(info.value)
    assert msg.startswith("--family 'secnd': no installed lollm family has that name. Did you mean 'second'?")
    assert "first (model types: shared; GGUF: sharedarch) from first-plugin" in msg
    with pytest.raises(UnknownFamily) as info:
        clash().family_named("zzz")
    assert "Did you mean" not in str(info.value)


def test_a_forced_family_must_declare_the_checkpoint_type():
    reg = clash()
    with pytest.raises(PluginError) as info:
        reg.route("second_only", family="first")
    msg = str(info.value)
    assert not isinstance(info.value, (UnknownFamily, DuplicateModelType))
    assert "--family 'first' does not declare the checkpoint's model type 'second_only'" in msg
    assert "(it declares shared)" in msg and "is declared by: second" in msg
    with pytest.raises(PluginError, match="GGUF architecture 'shared'.*it declares sharedarch"):
        reg.route(gguf_architecture="shared", family="first")


# -- did you mean: hook names ------------------------------------------------------------


class Misspelled:
    @hookimpl
    def lollm_register_familes(self, register):
        register(fam("never"))


class FarOff:
    @hookimpl
    def register_my_models(self, register):
        pass


class Unmarked:
    def lollm_register_families(self, register):  # no @hookimpl: pluggy would silently never call it
        register(fam("never"))


class StarImported:
    """A plugin whose module did ``from lollm.hookspecs import *``: the specs themselves are not implementations."""

    lollm_register_install_hints = staticmethod(hookspecs.lollm_register_install_hints)

    @hookimpl
    def lollm_register_families(self, register):
        register(fam("starred"))


class Renamed:
    @hookimpl(specname="lollm_register_families")
    def families(self, register):
        register(fam("renamed"))


def test_a_misspelled_hook_is_broken_with_the_closest_real_name():
    reg = build_registry(entry_points=[], extra_plugins=[
        ("typo", Misspelled()), ("far", FarOff()), ("unmarked", Unmarked()), ("renamed", Renamed()),
        ("starred", StarImported()), ("good", Plugin(fam("good"))),
    ])
    broken = {b.plugin: b.error for b in reg.broken}
    assert set(broken) == {"typo", "far", "unmarked"}
    assert ("'lollm_register_familes' is not a lollm hook (did you mean 'lollm_register_families'?)"
            in broken["typo"]), broken["typo"]
    assert "'register_my_models' is not a lollm hook; the hooks are lollm_register_families, " \
           "lollm_register_install_hints" in broken["far"]
    assert "defines lollm_register_families without @hookimpl" in broken["unmarked"]
    assert sorted(f.family.name for f in reg.families) == ["good", "renamed", "starred"]


def test_a_misspelled_hook_in_a_plugin_module_is_reported_by_lollm_families(tmp_path):
    site = write_site(tmp_path / "site", "lollm-testload-typo", "0.1", {"typo": "tl_typo.plugin"}, {"tl_typo": {
        "__init__.py": "",
        "plugin.py": """
            from lollm.hookspecs import hookimpl

            @hookimpl
            def lollm_register_install_hint(register):
                register("lollm-x", model_types=("x",))
            """,
    }})
    done = run_lollm("families", "--json", sites=(site,))
    assert done.returncode == 0, done.stderr
    broken = [b for b in json.loads(done.stdout)["broken"] if b["plugin"] == "typo"]
    assert len(broken) == 1 and broken[0]["distribution"] == "lollm-testload-typo"
    assert "did you mean 'lollm_register_install_hints'?" in broken[0]["error"]


# -- install hints -----------------------------------------------------------------------


def test_a_plugin_declares_where_other_types_live():
    index = Plugin(fam("mine"), hints=(
        {"install": "lollm-llama", "model_types": ("llama", "mistral"), "gguf_architectures": ("llama",)},
        {"install": "lollm-qwen[extra]", "model_types": ("qwen2",)},
    ))
    reg = build_registry(entry_points=[], extra_plugins=[("index", index)])
    assert reg.broken == []
    for route in (lambda: reg.route("mistral"), lambda: reg.route(gguf_architecture="llama")):
        with pytest.raises(UnknownModelType) as info:
            route()
        assert ("It is provided by the distribution 'lollm-llama': pip install lollm-llama "
                "(hint from plugin 'index' (index (local)))") in str(info.value)
    # a plugin's hint comes first; core's first-party table adds its own when it names another distribution
    with pytest.raises(UnknownModelType) as info:
        reg.route("qwen2")
    lines = str(info.value).splitlines()
    assert lines[1].startswith("It is provided by the distribution 'lollm-qwen[extra]': pip install lollm-qwen[extra]")
    # first-party families are folders of the repository, not on PyPI
    assert lines[2] == ("It is provided by the distribution 'lollm-qwen': pip install ./lollm-qwen "
                        "(hint from lollm-core's table of first-party distributions)")
    # a type nobody hints at gets no pip line
    with pytest.raises(UnknownModelType) as info:
        reg.route("martian")
    assert "pip install" not in str(info.value)


def test_a_hint_for_an_installed_but_left_out_distribution_says_so(eps):
    index = Plugin(hints=({"install": "Lollm-TestLoad-Beta", "model_types": ("tl_beta",)},))
    reg = build_registry(entry_points=eps, extra_plugins=[("index", index)], allowlist="lollm-testload-alpha")
    with pytest.raises(UnknownModelType) as info:
        reg.route("tl_beta")
    assert ("It is provided by the distribution 'Lollm-TestLoad-Beta', which is installed but left out by "
            f"{LOAD_PLUGINS_ENV}: add it to the list") in str(info.value)
    assert "pip install" not in str(info.value)


def test_the_first_party_table_covers_model_types_and_gguf_architectures():
    reg = build_registry(entry_points=[], allowlist="")
    with pytest.raises(UnknownModelType, match=r"pip install \./lollm-qwen3_5 "):
        reg.route(gguf_architecture="qwen35moe")
    # only first-party distributions, each named in both tables
    assert set(FIRST_PARTY_MODEL_TYPES.values()) == set(FIRST_PARTY_GGUF_ARCHITECTURES.values()) == {
        "lollm-qwen", "lollm-gemma", "lollm-qwen3_5"}
    repo = Path(__file__).resolve().parents[2]
    for dist in set(FIRST_PARTY_MODEL_TYPES.values()):
        assert f'name = "{dist}"' in (repo / dist / "pyproject.toml").read_text()


@pytest.mark.parametrize("hint, needle", [
    ({"install": "lollm llama", "model_types": ("llama",)}, "install='lollm llama' is not a distribution name"),
    ({"install": "lollm-llama>=1", "model_types": ("llama",)}, "is not a distribution name"),
    ({"install": 7, "model_types": ("llama",)}, "install=7"),
    ({"install": "lollm-llama", "model_types": "llama"}, "model_types must be a tuple of strings, got str"),
    ({"install": "lollm-llama", "gguf_architectures": ("llama", "")}, "gguf_architectures holds ''"),
    ({"install": "lollm-llama"}, "names no model type and no GGUF architecture"),
    ({"install": "lollm-llama", "model_types": ("llama",), "typo": 1}, "TypeError"),
])
def test_a_bad_hint_breaks_its_plugin_only(hint, needle):
    reg = build_registry(entry_points=[], extra_plugins=[("bad", Plugin(fam("bad"), hints=(hint,))),
                                                         ("good", Plugin(fam("good")))])
    assert [b.plugin for b in reg.broken] == ["bad"]
    assert needle in reg.broken[0].error, reg.broken[0].error
    assert reg.route("good").family.name == "good"
    assert reg.hints == []


# -- the CLI -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def toy_sites(tmp_path_factory) -> tuple[Path, Path]:
    """The documented toy family, and a twin distribution whose family claims the same model type."""
    from test_example_plugin import EXAMPLE

    root = tmp_path_factory.mktemp("toy")
    toy = write_site(root / "toy", "lollm-toy", "0.1.0", {"toy": "lollm_toy.plugin"},
                     {"lollm_toy": EXAMPLE / "src" / "lollm_toy"})
    twin = write_site(root / "twin", "lollm-toy-twin", "0.2.0", {"twin": "lollm_toy_twin.plugin"}, {"lollm_toy_twin": {
        "__init__.py": "",
        "plugin.py": """
            from lollm.family import CONTRACT_VERSION, Family
            from lollm.hookspecs import hookimpl

            @hookimpl
            def lollm_register_families(register):
                register(Family(name="toy_twin", contract=CONTRACT_VERSION, model_types=("lollm_toy",),
                                load="lollm_toy.modeling:load"))

            @hookimpl
            def lollm_register_install_hints(register):
                register("lollm-testload-martian", model_types=("martian",))
            """,
    }})
    return toy, twin


@pytest.fixture(scope="module")
def toy_ckpt(tmp_path_factory) -> Path:
    return write_toy_checkpoint(tmp_path_factory.mktemp("ckpt"))


def test_run_with_two_claimants_needs_family_and_obeys_it(toy_sites, toy_ckpt):
    args = ("run", str(toy_ckpt), "-p", "hi", "--temperature", "0", "-n", "2", "--device", "cpu")
    done = run_lollm(*args, sites=toy_sites)
    assert done.returncode == 2 and done.stderr.startswith("error:"), done.stderr
    assert "choose with --family NAME ('lollm_toy' or 'toy_twin')" in done.stderr.replace("\n", " ")
    for family in ("toy_twin", "lollm_toy"):
        done = run_lollm(*args, "--family", family, sites=toy_sites)
        assert done.returncode == 0, done.stderr
        assert f"· {family} on cpu float32]" in done.stderr


@pytest.mark.parametrize("command", ["run", "chat", "serve", "parity", "trace", "bench"])
def test_every_command_that_loads_a_model_checks_family_before_the_model(command, toy_sites, monkeypatch):
    from typer.testing import CliRunner

    import lollm.load.plugins as plugins
    from lollm.cli import app

    for folder in toy_sites:
        monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(plugins, "_REGISTRY", None)
    # the model does not exist: the family name is refused first, naming the installed ones
    args = [command, "/no/such/model", "--family", "toy_twim"] + (["-p", "hi"] if command in ("run", "trace") else [])
    args += ["--port", "0"] if command == "serve" else []  # serve checks its port first: 8000 may be taken on this machine
    done = CliRunner().invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert isinstance(done.exception, UnknownFamily), (done.exit_code, done.stdout, done.exception)
    assert str(done.exception).startswith("--family 'toy_twim': no installed lollm family has that name. "
                                          "Did you mean 'toy_twin'?")
    assert "toy_twin (model types: lollm_toy) from lollm-toy-twin 0.2.0" in str(done.exception)


def test_families_shows_what_the_allowlist_left_out(toy_sites, monkeypatch):
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "lollm-toy-twin,lollm-toy-twine")
    done = run_lollm("families", "--json", sites=toy_sites)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [f["family"] for f in data["families"]] == ["toy_twin"]
    assert data["load_plugins"] == ["lollm-toy-twin", "lollm-toy-twine"]
    assert {"plugin": "toy", "distribution": "lollm-toy", "version": "0.1.0"} in data["skipped"]
    assert data["warnings"] == [f"{LOAD_PLUGINS_ENV}: no distribution 'lollm-toy-twine' is installed; "
                                "did you mean the distribution 'lollm-toy-twin'?"]
    assert data["install_hints"] == [{"kind": "model type", "key": "martian", "install": "lollm-testload-martian",
                                      "source": "plugin 'twin' (lollm-toy-twin 0.2.0)"}]
    assert run_lollm("families", "--json", "--strict", sites=toy_sites).returncode == 1

    done = run_lollm("families", sites=toy_sites)
    assert done.returncode == 0, done.stderr
    assert "toy_twin" in done.stdout
    assert "skipped lollm-toy 0.1.0 (plugin 'toy'): not named in LOLLM_LOAD_PLUGINS" in done.stderr
    assert "warning: LOLLM_LOAD_PLUGINS: no distribution 'lollm-toy-twine' is installed" in done.stderr

    monkeypatch.setenv(LOAD_PLUGINS_ENV, "lollm-toy-twin")
    assert run_lollm("families", "--strict", sites=toy_sites).returncode == 0


def test_a_command_that_routes_warns_about_the_allowlist_once(toy_sites, toy_ckpt, monkeypatch):
    monkeypatch.setenv(LOAD_PLUGINS_ENV, "lollm-toy,lollm-tyo")
    done = run_lollm("run", str(toy_ckpt), "-p", "hi", "--temperature", "0", "-n", "2", "--device", "cpu", sites=toy_sites)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("warning: LOLLM_LOAD_PLUGINS: no distribution 'lollm-tyo' is installed; "
                             "did you mean the distribution 'lollm-toy'?") == 1
    assert "· lollm_toy on cpu float32]" in done.stderr  # the twin is left out: no clash
