"""The prompt cache on the hybrid cache: DeltaNet states cannot be cut back, so turns resume from snapshots.

Each turn of a conversation must equal a cold run of the same prompt, with and
without MTP self-speculative decoding; the reused prefix of turn 3 crosses the
delta rule's 64-token chunk boundary, and its 31-token suffix is prefilled in
chunked form from a non-zero state.
"""

from __future__ import annotations

import pytest
import torch

from lollm.generate.loop import generate
from lollm.generate.prompt_cache import PromptCache
from lollm.generate.sampling import SamplingParams
from lollm.testing.conformance import check_prompt_cache_turns

from lollm_qwen3_5.qwen3_5.kv import MAX_ROLLBACK_TOKENS

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
CHUNK = 64  # blocks.delta_rule_chunked's chunk_size


@pytest.mark.parametrize("draft_tokens", [0, 3], ids=["plain", "mtp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_turns_equal_cold_runs(family, draft_tokens, tiny_checkpoint, load_ours):
    model = load_ours(tiny_checkpoint(family, "text", mtp=True, lively=True))
    records = check_prompt_cache_turns(model, vocab=500, speculative_tokens=draft_tokens)
    how = [(r.how, r.reused) for r in records]
    # turn lengths: 40, 60 (40+8+12), 98 (60+8+30), 74 (60+2+12), 74, 17; each answer 8 tokens
    assert how == [
        ("cold", 0),
        ("extend", 47),  # a 13-token suffix: the short (recorded, recurrent) form
        ("extend", 67),  # a 31-token suffix: the chunked form, from the state after 67 tokens
        ("snapshot", 59),  # parts at 62, inside answer 2: the DeltaNet state cannot go back there
        ("snapshot", 73),  # the same prompt again: the snapshot before its last token
        ("cold", 0),
    ], how
    assert records[2].reused > CHUNK and records[2].prefilled > MAX_ROLLBACK_TOKENS


@pytest.mark.parametrize("family", FAMILIES)
def test_a_forward_interrupted_mid_layer_is_never_reused(family, tiny_checkpoint, load_ours):
    """Ctrl-C inside a forward leaves some DeltaNet states updated and others not: never reuse them."""
    model = load_ours(tiny_checkpoint(family, "text", lively=True))
    greedy = SamplingParams(temperature=0.0)
    ids = torch.randint(3, 500, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = PromptCache(model, 256)
    first = generate(model, ids[:30], max_new_tokens=6, sampling=greedy, prompt_cache=cache)
    prompt = ids[:30] + first.new_ids + ids[30:40]

    last_layer = model.model.layers[-1]
    calls = {"n": 0}

    def interrupt(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # the second decode step, after every earlier layer ran
            raise KeyboardInterrupt
        return type(last_layer).forward(last_layer, *args, **kwargs)

    last_layer.forward = interrupt
    with pytest.raises(KeyboardInterrupt):
        generate(model, prompt, max_new_tokens=6, sampling=greedy, prompt_cache=cache)
    del last_layer.forward

    again = generate(model, prompt, max_new_tokens=6, sampling=greedy, prompt_cache=cache)
    cold = generate(model, prompt, max_new_tokens=6, sampling=greedy)
    assert again.new_ids == cold.new_ids
    assert cache.last.how == "snapshot" and cache.last.reused == len(prompt) - 1, cache.last


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mtp_head_cache_is_right_after_the_prompt_cache_went_back(family, tiny_checkpoint, load_ours):
    """After the prompt cache restored a snapshot, the MTP head's K/V rows equal a fresh run's.

    (Its drafts never change the output, so only this check sees a wrong MTP state: it would just
    lower the acceptance rate.)
    """
    model = load_ours(tiny_checkpoint(family, "text", mtp=True, lively=True))
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(11)
    words = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    cache = PromptCache(model, 256)
    p1 = words(30)
    generate(model, p1, max_new_tokens=10, sampling=greedy, prompt_cache=cache, speculative_tokens=3)
    # p2 parts from p1 at its last token: back to the snapshot just before it, where the MTP row
    # of the position before pairs with a token that is now different
    p2 = p1[:-1] + [(p1[-1] + 1) % 500] + words(5)
    a2 = generate(model, p2, max_new_tokens=10, sampling=greedy, prompt_cache=cache, speculative_tokens=3).new_ids
    assert (cache.last.how, cache.last.reused) == ("snapshot", len(p1) - 1)
    kv = cache.cache
    truth = p2 + a2
    with torch.inference_mode():
        L = kv.length
        model.draft(kv, truth[L], 1)  # catch up to the last position
        assert kv.mtp_length == L
        hidden: list[torch.Tensor] = []
        model(torch.tensor([truth[:L]]), hidden_states=hidden)
        fresh = model.new_cache(L)
        cos, sin = model.model.rotary_emb(torch.arange(L), torch.float32)
        model.mtp(model.model.embed_tokens(torch.tensor([truth[1 : L + 1]])), hidden[-1], cos, sin, fresh, 0)
    slot = kv.mtp_slot
    torch.testing.assert_close(kv.k[slot, :, :, :L], fresh.k[slot, :, :, :L], rtol=1e-3, atol=2e-4)
    torch.testing.assert_close(kv.v[slot, :, :, :L], fresh.v[slot, :, :, :L], rtol=1e-3, atol=2e-4)
