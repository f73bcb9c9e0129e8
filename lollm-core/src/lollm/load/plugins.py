"""Finding the installed family plugins, and routing a checkpoint to one of them.

Flow::

    entry points "lollm.families"  ─►  $LOLLM_LOAD_PLUGINS allows the distribution?  (no: skipped, never imported)
        ─►  import (guarded)  ─►  hook names checked  ─►  pluggy PluginManager
        ─►  lollm_register_families(register)        ─►  Registry: model_type ─► InstalledFamily
        ─►  lollm_register_install_hints(register)   ─►  Registry.hints (for the "pip install" line of an error)

Each plugin is imported and registered inside its own guard
(:func:`_guarded`): any exception, ``SystemExit`` and a ``KeyboardInterrupt``
raised by the plugin's own code included, makes that one plugin broken
(``Registry.broken``, listed by ``lollm families``) and the others keep
working. The import runs in a daemon thread with a time limit
(:data:`IMPORT_TIMEOUT_SECONDS`, or ``$LOLLM_PLUGIN_IMPORT_TIMEOUT``): a
plugin whose import hangs is reported as broken after that time and left
behind (a daemon thread does not keep the process alive); it is remembered
in ``$LOLLM_CACHE/plugin-timeouts.json`` and not imported again by later
commands (so it costs that wait once) until ``lollm families`` retries it, a
larger time limit is given, or its version changes. An entry point that is
not a lollm plugin (it implements no hook, or registers nothing) is broken
too. First-party distributions register first, so a third-party family that
takes a first-party family's name is the one reported. What a plugin
prints while it is imported or registered is swallowed, so a bad plugin
changes neither the output nor the exit status of a command that does not
use it. The router only routes: an unknown type, or a type two plugins claim,
is an error naming what is installed, never a silent pick; the user settles a
clash, or forces a family, by its name (``--family NAME``, ``route(...,
family=NAME)``).

What the user controls (docs/plugin-loading.md):

* ``$LOLLM_LOAD_PLUGINS``: a comma-separated allowlist of distributions (pip
  names, compared after PEP 503 normalisation). Unset: every installed plugin
  loads; empty: none does. An entry point of a distribution not in the list is
  never imported (``Registry.skipped``); a listed name that is not installed
  is a warning (``Registry.warnings()``), as with simonw/llm's
  ``LLM_LOAD_PLUGINS``, shown by ``lollm families`` and by every command that
  routes a checkpoint, and named again in the error when routing then fails.
* A hook pluggy would never call (a misspelled name, or a hook's name
  without ``@hookimpl``) makes the plugin broken, with a "did you mean"
  (:func:`_check_hook_names`, difflib).
* Install hints: when no installed family serves a type, the error says which
  distribution would. Installed plugins declare such hints through the hook
  ``lollm_register_install_hints``; core adds its own small table only for the
  first-party distributions (:data:`FIRST_PARTY_MODEL_TYPES`,
  :data:`FIRST_PARTY_GGUF_ARCHITECTURES`), which each of them checks in its
  tests against its own registered families.

Ctrl-C: Python delivers signals to the main thread only, so a
``KeyboardInterrupt`` inside the guard's thread can only come from the
plugin's own code (a plugin failure); the user's Ctrl-C arrives in the main
thread, which is waiting for the guard, and stops the command as usual.

This module imports no torch and no model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.metadata as md
import io
import json
import math
import os
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import pluggy

from lollm import hookspecs
from lollm.errors import PluginError
from lollm.family import Family, validate_family
from lollm.load.checks import seconds_from_env
from lollm.load.registry import (
    FIRST_PARTY_DISTRIBUTIONS, GGUF_ARCHITECTURE, MODEL_TYPE, REQUIREMENT, BrokenPlugin, InstalledFamily, InstallHint,
    Registry, SkippedPlugin, normalize_name, read_allowlist,
)
# Moved to lollm.load.registry; still importable from here until lollm-core 0.3 (docs/plugins.md, 10).
from lollm.load.registry import FIRST_PARTY_GGUF_ARCHITECTURES, FIRST_PARTY_MODEL_TYPES  # noqa: F401


def _entry_points() -> Iterable[md.EntryPoint]:
    return md.entry_points(group=hookspecs.ENTRY_POINT_GROUP)


#: Seconds one plugin may take to import, and again to register its families,
#: before it is reported as broken. ``$LOLLM_PLUGIN_IMPORT_TIMEOUT`` overrides it
#: (a plugin that imports torch at module level needs a few seconds on a cold disk).
#: A plugin that runs out of this time is remembered (:func:`remembered_hangs`),
#: so it costs this wait once, not on every command.
IMPORT_TIMEOUT_SECONDS = 30.0
#: The largest ``$LOLLM_PLUGIN_IMPORT_TIMEOUT`` accepted, in seconds (an hour: far
#: beyond any import, and far below what ``threading``'s wait can take).
MAX_IMPORT_TIMEOUT_SECONDS = 3600.0
IMPORT_TIMEOUT_ENV = "LOLLM_PLUGIN_IMPORT_TIMEOUT"


def _timeout() -> float:
    """``$LOLLM_PLUGIN_IMPORT_TIMEOUT`` in seconds (default :data:`IMPORT_TIMEOUT_SECONDS`).

    Raises PluginError naming the variable for text that is not a number, and
    for a number outside (0, :data:`MAX_IMPORT_TIMEOUT_SECONDS`]: ``nan``,
    ``inf`` (``1e309`` reads as inf), zero and negative values included.
    """
    return seconds_from_env(IMPORT_TIMEOUT_ENV, IMPORT_TIMEOUT_SECONDS, MAX_IMPORT_TIMEOUT_SECONDS, error=PluginError)


# -- plugins that hung: remembered, so that one hanging import does not cost every command -------

#: The file, in ``$LOLLM_CACHE`` (else ``~/.cache/lollm``), remembering plugins that ran out of time.
HANGS_FILE = "plugin-timeouts.json"


def _hangs_path() -> Path | None:
    """Where the memory lives; None when there is no home folder to find it in."""
    try:
        return Path(os.environ.get("LOLLM_CACHE") or Path.home() / ".cache" / "lollm") / HANGS_FILE
    except RuntimeError:  # Path.home() without $HOME or a password entry
        return None


def _hang_key(ep: md.EntryPoint, dist: str, version: str) -> str | None:
    """What identifies one installed plugin across processes; None for an entry point of no distribution."""
    if dist == "?":
        return None
    return f"{normalize_name(dist)}=={version}:{ep.name}={ep.value}"


def remembered_hangs() -> dict[str, float]:
    """{plugin key: the time limit in seconds it ran out of}, from :data:`HANGS_FILE`.

    Read at most 1 MiB of a regular file (opened without blocking, so a FIFO
    in its place cannot stall a command); an absent, unreadable, special or
    malformed file is an empty memory (this is a cache: it never makes a
    command fail).
    """
    path = _hangs_path()
    if path is None:
        return {}
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            data = json.loads(f.read(2**20))
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items()
            if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _save_hangs(hangs: dict[str, float]) -> None:
    """Write the memory atomically (a temporary file, then ``os.replace``); a failure to write is ignored."""
    path = _hangs_path()
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{HANGS_FILE}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(hangs, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class _Failed(Exception):
    """What :func:`_guarded` reports: the plugin raised, exited, or ran out of time."""


class _TimedOut(_Failed):
    """The plugin's import or registration did not finish within the time limit."""


def _guarded(work: Callable[[], Any], what: str, timeout: float) -> Any:
    """Run a plugin's ``work`` in a daemon thread; return its result or raise _Failed saying why.

    Everything the plugin code raises is caught, BaseException included: an
    ``ImportError``, a ``sys.exit()`` (``SystemExit``), a ``KeyboardInterrupt``
    it raises itself. stdout and stderr are swallowed while it runs.
    """
    outcome: dict[str, object] = {}

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
        raise _TimedOut(
            f"{what} did not finish within {timeout:g} s (it may hang; a slow import can be given more "
            f"time with {IMPORT_TIMEOUT_ENV})"
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


@dataclass
class _Source:
    """One plugin object to register: its entry-point name, distribution, version, and the hang memory's key."""

    name: str
    dist: str
    version: str
    obj: object
    key: str | None = None
    entry_point: str | None = None  # "name = value" when it came from an entry point (not extra_plugins)


def build_registry(entry_points: Iterable[md.EntryPoint] | None = None, extra_plugins: Iterable[tuple[str, object]] = (),
                   allowlist: str | None = None, *, retry_hung: bool = False) -> Registry:
    """Load every plugin the user allows and collect its families and install hints.

    ``entry_points`` defaults to the installed ones; ``extra_plugins`` are
    ``(name, module_or_object)`` pairs registered directly (used by tests and
    the conformance kit; the allowlist does not apply to them). ``allowlist``
    is the text of ``$LOLLM_LOAD_PLUGINS`` (None: read the variable; see
    :func:`read_allowlist`): an entry point whose distribution it does not name
    is recorded in ``Registry.skipped`` and never imported. A plugin that fails
    to import (or takes longer than the time limit), does not match the
    hookspecs (a misspelled hook gets a "did you mean"), raises or exits in its
    hook, or registers a bad family or hint is recorded in ``Registry.broken``
    and skipped; the others load. So is an entry point that is not a lollm
    plugin (it implements no hook, or registers nothing).

    First-party distributions (:data:`FIRST_PARTY_DISTRIBUTIONS`) register
    first, so a third-party family that takes a first-party family's name is
    the one reported broken, whatever the order of the entry points.

    A plugin that ran out of time is remembered in :data:`HANGS_FILE` and not
    imported again (it is listed as broken at once) until ``retry_hung`` is
    given (``lollm families`` does), the time limit is raised above the one it
    ran out of, or its version changes. Raises PluginError only for a
    malformed ``$LOLLM_LOAD_PLUGINS`` or ``$LOLLM_PLUGIN_IMPORT_TIMEOUT``.
    """
    timeout = _timeout()
    allowed = read_allowlist(allowlist)
    registry = Registry(allowlist=allowed)
    hangs = remembered_hangs()
    before = dict(hangs)
    sources: list[_Source] = []
    installed = list(_entry_points() if entry_points is None else entry_points)
    for ep in installed:
        dist, version = _distribution_of(ep)
        if allowed is not None and normalize_name(dist) not in allowed:
            registry.skipped.append(SkippedPlugin(ep.name, dist, version))
            continue
        key = _hang_key(ep, dist, version)
        if key in hangs and timeout <= hangs[key] and not retry_hung:
            registry.broken.append(BrokenPlugin(ep.name, dist, _remembered(ep, hangs[key])))
            continue
        try:
            obj = _guarded(ep.load, f"import of {ep.value!r}", timeout)
        except _Failed as exc:
            registry.broken.append(BrokenPlugin(ep.name, dist, str(exc)))
            if isinstance(exc, _TimedOut) and key is not None:
                hangs[key] = timeout
            continue
        hangs.pop(key, None)  # imported in time: forget an earlier hang (a registration that hangs is remembered again)
        sources.append(_Source(ep.name, dist, version, obj, key, f"{ep.name} = {ep.value}"))
    if allowed:
        registry.unmatched = _unmatched(allowed, installed)
    sources += [_Source(name, name, "(local)", obj) for name, obj in extra_plugins]
    sources.sort(key=lambda s: normalize_name(s.dist) not in FIRST_PARTY_DISTRIBUTIONS)  # stable: first-party first
    for source in sources:
        _register_source(registry, source, timeout, hangs)
    if hangs != before:
        _save_hangs(hangs)
    return registry


def _register_source(registry: Registry, source: _Source, timeout: float, hangs: dict[str, float]) -> None:
    """Call one plugin's hooks (guarded) and add what it registers; a failure makes it broken (and a hang is remembered)."""
    name, dist, version = source.name, source.dist, source.version
    try:
        families, hints = _guarded(lambda: _register(name, source.obj, entry_point=source.entry_point),
                                   f"plugin {name!r}", timeout)
    except _Failed as exc:
        registry.broken.append(BrokenPlugin(name, dist, str(exc)))
        if isinstance(exc, _TimedOut) and source.key is not None:
            hangs[source.key] = timeout
        return
    origin = f"plugin {name!r} ({dist} {version})"
    for family in families:
        try:
            registry.add(InstalledFamily(dataclasses.replace(family, registered_by=origin), name, dist, version))
        except PluginError as exc:
            registry.broken.append(BrokenPlugin(name, dist, str(exc)))
    registry.hints += [InstallHint(kind, key, install, origin) for kind, key, install in hints]


def _remembered(ep: md.EntryPoint, seconds: float) -> str:
    return (f"import of {ep.value!r} (or its registration) did not finish within {seconds:g} s on an earlier run, so it is not tried again "
            f"(remembered in {_hangs_path()}); `lollm families` tries it again, and so does a "
            f"{IMPORT_TIMEOUT_ENV} above {seconds:g}")


def _unmatched(allowed: dict[str, str], installed: list[md.EntryPoint]) -> list[str]:
    """Why each allowlisted name matches no installed plugin: not installed at all, or installed without one."""
    dists = {normalize_name(dist): dist for dist in (_distribution_of(ep)[0] for ep in installed)}
    by_plugin = {normalize_name(ep.name): _distribution_of(ep)[0] for ep in installed}
    why = []
    for norm, written in allowed.items():
        if norm in dists:
            continue
        try:
            md.distribution(written)
            line = f"{written!r} is installed but has no {hookspecs.ENTRY_POINT_GROUP!r} entry point (it is not a lollm plugin)"
        except md.PackageNotFoundError:
            line = f"no distribution {written!r} is installed"
        close = [by_plugin[norm]] if norm in by_plugin else [
            dists[d] for d in difflib.get_close_matches(norm, list(dists), n=1, cutoff=0.8)]
        if close:
            line += f"; did you mean the distribution {close[0]!r}?"
        why.append(line)
    return why


def _hook_names() -> list[str]:
    return sorted(name for name in vars(hookspecs) if name.startswith("lollm_")
                  and hasattr(getattr(hookspecs, name), hookspecs.PROJECT_NAME + "_spec"))


def _check_hook_names(obj: object) -> None:
    """A hook implementation pluggy would not call, named with a "did you mean" (difflib).

    Two mistakes are caught: ``@hookimpl`` on a name the contract lacks
    (``lollm_register_familes``), and a function with a hook's exact name but
    no ``@hookimpl`` (pluggy ignores it, so the plugin would silently register
    nothing).
    """
    known = _hook_names()
    marker = hookspecs.PROJECT_NAME + "_impl"
    for attr in dir(obj):
        if attr.startswith("__"):
            continue
        try:
            value = getattr(obj, attr)
        except Exception:  # a property that raises: pluggy's own scan skips it too
            continue
        if not callable(value):
            continue
        opts = getattr(value, marker, None)
        if isinstance(opts, dict):
            hook = opts.get("specname") or attr
            if hook not in known:
                close = difflib.get_close_matches(hook, known, n=1, cutoff=0.6)
                guess = f" (did you mean {close[0]!r}?)" if close else ""
                raise PluginError(f"does not match the lollm plugin contract: {hook!r} is not a lollm hook{guess}; "
                                  f"the hooks are {', '.join(known)}")
        elif attr in known and not hasattr(value, hookspecs.PROJECT_NAME + "_spec"):  # not the spec, star-imported
            raise PluginError(f"defines {attr} without @hookimpl (from lollm.hookspecs import hookimpl), "
                              f"so lollm would never call it")


def _register(name: str, obj: object, *, entry_point: str | None = None) -> tuple[list[Family], list[tuple[str, str, str]]]:
    """Register one plugin object with a plugin manager of its own and call its hooks; return its families and hints.

    Each plugin gets its own pluggy PluginManager, so a plugin left running
    after its time limit can never touch another plugin's registration.
    ``entry_point`` (``"name = value"``, for a plugin found through the group
    ``lollm.families``): such a plugin must implement a hook and register a
    family or an install hint; raises PluginError saying it is not a lollm
    plugin otherwise (an entry point naming the wrong module or object).
    """
    _check_hook_names(obj)
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(obj, name=name)
        # a hook the contract does not have (a newer contract) is an error, not a silent no-op
        pm.check_pending()
    except Exception as exc:  # pluggy's validation errors
        raise PluginError(f"does not match the lollm plugin contract: {exc}") from None
    if entry_point is not None and not any(getattr(pm.hook, hook).get_hookimpls() for hook in _hook_names()):
        raise PluginError(f"the entry point {entry_point!r} is not a lollm plugin: it implements none of the hooks "
                          f"{', '.join(_hook_names())} (point it at the module holding them)")
    collected: list[Family] = []
    hints: list[tuple[str, str, str]] = []

    def register(family: object) -> None:
        collected.append(validate_family(family, plugin=name))

    def register_hint(install: object, *, model_types: object = (), gguf_architectures: object = ()) -> None:
        hints.extend(validate_install_hint(install, model_types, gguf_architectures, plugin=name))

    for hook, call in (("lollm_register_families", lambda: pm.hook.lollm_register_families(register=register)),
                       ("lollm_register_install_hints",
                        lambda: pm.hook.lollm_register_install_hints(register=register_hint))):
        try:
            call()
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"{hook} raised {type(exc).__name__}: {exc}") from None
    if entry_point is not None and not collected and not hints:
        raise PluginError(f"the entry point {entry_point!r} registered no family and no install hint "
                          f"(a plugin in the group {hookspecs.ENTRY_POINT_GROUP!r} must register one)")
    return collected, hints


def validate_install_hint(install: object, model_types: object, gguf_architectures: object, *,
                          plugin: str) -> list[tuple[str, str, str]]:
    """Check one ``register(install, model_types=..., gguf_architectures=...)`` call; return ``(kind, key, install)`` rows.

    ``install`` must be a pip requirement of the plain kind a user can paste
    (a distribution name, extras at most: no versions, URLs or spaces); the
    keys tuples (or lists) of non-empty strings, at least one key in all.
    Raises PluginError naming the plugin and the bad value.
    """
    where = f"plugin {plugin!r}: lollm_register_install_hints"
    if not isinstance(install, str) or not REQUIREMENT.match(install):
        raise PluginError(f"{where}: install={install!r} is not a distribution name (e.g. 'lollm-llama')")
    rows: list[tuple[str, str, str]] = []
    for kind, arg, keys in ((MODEL_TYPE, "model_types", model_types),
                            (GGUF_ARCHITECTURE, "gguf_architectures", gguf_architectures)):
        if isinstance(keys, str) or not isinstance(keys, (tuple, list)):
            raise PluginError(f"{where}: {arg} must be a tuple of strings, got {type(keys).__name__}")
        for key in keys:
            if not isinstance(key, str) or not key.strip():
                raise PluginError(f"{where}: {arg} holds {key!r}, not a non-empty string")
            rows.append((kind, key, install))
    if not rows:
        raise PluginError(f"{where}: the hint for {install!r} names no model type and no GGUF architecture")
    return rows


_REGISTRY: Registry | None = None


def get_registry(refresh: bool = False, *, retry_hung: bool = False) -> Registry:
    """The registry of installed plugins, built once per process.

    ``retry_hung``: import again the plugins remembered as hanging (see
    :func:`build_registry`); a registry already built is rebuilt for it.
    """
    global _REGISTRY
    if _REGISTRY is None or refresh or retry_hung:
        _REGISTRY = build_registry(retry_hung=retry_hung)
    return _REGISTRY
