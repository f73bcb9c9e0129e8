"""Checks that the batched engine (:mod:`lollm.engine`) gives each request what it gets alone.

The conformance kit runs them against every family (``FamilyConformance``): a family
that runs batched must produce, for every request in a batch, the greedy tokens the
single-sequence loop (:func:`lollm.generate.loop.generate`) produces for it alone.

A batched step computes the same sums as a lone one, but a matmul over more rows may
add them in another order, so a logit can move by float rounding. Where that flips a
near-tie, the two runs part ways from there on. :func:`assert_same_greedy` allows that
one case only, and proves it is one: at the first differing position, the lone run's
two best logits must lie within ``tie_bound`` of each other, and the engine's pick must
be the runner-up. Any other difference fails.
"""

from __future__ import annotations

import torch

from lollm.engine.driver import EngineJob, EngineLoop, EngineRun
from lollm.engine.engine import Engine, EngineConfig
from lollm.engine.cache import largest_window, window_blocks_per_sequence
from lollm.engine.scheduler import Request
from lollm.generate.loop import generate
from lollm.model import CausalLM
from lollm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
#: Two logits closer than this count as a tie that float rounding may flip (the kit's
#: self-consistency bound: a batched step is held to what a cached decode is held to).
TIE_BOUND = 1e-3


def solo(model: CausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The greedy tokens of ``prompt`` run alone through the single-sequence loop."""
    return generate(model, prompt, max_new_tokens=max_new_tokens, sampling=GREEDY).new_ids


@torch.inference_mode()
def assert_same_greedy(model: CausalLM, prompt: list[int], got: list[int], want: list[int], what: str,
                       tie_bound: float = TIE_BOUND) -> None:
    """``got`` (the engine's tokens) equals ``want`` (alone), or parts from it at a proven near-tie."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a == b:
            continue
        logits = model(torch.tensor([prompt + want[:i]]), logits_to_keep=1)[0, -1].double()
        top2 = torch.topk(logits, 2)
        gap = float(top2.values[0] - top2.values[1])
        # the two picks must be the two best, within the bound (this recomputation may itself order them
        # either way: its one forward rounds elsewhere than the lone run's decode steps)
        assert set(top2.indices.tolist()) == {a, b} and gap <= tie_bound, (
            f"{what}: token {i} is {a} batched but {b} alone, and that is no near-tie "
            f"(alone the best two are {top2.indices.tolist()} with a gap of {gap:.2e}, bound {tie_bound:g})")
        return
    assert len(got) == len(want), f"{what}: {len(got)} tokens batched, {len(want)} alone"


@torch.inference_mode()
def path_noise(model: CausalLM, prompt: list[int], decode: int = 8) -> float:
    """How far a model's own two ways of computing a logit part, on ``prompt``: max |Δ logit|.

    One forward over the whole prompt (many rows at once, as in a prefill or a full engine
    step) against a prefill of all but the last ``decode`` tokens and then one token at a
    time (a decode step's one row). A float model gives float rounding (about 1e-5). Packed GGUF
    weights give every row the same bits at any row count (docs/batch-invariance.md, "The same bits alone and in any batch"), but the
    single-sequence loop attends through torch's SDPA, whose sums follow the call's shape, and the
    next layer's int8 activations magnify a last-bit difference into a code: their logits part by
    more (about 0.1 to 0.3). A caller that compares an engine run with a lone run of the loop on
    such a model derives its ``tie_bound`` from this figure instead of :data:`TIE_BOUND`.
    """
    decode = max(1, min(decode, len(prompt) - 1))
    head = len(prompt) - decode
    whole = model(torch.tensor([prompt]))[0, head:].double()  # (decode, V): the logits after each of the last tokens
    cache = model.new_cache(len(prompt))
    model(torch.tensor([prompt[:head]]), cache, logits_to_keep=1)
    steps = torch.stack([model(torch.tensor([[token]]), cache)[0, -1] for token in prompt[head:]]).double()
    return float((whole - steps).abs().max())


def run_engine(engine: Engine, arrivals: list[tuple[int, list[int], int]]) -> dict[str, Request]:
    """Run ``arrivals`` (step at which it arrives, prompt, max_new_tokens) to the end through the engine driver
    (:class:`lollm.engine.driver.EngineLoop`, stepped here); each request's record, by its id."""
    driver = EngineLoop(engine, background=False)
    runs: list[EngineRun] = []
    step = 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or driver.busy():
        while pending and pending[0][0] <= step:
            _, prompt, n = pending.pop(0)
            runs.append(driver.add(EngineJob(prompt, n, GREEDY)))
        driver.step()
        step += 1
        assert step < 10_000, "the engine made no progress in 10,000 steps"
    records: dict[str, Request] = {}
    for run in runs:
        run.future.result()  # a request the engine refused raises its error here
        req = records[run.request_id] = run.request
        assert req.tokens[req.prompt_len:] == run.result.new_ids, f"{run.request_id}: the outputs and the record disagree"
    return records


def mixed_prompts(prompt: list[int], count: int = 5) -> list[list[int]]:
    """``count`` prompts of different lengths and contents cut from ``prompt`` (the longest is all of it)."""
    T = len(prompt)
    lengths = [T, 3, max(2, T // 2), min(T, 17), max(2, T - 5), 9, 2][:count]
    return [prompt[i % T:] + prompt[: i % T] if L == T else prompt[i : i + L] if i + L <= T else prompt[:L]
            for i, L in enumerate(lengths)]


def pool_is_full(engine: Engine) -> None:
    for what, pool in (("KV", engine.scheduler.pool), ("sliding-window KV", engine.scheduler.window_pool)):
        if pool is not None:
            assert pool.num_free == pool.num_blocks and not any(pool.refs), (
                f"after every request ended, {pool.num_used} of {pool.num_blocks} {what} blocks are still taken")
    assert sorted(engine.scheduler.free_slots) == list(range(engine.config.max_sequences))


def check_engine_equals_solo(model: CausalLM, prompt: list[int], *, max_new_tokens: int = 6,
                             tie_bound: float = TIE_BOUND) -> dict[str, Request]:
    """Five requests of different lengths, two arriving mid-decode, with small blocks (4) and a token budget
    (12) that splits prompts into chunks mixed with decode steps: each request's greedy tokens equal
    its lone run's; the pool is full again afterwards. Returns the request records."""
    prompts = mixed_prompts(prompt)
    n = max(1, min(max_new_tokens, int(model.max_context) - max(len(p) for p in prompts) - 1))
    engine = Engine(model, EngineConfig(kv_blocks=256, block_size=4, max_sequences=8, max_batch_tokens=12))
    arrivals = [(0, prompts[0], n), (0, prompts[1], n), (0, prompts[2], n), (3, prompts[3], n), (5, prompts[4], n)]
    records = run_engine(engine, arrivals)
    for (rid, req), p in zip(records.items(), prompts):
        assert_same_greedy(model, p, req.tokens[req.prompt_len:], solo(model, p, n), f"request {rid}", tie_bound)
    pool_is_full(engine)
    return records


def check_prefix_cache_hit(model: CausalLM, prompt: list[int], *, max_new_tokens: int = 4) -> Request:
    """A request sharing a cached prefix takes its blocks (``cached_tokens`` > 0; a model with recurrent state
    up to a block where its state was saved) and still equals its lone run; the pool is full again
    afterwards. Returns the second request."""
    n = max(1, min(max_new_tokens, int(model.max_context) - len(prompt) - 1))
    engine = Engine(model, EngineConfig(kv_blocks=128, block_size=4, max_sequences=4, max_batch_tokens=16))
    first = prompt[: max(9, len(prompt) - 3)]
    second = first[:-1] + [(first[-1] + 1) % int(model.vocab_size)] + prompt[len(first):]
    run_engine(engine, [(0, first, n)])
    req = run_engine(engine, [(0, second, n)])["req-1"]
    if engine.kv.recurrent:  # reused only up to a block with a recurrent-state snapshot (lollm.engine.snapshots)
        assert req.cached_tokens > 0 and req.cached_tokens % 4 == 0, f"{req.cached_tokens} cached tokens reused"
        assert len(engine.snapshots) > 0
    else:
        assert req.cached_tokens >= 4 * ((len(first) - 2) // 4), f"only {req.cached_tokens} cached tokens reused"
    assert_same_greedy(model, second, req.tokens[req.prompt_len:], solo(model, second, n), "prefix-cache hit")
    pool_is_full(engine)
    return req


def check_preemption_and_abort(model: CausalLM, prompt: list[int], *, max_new_tokens: int = 8) -> list[Request]:
    """A pool too small for three requests at once: some are preempted and recomputed, and all equal their lone
    runs; a request aborted mid-decode frees its blocks. Returns the records of the three."""
    p = (prompt * 8)[:8]
    n = max(5, min(max_new_tokens, int(model.max_context) - len(p) - 1))
    blocks = 3 * 2  # the three prompts fit (2 blocks each), their answers do not: the newest are preempted
    engine = Engine(model, EngineConfig(kv_blocks=blocks, block_size=4, max_sequences=4, max_batch_tokens=64))
    prompts = [p, p[1:] + p[:1], p[2:] + p[:2]]
    records = run_engine(engine, [(0, q, n) for q in prompts])
    assert any(r.preemptions for r in records.values()), "the small pool never preempted: the test proves nothing"
    for (rid, req), q in zip(records.items(), prompts):
        assert_same_greedy(model, q, req.tokens[req.prompt_len:], solo(model, q, n), f"preempted {rid}")
    pool_is_full(engine)
    driver = EngineLoop(engine, background=False)
    job = EngineJob(p, n, GREEDY)
    driver.add(job)
    driver.step()
    driver.step()
    job.cancel.set()  # the driver aborts it at its next step
    driver.step()
    assert not engine.has_unfinished()
    pool_is_full(engine)
    return list(records.values())


def check_window_blocks_released(model: CausalLM, prompt: list[int], *, max_new_tokens: int = 6) -> Request | None:
    """A model with sliding-window layers keeps their keys in a pool of their own and gives back the blocks
    that left the window: one request with a prompt of several windows runs in chunks of 8 tokens through
    blocks of 4; after every step its window table has -1 for every block before the window its step read
    and at most :func:`~lollm.engine.cache.window_blocks_per_sequence` live blocks; the window pool's peak
    use is below the full pool's; the tokens equal the lone run's; both pools are full again afterwards.
    A model without such layers gets no window pool (returns None)."""
    size, chunk = 4, 8
    engine = Engine(model, EngineConfig(kv_blocks=512, block_size=size, max_sequences=2, max_batch_tokens=chunk))
    window = largest_window(model.cache_layers())
    if window is None:
        assert engine.scheduler.window_pool is None and engine.kv.num_window_blocks is None
        return None
    assert len(prompt) >= 2 * window + size, f"a prompt of {len(prompt)} tokens is too short for a window of {window}"
    n = max(1, min(max_new_tokens, int(model.max_context) - len(prompt) - 1))
    driver = EngineLoop(engine, background=False)
    run, peak = driver.add(EngineJob(prompt, n, GREEDY)), {"full": 0, "window": 0}
    while driver.busy():
        computed = run.request.computed if run.request is not None else 0  # the engine takes it at the first step
        read_from = max(0, computed - window + 1) // size  # the first block this step's window reads
        outs = driver.step()
        if outs and outs[-1].finished:
            break
        table = run.request.window_table
        assert all(b == -1 for b in table[:read_from]), f"window blocks before block {read_from} were kept: {table}"
        assert all(b >= 0 for b in table[read_from:]), f"a block inside the window was given back: {table}"
        live = sum(b >= 0 for b in table)
        assert live <= window_blocks_per_sequence(window, size, chunk), f"{live} live window blocks"
        stats = engine.stats()
        peak["full"] = max(peak["full"], stats["kv_blocks_used"])
        peak["window"] = max(peak["window"], stats["kv_window_blocks_used"])
    assert peak["window"] < peak["full"], f"the window pool never used fewer blocks than the full one: {peak}"
    assert_same_greedy(model, prompt, run.result.new_ids, solo(model, prompt, n), "a prompt of several windows")
    pool_is_full(engine)
    return run.request


# ---------------------------------------------------------------------------
# Batch invariance: the logits themselves, bit for bit
# ---------------------------------------------------------------------------


def run_engine_logits(engine: Engine, arrivals: list[tuple[int, list[int], int]]) -> list[list[torch.Tensor]]:
    """:func:`run_engine`, keeping the logits row (V,) the engine sampled each request's every token from.

    Returns one list per arrival, in the order given (not by arrival step): its rows, in order.
    """
    rows: dict[str, list[torch.Tensor]] = {}
    choose = engine._choose  # noqa: SLF001 -- the one place every sampled row passes

    def keep(req: Request, logits_row: torch.Tensor, greedy_pick: int | None):
        rows.setdefault(req.request_id, []).append(logits_row.detach().clone())
        return choose(req, logits_row, greedy_pick)

    engine._choose = keep  # noqa: SLF001
    try:
        records = run_engine(engine, arrivals)
    finally:
        del engine._choose  # back to the class's method
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])  # run_engine adds them by arrival step
    by_arrival = list(records)
    out: list[list[torch.Tensor]] = [[] for _ in arrivals]
    for position, i in enumerate(order):
        out[i] = rows.get(by_arrival[position], [])
    return out


def check_batch_invariance(model: CausalLM, arrivals: list[tuple[int, list[int], int]], config: EngineConfig,
                           *, bound: float = 0.0) -> float:
    """Each request's logits in a batch equal its logits alone, through the same engine: bit for bit.

    arrivals: (engine step at which it arrives, prompt ids, max_new_tokens). The requests run together
    through one :class:`~lollm.engine.engine.Engine` of ``config`` (their prompts chunked by the token
    budget among the others' decode rows, late arrivals joining mid-decode), then each alone through a
    fresh engine of the same config. Greedy: equal logits give equal tokens, so the two runs follow the
    same path to the end.

    bound: 0 (the default) asks ``torch.equal`` of every row: batch invariance. A float path that cannot
    be made bitwise (torch's float32 GEMM rounds a row differently at another row count) passes the
    largest |Δ logit| it allows instead; the runs must then still give the same tokens.
    Returns the largest |Δ logit| seen (0.0 when bitwise). AssertionError names the request and step.
    """
    together = run_engine_logits(Engine(model, config), arrivals)
    worst = 0.0
    for i, (_, prompt, n) in enumerate(arrivals):
        alone = run_engine_logits(Engine(model, config), [(0, prompt, n)])[0]
        assert len(together[i]) == len(alone), f"request {i}: {len(together[i])} tokens batched, {len(alone)} alone"
        for step, (a, b) in enumerate(zip(together[i], alone)):
            if bound == 0.0:
                assert torch.equal(a, b), (
                    f"request {i} ({len(prompt)} prompt tokens), token {step}: batched logits differ from the lone "
                    f"run's by up to {float((a.double() - b.double()).abs().max()):.3g} (batch invariance wants 0)")
            else:
                gap = float((a.double() - b.double()).abs().max())
                worst = max(worst, gap)
                assert gap <= bound, f"request {i}, token {step}: |Δ logit| {gap:.3g} over the bound {bound:g}"
                assert int(a.argmax()) == int(b.argmax()), f"request {i}, token {step}: another token batched"
    return worst


def invariance_arrivals(prompts: list[list[int]], max_new_tokens: int, *, late_every: int = 3) -> list[tuple[int, list[int], int]]:
    """Arrivals for :func:`check_batch_invariance`: most requests at step 0, every ``late_every``-th one
    arriving mid-decode (at step 2, 4, ...), so its prefill chunks share steps with the others' decode rows."""
    return [((i // late_every) * 2 if i % late_every == late_every - 1 else 0, p, max_new_tokens)
            for i, p in enumerate(prompts)]
