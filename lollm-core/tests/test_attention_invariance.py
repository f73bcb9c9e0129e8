"""Attention in an engine step, each query computed alone: lollm.native's paged kernel (attention.cpp).

On a CPU with the ``sdpa`` backend and the native library built, ``attend(start=Batch)`` runs every
sequence of a step through one kernel that computes each (query, head) by one fixed float32 order
(docs/batch-invariance.md, "Batch invariance in attention"). What is held here:

* the kernel against the attention arithmetic in float64 (``eager_probs``): GQA, windows (blocks
  released before the window are -1 and NaN), soft-caps, scales, mixed decode and prefill steps,
  bfloat16 pools; no slot it must not read (NaN) reaches an output;
* batch invariance with ``torch.equal``: a sequence's rows alone equal its rows beside other
  sequences of other lengths; a prompt's rows in chunks of 1, 7, 16 and 33 equal its rows in one
  chunk; 1 thread equals 2; the AVX2 and plain C++ builds equal the native one;
* the engine on the toy model: greedy requests alone and eight together give equal logits.

Where no C++ compiler is installed the tests skip, saying so (LOLLM_REQUIRE_NATIVE=1: they fail).
"""

from __future__ import annotations

import os
import platform

import pytest
import torch

from lollm import attention, native
from lollm.attention import attend, eager_probs, use_backend
from lollm.batch import Batch


@pytest.fixture(autouse=True)
def built():
    if native.paged_attention_op() is None:
        if os.environ.get("LOLLM_REQUIRE_NATIVE") == "1":
            pytest.fail(native.status())
        pytest.skip(native.status())


def make_step(H, K, D, starts, counts, *, block_size=4, seed=0, dtype=torch.float32, window=None):
    """q (1, H, N, D), pools and the Batch of an engine step over shuffled blocks.

    Every slot no sequence has written, every block no table lists (block 0 among them), and with a
    ``window`` every block a sliding layer would have given back (-1 in the window tables) is NaN."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(s + c) // block_size) for s, c in zip(starts, counts)]
    num_blocks = 1 + sum(needed) + 2
    order = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    tables = [order[sum(needed[:i]):sum(needed[:i + 1])] for i in range(len(starts))]
    pools = []
    for _ in range(2):
        pool = torch.full((num_blocks, block_size, K, D), float("nan"))
        for table, s, c in zip(tables, starts, counts):
            flat = torch.randn(len(table) * block_size, K, D, generator=g)
            flat[s + c:] = float("nan")
            pool[table] = flat.view(len(table), block_size, K, D)
        pools.append(pool.to(dtype))
    batch = Batch(starts=list(starts), counts=list(counts), block_tables=tables, block_size=block_size,
                  state_slots=list(range(len(starts))))
    if window is not None:
        batch.window_tables, batch.window = [list(t) for t in tables], window
        for table, s in zip(batch.window_tables, starts):
            for i in range(max(0, s - window + 1) // block_size):
                pools[0][table[i]], pools[1][table[i]], table[i] = float("nan"), float("nan"), -1
    q = torch.randn(1, H, sum(counts), D, generator=g).to(dtype)
    return q, pools[0], pools[1], batch


def reference(q, k_pool, v_pool, batch, *, window=None, softcap=None, scale=None):
    """(1, H, N, D) float64: each sequence's queries over its own keys, gathered, by eager_probs in float64."""
    K, D = k_pool.shape[2], k_pool.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    size = batch.block_size
    for (lo, hi), start, table in zip(batch.segments(), batch.starts, batch.tables_for(window)):
        skip = max(0, start - window + 1) // size if window is not None else 0
        S = start + (hi - lo) - skip * size
        blocks = torch.tensor(table[skip:])
        k = k_pool[blocks].double().reshape(-1, K, D)[:S].transpose(0, 1)[None]
        v = v_pool[blocks].double().reshape(-1, K, D)[:S].transpose(0, 1)[None]
        out[:, :, lo:hi] = eager_probs(q[:, :, lo:hi].double(), k, v, start=start, window=window, softcap=softcap,
                                       scale=scale)[0]
    return out


def native_attend(q, k_pool, v_pool, batch, **kwargs):
    with use_backend("sdpa"):
        return attend(q, k_pool, v_pool, start=batch, **kwargs)


# -- against the arithmetic in float64 ---------------------------------------------------------

MIXED = ([0, 5, 17, 30, 3, 40], [1, 3, 1, 9, 1, 33])  # decode rows, chunks, and a prompt from 0


@pytest.mark.parametrize("heads", [(14, 2, 64), (4, 4, 64), (8, 1, 128), (6, 2, 20)], ids=str)
@pytest.mark.parametrize("window", [None, 6, 1000])
@pytest.mark.parametrize("softcap, scale", [(None, None), (30.0, None), (None, 0.3), (5.0, 1.0)])
def test_the_kernel_computes_attention(heads, window, softcap, scale):
    """Every row within float32 rounding of the float64 arithmetic, and finite: no NaN of an unwritten
    slot, a padding block or a block released before the window reaches it. D = 20 takes the plain
    C++ weighted sum (no multiple of 8); heads ratios 7, 1 and 8."""
    H, K, D = heads
    q, k_pool, v_pool, batch = make_step(H, K, D, *MIXED, seed=D + H, window=window if window and window < 40 else None)
    got = native_attend(q, k_pool, v_pool, batch, window=window, softcap=softcap, scale=scale)
    want = reference(q, k_pool, v_pool, batch, window=window, softcap=softcap, scale=scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pools_compute_in_float32(dtype):
    """A bfloat16 or float16 model's pool is read as it is, widened exactly; the output is rounded once to q's dtype."""
    q, k_pool, v_pool, batch = make_step(14, 2, 64, *MIXED, seed=3, dtype=dtype)
    got = native_attend(q, k_pool, v_pool, batch)
    assert got.dtype == dtype
    want = reference(q, k_pool, v_pool, batch)
    assert torch.equal(got, want.to(dtype)) or (got.double() - want).abs().max() < 2e-2
    assert torch.equal(got, native_attend(q.float(), k_pool.float(), v_pool.float(), batch).to(dtype))


def test_the_kernel_names_what_it_cannot_read():
    """A released (-1) or foreign block among those a query reads, or a table too short: a clear error."""
    q, k_pool, v_pool, batch = make_step(4, 2, 64, [10, 3], [1, 2], seed=1)
    op = native.paged_attention_op()
    rows = q[0].transpose(0, 1).contiguous()
    tables = torch.tensor([batch.block_tables[0], batch.block_tables[1] + [-1]])
    starts, counts = torch.tensor(batch.starts), torch.tensor(batch.counts)
    tables[0, 1] = -1
    with pytest.raises(RuntimeError, match=r"paged_attention: tables\[0, 1\] = -1 is no block"):
        op(rows, k_pool, v_pool, tables, starts, counts, None, None, 0.125)
    tables[0, 1] = k_pool.shape[0]
    with pytest.raises(RuntimeError, match="is no block of a pool of"):
        op(rows, k_pool, v_pool, tables, starts, counts, None, None, 0.125)
    with pytest.raises(RuntimeError, match="sequence 0 reaches position 10 but its row of tables holds 2 blocks of 4"):
        op(rows, k_pool, v_pool, tables[:, :2].contiguous(), starts, counts, None, None, 0.125)
    with pytest.raises(RuntimeError, match=r"got one of Long \[2, 2\] not contiguous"):
        op(rows, k_pool, v_pool, tables[:, :2], starts, counts, None, None, 0.125)
    tables[0, 1] = batch.block_tables[0][1]
    with pytest.raises(RuntimeError, match="counts add up to 3 queries, q holds 2"):
        op(rows[:2], k_pool, v_pool, tables, starts, counts, None, None, 0.125)
    with pytest.raises(RuntimeError, match="q must be a contiguous float32"):
        op(rows.double(), k_pool, v_pool, tables, starts, counts, None, None, 0.125)
    with pytest.raises(RuntimeError, match="pools of Long"):
        op(rows, k_pool.long(), v_pool.long(), tables, starts, counts, None, None, 0.125)


# -- batch invariance, bit for bit --------------------------------------------------------------

def one_sequence(q, k_pool, v_pool, batch, b, **kwargs):
    """Sequence b of ``batch`` run alone in a step of its own (same pool, same table): its (1, H, T_b, D) rows."""
    lo, hi = batch.segments()[b]
    alone = Batch(starts=[batch.starts[b]], counts=[batch.counts[b]], block_tables=[batch.block_tables[b]],
                  block_size=batch.block_size, state_slots=[0])
    if batch.window_tables is not None:
        alone.window_tables, alone.window = [batch.window_tables[b]], batch.window
    return native_attend(q[:, :, lo:hi], k_pool, v_pool, alone, **kwargs)


@pytest.mark.parametrize("window", [None, 6])
def test_a_sequence_alone_equals_it_beside_others(window):
    """Each sequence's rows, alone, are torch.equal to its rows in a step with five others of other lengths
    (decode rows and prompt chunks), whatever its place in the step."""
    starts, counts = [12, 200, 3, 77, 40, 0], [1, 1, 5, 1, 16, 33]
    q, k_pool, v_pool, batch = make_step(14, 2, 64, starts, counts, seed=5, window=window)
    together = native_attend(q, k_pool, v_pool, batch, window=window)
    for b, (lo, hi) in enumerate(batch.segments()):
        assert torch.equal(one_sequence(q, k_pool, v_pool, batch, b, window=window), together[:, :, lo:hi]), b
    order = [5, 3, 1, 0, 4, 2]  # the same sequences in another order
    swapped = Batch(starts=[starts[b] for b in order], counts=[counts[b] for b in order],
                    block_tables=[batch.block_tables[b] for b in order], block_size=4, state_slots=order)
    if window is not None:
        swapped.window_tables, swapped.window = [batch.window_tables[b] for b in order], window
    rows = torch.cat([q[:, :, slice(*batch.segments()[b])] for b in order], dim=2)
    again = native_attend(rows, k_pool, v_pool, swapped, window=window)
    for i, b in enumerate(order):
        assert torch.equal(again[:, :, slice(*swapped.segments()[i])], together[:, :, slice(*batch.segments()[b])]), b


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
@pytest.mark.parametrize("softcap, window", [(None, None), (20.0, 50)])
def test_a_prompt_in_chunks_equals_it_in_one(chunk, softcap, window):
    """A prompt of 120 tokens, computed in chunks of ``chunk`` (each chunk a step beside a decode row of
    another sequence), gives torch.equal rows to the prompt in one chunk."""
    T = 120
    q, k_pool, v_pool, batch = make_step(14, 2, 64, [0, 300], [T, 1], seed=7)
    whole = one_sequence(q, k_pool, v_pool, batch, 0, window=window, softcap=softcap)
    for lo in range(0, T, chunk):
        hi = min(T, lo + chunk)
        step = Batch(starts=[300, lo], counts=[1, hi - lo], block_tables=[batch.block_tables[1], batch.block_tables[0]],
                     block_size=4, state_slots=[1, 0])
        rows = torch.cat([q[:, :, T:], q[:, :, lo:hi]], dim=2)
        got = native_attend(rows, k_pool, v_pool, step, window=window, softcap=softcap)
        assert torch.equal(got[:, :, 1:], whole[:, :, lo:hi]), (lo, hi)


def test_the_thread_count_changes_nothing():
    q, k_pool, v_pool, batch = make_step(14, 2, 64, *MIXED, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_attend(q, k_pool, v_pool, batch)
        torch.set_num_threads(2)
        two = native_attend(q, k_pool, v_pool, batch)
        torch.set_num_threads(3)
        three = native_attend(q, k_pool, v_pool, batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, three)


def test_sdpa_moves_a_rows_last_bits_with_its_chunk():
    """Why the kernel exists: the path without it (SDPA per chunk) gives a prompt's rows other bits
    in chunks than in one call (on torch's CPU kernels as of this writing; see docs/batch-invariance.md, "Batch invariance in attention")."""
    T = 300
    q, k_pool, v_pool, batch = make_step(14, 2, 64, [0], [T], seed=11)
    real = attention.paged_attention_op
    attention.paged_attention_op = lambda: None
    try:
        whole = native_attend(q, k_pool, v_pool, batch)
        unequal = 0
        for chunk in (1, 7, 16, 33):
            for lo in range(0, T, chunk):
                step = Batch(starts=[lo], counts=[min(T, lo + chunk) - lo], block_tables=batch.block_tables,
                             block_size=4, state_slots=[0])
                got = native_attend(q[:, :, lo:lo + chunk], k_pool, v_pool, step)
                unequal += not torch.equal(got, whole[:, :, lo:lo + chunk])
    finally:
        attention.paged_attention_op = real
    assert unequal > 0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the other builds are x86 instruction sets")
@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_every_build_gives_the_same_bits(variant):
    """The plain C++ and AVX2 builds compute each lane as the native build's vectors do: torch.equal."""
    other = native.build_variant(variant).paged_attention
    for H, K, D, softcap in [(14, 2, 64, None), (6, 2, 20, 30.0), (8, 1, 128, None)]:
        q, k_pool, v_pool, batch = make_step(H, K, D, *MIXED, seed=H + D)
        want = native_attend(q, k_pool, v_pool, batch, softcap=softcap)
        width = max(len(t) for t in batch.block_tables)
        tables = torch.tensor([t + [-1] * (width - len(t)) for t in batch.block_tables])
        got = other(q[0].transpose(0, 1).contiguous(), k_pool, v_pool, tables, torch.tensor(batch.starts),
                    torch.tensor(batch.counts), None, softcap, D**-0.5)
        assert torch.equal(got.transpose(0, 1).unsqueeze(0), want), (variant, H, K, D)


# -- the engine: requests alone and together ----------------------------------------------------

class RowByRow(torch.nn.Module):
    """A float32 linear computed one row at a time, as a lone decode step computes it.

    torch's float32 GEMM gives a row other last bits at M rows than at one (its blocking follows
    M; measured in docs/batch-invariance.md, "Batch invariance in attention"), so the toy model's layers are made row-independent
    here, to hold everything else of an engine step to bit-for-bit equality: attention, the KV
    writes, positions, the recurrent state, the greedy pick."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):  # (1, T, C) -> (1, T, out)
        rows = x.reshape(-1, x.shape[-1])
        return torch.cat([self.linear(rows[i:i + 1]) for i in range(rows.shape[0])]).view(*x.shape[:-1], -1)


def logits_by_position(model, prompts, arrivals, max_new_tokens):
    """Run ``prompts`` through one engine (prompt i joins at step ``arrivals[i]``): {(i, position): logits row}
    for every row the engine computed, a request's logits after ``position`` tokens."""
    from lollm.engine import Engine, EngineConfig
    from lollm.generate.sampling import SamplingParams

    engine = Engine(model, EngineConfig(kv_blocks=256, block_size=4, max_sequences=8, max_batch_tokens=12))
    seen, real = {}, engine._forward

    def forward(plan):
        logits = real(plan)
        for b, (req, count) in enumerate(plan):
            seen[(req.request_id, req.computed + count)] = logits[b].clone()
        return logits

    engine._forward = forward
    ids, step, pending = {}, 0, sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            ids[engine.add_request(prompts[i], sampling=SamplingParams(temperature=0), max_new_tokens=max_new_tokens)] = i
        engine.step()
        step += 1
    return {(ids[rid], position): row for (rid, position), row in seen.items()}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("recurrent", [False, True])
def test_requests_alone_and_eight_together_give_equal_logits(window, recurrent):
    """Eight greedy requests of mixed lengths, four arriving mid-decode, through one engine with a token
    budget that chunks the prompts beside decode rows: every logits row the engine computes for a request
    is torch.equal to that row when the request runs alone (with the toy's linears row by row)."""
    from _toy_batched import ToyLM

    model = ToyLM(recurrent=recurrent, window=window, max_context=128)
    model.qkv, model.out, model.head = RowByRow(model.qkv), RowByRow(model.out), RowByRow(model.head)
    base = [(7 * i + 3) % 40 for i in range(40)]
    prompts = [base] + [base[i:i + n] for i, n in enumerate([3, 20, 17, 35, 9, 2, 26], start=1)]
    with torch.inference_mode():
        together = logits_by_position(model, prompts, [0, 0, 0, 3, 5, 5, 8, 9], 8)
        alone = {}
        for i, prompt in enumerate(prompts):
            alone.update({(i, position): row for (_, position), row in logits_by_position(model, [prompt], [0], 8).items()})
    common = [key for key in together if key in alone]
    assert len(common) >= 8 * 8  # every sampled row at least (prompt chunks end elsewhere alone)
    unequal = [key for key in common if not torch.equal(together[key], alone[key])]
    assert not unequal, f"{len(unequal)} of {len(common)} logits rows differ, first (request, position) {unequal[:3]}"
