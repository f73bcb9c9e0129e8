"""``lollm new-family NAME --like FAMILY``: a new family distribution, copied from an installed family.

The project's rule is that each family reads on its own, top to bottom, and
that a reference family is there to be copied. This module does the copying
that a new author would otherwise do by hand (and get wrong in a dozen
places), and writes everything around it::

    lollm-NAME/
      pyproject.toml                 the distribution, its entry point in ``lollm.families``, a test extra
      README.md                      what was made from what, and what to edit next
      .github/workflows/ci.yml       install CPU torch, the distribution with its test extra, run pytest
      src/lollm_NAME/__init__.py     a docstring and the version
      src/lollm_NAME/plugin.py       the Family record (no torch import)
      src/lollm_NAME/NAME/           the reference family's package, names changed
        __init__.py                  its manifest: MODEL_TYPES = (MODEL_TYPE,), GGUF_ARCHITECTURES = (NAME,),
                                     REFERENCE_MODEL_TYPES, PARITY_REFERENCE added
        parity.py                    the parity reference: transformers' class of the reference's model type
      tests/test_conformance.py      the conformance kit (lollm.testing.conformance) on a tiny random
                                     checkpoint of the new model type, parity included

How the reference is found: the installed family's ``load`` string
(``"lollm_qwen.qwen2.weights:load"``) names its package (``lollm_qwen.qwen2``);
every ``.py`` file of that package folder is copied. A family that imports
another package of its distribution cannot be copied alone and is refused.
A vision family's tower (contract 3, ``Family.vision``) comes too: inside the
folder (gemma3) it is copied with it; beside it (gemma4's ``gemma4_vision*.py``,
qwen3_5's ``vision*.py``) its files go beside the copy's folder (:func:`vision_files`).
The copy's plugin declares it, and its tests run the kit's vision check.

How names change (plain text substitution on whole words, in code and docstrings alike):

    ``lollm_qwen.qwen2`` -> ``lollm_NAME.NAME``     ``lollm_qwen`` -> ``lollm_NAME``   ``lollm-qwen`` -> ``lollm-NAME``
    ``Qwen2``            -> ``Name`` (CamelCase)    ``QWEN2``      -> ``NAME``         ``qwen2``      -> ``NAME``

(``Qwen2.5`` and other version numbers are left alone.) The docstrings then
still describe the reference's sources in places: the README says so, and
reviewing them is the author's first edit.

The copy keeps whatever its reference has, the batch seam included: a reference
whose model has ``cache_layers()`` (qwen2, qwen3) gives a family that runs in
the batched engine (:mod:`lollm.engine`) and passes the kit's three engine tests
as it is; :func:`describe` prints a note when the reference has no such method.

The new family claims its own model types, never the reference's, so the copy
and the reference can be installed side by side: each of the reference's
types renamed (``qwen2`` -> ``NAME``; ``qwen3_5_text`` -> ``NAME_text`` for
``--like qwen3_5``), the first one replaced by ``MODEL_TYPE`` when given; and the GGUF
architecture ``NAME``. transformers does not know the new model types: the
manifest maps each back to the reference's (``REFERENCE_MODEL_TYPES``), the
copied ``parity.py`` builds transformers' class of that type from the same
config.json and the same weight files, and the tests write their tiny
checkpoint the same way (a real hub config of the reference type from
:mod:`lollm.cli.hub_configs`, shrunk, written by transformers, then
relabelled with the new model types, nested ``text_config`` included).

Errors (:class:`NewFamilyError`, one ``error:`` line): NAME not a lowercase
Python identifier, longer than :data:`MAX_NAME_LENGTH`, or naming a first-party
or installed distribution (:func:`check_name`); the output folder already there
in any form, a symlink included, or ``--into`` not a folder (:func:`check_into`);
a work folder that cannot be made or is a symlink, a write that fails (nothing
is left behind); FAMILY not installed (the installed ones are listed), a
reference package that is not self-contained, no hub config of the reference's
model type to test with.
"""

from __future__ import annotations

import keyword
import os
import re
import shutil
import textwrap
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import version as dist_version
from pathlib import Path

from lollm.cli.new_family_templates import (
    CI, MANIFEST_TAIL, PACKAGE_INIT, PARITY, PLUGIN, PYPROJECT, README, TESTS, TESTS_VISION, VISION_LINE,
)
from lollm.errors import LollmError
from lollm.family import CONTRACT_VERSION

# Lazy imports below: the hub configs, the plugin registry and importlib.metadata, only for the command that
# writes a family (its --help and flag checks stay light).

_NAME = re.compile(r"[a-z][a-z0-9_]*")


class NewFamilyError(LollmError):
    """``lollm new-family`` cannot write the distribution asked for (the message says why)."""


@dataclass(frozen=True)
class Rendered:
    """What :func:`render` wrote: the distribution folder and the facts the CLI prints.

    batched: the reference's model has ``cache_layers()`` (its source defines one), so the copy
    runs in the batched engine (:mod:`lollm.engine`) and passes the kit's three engine tests.
    """

    folder: Path
    name: str
    model_type: str
    like: str
    reference_package: str
    hub_config: str
    files: tuple[str, ...]
    batched: bool = True


def camel(name: str) -> str:
    """``"qwen2"`` -> ``"Qwen2"``, ``"my_llama"`` -> ``"MyLlama"``: the class-name prefix of a family."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def substitutions(ref_name: str, ref_package: str, ref_top: str, name: str) -> list[tuple[re.Pattern, str]]:
    """The ordered (pattern, replacement) pairs that rename the reference ``ref_name`` to ``name``.

    ref_package: the reference family's dotted package (``lollm_qwen.qwen2``); ref_top: its
    distribution package (``lollm_qwen``). Whole words only: a letter or digit may not touch
    either end, and a version suffix (``Qwen2.5``) is not a name.
    """
    top = f"lollm_{name}"

    def word(text: str, then: str = "A-Za-z0-9") -> re.Pattern:
        return re.compile(rf"(?<![A-Za-z0-9]){re.escape(text)}(?![{then}]|\.\d)")

    return [
        (re.compile(re.escape(ref_package)), f"{top}.{name}"),
        (word(ref_top), top),
        (word(ref_top.replace("_", "-")), f"lollm-{name}"),
        (word(camel(ref_name), then="a-z0-9"), camel(name)),  # Qwen2Config -> MineConfig
        (word(ref_name.upper(), then="A-Z0-9"), name.upper()),
        (word(ref_name), name),
    ]


def rename(text: str, subs: list[tuple[re.Pattern, str]]) -> str:
    """``text`` with every pattern of ``subs`` replaced, in one pass (earlier pairs win at a position).

    One pass, so a new name that contains the old one (``my_qwen3`` for ``qwen3``) is not renamed again.
    """
    combined = re.compile("|".join(f"(?P<s{i}>{pattern.pattern})" for i, (pattern, _) in enumerate(subs)))
    return combined.sub(lambda m: subs[int(m.lastgroup[1:])][1], text)


def _set_constant(text: str, constant: str, value: str, where: str) -> str:
    """Replace ``CONSTANT = (...)`` (one tuple, maybe over several lines) at the start of a line."""
    pattern = re.compile(rf"^{constant} = \([^)]*\)", re.MULTILINE)
    if not pattern.search(text):
        raise NewFamilyError(f"{where} has no line '{constant} = (...)'; lollm new-family needs the manifest "
                             f"constants MODEL_TYPES and GGUF_ARCHITECTURES (see lollm_qwen/qwen2/__init__.py)")
    return pattern.sub(lambda _: f"{constant} = {value}", text, count=1)


def find_hub_config(model_types: tuple[str, ...]) -> str:
    """The hub config in :mod:`lollm.cli.hub_configs` whose model_type is one of ``model_types``
    (the earlier type first), a dense one before a mixture of experts (a family may refuse the
    experts of its larger sizes: lollm's gemma4 does), then by name."""
    from lollm.cli.hub_configs import available, hub_config

    def experts(raw: dict) -> bool:
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        return bool(text.get("num_experts"))

    for type_ in model_types:
        found = []
        for hub in sorted(available()):
            try:
                raw = hub_config(hub)
            except (OSError, ValueError, LollmError):
                continue
            if raw.get("model_type") == type_:
                found.append((experts(raw), hub))
        if found:
            return min(found)[1]
    raise NewFamilyError(f"lollm.cli.hub_configs holds no config.json of model type {' or '.join(model_types)}; "
                         f"the generated tests need a real hub config of the reference architecture")


def core_range() -> str:
    """``lollm-core>=X.Y,<X.(Y+1)``: the lollm-core of this install, the range the new distribution is tested with."""
    major, minor = (int(p) for p in dist_version("lollm-core").split(".")[:2])
    return f"lollm-core>={major}.{minor},<{major}.{minor + 1}"


def render(name: str, like: str, into: Path | str = ".", *, model_type: str | None = None, registry=None) -> Rendered:
    """Write the distribution ``lollm-NAME`` into the folder ``into``; return what was written.

    name: the new family's name, a lowercase Python identifier (``[a-z][a-z0-9_]*``, not a keyword);
    like: the name of an installed family to copy; model_type: the config.json ``model_type``
    the new family claims in place of the reference's first (default: that one renamed, for
    qwen2 ``name``); registry: the plugin registry to look ``like`` up
    in (default: the installed plugins). Raises NewFamilyError (nothing is left half-written:
    the folder is built beside its target and moved in place at the end): see the module
    docstring, :func:`check_name` and :func:`check_into` for what is refused.
    """
    from lollm.load.plugins import build_registry

    check_name(name)
    if model_type is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", model_type):
        raise NewFamilyError(f"--model-type {model_type!r}: use 1 to 128 letters, digits, '_', '-' or '.'")
    into = Path(into)
    folder = into / f"lollm-{name}"
    check_into(into, folder)

    registry = registry or build_registry()
    installed = {entry.family.name: entry for entry in registry.families}
    if like not in installed:
        names = ", ".join(sorted(installed)) or "none"
        raise NewFamilyError(f"--like {like!r}: no installed family has that name (installed: {names})")
    entry = installed[like]
    if name in installed:
        raise NewFamilyError(f"NAME {name!r} is already the name of an installed family ({installed[name].distribution}); "
                             f"choose another")
    family = entry.family

    # 1. The reference package: the load string names a module inside it.
    module = family.load.split(":")[0]
    ref_package = module.rsplit(".", 1)[0]
    ref_top = ref_package.split(".")[0]
    if "." not in ref_package:
        raise NewFamilyError(f"family {like!r} loads from {module!r}, a module not inside a family package; "
                             f"lollm new-family copies a package such as lollm_qwen.qwen2")
    package = import_module(ref_package)
    source = Path(package.__file__).parent
    files = sorted(p for p in source.glob("*.py"))
    inner = re.escape(ref_package.split(".", 1)[1])
    others = re.compile(rf"^\s*(?:from|import)\s+{re.escape(ref_top)}(?:\.(?!{inner}\b)\w+|\s+import)", re.MULTILINE)
    outside = re.compile(r"^\s*from\s+\.\.", re.MULTILINE)  # a relative import above the family folder
    for path in files:
        text = path.read_text(encoding="utf-8")
        hit = others.search(text) or outside.search(text)
        if hit:
            raise NewFamilyError(f"{path} uses {hit.group(0)}, outside the family package {ref_package}; "
                                 f"a family copied with lollm new-family must be self-contained")
    # the new model types: the reference's renamed (qwen2 -> NAME), the first one MODEL_TYPE when given
    subs = substitutions(like, ref_package, ref_top, name)
    types = {old: rename(old, subs) for old in family.model_types}
    if model_type is not None:
        types[family.model_types[0]] = model_type
    if len(set(types.values())) != len(types):
        raise NewFamilyError(f"--model-type {model_type!r} equals another of the new model types {sorted(types.values())}")
    claimed = {t: e.family.name for e in registry.families for t in e.family.model_types}
    for new in types.values():
        if new in claimed:
            raise NewFamilyError(f"model type {new!r} is already claimed by the installed family {claimed[new]!r}; "
                                 f"give the new family its own (--model-type)")
    model_type = types[family.model_types[0]]
    hub = find_hub_config(family.model_types)

    vision = vision_files(family, ref_package, ref_top)

    # 2. Build the distribution in a sibling folder, then move it in place (no half-written output).
    written = _write_in_place(into, folder, name=name, types=types, like=like, family=family, entry=entry,
                              ref_package=ref_package, ref_top=ref_top, files=files, hub=hub, vision=vision)
    batched = any(re.search(r"^\s+def cache_layers\(", p.read_text(encoding="utf-8"), re.MULTILINE) for p in files)
    return Rendered(folder=folder, name=name, model_type=model_type, like=like, reference_package=ref_package,
                    hub_config=hub, files=tuple(written), batched=batched)


def vision_files(family, ref_package: str, ref_top: str) -> list[Path]:
    """The vision modules of the reference that lie beside its family folder, which the copy takes too.

    ``family.vision`` (contract 3, ``"module:function"``) names the tower's module: inside the family
    package (gemma3's ``lollm_gemma.gemma3.vision``) it is copied with the folder, and this returns [];
    beside it, in the distribution's package (gemma4's ``lollm_gemma.gemma4_vision_contract``, qwen3_5's
    ``lollm_qwen3_5.vision_family``), this returns that module's file and every sibling module it
    imports relatively (``from .gemma4_vision import ...``), in turn; the copy keeps them beside its
    own folder, so their imports (``from .gemma4.blocks``, renamed ``from .NAME.blocks``) still hold.
    [] for a family without vision. NewFamilyError for a tower that imports another family's folder or
    lies outside the distribution's package: the copy could not stand alone.
    """
    if family.vision is None or family.vision.startswith(f"{ref_package}."):
        return []
    module = family.vision.split(":")[0]
    if module.rsplit(".", 1)[0] != ref_top:
        raise NewFamilyError(f"family {family.name!r} loads its vision tower from {module!r}, outside {ref_top}; "
                             f"lollm new-family copies a tower kept in the family's own distribution package")
    top = Path(import_module(ref_top).__file__).parent
    folder = ref_package.split(".", 1)[1]
    found, todo = [], [module.rsplit(".", 1)[1]]
    while todo:
        path = top / f"{todo.pop()}.py"
        if path in found:
            continue
        found.append(path)
        for sibling in re.findall(r"^\s*from\s+\.(\w+)", path.read_text(encoding="utf-8"), re.MULTILINE):
            if (top / f"{sibling}.py").is_file():
                todo.append(sibling)
            elif sibling != folder:
                raise NewFamilyError(f"{path} imports .{sibling}, another part of {ref_top} than the family folder "
                                     f"{folder}/; the vision tower of a copied family must be self-contained")
    return sorted(found)


#: The longest NAME accepted. NAME appears up to four times in one generated path
#: (``lollm-NAME/src/lollm_NAME/NAME/modeling_NAME.py``: 4 x NAME + 31 characters), so
#: 40 keeps the deepest file within 191 characters of the target folder, leaving room
#: under Windows' 260-character MAX_PATH for where it is written; every real family
#: name is a dozen characters or less (``qwen3_5_moe`` is 11).
MAX_NAME_LENGTH = 40


def check_name(name: str) -> None:
    """Refuse a NAME ``lollm new-family`` must not write; raises NewFamilyError saying why.

    Refused: a NAME that is not a lowercase Python identifier (``[a-z][a-z0-9_]*``,
    not a keyword) or that ends in ``_`` (``lollm-mine_`` is no distribution
    name, PEP 508); one longer than :data:`MAX_NAME_LENGTH`; one whose
    distribution ``lollm-NAME`` is a first-party distribution (``core``,
    ``qwen``, ``gemma``, ``qwen3_5``) or any installed distribution, compared
    after PEP 503 normalisation (installing the copy would replace it); one whose
    package ``lollm_NAME`` can already be imported.
    """
    from importlib.metadata import distributions
    from importlib.util import find_spec

    from lollm.load.registry import FIRST_PARTY_DISTRIBUTIONS, normalize_name

    shown = name if len(name) <= 60 else name[:60] + "…"
    if not _NAME.fullmatch(name) or keyword.iskeyword(name) or name.endswith("_"):
        raise NewFamilyError(f"NAME {shown!r} is not a valid family name: use a lowercase Python identifier "
                             f"([a-z][a-z0-9_]*, not a keyword, not ending in '_'), e.g. 'mine' or 'llama'")
    if len(name) > MAX_NAME_LENGTH:
        raise NewFamilyError(f"NAME {shown!r} has {len(name)} characters; use at most {MAX_NAME_LENGTH} (it is "
                             f"repeated in the paths of the files written)")
    dist = normalize_name(f"lollm-{name}")
    if dist in FIRST_PARTY_DISTRIBUTIONS:
        raise NewFamilyError(f"NAME {name!r} would write the distribution lollm-{name}, the name of a lollm "
                             f"distribution (installing the copy would replace it); choose another NAME")
    for installed in distributions():
        try:
            other = str(installed.metadata["Name"] or "")
        except Exception:  # unreadable metadata of a broken installation: not a name to compare
            continue
        if normalize_name(other) == dist:
            raise NewFamilyError(f"NAME {name!r} would write the distribution lollm-{name}, and {other} "
                                 f"{installed.version} is installed (installing the copy would replace it); "
                                 f"choose another NAME")
    try:
        taken = find_spec(f"lollm_{name}") is not None
    except (ImportError, ValueError):  # a module of that name is half-imported: taken all the same
        taken = True
    if taken:
        raise NewFamilyError(f"NAME {name!r}: a package lollm_{name} is already importable here; choose another NAME")


def check_into(into: Path, folder: Path) -> None:
    """Refuse a target ``lollm new-family`` cannot write cleanly; raises NewFamilyError naming the path.

    ``into`` must be a folder (or not exist yet, below a folder); ``folder``
    (``into/lollm-NAME``) must not exist in any form, a dangling symlink included.
    """
    if os.path.lexists(folder):
        kind = "a symlink" if folder.is_symlink() else "a folder" if folder.is_dir() else "a file"
        raise NewFamilyError(f"{folder} already exists ({kind}); remove it or choose another NAME or --into")
    probe = into
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise NewFamilyError(f"--into {into}: {probe} is not a folder")


def _write_in_place(into: Path, folder: Path, **kwargs) -> list[str]:
    """Write the distribution (:func:`_write`, ``kwargs``) in a work folder, then rename it to ``folder``.

    On any failure the work folder is removed and nothing is left; an OSError
    (a full disk, a read-only folder, a target that appeared meanwhile) is a
    NewFamilyError naming the path. Returns the files written, relative to ``folder``.
    """
    work = _work_folder(into, kwargs["name"])
    try:
        written = _write(work, **kwargs)
        if os.path.lexists(folder):  # appeared while we wrote (a symlink, a file, a folder)
            raise NewFamilyError(f"{folder} appeared while lollm new-family was writing; nothing was written")
        os.rename(work, folder)
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise NewFamilyError(f"cannot write {folder}: {exc.strerror or exc} ({exc.filename or work}); "
                             f"nothing was written") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return written


def _work_folder(into: Path, name: str) -> Path:
    """Make the empty folder ``into/.lollm-NAME.partial`` the distribution is written in; return it.

    Created with ``mkdir`` (which never follows an existing symlink). A leftover
    folder of an interrupted run is removed first; a symlink or a file of that
    name is refused, never followed or removed. Raises NewFamilyError naming
    the path when it cannot be made (an unwritable or read-only folder).
    """
    work = into / f".lollm-{name}.partial"
    try:
        into.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(work):
            if work.is_symlink() or not work.is_dir():
                raise NewFamilyError(f"{work} exists and is {'a symlink' if work.is_symlink() else 'not a folder'}; "
                                     f"lollm new-family writes there first: remove it")
            shutil.rmtree(work)  # a leftover of an interrupted run (rmtree removes links inside, never follows them)
        os.mkdir(work)
    except OSError as exc:
        raise NewFamilyError(f"--into {into}: cannot make {work}: {exc.strerror or exc}; nothing was written") from None
    return work


def _write(work: Path, *, name, types, like, family, entry, ref_package, ref_top, files, hub, vision) -> list[str]:
    from lollm.cli.hub_configs import hub_config

    model_type = types[family.model_types[0]]
    ref_model_type = hub_config(hub)["model_type"]
    new_types = tuple(types.values())
    back = {new: old for old, new in types.items()}
    subs = substitutions(like, ref_package, ref_top, name)
    top = f"lollm_{name}"
    dist = f"lollm-{name}"
    pkg = work / "src" / top / name
    pkg.mkdir(parents=True)
    written: list[str] = []

    def put(rel: str, text: str) -> None:
        path = work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(rel)

    # the family package, renamed
    for path in files:
        text = rename(path.read_text(encoding="utf-8"), subs)
        target = rename(path.name, subs)
        if path.name == "__init__.py":
            text = _set_constant(text, "MODEL_TYPES", repr(new_types), f"{path}")
            text = _set_constant(text, "GGUF_ARCHITECTURES", f"({name!r},)", f"{path}")
            text = text.rstrip("\n") + "\n\n" + MANIFEST_TAIL.format(
                like=like, ref_package=ref_package, dist=entry.distribution, version=entry.version,
                back=back, top=top, name=name) + "\n"
        put(f"src/{top}/{name}/{target}", text)
    for path in vision:  # the tower beside the family folder (gemma4, qwen3_5): beside the copy's folder too
        put(f"src/{top}/{rename(path.name, subs)}", rename(path.read_text(encoding="utf-8"), subs))
    put(f"src/{top}/{name}/parity.py", PARITY.format(name=name))
    put(f"src/{top}/__init__.py", PACKAGE_INIT.format(name=name, dist=dist, like=like))
    caps = family.capabilities
    cap_args = ", ".join(f"{k}=True" for k in ("thinking_toggle", "speculative_head", "vision") if getattr(caps, k, False))
    has_vision = family.vision is not None  # contract 3: the manifest's VISION, renamed, names the copied tower
    put(f"src/{top}/plugin.py", PLUGIN.format(name=name, top=top, caps=cap_args, contract=CONTRACT_VERSION,
                                              vision=VISION_LINE.format(name=name) if has_vision else ""))
    core = core_range()
    put("pyproject.toml", PYPROJECT.format(dist=dist, name=name, top=top, like=like, core=core,
                                           core_test=core.replace("lollm-core", "lollm-core[parity,test]")))
    put("README.md", README.format(dist=dist, name=name, top=top, like=like, model_type=model_type, ref_package=ref_package,
                                   ref_model_type=ref_model_type, hub=hub, ref_dist=entry.distribution,
                                   contract=CONTRACT_VERSION))
    put(".github/workflows/ci.yml", CI.format(dist=dist))
    put("tests/test_conformance.py", TESTS.format(name=name, top=top, hub=hub, camel=camel(name),
                                                  vision=TESTS_VISION.format(like=like) if has_vision else ""))
    leftover = [rel for rel in written if rel.endswith(".py") and re.search(rf"^\s*(from|import)\s+{re.escape(ref_top)}\b",
                                                                           (work / rel).read_text(), re.MULTILINE)]
    if leftover:
        raise NewFamilyError(f"the copy still names {ref_top} in {', '.join(leftover)}; it would not import alone")
    return written


def describe(rendered: Rendered) -> str:
    """The lines ``lollm new-family`` prints after writing (a note when the copy cannot run batched)."""
    text = textwrap.dedent(f"""\
        wrote {rendered.folder}/ ({len(rendered.files)} files): family {rendered.name!r}, model type {rendered.model_type!r},
        copied from {rendered.like!r} ({rendered.reference_package}); tests use the hub config {rendered.hub_config}
        next:
          pip install -e "{rendered.folder}[test]"
          pytest {rendered.folder}/tests""")
    if not rendered.batched:
        text += (f"\nnote: {rendered.like!r} has no cache_layers() yet, so the copy cannot run in the batched engine: "
                 f"the kit's three engine tests fail until you add the batch seam (lollm's docs/plugins.md, \"Running batched\")")
    return text
