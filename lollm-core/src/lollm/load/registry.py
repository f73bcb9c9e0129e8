"""The router: installed families indexed by model type and GGUF architecture, and its errors.

:mod:`lollm.load.plugins` finds and imports the plugins and fills a :class:`Registry`; the
registry only routes. An unknown type, or a type two plugins claim, is an error naming what is
installed, never a silent pick.

This module imports no torch and no model code.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field

from lollm.errors import DuplicateModelType, PluginError, UnknownFamily, UnknownModelType
from lollm.family import Family

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

#: The ``source`` of a hint from the two tables above.
FIRST_PARTY_SOURCE = "lollm-core's table of first-party distributions"

#: The environment variable holding the allowlist of plugin distributions.
LOAD_PLUGINS_ENV = "LOLLM_LOAD_PLUGINS"

MODEL_TYPE = "model type"
GGUF_ARCHITECTURE = "GGUF architecture"
#: The ``general.architecture`` of llama.cpp's mmproj files (``convert_hf_to_gguf.py --mmproj``): a vision tower
#: that goes beside a text GGUF (``--mmproj FILE``), never a model of its own.
MMPROJ_ARCHITECTURE = "clip"

# PEP 508 distribution name, with optional extras for an install hint ("lollm-x[cuda]")
_DIST_NAME = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])$")
REQUIREMENT = re.compile(r"^([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]*[A-Za-z0-9])(\[[A-Za-z0-9._,-]+\])?$")


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

    def command(self) -> str:
        """The pip command to show. First-party families ship as folders of the lollm repository, not on
        PyPI, so theirs installs the folder (``pip install ./lollm-gemma``); a plugin's hint is taken as given."""
        if self.source == FIRST_PARTY_SOURCE:
            return f"pip install ./{self.install}"
        return f"pip install {self.install}"


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
        if kind == GGUF_ARCHITECTURE and key == MMPROJ_ARCHITECTURE:
            raise UnknownModelType(
                f"this GGUF is an mmproj file (general.architecture {key!r}): it holds a vision tower, not a model. "
                "Give the text model's GGUF as the model and this file beside it with --mmproj FILE (docs/vision.md)")
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
            found.append(InstallHint(kind, key, table[key], FIRST_PARTY_SOURCE))
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
                lines.append(f"It is provided by the distribution {hint.install!r}: {hint.command()} "
                             f"(hint from {hint.source})")
        return "\n".join(lines + self._installed_lines())


def _base_name(requirement: str) -> str:
    return requirement.split("[", 1)[0]


def _who(entry: InstalledFamily) -> str:
    return f"family {entry.family.name!r} of plugin {entry.plugin!r} ({entry.distribution} {entry.version})"
