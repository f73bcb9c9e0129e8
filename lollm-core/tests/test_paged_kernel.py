"""The paged attention kernel (lollm.kernels.paged_attention) against the seam's sdpa on an engine step.

Each case is one engine step over a random KV pool: several sequences of different
lengths whose blocks are scattered over the pool in random order, each bringing 1 to
16 new tokens (decode, verify); GQA ratios 1, 2 and 7; head widths 64 to 512; a
window shorter and longer than the text; soft-cap on and off. The reference is the
seam itself with the ``sdpa`` backend (:func:`lollm.attention._attend_batch`: each
sequence's blocks gathered, then sdpa) in float64 on the same rounded inputs.

Every block no table lists, block 0 among them (the tables' padding), and every slot
past a sequence's length is NaN: a kernel that read one would return NaN (0 * NaN
is NaN), so the cases also prove that the kernel reads nothing but the table's
blocks up to each sequence's length.

They run where test_flash_kernels.py runs and as it runs: in Triton's CPU interpreter
(conftest.py sets ``TRITON_INTERPRET=1`` unless it is set), float32 and float16;
``TRITON_INTERPRET=0`` on a CUDA GPU, bfloat16 included (benchmarks/gpu_paged_check.sh).
Bounds as there (max |Δ| against float64): float32 5e-5, float16 4e-3, bfloat16 3e-2.
Measured in the interpreter on CASES: float32 at most 4.5e-6 (gemma2's cap at D = 256),
float16 at most 9.7e-4; the seam's sdpa run in those dtypes: 3.4e-6 and 1.3e-3.
Needs ``lollm-core[triton]`` (marker ``triton``: deselected only in the nox session
without the extra; everywhere else a missing Triton fails these tests).
"""

from __future__ import annotations

import os

import pytest
import torch

from lollm.attention import attend, use_backend
from lollm.batch import Batch

pytestmark = pytest.mark.triton

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")
DEVICE = "cpu" if INTERPRETED else "cuda"
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
BOUND = {torch.float32: 5e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def kernels():
    """lollm.kernels, imported after conftest.py set TRITON_INTERPRET (a missing Triton fails here)."""
    import lollm.kernels

    if not INTERPRETED and not torch.cuda.is_available():
        pytest.fail("TRITON_INTERPRET is off and torch sees no CUDA device: the kernels cannot run", pytrace=False)
    assert lollm.kernels.interpreted() == INTERPRETED
    return lollm.kernels


def engine_step(H, K, D, block_size, starts, counts, dtype, seed=0):
    """q (1, H, N, D), pools (blocks, block_size, K, D) and the Batch of one engine step.

    Block tables take blocks 1.. in a random order, so no sequence's blocks are contiguous
    or in order; two spare blocks stay unused. Unused blocks and slots past each sequence's
    length are NaN.
    """
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(s + c) // block_size) for s, c in zip(starts, counts)]
    num_blocks = 1 + sum(needed) + 2
    order = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(order[used:used + n])
        used += n
    batch = Batch(starts=list(starts), counts=list(counts), block_tables=tables, block_size=block_size,
                  state_slots=list(range(len(starts))))
    pools = []
    for _ in range(2):
        pool = torch.full((num_blocks, block_size, K, D), float("nan"))
        for table, s, c in zip(tables, starts, counts):
            flat = torch.randn(len(table) * block_size, K, D, generator=g)
            flat[s + c:] = float("nan")  # slots not yet written
            pool[table] = flat.view(len(table), block_size, K, D)
        pools.append(pool.to(dtype).to(DEVICE))
    q = torch.randn(1, H, sum(counts), D, generator=g).to(dtype).to(DEVICE)
    return q, pools[0], pools[1], batch


def sdpa_reference(q, k_pool, v_pool, batch, **kw):
    """The seam with the sdpa backend (gather + sdpa per sequence) in float64."""
    with use_backend("sdpa"):
        return attend(q.double(), k_pool.double(), v_pool.double(), start=batch, **kw)


def check(got, q, k_pool, v_pool, batch, **kw):
    want = sdpa_reference(q, k_pool, v_pool, batch, **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert torch.isfinite(got).all(), "a NaN: the kernel read a slot outside the block tables"
    err = (got.float() - want).abs().max().item()
    assert err < BOUND[q.dtype], f"max |Δ| {err:.2e} over the bound {BOUND[q.dtype]:.0e} for {q.dtype}"
    return err


def layout_of(kernels, batch):
    return kernels.PagedLayout.build(batch.starts, batch.counts, batch.block_tables, DEVICE)


# (H, K), D, block_size, starts, counts, window, softcap: sequences of different lengths, never tile multiples
CASES = [
    ((7, 1), 64, 16, (0, 16, 40, 99), (1, 1, 1, 1)),  # a decode step: a new sequence, one at a block edge
    ((4, 2), 64, 8, (5, 30, 61), (3, 16, 2), 6, 2.0),  # verify steps (T up to 16), window, soft-cap
    ((3, 3), 128, 16, (12, 2, 50), (1, 4, 1), 80, None),  # window longer than every text
    ((4, 2), 256, 16, (33, 7), (1, 3), None, 50.0),  # gemma2's cap
    ((7, 1), 512, 4, (21, 3), (1, 2), 5, None),  # gemma4's global heads (scale 1), small blocks
]


def _case_id(c):
    (H, K), D, bs, starts, counts, *rest = c
    window, softcap = (rest + [None, None])[:2]
    return f"H{H}K{K}-D{D}-bs{bs}-starts{'.'.join(map(str, starts))}-T{'.'.join(map(str, counts))}-W{window}-cap{softcap}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_paged_kernel_against_sdpa(kernels, case, dtype):
    (H, K), D, block_size, starts, counts, *rest = case
    window, softcap = (rest + [None, None])[:2]
    q, k_pool, v_pool, batch = engine_step(H, K, D, block_size, starts, counts, dtype)
    scale = 1.0 if D == 512 else None
    got = kernels.paged_attention(q, k_pool, v_pool, layout_of(kernels, batch), window=window, softcap=softcap, scale=scale)
    check(got, q, k_pool, v_pool, batch, window=window, softcap=softcap, scale=scale)


def test_split_count_does_not_change_the_result(kernels):
    q, k_pool, v_pool, batch = engine_step(4, 2, 64, 16, (100, 3, 50), (1, 2, 1), torch.float32, seed=1)
    layout = layout_of(kernels, batch)
    one = kernels.paged_attention(q, k_pool, v_pool, layout, splits=1)
    check(one, q, k_pool, v_pool, batch)
    for splits in (2, 3):
        assert (kernels.paged_attention(q, k_pool, v_pool, layout, splits=splits) - one).abs().max() < 1e-6


def test_keys_before_every_window_are_never_loaded(kernels):
    """Each sequence's own positions before its first query's window are poisoned with NaN: never read."""
    W, starts, counts = 5, (40, 19), (1, 3)
    q, k_pool, v_pool, batch = engine_step(4, 2, 64, 8, starts, counts, torch.float32, seed=2)
    poisoned = v_pool.clone()
    for table, s in zip(batch.block_tables, starts):
        for p in range(s - W + 1):
            poisoned[table[p // 8], p % 8] = float("nan")
    got = kernels.paged_attention(q, k_pool, poisoned, layout_of(kernels, batch), window=W)
    check(got, q, k_pool, v_pool, batch, window=W)
    unwindowed = kernels.paged_attention(q, k_pool, poisoned, layout_of(kernels, batch))
    assert torch.isnan(unwindowed).all()  # without the window they are read: the poison works


def test_an_engine_step_through_the_seam_takes_the_paged_kernel_for_short_sequences(kernels, monkeypatch):
    """attend(start=Batch) with --attn triton: one paged launch for the decode and verify sequences,
    the gather + prefill kernel for a chunk longer than 16; the whole step equals sdpa's."""
    calls = []
    for name in ("paged_attention_batch", "flash_prefill", "flash_decode"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    long_chunk = kernels.PAGED_MAX_QUERIES + 1
    q, k_pool, v_pool, batch = engine_step(4, 2, 32, 16, (9, 0, 20), (1, long_chunk, 3), torch.float32, seed=3)
    with use_backend("triton"):
        got = attend(q, k_pool, v_pool, start=batch, window=12)
    check(got, q, k_pool, v_pool, batch, window=12)
    assert calls == ["paged_attention_batch", "flash_prefill"]
    calls.clear()
    q, k_pool, v_pool, batch = engine_step(4, 2, 32, 16, (9, 30), (1, 2), torch.float32, seed=4)
    with use_backend("triton"):
        got = attend(q, k_pool, v_pool, start=batch)
    check(got, q, k_pool, v_pool, batch)
    assert calls == ["paged_attention_batch"]  # a pure decode step: one launch, no gather


def test_strided_queries_as_a_family_hands_them_over(kernels):
    """q transposed from (1, N, H, D), as a family's projection reshapes it."""
    H, K, D = 4, 2, 64
    q, k_pool, v_pool, batch = engine_step(H, K, D, 16, (10, 33), (2, 1), torch.float32, seed=5)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # (1, H, N, D) with the strides of (1, N, H, D)
    assert not strided.is_contiguous()
    check(kernels.paged_attention(strided, k_pool, v_pool, layout_of(kernels, batch)), q, k_pool, v_pool, batch)


def test_the_layout_is_built_once_per_engine_step(kernels):
    """Every layer of a step passes the same Batch: its block tables go to the device once."""
    from lollm.kernels.paged_attention import _layout_of

    _, _, _, batch = engine_step(2, 1, 16, 4, (3, 0, 6), (1, 20, 2), torch.float32)
    seqs, rows, layout = _layout_of(batch, torch.device(DEVICE), None)
    assert seqs == [0, 2] and rows.tolist() == [0, 21, 22]
    assert layout.tables.dtype == torch.int32 and layout.tables.shape == (2, 2)
    assert layout.tables[0].tolist() == batch.block_tables[0] + [0]  # padded with block 0
    assert layout.rows.tolist() == [0, 1] and layout.max_count == 2 and layout.max_keys == 8
    assert _layout_of(batch, torch.device(DEVICE), None)[2] is layout
    assert _layout_of(batch, torch.device(DEVICE), 3)[2] is layout  # no window tables: every layer reads the same
    other = Batch(starts=batch.starts, counts=batch.counts, block_tables=batch.block_tables, block_size=4,
                  state_slots=batch.state_slots, window_tables=[[b + 100 for b in t] for t in batch.block_tables], window=3)
    assert _layout_of(other, torch.device(DEVICE), None)[2] is not layout
    windowed = _layout_of(other, torch.device(DEVICE), 3)[2]  # sliding layers: the window tables, kept too
    assert windowed.tables[0].tolist() == [b + 100 for b in batch.block_tables[0]] + [0]
    assert _layout_of(other, torch.device(DEVICE), 3)[2] is windowed
    assert _layout_of(other, torch.device(DEVICE), None)[2] is not windowed


def test_window_tables_with_blocks_given_back(kernels):
    """A sliding-window layer in the engine reads its own pool through window tables whose blocks before
    each sequence's window are -1 (given back) and hold NaN: the paged kernel and the seam's gather both
    start at the window's first block, and equal the same step over the whole tables."""
    W, bs, starts, counts = 6, 4, (40, 19, 3), (1, 3, 2)
    q, k_pool, v_pool, batch = engine_step(4, 2, 64, bs, starts, counts, torch.float32, seed=6)
    tables, k_released, v_released = [], k_pool.clone(), v_pool.clone()
    for table, s in zip(batch.block_tables, starts):
        first = max(0, s - W + 1) // bs
        for block in table[:first]:
            k_released[block], v_released[block] = float("nan"), float("nan")
        tables.append([-1] * first + table[first:])
    windowed = Batch(starts=batch.starts, counts=batch.counts, block_tables=batch.block_tables, block_size=bs,
                     state_slots=batch.state_slots, window_tables=tables, window=W)
    assert any(-1 in t for t in tables)
    want = sdpa_reference(q, k_pool, v_pool, batch, window=W)
    got_sdpa = sdpa_reference(q, k_released, v_released, windowed, window=W)
    assert torch.isfinite(got_sdpa).all() and (got_sdpa - want).abs().max() < 1e-12
    got, covered = kernels.paged_attention_batch(q, k_released, v_released, windowed, window=W)
    assert all(covered)
    check(got, q, k_pool, v_pool, batch, window=W)


def test_what_the_paged_kernel_does_not_cover_is_a_clear_error(kernels):
    from lollm.errors import AttentionBackendError

    q, k_pool, v_pool, batch = engine_step(2, 1, 16, 4, (3,), (1,), torch.float64)
    with pytest.raises(AttentionBackendError, match="float32, float16 or bfloat16"):
        kernels.flash_attention_paged(q, k_pool, v_pool, batch)
    with pytest.raises(ValueError, match="every count >= 1"):
        kernels.PagedLayout.build([3, 4], [1, 0], [[1], [2]], DEVICE)
    q, k_pool, v_pool, batch = engine_step(2, 1, 16, 4, (3, 5), (1, 2), torch.float32)
    with pytest.raises(ValueError, match="for 3 queries"):
        kernels.paged_attention(q[:, :, :2], k_pool, v_pool, layout_of(kernels, batch))
