"""qwen3_5 and qwen3_5_moe in the batched engine (lollm.engine): each request equals its run alone.

A DeltaNet layer's memory is a state per sequence, not a list of keys: in an engine
step the conv and the delta rule run over each sequence's own rows, on its own state
slot (kv.py). These tests hold every request's greedy tokens to those of the same
request run alone (lollm.testing.batching), with prompts across the delta rule's
64-token chunk boundary, both in one engine chunk and split into chunks that cross it.
"""

from __future__ import annotations

import pytest
import torch

from lollm.engine import Engine, EngineConfig
from lollm.testing.batching import assert_same_greedy, pool_is_full, run_engine, solo

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
CHUNK = 64  # blocks.delta_rule_chunked's chunk_size
NEW_TOKENS = 6


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(model, engine: Engine, arrivals: list[tuple[int, list[int], int]]) -> tuple[dict, list[tuple]]:
    """Run ``arrivals`` through ``engine``; each request equals its lone run. Returns the records and
    each engine step's layout: (starts, counts) of its sequences."""
    steps = []
    hook = model.register_forward_pre_hook(lambda m, args: steps.append((args[1].batch.starts, args[1].batch.counts)))
    try:
        records = run_engine(engine, arrivals)
    finally:
        hook.remove()
    for (rid, req), (_, prompt, n) in zip(records.items(), arrivals):
        assert_same_greedy(model, prompt, req.tokens[req.prompt_len:], solo(model, prompt, n), f"request {rid}")
    pool_is_full(engine)
    return records, steps


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_prompt_in_one_engine_chunk_among_decodes(family, tiny_checkpoint, load_ours):
    """A 100-token prompt is prefilled up to position 96 (two delta-rule chunks, the second padded) in ONE
    engine step, beside short requests that already decode (the engine stops the chunk at the block
    boundary before the last token, where it saves the recurrent state); a request arrives mid-decode."""
    model = load_ours(tiny_checkpoint(family, "text", lively=True))
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=8, max_sequences=4, max_batch_tokens=256))
    arrivals = [(0, _prompt(5, 1), NEW_TOKENS), (0, _prompt(12, 2), NEW_TOKENS),
                (2, _prompt(CHUNK + 36, 3), NEW_TOKENS), (4, _prompt(7, 4), NEW_TOKENS)]
    _, steps = _check(model, engine, arrivals)
    assert any(0 in starts and CHUNK + 32 in counts for starts, counts in steps), steps  # one step, from 0


@pytest.mark.parametrize("family", FAMILIES)
def test_long_prompts_split_into_chunks_across_the_delta_rule_chunk(family, tiny_checkpoint, load_ours):
    """A token budget of 24 splits a 90-token prompt into engine chunks of at most 24 tokens (one of
    them from 48 to 72, across position 64), each run from the state the last one left; the others
    decode meanwhile, and a request arrives while the long one is still in prefill."""
    model = load_ours(tiny_checkpoint(family, "text", lively=True))
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4, max_sequences=4, max_batch_tokens=24))
    arrivals = [(0, _prompt(CHUNK + 26, 5), NEW_TOKENS), (0, _prompt(3, 6), NEW_TOKENS),
                (1, _prompt(CHUNK + 6, 7), NEW_TOKENS), (2, _prompt(9, 8), NEW_TOKENS)]
    _, steps = _check(model, engine, arrivals)
    crossing = [(s, n) for starts, counts in steps for s, n in zip(starts, counts) if 0 < s < CHUNK < s + n]
    assert crossing and all(n > 1 for _, n in crossing), steps  # prefill chunks across position 64
    assert any(len(counts) > 1 and max(counts) > 1 for _, counts in steps), steps  # chunks beside decodes


@pytest.mark.parametrize("family", FAMILIES)
def test_sequences_decoding_together_keep_their_own_state(family, tiny_checkpoint, load_ours):
    """Two different prompts decode side by side in every step: a state shared or swapped between their
    slots would change their tokens. Their runs alone differ, so the check can see a leak."""
    model = load_ours(tiny_checkpoint(family, "text", lively=True))
    first, second = _prompt(20, 9), _prompt(20, 10)
    alone = solo(model, first, 2 * NEW_TOKENS), solo(model, second, 2 * NEW_TOKENS)
    assert alone[0] != alone[1], "the two prompts continue alike alone: a leak could not show"
    engine = Engine(model, EngineConfig(kv_blocks=64, block_size=4, max_sequences=2, max_batch_tokens=64))
    _, steps = _check(model, engine, [(0, first, 2 * NEW_TOKENS), (0, second, 2 * NEW_TOKENS)])
    # the prompts run up to the block boundary before their last token (16), then their last 4 tokens;
    # from then on every decode step runs both
    assert steps[1][1] == [4, 4] and all(counts == [1, 1] for _, counts in steps[2:]), steps


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_layers_follow_the_layer_types(family, tiny_checkpoint, load_ours):
    """Full attention layers page keys; DeltaNet layers keep float32 conv and delta-rule states per slot."""
    model = load_ours(tiny_checkpoint(family, "text"))
    c = model.config
    layers = model.cache_layers()
    assert [spec.kind for spec in layers] == ["full" if t == "full_attention" else "recurrent" for t in c.layer_types]
    cache = model.new_cache(8)
    for spec in layers:
        if spec.kind == "full":
            assert (spec.num_kv_heads, spec.head_dim) == (cache.k.shape[2], cache.k.shape[4])
        else:
            assert spec.state == {"conv": tuple(cache.conv.shape[1:]), "recurrent": tuple(cache.recurrent.shape[1:])}
            assert spec.state_dtype == torch.float32 == cache.recurrent.dtype
