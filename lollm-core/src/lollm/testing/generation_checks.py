"""The conformance kit's checks of generation: the shared loop, speculation, chunked prefill, the
prompt cache and the batched engine.

Section 7 of :class:`lollm.testing.conformance.FamilyConformance` (which inherits
:class:`GenerationChecks`), and the checks a family's own tests call alone
(:func:`check_speculation_is_exact`, :func:`check_chunked_prefill_is_exact`,
:func:`check_prompt_cache_turns`, with :func:`repeating_prompt` to feed them).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys

import pytest
import torch

from lollm.generate import prefill
from lollm.generate.drafting import Drafter, PromptLookupDrafter
from lollm.generate.loop import generate
from lollm.generate.memory import cache_bytes, tensor_bytes
from lollm.generate.prompt_cache import CacheReuse, PromptCache
from lollm.load.loader import load_checkpoint
from lollm.model import Cache, CausalLM
from lollm.sampling_params import SamplingParams
from lollm.engine.engine import EngineConfig
from lollm.load.options import LoadOptions
from lollm.load.quantized import Quantization
from lollm.testing.batching import (check_batch_invariance, check_engine_equals_solo, check_preemption_and_abort,
                                    check_prefix_cache_hit, check_window_blocks_released, invariance_arrivals,
                                    mixed_prompts)
from lollm.testing.coverage import DELTA_RULE_CHUNK


def float_matmuls(model: torch.nn.Module) -> list[str]:
    """The float matmuls a model loaded with int8 weights still runs over an engine step's rows: its ``nn.Linear``
    modules (a packed layer is not one) and its parameters of 3 or more dimensions (fused experts)."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return names + [name for name, p in model.named_parameters() if p.is_floating_point() and p.dim() >= 3]


def check_prompt_cache_turns(
    model: CausalLM,
    *,
    vocab: int | None = None,
    first: int = 40,
    message: int = 12,
    long_message: int = 30,
    answer: int = 8,
    speculative_tokens: int = 0,
    max_snapshots: int = 4,
    seed: int = 0,
) -> list[CacheReuse]:
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


class GenerationChecks:
    """Section 7 of the kit and its engine tests; the fixtures and class attributes they use are
    :class:`FamilyConformance`'s."""

    # -- 7. the shared loop drives the model ------------------------------------------------

    def test_shared_generate_loop_follows_the_logits(self, model, prompt_ids):
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
        # torch.fx.experimental.symbolic_shapes: where torch's reference ops reach sympy from
        with refused_imports("torch._dynamo", "sympy", "triton", "torch.fx.experimental.symbolic_shapes") as attempts:
            model = load(load_checkpoint(checkpoint_dir))
            need = cache_bytes(model, 37)
        assert not attempts, f"the load or the cache's sizing imported {attempts}"
        assert need is not None

    def test_cache_size_is_measured_exactly(self, model):
        """lollm.generate.memory sizes the cache on the meta device (no storage) before the loop allocates it:
        the bytes it finds are the bytes of the cache ``new_cache`` really builds."""
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

    def test_engine_is_batch_invariant(self, installed, checkpoint, prompt_ids):
        """With packed int8 weights (lollm's native kernel), every logit a request samples from is the same alone
        and batched, bit for bit: five requests of mixed lengths, two arriving mid-decode, prompts cut into
        chunks by the token budget (lollm.testing.batching.check_batch_invariance). A family that keeps float
        matmuls over the step's rows runs it on ``batch_invariance_weights`` within ``batch_invariance_bound``."""
        from lollm import native

        if native.block_int8_op() is None:
            pytest.fail(f"batch invariance needs lollm's native kernel: {native.status()}")
        load = installed.family.resolve("load")
        model = load(checkpoint, LoadOptions(device="cpu", dtype="float32", attn="sdpa", weights="quantized",
                                             quantization=Quantization("int8")))
        weights, bound = self.batch_invariance_weights, self.batch_invariance_bound
        if weights is None:  # int8 where every matmul packs; a float matmul left over the step's rows: float weights
            weights = "float" if float_matmuls(model) else "int8"
        if bound is None:
            bound = 0.0 if weights == "int8" else self.self_consistency_max_abs_diff
        if weights == "float":
            model = load(checkpoint, LoadOptions(device="cpu", dtype="float32", attn="sdpa", weights="float",
                                                 quantization=Quantization("float")))
        prompts = mixed_prompts(prompt_ids[0].tolist())
        n = max(1, min(6, int(model.max_context) - max(len(p) for p in prompts) - 1))
        config = EngineConfig(kv_blocks=256, block_size=4, max_sequences=8, max_batch_tokens=12)
        check_batch_invariance(model, invariance_arrivals(prompts, n, late_every=2), config, bound=bound)

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


def check_speculation_is_exact(model: CausalLM, prompt: list[int], *, max_new_tokens: int = 24, draft_tokens: int = 4,
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
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed)
    counts = {}
    for name, sampling in (("greedy", greedy), ("sampled", sampled)):
        plain = generate(model, prompt, max_new_tokens=max_new_tokens, sampling=sampling)
        drafters = {"scripted": _scripted_drafter(prompt, plain.new_ids, draft_tokens, int(model.vocab_size))}
        if sampling is greedy:
            drafters["prompt lookup"] = PromptLookupDrafter(tokens=draft_tokens, min_ngram=1)
        for kind, drafter in drafters.items():
            caches: list[Cache] = []
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


def check_chunked_prefill_is_exact(model: CausalLM, prompt: list[int], *, window: int | None = None,
                                   max_new_tokens: int = 6, max_abs_diff: float = 1e-3) -> list[int]:
    """A prefill run in chunks (:data:`lollm.generate.prefill.PREFILL_CHUNK_TOKENS` set small) equals a whole one.

    For each size of :func:`prefill_chunk_sizes`: :func:`lollm.generate.prefill.run_prompt` over ``prompt``
    gives the last position's logits of a whole prefill (same argmax, max |Δ| <= ``max_abs_diff``)
    and a cache of ``len(prompt)`` positions, and :func:`lollm.generate.loop.generate` (greedy,
    ``max_new_tokens``) gives the whole prefill's tokens. The constant is restored afterwards.
    Returns the chunk sizes tried; AssertionError names the one that differs.
    """
    T, saved = len(prompt), prefill.PREFILL_CHUNK_TOKENS
    n = min(max_new_tokens, int(model.max_context) - T)
    greedy = SamplingParams(temperature=0.0)

    def run(chunk: int) -> tuple[torch.Tensor, list[int]]:
        prefill.PREFILL_CHUNK_TOKENS = chunk
        try:
            cache = model.new_cache(T)
            logits = prefill.run_prompt(model, prompt, cache, next(model.parameters()).device)[0, -1].double()
            assert cache.length == T, f"chunks of {chunk}: the cache holds {cache.length} positions, not {T}"
            return logits, generate(model, prompt, max_new_tokens=n, sampling=greedy).new_ids
        finally:
            prefill.PREFILL_CHUNK_TOKENS = saved

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


def _scripted_drafter(prompt: list[int], continuation: list[int], tokens: int, vocab: int) -> Drafter:
    """A drafter that proposes ``continuation`` where it goes, every third draft made wrong (+1 mod vocab)."""
    truth = list(prompt) + list(continuation)

    class Scripted(Drafter):
        name = "scripted"

        def propose(self, model: CausalLM, cache: Cache, history: list[int], num_tokens: int) -> list[int]:
            at = len(history)
            out = truth[at : at + num_tokens]
            return [(t + 1) % vocab if (at + i) % 3 == 0 else t for i, t in enumerate(out)]

    return Scripted(tokens=tokens)


def _spying(drafter: Drafter, caches: list[Cache]) -> Drafter:
    """``drafter``, also recording the cache object each ``propose`` is given (the generation's main cache)."""
    inner = drafter

    class Spy(type(drafter)):
        def propose(self, model: CausalLM, cache: Cache, history: list[int], num_tokens: int) -> list[int]:
            if not caches or caches[-1] is not cache:
                caches.append(cache)
            return inner.propose(model, cache, history, num_tokens)

    fields = {k: getattr(drafter, k) for k in getattr(drafter, "__dataclass_fields__", {})}
    return Spy(**fields)


def _check_final_cache(model: CausalLM, cache: Cache, sequence: list[int], run: str) -> None:
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
