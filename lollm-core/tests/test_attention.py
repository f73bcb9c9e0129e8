"""The attention seam (lollm.attention): every backend against a float64 softmax written out here.

The reference below shares no code with the seam: it computes each query's
scores against keys given in *position order* with explicit positions, and
applies the causal and window rules as transformers states them
(key j visible from query p when ``p - W < j <= p``). The seam gets the same
keys as a family's cache hands them over, ring order included.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

from lollm import attention
from lollm.attention import attend, recording, use_backend
from lollm.errors import AttentionBackendError, LollmError
from lollm.load.options import LoadOptions

HEADS = [(3, 3), (4, 2), (7, 1)]  # (H, K): GQA ratios 1, 2, 7
HEAD_DIMS = [16, 256, 512]

# (name, start, T, window, layout): layout says how the cache hands its keys over
#   "full":  positions 0 .. start+T-1 in order (a full KV cache)
#   "slide": positions max(0, start-(W-1)) .. start+T-1 in order (a sliding cache, T > 1)
#   "ring":  the min(start+1, W) newest positions in ring slots p % W (a sliding cache, T == 1)
CASES = [
    ("prefill", 0, 6, None, "full"),
    ("prefill window shorter than the prompt", 0, 6, 3, "slide"),
    ("prefill window longer than the prompt", 0, 6, 9, "slide"),
    ("chunk after a cache", 5, 3, None, "full"),
    ("chunk after a cache, window", 5, 3, 4, "slide"),
    ("decode", 7, 1, None, "full"),
    ("decode T=3 (speculative verify)", 7, 3, None, "full"),
    ("decode T=3 on a sliding layer", 7, 3, 4, "slide"),
    ("decode on a full ring (wrapped)", 9, 1, 4, "ring"),
    ("decode on a ring not yet full", 2, 1, 4, "ring"),
    ("decode, window longer than the text", 4, 1, 16, "ring"),
    # gemma4's KV-sharing layers carry only the last prompt position, against all the prompt's keys
    ("last prompt position only, window", 7, 1, 3, "full"),
]


def cache_positions(start: int, T: int, window: int | None, layout: str) -> torch.Tensor:
    """Positions of the keys, in the order the cache returns them."""
    last = start + T - 1
    if layout == "full":
        return torch.arange(0, last + 1)
    first = max(0, start - (window - 1))
    if layout == "slide":
        return torch.arange(first, last + 1)
    first = max(0, last - window + 1)
    filled = last + 1 - first  # slots in use: min(start+1, W)
    slots = {p % window: p for p in range(first, last + 1)}  # slot -> position
    return torch.tensor([slots[s] for s in range(filled)])


def reference(q, k, v, q_pos, k_pos, *, window, softcap, scale) -> torch.Tensor:
    """softmax over visible keys, in float64, one head at a time. Returns (1, H, T, D) float64."""
    q, k, v = q.double(), k.double(), v.double()
    _, H, T, D = q.shape
    K = k.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.zeros(1, H, T, D, dtype=torch.float64)
    for h in range(H):
        g = h // (H // K)
        for i in range(T):
            p = int(q_pos[i])
            seen = [j for j in range(k.shape[2]) if int(k_pos[j]) <= p and (window is None or int(k_pos[j]) > p - window)]
            s = (k[0, g, seen] @ q[0, h, i]) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[0, h, i] = torch.softmax(s, dim=0) @ v[0, g, seen]
    return out


def make(H, K, D, start, T, window, layout, *, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_pos = cache_positions(start, T, window, layout)
    S = len(k_pos)
    q = torch.randn(1, H, T, D, generator=g).to(dtype)
    k = torch.randn(1, K, S, D, generator=g).to(dtype)
    v = torch.randn(1, K, S, D, generator=g).to(dtype)
    return q, k, v, torch.arange(start, start + T), k_pos


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backends_against_a_float64_softmax(backend, softcap, case):
    _, start, T, window, layout = case
    for H, K in HEADS:
        for D in HEAD_DIMS:
            q, k, v, q_pos, k_pos = make(H, K, D, start, T, window, layout)
            scale = 1.0 if D == 512 else None  # gemma4's global heads: 512 wide, scale 1
            want = reference(q, k, v, q_pos, k_pos, window=window, softcap=softcap, scale=scale)
            with use_backend(backend):
                got = attend(q, k, v, start=start, ring=layout == "ring", window=window, softcap=softcap, scale=scale)
            assert got.shape == (1, H, T, D) and got.dtype == torch.float32
            err = (got.double() - want).abs().max().item()
            assert err < 2e-5, f"H={H} K={K} D={D}: max |Δ| {err:.2e}"


def test_ring_order_is_not_position_order_in_the_wrapped_case():
    """The ring case above really hands keys out of position order (else it would test nothing new)."""
    k_pos = cache_positions(9, 1, 4, "ring")
    assert k_pos.tolist() == [8, 9, 6, 7]
    assert attention.key_positions(9, 1, 4, ring=True).tolist() == [8, 9, 6, 7]
    assert attention.key_positions(2, 1, 3, ring=True).tolist() == [0, 1, 2]  # ring not yet full
    assert attention.key_positions(5, 3, 8).tolist() == list(range(8))


def test_a_window_hides_keys_of_a_ring_read_as_positions():
    """A T=3 step on keys given in ring order must use the ring's positions, not their order."""
    H, K, D, start, T, W = 2, 1, 8, 10, 3, 4
    q, k, v, q_pos, k_pos = make(H, K, D, start, T, W, "slide")  # positions 7 .. 12
    perm = torch.tensor([p % len(k_pos) for p in k_pos.tolist()]).argsort()  # slot order of a 6-slot ring
    assert k_pos[perm].tolist() == [12, 7, 8, 9, 10, 11]
    want = reference(q, k, v, q_pos, k_pos, window=W, softcap=None, scale=None)
    for backend in ("sdpa", "eager"):
        with use_backend(backend):
            got = attend(q, k[:, :, perm], v[:, :, perm], start=start, ring=True, window=W)
        assert (got.double() - want).abs().max() < 2e-5
        wrong = attend(q, k[:, :, perm], v[:, :, perm], start=start, ring=False, window=W)
        assert (wrong.double() - want).abs().max() > 1e-3  # the flag matters


def _attention_before_the_seam(q, k, v, mask, scale=None):
    """What qwen2/qwen3/qwen3_5/gemma3/gemma4 ran before lollm.attention (repeat_kv, then SDPA)."""
    _, H, T, D = q.shape
    K = k.shape[1]
    n = H // K
    if T == 1:
        return F.scaled_dot_product_attention(q.reshape(1, K, n, D), k, v, attn_mask=mask, scale=scale).reshape(1, H, 1, D)
    S = k.shape[2]
    k = k[:, :, None].expand(1, K, n, S, D).reshape(1, H, S, D)
    v = v[:, :, None].expand(1, K, n, S, D).reshape(1, H, S, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_backend_is_bit_for_bit_the_code_it_replaced(dtype):
    """The reference path must not move: the parity figures on real checkpoints depend on it."""
    H, K, D = 14, 2, 64
    for start, T in [(0, 9), (6, 4), (9, 1)]:
        q, k, v, q_pos, k_pos = make(H, K, D, start, T, None, "full", dtype=dtype)
        mask = None if T == 1 or start == 0 else (k_pos[None, :] <= q_pos[:, None])
        old = _attention_before_the_seam(q, k, v, mask)
        with use_backend("sdpa"):
            new = attend(q, k, v, start=start)
        assert torch.equal(old, new), (start, T)


def test_eager_backend_is_gemma2s_soft_capped_arithmetic():
    """gemma2 computed its attention explicitly before the seam; ``sdpa`` with a soft-cap runs the same."""
    H, K, D, start, T, W, cap, scale = 4, 2, 32, 5, 3, 4, 50.0, 0.1
    q, k, v, q_pos, k_pos = make(H, K, D, start, T, W, "slide", dtype=torch.bfloat16)
    mask = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - W)
    scores = torch.matmul(q.reshape(1, K, 2 * T, D), k.transpose(2, 3)) * scale
    scores = (torch.tanh(scores / cap) * cap).view(1, K, 2, T, len(k_pos)).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    old = torch.matmul(probs.view(1, K, 2 * T, len(k_pos)), v).view(1, H, T, D)
    for backend in ("sdpa", "eager"):
        with use_backend(backend):
            assert torch.equal(attend(q, k, v, start=start, window=W, softcap=cap, scale=scale), old)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_sdpa_and_eager_agree(dtype, tol):
    for name, start, T, window, layout in CASES:
        q, k, v, *_ = make(7, 1, 64, start, T, window, layout, dtype=dtype, seed=1)
        kw = dict(start=start, ring=layout == "ring", window=window)
        with use_backend("sdpa"):
            a = attend(q, k, v, **kw)
        with use_backend("eager"):
            b = attend(q, k, v, **kw)
        assert a.dtype == b.dtype == dtype
        assert (a.float() - b.float()).abs().max() < tol, name


# -- recording --------------------------------------------------------------------------------


def test_recording_hands_out_probabilities_that_reproduce_the_output():
    H, K, D = 4, 2, 32
    for name, start, T, window, layout in CASES:
        q, k, v, q_pos, k_pos = make(H, K, D, start, T, window, layout, seed=2)
        kw = dict(start=start, ring=layout == "ring", window=window, softcap=3.0 if window else None)
        with use_backend("sdpa"):
            plain = attend(q, k, v, **kw)
            with recording() as rec:
                recorded = attend(q, k, v, layer=5, **kw)
        (r,) = rec.records
        assert r.layer == 5 and r.window == window
        assert r.probs.shape == (1, H, T, len(k_pos)) and r.probs.dtype == torch.float32
        assert torch.equal(r.query_positions, q_pos) and torch.equal(r.key_positions, k_pos), name
        assert torch.allclose(r.probs.sum(-1), torch.ones(1, H, T), atol=1e-6), name
        hidden = (k_pos[None, :] > q_pos[:, None]) | ((k_pos[None, :] <= q_pos[:, None] - window) if window else False)
        assert (r.probs[..., hidden] == 0).all(), name
        groups = torch.arange(H) // (H // K)
        weighted = r.probs.double() @ v[0, groups].double()  # (1, H, T, D): the rows times V
        assert (weighted - plain.double()).abs().max() < 1e-5, name
        assert torch.allclose(recorded, plain, atol=1e-5), name


def test_nothing_is_recorded_outside_the_block_and_blocks_nest():
    q, k, v, *_ = make(2, 1, 8, 0, 4, None, "full")
    with recording() as outer:
        attend(q, k, v, start=0, layer=0)
        with recording() as inner:
            attend(q, k, v, start=0, layer=1)
        attend(q, k, v, start=0, layer=2)
    attend(q, k, v, start=0, layer=3)
    assert [r.layer for r in outer.records] == [0, 2]
    assert [r.layer for r in inner.records] == [1]


# -- picking a backend --------------------------------------------------------------------------


@pytest.fixture
def spies(monkeypatch):
    """Replace the sdpa and eager backends by spies that note which one ran."""
    ran: list[str] = []
    for name in ("sdpa", "eager"):
        real = attention.BACKENDS[name]

        def spy(q, k, v, _name=name, _real=real, **kw):
            ran.append(_name)
            return _real.attend(q, k, v, **kw)

        monkeypatch.setitem(attention.BACKENDS, name, attention.Backend(name, real.summary, spy))
    return ran


def test_selection_order_context_then_environment_then_sdpa(spies, monkeypatch):
    q, k, v, *_ = make(2, 1, 8, 0, 3, None, "full")
    monkeypatch.delenv("LOLLM_ATTN", raising=False)
    attend(q, k, v, start=0)
    monkeypatch.setenv("LOLLM_ATTN", "eager")
    attend(q, k, v, start=0)
    with use_backend("sdpa"):
        attend(q, k, v, start=0)
        with use_backend(None):  # None passes the current choice through
            attend(q, k, v, start=0)
    attend(q, k, v, start=0)
    assert spies == ["sdpa", "eager", "sdpa", "sdpa", "eager"]


def test_two_threads_keep_their_own_backend(spies):
    q, k, v, *_ = make(2, 1, 8, 0, 3, None, "full")
    barrier = threading.Barrier(2)

    def run(name):
        with use_backend(name):
            barrier.wait()  # both threads have set their backend before either attends
            attend(q, k, v, start=0)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("sdpa", "eager")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(spies) == ["eager", "sdpa"]


def test_set_backend_holds_until_changed(spies):
    import contextvars

    def body():
        q, k, v, *_ = make(2, 1, 8, 0, 3, None, "full")
        attention.set_backend("eager")
        attend(q, k, v, start=0)
        assert attention.current_backend() == "eager"

    contextvars.copy_context().run(body)  # a copy: the setting does not leak into other tests
    assert spies == ["eager"]


def test_unknown_names_are_one_clear_error(monkeypatch):
    with pytest.raises(AttentionBackendError, match=r"--attn: unknown attention backend 'flash' \(use one of: sdpa, eager, triton\)"):
        attention.resolve_backend("flash")
    with pytest.raises(AttentionBackendError, match="--attn: unknown attention backend 'flash'"):
        with use_backend("flash"):
            pass
    monkeypatch.setenv("LOLLM_ATTN", "fast")
    with pytest.raises(AttentionBackendError, match="LOLLM_ATTN: unknown attention backend 'fast'"):
        attention.resolve_backend()
    q, k, v, *_ = make(2, 1, 8, 0, 3, None, "full")
    with pytest.raises(AttentionBackendError, match="LOLLM_ATTN: unknown attention backend 'fast'"):
        attend(q, k, v, start=0)
    assert issubclass(AttentionBackendError, LollmError)


def _site_without_triton(tmp_path):
    """A folder that, first on PYTHONPATH, makes ``import triton`` fail as if the extra were not installed."""
    site = tmp_path / "no-triton-site"
    (site / "triton").mkdir(parents=True)
    (site / "triton" / "__init__.py").write_text("raise ImportError(\"No module named 'triton'\")\n")
    return site


def test_triton_without_the_extra_is_one_clear_error(monkeypatch, tmp_path):
    """Without Triton (hidden here; really absent in the nox core_only session, test_core_only.py)."""
    from _core_helpers import run_lollm

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    for call in (lambda: attention.resolve_backend("triton"), lambda: attention.set_backend("triton"),
                 lambda: attention.triton_check(torch.device("cpu"))):
        with pytest.raises(AttentionBackendError, match=r"needs Triton: pip install 'lollm-core\[triton\]'"):
            call()
    missing = str(tmp_path / "no-such-model")  # the backend is refused before anything loads
    _one_error_line(run_lollm("bench", missing, "--attn", "triton", sites=(_site_without_triton(tmp_path),)),
                    "lollm-core[triton]")


@pytest.mark.triton
def test_triton_without_a_gpu_or_the_interpreter_is_one_clear_error(monkeypatch, tmp_path):
    """Triton installed, TRITON_INTERPRET unset: a CPU device is refused before Triton looks for a GPU driver."""
    from _core_helpers import run_lollm

    import triton  # noqa: F401  (lollm-core[triton])

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(AttentionBackendError, match=r"runs on a CUDA GPU.*TRITON_INTERPRET=1"):
        attention.triton_check(torch.device("cpu"))
    if not torch.cuda.is_available():  # this machine has no GPU at all: say so even without a device
        with pytest.raises(AttentionBackendError, match=r"sees none.*TRITON_INTERPRET=1"):
            attention.resolve_backend("triton")
    missing = str(tmp_path / "no-such-model")
    line = _one_error_line(run_lollm("run", "-m", missing, "-p", "hi", "--device", "cpu", "--attn", "triton"),
                           "CUDA GPU", "TRITON_INTERPRET=1")
    assert "driver" not in line
    # picked through LOLLM_ATTN alone, never checked before the first call: the call checks
    code = """
        import torch
        from lollm.attention import attend
        from lollm.errors import AttentionBackendError
        q = torch.zeros(1, 2, 3, 16); k = torch.zeros(1, 1, 3, 16)
        try:
            attend(q, k, k, start=0)
        except AttentionBackendError as e:
            print("refused:", e)
    """
    from _core_helpers import child_env

    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=child_env(LOLLM_ATTN="triton"), timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.startswith("refused: the 'triton' attention backend runs on a CUDA GPU"), done.stdout


def test_shapes_that_break_the_contract_are_refused():
    q = torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match="3 query heads cannot share 2"):
        attend(q, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), start=2)
    with pytest.raises(ValueError, match="the keys must include the new positions"):
        attend(q, torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 1, 8), start=0)


# -- the command line: --attn and LOLLM_ATTN ------------------------------------------------------


def _one_error_line(done, *needles):
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ")
    for needle in needles:
        assert needle in line, line
    return line


def test_cli_refuses_unknown_backends_before_loading_anything(tmp_path, monkeypatch):
    """The model path does not exist: the error is about the backend, so it was checked first."""
    from _core_helpers import run_lollm

    missing = str(tmp_path / "no-such-model")
    _one_error_line(run_lollm("run", "-m", missing, "-p", "hi", "--attn", "flash"),
                    "--attn: unknown attention backend 'flash'", "sdpa, eager, triton")
    monkeypatch.setenv("LOLLM_ATTN", "fast")
    _one_error_line(run_lollm("parity", missing), "LOLLM_ATTN: unknown attention backend 'fast'")


@pytest.mark.parametrize("command", ["parity", "bench"])
def test_cli_hands_the_backend_to_parity_and_bench(monkeypatch, capsys, command):
    import sys

    import lollm.proof.bench as bench
    import lollm.cli as cli
    import lollm.proof.parity as parity

    seen = {}

    def fake_parity(spec, **kwargs):
        seen["attn"] = kwargs["options"].attn
        report = parity.ParityReport(model=spec, family="fake", dtype="float32", device="cpu", num_tokens=1,
                                     min_cosine_required=0.99999, attn=kwargs["options"].attn)
        report.positions = [parity.PositionStats(0, 5, 1, 1, 5, 1.0, 0.0)]
        return report

    def fake_bench(spec, options, **kwargs):
        seen["attn"] = options.attn
        return bench.BenchResult([], prompt_tokens=1, new_tokens=1, threads=1)

    monkeypatch.setattr(parity, "run_parity", fake_parity)
    monkeypatch.setattr(bench, "run_bench", fake_bench)
    monkeypatch.setattr(sys, "argv", ["lollm", command, "some/model", "--attn", "eager", "--json"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    assert info.value.code in (0, None)
    assert seen["attn"] == "eager"


def test_bench_generates_with_the_backend_it_loaded(monkeypatch):
    """bench measures in-process: our engine's every generation runs with the load's backend."""
    import types

    import lollm.proof.bench as bench
    import lollm.generate.loop as generate_module

    loads, runs = [], []

    def fake_open_model(spec, options):
        loads.append(options.attn)
        return types.SimpleNamespace(model=torch.nn.Linear(2, 2), attn=options.attn or "sdpa")

    def fake_generate(model, ids, **kwargs):
        runs.append(kwargs.get("attn"))
        return generate_module.GenerationResult(prompt_ids=list(ids), new_ids=[1, 1], text="", stop_reason="max_new_tokens",
                                                prefill_seconds=0.1, decode_seconds=0.1)

    monkeypatch.setattr(bench, "open_model", fake_open_model)
    monkeypatch.setattr(bench, "generate", fake_generate)
    engine = bench.LollmEngine("some/model", LoadOptions(device="cpu", attn="eager"))
    engine.load()
    engine.prefill([1, 2, 3])
    engine.decode([1, 2, 3], 1)
    assert loads == ["eager"] and runs == ["eager", "eager"]


def test_an_engine_step_takes_a_backends_paged_path_for_the_rows_it_covers(monkeypatch):
    """attend(start=Batch): a backend's ``attend_paged`` runs once for the step; only the sequences
    it leaves uncovered take the per-sequence gather loop, and the step equals the plain backend's."""
    from lollm.batch import Batch

    g = torch.Generator().manual_seed(7)
    H, K, D, block_size = 4, 2, 16, 4
    k_pool, v_pool = torch.randn(2, 9, block_size, K, D, generator=g)
    batch = Batch(starts=[5, 0, 9], counts=[1, 6, 2], block_tables=[[3, 7], [1, 8], [6, 0, 2]],
                  block_size=block_size, state_slots=[0, 1, 2])
    q = torch.randn(1, H, 9, D, generator=g)
    with use_backend("eager"):
        want = attend(q, k_pool, v_pool, start=batch, window=4)
    paged_calls, loop_calls = [], []

    def paged(q, k_pool, v_pool, batch, **kw):  # covers sequences 0 and 2 with something the loop never writes
        paged_calls.append(kw)
        out = torch.full_like(q, float("nan"))
        out[:, :, 0:1], out[:, :, 7:9] = want[:, :, 0:1], want[:, :, 7:9]
        return out, [True, False, True]

    def per_sequence(q, k, v, **kw):
        loop_calls.append((q.shape[2], k.shape[2], kw["start"]))
        return attention.eager_attention(q, k, v, **kw)

    monkeypatch.setitem(attention.BACKENDS, "paged-test", attention.Backend("paged-test", "test", per_sequence,
                                                                           attend_paged=paged))
    with use_backend("paged-test"):
        got = attend(q, k_pool, v_pool, start=batch, window=4)
    assert paged_calls == [dict(window=4, softcap=None, scale=None)]
    assert loop_calls == [(6, 6, 0)]  # only sequence 1: 6 queries over its 6 gathered keys
    assert torch.equal(got, want)


def _decode_step(H, K, D, block_size, starts, seed, counts=None):
    """q (1, H, N, D), pools and the Batch of an engine step (by default one query each) over scattered
    blocks; every slot no sequence has written, and every block no table lists, is NaN."""
    from lollm.batch import Batch

    g = torch.Generator().manual_seed(seed)
    counts = counts or [1] * len(starts)
    needed = [-(-(s + c) // block_size) for s, c in zip(starts, counts)]
    num_blocks = 1 + sum(needed) + 2
    order = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()
    tables = [order[sum(needed[:i]):sum(needed[: i + 1])] for i in range(len(starts))]
    pools = []
    for _ in range(2):
        pool = torch.full((num_blocks, block_size, K, D), float("nan"))
        for table, s, c in zip(tables, starts, counts):
            flat = torch.randn(len(table) * block_size, K, D, generator=g)
            flat[s + c :] = float("nan")
            pool[table] = flat.view(len(table), block_size, K, D)
        pools.append(pool)
    batch = Batch(starts=list(starts), counts=list(counts), block_tables=tables, block_size=block_size,
                  state_slots=list(range(len(starts))))
    return torch.randn(1, H, sum(counts), D, generator=g), pools[0], pools[1], batch


@pytest.mark.parametrize("counts", [None, [1, 3, 1, 1, 1]], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 6, 1000])
@pytest.mark.parametrize("heads", [(14, 2), (4, 4)])
def test_a_decode_step_of_several_sequences_is_one_sdpa_call(window, heads, counts, monkeypatch):
    """With the sdpa backend, the sequences of a step that bring one query each run in one call
    (keys padded to the longest, a mask); a sequence with more queries (a prompt's chunk) keeps its
    own call. Each row equals the per-sequence loop (here the eager backend in float64) within
    float32 rounding, and no NaN of an unwritten slot, a padding block or a block released before
    the window reaches it. This is the path without the native kernel (which takes every engine
    step on a CPU where it is built: test_attention_invariance.py), so the kernel is held off."""
    monkeypatch.setattr(attention, "paged_attention_op", lambda: None)
    H, K = heads
    q, k_pool, v_pool, batch = _decode_step(H, K, 64, 4, starts=[0, 5, 17, 30, 3], seed=11, counts=counts)
    if window is not None and window < 30:  # the engine gives back blocks before the window: -1, NaN there
        batch.window_tables, batch.window = [list(t) for t in batch.block_tables], window
        for table, s in zip(batch.window_tables, batch.starts):
            for i in range(max(0, s - window + 1) // 4):
                k_pool[table[i]], v_pool[table[i]], table[i] = float("nan"), float("nan"), -1
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(a[0].shape) or real_sdpa(*a, **kw))
    with use_backend("sdpa"):
        got = attend(q, k_pool, v_pool, start=batch, window=window)
    if counts is None:
        assert calls == [torch.Size([5, K, H // K, 64])], "one call for the five sequences"
    else:  # the four decode rows at once, then sequence 1's three queries alone
        assert calls == [torch.Size([4, K, H // K, 64]), torch.Size([1, H, 3, 64])]
    with use_backend("eager"):
        want = attend(q.double(), k_pool.double(), v_pool.double(), start=batch, window=window)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() < 1e-5


def test_bench_report_prints_its_note_as_text_and_advice_only_where_ratios_exist(monkeypatch, capsys):
    """The note names "lollm-core[bench]": rich must not read it as markup (it once printed "lollm-core")."""
    import lollm.proof.bench as bench
    import lollm.cli.report as cli_report
    from lollm.load.options import LoadOptions

    monkeypatch.setattr(cli_report, "out", cli_report.Console(highlight=False, width=400))
    options = LoadOptions(device="cpu", attn="eager", weights="auto")
    alone = bench.BenchResult([bench.EngineFigures("lollm", prefill_tok_s=[10.0], decode_tok_s=[2.0])],
                              prompt_tokens=4, new_tokens=2, threads=1, note=bench.NO_LLAMA_CPP)
    cli_report.bench(alone, model="m.gguf", options=options, new_tokens=2, rounds=1, as_json=False)
    text = capsys.readouterr().out
    assert "pip install 'lollm-core[bench]'" in text and "1 round," in text and "1 rounds" not in text
    assert "per-round ratios" not in text  # nothing to read: one engine, no ratios
    both = bench.BenchResult([bench.EngineFigures("lollm", prefill_tok_s=[10.0], decode_tok_s=[2.0]),
                              bench.EngineFigures("llama.cpp", prefill_tok_s=[5.0], decode_tok_s=[4.0])],
                             prompt_tokens=4, new_tokens=2, threads=1)
    cli_report.bench(both, model="m.gguf", options=options, new_tokens=2, rounds=1, as_json=False)
    text = capsys.readouterr().out
    assert "lollm/llama.cpp decode: 0.50× (median of the per-round ratios 0.50; by CPU time n/a)" in text
    assert "read the per-round ratios" in text
