"""Checked reads of the values a checkpoint carries: config.json keys, GGUF metadata, tensor sizes.

A checkpoint downloaded from anywhere is untrusted in all of its parts. A
family therefore reads every config value through a :class:`ConfigReader`,
which checks its type and range where it is read and raises
:class:`lollm.errors.ConfigError` naming the file, the key and the bad value::

    read = ConfigReader(raw, "qwen2: config.json")
    layers = read.positive_int("num_hidden_layers", at_most=MAX_LAYERS)
    theta = read.number("rope_theta", above=1.0)
    tied = read.boolean("tie_word_embeddings", default=False)
    # ConfigError: qwen2: config.json 'num_hidden_layers' is 0: expected an integer from 1 to 4096

The same reader serves GGUF metadata (``ConfigReader(metadata, "qwen2: GGUF
metadata")``, keys such as ``"qwen2.block_count"``): the file's typed values
are checked the same way.

Rules, the same for every key:

* JSON ``null`` counts as absent (transformers writes ``null`` for "use the
  default"): the default is returned, or ConfigError when the key is required.
* ``true``/``false`` are booleans only: never numbers (Python's ``True == 1``
  is not taken), and a boolean key never accepts ``0``, ``1`` or ``"true"``.
* Numbers are finite (no NaN, no infinity); integers are JSON integers (``2.0``
  is refused for a count).

Upper bounds (far above every released model, low enough that a loop over
them or a module built from them ends at once):

=================  ====================  ==========================================
bound              value                 used for
=================  ====================  ==========================================
MAX_LAYERS         4,096                 decoder layers
MAX_WIDTH          1,048,576 (2**20)     widths: hidden, MLP, head dim, expert width
MAX_HEADS          65,536 (2**16)        attention heads, KV heads, experts
MAX_VOCAB          16,777,216 (2**24)    vocabulary rows, token ids
MAX_CONTEXT        16,777,216 (2**24)    max_position_embeddings, sliding window
MAX_ROPE_FACTOR    1,024 (2**10)         a RoPE scaling 'factor' (at least 1); YaRN's betas and
                                         Llama 3's low/high_freq_factor (at least 2**-10)
MAX_ROPE_SCALE     16                    what multiplies cos and sin: YaRN's attention_factor,
                                         mscale, mscale_all_dim (at least 2**-10)
MAX_ROPE_THETA     1e16                  a RoPE base: rope_theta, GGUF rope.freq_base (above 1)
=================  ====================  ==========================================

The RoPE bounds hold every published model with room to spare: scaling factors run from
4 (Qwen's YaRN) through 8 (Gemma 3, Llama 3.1) and 32 (Llama 3.2) to 512 (LongRoPE's
2,048k-token Llama 2); YaRN's betas are 32 and 1, Llama 3's frequency factors 1 and 4,
the multipliers of cos and sin near 1 (0.707 to 1.4); RoPE bases run from 10,000 to 1e7
(Qwen3.5), a few 1e9 for the million-token Llama 3 fine-tunes. A factor below 1 would
shrink the context (transformers warns that it is invalid). Past the bounds the numbers
stop meaning anything: a linear factor of 1e-300 turns every position into infinity and
the logits into NaN, a base past float32's 3.4e38 overflows to infinity.

These bounds only stop absurd values early. The real check of a size is
against the weights: :class:`WeightTable` compares the numbers of layers,
the vocabulary and the widths with the checkpoint's tensor table (names and
shapes, read from the file headers without reading any data), so that no
module is built, even on the meta device, that the weight files do not back.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

from lollm.errors import ConfigError, LollmError, WeightsError

MAX_LAYERS = 4096
MAX_WIDTH = 1 << 20
MAX_HEADS = 1 << 16
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 24
MAX_ROPE_FACTOR = 1024.0
MAX_ROPE_SCALE = 16.0
MAX_ROPE_THETA = 1e16
MIN_ROPE_KNOB = 2.0**-10

#: Marks a key without a default: absent (or null) raises.
REQUIRED: object = object()


def show(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a bad value may be a megabyte of junk)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def seconds_from_env(name: str, default: float, maximum: float, *, error: type[LollmError] = LollmError,
                     environ: Mapping[str, str] | None = None) -> float:
    """A duration in seconds from the environment variable ``name`` (``default`` when unset or empty).

    ``environ`` defaults to ``os.environ``. Raises ``error`` naming the variable
    for text that is not a number, and for a number outside (0, ``maximum``]:
    ``nan``, ``inf`` (``1e309`` reads as inf), zero and negative values included.
    Used for ``LOLLM_PLUGIN_IMPORT_TIMEOUT`` and the tensor-parallel timeouts.
    """
    text = (os.environ if environ is None else environ).get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise error(f"{name} must be a number of seconds, got {text!r}") from None
    if not 0 < value <= maximum:  # False for nan too
        raise error(f"{name} must be more than 0 and at most {maximum:g} seconds, got {text!r}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ConfigReader:
    """Typed, range-checked reads of one dict of settings (a config.json object or GGUF metadata).

    raw:      the dict (anything else raises ConfigError naming ``where``).
    where:    how an error names the place, e.g. ``"qwen2: config.json"``,
              ``"gemma3: config.json 'text_config'"`` or ``"qwen2: GGUF metadata"``.
    defaults: values for the keys ``raw`` leaves out (a family's copy of transformers'
              defaults), merged under ``raw`` and checked like the rest.

    Every method takes the key and an optional ``default`` (returned when the
    key is absent or null; without one the key is required) and raises
    ConfigError naming ``where``, the key and the value when the value is of the
    wrong type or out of range.
    """

    def __init__(self, raw: object, where: str, defaults: Mapping[str, object] | None = None):
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} is {show(raw)}: expected an object of settings")
        self.raw = {**defaults, **raw} if defaults else raw
        self.where = where

    # -- the building blocks -------------------------------------------------
    def fail(self, message: str) -> ConfigError:
        """A ConfigError whose message starts with ``where`` (for the checks a family writes itself)."""
        return ConfigError(f"{self.where} {message}")

    def check(self, condition: bool, message: str) -> None:
        """ConfigError ``"{where} {message}"`` unless ``condition`` holds (a consistency rule between keys)."""
        if not condition:
            raise self.fail(message)

    def has(self, key: str) -> bool:
        """Whether ``key`` is present and not null."""
        return self.raw.get(key) is not None

    def value(self, key: str, default: object = REQUIRED) -> Any:
        """The raw value of ``key``, unchecked; ``default`` when absent or null (ConfigError when required)."""
        value = self.raw.get(key)
        if value is None:
            if default is REQUIRED:
                raise self.fail(f"has no {key!r}, which the model needs")
            return default
        return value

    def _present(self, key: str, default: object) -> bool:
        """Whether ``key`` has a value to check; False (use the default) when it is absent or null."""
        if self.raw.get(key) is not None:
            return True
        if default is REQUIRED:
            raise self.fail(f"has no {key!r}, which the model needs")
        return False

    def _bad(self, key: str, value: object, expected: str) -> ConfigError:
        return self.fail(f"{key!r} is {show(value)}: expected {expected}")

    # -- numbers -------------------------------------------------------------
    def integer(self, key: str, default: object = REQUIRED, *, at_least: int = 0, at_most: int) -> int:
        """An integer in ``at_least .. at_most`` (a JSON integer: not a boolean, not ``2.0``)."""
        if not self._present(key, default):
            return default
        value = self.raw[key]
        if not _is_int(value) or not at_least <= value <= at_most:
            raise self._bad(key, value, f"an integer from {at_least} to {at_most}")
        return value

    def positive_int(self, key: str, default: object = REQUIRED, *, at_most: int) -> int:
        """An integer in ``1 .. at_most`` (a count or a width)."""
        return self.integer(key, default, at_least=1, at_most=at_most)

    def number(
        self,
        key: str,
        default: object = REQUIRED,
        *,
        above: float | None = None,
        at_least: float | None = None,
        at_most: float | None = None,
    ) -> float:
        """A finite number (int or float, never a boolean), as a float, within the given bounds.

        above: strictly greater than this; at_least / at_most: the closed bounds.
        """
        if not self._present(key, default):
            return default
        value = self.raw[key]
        ok = _is_number(value) and math.isfinite(value)
        ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
        ok = ok and (at_most is None or value <= at_most)
        if not ok:
            bounds = [f"> {above}" if above is not None else "", f">= {at_least}" if at_least is not None else "",
                      f"<= {at_most}" if at_most is not None else ""]
            where = " and ".join(b for b in bounds if b)
            raise self._bad(key, value, "a finite number" + (f" {where}" if where else ""))
        return float(value)

    # -- RoPE ----------------------------------------------------------------
    def rope_theta(self, key: str, default: object = REQUIRED) -> float:
        """A RoPE base (``rope_theta``, GGUF ``rope.freq_base``): a finite number above 1 and at most
        :data:`MAX_ROPE_THETA`."""
        return self.number(key, default, above=1.0, at_most=MAX_ROPE_THETA)

    def rope_factor(self, key: str = "factor", default: object = REQUIRED) -> float:
        """A RoPE context-extension factor (``rope_scaling.factor``, GGUF ``rope.scaling.factor``):
        a finite number from 1 to :data:`MAX_ROPE_FACTOR` (see the module docstring for why)."""
        return self.number(key, default, at_least=1.0, at_most=MAX_ROPE_FACTOR)

    def rope_knob(self, key: str, default: object = None, *, at_most: float = MAX_ROPE_FACTOR) -> float:
        """A tuning number of a RoPE scaling, from :data:`MIN_ROPE_KNOB` to ``at_most``: YaRN's
        ``beta_fast`` / ``beta_slow`` and Llama 3's ``low_freq_factor`` / ``high_freq_factor`` (up to
        :data:`MAX_ROPE_FACTOR`); YaRN's ``attention_factor``, ``mscale``, ``mscale_all_dim``, which
        multiply cos and sin (give ``at_most=MAX_ROPE_SCALE``). Absent or null: ``default`` (None)."""
        return self.number(key, default, at_least=MIN_ROPE_KNOB, at_most=at_most)

    # -- flags, names, lists -------------------------------------------------
    def boolean(self, key: str, default: object = REQUIRED) -> bool:
        """``true`` or ``false`` (not ``0``/``1``, not the string ``"true"``)."""
        if not self._present(key, default):
            return default
        value = self.raw[key]
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def string(self, key: str, default: object = REQUIRED, *, choices: Sequence[str] | None = None) -> str:
        """A string, one of ``choices`` when given."""
        if not self._present(key, default):
            return default
        value = self.raw[key]
        if not isinstance(value, str):
            raise self._bad(key, value, "a string")
        if choices is not None and value not in choices:
            raise self.fail(f"{key!r} is {show(value)}; implemented: {', '.join(map(repr, choices))}")
        return value

    def strings(self, key: str, default: object = REQUIRED, *, length: int, choices: Sequence[str]) -> tuple[str, ...]:
        """A list of exactly ``length`` strings, each one of ``choices`` (e.g. ``layer_types``)."""
        if not self._present(key, default):
            return default
        value = self.raw[key]
        if not isinstance(value, list) or len(value) != length:
            raise self._bad(key, value, f"a list of {length} entries (one per layer)")
        bad = [v for v in value if not isinstance(v, str) or v not in choices]
        if bad:
            raise self.fail(f"{key!r} holds {show(bad[0])}; implemented: {', '.join(map(repr, choices))}")
        return tuple(value)

    def token_ids(self, key: str) -> tuple[int, ...]:
        """Token ids given as one id or a list of ids (``eos_token_id``); absent or null: ``()``.

        Each id is an integer in ``0 .. MAX_VOCAB - 1``; a null inside the list is refused.
        """
        value = self.value(key, None)
        if value is None:
            return ()
        ids = value if isinstance(value, list) else [value]
        if not all(_is_int(i) and 0 <= i < MAX_VOCAB for i in ids):
            raise self._bad(key, value, f"a token id or a list of token ids (integers from 0 to {MAX_VOCAB - 1})")
        return tuple(ids)

    def mapping(self, key: str, default: object = None) -> dict[str, Any] | None:
        """A JSON object (dict); ``default`` (None) when absent or null."""
        if not self._present(key, default):
            return default
        value = self.raw[key]
        if not isinstance(value, dict):
            raise self._bad(key, value, "an object")
        return value

    def section(self, key: str, default: object = None) -> "ConfigReader | None":
        """A nested object as a reader of its own (errors name ``where 'key'``); None when absent."""
        value = self.mapping(key, default)
        return None if value is None else ConfigReader(value, f"{self.where} {key!r}")

    def refuse_unknown(self, known: Iterable[str], what: str) -> None:
        """ConfigError naming the first key not in ``known`` (``what`` says who does not implement it)."""
        unknown = sorted(k for k in self.raw if k not in set(known))
        if unknown:
            raise self.fail(f"has {show(unknown[0])}, which {what} does not implement")


# ---------------------------------------------------------------------------
# Sizes against the weights: the tensor table
# ---------------------------------------------------------------------------


def tensor_table(source: Any, name_map: Callable[[str], str | None]) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors as ``{model name: shape}``, from the file headers only (no data read).

    source: a TensorSource (``names()``, ``shape(name)``); name_map: the family's file name ->
    model name (``None``: a tensor the family skips). A name the family does not know raises
    its WeightsError here, before anything is built.
    """
    table: dict[str, tuple[int, ...]] = {}
    for name in source.names():
        target = name_map(name)
        if target is not None:
            table[target] = tuple(source.shape(name))
    return table


class WeightTable:
    """Check a config's sizes against the tensor table, before any module is built.

    shapes: ``{model tensor name: shape}`` (:func:`tensor_table`).
    where:  how an error names the config (``"qwen2: config.json"``, ``"qwen2: GGUF metadata"``).
    keys:   field name -> the key as the file spells it, for the message (GGUF:
            ``{"num_hidden_layers": "qwen2.block_count", ...}``); a field not in it is named as is.

    A mismatch raises ConfigError naming the key, its value and what the weights hold;
    a tensor the check needs that is absent raises WeightsError naming it.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], where: str, keys: Mapping[str, str] | None = None):
        self.shapes = shapes
        self.where = where
        self.keys = dict(keys or {})

    def _name(self, field: str | tuple[str, ...]) -> str:
        fields = (field,) if isinstance(field, str) else field
        return " x ".join(repr(self.keys.get(f, f)) for f in fields)

    def count(self, prefix: str) -> int:
        """How many consecutive blocks ``{prefix}0.``, ``{prefix}1.`` … the table holds (0 when none)."""
        pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
        held = {int(m.group(1)) for name in self.shapes if (m := pattern.match(name))}
        n = 0
        while n in held:
            n += 1
        return n

    def layers(self, field: str, value: int, prefix: str = "model.layers.") -> None:
        """``value`` must be the number of layers the weights hold (blocks ``{prefix}0.`` … ``{prefix}{value-1}.``)."""
        held = self.count(prefix)
        if value != held:
            what = f"{held} layers ({prefix}0 .. {prefix}{held - 1})" if held else f"no {prefix}N tensors"
            raise ConfigError(f"{self.where} {self._name(field)} is {value}, but the weights hold {what}")

    def size(self, field: str | tuple[str, ...], value: int, tensor: str, dim: int) -> None:
        """Dimension ``dim`` of ``tensor`` must be ``value`` (a product when ``field`` names several keys)."""
        shape = self.shapes.get(tensor)
        if shape is None:
            raise WeightsError(f"the checkpoint has no tensor for {tensor!r}, which {self.where} {self._name(field)} needs")
        if len(shape) <= dim or shape[dim] != value:
            raise ConfigError(
                f"{self.where} {self._name(field)} is {value}, but the weights hold {tensor!r} of shape {shape}"
            )
