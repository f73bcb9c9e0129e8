"""The conformance kit's reference: its own float32 noise on a checkpoint, and its sensitivity.

The parity tests of :class:`lollm.testing.conformance.FamilyConformance` compare a family with
transformers' model of the same checkpoint. :func:`measure_noise_floor` sets their bound from
how far the reference disagrees with itself; :func:`reference_sensitivity` proves the tiny
checkpoint can tell a right model from a wrong one (a perturbed reference moves far past that bound).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from lollm.load.loader import Checkpoint
from lollm.proof.parity import load_reference_model, relabel_model_types

# Lazy import below: transformers (an optional extra, lollm-core[parity]); with_layer_types works without it.
if TYPE_CHECKING:  # its classes only name types here
    from transformers import PretrainedConfig, PreTrainedModel

#: A parity reference, ready to run: ids (1, T) -> (logits (T, V), hidden states: num_layers + 1 tensors (1, T, D)).
ReferenceRun = Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]
#: What builds one: ``build(checkpoint, dtype)`` (:func:`lollm.proof.parity.default_reference`, or a family's
#: ``parity_reference``).
ReferenceBuilder = Callable[[Checkpoint, torch.dtype], ReferenceRun]
#: One perturbation, made to a copy of the reference's text config, or to the model built from it.
ConfigEdit = Callable[["PretrainedConfig"], None]
ModelEdit = Callable[["PreTrainedModel"], None]

#: The perturbations of the reference the sensitivity test applies (:func:`reference_sensitivity`).
SENSITIVITY_CHECKS = ("rope_theta", "rope_scaling", "norm_eps", "attention_scale", "sliding_window")
SENSITIVITY_CHECKS_HELP = {
    "rope_theta": "the RoPE base times 2",
    "rope_scaling": "the RoPE scaling removed",
    "norm_eps": "the norm epsilon times 0.1",
    "attention_scale": "the attention scale times 1.25",
    "sliding_window": "the sliding window off by one",
}


def _rope_dicts(config: PretrainedConfig) -> list[dict[str, object]]:
    """The RoPE parameter dicts of a transformers 5 config (one, or one per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return []
    if params and all(isinstance(v, dict) for v in params.values()):
        return [v for v in params.values() if "rope_theta" in v]
    return [params] if "rope_theta" in params else []


def _perturbations(name: str, config: PretrainedConfig) -> list[tuple[str, ConfigEdit | None, ModelEdit | None]]:
    """(label, edit of the text config, edit of the built model) for one check; [] when it does not apply."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if name == "rope_theta":
        if not _rope_dicts(text):
            return []

        def edit(cfg: PretrainedConfig) -> None:
            for d in _rope_dicts(cfg):
                d["rope_theta"] = d["rope_theta"] * 2
        return [("rope_theta", edit, None)]
    if name == "rope_scaling":
        if not any(d.get("rope_type", "default") != "default" for d in _rope_dicts(text)):
            return []

        def edit(cfg: PretrainedConfig) -> None:
            for d in _rope_dicts(cfg):
                if d.get("rope_type", "default") != "default":
                    theta = d["rope_theta"]
                    d.clear()
                    d.update(rope_type="default", rope_theta=theta)
        return [("rope_scaling", edit, None)]
    if name == "norm_eps":
        keys = [k for k in ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon")
                if isinstance(getattr(text, k, None), float)]
        if not keys:
            return []

        def edit(cfg: PretrainedConfig) -> None:
            for k in keys:
                setattr(cfg, k, getattr(cfg, k) * 0.1)
        return [("norm_eps", edit, None)]
    if name == "attention_scale":
        def scale(model: PreTrainedModel) -> None:
            found = [m for m in model.modules() if isinstance(getattr(m, "scaling", None), float)]
            if not found:
                raise _NotApplicable
            for m in found:
                m.scaling = m.scaling * 1.25
        return [("attention_scale", None, scale)]
    if name == "sliding_window":
        w = getattr(text, "sliding_window", None)
        types = getattr(text, "layer_types", None) or []
        uses = "sliding_attention" in types or getattr(text, "use_sliding_window", False) is True
        if not (isinstance(w, int) and w > 1 and uses):
            return []
        out = []
        for delta in (+1, -1):
            def edit(cfg: PretrainedConfig, delta: int = delta) -> None:
                cfg.sliding_window = cfg.sliding_window + delta
            out.append((f"sliding_window {delta:+d}", edit, None))
        return out
    raise ValueError(f"unknown sensitivity check {name!r} (known: {', '.join(SENSITIVITY_CHECKS)})")


class _NotApplicable(Exception):
    """Raised by a model edit that finds nothing to change: the perturbation is left out."""


def reference_sensitivity(checkpoint: Checkpoint, ids: torch.Tensor,
                          checks: tuple[str, ...] = SENSITIVITY_CHECKS,
                          model_types: dict[str, str] | None = None) -> dict[str, float]:
    """How far each perturbation moves the reference's logits: {label: max |Δ| over positions and vocabulary}.

    The reference is transformers' model of the checkpoint (:func:`lollm.proof.parity.load_reference_model`,
    float32, CPU). Each perturbation builds the same class again from a copy of its config with
    one change (RoPE base x2; RoPE scaling removed; norm epsilon x0.1; sliding window +1 and -1),
    or scales the float ``scaling`` of every attention module by 1.25, loads the same weights,
    and runs ``ids`` (1, T) without a cache. A perturbation that does not apply (no RoPE scaling in
    the config, no sliding-window layer, no ``scaling`` attribute) is left out of the result.
    ``model_types``: for model types transformers does not know, the architecture that stands for
    each (:func:`lollm.proof.parity.load_reference_model`).
    """
    base_model = load_reference_model(checkpoint, torch.float32, model_types)
    state = base_model.state_dict()

    @torch.inference_mode()
    def logits(model: PreTrainedModel) -> torch.Tensor:
        return model(ids, use_cache=False).logits[0].double()

    base = logits(base_model)
    moved: dict[str, float] = {}
    for name in checks:
        for label, edit_config, edit_model in _perturbations(name, base_model.config):
            config = copy.deepcopy(base_model.config)
            if edit_config is not None:
                edit_config(config.get_text_config() if hasattr(config, "get_text_config") else config)
            model = type(base_model)(config).to(torch.float32).eval()
            model.load_state_dict(state, strict=True)
            if edit_model is not None:
                try:
                    edit_model(model)
                except _NotApplicable:
                    continue
            moved[label] = float((logits(model) - base).abs().max())
    return moved


#: The parity bound is this many times the reference's own float32 noise on the checkpoint (two
#: correct float32 implementations are each about one noise from the exact result: 2 x, and 2.5 x margin) ...
NOISE_FACTOR = 5.0
#: ... and never below this (a checkpoint whose float32 and float64 logits agree closer than 2e-6).
BOUND_FLOOR = 1e-5


@dataclass(frozen=True)
class NoiseFloor:
    """How far the reference disagrees with itself on one checkpoint, and the parity bound set from it.

    float64: max |Δ| of a logit between the reference at float32 and transformers' model at
    float64 (the float32 rounding of every sum: how far from the exact result a correct float32
    implementation lands); batch: max |Δ| between the float32 reference on the prompt alone and
    as the first row of a batch of two (another blocking of the same products); noise: the
    larger; bound: ``max(factor * noise, floor)`` (:data:`NOISE_FACTOR`, :data:`BOUND_FLOOR`), in
    logit units: what :class:`FamilyConformance`'s parity tests allow.
    """

    float64: float
    batch: float
    noise: float
    bound: float


#: Built references and measured noise floors, by builder, checkpoint files and what else they depend on.
_REFERENCE_RUNS: dict[tuple, ReferenceRun | NoiseFloor] = {}


def _files_stamp(path: Path) -> tuple:
    """(name, size, mtime_ns) of the checkpoint file or of each file of its folder: a rewritten checkpoint is another."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def _reference_key(build: ReferenceBuilder, checkpoint: Checkpoint, *more: object) -> tuple:
    return (getattr(build, "__module__", ""), getattr(build, "__qualname__", repr(build)), str(Path(checkpoint.path).resolve()),
            _files_stamp(checkpoint.path), *more)


def cached_reference(build: ReferenceBuilder, checkpoint: Checkpoint, dtype: torch.dtype) -> ReferenceRun:
    """``build(checkpoint, dtype)``, built once per process for the same builder, files and dtype.

    The mutation suite runs the kit on many copies of a family against one checkpoint; the
    reference (transformers' model of it) is the same for all of them, so it is built once
    (and its noise floor measured once, :func:`measure_noise_floor`).
    """
    key = _reference_key(build, checkpoint, str(dtype))
    if key not in _REFERENCE_RUNS:
        if not any(k[:4] == key[:4] for k in _REFERENCE_RUNS):
            _REFERENCE_RUNS.clear()  # one checkpoint at a time: keep memory flat over a long suite
        _REFERENCE_RUNS[key] = build(checkpoint, dtype)
    return _REFERENCE_RUNS[key]


def measure_noise_floor(build: ReferenceBuilder, checkpoint: Checkpoint, ids: torch.Tensor, *, model_types: dict[str, str] | None = None,
                        factor: float = NOISE_FACTOR, floor: float = BOUND_FLOOR) -> NoiseFloor:
    """The reference's own float32 noise on ``checkpoint`` for the prompt ``ids`` (1, T), and the bound from it.

    ``build``: the family's parity reference (``build(checkpoint, dtype) -> run(ids) -> (logits (T, V),
    hidden states)``, :func:`lollm.proof.parity.default_reference` by default); ``model_types``: for
    types transformers does not know, the type whose class stands for each. The two equivalent
    runs (:class:`NoiseFloor`): transformers' model of the checkpoint at float64 (its mixtures of
    experts through the plain per-expert loop: the grouped matmul has no float64), and the
    float32 reference as the first row of a batch of two.
    """
    key = _reference_key(build, checkpoint, "noise", ids.numpy().tobytes(), tuple(sorted((model_types or {}).items())),
                         factor, floor)
    if key in _REFERENCE_RUNS:
        return _REFERENCE_RUNS[key]
    ref32 = cached_reference(build, checkpoint, torch.float32)
    base = ref32(ids)[0].double()
    model64 = load_reference_model(checkpoint, torch.float64, model_types)
    if getattr(model64.config, "_experts_implementation", None) not in (None, "eager"):
        model64.set_experts_implementation("eager")
    with torch.inference_mode():
        d64 = float((model64(ids, use_cache=False).logits[0].double() - base).abs().max())
    batched = ref32(torch.cat([ids, torch.roll(ids, 1, dims=1)]))[0].double()
    dbatch = float((batched - base).abs().max())
    noise = max(d64, dbatch)
    _REFERENCE_RUNS[key] = NoiseFloor(float64=d64, batch=dbatch, noise=noise, bound=max(factor * noise, floor))
    return _REFERENCE_RUNS[key]


def with_layer_types(config: dict[str, object], model_types: dict[str, str] | None = None) -> dict[str, object]:
    """The config.json dict with ``layer_types`` as transformers derives it, when the file leaves it out.

    Gemma 2's hub config.json has no ``layer_types`` (transformers alternates sliding and global
    layers from layer 0); the coverage check must count the layers the reference runs. Without
    transformers, or for a type it does not know, the dict is returned as it is.
    """
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if isinstance(text.get("layer_types"), list):
        return config
    try:
        import transformers

        raw = relabel_model_types(dict(text), model_types or {})
        types = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw).layer_types
    except Exception:  # no transformers, a type it does not know, no layer_types attribute: keep the file's view
        return config
    return {**text, "layer_types": list(types)} if isinstance(types, list) else config




#: The bfloat16 check's bound on the mean |Δ| of a logit is at least this fraction of the reference's own
#: bfloat16 error (its mean distance from its float32 logits): a family that rounds where transformers rounds
#: differs from it only where a float32 sum is blocked otherwise (measured: 0 for lollm's seven families on the
#: CPU); one more rounding per norm (Gemma's norm cast before its (1 + w)) moves it by about 1.1 to 1.3 x that error.
BF16_ERROR_FRACTION = 0.25


@dataclass(frozen=True)
class Bf16Noise:
    """The reference's own noise at bfloat16 on one checkpoint, and the bfloat16 check's bounds from it.

    error_mean, error_max: mean and max |Δ| of a logit between the reference at bfloat16 and at float32
    (how far bfloat16 rounding puts a correct implementation from the float32 result). noise_mean,
    noise_max: the same between the bfloat16 reference on the prompt alone and (a) as the first row of
    a batch of two, (b) followed by 5 more tokens (other blockings of the same products, rounded at the
    same places; the larger of the two). mean_bound = ``max(factor * noise_mean, fraction * error_mean)``;
    max_bound = ``max(factor * noise_max, 2 * error_max)`` (two correct bfloat16 implementations are each
    within about error_max of the float32 result): what :class:`FamilyConformance`'s bfloat16 test allows.
    """

    error_mean: float
    error_max: float
    noise_mean: float
    noise_max: float
    mean_bound: float
    max_bound: float


def measure_bf16_noise(build: ReferenceBuilder, checkpoint: Checkpoint, ids: torch.Tensor, *,
                       factor: float = NOISE_FACTOR, fraction: float = BF16_ERROR_FRACTION) -> Bf16Noise:
    """The reference's bfloat16 error and noise on ``checkpoint`` for the prompt ``ids`` (1, T), and the bounds
    (:class:`Bf16Noise`). ``build``: the family's parity reference, run at bfloat16 and at float32 (each built
    once per process, :func:`cached_reference`)."""
    key = _reference_key(build, checkpoint, "bf16 noise", ids.numpy().tobytes(), factor, fraction)
    if key in _REFERENCE_RUNS:
        return _REFERENCE_RUNS[key]
    ref16 = cached_reference(build, checkpoint, torch.bfloat16)
    base = ref16(ids)[0].double()
    error = (base - cached_reference(build, checkpoint, torch.float32)(ids)[0].double()).abs()
    more = torch.randint(0, int(base.shape[-1]), (1, 5), generator=torch.Generator().manual_seed(5))
    others = [ref16(torch.cat([ids, torch.roll(ids, 1, dims=1)]))[0].double(),
              ref16(torch.cat([ids, more], dim=1))[0][: ids.shape[1]].double()]
    noise_mean = max(float((o - base).abs().mean()) for o in others)
    noise_max = max(float((o - base).abs().max()) for o in others)
    _REFERENCE_RUNS[key] = Bf16Noise(
        error_mean=float(error.mean()), error_max=float(error.max()), noise_mean=noise_mean, noise_max=noise_max,
        mean_bound=max(factor * noise_mean, fraction * float(error.mean())),
        max_bound=max(factor * noise_max, 2 * float(error.max())))
    return _REFERENCE_RUNS[key]
