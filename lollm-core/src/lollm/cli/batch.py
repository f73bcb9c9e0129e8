"""What ``lollm run --prompts-file`` does when its prompts run batched, and what ``lollm bench --concurrency`` prints.

``run`` with more than one prompt hands them all to one engine (:class:`lollm.engine.llm.LLM`) when the
model can run batched and nothing asks for what the engine cannot do (``--tp``, ``--mtp``,
``--prompt-lookup``: :func:`batch_reason`); otherwise they run one after another as before, and a
note says why. The output is the same either way, in input order: per prompt the ``[prompt i/n]``
header, the text and the statistics line (or one JSON object with ``--json``). Batched, a prompt
is printed as soon as it and every prompt before it are done, and one closing line gives the
output throughput of the whole batch.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table

from lollm.cli import report as show
from lollm.cli.report import err, out
from lollm.engine.llm import LLM, Completion, PromptError
from lollm.errors import GenerationError, LollmError

# Lazy imports below: torch, lollm.attention, lollm.load.pipeline, lollm.generate.loop, lollm.proof.bench and
# lollm.proof.bench_batching import torch, which the CLI leaves until the flags are checked; the functions that run a model import them.

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only (these modules import torch)
    from lollm.generate.drafting import Drafter
    from lollm.generate.structured import CompiledConstraint
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import LoadedModel
    from lollm.proof.bench_batching import ConcurrencyResult
    from lollm.sampling_params import SamplingParams


def batch_reason(loaded: LoadedModel, drafter: Drafter | None) -> str | None:
    """Why ``run``'s prompts must run one at a time (None: they run batched through the engine):
    :func:`lollm.engine.engine.why_not_batched` of the loaded model and the drafter's flag."""
    from lollm.engine.engine import why_not_batched

    speculative = None if drafter is None else "--mtp" if drafter.name == "MTP" else "--prompt-lookup"
    return why_not_batched(loaded.model, tp=loaded.tp, speculative=speculative, family=loaded.family.family.name)


class _InOrder:
    """Prints completions in input order as they finish: each waits for the prompts before it."""

    def __init__(self, loaded: LoadedModel, prompts: list[str], sampling: SamplingParams, as_json: bool):
        self.loaded, self.prompts, self.sampling, self.as_json = loaded, prompts, sampling, as_json
        self.waiting: dict[int, Completion] = {}
        self.next = 0

    def take(self, completion: Completion) -> None:
        self.waiting[completion.index] = completion
        while self.next in self.waiting:
            self._print(self.waiting.pop(self.next))
            self.next += 1

    def _print(self, c: Completion) -> None:
        from lollm.generate.loop import GenerationResult

        if not self.as_json:
            err.print(f"[dim]\\[prompt {c.index + 1}/{len(self.prompts)}][/dim]")
            sys.stdout.write(c.text)
        decode = c.token_times[-1] - c.token_times[0] if c.token_times else 0.0
        result = GenerationResult(prompt_ids=c.prompt_ids, new_ids=c.token_ids, text=c.text, stop_reason=c.finish_reason,
                                  prefill_seconds=c.ttft, decode_seconds=decode, reused_tokens=c.cached_tokens,
                                  logprobs=c.logprobs)
        extra = {"batched": {"ttft_seconds": c.ttft, "cached_tokens": c.cached_tokens}}
        show.generation(self.loaded, self.prompts[c.index], result, self.sampling, as_json=self.as_json, extra=extra)


def run_batched(loaded: LoadedModel, prompts: list[str], all_ids: list[list[int]], *, sampling: SamplingParams,
                stop_strings: list[str], max_new_tokens: int, as_json: bool,
                constraint: CompiledConstraint | None = None) -> None:
    """``run``'s prompts through one engine; printed in input order, then (text) the batch's throughput line.

    ``constraint``: a compiled constraint every output follows (None: free text). Ctrl-C exits 130
    after what was printed.
    """

    llm = LLM.from_loaded(loaded)
    printer = _InOrder(loaded, prompts, sampling, as_json)
    started = time.perf_counter()
    try:
        done = llm.generate(all_ids, sampling, max_new_tokens=max_new_tokens, stop=stop_strings, constraint=constraint,
                            on_completion=printer.take)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except PromptError as bad:  # counted as the [prompt i/n] headers count: from 1
        raise GenerationError(f"prompt {bad.index + 1}/{len(prompts)}: {bad.detail}") from None
    seconds = time.perf_counter() - started
    if not as_json:
        tokens = sum(len(c.token_ids) for c in done)
        ttft = statistics.median(c.ttft for c in done)
        err.print("[dim]" + escape(f"[batched: {len(done)} prompts in one engine · {tokens} tokens in {seconds:.2f} s · "
                                   f"{tokens / seconds if seconds else 0.0:.1f} tok/s output · time to first token "
                                   f"median {ttft:.2f} s · up to {llm._engine.config.max_sequences} at once]") + "[/dim]",
                  soft_wrap=True)


# -- lollm bench --concurrency ----------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    """``--concurrency 1,4,16`` as [1, 4, 16] (ascending: the lowest is the ratios' base); LollmError naming the
    flag for anything but distinct positive whole numbers."""
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        raise LollmError(f"--concurrency {text!r}: give concurrency levels as whole numbers, e.g. 1,4,16") from None
    if not levels or min(levels) < 1:
        raise LollmError(f"--concurrency {text!r}: every level must be >= 1")
    if len(set(levels)) != len(levels):
        raise LollmError(f"--concurrency {text!r}: a level is given twice")
    return sorted(levels)


def bench_concurrency(spec: str, options: LoadOptions, *, levels: list[int], prompt_tokens: int, new_tokens: int, rounds: int,
                      threads: int | None, as_json: bool) -> None:
    """``bench --concurrency``: load as ``bench`` does, measure every level in alternating rounds, print the figures."""
    import torch

    from lollm.attention import use_backend
    from lollm.proof.bench import prompt_ids
    from lollm.proof.bench_batching import run_concurrency
    from lollm.load.pipeline import open_model
    from lollm.load.threads import apply_threads

    apply_threads(threads)
    loaded = open_model(spec, options)
    ids = prompt_ids(loaded.tokenizer, prompt_tokens)
    with use_backend(loaded.attn):
        result = run_concurrency(loaded.model, ids, levels, new_tokens=new_tokens, rounds=rounds,
                                 threads=torch.get_num_threads(), log=None if as_json else show.note)
    concurrency_report(result, model=spec, as_json=as_json)


def concurrency_report(result: ConcurrencyResult, *, model: str, as_json: bool) -> None:
    """``bench --concurrency``: JSON, or one row per level (throughput, its ratio, TTFT and inter-token latency)."""
    from lollm.proof.bench import machine_load

    if as_json:
        print(json.dumps({**result.to_json(), "machine": machine_load()}, indent=2))
        return
    base = result.levels[0].concurrency
    title = (f"bench --concurrency: {model} (prompt {result.prompt_tokens}, {result.new_tokens} new tokens per request, "
             f"{result.rounds} round{'s' if result.rounds != 1 else ''}, {result.threads} thread{'s' if result.threads != 1 else ''}; medians)")
    table = Table(title=escape(title))
    for col in ("requests at once", "output tok/s", f"× vs {base}", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms",
                "ITL p95 ms"):
        table.add_column(col, justify="right")
    for level in result.levels:
        ratio = result.ratio(level.concurrency)
        table.add_row(str(level.concurrency), f"{level.median_tok_s:.1f}", "-" if ratio is None else f"{ratio:.2f}×",
                      f"{level.ttft(50) * 1e3:.0f}", f"{level.ttft(95) * 1e3:.0f}", f"{level.itl(50) * 1e3:.1f}",
                      f"{level.itl(95) * 1e3:.1f}")
    out.print(table)
    out.print(f"× vs {base}: the median of the per-round ratios of output tok/s to concurrency {base}; TTFT: from "
              f"submission (all of a level at once) to a request's first token; ITL: between its tokens")
    out.print(f"[dim]{escape(machine_load())}: figures are noisy on a shared machine; read the ratios[/dim]")
