"""gemma2, gemma3 and gemma4 in the batched engine (lollm.engine), with prompts longer than the window.

The kit's engine tests (lollm.testing.conformance) run gemma2 and gemma3 on one prompt
of 3 W + 2 positions. Here every request is longer than the sliding window, the token
budget cuts the prompts into chunks whose first queries see back across the window's
edge into keys an earlier chunk wrote to the paged pool, one request arrives while the
others decode, and the blocks (4 positions) never line up with the window (6). Each
request must still produce the greedy tokens it produces alone (lollm.generate.loop).

gemma4 has no kit subclass here (its tiny checkpoints are checked against the reference
in test_gemma_parity_tiny.py), so the kit's four engine checks run on it below.
"""

from __future__ import annotations

import pytest
import torch
from _gemma_testing import WINDOW, load_ours, prompt_ids

from lollm.engine import Engine, EngineConfig
from lollm.testing.batching import (assert_same_greedy, check_engine_equals_solo, check_preemption_and_abort,
                                    check_prefix_cache_hit, check_window_blocks_released, pool_is_full, run_engine,
                                    solo)

#: gemma2 (soft-caps), gemma3 (5 sliding : 1 global), gemma4 E2B (per-layer embeddings, KV-sharing
#: layers, global head dim 2x), gemma4 with K = V global layers of their own KV-head count.
MODELS = ["gemma2", "gemma3-1b", "gemma4-e2b-text", "gemma4-k-eq-v"]
GEMMA4 = ["gemma4-e2b-text", "gemma4-k-eq-v"]
#: Prompt lengths, all past the window and all different: 3W+2, 2W+1, W+3, and 4W+5 for the late one.
LENGTHS = [3 * WINDOW + 2, 2 * WINDOW + 1, WINDOW + 3, 4 * WINDOW + 5]
#: The step at which the fourth request arrives (the first one decodes by then: asserted below).
LATE = 6
#: Tokens per step: 7 is neither a multiple of the window nor of the block size.
BUDGET = 7
BLOCK_SIZE = 4
NEW_TOKENS = 2 * WINDOW  # the answers run past the window too


@pytest.mark.parametrize("name", MODELS)
def test_cache_layers_describe_what_each_update_writes(tiny, name):
    """cache_layers()[i] has the shape of the keys/values layer i hands to cache.update(i, ...), the
    window of a sliding layer; a "shared" layer is one that never calls update (gemma4's KV sharing)."""
    model = load_ours(tiny(name, "transformers5"))
    config, specs = model.config, model.cache_layers()
    assert len(specs) == config.num_hidden_layers
    cache = model.new_cache(32)
    written: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    update = cache.update

    def spy(layer, k, v):
        written[layer] = (tuple(k.shape), tuple(v.shape))
        return update(layer, k, v)

    cache.update = spy
    T = WINDOW + 3
    with torch.inference_mode():
        model(torch.tensor([prompt_ids(T)]), cache)
    for i, spec in enumerate(specs):
        if spec.kind == "shared":
            assert i not in written, f"layer {i} is 'shared' but wrote keys"
            continue
        want = (1, spec.num_kv_heads, T, spec.head_dim)
        assert written.get(i) == (want, want), f"layer {i}: {spec} but update got {written.get(i)}"
        sliding = config.layer_types[i] == "sliding_attention"
        assert spec.kind == ("sliding" if sliding else "full"), f"layer {i} is {config.layer_types[i]}, {spec}"
        assert spec.window == (config.sliding_window if sliding else None)
    if name in GEMMA4:
        heads = {(s.num_kv_heads, s.head_dim) for s in specs if s.stores_keys}
        assert len(heads) == 2, f"the tiny gemma4 should have two key shapes (sliding, global), got {heads}"
    if name == "gemma4-e2b-text":
        assert [s.kind for s in specs].count("shared") == config.num_kv_shared_layers > 0


def _layout_recorder(engine: Engine) -> list[list[tuple[str, int, int, int]]]:
    """Record each step's plan: per request (id, positions computed before, tokens now, prompt length)."""
    steps: list[list[tuple[str, int, int, int]]] = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        steps.append([(req.request_id, req.computed, n, req.prompt_len) for req, n in plan])
        return plan

    engine.scheduler.schedule = recording
    return steps


def _check_the_layout_proves_something(steps, late_id: str) -> None:
    """The steps chunked prompts across the window's edge, mixed them with decode, and the late
    request came in while another one decoded."""
    chunks = [(c, n) for step in steps for _, c, n, p in step if c < p]
    assert any(c >= WINDOW for c, _ in chunks), f"no prompt chunk began past the window: {chunks}"
    assert any(n > 1 for _, n in chunks[1:]), "no prompt was cut into chunks"
    first = next(step for step in steps if any(rid == late_id for rid, *_ in step))
    assert any(rid != late_id and c >= p for rid, c, _, p in first), f"the late request met no decode: {first}"
    assert any(any(c < p and n > 1 for _, c, n, p in step) and any(c >= p for _, c, _, p in step) for step in steps), \
        "no step mixed a prompt chunk with decode tokens"


@pytest.mark.parametrize("name", MODELS)
def test_engine_prompts_longer_than_the_window_equal_solo_runs(tiny, name):
    model = load_ours(tiny(name, "transformers5"))
    config = model.config
    if name == "gemma2":  # both soft-caps run in the engine step too
        assert config.attn_logit_softcapping and config.final_logit_softcapping
    if name == "gemma4-e2b-text":  # per-layer embeddings, per token, and KV-sharing layers on the pool
        assert config.hidden_size_per_layer_input > 0 and config.num_kv_shared_layers > 0
    prompts = [prompt_ids(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=BLOCK_SIZE, max_sequences=4,
                                        max_batch_tokens=BUDGET))
    steps = _layout_recorder(engine)
    arrivals = [(0, prompts[0], NEW_TOKENS), (0, prompts[1], NEW_TOKENS), (0, prompts[2], NEW_TOKENS),
                (LATE, prompts[3], NEW_TOKENS)]
    records = run_engine(engine, arrivals)
    assert list(records) == ["req-0", "req-1", "req-2", "req-3"]
    _check_the_layout_proves_something(steps, "req-3")
    for (rid, req), prompt in zip(records.items(), prompts):
        got = req.tokens[req.prompt_len:]
        assert len(got) == NEW_TOKENS, f"{rid}: {len(got)} tokens"
        assert_same_greedy(model, prompt, got, solo(model, prompt, NEW_TOKENS), f"{name} {rid} ({len(prompt)} tokens)")
    pool_is_full(engine)


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4_passes_the_kits_engine_checks(tiny, name):
    """The kit's four engine tests, on the kit's prompt length (3 W + 2)."""
    model = load_ours(tiny(name, "transformers5"))
    prompt = prompt_ids(3 * WINDOW + 2, seed=3)
    check_engine_equals_solo(model, prompt)
    req = check_prefix_cache_hit(model, prompt)
    assert req.cached_tokens > 0
    check_preemption_and_abort(model, prompt)
    assert check_window_blocks_released(model, prompt) is not None  # its shared layers read the window pool too


@pytest.mark.parametrize("name", MODELS)
def test_engine_logits_are_batch_invariant_on_packed_weights(tiny, name):
    """Batch invariance (docs/batching.md): with int8 weights (lollm's native kernel) and the native paged
    attention, each request's every logit is the same, bit for bit, beside the others (prompts past the window,
    chunked by a budget of 7, one arriving mid-decode) as alone: gemma2's soft-caps, gemma4's per-layer
    embeddings and KV-sharing layers included."""
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.testing.batching import check_batch_invariance

    model = open_model(str(tiny(name, "transformers5")), LoadOptions(device="cpu", dtype="float32", quantize="int8")).model
    assert model.weights_summary.packed > 0
    prompts = [prompt_ids(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    arrivals = [(0, prompts[0], 6), (0, prompts[1], 6), (0, prompts[2], 6), (LATE, prompts[3], 6)]
    check_batch_invariance(model, arrivals, EngineConfig(kv_blocks=128, block_size=BLOCK_SIZE, max_sequences=4,
                                                         max_batch_tokens=BUDGET))
