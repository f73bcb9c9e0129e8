"""Sampling settings: what the user, generation_config.json and the family ask for, checked and merged.

:class:`SamplingParams` holds the settings the sampler (:mod:`lollm.generate.sampling`)
applies; :func:`resolve_sampling` decides them once, most specific source
first (a flag, then generation_config.json, then the family's defaults, then
the neutral values) and records where each came from. This module imports no
torch: the CLI checks its flags with :func:`check_sampling_value` and
:func:`check_seed` before anything heavy is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from lollm.errors import GenerationError


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each next token.

    temperature:        0 means greedy; otherwise logits are divided by it (>0).
    top_k:              keep the k most likely tokens (0 = off).
    top_p:              keep the smallest set whose probability mass reaches p (1.0 = off).
    min_p:              drop tokens less likely than min_p × the top probability (0 = off).
    repetition_penalty: >1 makes tokens already in the sequence less likely (1.0 = off),
                        as in CTRL (Keskar et al., 2019): positive logits are divided by it,
                        negative ones multiplied.
    seed:               seed of the random generator, 0 .. 2**64-1 (None: nondeterministic).
    sources:            where each value came from (``"flag"``, ``"generation_config.json"``,
                        ``"family default"``, ``"neutral"``); filled by :func:`resolve_sampling`,
                        not part of equality.

    Raises GenerationError for a value of the wrong type or outside its range.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name in _KEYS:
            check_sampling_value(name, getattr(self, name))
        if self.seed is not None:
            check_seed(self.seed)

    @property
    def greedy(self) -> bool:
        """True for ``temperature == 0``: the sampler takes the argmax and draws nothing."""
        return self.temperature == 0


_KEYS = ["temperature", "top_k", "top_p", "min_p", "repetition_penalty"]
#: The neutral value of each setting: the one that changes nothing.
NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
SEED_MAX = 2**64 - 1


def check_sampling_value(key: str, value: object) -> None:
    """Raise GenerationError unless ``value`` is a valid ``key`` (its type and range).

    ``top_k`` must be a whole number (``2.5`` is refused, not cut to 2); the
    others any finite number. This module-level check is what the CLI runs on
    its flags before anything heavy is loaded.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GenerationError(f"{key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise GenerationError(f"{key} must be a finite number, got {value}")
    if key == "top_k":
        if value != int(value):
            raise GenerationError(f"top_k must be a whole number, got {value!r}")
        if value < 0:
            raise GenerationError(f"top_k must be >= 0, got {value}")
    elif key == "temperature" and value < 0:
        raise GenerationError(f"temperature must be >= 0, got {value}")
    elif key == "top_p" and not 0.0 < value <= 1.0:
        raise GenerationError(f"top_p must be in (0, 1], got {value}")
    elif key == "min_p" and not 0.0 <= value <= 1.0:
        raise GenerationError(f"min_p must be in [0, 1], got {value}")
    elif key == "repetition_penalty" and value <= 0:
        raise GenerationError(f"repetition_penalty must be > 0, got {value}")


def check_seed(seed: object) -> None:
    """Raise GenerationError unless ``seed`` is a whole number in 0 .. 2**64-1 (what torch.Generator takes)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise GenerationError(f"seed must be a whole number, got {seed!r}")
    if not 0 <= seed <= SEED_MAX:
        raise GenerationError(f"seed must be in 0 .. 2**64-1, got {seed}")


def resolve_sampling(
    user: Mapping[str, object],
    generation_config: Mapping[str, object],
    family_defaults: Mapping[str, object],
    *,
    seed: int | None = None,
    generation_config_name: str = "generation_config.json",
) -> SamplingParams:
    """Merge the three sources of sampling settings, most specific first.

    ``user`` holds only the flags the user actually gave (None values are
    ignored). generation_config.json's ``do_sample: false`` means greedy
    unless the user asked for a temperature. The result's ``sources`` says
    where each value came from: ``"flag"``, ``generation_config_name``,
    ``"family default"`` or ``"neutral"``. A bad value raises GenerationError
    naming its key and its source (``generation_config_name`` for the file).
    """
    values: dict[str, object] = dict(NEUTRAL)
    sources = dict.fromkeys(_KEYS, "neutral")
    given = {k: v for k, v in user.items() if v is not None}
    for name, source in (("family default", family_defaults), (generation_config_name, generation_config), ("flag", given)):
        for key in _KEYS:
            if key in source and source[key] is not None:
                values[key], sources[key] = source[key], name
    if generation_config.get("do_sample") is False and given.get("temperature") is None:
        values["temperature"], sources["temperature"] = 0.0, f"{generation_config_name} (do_sample: false)"
    for key in _KEYS:
        try:
            check_sampling_value(key, values[key])
        except GenerationError as exc:
            where = "--" + key.replace("_", "-") if sources[key] == "flag" else sources[key]
            raise GenerationError(f"{where}: {exc}") from None
        values[key] = int(values[key]) if key == "top_k" else float(values[key])
    return SamplingParams(**values, seed=seed, sources=sources)


def describe_sampling(params: SamplingParams, *, everything: bool = False) -> str:
    """One line saying which sampling settings apply and where each came from.

    The temperature is always shown (greedy decoding is named as such); other
    settings at their neutral value, and filters that cannot change a greedy
    pick, are left out unless ``everything`` (``--verbose``).
    """
    parts = []
    for key in _KEYS:
        value = getattr(params, key)
        source = params.sources.get(key, "neutral")
        if key == "temperature" and params.greedy:
            parts.append(f"greedy (temperature 0, {source})")
        elif everything or key == "temperature" or value != NEUTRAL[key]:
            if params.greedy and key in ("top_k", "top_p", "min_p") and not everything:
                continue  # filters do not change the argmax
            parts.append(f"{key} {value:g} ({source})")
    if params.seed is not None:
        parts.append(f"seed {params.seed}")
    return "sampling: " + " · ".join(parts)


