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
import re
import stat
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pluggy

from lollm import hookspecs
from lollm.errors import DuplicateModelType, PluginError, UnknownFamily, UnknownModelType
from lollm.family import Family, validate_family

#: The first-party distribution that serves each model type, for the error when
#: none is installed (an uninstalled plugin cannot declare anything itself). A
#: hint only: routing uses the installed plugins, never this table. Each
#: first-party distribution's tests check its rows against the families it
#: registers, so the table cannot drift; third parties declare theirs with the
#: hook ``lollm_register_install_hints``.
FIRST_PARTY_MODEL_TYPES = {
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
#: The same for GGUF ``general.architecture`` values (llama.cpp's names).
FIRST_PARTY_GGUF_ARCHITECTURES = {
    "qwen2": "lollm-qwen",
    "qwen3": "lollm-qwen",
    "gemma2": "lollm-gemma",
    "gemma3": "lollm-gemma",
    "gemma4": "lollm-gemma",
    "qwen35": "lollm-qwen3_5",
    "qwen35moe": "lollm-qwen3_5",
}

#: The environment variable holding the allowlist of plugin distributions.
LOAD_PLUGINS_ENV = "LOLLM_LOAD_PLUGINS"

MODEL_TYPE = "model type"
GGUF_ARCHITECTURE = "GGUF architecture"

# PEP 508 distribution name, with optional extras for an install hint ("lollm-x[cuda]")
_DIST_NAME = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$")
_REQUIREMENT = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])(\[[A-Za-z0-9._,-]+\])?$")


def normalize_name(name: str) -> str:
    """A distribution name as PEP 503 compares them: runs of ``-``, ``_``, ``.`` become ``-``, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: The distributions of this project (PEP 503 names). They register before any other, so a
#: third-party family that takes the name of a first-party one is the one reported broken.
FIRST_PARTY_DISTRIBUTIONS = frozenset(normalize_name(d) for d in ("lollm-core", *FIRST_PARTY_MODEL_TYPES.values()))


def read_allowlist(text: str | None = None) -> dict[str, str] | None:
    """``$LOLLM_LOAD_PLUGINS`` (or ``text``) as {normalised name: name as written}; None when unset.

    Unset: every plugin loads. ``""`` (or only commas and spaces): none does.
    Raises PluginError naming the variable and the entry that is not a valid
    distribution name (a typo such as ``lollm qwen``), instead of silently
    loading nothing.
    """
    if text is None:
        text = os.environ.get(LOAD_PLUGINS_ENV)
        if text is None:
            return None
    names: dict[str, str] = {}
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        if not _DIST_NAME.match(name):
            raise PluginError(
                f"{LOAD_PLUGINS_ENV}: {name!r} is not a distribution name (the list is pip names separated "
                f"by commas, e.g. {LOAD_PLUGINS_ENV}=lollm-qwen,lollm-gemma)"
            )
        names.setdefault(normalize_name(name), name)
    return names


@dataclass(frozen=True)
class InstallHint:
    """``pip install {install}`` serves ``key`` (a model type or a GGUF architecture); ``source`` says who said so."""

    kind: str  # MODEL_TYPE or GGUF_ARCHITECTURE
    key: str
    install: str  # a pip requirement: a distribution name, with extras at most
    source: str


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


@dataclass(frozen=True)
class SkippedPlugin:
    """An installed entry point left out, never imported, because ``$LOLLM_LOAD_PLUGINS`` does not name its distribution."""

    plugin: str
    distribution: str
    version: str


@dataclass
class Registry:
    """All installed families, indexed by model type and GGUF architecture."""

    families: list[InstalledFamily] = field(default_factory=list)
    broken: list[BrokenPlugin] = field(default_factory=list)
    skipped: list[SkippedPlugin] = field(default_factory=list)
    # $LOLLM_LOAD_PLUGINS as read ({normalised: as written}), None when unset
    allowlist: dict[str, str] | None = None
    # names in the allowlist matched by no installed plugin, with why
    unmatched: list[str] = field(default_factory=list)
    hints: list[InstallHint] = field(default_factory=list)
    by_model_type: dict[str, InstalledFamily] = field(default_factory=dict)
    by_gguf_architecture: dict[str, InstalledFamily] = field(default_factory=dict)
    # a type claimed twice maps to every claimant; looked up only to raise
    conflicts: dict[str, list[InstalledFamily]] = field(default_factory=dict)

    # -- building -------------------------------------------------------
    def add(self, entry: InstalledFamily) -> None:
        if any(f.family.name == entry.family.name for f in self.families):
            other = next(f for f in self.families if f.family.name == entry.family.name)
            if normalize_name(other.distribution) in FIRST_PARTY_DISTRIBUTIONS:
                raise PluginError(
                    f"family name {entry.family.name!r} is taken by the first-party {_who(other)}; {_who(entry)} "
                    f"was not registered (a third-party family needs a name of its own)"
                )
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
    def route(self, model_type: str | None = None, *, gguf_architecture: str | None = None,
              family: str | None = None) -> InstalledFamily:
        """Return the family serving ``model_type`` (or ``gguf_architecture``).

        ``family`` (the CLI's ``--family NAME``) picks the family by name: it
        settles a type that several plugins claim, and is checked against what
        that family declares. Raises UnknownFamily (no installed family has that
        name; the installed ones are named), PluginError (the named family does
        not declare this type), UnknownModelType (naming the type, the installed
        families with their distributions, and which distribution would serve it
        when a hint is known) or DuplicateModelType (naming every claimant and
        ``--family``).
        """
        if (model_type is None) == (gguf_architecture is None):
            raise ValueError("route() needs exactly one of model_type or gguf_architecture")
        kind = MODEL_TYPE if model_type is not None else GGUF_ARCHITECTURE
        key = model_type if model_type is not None else gguf_architecture
        if family is not None:
            return self._forced(family, kind, key)
        index = self.by_model_type if model_type is not None else self.by_gguf_architecture
        claimants = self.conflicts.get(f"{kind}:{key}")
        if claimants:
            names = " and ".join(_who(c) for c in claimants)
            choices = " or ".join(repr(c.family.name) for c in claimants)
            raise DuplicateModelType(
                f"{kind} {key!r} is claimed by more than one installed plugin: {names}; "
                f"choose with --family NAME ({choices}), or leave one out with {LOAD_PLUGINS_ENV}"
            )
        if key in index:
            return index[key]
        raise UnknownModelType(self._unknown_message(kind, key))

    def family_named(self, name: str) -> InstalledFamily:
        """The installed family called ``name``; UnknownFamily naming the installed ones (and the closest name) if none is."""
        for entry in self.families:
            if entry.family.name == name:
                return entry
        names = [f.family.name for f in self.families]
        lines = [f"--family {name!r}: no installed lollm family has that name."]
        close = difflib.get_close_matches(name, names, n=1)
        if close:
            lines[0] += f" Did you mean {close[0]!r}?"
        lines += self._installed_lines()
        raise UnknownFamily("\n".join(lines))

    def _forced(self, name: str, kind: str, key: str) -> InstalledFamily:
        entry = self.family_named(name)
        declared = entry.family.model_types if kind == MODEL_TYPE else entry.family.gguf_architectures
        if key in declared:
            return entry
        others = [f.family.name for f in self.families
                  if key in (f.family.model_types if kind == MODEL_TYPE else f.family.gguf_architectures)]
        which = f"; {kind} {key!r} is declared by: {', '.join(others)}" if others else ""
        raise PluginError(
            f"--family {name!r} does not declare the checkpoint's {kind} {key!r} (it declares "
            f"{', '.join(declared) or 'none'}){which}. A family serves only what it declares: "
            f"fix the checkpoint's {'config.json model_type' if kind == MODEL_TYPE else 'general.architecture'} "
            f"or ask the family's author to declare it"
        )

    def install_hints(self, kind: str, key: str) -> list[InstallHint]:
        """What would serve ``key``: hints declared by installed plugins first, then core's first-party table."""
        found = [h for h in self.hints if h.kind == kind and h.key == key]
        table = FIRST_PARTY_MODEL_TYPES if kind == MODEL_TYPE else FIRST_PARTY_GGUF_ARCHITECTURES
        if key in table and not any(normalize_name(h.install) == normalize_name(table[key]) for h in found):
            found.append(InstallHint(kind, key, table[key], "lollm-core's table of first-party distributions"))
        return found

    def warnings(self) -> list[str]:
        """One line per ``$LOLLM_LOAD_PLUGINS`` entry that no installed plugin matches (shown, never fatal)."""
        return [f"{LOAD_PLUGINS_ENV}: {why}" for why in self.unmatched]

    def _installed_lines(self) -> list[str]:
        lines: list[str] = []
        if self.families:
            lines.append("Installed families:")
            for f in self.families:
                types = "model types: " + ", ".join(f.family.model_types)
                if f.family.gguf_architectures:
                    types += "; GGUF: " + ", ".join(f.family.gguf_architectures)
                lines.append(f"  {f.family.name} ({types}) from {f.distribution} {f.version}")
        else:
            lines.append("No family plugin is installed (only lollm-core)." if not self.skipped
                         else "No family plugin is loaded.")
        if self.skipped:
            left = ", ".join(sorted({s.distribution for s in self.skipped}))
            shown = ",".join(self.allowlist.values()) if self.allowlist else ""
            lines.append(f"Installed but left out by {LOAD_PLUGINS_ENV}={shown!r}: {left}")
        lines += self.warnings()
        for b in self.broken:
            lines.append(f"Plugin {b.plugin!r} from {b.distribution} failed to load: {b.error}")
        return lines

    def _unknown_message(self, kind: str, key: str) -> str:
        lines = [f"no installed lollm family serves {kind} {key!r}."]
        skipped = {normalize_name(s.distribution) for s in self.skipped}
        for hint in self.install_hints(kind, key):
            if normalize_name(_base_name(hint.install)) in skipped:
                lines.append(f"It is provided by the distribution {hint.install!r}, which is installed but left out "
                             f"by {LOAD_PLUGINS_ENV}: add it to the list (hint from {hint.source})")
            else:
                lines.append(f"It is provided by the distribution {hint.install!r}: pip install {hint.install} "
                             f"(hint from {hint.source})")
        return "\n".join(lines + self._installed_lines())


def _base_name(requirement: str) -> str:
    return requirement.split("[", 1)[0]


def _who(entry: InstalledFamily) -> str:
    return f"family {entry.family.name!r} of plugin {entry.plugin!r} ({entry.distribution} {entry.version})"


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
    from lollm.load.checks import seconds_from_env

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

    def register(family: Any) -> None:
        collected.append(validate_family(family, plugin=name))

    def register_hint(install: Any, *, model_types: Any = (), gguf_architectures: Any = ()) -> None:
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


def validate_install_hint(install: Any, model_types: Any, gguf_architectures: Any, *,
                          plugin: str) -> list[tuple[str, str, str]]:
    """Check one ``register(install, model_types=..., gguf_architectures=...)`` call; return ``(kind, key, install)`` rows.

    ``install`` must be a pip requirement of the plain kind a user can paste
    (a distribution name, extras at most: no versions, URLs or spaces); the
    keys tuples (or lists) of non-empty strings, at least one key in all.
    Raises PluginError naming the plugin and the bad value.
    """
    where = f"plugin {plugin!r}: lollm_register_install_hints"
    if not isinstance(install, str) or not _REQUIREMENT.match(install):
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
