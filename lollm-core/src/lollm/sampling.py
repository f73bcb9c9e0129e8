"""The sampler: from the logits of the last position to the next token id.

Each step is a small pure function over a 1-D tensor of logits (``(V,)``,
float32), composed in the same order as transformers applies them::

    logits ─► repetition penalty ─► temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► draw

Greedy decoding (``temperature == 0``) skips the random part and takes the
argmax after the repetition penalty.

Which values apply is decided once, by :func:`resolve_sampling`: a flag the
user gave wins over generation_config.json, which wins over the family's
defaults, which win over the neutral values of :class:`SamplingParams`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

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
    seed:               seed of the random generator (None: nondeterministic).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise GenerationError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise GenerationError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise GenerationError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_KEYS = [f.name for f in fields(SamplingParams) if f.name != "seed"]


def resolve_sampling(
    user: Mapping[str, Any],
    generation_config: Mapping[str, Any],
    family_defaults: Mapping[str, Any],
    *,
    seed: int | None = None,
) -> SamplingParams:
    """Merge the three sources of sampling settings, most specific first.

    ``user`` holds only the flags the user actually gave (None values are
    ignored). generation_config.json's ``do_sample: false`` means greedy
    unless the user asked for a temperature.
    """
    values: dict[str, Any] = {}
    for source in (family_defaults, generation_config, {k: v for k, v in user.items() if v is not None}):
        for key in _KEYS:
            if key in source and source[key] is not None:
                values[key] = source[key]
    if generation_config.get("do_sample") is False and user.get("temperature") is None:
        values["temperature"] = 0.0

    def number(key: str, kind: type, neutral: Any) -> Any:
        value = values.get(key, neutral)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GenerationError(f"{key} must be a number, got {value!r}")
        return kind(value)

    return SamplingParams(
        temperature=number("temperature", float, 1.0),
        top_k=number("top_k", int, 0),
        top_p=number("top_p", float, 1.0),
        min_p=number("min_p", float, 0.0),
        repetition_penalty=number("repetition_penalty", float, 1.0),
        seed=seed,
    )


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalize every token id already present in ``previous_ids`` ((N,) int64), once each.

    The ids may sit on the CPU (the generate loop keeps them there) while the logits
    are on the model's device: they are moved to the logits' device first.
    """
    if penalty == 1.0 or previous_ids.numel() == 0:
        return logits
    previous_ids = previous_ids.to(logits.device)
    logits = logits.clone()
    seen = logits.gather(0, previous_ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    logits.scatter_(0, previous_ids, seen)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by the temperature: <1 sharpens the distribution, >1 flattens it."""
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest to -inf (ties with the k-th are kept)."""
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al., 2019): keep the most likely tokens whose mass first reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = mass_before >= p  # the first token always stays (mass_before = 0)
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


class Sampler:
    """Applies :class:`SamplingParams` step after step, with its own seeded generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, previous_ids: torch.Tensor) -> int:
        """Choose the next id from ``logits`` ((V,) any float dtype) given the ids so far ((N,) int64)."""
        p = self.params
        logits = logits.float()
        logits = apply_repetition_penalty(logits, previous_ids, p.repetition_penalty)
        if p.greedy:
            return int(torch.argmax(logits))
        logits = apply_temperature(logits, p.temperature)
        logits = top_k_filter(logits, p.top_k)
        logits = top_p_filter(logits, p.top_p)
        logits = min_p_filter(logits, p.min_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))
