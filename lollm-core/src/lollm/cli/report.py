"""What the ``lollm`` commands print: the two consoles, and one function per report (tables, statistics, JSON).

``out`` is stdout (what a command produces: tables, JSON), ``err`` is stderr (notes,
statistics, warnings, errors). Piped output (CI logs, files) gets wide lines instead
of rich's 80-column default. Text that comes from outside (a file name, a plugin's
message) goes through ``rich.markup.escape`` before it is printed.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Lazy imports below: torch (the thread count), the plugin registry, the inventory and the benchmark's machine
# load, each only for the report that shows it, so that the CLI's start-up stays light.

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only (these modules import torch)
    from lollm.cli.models import ModelRow
    from lollm.generate.drafting import Drafter
    from lollm.generate.loop import GenerationResult
    from lollm.cli.inventory import Inventory, TensorRow
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import LoadedModel
    from lollm.load.registry import Registry
    from lollm.proof.bench import BenchResult
    from lollm.proof.parity import ParityReport
    from lollm.sampling_params import SamplingParams

out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)


def note(line: str) -> None:
    """One dim line on stderr (``line`` is plain text: escaped here)."""
    err.print(f"[dim]{escape(line)}[/dim]", soft_wrap=True)


# -- run and chat: how the weights were kept, the end of one generation ----------------


def execution_note(loaded: LoadedModel) -> str:
    """What the statistics line adds after the dtype: packed weights (their mode; the line above gives
    the details) and the tensor-parallel degree; empty for a plain float run in one process."""
    text = ""
    summary = getattr(loaded.model, "weights_summary", None)
    if summary is not None and summary.packed:
        text += f" · weights packed ({summary.requested})"
    if getattr(loaded, "tp", None) is not None:
        text += f" · tp {loaded.tp.world}"
    return text


def weights_summary(loaded: LoadedModel) -> None:
    """One dim line on stderr saying how the weights were kept (packed or float)."""
    summary = getattr(loaded.model, "weights_summary", None)
    if summary is not None and summary.requested != "float":
        kept = "" if summary.packed else f" (note: the family {loaded.family.family.name!r} keeps every weight float)"
        err.print("[dim]" + escape(summary.line() + kept) + "[/dim]", soft_wrap=True)


def generation(loaded: LoadedModel, prompt: str, result: GenerationResult, sampling: SamplingParams, *, as_json: bool,
               drafter: Optional[Drafter] = None, extra: Optional[dict[str, object]] = None) -> None:
    """The end of one generation of ``run``: a JSON object on stdout, or a newline and the statistics line on stderr.

    With a ``drafter`` (:mod:`lollm.generate.drafting`), a second line says how many of its drafts were accepted
    (JSON: ``"speculative": {"drafter", "drafted", "accepted"}``, and ``"mtp"`` as before for the draft head).
    ``extra``: more keys of the JSON object (a batched run's ``"batched"``: its time to first token and
    cached prompt tokens).
    """
    dtype = str(loaded.dtype).removeprefix("torch.")
    if as_json:
        data = {
            "prompt": prompt, "text": result.text, "ids": result.new_ids, "prompt_ids": result.prompt_ids,
            "stop_reason": result.stop_reason,
            "timings": {
                "load_seconds": loaded.load_seconds, "prefill_seconds": result.prefill_seconds,
                "decode_seconds": result.decode_seconds, "prefill_tokens_per_second": result.prefill_tokens_per_second,
                "decode_tokens_per_second": result.decode_tokens_per_second,
                "threads": _torch_threads(),
            },
            "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                         "min_p": sampling.min_p, "repetition_penalty": sampling.repetition_penalty, "seed": sampling.seed,
                         "sources": dict(sampling.sources)},
            "family": loaded.family.family.name, "device": str(loaded.device), "dtype": dtype,
        }
        if drafter is not None:
            data["speculative"] = {"drafter": drafter.name, "drafted": result.drafted, "accepted": result.accepted}
            if drafter.name == "MTP":
                data["mtp"] = {"drafted": result.drafted, "accepted": result.accepted}
        data.update(extra or {})
        print(json.dumps(data, ensure_ascii=False))
        sys.stdout.flush()
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(
        "[dim]" + escape(f"[{len(result.new_ids)} tokens · load {loaded.load_seconds:.2f} s · prompt {len(result.prompt_ids)} tokens at "
        f"{result.prefill_tokens_per_second:.1f} tok/s · decode {result.decode_tokens_per_second:.1f} tok/s · stop: {result.stop_reason} · "
        f"{loaded.family.family.name} on {loaded.device} {dtype}{execution_note(loaded)}]") + "[/dim]",
        soft_wrap=True,
    )
    if drafter is not None:
        err.print(f"[dim]{escape(drafter_line(drafter.name, result.drafted, result.accepted))}[/dim]", soft_wrap=True)


def drafter_line(name: str, drafted: int, accepted: int) -> str:
    """The speculative statistics line: how many drafted tokens the target model accepted.

    Prompt lookup drafts only where the last tokens occurred earlier in the prompt or the output: a prompt
    with no repeats drafts nothing, which the line says instead of "0 of 0".
    """
    if drafted == 0:
        why = " (no n-gram of the context recurred, so every token came from a plain step)" if name == "prompt lookup" else ""
        return f"{name}: nothing drafted{why}"
    return f"{name}: {accepted} of {drafted} drafted tokens accepted (acceptance rate {accepted / drafted:.1%})"


def _torch_threads() -> int:
    """The intra-op threads torch computed with (``--threads``, else lollm.load.threads' default)."""
    import torch

    return torch.get_num_threads()


# -- families --------------------------------------------------------------------------


def families_json(registry: Registry) -> dict[str, object]:
    """``lollm families --json``: every installed family (with the plugin contract it speaks), and the trouble."""
    return {
        "families": [
            {"family": f.family.name, "model_types": list(f.family.model_types),
             "gguf_architectures": list(f.family.gguf_architectures), "distribution": f.distribution,
             "version": f.version, "plugin": f.plugin, "contract": f.family.contract,
             "description": f.family.description}
            for f in registry.families
        ],
        "broken": [{"plugin": b.plugin, "distribution": b.distribution, "error": b.error} for b in registry.broken],
        "conflicts": {slot: [f.family.name for f in claimants] for slot, claimants in registry.conflicts.items()},
        "load_plugins": None if registry.allowlist is None else list(registry.allowlist.values()),
        "skipped": [{"plugin": k.plugin, "distribution": k.distribution, "version": k.version} for k in registry.skipped],
        "warnings": registry.warnings(),
        "install_hints": [{"kind": h.kind, "key": h.key, "install": h.install, "source": h.source} for h in registry.hints],
    }


def families_table(registry: Registry) -> None:
    """``lollm families``: the table of installed families on stdout (or why there is none), then the trouble on stderr."""
    from lollm.load.registry import FIRST_PARTY_MODEL_TYPES, LOAD_PLUGINS_ENV

    if not registry.families and registry.skipped:
        out.print(f"No family plugin is loaded: {LOAD_PLUGINS_ENV} leaves out every installed one.")
    elif not registry.families:
        firsts = ", ".join(sorted(set(FIRST_PARTY_MODEL_TYPES.values())))
        out.print(f"No family plugin is installed. Install one, e.g. pip install ./lollm-qwen from the lollm repository "
                  f"(first-party: {firsts})")
    else:
        table = Table(title="Installed lollm families")
        for col in ("family", "model types", "GGUF", "distribution", "version", "contract", "capabilities"):
            table.add_column(col)
        for f in registry.families:
            caps = [name for name, on in vars(f.family.capabilities).items() if on]
            table.add_row(f.family.name, ", ".join(f.family.model_types), ", ".join(f.family.gguf_architectures) or "-",
                          f.distribution, f.version, str(f.family.contract), ", ".join(caps) or "-")
        out.print(table)
    for b in registry.broken:
        err.print(f"[red]broken plugin {escape(repr(b.plugin))} ({escape(b.distribution)}):[/red] {escape(b.error)}")
    for slot, claimants in registry.conflicts.items():
        who = ", ".join(f"{c.family.name} ({c.distribution})" for c in claimants)
        err.print(f"[red]{escape(slot)} is claimed by several families:[/red] {escape(who)} "
                  f"(choose with --family NAME)")
    for k in registry.skipped:
        err.print(f"[dim]skipped {escape(k.distribution)} {escape(k.version)} (plugin {escape(repr(k.plugin))}): "
                  f"not named in {LOAD_PLUGINS_ENV}[/dim]", soft_wrap=True)
    plugin_warnings(registry)


def plugin_warnings(registry: Registry) -> None:
    """The registry's warnings (``$LOLLM_LOAD_PLUGINS`` naming what is not installed ...), one yellow line each on stderr."""
    for line in registry.warnings():
        err.print(f"[yellow]warning:[/yellow] {escape(line)}", soft_wrap=True)


# -- tokenize, list, inspect ----------------------------------------------------------------


def tokens_table(ids: list[int], pieces: list[str]) -> None:
    """``lollm tokenize``: one row per token (position, id, piece with its whitespace made visible)."""
    table = Table(title=f"{len(ids)} tokens")
    table.add_column("#", justify="right")
    table.add_column("id", justify="right")
    table.add_column("piece")
    for i, (tid, piece) in enumerate(zip(ids, pieces)):
        shown = piece.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")  # whitespace made visible
        table.add_row(str(i), str(tid), escape(f"'{shown}'"))
    out.print(table)


def models_table(rows: list[ModelRow]) -> None:
    """``lollm list``: the models of the caches, by the names the commands take (lollm.load.local_names)."""
    table = Table(title="Models on this machine (run one: lollm run NAME -p TEXT)")
    table.add_column("model", no_wrap=True)  # the name to copy: whole on one line, the other columns give way
    for col, justify in (("format", "left"), ("quant", "left"), ("size", "right"), ("family", "left"), ("cache", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for r in rows:
        table.add_row(escape(r.name), r.fmt,
                      escape(r.quant), f"{r.size / 2**20:,.1f} MiB", escape(r.family), r.source)
    out.print(table)
    out.print("Each name works as shown with run, chat, serve, tokenize and inspect, offline; "
              "lollm list --json gives each path.", style="dim", soft_wrap=True)


def inventory(inv: Inventory, rows: list[TensorRow], pattern: Optional[str], *, tensors: bool) -> None:
    """``lollm inspect``: the summary, the metadata, then (``tensors``) the tensors ``rows`` in natural order."""
    from lollm.cli.inventory import summarize

    inventory_summary(inv)
    meta = Table(title="metadata")
    meta.add_column("key")
    meta.add_column("value")
    for key, value in inv.metadata.items():
        meta.add_row(escape(str(key)), escape(summarize(value)))
    out.print(meta)
    if tensors:
        title = f"{len(rows)} tensors" + ("" if pattern is None else f" of {len(inv.tensors)} matching {pattern!r}")
        table = Table(title=escape(title))
        for col, justify in (("name", "left"), ("shape", "left"), ("type", "left"), ("bytes", "right")):
            table.add_column(col, justify=justify)
        for t in rows:
            table.add_row(escape(t.name), "×".join(map(str, t.shape)) or "scalar", t.type, f"{t.nbytes:,}")
        out.print(table)


def inventory_json(inv: Inventory, rows: list[TensorRow], pattern: Optional[str]) -> dict[str, object]:
    """``lollm inspect --json``: path, format, summary, metadata (arrays summarized), the tensors ``rows``, the totals."""
    from lollm.cli.inventory import summarize

    return {
        "path": str(inv.path), "format": inv.fmt, "summary": inv.summary(), "filter": pattern,
        "metadata": {k: summarize(v) for k, v in inv.metadata.items()},
        "tensors": [{"name": t.name, "shape": list(t.shape), "type": t.type, "bytes": t.nbytes} for t in rows],
        "totals": {k: {"tensors": n, "bytes": b} for k, (n, b) in inv.totals().items()},
        "total_bytes": inv.total_bytes,
    }


def inventory_summary(inv: Inventory) -> None:
    """The first table of ``inspect``: the checkpoint at a glance (lollm.cli.inventory.Inventory.summary)."""
    s = inv.summary()
    table = Table(title=escape(f"{inv.path} ({inv.fmt})"), show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("format", s["format"])
    table.add_row("architecture", escape(s["architecture"] or "(not named)"))
    table.add_row("tensors", f"{s['tensors']:,}")
    table.add_row("parameters", f"{s['parameters']:,}" + (f" ({s['parameters'] / 1e6:,.1f} M)" if s["parameters"] >= 1e6 else ""))
    table.add_row("bytes", size(s["bytes"]))
    table.add_row("types", escape(", ".join(f"{kind} {n} ({size(b)})" for kind, (n, b) in inv.totals().items()) or "-"))
    out.print(table)


def size(nbytes: int) -> str:
    """Bytes for a person: ``1,432 B`` below one MiB, else ``300.2 MiB``."""
    return f"{nbytes:,} B" if nbytes < 2**20 else f"{nbytes / 2**20:,.1f} MiB"


# -- parity and bench -----------------------------------------------------------------------


def parity(report: ParityReport, as_json: bool) -> None:
    """The parity report: JSON, or the table of positions and the verdict line."""
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
        return
    packed = "" if report.weights == "float" else f", {report.weights} weights"
    split = "" if report.tp == 1 else f", ours over --tp {report.tp} ranks"
    table = Table(title=f"parity: {report.family} {report.dtype}{packed} {report.device}{split} attn {report.attn}, "
                        f"{report.num_tokens} positions")
    for col in ("pos", "token", "ours", "ref", "top-5", "cosine", "max |Δ|"):
        table.add_column(col, justify="right")
    for p in report.positions:
        mark = "" if p.ours_argmax == p.ref_argmax else " ✗"
        table.add_row(str(p.position), str(p.token_id), f"{p.ours_argmax}{mark}", str(p.ref_argmax),
                      f"{p.top5_overlap}/5", f"{p.cosine:.7f}", f"{p.max_abs_diff:.2e}")
    out.print(table)
    verdict = "[green]PASS[/green]" if report.passed else "[red]FAIL[/red]"
    out.print(
        f"{verdict}: argmax {report.argmax_matches}/{report.num_tokens}"
        + ("" if report.min_top1_required >= 1 else f" (required {report.min_top1_required:.0%})")
        + f", min cosine {report.min_cosine:.7f} "
        f"(required {report.min_cosine_required}), max |Δ| {report.max_abs_diff:.3e}, min top-5 overlap {report.min_top5_overlap}/5"
    )
    if report.first_diverging_layer is not None:
        i = report.first_diverging_layer
        where = "the embeddings" if i == 0 else f"the output of layer {i - 1}"
        out.print(f"first divergence: hidden state {i} ({where}), cosine {report.layer_cosines[i]:.6f}")


def _times(ratio: float | None) -> str:
    """A ratio as "0.87×"; "n/a" where the reference measured nothing (no round, or 0 tokens/s)."""
    return "n/a" if ratio is None else f"{ratio:.2f}×"


def bench(result: BenchResult, *, model: str, options: LoadOptions, new_tokens: int, rounds: int, as_json: bool) -> None:
    """The bench figures: JSON, or the table, the ratios and the machine's load.

    ``options``: the :class:`lollm.load.options.LoadOptions` lollm was benched with (its dtype,
    weights, quantize, resolved attention backend and ``tp`` are named in the title).
    """
    from lollm.proof.bench import machine_load

    tp = options.tp
    names = [e.name for e in result.engines]
    ratios = {ref: {k: {"median": result.ratio("lollm", ref, k), "rounds": result.ratios("lollm", ref, k)}
                    for k in ("prefill_tok_s", "decode_tok_s")}
              for ref in ("transformers", "llama.cpp") if ref in names}
    if as_json:
        print(json.dumps({"rows": result.rows, "ratios_lollm_over_transformers": ratios.get("transformers", {}),
                          "ratios_lollm_over_llama_cpp": ratios.get("llama.cpp", {}), "note": result.note,
                          "threads": result.threads, "tp": tp, "machine": machine_load()}, indent=2))
        return
    kept = ("weights " + (f"--quantize {options.quantize}" if options.quantize else options.weights)) + ", "
    split = "" if tp == 1 else f"--tp {tp}: rank 0's load and shard, steps of all {tp} ranks together; "
    title = (f"bench: {model} ({options.dtype}, {kept}attn {options.attn}, prompt {result.prompt_tokens}, decode {new_tokens}, "
             f"{rounds} round{'s' if rounds != 1 else ''}, {result.threads} thread{'s' if result.threads != 1 else ''}{' per process' if tp != 1 else ''}; {split}medians)")
    table = Table(title=escape(title))
    for col in ("engine", "load s", "load peak MB", "weights MB", "peak/weights", "prefill tok/s", "decode tok/s",
                "decode GB/s", "prefill / decode tok/s by CPU time"):
        table.add_column(col, justify="right")
    for e in result.engines:
        table.add_row(e.name, f"{e.load_seconds:.2f}", f"{e.load_peak_bytes / 1e6:.0f}", f"{e.weights_bytes / 1e6:.0f}",
                      f"{e.load_peak_bytes / max(e.weights_bytes, 1):.2f}", f"{e.median('prefill_tok_s'):.1f}",
                      f"{e.median('decode_tok_s'):.2f}", f"{e.bandwidth_gb_s:.1f}",
                      f"{e.median('prefill_cpu_tok_s'):.1f} / {e.median('decode_cpu_tok_s'):.2f}")
    out.print(table)
    out.print("decode GB/s: weight bytes (lollm: as held in memory; llama.cpp: the file) × decode tok/s, the "
              "memory traffic a decode step sustains")
    for ref, by_key in ratios.items():
        for key, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
            per_round = " ".join(f"{r:.2f}" for r in by_key[key]["rounds"])
            cpu = result.ratio("lollm", ref, key.replace("_tok_s", "_cpu_tok_s"))
            out.print(f"lollm/{ref} {label}: {_times(by_key[key]['median'])} (median of the per-round ratios {per_round}; "
                      f"by CPU time {_times(cpu)})")
    decode = result.by_name("lollm").median("decode_tok_s")
    if tp != 1 and decode > 0:
        out.print(f"--tp {tp}: {1000 / decode:.2f} ms per decode step, each step computed by {tp} processes together "
                  f"(compare with the same command without --tp, one process)")
    if result.note:
        out.print(escape(result.note))  # it names 'lollm-core[bench]': not markup
    advice = "; read the per-round ratios" if ratios else ""
    out.print(f"[dim]{escape(machine_load())}: figures are noisy on a shared machine{advice}[/dim]")
