"""The Family record: everything core needs to know about one model family.

A plugin describes each family it ships with one :class:`Family` and hands it
to core through the ``lollm_register_families`` hook (see
:mod:`lollm.hookspecs`). The record is plain data: the functions it points to
are given as ``"package.module:function"`` strings, so that listing the
installed families (``lollm families``) imports no model code and no torch.
Core imports them only when a model of that family is actually loaded
(:meth:`Family.resolve`).

This module must stay importable without torch.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import sys
import traceback
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from lollm.errors import GenerationError, LollmError, PluginError
from lollm.sampling_params import check_sampling_value

#: The version of the plugin contract this lollm-core speaks. A family records
#: the version it was written for in ``Family.contract``; core refuses a family
#: whose version it does not speak, naming both and what to change. Bump it only
#: when a change would break existing plugins (a renamed hook argument, a changed
#: ``load`` signature); adding optional fields or hook arguments does not need a bump.
#:
#: Contract 2 (this one): ``load(checkpoint, options)`` with a :class:`lollm.load.options.LoadOptions`.
#: "Contract 3: vision" (docs/vision.md) adds, optionally, ``Capabilities(vision=True)`` and
#: ``Family.vision``; added optional fields, so the version stays 2 and text families change nothing.
#: Contract 1 was ``load(raw_config, weights, fmt, device, dtype, progress)``, with the
#: quantization and the tensor-parallel group set as attributes on ``weights``.
CONTRACT_VERSION = 2

#: What a plugin written for an older contract must change, by the version it speaks.
CONTRACT_CHANGES = {
    1: ("contract 2 calls load(checkpoint, options): read config, weights and fmt from the "
        "lollm.load.loader.Checkpoint, and device, dtype, quantization and tensor_parallel from the "
        "lollm.load.options.LoadOptions (nothing is set on the weights any more); lollm.load.build.build_model "
        "does the meta build, the --tp share and the streaming load. Then set contract=2. "
        "See docs/plugins.md, 'Moving a family to contract 2'"),
}

#: Sampling settings a family may give defaults for, with their types.
SAMPLING_KEYS = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
}


@dataclass(frozen=True)
class Capabilities:
    """Optional features a family supports; the CLI refuses flags the family lacks.

    thinking_toggle:  the family's chat templates read ``enable_thinking`` (informational: ``lollm families``
                      lists it; ``--think`` / ``--no-think`` are decided from the checkpoint's own template,
                      see :meth:`lollm.tokenizer.Tokenizer.chat_template_reads`).
    speculative_head: the checkpoint may carry a draft head for self-speculative decoding (``--mtp``).
    vision:           the family's checkpoints may carry a vision tower, loaded by ``Family.vision``
                      (contract 3: vision, docs/vision.md); ``--image`` and image content need it.
    """

    thinking_toggle: bool = False
    speculative_head: bool = False
    vision: bool = False


@dataclass(frozen=True)
class Family:
    """One model family, as a plugin registers it.

    Fields:
      name:               short family name, e.g. ``"qwen2"``; unique among installed families.
      contract:           the plugin-contract version this family was written for
                          (:data:`CONTRACT_VERSION` of the lollm-core it was built against).
      model_types:        the ``model_type`` values of config.json it serves, e.g. ``("qwen2",)``.
      load:               ``"module:function"`` of the loader, called as ``load(checkpoint, options)``:
                          ``checkpoint`` a :class:`lollm.load.loader.Checkpoint` (``.config``: config.json
                          as a dict or the GGUF metadata; ``.weights``: a TensorSource keyed by the
                          file's own tensor names; ``.fmt``: ``"safetensors"`` or ``"gguf"``),
                          ``options`` the resolved :class:`lollm.load.options.LoadOptions` (device,
                          dtype, quantization, tensor_parallel, progress); it returns a model
                          following :class:`lollm.model.CausalLM`, usually through
                          :func:`lollm.load.build.build_model`.
      gguf_architectures: the GGUF ``general.architecture`` values it serves.
      sampling_defaults:  defaults for keys of :data:`SAMPLING_KEYS`; generation_config.json
                          and user flags take precedence over them.
      capabilities:       optional features, see :class:`Capabilities`.
      parity_reference:   ``"module:function"`` building the transformers reference for the
                          parity gate, called as ``build(checkpoint, dtype)`` and returning a
                          callable ``ids -> (logits, hidden_states)``; ``None`` means the
                          default, ``transformers.AutoModelForCausalLM`` on the same folder.
      vision:             ``"module:function"`` of the vision-tower loader (contract 3: vision), called as
                          ``load_vision(checkpoint, options)`` on the same checkpoint and options as ``load``;
                          it returns a :class:`lollm.vision.spec.VisionTower`, or None when this checkpoint
                          has no tower. Given exactly when ``capabilities.vision`` is True.
      description:        one line for ``lollm families``.
      registered_by:      set by core when it registers the family (``"plugin 'qwen' (lollm-qwen 0.1.0)"``),
                          for error messages; a plugin leaves it empty. Not compared.
    """

    name: str
    contract: int
    model_types: tuple[str, ...]
    load: str
    gguf_architectures: tuple[str, ...] = ()
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    capabilities: Capabilities = Capabilities()
    parity_reference: str | None = None
    description: str = ""
    vision: str | None = None
    registered_by: str = field(default="", compare=False)

    def resolve(self, attribute: str = "load") -> Callable[..., Any]:
        """Import the function named by ``self.load`` (or another ``module:function`` field); return it, guarded.

        Raises PluginError naming the family, the plugin that registered it and
        the target when it cannot be imported. The function returned calls the
        plugin's own and turns any exception it raises, other than a LollmError
        (which already speaks to the user) and a KeyboardInterrupt, into one
        PluginError naming the same, the exception and the plugin's line it came
        from (:func:`guard_plugin_call`).
        """
        target = getattr(self, attribute)
        what = f"{attribute} of family {self.name!r}" + (f" of {self.registered_by}" if self.registered_by else "")
        if target is None:
            raise PluginError(f"family {self.name!r} has no {attribute}")
        return guard_plugin_call(import_target(target, what=what), what=f"{what} ({target})")


#: Set (to anything but ``""`` or ``0``) to let an exception raised inside a plugin's
#: function propagate with its traceback instead of the one-line PluginError.
DEBUG_ENV = "LOLLM_DEBUG"


def debugging() -> bool:
    """Whether ``$LOLLM_DEBUG`` asks for tracebacks (set, and not ``""`` or ``0``)."""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def guard_plugin_call(fn: Callable[..., Any], *, what: str) -> Callable[..., Any]:
    """``fn`` wrapped so that a plugin's failure is one PluginError line, not a traceback.

    A LollmError and a KeyboardInterrupt pass unchanged; any other exception
    (``SystemExit`` included) becomes PluginError(``"{what} failed: Type:
    message (at file.py:line, in function); set LOLLM_DEBUG=1 for the traceback"``),
    the original kept as its ``__cause__``. With ``$LOLLM_DEBUG`` set the
    original exception propagates as it is, traceback and all.
    """
    @functools.wraps(fn)
    def call(*args: object, **kwargs: object) -> Any:
        try:
            return fn(*args, **kwargs)
        except LollmError:
            raise
        except (Exception, SystemExit) as exc:
            if debugging():
                raise
            text = " ".join(str(exc).split())
            text = text if len(text) <= 500 else text[:500] + " …"
            raise PluginError(f"{what} failed: {type(exc).__name__}: {text}{_where(exc, fn)}; "
                              f"set {DEBUG_ENV}=1 for the traceback") from exc

    return call


def _where(exc: BaseException, fn: Callable[..., Any]) -> str:
    """`` (at FILE:LINE, in FUNCTION)``: the innermost frame of the traceback in ``fn``'s top-level package, or ``""``.

    The plugin's own line is what its author needs; a frame inside torch says less.
    """
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # the first is the guard's own call
    top = sys.modules.get((getattr(fn, "__module__", None) or "").split(".")[0])
    where = getattr(top, "__file__", None)
    if not where:
        ours = []
    elif hasattr(top, "__path__"):  # a package: any of its files
        root = os.path.dirname(where) + os.sep
        ours = [f for f in frames if f.filename.startswith(root)]
    else:  # a single module
        ours = [f for f in frames if f.filename == where]
    if not (ours or frames):
        return ""
    last = (ours or frames)[-1]
    return f" (at {last.filename}:{last.lineno}, in {last.name})"


def import_target(target: str, *, what: str) -> Callable[..., Any]:
    """Import ``"package.module:function"`` and return the function.

    Raises PluginError naming ``what`` and the target on a malformed string,
    an import failure (with its cause) or a missing attribute.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"{what}: {target!r} is not of the form 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # a plugin's import error of any kind, sys.exit() included
        raise PluginError(f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{what}: module {module_name!r} has no attribute {attr!r}") from None


#: ``"package.module:function"``: dotted Python identifiers, one colon, an identifier.
_TARGET = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def validate_family(family: object, *, plugin: str) -> Family:
    """Check one registration field by field and return a clean copy; raise PluginError naming the plugin otherwise.

    A plugin is third-party code, so every field is checked for its type, not
    only its presence: ``model_types="qwen2"`` (a string would claim the
    one-letter types q, w, e, n, 2), ``None`` where a tuple or a record is
    expected, sampling defaults that are not numbers of the right kind and
    range. The copy holds plain tuples, a plain dict and a plain
    :class:`Capabilities`, so nothing the plugin keeps a reference to can
    change it later.
    """
    if not isinstance(family, Family):
        raise PluginError(f"plugin {plugin!r} registered {type(family).__name__}, not a lollm.family.Family")
    name = family.name
    if not isinstance(name, str) or not name.strip():
        raise PluginError(f"plugin {plugin!r}: a family's name must be a non-empty string, got {name!r}")
    where = f"plugin {plugin!r}: family {name!r}"
    if isinstance(family.contract, bool) or not isinstance(family.contract, int):
        raise PluginError(f"{where}: contract must be an int (lollm.family.CONTRACT_VERSION), got {family.contract!r}")
    if family.contract != CONTRACT_VERSION:
        change = CONTRACT_CHANGES.get(family.contract, f"install versions of lollm-core and {plugin!r} that match")
        raise PluginError(
            f"plugin {plugin!r}: family {name!r} was written for lollm plugin contract "
            f"{family.contract}, but this lollm-core speaks contract {CONTRACT_VERSION}: {change}"
        )
    model_types = _names(family.model_types, "model_types", where)
    gguf_architectures = _names(family.gguf_architectures, "gguf_architectures", where)
    if not model_types and not gguf_architectures:
        raise PluginError(f"{where} declares no model types and no GGUF architectures")
    load = _target(family.load, "load", where)
    parity_reference = None if family.parity_reference is None else _target(family.parity_reference, "parity_reference", where)
    vision = None if family.vision is None else _target(family.vision, "vision", where)
    capabilities = _capabilities(family.capabilities, where)
    if capabilities.vision != (vision is not None):
        raise PluginError(f"{where}: capabilities.vision is {capabilities.vision} but vision is {vision!r}: "
                          "a family with a vision tower sets both (docs/vision.md), a text family neither")
    if not isinstance(family.description, str):
        raise PluginError(f"{where}: description must be a string, got {type(family.description).__name__}")
    return Family(
        name=name,
        contract=family.contract,
        model_types=model_types,
        load=load,
        gguf_architectures=gguf_architectures,
        sampling_defaults=_sampling_defaults(family.sampling_defaults, where),
        capabilities=capabilities,
        parity_reference=parity_reference,
        description=family.description,
        vision=vision,
    )


def _names(value: object, key: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise PluginError(
            f"{where}: {key} must be a tuple of strings, got the string {value!r} "
            f"(write ({value!r},) with the comma; a bare string would claim each of its letters)"
        )
    if not isinstance(value, (tuple, list)):
        raise PluginError(f"{where}: {key} must be a tuple of strings, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise PluginError(f"{where}: {key} must hold non-empty strings, got {item!r}")
    if len(set(value)) != len(value):
        raise PluginError(f"{where}: {key} lists a name twice: {list(value)}")
    return tuple(value)


def _target(value: object, key: str, where: str) -> str:
    if not isinstance(value, str) or not _TARGET.match(value):
        raise PluginError(f"{where}: {key} must be 'module:function', got {value!r}")
    return value


def _sampling_defaults(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, MappingABC):
        raise PluginError(f"{where}: sampling_defaults must be a dict, got {type(value).__name__}")
    checked: dict[str, Any] = {}
    for key, number in value.items():
        if key not in SAMPLING_KEYS:
            raise PluginError(f"{where}: unknown sampling default {key!r} (known: {', '.join(SAMPLING_KEYS)})")
        try:
            check_sampling_value(key, number)
        except GenerationError as exc:
            raise PluginError(f"{where}: sampling default {key!r}: {exc}") from None
        checked[key] = SAMPLING_KEYS[key](number)
    return checked


def _capabilities(value: object, where: str) -> Capabilities:
    if not isinstance(value, Capabilities):
        raise PluginError(f"{where}: capabilities must be a lollm.family.Capabilities, got {type(value).__name__}")
    flags = {}
    for f in fields(Capabilities):
        flag = getattr(value, f.name)
        if not isinstance(flag, bool):
            raise PluginError(f"{where}: capabilities.{f.name} must be True or False, got {flag!r}")
        flags[f.name] = flag
    return Capabilities(**flags)
