"""The conformance kit's checks of the model itself: its protocol, self-consistency, cache and strict loading.

Sections 3 to 6 of :class:`lollm.testing.conformance.FamilyConformance` (which inherits
:class:`ModelChecks`): the attributes and forward shapes of :mod:`lollm.model`'s protocol,
prefill-all equals prefill-then-decode, a preallocated cache, and a missing or unexpected
tensor raising :class:`~lollm.errors.WeightsError` naming it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from safetensors.torch import save_file

from lollm.errors import WeightsError
from lollm.load.loader import load_checkpoint
from lollm.model import Cache
from lollm.testing.schedules import chunk_schedules, short_schedule

#: Name of the extra tensor the "unexpected tensor" test adds to a copy of the checkpoint.
UNEXPECTED_TENSOR = "lollm_conformance.unexpected_tensor.weight"
#: Substrings of tensor names that may be legitimately absent (tied embeddings);
#: the "missing tensor" test does not drop those unless told to.
TIE_CANDIDATES = ("lm_head", "embed", "wte", "tok_embeddings", "output.weight")


def _cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each row of two (T, V) tensors, in float64."""
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def _cache_tensors(obj: object, path: str = "cache", depth: int = 0, seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
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


def _storage_map(cache: Cache) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{path: (data_ptr, shape)} of every tensor of the cache (:func:`_cache_tensors`): equal maps, the same storage."""
    return {path: (t.data_ptr(), tuple(t.shape)) for path, t in _cache_tensors(cache)}


def _rewrite_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> Path:
    """Copy the checkpoint folder ``src`` to ``dst`` with its weights rewritten as one model.safetensors.

    ``edit`` receives the ``{name: tensor}`` dict of every tensor and changes it in place.
    """
    source = load_checkpoint(src).weights
    tensors = {name: source.read(name) for name in source.names()}
    edit(tensors)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


class ModelChecks:
    """Sections 3 to 6 of the kit; the fixtures and class attributes they use are :class:`FamilyConformance`'s."""

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
        for schedule in chunk_schedules(T, sliding_window):
            cache = model.new_cache(T)
            rows, at = [], 0
            for size in schedule:
                rows.append(model(prompt_ids[:, at : at + size], cache)[0])
                at += size
            assert cache.length == T
            self._assert_same(full, torch.cat(rows), f"prefill-all vs chunks {short_schedule(schedule)}")

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

