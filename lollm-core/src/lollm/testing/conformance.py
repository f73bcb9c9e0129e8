"""The conformance kit: the tests every lollm family must pass, for plugin authors to inherit.

A plugin author subclasses :class:`FamilyConformance` in their own test suite
and gives two fixtures; every test below then runs against their family::

    import pytest
    from lollm.testing.conformance import FamilyConformance

    class TestMyFamily(FamilyConformance):
        reference_available = True  # transformers knows this architecture: run the parity test

        @pytest.fixture
        def family_name(self):
            return "mine"

        @pytest.fixture
        def checkpoint_dir(self, tmp_path):
            return write_my_tiny_checkpoint(tmp_path)  # config.json + model.safetensors

What the inherited tests prove (each one is a method below, read them):

0. the tiny checkpoint and the prompts can see every feature the family has (each layer kind,
   every window crossed twice, decode past position 64 and past a delta-rule chunk, soft-caps
   and scalars away from neutral: :mod:`lollm.testing.coverage`), or the kit fails the
   checkpoint, naming the blind spot and its fix;
1. the family is registered under its name and serves the checkpoint's ``model_type``;
2. the plugin module it came from imports no torch (``lollm families`` stays light);
3. ``load`` builds a model meeting :mod:`lollm.model`'s protocol: attributes, ``new_cache``,
   forward shapes, ``logits_to_keep``, ``num_layers + 1`` hidden states;
4. prefill-all equals prefill-then-decode (one token or a chunk at a time, and with a sliding
   window W, prefills and chunks that end before, on and after its edge), cosine and max |Δ|
   bounded at every position;
5. the cache is preallocated: decoding never replaces its tensors;
6. a missing and an unexpected tensor raise :class:`~lollm.errors.WeightsError` naming it;
7. the shared generate loop drives the model, and greedy generation follows the logits;
   with a prompt cache (:mod:`lollm.generate.prompt_cache`), every turn of a conversation equals a
   cold run of the same prompt (:func:`check_prompt_cache_turns`, also usable alone);
8. with ``reference_available = True``: the same argmax at every position as
   transformers' ``AutoModelForCausalLM`` (or the family's own ``parity_reference``),
   cosine >= :attr:`FamilyConformance.parity_min_cosine` and max |Δ| <= a bound set from the
   reference's own float32 noise on the checkpoint (:func:`measure_noise_floor`), at fp32,
   after a prefill and through the cache (prefill then decode); and the checkpoint is
   *sensitive*: perturbing the reference's RoPE base, RoPE scaling, norm epsilon, attention
   scale or sliding window moves its logits far past that bound (:func:`reference_sensitivity`), or the kit fails the checkpoint;
9. with ``gguf_types`` set: the checkpoint written as a GGUF the converter's way
   (:mod:`lollm.testing.gguf_writer`, F32/F16/Q8_0/Q4_0) loads through the family and
   matches the reference run on the weights the file holds.

Why these checks and bounds, and the mutants that prove the kit fails a wrong family:
docs/conformance-kit.md (:mod:`lollm.testing.mutation` makes those mutants).

The family must be installed (its entry point visible) for the tests to find
it; while developing, override the ``registry`` fixture with
``build_registry(entry_points=[], extra_plugins=[("mine", my_plugin_module)])``.

Everything runs on the CPU at float32. pytest is needed (``lollm-core[test]``),
transformers only for the parity test (``lollm-core[parity]``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from lollm.errors import WeightsError
from lollm.hookspecs import ENTRY_POINT_GROUP
from lollm.load.loader import Checkpoint, load_checkpoint
from lollm.load.plugins import InstalledFamily, Registry, build_registry
from lollm.load.options import LoadOptions
from lollm.load.quantized import Quantization
from lollm.testing.coverage import DELTA_RULE_CHUNK, check_coverage
from lollm.testing.batching import (check_engine_equals_solo, check_preemption_and_abort, check_prefix_cache_hit,
                                    check_window_blocks_released)

__all__ = ["FamilyConformance", "NoiseFloor", "check_prompt_cache_turns", "measure_noise_floor", "reference_sensitivity"]

#: Name of the extra tensor the "unexpected tensor" test adds to a copy of the checkpoint.
UNEXPECTED_TENSOR = "lollm_conformance.unexpected_tensor.weight"
#: Substrings of tensor names that may be legitimately absent (tied embeddings);
#: the "missing tensor" test does not drop those unless told to.
TIE_CANDIDATES = ("lm_head", "embed", "wte", "tok_embeddings", "output.weight")


#: The kit's tests that need the transformers reference (skipped with ``reference_available = False``).
REFERENCE_TESTS = ("test_parity_with_the_reference", "test_cached_decode_matches_the_reference",
                   "test_reference_checkpoint_is_sensitive", "test_gguf_parity_with_the_reference")

#: With a sliding window W, the test prompt has 3 W + 2 positions when that is at most this many.
MAX_WINDOWED_PROMPT = 128
#: The test prompt's positions at least: one-token decode steps past position 64
#: (:data:`lollm.testing.coverage.LONG_DECODE`) and a prefill past one delta-rule chunk, then decode.
SEQUENCE_LENGTH = 72

#: The perturbations of the reference the sensitivity test applies (:func:`reference_sensitivity`).
SENSITIVITY_CHECKS = ("rope_theta", "rope_scaling", "norm_eps", "attention_scale", "sliding_window")
SENSITIVITY_CHECKS_HELP = {
    "rope_theta": "the RoPE base times 2",
    "rope_scaling": "the RoPE scaling removed",
    "norm_eps": "the norm epsilon times 0.1",
    "attention_scale": "the attention scale times 1.25",
    "sliding_window": "the sliding window off by one",
}


def _sliding_window(config: dict[str, Any]) -> int | None:
    """``sliding_window`` of a config.json dict (or of its ``text_config``), unless ``use_sliding_window`` is false."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict):
            w = cfg.get("sliding_window")
            if isinstance(w, int) and not isinstance(w, bool) and w > 0 and cfg.get("use_sliding_window", True) is not False:
                return w
    return None


def _fill(T: int, sizes: list[int]) -> list[int]:
    """Chunks of the sizes given, in turn, until they cover T positions (the last one cut)."""
    out: list[int] = []
    while sum(out) < T:
        out.append(min(sizes[len(out) % len(sizes)], T - sum(out)))
    return out


def _schedules(T: int, window: int | None) -> list[list[int]]:
    """Chunk sizes the self-consistency test feeds through a cache, each summing to T.

    Always: one token at a time (decodes cross every boundary, and run past position 64),
    half then one at a time, chunks of 3 and 1; when T > 66, a prefill of 65 positions (past
    one chunk of the chunked delta rule) then one at a time. With a sliding window W: a prefill of W + 1 positions (it wraps
    around a ring of W slots) then one at a time, and chunks of W - 1, 1, W + 1 in turn
    (a chunk that ends just before the window's edge, a decode on the edge, a chunk
    that straddles it and must read keys a ring has since overwritten).
    """
    out = [[1] * T, [T // 2] + [1] * (T - T // 2), _fill(T, [3, 1])]
    if T > DELTA_RULE_CHUNK + 2:  # a prefill past one chunk of the chunked delta rule, then decode
        out.append([DELTA_RULE_CHUNK + 1] + [1] * (T - DELTA_RULE_CHUNK - 1))
    if window and window + 1 < T:
        out += [[window + 1] + [1] * (T - window - 1), _fill(T, [max(1, window - 1), 1, window + 1])]
    unique: list[list[int]] = []
    for schedule in out:
        if schedule not in unique:
            unique.append(schedule)
    return unique


def _short(schedule: list[int]) -> str:
    """[5, 1, 1, 1] -> '[5, 1 x3]' (runs of one size written once)."""
    parts: list[str] = []
    i = 0
    while i < len(schedule):
        j = i
        while j < len(schedule) and schedule[j] == schedule[i]:
            j += 1
        parts.append(str(schedule[i]) if j - i == 1 else f"{schedule[i]} x{j - i}")
        i = j
    return "[" + ", ".join(parts) + "]"


def _rope_dicts(config: Any) -> list[dict[str, Any]]:
    """The RoPE parameter dicts of a transformers 5 config (one, or one per layer type)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return []
    if params and all(isinstance(v, dict) for v in params.values()):
        return [v for v in params.values() if "rope_theta" in v]
    return [params] if "rope_theta" in params else []


def _perturbations(name: str, config: Any) -> list[tuple[str, Any, Any]]:
    """(label, edit of the text config, edit of the built model) for one check; [] when it does not apply."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if name == "rope_theta":
        if not _rope_dicts(text):
            return []

        def edit(cfg):
            for d in _rope_dicts(cfg):
                d["rope_theta"] = d["rope_theta"] * 2
        return [("rope_theta", edit, None)]
    if name == "rope_scaling":
        if not any(d.get("rope_type", "default") != "default" for d in _rope_dicts(text)):
            return []

        def edit(cfg):
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

        def edit(cfg):
            for k in keys:
                setattr(cfg, k, getattr(cfg, k) * 0.1)
        return [("norm_eps", edit, None)]
    if name == "attention_scale":
        def scale(model):
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
            def edit(cfg, delta=delta):
                cfg.sliding_window = cfg.sliding_window + delta
            out.append((f"sliding_window {delta:+d}", edit, None))
        return out
    raise ValueError(f"unknown sensitivity check {name!r} (known: {', '.join(SENSITIVITY_CHECKS)})")


class _NotApplicable(Exception):
    pass


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
    import copy

    from lollm.proof.parity import load_reference_model

    base_model = load_reference_model(checkpoint, torch.float32, model_types)
    state = base_model.state_dict()

    @torch.inference_mode()
    def logits(model) -> torch.Tensor:
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


_REFERENCE_RUNS: dict[tuple, Any] = {}


def _files_stamp(path: Path) -> tuple:
    """(name, size, mtime_ns) of the checkpoint file or of each file of its folder: a rewritten checkpoint is another."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def _reference_key(build, checkpoint: Checkpoint, *more: Any) -> tuple:
    return (getattr(build, "__module__", ""), getattr(build, "__qualname__", repr(build)), str(Path(checkpoint.path).resolve()),
            _files_stamp(checkpoint.path), *more)


def cached_reference(build, checkpoint: Checkpoint, dtype: torch.dtype):
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


def measure_noise_floor(build, checkpoint: Checkpoint, ids: torch.Tensor, *, model_types: dict[str, str] | None = None,
                        factor: float = NOISE_FACTOR, floor: float = BOUND_FLOOR) -> NoiseFloor:
    """The reference's own float32 noise on ``checkpoint`` for the prompt ``ids`` (1, T), and the bound from it.

    ``build``: the family's parity reference (``build(checkpoint, dtype) -> run(ids) -> (logits (T, V),
    hidden states)``, :func:`lollm.proof.parity.default_reference` by default); ``model_types``: for
    types transformers does not know, the type whose class stands for each. The two equivalent
    runs (:class:`NoiseFloor`): transformers' model of the checkpoint at float64 (its mixtures of
    experts through the plain per-expert loop: the grouped matmul has no float64), and the
    float32 reference as the first row of a batch of two.
    """
    from lollm.proof.parity import load_reference_model

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


def _with_layer_types(config: dict[str, Any], model_types: dict[str, str] | None = None) -> dict[str, Any]:
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

        from lollm.proof.parity import relabel_model_types

        raw = relabel_model_types(dict(text), model_types or {})
        types = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw).layer_types
    except Exception:  # no transformers, a type it does not know, no layer_types attribute: keep the file's view
        return config
    return {**text, "layer_types": list(types)} if isinstance(types, list) else config


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each row of two (T, V) tensors, in float64."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def _cache_tensors(obj: Any, path: str = "cache", depth: int = 0, seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of at least 2 dimensions reachable from ``obj`` (attributes, lists, dicts), with its path."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 2:
            yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _cache_tensors(value, f"{path}[{key!r}]", depth + 1, seen)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _cache_tensors(value, f"{path}[{i}]", depth + 1, seen)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) + [s for s in getattr(type(obj), "__slots__", ()) if isinstance(s, str)]
        for name in names:
            if hasattr(obj, name):
                yield from _cache_tensors(getattr(obj, name), f"{path}.{name}", depth + 1, seen)


def _storage_map(cache: Any) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {path: (t.data_ptr(), tuple(t.shape)) for path, t in _cache_tensors(cache)}


def _rewrite_checkpoint(src: Path, dst: Path, edit) -> Path:
    """Copy the checkpoint folder ``src`` to ``dst`` with its weights rewritten as one model.safetensors.

    ``edit`` receives the ``{name: tensor}`` dict of every tensor and changes it in place.
    """
    from safetensors.torch import save_file

    source = load_checkpoint(src).weights
    tensors = {name: source.read(name) for name in source.names()}
    edit(tensors)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def check_prompt_cache_turns(
    model: Any,
    *,
    vocab: int | None = None,
    first: int = 40,
    message: int = 12,
    long_message: int = 30,
    answer: int = 8,
    speculative_tokens: int = 0,
    max_snapshots: int = 4,
    seed: int = 0,
) -> list[Any]:
    """Greedy turns of a conversation with a prompt cache each equal a cold run of the same prompt.

    The conversation is made of random token ids (in ``[3, vocab)``: clear of the
    usual special ids) with no stop ids, so every answer has ``answer`` tokens:

    1. a first prompt of ``first`` ids                              (a cold start);
    2. turn 1 + its answer + ``message`` new ids                    (the cache continues);
    3. turn 2 + its answer + ``long_message`` new ids               (a longer suffix);
    4. turn 3 again, but with answer 2 cut after 2 tokens and another message
                                                                    (the prompts part inside answer 2);
    5. turn 4 again, unchanged                                      (regenerate: the same prompt);
    6. the first 5 ids of turn 1 and ``message`` others             (they part early).

    Every turn's new ids must equal those of ``generate`` without a prompt cache
    (``speculative_tokens`` as given for both). Returns each turn's
    :class:`lollm.generate.prompt_cache.CacheReuse`, for the caller to check how the
    cache was reused (that depends on what the family's cache can do).
    """
    from lollm.generate.loop import generate
    from lollm.generate.prompt_cache import PromptCache
    from lollm.generate.sampling import SamplingParams

    vocab = int(vocab or model.vocab_size)
    g = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    greedy = SamplingParams(temperature=0.0)
    # room for the longest turn (3) and its answer, with the drafts of a speculative step
    room = first + message + long_message + 3 * answer + speculative_tokens + 1
    cache = PromptCache(model, min(room, int(model.max_context)), max_snapshots=max_snapshots)
    records = []

    def turn(number: int, prompt: list[int]) -> list[int]:
        warm = generate(model, prompt, max_new_tokens=answer, sampling=greedy, prompt_cache=cache,
                        speculative_tokens=speculative_tokens)
        cold = generate(model, prompt, max_new_tokens=answer, sampling=greedy, speculative_tokens=speculative_tokens)
        assert warm.new_ids == cold.new_ids, (
            f"turn {number} ({len(prompt)} prompt ids, {cache.last.reused} reused by '{cache.last.how}'): "
            f"with the prompt cache {warm.new_ids}, cold {cold.new_ids}"
        )
        assert warm.reused_tokens == cache.last.reused
        records.append(cache.last)
        return warm.new_ids

    p1 = words(first)
    a1 = turn(1, p1)
    p2 = p1 + a1 + words(message)
    a2 = turn(2, p2)
    p3 = p2 + a2 + words(long_message)
    turn(3, p3)
    p4 = p2 + a2[:2] + words(message)
    turn(4, p4)
    turn(5, p4)
    turn(6, p1[:5] + words(message))
    return records


class FamilyConformance:
    """Inherit from this in a ``Test…`` class and provide the fixtures ``family_name`` and ``checkpoint_dir``.

    Class attributes to adjust:

    reference_available:     run the parity tests against transformers (it must know the architecture).
    sequence_length:         positions in the test prompt at least (kept below the model's context);
                             with a sliding window W, at least 3 W + 2 (see ``prompt_ids``).
    self_consistency_min_cosine: prefill-all versus prefill-then-decode, per position.
    self_consistency_max_abs_diff: the same, the largest |Δ| of a logit allowed at any position.
    parity_min_cosine:       ours versus the reference at fp32, per position.
    parity_max_abs_diff:     ours versus the reference at fp32: the largest |Δ| of a logit allowed at
                             any position, after a prefill and after a cached decode. None (the
                             default): set per checkpoint from the reference's own float32 noise,
                             ``max(parity_noise_factor * noise, parity_bound_floor)``
                             (:func:`measure_noise_floor`); a number: that fixed bound.
    parity_noise_factor, parity_bound_floor: see ``parity_max_abs_diff`` (5 and 1e-5).
    sensitivity_margin:      each perturbation of :data:`SENSITIVITY_CHECKS` must move the reference's
                             logits by more than ``sensitivity_margin`` times the parity bound.
    coverage_waivers:        feature name -> why this checkpoint cannot show it (the coverage test,
                             :mod:`lollm.testing.coverage`, then lets it pass; the reason is the
                             record of what the kit does not see).
    sensitivity_checks:      which perturbations the sensitivity test applies (those that apply to
                             the checkpoint: a config without RoPE scaling has no "rope_scaling").
    gguf_types:              the GGUF mode: ggml types (of ``lollm.testing.gguf_writer.GGUF_TYPES``) in which
                             the checkpoint is written as a GGUF the converter's way, loaded through
                             the family and compared with the reference on the same (dequantized)
                             weights, with the parity bounds; () (the default): no GGUF mode.
    reference_model_types:   for model types transformers does not know (a family copied by
                             ``lollm new-family``), the transformers model type whose class stands
                             for each; the sensitivity test perturbs that class.
    tensor_to_drop:          the tensor the "missing tensor" test removes (default: the first
                             one, in sorted order, that is not an embedding or an lm_head).
    """

    reference_available: bool = False
    sequence_length: int = SEQUENCE_LENGTH
    self_consistency_min_cosine: float = 0.9999
    self_consistency_max_abs_diff: float = 1e-3
    parity_min_cosine: float = 0.99999
    parity_max_abs_diff: float | None = None
    parity_noise_factor: float = NOISE_FACTOR
    parity_bound_floor: float = BOUND_FLOOR
    coverage_waivers: dict[str, str] = {}
    sensitivity_margin: float = 10.0
    sensitivity_checks: tuple[str, ...] = SENSITIVITY_CHECKS
    gguf_types: tuple[str, ...] = ()
    reference_model_types: dict[str, str] = {}
    tensor_to_drop: str | None = None

    # -- fixtures the plugin author provides ---------------------------------------

    @pytest.fixture
    def family_name(self) -> str:
        pytest.fail("FamilyConformance: define the fixture `family_name` (the Family.name to test) in your subclass",
                    pytrace=False)

    @pytest.fixture
    def checkpoint_dir(self) -> Path:
        pytest.fail("FamilyConformance: define the fixture `checkpoint_dir` (a tiny checkpoint folder with "
                    "config.json and model.safetensors) in your subclass", pytrace=False)

    # -- fixtures the kit builds from them (override if you must) -------------------

    @pytest.fixture
    def registry(self) -> Registry:
        """The installed plugins, read afresh (not the process-wide cache)."""
        return build_registry()

    @pytest.fixture
    def checkpoint(self, checkpoint_dir) -> Checkpoint:
        return load_checkpoint(Path(checkpoint_dir))

    @pytest.fixture
    def installed(self, registry: Registry, family_name: str) -> InstalledFamily:
        for entry in registry.families:
            if entry.family.name == family_name:
                return entry
        broken = "; ".join(f"{b.plugin} ({b.distribution}): {b.error}" for b in registry.broken) or "none"
        names = ", ".join(f.family.name for f in registry.families) or "none"
        pytest.fail(f"no installed family is named {family_name!r} (installed: {names}; broken plugins: {broken}). "
                    f"Is your distribution installed, with an entry point in the group {ENTRY_POINT_GROUP!r}?",
                    pytrace=False)

    @pytest.fixture
    def load(self, installed: InstalledFamily):
        """``load(checkpoint)`` with the family's loader, on the CPU at float32 (plugin contract 2)."""
        loader = installed.family.resolve("load")
        options = LoadOptions(device="cpu", dtype="float32", attn="sdpa", weights="float", quantization=Quantization("float"))

        def load(checkpoint: Checkpoint):
            return loader(checkpoint, options)

        return load

    @pytest.fixture
    def model(self, load, checkpoint: Checkpoint):
        return load(checkpoint)

    @pytest.fixture
    def sliding_window(self, checkpoint: Checkpoint) -> int | None:
        """The checkpoint's sliding window W (positions a sliding-window query sees), or None.

        Read from config.json (``sliding_window``, or ``text_config.sliding_window``), unless
        ``use_sliding_window`` is false. Override it when your family spells it otherwise.
        """
        return _sliding_window(checkpoint.config)

    @pytest.fixture
    def prompt_ids(self, model, sliding_window) -> torch.Tensor:
        """(1, T) deterministic random ids inside the vocabulary.

        T = ``sequence_length`` (72: decode steps past position 64, a prefill past a delta-rule
        chunk), or 3 W + 2 with a sliding window W when that is longer (so that prompts and chunks
        cross the window more than once), at most ``model.max_context - 4`` (room for the cache tests'
        decode steps after it).
        """
        wanted = self.sequence_length
        if sliding_window is not None and 3 * sliding_window + 2 <= MAX_WINDOWED_PROMPT:
            wanted = max(wanted, 3 * sliding_window + 2)
        T = max(2, min(wanted, int(model.max_context) - 4))
        g = torch.Generator().manual_seed(1234)
        return torch.randint(0, int(model.vocab_size), (1, T), generator=g)

    @pytest.fixture
    def parity_bound(self, installed, checkpoint, prompt_ids) -> float:
        """The largest |Δ| of a logit the parity tests allow: ``parity_max_abs_diff`` when set,
        else measured on this checkpoint and prompt (:func:`measure_noise_floor`)."""
        if not self.reference_available:  # the tests that ask for it skip, saying the same
            pytest.skip("reference_available = False: no transformers reference for this family")
        if self.parity_max_abs_diff is not None:
            return float(self.parity_max_abs_diff)
        floor = measure_noise_floor(self._reference_builder(installed), checkpoint, prompt_ids,
                                    model_types=self.reference_model_types, factor=self.parity_noise_factor,
                                    floor=self.parity_bound_floor)
        return floor.bound

    # -- 0. coverage: the checkpoint and the prompts can see every feature --------------

    def test_checkpoint_covers_every_feature(self, checkpoint, prompt_ids, sliding_window):
        """From config.json and the prompt schedule: every layer kind present, every window crossed
        twice, decode past position 64 and past a delta-rule chunk, soft-caps and scalars away from
        their neutral values (:func:`lollm.testing.coverage.check_coverage`). A blind spot fails,
        naming the feature and the config change that fixes it (or ``coverage_waivers`` records why not).
        The report is printed too: ``pytest -rP`` shows it when the test passes."""
        T = prompt_ids.shape[1]
        schedules = _schedules(T, sliding_window)
        longest = max(s[0] for s in schedules if len(s) > 1 and s[1] == 1)
        report = check_coverage(_with_layer_types(checkpoint.config, self.reference_model_types),
                                prompt_length=T, longest_prefill=longest)
        print(f"coverage report ({T}-position prompt, longest prefill before decode {longest}):\n{report.table()}")
        blind = report.blind(self.coverage_waivers)
        assert not blind, (
            "the tiny checkpoint or the prompts cannot see: "
            + "; ".join(f"{f.name} ({f.detail}) -- fix: {f.fix}" for f in blind)
            + ". A family with a bug there would pass the kit. Coverage report:\n" + report.table()
        )

    # -- 1. registration ------------------------------------------------------------

    def test_family_is_registered_and_serves_the_checkpoint(self, registry, installed, checkpoint, family_name):
        assert family_name == installed.family.name
        assert checkpoint.model_type in installed.family.model_types, (
            f"the checkpoint's model_type {checkpoint.model_type!r} is not among the family's "
            f"model_types {installed.family.model_types}"
        )
        routed = registry.route(checkpoint.model_type)  # raises on an unknown or doubly claimed type
        assert routed.family.name == family_name, f"{checkpoint.model_type!r} routes to {routed.family.name!r}"
        assert not [b for b in registry.broken if b.plugin == installed.plugin], registry.broken

    # -- 2. the plugin module is light ----------------------------------------------------

    def test_plugin_module_imports_no_torch(self, installed, family_name):
        eps = [ep for ep in md.entry_points(group=ENTRY_POINT_GROUP) if ep.name == installed.plugin]
        if not eps:
            pytest.skip(f"plugin {installed.plugin!r} is not installed through an entry point "
                        f"(registered directly), so there is no plugin module to import alone")
        ep = eps[0]
        code = textwrap.dedent(
            f"""
            import json, sys
            import importlib.metadata as md
            from lollm.load.plugins import build_registry
            ep = md.EntryPoint({ep.name!r}, {ep.value!r}, {ENTRY_POINT_GROUP!r})
            reg = build_registry(entry_points=[ep])
            print(json.dumps({{
                "families": [f.family.name for f in reg.families],
                "broken": [b.error for b in reg.broken],
                "heavy": sorted(m for m in ("torch", "transformers", "safetensors", "numpy") if m in sys.modules),
            }}))
            """
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert not result["broken"], result["broken"]
        assert family_name in result["families"]
        assert "torch" not in result["heavy"], (
            f"importing the plugin module {ep.value!r} and registering its families imported {result['heavy']}; "
            f"name the loader as a 'module:function' string and import torch only there"
        )

    # -- 3. the model protocol --------------------------------------------------------------

    def test_model_has_the_protocol_attributes(self, model, checkpoint):
        for name in ("vocab_size", "max_context", "num_layers"):
            value = getattr(model, name, None)
            assert isinstance(value, int) and not isinstance(value, bool) and value > 0, f"model.{name} = {value!r}"
        eos = getattr(model, "eos_token_ids", None)
        assert isinstance(eos, tuple) and all(isinstance(i, int) for i in eos), f"model.eos_token_ids = {eos!r}"
        assert callable(getattr(model, "new_cache", None)), "model.new_cache is missing"
        assert callable(model), "the model is not callable"
        if isinstance(model, torch.nn.Module):
            left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
            assert not left, f"tensors left on the meta device after load: {left[:8]}"
            wrong = [n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
            assert not wrong, f"asked for float32, got other dtypes for {wrong[:8]}"
            assert not any(p.requires_grad for p in model.parameters()), "parameters should not require grad"
        if isinstance(checkpoint.config.get("vocab_size"), int):
            assert model.vocab_size == checkpoint.config["vocab_size"]

    @torch.inference_mode()
    def test_forward_shapes_logits_to_keep_and_hidden_states(self, model, prompt_ids):
        T, V = prompt_ids.shape[1], model.vocab_size
        logits = model(prompt_ids, None)
        assert tuple(logits.shape) == (1, T, V), f"forward returned {tuple(logits.shape)}, expected {(1, T, V)}"
        assert logits.is_floating_point() and torch.isfinite(logits).all()
        last = model(prompt_ids, None, logits_to_keep=1)
        assert tuple(last.shape) == (1, 1, V)
        torch.testing.assert_close(last[0, -1], logits[0, -1], rtol=1e-4, atol=1e-4)
        three = model(prompt_ids, None, logits_to_keep=3)
        assert tuple(three.shape) == (1, 3, V)
        torch.testing.assert_close(three[0], logits[0, -3:], rtol=1e-4, atol=1e-4)

        hidden: list[torch.Tensor] = []
        again = model(prompt_ids, None, hidden_states=hidden)
        assert len(hidden) == model.num_layers + 1, (
            f"{len(hidden)} hidden states for {model.num_layers} layers; expected num_layers + 1 "
            f"(embeddings, each layer's output but the last, the final-normed last output)"
        )
        sizes = {tuple(h.shape) for h in hidden}
        assert len(sizes) == 1 and next(iter(sizes))[:2] == (1, T), f"hidden state shapes {sizes}"
        torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-5)

    @torch.inference_mode()
    def test_new_cache_and_forward_advance_the_length(self, model, prompt_ids):
        T = prompt_ids.shape[1]
        cache = model.new_cache(T + 3)
        assert cache.length == 0, f"a new cache has length {cache.length}"
        assert cache.max_tokens >= T + 3
        model(prompt_ids, cache, logits_to_keep=1)
        assert cache.length == T
        model(prompt_ids[:, :1], cache)
        assert cache.length == T + 1

    # -- 4. self-consistency ------------------------------------------------------------------

    @torch.inference_mode()
    def test_prefill_all_equals_prefill_then_decode(self, model, prompt_ids, sliding_window):
        T = prompt_ids.shape[1]
        full = model(prompt_ids, None)[0]
        cached = model(prompt_ids, model.new_cache(T), logits_to_keep=0)[0]
        self._assert_same(full, cached, "prefill with a cache vs without")
        # one token at a time from the start, half then one at a time, uneven chunks, and
        # (with a sliding window) prefills and chunks that end just before, at and after it
        for schedule in _schedules(T, sliding_window):
            cache = model.new_cache(T)
            rows, at = [], 0
            for size in schedule:
                rows.append(model(prompt_ids[:, at : at + size], cache)[0])
                at += size
            assert cache.length == T
            self._assert_same(full, torch.cat(rows), f"prefill-all vs chunks {_short(schedule)}")

    @staticmethod
    def _chunks(T: int) -> list[int]:
        return _fill(T, [3, 1])

    def _assert_same(self, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
        cos = _cosines(a, b)
        worst = int(cos.argmin())
        assert float(cos.min()) >= self.self_consistency_min_cosine, (
            f"{what}: cosine {float(cos[worst]):.7f} at position {worst} "
            f"(required {self.self_consistency_min_cosine})"
        )
        diff = (a.double() - b.double()).abs().amax(-1)
        over = (diff > self.self_consistency_max_abs_diff).nonzero().flatten().tolist()
        assert not over, (
            f"{what}: max |Δ| of the logits {float(diff.max()):.3e} at position {int(diff.argmax())} "
            f"(bound {self.self_consistency_max_abs_diff:g}; over it at positions {over})"
        )
        mismatched = (a.argmax(-1) != b.argmax(-1)).nonzero().flatten().tolist()
        assert not mismatched, f"{what}: argmax differs at positions {mismatched}"

    # -- 5. the cache is preallocated --------------------------------------------------------

    @torch.inference_mode()
    def test_cache_is_preallocated(self, model, prompt_ids):
        T = prompt_ids.shape[1]
        cache = model.new_cache(T + 4)
        before = _storage_map(cache)
        model(prompt_ids, cache, logits_to_keep=1)
        if not before:
            before = _storage_map(cache)  # a cache that allocates on the first forward, once
            if not before:
                pytest.skip("no tensor of 2+ dimensions is reachable from the cache's attributes, so its storage "
                            "cannot be checked; the data_ptr check is skipped")
        for step in range(4):
            model(prompt_ids[:, step : step + 1], cache)
            now = _storage_map(cache)
            assert now == before, (
                f"decode step {step} changed the cache's tensors (a per-step torch.cat?): "
                f"{sorted(set(now.items()) ^ set(before.items()))[:4]}"
            )

    # -- 6. strict loading --------------------------------------------------------------------

    def _droppable(self, names: list[str]) -> str:
        if self.tensor_to_drop is not None:
            assert self.tensor_to_drop in names, f"tensor_to_drop {self.tensor_to_drop!r} is not in the checkpoint"
            return self.tensor_to_drop
        candidates = [n for n in sorted(names) if not any(t in n for t in TIE_CANDIDATES)]
        return candidates[0] if candidates else sorted(names)[0]

    def test_missing_tensor_raises_naming_it(self, load, checkpoint_dir, tmp_path):
        names = load_checkpoint(Path(checkpoint_dir)).weights.names()
        victim = self._droppable(names)
        folder = _rewrite_checkpoint(Path(checkpoint_dir), tmp_path / "missing", lambda t: t.pop(victim))
        with pytest.raises(WeightsError) as info:
            load(load_checkpoint(folder))
        leaf = ".".join(victim.split(".")[-2:])
        assert victim in str(info.value) or leaf in str(info.value), (
            f"dropping {victim!r} raised a WeightsError that does not name it: {info.value}"
        )

    def test_unexpected_tensor_raises_naming_it(self, load, checkpoint_dir, tmp_path):
        def add(tensors):
            tensors[UNEXPECTED_TENSOR] = torch.zeros(3, 3)

        folder = _rewrite_checkpoint(Path(checkpoint_dir), tmp_path / "unexpected", add)
        with pytest.raises(WeightsError) as info:
            load(load_checkpoint(folder))
        assert UNEXPECTED_TENSOR in str(info.value), f"the WeightsError does not name the tensor: {info.value}"

    # -- 7. the shared loop drives the model ------------------------------------------------

    def test_shared_generate_loop_follows_the_logits(self, model, prompt_ids):
        from lollm.generate.loop import generate
        from lollm.generate.sampling import SamplingParams

        ids = prompt_ids[0].tolist()[:6]
        n = min(5, int(model.max_context) - len(ids))
        result = generate(model, ids, max_new_tokens=n, sampling=SamplingParams(temperature=0.0))
        assert len(result.new_ids) == n and result.stop_reason in {"max_new_tokens", "context"}
        # greedy decoding must pick the argmax of a plain forward over the growing sequence
        with torch.inference_mode():
            seq = list(ids)
            for step, got in enumerate(result.new_ids):
                logits = model(torch.tensor([seq]), None, logits_to_keep=1)[0, -1]
                top2 = logits.topk(2).values
                if float(top2[0] - top2[1]) > 1e-4:  # skip near-ties, where rounding may pick either
                    assert got == int(logits.argmax()), f"greedy step {step}: loop chose {got}, forward says {int(logits.argmax())}"
                seq.append(got)

    def test_load_and_cache_sizing_import_neither_dynamo_nor_sympy(self, load, checkpoint_dir):
        """Building the modules (lollm.load.build.on_meta) and sizing a cache (lollm.generate.memory) import neither
        torch._dynamo (with Triton: about 150 MB of resident memory) nor sympy (40 MB), which torch's
        Python reference ops pull in on first use; a lone ``lollm run`` process never needs them."""
        from lollm.generate.memory import cache_bytes

        # torch.fx.experimental.symbolic_shapes: where torch's reference ops reach sympy from
        with refused_imports("torch._dynamo", "sympy", "triton", "torch.fx.experimental.symbolic_shapes") as attempts:
            model = load(load_checkpoint(checkpoint_dir))
            need = cache_bytes(model, 37)
        assert not attempts, f"the load or the cache's sizing imported {attempts}"
        assert need is not None

    def test_cache_size_is_measured_exactly(self, model):
        """lollm.generate.memory sizes the cache on the meta device (no storage) before the loop allocates it:
        the bytes it finds are the bytes of the cache ``new_cache`` really builds."""
        from lollm.generate.memory import cache_bytes, tensor_bytes

        for positions in (1, 37):
            need = cache_bytes(model, positions)
            assert need is not None, f"new_cache({positions}) could not be built on the meta device"
            assert need == tensor_bytes(model.new_cache(positions)), f"cache for {positions} positions"

    def test_chunked_prefill_equals_whole(self, model, prompt_ids, sliding_window):
        """The shared loop's chunked prefill (lollm.generate.prefill) gives a whole prefill's logits and greedy tokens."""
        check_chunked_prefill_is_exact(model, prompt_ids[0].tolist(), window=sliding_window,
                                       max_abs_diff=self.self_consistency_max_abs_diff)

    # -- the batched engine (lollm.engine, lollm.testing.batching) --------------------------------

    def test_engine_requests_equal_solo_runs(self, model, prompt_ids):
        """Requests of different lengths, some arriving mid-decode, chunked prefill mixed with decode:
        each one's greedy tokens equal its run alone; the block pool is full again afterwards."""
        check_engine_equals_solo(model, prompt_ids[0].tolist(), tie_bound=self.self_consistency_max_abs_diff)

    def test_engine_releases_sliding_window_blocks(self, model, prompt_ids):
        """Sliding-window layers keep their keys in the engine's second pool and give back the blocks that
        left the window (a family without such layers gets no second pool)."""
        check_window_blocks_released(model, prompt_ids[0].tolist(), max_new_tokens=4)

    def test_engine_prefix_cache_hit_equals_cold_run(self, model, prompt_ids):
        """A prompt that shares cached blocks reuses them (with recurrent state: up to a snapshot) and equals a cold run."""
        check_prefix_cache_hit(model, prompt_ids[0].tolist())

    def test_engine_preemption_and_abort(self, model, prompt_ids):
        """Preempted and recomputed requests equal uninterrupted runs; an abort frees its blocks."""
        check_preemption_and_abort(model, prompt_ids[0].tolist())

    def test_prompt_cache_turns_equal_cold_runs(self, model):
        """A conversation through lollm.generate.prompt_cache: each turn equals a cold run of its prompt."""
        if int(model.max_context) < 48:
            pytest.skip("the test conversation needs a context of 48 positions")
        records = check_prompt_cache_turns(model, first=20, message=6, long_message=10, answer=4)
        # turn 2 continues turn 1 as it is: every family reuses that much
        assert records[1].how == "extend" and records[1].reused > 0, records[1]

    # -- 8. parity against the reference ------------------------------------------------------

    @staticmethod
    def _reference_builder(installed: InstalledFamily):
        from lollm.proof.parity import default_reference

        return installed.family.resolve("parity_reference") if installed.family.parity_reference else default_reference

    def _reference(self, installed: InstalledFamily, checkpoint: Checkpoint):
        return cached_reference(self._reference_builder(installed), checkpoint, torch.float32)

    def _check_parity(self, ours: torch.Tensor, ref: torch.Tensor, ids: list[int], what: str, bound: float,
                      hidden: list[torch.Tensor] | None = None, ref_hidden: list[torch.Tensor] | None = None) -> None:
        """Fail unless every position has the reference's argmax, cosine >= parity_min_cosine and
        max |Δ| <= ``bound`` (the parity_bound fixture); the message names the worst position (and
        the first diverging hidden state when both sides gave them)."""
        from lollm.proof.parity import compare_logits, layer_cosines

        stats = compare_logits(ours.float(), ref.float(), ids)
        bad = [s for s in stats if s.ours_argmax != s.ref_argmax or s.cosine < self.parity_min_cosine
               or s.max_abs_diff > bound]
        if not bad:
            return
        layers = ""
        if hidden and ref_hidden and len(ref_hidden) == len(hidden):
            cos = layer_cosines(hidden, ref_hidden)
            first = next((i for i, c in enumerate(cos) if c < self.parity_min_cosine), None)
            layers = f"; per hidden state min cosine {[round(c, 6) for c in cos]}, first diverging: {first}"
        worst = max(bad, key=lambda s: s.max_abs_diff)
        pytest.fail(
            f"{what}: parity failed at {len(bad)} of {len(stats)} positions {[s.position for s in bad][:16]} "
            f"(argmax, cosine < {self.parity_min_cosine} or max |Δ| > {bound:.2e}, the bound from the reference's "
            f"own float32 noise); "
            f"worst position {worst.position}: max |Δ| {worst.max_abs_diff:.3e}, cosine {worst.cosine:.7f}, "
            f"argmax ours {worst.ours_argmax} vs reference {worst.ref_argmax}{layers}",
            pytrace=False,
        )

    def test_parity_with_the_reference(self, model, installed, checkpoint, prompt_ids, parity_bound):
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        with torch.inference_mode():
            hidden: list[torch.Tensor] = []
            ours = model(prompt_ids, None, hidden_states=hidden)[0].float()
        ref_logits, ref_hidden = self._reference(installed, checkpoint)(prompt_ids)
        self._check_parity(ours, ref_logits, prompt_ids[0].tolist(), "prefill", parity_bound, hidden, ref_hidden)

    def test_cached_decode_matches_the_reference(self, model, installed, checkpoint, prompt_ids, sliding_window,
                                                 parity_bound):
        """Ours through the cache (a prefill, then one token at a time; a prefill past a delta-rule
        chunk, then one at a time; chunks across the window) equals the reference's prefill of the
        whole prompt, position by position."""
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        T = prompt_ids.shape[1]
        ref_logits, _ = self._reference(installed, checkpoint)(prompt_ids)
        first = max(1, min(T - 1, sliding_window - 1)) if sliding_window else max(1, T // 2)
        schedules = [[first] + [1] * (T - first)]
        if T > DELTA_RULE_CHUNK + 2:
            schedules.append([DELTA_RULE_CHUNK + 1] + [1] * (T - DELTA_RULE_CHUNK - 1))
        if sliding_window:
            schedules.append(_fill(T, [sliding_window + 1]))
        with torch.inference_mode():
            for schedule in schedules:
                cache = model.new_cache(T)
                rows, at = [], 0
                for size in schedule:
                    rows.append(model(prompt_ids[:, at : at + size], cache)[0].float())
                    at += size
                self._check_parity(torch.cat(rows), ref_logits, prompt_ids[0].tolist(),
                                   f"cached forward in chunks {_short(schedule)} vs the reference's prefill", parity_bound)

    def test_reference_checkpoint_is_sensitive(self, checkpoint, prompt_ids, parity_bound):
        """The tiny checkpoint can tell a right model from a wrong one.

        Each perturbation of :data:`SENSITIVITY_CHECKS` that applies to the checkpoint is made
        to the *reference* (transformers, same weights, one config value or attention scale
        changed) and must move its logits by more than ``sensitivity_margin`` times the parity
        bound at some position; otherwise a family with that bug would pass
        the parity tests above, and this test fails the checkpoint, naming what it cannot see.

        The reference here is always transformers' model of the checkpoint (a family's own
        ``parity_reference`` cannot be perturbed; ``reference_model_types`` names the class for a
        model type transformers does not know); ``sensitivity_checks = ()`` turns the test off.
        """
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        moved = reference_sensitivity(checkpoint, prompt_ids, self.sensitivity_checks, self.reference_model_types)
        if not moved:
            pytest.skip(f"none of the perturbations {self.sensitivity_checks} applies to this checkpoint's config")
        need = self.sensitivity_margin * parity_bound
        weak = {name: d for name, d in moved.items() if not d > need}
        assert not weak, (
            "the tiny checkpoint is insensitive to "
            + "; ".join(f"{name} ({SENSITIVITY_CHECKS_HELP[name.split(' ')[0]]}: the reference's logits moved by "
                        f"{d:.3e} at most)" for name, d in weak.items())
            + f"; each must move them by more than {need:.3e} ({self.sensitivity_margin:g} x the parity bound), "
            f"or a family with that bug passes the parity tests. Make the checkpoint more sensitive: "
            f"write_tiny_checkpoint(..., init_std=lollm.testing.tiny.SENSITIVE_INIT_STD), "
            f"rms_norm_eps=SENSITIVE_NORM_EPS in its config, a sliding window under a third of the prompt "
            f"(prompt: {prompt_ids.shape[1]} positions); moved by: "
            + ", ".join(f"{k} {v:.3e}" for k, v in moved.items())
        )

    # -- 9. the GGUF mode ------------------------------------------------------------------------

    def test_gguf_parity_with_the_reference(self, load, installed, checkpoint_dir, prompt_ids, sliding_window, tmp_path,
                                            parity_bound):
        """The checkpoint as a GGUF of each of ``gguf_types`` (:func:`lollm.testing.gguf_writer.write_tiny_gguf`,
        the converter's names, metadata and quirks) loads through the family and matches the
        reference run on the weights as the file holds them, after a prefill and through the cache."""
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        if not self.gguf_types:
            pytest.skip("gguf_types = (): the GGUF mode is off for this family; set gguf_types = (\"F32\", \"F16\", "
                        "\"Q8_0\", \"Q4_0\") (any subset) on the test class to turn it on")
        from lollm.testing.gguf_writer import write_tiny_gguf

        T = prompt_ids.shape[1]
        first = max(1, min(T - 1, sliding_window - 1)) if sliding_window else max(1, T // 2)
        for ggml_type in self.gguf_types:
            path = write_tiny_gguf(checkpoint_dir, tmp_path / f"tiny-{ggml_type}.gguf", ggml_type,
                                   reference_dir=tmp_path / f"reference-{ggml_type}")
            gguf_checkpoint = load_checkpoint(path)
            assert gguf_checkpoint.fmt == "gguf", f"{path} was read as {gguf_checkpoint.fmt!r}"
            model = load(gguf_checkpoint)
            ref_logits, ref_hidden = self._reference(installed, load_checkpoint(tmp_path / f"reference-{ggml_type}"))(prompt_ids)
            ids = prompt_ids[0].tolist()
            with torch.inference_mode():
                hidden: list[torch.Tensor] = []
                ours = model(prompt_ids, None, hidden_states=hidden)[0].float()
                self._check_parity(ours, ref_logits, ids, f"GGUF {ggml_type}: prefill", parity_bound, hidden, ref_hidden)
                cache = model.new_cache(T)
                rows = [model(prompt_ids[:, :first], cache)[0].float()]
                rows += [model(prompt_ids[:, t : t + 1], cache)[0].float() for t in range(first, T)]
            self._check_parity(torch.cat(rows), ref_logits, ids, f"GGUF {ggml_type}: prefill of {first}, then decode",
                               parity_bound)


def check_speculation_is_exact(model: Any, prompt: list[int], *, max_new_tokens: int = 24, draft_tokens: int = 4,
                               seed: int = 7) -> dict[str, tuple[int, int]]:
    """Speculative decoding (prompt lookup, and a scripted drafter) gives plain decoding's tokens and cache.

    Every drafter goes through the one verify path (``lollm.generate.loop._speculative_steps``);
    these runs compare it with plain decoding on ``model``, token for token:

    * greedy, with :class:`lollm.generate.drafting.PromptLookupDrafter` down to 1-grams (its drafts come
      from ``prompt`` and the output so far: accepted, rejected, or none at all);
    * greedy, with a *scripted* drafter that proposes the plain run's own continuation
      but with one token in three changed, so that every run has accepted drafts, rejected
      drafts, and steps that end on either;
    * sampled (temperature 1, ``seed``), with the scripted drafter made from the plain
      sampled continuation: a seeded sampler must draw the same tokens.

    After each speculative run, the cache it leaves holds exactly prompt + new ids - 1
    positions, and one more forward of the last new id on it gives the logits (argmax
    and values within 1e-3) that a full forward of the whole sequence gives (an
    independent route). Returns ``{run: (drafted, accepted)}`` for the caller's own
    assertions. AssertionError names the run that differs.
    """
    from lollm.generate.drafting import PromptLookupDrafter
    from lollm.generate.loop import generate
    from lollm.generate.sampling import SamplingParams

    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed)
    counts = {}
    for name, sampling in (("greedy", greedy), ("sampled", sampled)):
        plain = generate(model, prompt, max_new_tokens=max_new_tokens, sampling=sampling)
        drafters = {"scripted": _scripted_drafter(prompt, plain.new_ids, draft_tokens, int(model.vocab_size))}
        if sampling is greedy:
            drafters["prompt lookup"] = PromptLookupDrafter(tokens=draft_tokens, min_ngram=1)
        for kind, drafter in drafters.items():
            caches: list[Any] = []
            spy = _spying(drafter, caches)
            spec = generate(model, prompt, max_new_tokens=max_new_tokens, sampling=sampling, drafter=spy)
            run = f"{name} with the {kind} drafter"
            assert spec.new_ids == plain.new_ids, f"{run}: {spec.new_ids} != plain {plain.new_ids}"
            counts[f"{name}, {kind}"] = (spec.drafted, spec.accepted)
            if caches:
                _check_final_cache(model, caches[-1], prompt + plain.new_ids, run)
    return counts


def prefill_chunk_sizes(prompt_length: int, window: int | None = None) -> list[int]:
    """The chunk sizes :func:`check_chunked_prefill_is_exact` tries, each below ``prompt_length``: 7 (many
    uneven chunks), one past a delta-rule chunk, and with a sliding window W, W - 1 and W + 1 (chunks that
    end just before the window's edge, and chunks that straddle it)."""
    sizes = {7, DELTA_RULE_CHUNK + 1} | ({max(1, window - 1), window + 1} if window else set())
    return sorted(c for c in sizes if c < prompt_length)


@torch.inference_mode()
@contextlib.contextmanager
def refused_imports(*names: str):
    """Inside: importing any of ``names`` (or a submodule) raises ImportError, and its name is added to
    the yielded list. Modules already imported are hidden while inside (so a lazy ``import`` in a
    function reaches the refusal) and put back afterwards, untouched."""
    import importlib.abc

    attempts: list[str] = []

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if any(fullname == n or fullname.startswith(n + ".") for n in names):
                attempts.append(fullname)
                raise ImportError(f"{fullname} is refused here (lollm.testing.conformance.refused_imports)")
            return None

    hidden = {m: sys.modules.pop(m) for m in list(sys.modules) if any(m == n or m.startswith(n + ".") for n in names)}
    finder = Refuse()
    sys.meta_path.insert(0, finder)
    try:
        yield attempts
    finally:
        sys.meta_path.remove(finder)
        sys.modules.update(hidden)


def check_chunked_prefill_is_exact(model: Any, prompt: list[int], *, window: int | None = None,
                                   max_new_tokens: int = 6, max_abs_diff: float = 1e-3) -> list[int]:
    """A prefill run in chunks (:data:`lollm.generate.prefill.PREFILL_CHUNK_TOKENS` set small) equals a whole one.

    For each size of :func:`prefill_chunk_sizes`: :func:`lollm.generate.prefill.run_prompt` over ``prompt``
    gives the last position's logits of a whole prefill (same argmax, max |Δ| <= ``max_abs_diff``)
    and a cache of ``len(prompt)`` positions, and :func:`lollm.generate.loop.generate` (greedy,
    ``max_new_tokens``) gives the whole prefill's tokens. The constant is restored afterwards.
    Returns the chunk sizes tried; AssertionError names the one that differs.
    """
    import lollm.generate.prefill
    from lollm.generate.loop import generate
    from lollm.generate.sampling import SamplingParams

    T, saved = len(prompt), lollm.generate.prefill.PREFILL_CHUNK_TOKENS
    n = min(max_new_tokens, int(model.max_context) - T)
    greedy = SamplingParams(temperature=0.0)

    def run(chunk: int) -> tuple[torch.Tensor, list[int]]:
        lollm.generate.prefill.PREFILL_CHUNK_TOKENS = chunk
        try:
            cache = model.new_cache(T)
            logits = lollm.generate.prefill.run_prompt(model, prompt, cache, next(model.parameters()).device)[0, -1].double()
            assert cache.length == T, f"chunks of {chunk}: the cache holds {cache.length} positions, not {T}"
            return logits, generate(model, prompt, max_new_tokens=n, sampling=greedy).new_ids
        finally:
            lollm.generate.prefill.PREFILL_CHUNK_TOKENS = saved

    whole_logits, whole_ids = run(T)
    sizes = prefill_chunk_sizes(T, window)
    for chunk in sizes:
        logits, new_ids = run(chunk)
        diff = float((logits - whole_logits).abs().max())
        assert int(logits.argmax()) == int(whole_logits.argmax()) and diff <= max_abs_diff, (
            f"prefill of {T} positions in chunks of {chunk}: max |Δ| of the last logits {diff:.3e} "
            f"(bound {max_abs_diff:g}), argmax {int(logits.argmax())} vs whole {int(whole_logits.argmax())}")
        assert new_ids == whole_ids, f"chunks of {chunk}: greedy tokens {new_ids} != the whole prefill's {whole_ids}"
    return sizes


def _scripted_drafter(prompt: list[int], continuation: list[int], tokens: int, vocab: int) -> Any:
    """A drafter that proposes ``continuation`` where it goes, every third draft made wrong (+1 mod vocab)."""
    from lollm.generate.drafting import Drafter

    truth = list(prompt) + list(continuation)

    class Scripted(Drafter):
        name = "scripted"

        def propose(self, model, cache, history, num_tokens):
            at = len(history)
            out = truth[at : at + num_tokens]
            return [(t + 1) % vocab if (at + i) % 3 == 0 else t for i, t in enumerate(out)]

    return Scripted(tokens=tokens)


def _spying(drafter: Any, caches: list[Any]) -> Any:
    """``drafter``, also recording the cache object each ``propose`` is given (the generation's main cache)."""
    inner = drafter

    class Spy(type(drafter)):
        def propose(self, model, cache, history, num_tokens):
            if not caches or caches[-1] is not cache:
                caches.append(cache)
            return inner.propose(model, cache, history, num_tokens)

    fields = {k: getattr(drafter, k) for k in getattr(drafter, "__dataclass_fields__", {})}
    return Spy(**fields)


def _check_final_cache(model: Any, cache: Any, sequence: list[int], run: str) -> None:
    """``cache`` holds ``sequence[:-1]``: its length, and the next forward matches a full forward."""
    assert cache.length == len(sequence) - 1, f"{run}: the cache ends at {cache.length} positions, plain decoding " \
                                              f"leaves {len(sequence) - 1}"
    with torch.inference_mode():
        nxt = model(torch.tensor([sequence[-1:]]), cache)[0, -1].float()
        full = model(torch.tensor([sequence]))[0, -1].float()
    assert int(nxt.argmax()) == int(full.argmax()) and torch.allclose(nxt, full, atol=1e-3, rtol=1e-3), (
        f"{run}: the cache left at the end gives other logits than a full forward "
        f"(max |diff| {float((nxt - full).abs().max()):.2e})")


def repeating_prompt(vocab: int = 500, *, phrase: int = 10, repeats: int = 3, seed: int = 0) -> list[int]:
    """Ids in ``[3, vocab)``: every one of them once (shuffled), then a ``phrase`` of random ids said
    ``repeats`` times, each time followed by 3 other ids, then the phrase's first 3 ids once more.

    A prompt in which n-grams recur and every id occurs, so that prompt lookup (down to
    1-grams) finds drafts, right or wrong, at every decode step.
    """
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(3, vocab, (phrase + 3 * repeats,), generator=g).tolist()
    said = words[:phrase]
    tour = (torch.randperm(vocab - 3, generator=g) + 3).tolist()
    return tour + [i for r in range(repeats) for i in said + words[phrase + 3 * r : phrase + 3 * r + 3]] + said[:3]
