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

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from lollm.errors import PluginError

#: The version of the plugin contract this lollm-core speaks. A family records
#: the version it was written for in ``Family.contract``; core refuses a family
#: whose version it does not speak, naming both. Bump it only when a change
#: would break existing plugins (a renamed hook argument, a changed ``load``
#: signature); adding optional fields or hook arguments does not need a bump.
CONTRACT_VERSION = 1

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
    """

    thinking_toggle: bool = False
    speculative_head: bool = False


@dataclass(frozen=True)
class Family:
    """One model family, as a plugin registers it.

    Fields:
      name:               short family name, e.g. ``"qwen2"``; unique among installed families.
      contract:           the plugin-contract version this family was written for
                          (:data:`CONTRACT_VERSION` of the lollm-core it was built against).
      model_types:        the ``model_type`` values of config.json it serves, e.g. ``("qwen2",)``.
      load:               ``"module:function"`` of the loader, called as
                          ``load(raw_config, weights, fmt, device, dtype, progress)``:
                          ``raw_config`` is config.json as a dict (or GGUF metadata),
                          ``weights`` a :class:`lollm.loader.TensorSource` keyed by the
                          file's own tensor names, ``fmt`` ``"safetensors"`` or ``"gguf"``,
                          ``device``/``dtype`` torch objects, ``progress`` a bool;
                          it returns a model following :class:`lollm.model.CausalLM`.
      gguf_architectures: the GGUF ``general.architecture`` values it serves.
      sampling_defaults:  defaults for keys of :data:`SAMPLING_KEYS`; generation_config.json
                          and user flags take precedence over them.
      capabilities:       optional features, see :class:`Capabilities`.
      parity_reference:   ``"module:function"`` building the transformers reference for the
                          parity gate, called as ``build(checkpoint, dtype)`` and returning a
                          callable ``ids -> (logits, hidden_states)``; ``None`` means the
                          default, ``transformers.AutoModelForCausalLM`` on the same folder.
      description:        one line for ``lollm families``.
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

    def resolve(self, attribute: str = "load") -> Callable[..., Any]:
        """Import and return the function named by ``self.load`` (or another ``module:function`` field).

        Raises PluginError naming the family and the target when it cannot be imported.
        """
        target = getattr(self, attribute)
        if target is None:
            raise PluginError(f"family {self.name!r} has no {attribute}")
        return import_target(target, what=f"{attribute} of family {self.name!r}")


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
    except Exception as exc:  # a plugin's import error of any kind
        raise PluginError(f"{what}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{what}: module {module_name!r} has no attribute {attr!r}") from None


def validate_family(family: Any, *, plugin: str) -> Family:
    """Check one registration and return it; raise PluginError naming the plugin otherwise."""
    if not isinstance(family, Family):
        raise PluginError(f"plugin {plugin!r} registered {type(family).__name__}, not a lollm.family.Family")
    if family.contract != CONTRACT_VERSION:
        raise PluginError(
            f"plugin {plugin!r}: family {family.name!r} was written for lollm plugin contract "
            f"{family.contract}, but this lollm-core speaks contract {CONTRACT_VERSION}; "
            f"install versions of lollm-core and {plugin!r} that match"
        )
    if not family.name or not family.model_types and not family.gguf_architectures:
        raise PluginError(f"plugin {plugin!r}: family {family.name!r} declares no name or no model types")
    if ":" not in family.load:
        raise PluginError(f"plugin {plugin!r}: family {family.name!r}: load must be 'module:function', got {family.load!r}")
    for key, value in family.sampling_defaults.items():
        if key not in SAMPLING_KEYS:
            raise PluginError(
                f"plugin {plugin!r}: family {family.name!r}: unknown sampling default {key!r} "
                f"(known: {', '.join(SAMPLING_KEYS)})"
            )
        if not isinstance(value, (int, float)):
            raise PluginError(f"plugin {plugin!r}: family {family.name!r}: sampling default {key!r} must be a number")
    return family
