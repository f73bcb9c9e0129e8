"""The registry and the router, with plugin objects defined here (no installed distribution needed)."""

from __future__ import annotations

import importlib.metadata as md
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lollm import hookspecs
from lollm.errors import DuplicateModelType, LollmError, PluginError, UnknownModelType
from lollm.family import CONTRACT_VERSION, Capabilities, Family, import_target, validate_family
from lollm.hookspecs import hookimpl
from lollm.load.plugins import FIRST_PARTY_MODEL_TYPES, Registry, build_registry, get_registry


def fam(name: str, *types: str, gguf: tuple[str, ...] = (), **kwargs) -> Family:
    kwargs.setdefault("contract", CONTRACT_VERSION)
    kwargs.setdefault("load", f"nowhere_{name}.weights:load")
    return Family(name=name, model_types=types or (name,), gguf_architectures=gguf, **kwargs)


class Plugin:
    """A plugin object: registers ``items`` (anything, valid or not), or raises ``raises``."""

    def __init__(self, *items, raises: BaseException | None = None):
        self.items = items
        self.raises = raises

    @hookimpl
    def lollm_register_families(self, register):
        if self.raises is not None:
            raise self.raises
        for item in self.items:
            register(item)


def registry(*plugins: tuple[str, object], entry_points=()) -> Registry:
    return build_registry(entry_points=list(entry_points), extra_plugins=list(plugins))


# -- routing -------------------------------------------------------------------


def test_routes_by_model_type_and_gguf_architecture():
    reg = registry(
        ("alpha-plugin", Plugin(fam("alpha", "alpha", "alpha_text", gguf=("alpha-gguf",)))),
        ("beta-plugin", Plugin(fam("beta"), fam("gamma", gguf=("gamma",)))),
    )
    assert reg.broken == []
    assert [f.family.name for f in reg.families] == ["alpha", "beta", "gamma"]
    hit = reg.route("alpha_text")
    assert hit.family.name == "alpha" and hit.plugin == "alpha-plugin" and hit.distribution == "alpha-plugin"
    assert reg.route("alpha").family.name == "alpha"
    assert reg.route("beta").plugin == "beta-plugin"
    assert reg.route(gguf_architecture="alpha-gguf").family.name == "alpha"
    assert reg.route(gguf_architecture="gamma").family.name == "gamma"
    # the two indexes are separate: a model type is not a GGUF architecture
    with pytest.raises(UnknownModelType):
        reg.route(gguf_architecture="beta")
    with pytest.raises(UnknownModelType):
        reg.route("alpha-gguf")


def test_route_needs_exactly_one_key():
    reg = registry(("p", Plugin(fam("alpha"))))
    with pytest.raises(ValueError):
        reg.route()
    with pytest.raises(ValueError):
        reg.route("alpha", gguf_architecture="alpha")


def test_one_plugin_may_register_several_families():
    reg = registry(("multi", Plugin(fam("one"), fam("two"), fam("three"))))
    assert {f.family.name for f in reg.families} == {"one", "two", "three"}
    assert {f.plugin for f in reg.families} == {"multi"}


def test_unknown_type_names_the_type_the_installed_families_and_the_provider():
    reg = registry(("toy-plugin", Plugin(fam("toy", "toy", "toy_text"))), ("other", Plugin(fam("other"))))
    with pytest.raises(UnknownModelType) as info:
        reg.route("qwen2")
    msg = str(info.value)
    assert isinstance(info.value, PluginError) and isinstance(info.value, LollmError)
    assert "'qwen2'" in msg
    assert "lollm-qwen" in msg and FIRST_PARTY_MODEL_TYPES["qwen2"] == "lollm-qwen"
    assert "toy (model types: toy, toy_text) from toy-plugin" in msg
    assert "other (model types: other) from other" in msg


def test_unknown_type_without_known_provider_and_without_families():
    with pytest.raises(UnknownModelType) as info:
        registry().route("martian")
    msg = str(info.value)
    assert "'martian'" in msg and "No family plugin is installed" in msg
    assert "pip install" not in msg  # no provider is known for it


def test_unknown_gguf_architecture_names_it():
    reg = registry(("p", Plugin(fam("alpha", gguf=("alpha",)))))
    with pytest.raises(UnknownModelType, match="GGUF architecture 'gemma3'") as info:
        reg.route(gguf_architecture="gemma3")
    assert "lollm-gemma" in str(info.value)


def test_unknown_type_message_reports_broken_plugins():
    reg = registry(("good", Plugin(fam("good"))), ("bad", Plugin(raises=RuntimeError("kaput"))))
    with pytest.raises(UnknownModelType) as info:
        reg.route("qwen3")
    assert "'bad'" in str(info.value) and "kaput" in str(info.value)


# -- duplicates ----------------------------------------------------------------


def test_two_plugins_claiming_one_type_is_an_error_naming_both():
    reg = registry(
        ("first-plugin", Plugin(fam("first", "shared", "first_only"))),
        ("second-plugin", Plugin(fam("second", "shared", "second_only"))),
    )
    with pytest.raises(DuplicateModelType) as info:
        reg.route("shared")
    msg = str(info.value)
    assert isinstance(info.value, PluginError)
    assert "'shared'" in msg
    assert "'first'" in msg and "'first-plugin'" in msg
    assert "'second'" in msg and "'second-plugin'" in msg
    # no silent pick, and the other types of both plugins still route
    assert reg.route("first_only").family.name == "first"
    assert reg.route("second_only").family.name == "second"


def test_three_claimants_are_all_named():
    reg = registry(*[(f"p{i}", Plugin(fam(f"f{i}", "shared"))) for i in range(3)])
    with pytest.raises(DuplicateModelType) as info:
        reg.route("shared")
    assert all(f"'p{i}'" in str(info.value) for i in range(3))


def test_duplicate_gguf_architecture():
    reg = registry(("a", Plugin(fam("fa", gguf=("llama",)))), ("b", Plugin(fam("fb", gguf=("llama",)))))
    with pytest.raises(DuplicateModelType, match="GGUF architecture 'llama'") as info:
        reg.route(gguf_architecture="llama")
    assert "'a'" in str(info.value) and "'b'" in str(info.value)
    assert reg.route("fa").family.name == "fa"


def test_one_family_name_registered_twice_is_broken_naming_both():
    reg = registry(("a", Plugin(fam("same", "x"))), ("b", Plugin(fam("same", "y"))))
    assert reg.route("x").plugin == "a"
    assert [b.plugin for b in reg.broken] == ["b"]
    assert "'same'" in reg.broken[0].error and "'a'" in reg.broken[0].error and "'b'" in reg.broken[0].error
    with pytest.raises(UnknownModelType):
        reg.route("y")


# -- broken plugins --------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_plugin, needle",
    [
        (Plugin(raises=RuntimeError("boom")), "RuntimeError: boom"),
        (Plugin({"name": "dict"}), "not a lollm.family.Family"),
        (Plugin(fam("old", contract=CONTRACT_VERSION + 41)), f"contract {CONTRACT_VERSION + 41}"),
        (Plugin(fam("old", contract=0)), f"this lollm-core speaks contract {CONTRACT_VERSION}"),
        (Plugin(fam("typo", sampling_defaults={"temprature": 0.7})), "'temprature'"),
        (Plugin(fam("words", sampling_defaults={"top_p": "high"})), "'top_p'"),
        (Plugin(fam("noload", load="just_a_module")), "'just_a_module'"),
        (Plugin(Family(name="empty", contract=CONTRACT_VERSION, model_types=(), load="m:f")), "no model types"),
    ],
)
def test_a_broken_plugin_is_recorded_and_the_others_keep_working(bad_plugin, needle):
    reg = registry(("good-before", Plugin(fam("before"))), ("bad", bad_plugin), ("good-after", Plugin(fam("after"))))
    assert [b.plugin for b in reg.broken] == ["bad"]
    assert needle in reg.broken[0].error, reg.broken[0].error
    assert reg.route("before").family.name == "before"
    assert reg.route("after").family.name == "after"
    assert {f.family.name for f in reg.families} == {"before", "after"}


def test_a_plugin_that_registers_a_good_then_a_bad_family_is_broken_as_a_whole():
    reg = registry(("half", Plugin(fam("fine"), "junk")))
    assert [b.plugin for b in reg.broken] == ["half"]
    assert reg.families == []


class WrongSignature:
    @hookimpl
    def lollm_register_families(self, register, not_an_argument):
        register(fam("never"))


class UnknownHook:
    @hookimpl
    def lollm_register_models(self, register):
        pass


@pytest.mark.parametrize("bad", [WrongSignature(), UnknownHook()])
def test_a_plugin_that_does_not_match_the_hookspecs_is_broken(bad):
    reg = registry(("bad", bad), ("good", Plugin(fam("good"))))
    assert [b.plugin for b in reg.broken] == ["bad"]
    assert reg.route("good").family.name == "good"


def test_a_plugin_without_hooks_registers_nothing():
    reg = registry(("empty", object()), ("good", Plugin(fam("good"))))
    assert reg.broken == [] and [f.family.name for f in reg.families] == ["good"]


# -- entry points ----------------------------------------------------------------


def test_entry_points_load_and_failures_are_recorded(tmp_path, monkeypatch):
    (tmp_path / "lollm_test_ep_good.py").write_text(
        textwrap.dedent(
            """
            from lollm.family import CONTRACT_VERSION, Family
            from lollm.hookspecs import hookimpl

            @hookimpl
            def lollm_register_families(register):
                register(Family(name="epgood", contract=CONTRACT_VERSION, model_types=("epgood",), load="x.y:load"))
            """
        )
    )
    (tmp_path / "lollm_test_ep_raises.py").write_text("raise ImportError('needs libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    group = hookspecs.ENTRY_POINT_GROUP
    eps = [
        md.EntryPoint("good", "lollm_test_ep_good", group),
        md.EntryPoint("raises", "lollm_test_ep_raises", group),
        md.EntryPoint("missing", "lollm_test_no_such_module_anywhere", group),
        md.EntryPoint("noattr", "lollm_test_ep_good:no_such_object", group),
    ]
    reg = registry(("local", Plugin(fam("local"))), entry_points=eps)
    assert reg.route("epgood").plugin == "good"
    assert reg.route("local").plugin == "local"
    broken = {b.plugin: b for b in reg.broken}
    assert set(broken) == {"raises", "missing", "noattr"}
    assert "ImportError: needs libfoo" in broken["raises"].error and "lollm_test_ep_raises" in broken["raises"].error
    assert "ModuleNotFoundError" in broken["missing"].error
    assert "no_such_object" in broken["noattr"].error
    assert broken["raises"].distribution == "?"  # a hand-made EntryPoint belongs to no distribution


def test_build_registry_reads_the_installed_entry_points_by_default(monkeypatch):
    import lollm.load.plugins as plugins

    group = hookspecs.ENTRY_POINT_GROUP
    seen = []
    monkeypatch.setattr(plugins, "_entry_points", lambda: seen.append(1) or [md.EntryPoint("m", "lollm_nope_x", group)])
    reg = build_registry()
    assert seen == [1] and [b.plugin for b in reg.broken] == ["m"]
    # get_registry builds once and caches until refresh
    monkeypatch.setattr(plugins, "_REGISTRY", None)
    first = get_registry()
    assert get_registry() is first and len(seen) == 2
    assert get_registry(refresh=True) is not first and len(seen) == 3


# -- the Family record -----------------------------------------------------------


def test_family_defaults_and_validation():
    f = fam("plain")
    assert f.capabilities == Capabilities() and not f.capabilities.thinking_toggle
    assert f.sampling_defaults == {} and f.parity_reference is None and f.gguf_architectures == ()
    assert validate_family(f, plugin="p") == f
    gguf_only = Family(name="g", contract=CONTRACT_VERSION, model_types=(), load="m:f", gguf_architectures=("g",))
    assert validate_family(gguf_only, plugin="p") == gguf_only


def test_family_resolve_imports_the_target(tmp_path, monkeypatch):
    (tmp_path / "lollm_test_resolve_mod.py").write_text("def load(*args):\n    return 'loaded'\nboom = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    f = fam("r", load="lollm_test_resolve_mod:load", parity_reference="lollm_test_resolve_mod:load")
    assert f.resolve()() == "loaded"
    assert f.resolve("parity_reference")() == "loaded"
    with pytest.raises(PluginError, match="no parity_reference"):
        fam("r").resolve("parity_reference")
    with pytest.raises(PluginError, match="'lollm_test_resolve_mod' has no attribute 'nope'") as info:
        fam("r", load="lollm_test_resolve_mod:nope").resolve()
    assert "family 'r'" in str(info.value)
    with pytest.raises(PluginError, match="lollm_test_absent_mod"):
        fam("r", load="lollm_test_absent_mod:load").resolve()
    with pytest.raises(PluginError, match="not of the form"):
        import_target("no_colon", what="x")


# -- meta-tests: the contract is documented and tested --------------------------


def hook_specs() -> dict[str, object]:
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, hookspecs.PROJECT_NAME + "_spec")
    }


def test_every_hook_is_documented():
    specs = hook_specs()
    assert "lollm_register_families" in specs
    for name, fn in specs.items():
        doc = inspect.getdoc(fn)
        assert doc and len(doc) > 80, f"hook {name} has no real docstring"
        for param in inspect.signature(fn).parameters:
            assert f":param {param}:" in doc, f"hook {name}: argument {param!r} is not documented"
        assert ":returns:" in doc, f"hook {name}: the return value is not documented"


def test_every_hook_is_exercised_by_a_test():
    tests = [p for p in Path(__file__).parent.glob("test_*.py")]
    sources = {p.name: p.read_text(encoding="utf-8") for p in tests}
    for name in hook_specs():
        users = [f for f, text in sources.items() if f"def {name}(" in text]
        assert users, f"no test implements the hook {name}"


def test_light_modules_do_not_import_torch():
    code = textwrap.dedent(
        """
        import sys
        import lollm, lollm.errors, lollm.hookspecs, lollm.family, lollm.load.plugins, lollm.load.loader, lollm.cli, lollm.sampling_params
        heavy = sorted(m for m in ("torch", "transformers", "numpy", "safetensors") if m in sys.modules)
        print(",".join(heavy))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "torch" not in done.stdout.strip().split(","), f"imported: {done.stdout.strip()}"


# -- isolation: whatever a plugin does, it stays the plugin's problem ------------------


class Exits:
    @hookimpl
    def lollm_register_families(self, register):
        raise SystemExit(0)


class Interrupts:
    @hookimpl
    def lollm_register_families(self, register):
        raise KeyboardInterrupt


class Chatty:
    @hookimpl
    def lollm_register_families(self, register):
        print("hello from a chatty plugin")
        print("and its stderr", file=sys.stderr)
        register(fam("chatty"))


@pytest.mark.parametrize("bad, needle", [(Exits(), "called sys.exit(0)"), (Interrupts(), "raised KeyboardInterrupt")])
def test_a_plugin_that_exits_or_interrupts_in_its_hook_is_broken_not_fatal(bad, needle):
    reg = registry(("bad", bad), ("good", Plugin(fam("good"))))
    assert [b.plugin for b in reg.broken] == ["bad"]
    assert needle in reg.broken[0].error
    assert reg.route("good").family.name == "good"


def test_what_a_plugin_prints_while_registering_is_swallowed(capfd):
    reg = registry(("chatty", Chatty()))
    assert reg.route("chatty").family.name == "chatty"
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def write_module(folder: Path, name: str, source: str) -> md.EntryPoint:
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return md.EntryPoint(name, name, hookspecs.ENTRY_POINT_GROUP)


def test_an_import_that_exits_interrupts_or_hangs_makes_that_plugin_broken(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOLLM_PLUGIN_IMPORT_TIMEOUT", "0.5")
    eps = [
        write_module(tmp_path, "lollm_test_ep_exits", "import sys\nsys.exit(3)\n"),
        write_module(tmp_path, "lollm_test_ep_interrupts", "raise KeyboardInterrupt\n"),
        # blocks forever without using the CPU; its daemon thread is left behind
        write_module(tmp_path, "lollm_test_ep_hangs", "import threading\nthreading.Event().wait()\n"),
        # a real plugin (an entry point without a hook is broken: it is not a lollm plugin) that prints
        write_module(tmp_path, "lollm_test_ep_prints", "print('import-time noise')\n" + NOISY_PLUGIN),
    ]
    reg = registry(("good", Plugin(fam("good"))), entry_points=eps)
    broken = {b.plugin: b.error for b in reg.broken}
    assert set(broken) == {"lollm_test_ep_exits", "lollm_test_ep_interrupts", "lollm_test_ep_hangs"}
    assert "sys.exit(3)" in broken["lollm_test_ep_exits"]
    assert "KeyboardInterrupt" in broken["lollm_test_ep_interrupts"]
    assert "did not finish within 0.5 s" in broken["lollm_test_ep_hangs"]
    assert "LOLLM_PLUGIN_IMPORT_TIMEOUT" in broken["lollm_test_ep_hangs"]
    assert reg.route("good").family.name == "good"
    assert reg.route("noisy").plugin == "lollm_test_ep_prints"


NOISY_PLUGIN = """
from lollm.family import CONTRACT_VERSION, Family
from lollm.hookspecs import hookimpl

@hookimpl
def lollm_register_families(register):
    register(Family(name="noisy", contract=CONTRACT_VERSION, model_types=("noisy",), load="x.y:load"))
"""


@pytest.mark.parametrize("value", ["soon", "0", "-1"])
def test_a_bad_import_timeout_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("LOLLM_PLUGIN_IMPORT_TIMEOUT", value)
    with pytest.raises(PluginError, match="LOLLM_PLUGIN_IMPORT_TIMEOUT"):
        registry()


def test_a_plugin_module_that_exits_when_its_family_loads_is_a_plugin_error(tmp_path, monkeypatch):
    (tmp_path / "lollm_test_exits_on_load.py").write_text("import sys\nsys.exit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="SystemExit"):
        fam("x", load="lollm_test_exits_on_load:load").resolve()


# -- the Family record, field by field ----------------------------------------------------


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"name": None}, "name must be a non-empty string"),
        ({"name": 3}, "name must be a non-empty string"),
        ({"name": " "}, "name must be a non-empty string"),
        ({"contract": "1"}, "contract must be an int"),
        ({"contract": True}, "contract must be an int"),
        ({"model_types": None}, "model_types must be a tuple of strings, got NoneType"),
        ({"model_types": "qwen2"}, "got the string 'qwen2'"),
        ({"model_types": ("a", 1)}, "must hold non-empty strings, got 1"),
        ({"model_types": ("a", "")}, "must hold non-empty strings"),
        ({"model_types": ("a", "a")}, "lists a name twice"),
        ({"gguf_architectures": "llama"}, "gguf_architectures must be a tuple of strings"),
        ({"gguf_architectures": None}, "gguf_architectures must be a tuple of strings"),
        ({"load": None}, "load must be 'module:function'"),
        ({"load": "a b:c"}, "load must be 'module:function'"),
        ({"load": "pkg.mod:"}, "load must be 'module:function'"),
        ({"parity_reference": 5}, "parity_reference must be 'module:function'"),
        ({"capabilities": None}, "capabilities must be a lollm.family.Capabilities, got NoneType"),
        ({"capabilities": {"thinking_toggle": True}}, "capabilities must be a lollm.family.Capabilities"),
        ({"capabilities": Capabilities(thinking_toggle="yes")}, "capabilities.thinking_toggle must be True or False"),
        ({"sampling_defaults": None}, "sampling_defaults must be a dict"),
        ({"sampling_defaults": {"top_k": 2.5}}, "top_k must be a whole number"),
        ({"sampling_defaults": {"temperature": True}}, "'temperature'"),
        ({"sampling_defaults": {"top_p": float("nan")}}, "finite"),
        ({"sampling_defaults": {"temperature": -1}}, "temperature must be >= 0"),
        ({"sampling_defaults": {"repetition_penalty": 0}}, "repetition_penalty must be > 0"),
        ({"description": None}, "description must be a string"),
    ],
)
def test_every_family_field_is_checked_by_type(changes, needle):
    bad = Family(**{**dict(name="bad", contract=CONTRACT_VERSION, model_types=("bad",), load="m:f"), **changes})
    with pytest.raises(PluginError, match="plugin 'p'") as info:
        validate_family(bad, plugin="p")
    assert needle in str(info.value)
    # and through a registration: only that plugin is broken, and `families` can list everything else
    reg = registry(("p", Plugin(bad)), ("good", Plugin(fam("good"))))
    assert [b.plugin for b in reg.broken] == ["p"] and reg.route("good").family.name == "good"


def test_a_valid_registration_is_copied_into_plain_values():
    class Sneaky(Family):
        pass

    defaults = {"top_k": 20.0, "temperature": 1}
    f = validate_family(Sneaky(name="s", contract=CONTRACT_VERSION, model_types=["s"], load="m:f",
                               sampling_defaults=defaults), plugin="p")
    assert type(f) is Family and f.model_types == ("s",)
    assert f.sampling_defaults == {"top_k": 20, "temperature": 1.0} and isinstance(f.sampling_defaults["top_k"], int)
    defaults["top_k"] = 999  # the plugin's own dict changes later: the registration does not
    assert f.sampling_defaults["top_k"] == 20
