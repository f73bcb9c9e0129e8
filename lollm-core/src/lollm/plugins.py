"""Finding the installed family plugins, and routing a checkpoint to one of them.

Flow::

    entry points "lollm.families"  ─►  pluggy PluginManager  ─►  lollm_register_families(register)
                                                                     │
                                              Registry: model_type ─► InstalledFamily

Each plugin is imported and registered inside its own guard
(:func:`_guarded`): any exception, ``SystemExit`` and a ``KeyboardInterrupt``
raised by the plugin's own code included, makes that one plugin broken
(``Registry.broken``, listed by ``lollm families``) and the others keep
working. The import runs in a daemon thread with a time limit
(:data:`IMPORT_TIMEOUT_SECONDS`, or ``$LOLLM_PLUGIN_IMPORT_TIMEOUT``): a
plugin whose import hangs is reported as broken after that time and left
behind (a daemon thread does not keep the process alive). What a plugin
prints while it is imported or registered is swallowed, so a bad plugin
changes neither the output nor the exit status of a command that does not
use it. The router only routes: an unknown type, or a type two plugins claim,
is an error naming what is installed, never a silent pick.

Ctrl-C: Python delivers signals to the main thread only, so a
``KeyboardInterrupt`` inside the guard's thread can only come from the
plugin's own code (a plugin failure); the user's Ctrl-C arrives in the main
thread, which is waiting for the guard, and stops the command as usual.

This module imports no torch and no model code.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import io
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from lollm import hookspecs
from lollm.errors import DuplicateModelType, PluginError, UnknownModelType
from lollm.family import Family, validate_family

#: Which distribution serves a model type, for the error message when none is
#: installed. A hint only: routing uses the installed plugins, never this table.
KNOWN_PROVIDERS = {
    "qwen2": "lollm-qwen",
    "qwen3": "lollm-qwen",
    "gemma2": "lollm-gemma",
    "gemma3": "lollm-gemma",
    "gemma3_text": "lollm-gemma",
    "gemma4": "lollm-gemma",
    "gemma4_text": "lollm-gemma",
    "qwen3_5": "lollm-qwen3_5",
    "qwen3_5_text": "lollm-qwen3_5",
    "qwen3_5_moe": "lollm-qwen3_5",
    "qwen3_5_moe_text": "lollm-qwen3_5",
}


@dataclass(frozen=True)
class InstalledFamily:
    """A registered :class:`Family` plus where it came from."""

    family: Family
    plugin: str  # entry-point name
    distribution: str  # distribution (pip package) name, e.g. "lollm-qwen"
    version: str


@dataclass(frozen=True)
class BrokenPlugin:
    """An entry point that could not be loaded or registered, and why."""

    plugin: str
    distribution: str
    error: str


@dataclass
class Registry:
    """All installed families, indexed by model type and GGUF architecture."""

    families: list[InstalledFamily] = field(default_factory=list)
    broken: list[BrokenPlugin] = field(default_factory=list)
    by_model_type: dict[str, InstalledFamily] = field(default_factory=dict)
    by_gguf_architecture: dict[str, InstalledFamily] = field(default_factory=dict)
    # a type claimed twice maps to every claimant; looked up only to raise
    conflicts: dict[str, list[InstalledFamily]] = field(default_factory=dict)

    # -- building -------------------------------------------------------
    def add(self, entry: InstalledFamily) -> None:
        if any(f.family.name == entry.family.name for f in self.families):
            other = next(f for f in self.families if f.family.name == entry.family.name)
            raise PluginError(
                f"family name {entry.family.name!r} is registered twice: by {_who(other)} and by {_who(entry)}"
            )
        self.families.append(entry)
        for kind, keys, index in (
            ("model type", entry.family.model_types, self.by_model_type),
            ("GGUF architecture", entry.family.gguf_architectures, self.by_gguf_architecture),
        ):
            for key in keys:
                slot = f"{kind}:{key}"
                if slot in self.conflicts:
                    self.conflicts[slot].append(entry)
                elif key in index:
                    self.conflicts[slot] = [index.pop(key), entry]
                else:
                    index[key] = entry

    # -- routing --------------------------------------------------------
    def route(self, model_type: str | None = None, *, gguf_architecture: str | None = None) -> InstalledFamily:
        """Return the family serving ``model_type`` (or ``gguf_architecture``).

        Raises UnknownModelType (naming the type, the installed families with
        their distributions, and the distribution that would serve it when
        known) or DuplicateModelType (naming both claimants).
        """
        if (model_type is None) == (gguf_architecture is None):
            raise ValueError("route() needs exactly one of model_type or gguf_architecture")
        kind = "model type" if model_type is not None else "GGUF architecture"
        key = model_type if model_type is not None else gguf_architecture
        index = self.by_model_type if model_type is not None else self.by_gguf_architecture
        claimants = self.conflicts.get(f"{kind}:{key}")
        if claimants:
            names = " and ".join(_who(c) for c in claimants)
            raise DuplicateModelType(
                f"{kind} {key!r} is claimed by more than one installed plugin: {names}; "
                f"uninstall one of them"
            )
        if key in index:
            return index[key]
        raise UnknownModelType(self._unknown_message(kind, key))

    def _unknown_message(self, kind: str, key: str) -> str:
        lines = [f"no installed lollm family serves {kind} {key!r}."]
        provider = KNOWN_PROVIDERS.get(key)
        if provider:
            lines.append(f"It is provided by the distribution {provider!r}: pip install {provider}")
        if self.families:
            lines.append("Installed families:")
            for f in self.families:
                types = "model types: " + ", ".join(f.family.model_types)
                if f.family.gguf_architectures:
                    types += "; GGUF: " + ", ".join(f.family.gguf_architectures)
                lines.append(f"  {f.family.name} ({types}) from {f.distribution} {f.version}")
        else:
            lines.append("No family plugin is installed (only lollm-core).")
        for b in self.broken:
            lines.append(f"Plugin {b.plugin!r} from {b.distribution} failed to load: {b.error}")
        return "\n".join(lines)


def _who(entry: InstalledFamily) -> str:
    return f"family {entry.family.name!r} of plugin {entry.plugin!r} ({entry.distribution} {entry.version})"


def _entry_points() -> Iterable[md.EntryPoint]:
    return md.entry_points(group=hookspecs.ENTRY_POINT_GROUP)


#: Seconds one plugin may take to import, and again to register its families,
#: before it is reported as broken. ``$LOLLM_PLUGIN_IMPORT_TIMEOUT`` overrides it
#: (a plugin that imports torch at module level needs a few seconds on a cold disk).
IMPORT_TIMEOUT_SECONDS = 30.0


def _timeout() -> float:
    text = os.environ.get("LOLLM_PLUGIN_IMPORT_TIMEOUT", "").strip()
    if not text:
        return IMPORT_TIMEOUT_SECONDS
    try:
        value = float(text)
    except ValueError:
        raise PluginError(f"LOLLM_PLUGIN_IMPORT_TIMEOUT must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise PluginError(f"LOLLM_PLUGIN_IMPORT_TIMEOUT must be > 0, got {text!r}")
    return value


class _Failed(Exception):
    """What :func:`_guarded` reports: the plugin raised, exited, or ran out of time."""


def _guarded(work: Callable[[], Any], what: str, timeout: float) -> Any:
    """Run a plugin's ``work`` in a daemon thread; return its result or raise _Failed saying why.

    Everything the plugin code raises is caught, BaseException included: an
    ``ImportError``, a ``sys.exit()`` (``SystemExit``), a ``KeyboardInterrupt``
    it raises itself. stdout and stderr are swallowed while it runs.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # a plugin's failure of any kind, sys.exit() included
            outcome["error"] = exc

    thread = threading.Thread(target=target, name=f"lollm plugin: {what}", daemon=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        thread.start()
        thread.join(timeout)
    if thread.is_alive():
        raise _Failed(
            f"{what} did not finish within {timeout:g} s (it may hang; a slow import can be given more "
            f"time with LOLLM_PLUGIN_IMPORT_TIMEOUT)"
        )
    if "error" in outcome:
        exc = outcome["error"]
        if isinstance(exc, PluginError):
            raise _Failed(str(exc))
        if isinstance(exc, SystemExit):
            raise _Failed(f"{what} called sys.exit({exc.code!r})")
        raise _Failed(f"{what} raised {type(exc).__name__}: {exc}")
    return outcome.get("value")


def _distribution_of(ep: md.EntryPoint) -> tuple[str, str]:
    try:
        if ep.dist is not None:
            return str(ep.dist.metadata["Name"]), str(ep.dist.version)
    except Exception:  # unreadable metadata of a broken installation
        pass
    return "?", "?"


def build_registry(entry_points: Iterable[md.EntryPoint] | None = None, extra_plugins: Iterable[tuple[str, object]] = ()) -> Registry:
    """Load every plugin and collect its families.

    ``entry_points`` defaults to the installed ones; ``extra_plugins`` are
    ``(name, module_or_object)`` pairs registered directly (used by tests and
    the conformance kit). A plugin that fails to import (or takes longer than
    the time limit), does not match the hookspecs, raises or exits in its hook,
    or registers a bad family is recorded in ``Registry.broken`` and skipped;
    the others load.
    """
    timeout = _timeout()
    registry = Registry()
    sources: list[tuple[str, str, str, object]] = []
    for ep in _entry_points() if entry_points is None else entry_points:
        dist, version = _distribution_of(ep)
        try:
            obj = _guarded(ep.load, f"import of {ep.value!r}", timeout)
        except _Failed as exc:
            registry.broken.append(BrokenPlugin(ep.name, dist, str(exc)))
            continue
        sources.append((ep.name, dist, version, obj))
    for name, obj in extra_plugins:
        sources.append((name, name, "(local)", obj))

    for name, dist, version, obj in sources:
        try:
            collected = _guarded(lambda: _register(name, obj), f"plugin {name!r}", timeout)
        except _Failed as exc:
            registry.broken.append(BrokenPlugin(name, dist, str(exc)))
            continue
        for family in collected:
            try:
                registry.add(InstalledFamily(family, name, dist, version))
            except PluginError as exc:
                registry.broken.append(BrokenPlugin(name, dist, str(exc)))
    return registry


def _register(name: str, obj: object) -> list[Family]:
    """Register one plugin object with a plugin manager of its own and call its hook; return its families.

    Each plugin gets its own pluggy PluginManager, so a plugin left running
    after its time limit can never touch another plugin's registration.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(obj, name=name)
        # a hook the contract does not have (a typo, or a newer contract) is an error, not a silent no-op
        pm.check_pending()
    except Exception as exc:  # pluggy's validation errors
        raise PluginError(f"does not match the lollm plugin contract: {exc}") from None
    collected: list[Family] = []

    def register(family: Any) -> None:
        collected.append(validate_family(family, plugin=name))

    try:
        pm.hook.lollm_register_families(register=register)
    except PluginError:
        raise
    except Exception as exc:
        raise PluginError(f"lollm_register_families raised {type(exc).__name__}: {exc}") from None
    return collected


_REGISTRY: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The registry of installed plugins, built once per process."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        _REGISTRY = build_registry()
    return _REGISTRY
