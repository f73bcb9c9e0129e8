"""The Triton kernels of ``--attn triton`` (lollm.kernels) against the seam's sdpa, on a grid.

The grid covers what the families send: GQA ratios 1, 2 and 7; head widths 64,
128, 256 and 512 (gemma4's global heads); prefill from position 0 and chunks
after a cache; windows shorter and longer than the text; soft-cap on and off;
T = 1 and T = 3 decode on full caches and on ring buffers (wrapped and not yet
full); lengths that are not multiples of any tile; float32 and float16.

They run where the rest of CI runs, in Triton's CPU interpreter (conftest.py
sets ``TRITON_INTERPRET=1`` unless it is set). ``TRITON_INTERPRET=0`` runs them
compiled on a CUDA GPU, bfloat16 included (the interpreter computes ``tl.dot``
on bfloat16 wrongly, so bfloat16 is checked on a GPU only).

Bounds, max |Δ| against the seam's ``sdpa`` in float64 on the same (rounded) inputs,
with q, k, v ~ N(0, 1):

* float32: 5e-5 (measured in the interpreter: 1.5e-5 at D = 512 with scale 1, where scores
  reach about 80 and float32 rounds them to 1e-5; about 1e-6 elsewhere. The seam's own sdpa
  in float32 is 9e-6 from float64 on the same grid);
* float16: 4e-3 (measured: 1.8e-3, sdpa in float16: 2.2e-3. The output's own rounding,
  half a unit in the last place at |out| < 4, is 1e-3; the probabilities are rounded to
  float16 before p @ v, as in FlashAttention);
* bfloat16 (GPU only): 3e-2 (eight bits of mantissa: the seam's sdpa and eager agree to the same).

Needs ``lollm-core[triton]`` (marker ``triton``: the nox sessions without the extra
deselect it; everywhere else a missing Triton fails these tests).
"""

from __future__ import annotations

import os

import pytest
import torch

from lollm import attention
from lollm.attention import attend, sdpa_attention, use_backend

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


def key_layout(start: int, T: int, window: int | None, layout: str) -> int:
    """How many keys the cache hands over (the seam's convention, lollm.attention.key_positions).

    full:  0 .. start+T-1 in position order (a full KV cache);
    slide: the last W-1 cached positions and the T new ones, in position order;
    ring:  the min(start+1, W) newest positions as ring slots p % W (T = 1).
    """
    if layout == "full":
        return start + T
    if layout == "slide":
        return min(start + T, window - 1 + T)
    return min(start + T, window)


def inputs(H, K, D, start, T, window, layout, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = key_layout(start, T, window, layout)
    q, k, v = (torch.randn(1, n, L, D, generator=g).to(dtype).to(DEVICE) for n, L in ((H, T), (K, S), (K, S)))
    return q, k, v


def check(got, q, k, v, **kw):
    """got against the seam's sdpa in float64 on the same inputs; returns max |Δ|."""
    want = sdpa_attention(q.double(), k.double(), v.double(), **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert torch.isfinite(got).all()
    err = (got.float() - want).abs().max().item()
    assert err < BOUND[q.dtype], f"max |Δ| {err:.2e} over the bound {BOUND[q.dtype]:.0e} for {q.dtype}"
    return err


# -- prefill: (H, K), D, start, T, window, layout, softcap -----------------------------------------
# T and the key counts are never multiples of the tiles (16..64 rows, 16..64 keys).
PREFILL = [
    ((3, 3), 64, 0, 69, None, "full", None),  # two query tiles, the second one partial
    ((4, 2), 64, 11, 37, 7, "slide", 2.0),  # chunk after a cache, window shorter than the text, soft-cap
    ((7, 1), 128, 3, 45, 80, "slide", None),  # window longer than the text
    ((3, 3), 128, 20, 30, 9, "full", None),  # full cache read by a windowed layer: tiles before the window skipped
    ((4, 2), 256, 0, 37, None, "full", 50.0),  # gemma2's cap
    ((7, 1), 256, 9, 21, 6, "slide", None),
    ((4, 2), 512, 0, 21, None, "full", None),  # gemma4's global heads, scale 1
    ((7, 1), 512, 5, 19, 4, "slide", 3.0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL, ids=lambda c: f"H{c[0][0]}K{c[0][1]}-D{c[1]}-start{c[2]}-T{c[3]}-W{c[4]}-{c[5]}-cap{c[6]}")
def test_prefill_kernel_against_sdpa(kernels, case, dtype):
    (H, K), D, start, T, window, layout, softcap = case
    q, k, v = inputs(H, K, D, start, T, window, layout, dtype)
    scale = 1.0 if D == 512 else None
    got = kernels.flash_prefill(q, k, v, start=start, window=window, softcap=softcap, scale=scale)
    check(got, q, k, v, start=start, window=window, softcap=softcap, scale=scale)


# -- decode: (H, K), D, start, T, window, layout, softcap, splits -----------------------------------
DECODE = [
    ((3, 3), 64, 100, 1, None, "full", None, None),  # a plain decode step, 101 keys: two splits
    ((4, 2), 64, 40, 3, None, "full", 2.0, 3),  # speculative verify (T = 3), soft-cap, three splits
    ((7, 1), 128, 9, 1, 4, "ring", None, 2),  # a wrapped ring: slots hold positions 8 9 6 7
    ((7, 1), 128, 2, 1, 4, "ring", None, None),  # a ring not yet full
    ((4, 2), 256, 4, 1, 16, "ring", None, None),  # window longer than the text
    ((3, 3), 256, 20, 3, 6, "slide", 50.0, 2),  # T = 3 on a sliding layer
    ((7, 1), 512, 30, 1, None, "full", None, None),  # gemma4's global heads: many splits of 16 keys
    ((4, 2), 512, 21, 1, 6, "ring", 3.0, 2),
    ((7, 1), 64, 15, 3, 5, "full", None, 2),  # a windowed layer reading a full cache (gemma4 shared KV)
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE, ids=lambda c: f"H{c[0][0]}K{c[0][1]}-D{c[1]}-start{c[2]}-T{c[3]}-W{c[4]}-{c[5]}-cap{c[6]}-splits{c[7]}")
def test_decode_kernel_against_sdpa(kernels, case, dtype):
    (H, K), D, start, T, window, layout, softcap, splits = case
    q, k, v = inputs(H, K, D, start, T, window, layout, dtype, seed=1)
    scale = 1.0 if D == 512 else None
    ring = layout == "ring"
    got = kernels.flash_decode(q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale, splits=splits)
    check(got, q, k, v, start=start, ring=ring, window=window, softcap=softcap, scale=scale)


def test_ring_order_is_read_by_position(kernels):
    """The same keys in ring order and in position order give the same result; the ring flag matters."""
    H, K, D, start, W = 4, 2, 64, 9, 4
    q, k, v = inputs(H, K, D, start, 1, W, "ring", torch.float32)
    slots_to_positions = attention.key_positions(start, 1, W, ring=True)  # [8, 9, 6, 7]
    order = slots_to_positions.argsort().to(DEVICE)
    ring = kernels.flash_decode(q, k, v, start=start, ring=True, window=W)
    in_order = kernels.flash_decode(q, k[:, :, order], v[:, :, order], start=start, ring=False, window=W)
    assert (ring - in_order).abs().max() < 1e-6
    start = 10  # a T = 3 step: positions 7 .. 12 in order; as ring slots p % 6 they would be 12 7 8 9 10 11
    q3, k3, v3 = inputs(H, K, D, start, 3, W, "slide", torch.float32)
    check(kernels.flash_decode(q3, k3, v3, start=start, ring=False, window=W), q3, k3, v3, start=start, window=W)
    as_ring = kernels.flash_decode(q3, k3, v3, start=start, ring=True, window=W)
    assert (as_ring - sdpa_attention(q3, k3, v3, start=start, window=W)).abs().max() > 1e-3


def test_split_count_does_not_change_the_result(kernels):
    q, k, v = inputs(7, 1, 64, 200, 1, None, "full", torch.float32, seed=2)
    one = kernels.flash_decode(q, k, v, start=200, splits=1)
    for splits in (2, 3, 4):
        assert (kernels.flash_decode(q, k, v, start=200, splits=splits) - one).abs().max() < 1e-6


def test_prefill_skips_key_tiles_outside_the_window_and_after_the_last_query(kernels):
    """Values poisoned with NaN where no query of a tile may look: the tile must never be loaded.

    (A loaded NaN value survives a zero probability: 0 * NaN is NaN.)
    """
    BLOCK_M, BLOCK_N = kernels.PREFILL_TILES[64][:2]
    H, K, D = 2, 1, 64
    # window: one tile of queries at positions 200 .. 200+BLOCK_M-1 over a full cache; W = 10
    start, T, W = 200, BLOCK_M, 10
    q, k, v = inputs(H, K, D, start, T, W, "full", torch.float32, seed=3)
    hidden_tiles = (start - W + 1) // BLOCK_N * BLOCK_N  # keys before this column are outside every window
    assert hidden_tiles >= BLOCK_N
    poisoned = v.clone()
    poisoned[:, :, :hidden_tiles] = float("nan")
    got = kernels.flash_prefill(q, k, poisoned, start=start, window=W)
    check(got, q, k, v, start=start, window=W)
    # causal: two tiles of queries from position 0; keys after the first tile are poisoned
    q, k, v = inputs(H, K, D, 0, 2 * BLOCK_M, None, "full", torch.float32, seed=4)
    poisoned = v.clone()
    poisoned[:, :, BLOCK_M:] = float("nan")
    got = kernels.flash_prefill(q, k, poisoned, start=0)
    want = sdpa_attention(q, k, v, start=0)
    assert (got[:, :, :BLOCK_M] - want[:, :, :BLOCK_M]).abs().max() < BOUND[torch.float32]
    assert torch.isnan(got[:, :, BLOCK_M:]).all()  # the second tile does read them: the poison works


def test_the_triton_backend_picks_the_kernel_by_the_number_of_queries(kernels, monkeypatch):
    """Through lollm.attention.attend: decode steps and ring order take the split-K kernel, prompts the prefill one."""
    used = []
    for name in ("flash_prefill", "flash_decode"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name, **kw: used.append(_name) or _real(*a, **kw))
    steps = [(0, 40, None, "full", "flash_prefill"), (5, 17, 8, "slide", "flash_prefill"),
             (9, 1, None, "full", "flash_decode"), (7, 3, None, "full", "flash_decode"),
             (40, kernels.DECODE_MAX_QUERIES, None, "full", "flash_decode"), (9, 1, 4, "ring", "flash_decode")]
    for start, T, window, layout, kernel in steps:
        q, k, v = inputs(4, 2, 32, start, T, window, layout, torch.float32)
        ring = layout == "ring"
        with use_backend("triton"):
            got = attend(q, k, v, start=start, ring=ring, window=window)
        check(got, q, k, v, start=start, ring=ring, window=window)
        assert used.pop() == kernel, (start, T, layout)


def test_strided_inputs_as_a_cache_hands_them_over(kernels):
    """q transposed from (1, T, H, D), k and v a slice of a preallocated (1, K, max, D) cache."""
    H, K, D, T, start = 4, 2, 64, 20, 7
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, T, H, D, generator=g).to(DEVICE).transpose(1, 2)
    cache_k = torch.randn(1, K, 64, D, generator=g).to(DEVICE)
    cache_v = torch.randn(1, K, 64, D, generator=g).to(DEVICE)
    k, v = cache_k[:, :, : start + T], cache_v[:, :, : start + T]
    assert not q.is_contiguous() and not k.is_contiguous()
    check(kernels.flash_prefill(q, k, v, start=start), q, k, v, start=start)
    check(kernels.flash_decode(q[:, :, -1:], k, v, start=start + T - 1), q[:, :, -1:], k, v, start=start + T - 1)


def test_what_the_kernels_do_not_cover_is_a_clear_error(kernels):
    from lollm.errors import AttentionBackendError

    q, k, v = inputs(2, 1, 64, 0, 4, None, "full", torch.float64)
    with pytest.raises(AttentionBackendError, match="float32, float16 or bfloat16"):
        kernels.flash_attention(q, k, v, start=0)
    q, k, v = inputs(2, 1, 640, 0, 4, None, "full", torch.float32)
    with pytest.raises(AttentionBackendError, match="heads up to 512 wide, this one is 640"):
        kernels.flash_attention(q, k, v, start=0)


def test_the_kernels_compile_for_a_hopper_gpu_without_one(kernels):
    """Triton compiles for sm_90 ahead of time with the ptxas of its wheel (prefill, decode split and combine,
    and the paged kernel of test_paged_kernel.py): a common and the widest head,
    fp32 and bf16, every feature on, within the shared memory of a block. The interpreter never compiles,
    so this is CI's only sight of it (benchmarks/compile_attention_kernels.py prints the whole table)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_attention_kernels.py"
    args = ["--arch", "90", "--width", "128", "--width", "512", "--dtype", "float32", "--dtype", "bfloat16"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("sm_90") == 2 * 2 * 4 and "all compiled within limits" in done.stdout, done.stdout
