"""The batched engine (lollm.engine) on a toy model: the pool, the layout, the scheduler, and requests
that equal their runs alone (greedy and seeded sampling), with and without a recurrent layer.

The same checks run against every real family through the conformance kit (lollm.testing.batching).
"""

from __future__ import annotations

import pytest
import torch

from _toy_batched import ToyLM
from lollm.batch import Batch, CacheLayer, token_positions
from lollm.engine import Engine, EngineConfig
from lollm.engine.blocks import BlockPool, block_hash
from lollm.errors import GenerationError
from lollm.generate.loop import generate
from lollm.generate.sampling import SamplingParams
from lollm.testing.batching import (GREEDY, assert_same_greedy, check_engine_equals_solo, check_preemption_and_abort,
                                    check_prefix_cache_hit, check_window_blocks_released, pool_is_full, run_engine)

PROMPT = [(7 * i + 3) % 40 for i in range(40)]


@pytest.fixture(params=[False, True], ids=["attention", "attention+recurrent"])
def toy(request):
    return ToyLM(recurrent=request.param)


# -- the pool and the layout -------------------------------------------------------------


def test_block_pool_counts_names_and_lru():
    pool = BlockPool(3, 4)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b, pool.num_free) == (0, 1, 1)
    name = block_hash(b"", [1, 2, 3, 4])
    pool.name(a, name)
    assert pool.lookup(name) == a and pool.refs[a] == 2  # shared
    pool.release(a)
    pool.release(a)
    assert pool.num_free == 2 and pool.lookup(name) == a  # free, but still named: revived
    pool.release(a)
    pool.release(b)
    # free order, least recently freed first: 2 (never used), a, b
    assert [pool.allocate(), pool.allocate()] == [2, a] and pool.lookup(name) is None  # a reused: its name is gone
    with pytest.raises(GenerationError, match="released more often"):
        pool.release(2) or pool.release(2)


def test_block_names_chain_the_prefix():
    first = block_hash(b"", [1, 2])
    assert block_hash(first, [3, 4]) != block_hash(block_hash(b"", [9, 9]), [3, 4])
    assert block_hash(first, [3, 4]) == block_hash(block_hash(b"", [1, 2]), [3, 4])


def test_batch_layout():
    batch = Batch(starts=[5, 0], counts=[1, 3], block_tables=[[2, 0], [1]], block_size=4, state_slots=[0, 1])
    assert batch.positions.tolist() == [5, 0, 1, 2]
    assert batch.slots.tolist() == [0 * 4 + 1, 1 * 4 + 0, 1 * 4 + 1, 1 * 4 + 2]  # position 5: block table[1] = 0, offset 1
    assert batch.last_rows.tolist() == [0, 3] and batch.segments() == [(0, 1), (1, 4)]
    assert token_positions(batch, 4).tolist() == [5, 0, 1, 2] and token_positions(3, 2).tolist() == [3, 4]
    with pytest.raises(ValueError, match="cannot hold"):
        Batch(starts=[4], counts=[1], block_tables=[[0]], block_size=4, state_slots=[0])


def test_cache_layer_checks():
    with pytest.raises(ValueError, match="kind"):
        CacheLayer("paged")
    with pytest.raises(ValueError, match="window"):
        CacheLayer("full", 2, 8, window=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        CacheLayer("sliding", 0, 8, window=4)


# -- requests equal their runs alone -----------------------------------------------------


def test_requests_equal_solo_runs(toy):
    records = check_engine_equals_solo(toy, PROMPT, max_new_tokens=8)
    assert len(records) == 5


def test_prefix_cache_hit(toy):
    req = check_prefix_cache_hit(toy, PROMPT)
    assert req.cached_tokens > 0  # with a recurrent state: up to a block with a snapshot


def test_a_recurrent_prefix_is_shared_only_where_a_snapshot_exists():
    """Prompt chunks of a recurrent model end on block boundaries, where the states are saved; a second
    prompt resumes from the deepest one it shares (not past it), and equals its run alone."""
    toy = ToyLM(recurrent=True)
    engine = Engine(toy, EngineConfig(kv_blocks=64, block_size=4, max_sequences=4, max_batch_tokens=10))
    first = PROMPT[:30]
    run_engine(engine, [(0, first, 2)])
    # chunks of 10 tokens stop at 8, 16, 24, 28 (block boundaries, the last one before the prompt's
    # last token), then 28..30; the decode step computes position 30 only: 4 snapshots
    assert len(engine.snapshots) == 4
    second = first[:27] + [(first[27] + 1) % toy.vocab_size] + first[28:]
    req = run_engine(engine, [(0, second, 4)])["req-1"]
    assert req.cached_tokens == 24  # the deepest shared block with a snapshot ends at 24 (they part at 27)
    again = run_engine(engine, [(0, first, 2)])["req-2"]
    assert again.cached_tokens == 28  # the same prompt again: up to the boundary before its last token
    assert req.tokens[req.prompt_len:] == generate(toy, second, max_new_tokens=4, sampling=GREEDY).new_ids


def test_without_snapshots_a_recurrent_model_shares_nothing():
    toy = ToyLM(recurrent=True)
    engine = Engine(toy, EngineConfig(kv_blocks=64, block_size=4, max_sequences=4, state_snapshots=0))
    run_engine(engine, [(0, PROMPT[:30], 2)])
    assert engine.snapshots is None and run_engine(engine, [(0, PROMPT[:30], 2)])["req-1"].cached_tokens == 0


def test_the_prefix_check_catches_a_state_not_restored(monkeypatch):
    """A mutant engine that attaches the cached blocks but leaves the recurrent state at zero fails the kit's check."""
    from lollm.engine.snapshots import StateSnapshots

    def from_zero(self, name, slot_states):
        for layer in slot_states:
            for tensor in layer.values():
                tensor.zero_()

    monkeypatch.setattr(StateSnapshots, "restore", from_zero)
    with pytest.raises(AssertionError, match="no near-tie"):
        check_prefix_cache_hit(ToyLM(recurrent=True), PROMPT)


def test_preemption_and_abort(toy):
    records = check_preemption_and_abort(toy, PROMPT)
    assert any(r.preemptions for r in records)


def test_seeded_sampling_equals_solo(toy):
    """Sampled requests (each its own seed, top-p, penalty) draw exactly the tokens they draw alone."""
    settings = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, repetition_penalty=1.0 + 0.1 * s) for s in range(4)]
    engine = Engine(toy, EngineConfig(kv_blocks=64, block_size=4, max_batch_tokens=10))
    ids = {engine.add_request(PROMPT[s:s + 12], sampling=p, max_new_tokens=10): (s, p) for s, p in enumerate(settings)}
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.step.token)
    for rid, (s, p) in ids.items():
        assert got[rid] == generate(toy, PROMPT[s:s + 12], max_new_tokens=10, sampling=p).new_ids, rid


def test_a_forward_of_many_sequences_is_one_call(toy):
    """The point of it all: four decoding requests cost one forward per step, not four."""
    calls = []
    toy.register_forward_hook(lambda module, args, kwargs_or_out: calls.append(args[0].shape[1]))
    engine = Engine(toy, EngineConfig(kv_blocks=64, block_size=4))
    for s in range(4):
        engine.add_request(PROMPT[s:s + 5], sampling=SamplingParams(temperature=0), max_new_tokens=6)
    while engine.has_unfinished():
        engine.step()
    if toy.recurrent:  # prompts cut at the block boundary before their last token (a snapshot point)
        assert calls == [16, 4] + [4] * 5  # 4 x 4 prompt tokens, 4 x the last one, then 4 rows per decode step
    else:
        assert calls == [20] + [4] * 5  # one prefill step of 4 x 5 tokens, then 4 rows per decode step


# -- refusals and finish reasons ---------------------------------------------------------


def test_add_request_refusals(toy):
    engine = Engine(toy, EngineConfig(kv_blocks=4, block_size=4))
    greedy = SamplingParams(temperature=0)
    with pytest.raises(GenerationError, match="empty"):
        engine.add_request([], sampling=greedy, max_new_tokens=1)
    with pytest.raises(GenerationError, match="cannot fit the KV pool"):
        engine.add_request(PROMPT[:14], sampling=greedy, max_new_tokens=8)
    with pytest.raises(GenerationError, match="max_new_tokens"):
        engine.add_request(PROMPT[:3], sampling=greedy, max_new_tokens=0)
    engine.add_request(PROMPT[:3], sampling=greedy, max_new_tokens=2, request_id="x")
    with pytest.raises(GenerationError, match="already"):
        engine.add_request(PROMPT[:3], sampling=greedy, max_new_tokens=2, request_id="x")
    with pytest.raises(GenerationError, match="no cache_layers"):
        Engine(torch.nn.Linear(2, 2))


def test_stop_ids_end_a_request(toy):
    greedy = SamplingParams(temperature=0)
    alone = generate(toy, PROMPT[:6], max_new_tokens=6, sampling=greedy).new_ids
    engine = Engine(toy, EngineConfig(kv_blocks=32, block_size=4))
    engine.add_request(PROMPT[:6], sampling=greedy, max_new_tokens=6, stop_ids={alone[2]})
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.step.token for o in outs] == alone[: alone.index(alone[2]) + 1] and outs[-1].step.finish == "eos"


def test_a_request_waiting_for_blocks_pins_none_of_them(toy):
    """A waiting request whose prompt starts with cached blocks takes them only when it is admitted: held
    while it waits, they kept a running request from growing (it preempted itself over and over)."""
    engine = Engine(toy, EngineConfig(kv_blocks=12, block_size=4, max_sequences=2, max_batch_tokens=8, state_snapshots=1))
    first = PROMPT[:17]
    run_engine(engine, [(0, first, 1)])  # its blocks stay cached
    long = [(t + 3) % toy.vocab_size for t in PROMPT[:30]]  # needs 11 of the 12 blocks by its end
    late = first + [5, 6, 7]  # shares first's cached blocks, and waits for the long one
    ids = {engine.add_request(long, sampling=GREEDY, max_new_tokens=12): (long, 12)}
    engine.step()
    ids[engine.add_request(late, sampling=GREEDY, max_new_tokens=3)] = (late, 3)
    got: dict[str, list[int]] = {}
    for _ in range(500):  # hang guard: the run needs about 30 steps
        if not engine.has_unfinished():
            break
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out.step.token)
    assert not engine.has_unfinished(), "the requests never finished: a waiting request starved the running one"
    for rid, (prompt, n) in ids.items():
        assert got[rid] == generate(toy, prompt, max_new_tokens=n, sampling=GREEDY).new_ids, rid
    assert engine.scheduler.pool.num_free == 12


# -- sliding-window layers: their own pool, blocks given back as the window moves on ----------------


def test_window_blocks_leave_with_the_window():
    windowed = ToyLM(recurrent=False, window=8)
    req = check_window_blocks_released(windowed, PROMPT)
    assert req is not None
    assert check_window_blocks_released(ToyLM(recurrent=False), PROMPT) is None  # no sliding layer: one pool
    check_engine_equals_solo(windowed, PROMPT)
    check_preemption_and_abort(windowed, PROMPT)


def test_a_prefix_hit_is_cut_back_to_where_its_window_blocks_are_cached():
    """The full layers' blocks of a prefix are cached, but the window pool has handed one of the blocks the
    new request's first window needs to someone else: the hit ends a block earlier, where the window's
    blocks are all there, and the request still equals its lone run."""
    windowed = ToyLM(recurrent=False, window=8)
    engine = Engine(windowed, EngineConfig(kv_blocks=64, block_size=4, max_sequences=2, max_batch_tokens=8))
    first = run_engine(engine, [(0, PROMPT[:37], 2)])["req-0"]
    names = [block_hash(b"", PROMPT[:4])]
    for i in range(1, 9):
        names.append(block_hash(names[-1], PROMPT[4 * i : 4 * i + 4]))
    window_pool = engine.scheduler.window_pool
    assert all(name in engine.scheduler.pool.by_name for name in names) and first.cached_tokens == 0
    block = window_pool.by_name.pop(names[8])  # as if the pool had handed block 8 of the window to another request
    del window_pool.name_of[block]
    second = PROMPT[:36] + [5, 6, 7]
    req = run_engine(engine, [(0, second, 3)])["req-1"]
    assert req.cached_tokens == 32, "the hit should stop where block 8's window copy went missing"
    assert_same_greedy(windowed, second, req.tokens[req.prompt_len:], generate(windowed, second, max_new_tokens=3,
                                                                             sampling=GREEDY).new_ids, "cut-back hit")
    pool_is_full(engine)


def test_a_batch_checks_its_window_tables():
    batch = Batch(starts=[8], counts=[1], block_tables=[[0, 1, 2]], block_size=4, state_slots=[0],
                  window_tables=[[-1, 5, 6]], window=4)
    assert batch.window_slots.tolist() == [6 * 4] and batch.tables_for(4) == [[-1, 5, 6]] and batch.tables_for(None) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="released for a window of 4"):
        batch.tables_for(8)
    with pytest.raises(ValueError, match="has no block for position 8"):
        Batch(starts=[8], counts=[1], block_tables=[[0, 1, 2]], block_size=4, state_slots=[0], window_tables=[[5, 6, -1]], window=4)


def test_metrics_show_the_window_pool_where_there_is_one():
    """`lollm serve`'s /metrics gains the window pool's gauges for a model with sliding-window layers."""
    from prometheus_client.parser import text_string_to_metric_families

    from lollm.serve.metrics import ServerMetrics

    def gauges(model):
        engine = Engine(model, EngineConfig(kv_blocks=32, block_size=4, max_sequences=2, max_batch_tokens=8))
        text = ServerMetrics(engine.stats, kv_blocks=True).render().decode()
        return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.type == "gauge"}

    windowed = gauges(ToyLM(recurrent=False, window=8))
    # 2 sequences x (window 8 - 1 + a step of 8 tokens, in blocks of 4, + 1) = 2 x 5 window blocks
    assert windowed["lollm_kv_window_blocks_total"] == 2 * 5 and windowed["lollm_kv_window_blocks_used"] == 0
    assert windowed["lollm_kv_blocks_total"] == 32
    assert "lollm_kv_window_blocks_total" not in gauges(ToyLM(recurrent=False))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_logit_in_a_greedy_batch_is_named_by_the_sampler(bad, monkeypatch):
    """The batch's one argmax for plain greedy rows checks each row's sum; a NaN or an infinity
    anywhere (here one logit of the last request's rows) must reach the request's own sampler, which
    names it, and never be picked as a token."""
    toy = ToyLM(recurrent=False)
    head = toy.head.forward

    def poisoned(x):
        y = head(x)
        y[..., -1, 5] = bad  # the last row: the last request's
        return y

    monkeypatch.setattr(toy.head, "forward", poisoned)
    engine = Engine(toy, EngineConfig(kv_blocks=32, block_size=4, max_sequences=4))
    for prompt in (PROMPT[:5], PROMPT[5:12]):
        engine.add_request(prompt, sampling=GREEDY, max_new_tokens=3)
    with pytest.raises(GenerationError, match="non-finite logits"):
        while engine.has_unfinished():
            engine.step()


def test_the_batch_argmax_breaks_ties_as_the_greedy_sampler_does():
    """Exactly equal best logits: the batch's pick is the first of them, as SamplingParams' greedy
    argmax picks alone (so a tie never parts the engine from the lone run)."""
    from types import SimpleNamespace

    from lollm.generate.sampling import Sampler

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    logits[0, [7, 30]] = 9.0
    logits[2] = 1.5  # every logit equal
    plan = [(SimpleNamespace(seq=SimpleNamespace(plain_greedy=True)), 0)] * 3
    picks = Engine._greedy_picks(plan, logits, [0, 1, 2])
    greedy = Sampler(GREEDY)
    none = torch.zeros(0, dtype=torch.long)
    assert picks == {b: greedy(logits[b], none) for b in range(3)} and picks[0] == 7 and picks[2] == 0
