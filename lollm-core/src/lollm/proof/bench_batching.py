"""Measuring the engine under load: N requests of one shape submitted at once, for several N.

``lollm bench MODEL --concurrency 1,4,16`` (and lollm-core/benchmarks/bench_batching.py) run,
for each concurrency level N, N requests of ``prompt_tokens`` prompt ids and ``new_tokens``
greedy new tokens, all handed to one :class:`lollm.engine.Engine` at the same moment, and
step it until every request is done. Per level:

* **output throughput**: every generated token of the level divided by the wall time from the
  submission to the last token (tok/s). A decode step reads the weights once for all its
  rows, so this grows with N until arithmetic, not memory, bounds a step (docs/batching.md);
* **TTFT** (time to first token) of each request, from the submission: with N requests the
  prompts share the steps, so the last prompt's first token waits for the others' chunks;
* **ITL** (inter-token latency): the time between one request's consecutive tokens: one step
  of the whole batch, so it grows with N while the throughput does.

Each request's prompt is the same text started at another offset, so no two share a first
block, and the pool's prefix cache is off: the figures are those of the batching alone.
Every request generates exactly ``new_tokens`` (no end-of-sequence id stops it). The levels
alternate within each round (1 4 16 1 4 16 ...), as :mod:`lollm.proof.bench` alternates engines, so
a shared machine's changing load touches every level alike; ratios are taken within a round.
Nothing here asserts a speed: these are figures to read.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from lollm.engine.cache import pool_room
from lollm.engine.driver import EngineJob, EngineLoop
from lollm.engine.engine import Engine, EngineConfig, why_not_batched
from lollm.errors import LollmError
from lollm.model import CausalLM
from lollm.sampling_params import SamplingParams


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``, interpolating linearly between ranks (0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LevelFigures:
    """One concurrency level's measurements over the rounds.

    tok_s: output tokens per second of the whole level, one value per round.
    ttfts: seconds from submission to the first token, one per request of every round.
    itls:  seconds between consecutive tokens of one request, every gap of every request and round.
    """

    concurrency: int
    tok_s: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)

    @property
    def median_tok_s(self) -> float:
        return statistics.median(self.tok_s) if self.tok_s else 0.0

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def itl(self, q: float) -> float:
        return percentile(self.itls, q)

    def to_json(self) -> dict[str, object]:
        return {"concurrency": self.concurrency, "output_tok_s": self.median_tok_s, "rounds_output_tok_s": self.tok_s,
                "ttft_p50_s": self.ttft(50), "ttft_p95_s": self.ttft(95), "itl_p50_s": self.itl(50),
                "itl_p95_s": self.itl(95)}


@dataclass
class ConcurrencyResult:
    """Every level's figures, in the order given (the first is the ratios' base)."""

    levels: list[LevelFigures]
    prompt_tokens: int
    new_tokens: int
    rounds: int
    threads: int

    def ratios(self, concurrency: int) -> list[float]:
        """Per round: the level's output tok/s over the first level's."""
        base = self.levels[0].tok_s
        level = next(f for f in self.levels if f.concurrency == concurrency).tok_s
        return [a / b for a, b in zip(level, base) if b > 0]

    def ratio(self, concurrency: int) -> float | None:
        """The median of :meth:`ratios` (None without a round)."""
        r = self.ratios(concurrency)
        return statistics.median(r) if r else None

    def to_json(self) -> dict[str, object]:
        base = self.levels[0].concurrency
        return {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "rounds": self.rounds,
                "threads": self.threads, "base_concurrency": base,
                "levels": [{**f.to_json(), f"ratio_to_{base}": self.ratio(f.concurrency),
                            f"rounds_ratio_to_{base}": self.ratios(f.concurrency)} for f in self.levels]}


def distinct_prompts(ids: list[int], count: int) -> list[list[int]]:
    """``count`` prompts of ``len(ids)`` ids: ``ids`` rotated by 7 more places each (no shared first block)."""
    n = len(ids)
    return [ids[(7 * i) % n:] + ids[: (7 * i) % n] for i in range(count)]


def measure_level(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], list[float]]:
    """Submit every prompt at once, step to the end through the engine driver: (output tok/s, TTFTs, inter-token gaps), seconds."""
    greedy = SamplingParams(temperature=0.0)
    driver = EngineLoop(engine, background=False)  # no stop ids: exactly new_tokens each
    submitted = time.perf_counter()
    runs = [driver.add(EngineJob(ids, new_tokens, greedy)) for ids in prompts]
    driver.run_until_done()
    times = [run.times for run in runs]
    end = max(t[-1] for t in times)
    tokens = sum(len(t) for t in times)
    ttfts = [t[0] - submitted for t in times]
    itls = [b - a for t in times for a, b in zip(t, t[1:])]
    return tokens / (end - submitted), ttfts, itls


def run_concurrency(model: CausalLM, ids: list[int], levels: list[int], *, new_tokens: int, rounds: int, threads: int,
                    log: Callable[[str], None] | None = None) -> ConcurrencyResult:
    """Measure ``levels`` in ``rounds`` alternating rounds on ``model`` (a loaded family model).

    ids: one prompt (every request gets it rotated, :func:`distinct_prompts`). One engine serves
    every level: room for the largest level's requests at once (within half the free memory, the cap
    of :func:`lollm.engine.cache.pool_blocks`), prefix caching off. Raises LollmError for a model that cannot run batched
    (:func:`lollm.engine.engine.why_not_batched`) or a largest level that would not fit half the free memory.
    """
    refusal = why_not_batched(model)
    if refusal is not None:
        raise LollmError(f"--concurrency: {refusal}")
    block, top = EngineConfig.block_size, max(levels)
    wanted = top * -(-(len(ids) + new_tokens) // block)
    # every request of the largest level at once (none preempted), within pool_blocks' cap of half the free memory
    room = pool_room(model, block)
    if room.half_free_blocks is not None and wanted > room.half_free_blocks:
        raise LollmError(f"--concurrency {top}: {top} requests at once need {wanted * room.block_bytes / 2**30:.1f} "
                         f"GiB of KV cache, more than half the {(room.free_bytes or 0) / 2**30:.1f} GiB free; give smaller "
                         f"levels or fewer tokens")
    engine = Engine(model, EngineConfig(kv_blocks=wanted, max_sequences=top, max_batch_tokens=max(256, top),
                                        prefix_caching=False))
    measure_level(engine, [ids[:16]], 2)  # warm-up: the first steps allocate and pick kernels
    figures = [LevelFigures(n) for n in levels]
    for r in range(rounds):
        for fig in figures:
            tok_s, ttfts, itls = measure_level(engine, distinct_prompts(ids, fig.concurrency), new_tokens)
            fig.tok_s.append(tok_s)
            fig.ttfts += ttfts
            fig.itls += itls
            if log is not None:
                log(f"round {r + 1}/{rounds}: {fig.concurrency} at once: {tok_s:.1f} output tok/s, "
                    f"TTFT p50 {percentile(ttfts, 50) * 1e3:.0f} ms")
    return ConcurrencyResult(figures, len(ids), new_tokens, rounds, threads)
