"""The sampler: from the logits of the last position to the next token id.

Each step is a small pure function over a 1-D tensor of logits (``(V,)``,
float32), composed in the same order as transformers applies them::

    logits ─► repetition penalty ─► temperature ─► [constraint mask] ─► top-k ─► top-p ─► min-p ─► softmax ─► draw

The constraint mask (:mod:`lollm.generate.structured`, a JSON schema or grammar) is there only when the
request has one: it sets the ids the constraint forbids to -inf.

Greedy decoding (``temperature == 0``) skips the random part and takes the
argmax after the repetition penalty.

Which values apply is decided once, by :func:`resolve_sampling`: a flag the
user gave wins over generation_config.json, which wins over the family's
defaults, which win over the neutral values of :class:`SamplingParams`; the
result records where each value came from (``SamplingParams.sources``).

The sampler refuses logits that are not finite (NaN, +-inf): they come from a
broken checkpoint or an overflow, and sampling from them would be garbage.
"""

from __future__ import annotations

import torch

from lollm.errors import GenerationError

# The settings themselves live in a module without torch, so that the CLI can
# check its flags before torch is imported; they are part of this module's API.
from lollm.sampling_params import (  # noqa: F401 (re-exported)
    NEUTRAL,
    SEED_MAX,
    SamplingParams,
    check_sampling_value,
    check_seed,
    describe_sampling,
    resolve_sampling,
)


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalize every token id already present in ``previous_ids`` ((N,) int64), once each.

    ``logits``: (V,) float32; returns a new (V,) tensor (``logits`` itself when there is
    nothing to do): a positive logit is divided by ``penalty``, a negative one multiplied.
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


def apply_allowed(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Set the logit of every id not in ``allowed`` ((V,) bool, any device; None: all allowed) to -inf.

    ``logits``: (V,) float; returns a new (V,) tensor on the logits' device (``logits`` itself for None).
    """
    if allowed is None:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide the (V,) float ``logits`` by ``temperature`` (> 0): <1 sharpens the distribution, >1 flattens it."""
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit of the (V,) float ``logits`` below the k-th largest to -inf (ties with the k-th are kept).

    ``k <= 0`` or ``k >= V``: nothing is dropped. Returns a new (V,) tensor (``logits`` itself when nothing is dropped).
    """
    if k <= 0 or k >= logits.numel():
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al., 2019): keep the most likely tokens whose mass first reaches p.

    ``logits``: (V,) float; returns a new (V,) tensor with the dropped ids at -inf (``p >= 1``: ``logits`` itself).

    The most likely token always stays, whatever ``p`` (as in transformers and
    llama.cpp): a ``p`` too small for float32 (``1e-300`` rounds to 0) must not
    leave nothing to sample from.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
    drop_sorted = mass_before >= p
    drop_sorted[0] = False  # the most likely token
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's.

    ``logits``: (V,) float; returns a new (V,) tensor with the dropped ids at -inf (``min_p <= 0``: ``logits`` itself).
    """
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


class Sampler:
    """Applies :class:`SamplingParams` step after step, with its own seeded generator.

    The generator is a CPU ``torch.Generator`` seeded with ``params.seed`` (None: from the OS),
    so that one seed gives the same draws on every device.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, previous_ids: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
        """Choose the next id from ``logits`` ((V,) any float dtype) given the ids so far ((N,) int64).

        ``allowed`` ((V,) bool, any device): the ids a constraint permits (:mod:`lollm.generate.structured`);
        the others get ``-inf`` after the repetition penalty and the temperature, before the
        filters, so top-k / top-p / min-p choose among permitted ids only.

        Raises GenerationError when the logits are not finite, naming the likely
        cause: the model (broken weights or config, or an overflow of the dtype),
        the repetition penalty, or the temperature.
        """
        p = self.params
        logits = logits.float()
        _require_finite(
            logits,
            "the model produced non-finite logits (NaN or infinity): the checkpoint's weights or config "
            "are broken (NaN weights, a norm epsilon <= 0, ...) or the dtype overflowed (try --dtype float32)",
        )
        logits = apply_repetition_penalty(logits, previous_ids, p.repetition_penalty)
        if p.repetition_penalty != 1.0:
            _require_finite(logits, f"repetition_penalty {p.repetition_penalty:g} pushed the logits to infinity; use a value near 1")
        if p.greedy:
            return int(torch.argmax(apply_allowed(logits, allowed)))
        logits = apply_temperature(logits, p.temperature)
        if p.temperature != 1.0:
            _require_finite(logits, f"temperature {p.temperature:g} pushed the logits to infinity; use a larger temperature, or 0 for greedy")
        logits = apply_allowed(logits, allowed)
        logits = top_k_filter(logits, p.top_k)
        logits = top_p_filter(logits, p.top_p)
        logits = min_p_filter(logits, p.min_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))


def _require_finite(logits: torch.Tensor, cause: str) -> None:
    """GenerationError naming ``cause`` when any of the (V,) ``logits`` is NaN or infinite."""
    if not bool(torch.isfinite(logits).all()):
        raise GenerationError(f"cannot sample the next token: {cause}")
