"""The ``lollm`` command line.

Commands::

    lollm run       MODEL --prompt TEXT      generate text, streamed to stdout
    lollm families                           the installed family plugins
    lollm tokenize  MODEL TEXT [--chat]      how text becomes token ids
    lollm parity    MODEL                    our logits against transformers'
    lollm trace     MODEL --prompt TEXT      one forward pass, drawn as a self-contained HTML page
    lollm bench     MODEL                    prefill/decode speed and memory, beside transformers
    lollm inspect   MODEL                    metadata and tensor table of a GGUF file or safetensors folder

Any :class:`lollm.errors.LollmError` is printed as one ``error:`` line on
stderr with exit status 2; ``parity`` exits 1 when the gate fails.
"""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lollm.errors import LollmError

app = typer.Typer(
    help="lollm: a study-first LLM inference engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Piped output (CI logs, files) gets wide lines instead of rich's 80-column default.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)


ATTN_HELP = "Attention backend: sdpa (the default and reference), eager (scores written out), triton (lollm-core[triton]). Default: $LOLLM_ATTN, else sdpa."


def _messages(prompt: str, system: Optional[str]) -> list[dict[str, str]]:
    messages = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return messages


@app.command()
def run(
    model: str = typer.Option(..., "--model", "-m", help="Checkpoint folder, .gguf file, Hugging Face repo id, or org/name:QUANT for a GGUF repo."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt; read from stdin when omitted."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System message (chat mode only)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens to generate."),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy. Default: generation_config, then the family's."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass (1 = off)."),
    min_p: Optional[float] = typer.Option(None, "--min-p", help="Drop tokens below min_p × the top probability."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", help="> 1 discourages repeats."),
    seed: Optional[int] = typer.Option(None, help="Random seed for sampling."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    no_chat: bool = typer.Option(False, "--no-chat", help="Use the prompt as raw text, without the chat template."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's enable_thinking flag (families with a thinking toggle). Default: the template's own default."),
    mtp: bool = typer.Option(False, "--mtp", help="Self-speculative decoding with the checkpoint's draft (MTP) head; same output, faster when drafts are accepted."),
    draft_tokens: int = typer.Option(3, "--draft-tokens", help="Tokens drafted per step with --mtp."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option("auto", help="auto (float32 on CPU, the checkpoint's dtype elsewhere), float32, bfloat16, float16."),
    attn: Optional[str] = typer.Option(None, "--attn", help=ATTN_HELP),
) -> None:
    """Generate a continuation of PROMPT, streamed to stdout; statistics go to stderr."""
    from lollm.generate import generate, stop_token_ids
    from lollm.pipeline import open_model
    from lollm.sampling import resolve_sampling

    if prompt is None:
        if sys.stdin.isatty():
            raise LollmError("give --prompt, or pipe the prompt on stdin")
        prompt = sys.stdin.read().rstrip("\n")  # the newline that ends a piped line is not part of the prompt
    loaded = open_model(model, device=device, dtype=dtype, progress=True, attn=attn)
    tokenizer = loaded.tokenizer
    capabilities = loaded.family.family.capabilities
    if think is not None and not capabilities.thinking_toggle:
        raise LollmError(f"--think/--no-think: the family {loaded.family.family.name!r} has no thinking toggle")
    if mtp and not capabilities.speculative_head:
        raise LollmError(f"--mtp: the family {loaded.family.family.name!r} has no speculative (MTP) head")
    if mtp and not getattr(loaded.model, "has_draft_head", False):
        raise LollmError(f"--mtp: the checkpoint {model} carries no draft-head tensors (mtp.*), so it cannot draft")
    template_flags = {} if think is None else {"enable_thinking": think}
    if no_chat or tokenizer.chat_template is None:
        if not no_chat:
            err.print("[dim]note: the checkpoint has no chat template; using the prompt as raw text[/dim]")
        if system:
            raise LollmError("--system needs the chat template; it cannot be used with --no-chat or a model without one")
        ids = tokenizer.encode(prompt)
    else:
        ids = tokenizer.encode_chat(_messages(prompt, system), add_generation_prompt=True, **template_flags)
    user = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
    sampling = resolve_sampling(user, loaded.checkpoint.generation_config, loaded.family.family.sampling_defaults, seed=seed)
    stops = stop_token_ids(loaded.checkpoint.generation_config, loaded.checkpoint.config, tokenizer)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = generate(
        loaded.model, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stops,
        stop_strings=stop, tokenizer=tokenizer, on_text=show, speculative_tokens=draft_tokens if mtp else 0,
        attn=loaded.attn,
    )
    sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(
        "[dim]" + escape(f"[{len(result.new_ids)} tokens · prompt {len(ids)} tokens at {result.prefill_tokens_per_second:.1f} tok/s · "
        f"decode {result.decode_tokens_per_second:.1f} tok/s · stop: {result.stop_reason} · "
        f"{loaded.family.family.name} on {loaded.device} {str(loaded.dtype).removeprefix('torch.')}]") + "[/dim]",
        soft_wrap=True,
    )
    if mtp:
        err.print(
            f"[dim]MTP: {result.accepted} of {result.drafted} drafted tokens accepted "
            f"(acceptance rate {result.acceptance_rate:.1%})[/dim]",
            soft_wrap=True,
        )


@app.command()
def families(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a plugin is broken or two plugins claim one type."),
) -> None:
    """List the installed family plugins (no model code is imported)."""
    from lollm.plugins import get_registry

    registry = get_registry()
    if as_json:
        data = {
            "families": [
                {"family": f.family.name, "model_types": list(f.family.model_types),
                 "gguf_architectures": list(f.family.gguf_architectures), "distribution": f.distribution,
                 "version": f.version, "plugin": f.plugin, "description": f.family.description}
                for f in registry.families
            ],
            "broken": [{"plugin": b.plugin, "distribution": b.distribution, "error": b.error} for b in registry.broken],
            "conflicts": {slot: [f.family.name for f in claimants] for slot, claimants in registry.conflicts.items()},
        }
        print(json.dumps(data, indent=2))
        if strict and (registry.broken or registry.conflicts):
            raise typer.Exit(1)
        return
    if not registry.families:
        out.print("No family plugin is installed. Install one, e.g. pip install lollm-qwen")
    else:
        table = Table(title="Installed lollm families")
        for col in ("family", "model types", "GGUF", "distribution", "version", "capabilities"):
            table.add_column(col)
        for f in registry.families:
            caps = [name for name, on in vars(f.family.capabilities).items() if on]
            table.add_row(f.family.name, ", ".join(f.family.model_types), ", ".join(f.family.gguf_architectures) or "-",
                          f.distribution, f.version, ", ".join(caps) or "-")
        out.print(table)
    for b in registry.broken:
        err.print(f"[red]broken plugin {escape(repr(b.plugin))} ({escape(b.distribution)}):[/red] {escape(b.error)}")
    for slot, claimants in registry.conflicts.items():
        who = ", ".join(f"{c.family.name} ({c.distribution})" for c in claimants)
        err.print(f"[red]{escape(slot)} is claimed by several families:[/red] {escape(who)}")
    if strict and (registry.broken or registry.conflicts):
        raise typer.Exit(1)


@app.command()
def tokenize(
    model: str = typer.Argument(..., help="Checkpoint folder, .gguf file or repo id (only the tokenizer is read)."),
    text: str = typer.Argument(..., help="The text to tokenize."),
    chat: bool = typer.Option(False, "--chat", help="Wrap TEXT as a user message with the chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message for --chat."),
    as_json: bool = typer.Option(False, "--json", help="Print {ids, pieces} as JSON."),
) -> None:
    """Show the token ids and pieces of TEXT: how the model sees it."""
    from pathlib import Path

    from lollm.loader import download_repo, _looks_like_repo_id
    from lollm.tokenizer import load_gguf_tokenizer, load_tokenizer

    folder = Path(model)
    if folder.is_file() and folder.suffix == ".gguf":
        tokenizer = load_gguf_tokenizer(folder)  # built from the file's tokenizer.* metadata
    else:
        if not folder.exists() and _looks_like_repo_id(model):
            folder = download_repo(model)
        tokenizer = load_tokenizer(folder)
    if chat:
        rendered = tokenizer.apply_chat_template(_messages(text, system), add_generation_prompt=True)
        ids = tokenizer.encode_chat(_messages(text, system), add_generation_prompt=True)
    else:
        rendered, ids = text, tokenizer.encode(text)
    pieces = tokenizer.pieces(ids)
    if as_json:
        print(json.dumps({"text": rendered, "ids": ids, "pieces": pieces}, ensure_ascii=False))
        return
    table = Table(title=f"{len(ids)} tokens")
    table.add_column("#", justify="right")
    table.add_column("id", justify="right")
    table.add_column("piece")
    for i, (tid, piece) in enumerate(zip(ids, pieces)):
        shown = piece.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")  # whitespace made visible
        table.add_row(str(i), str(tid), escape(f"'{shown}'"))
    out.print(table)


@app.command()
def parity(
    model: str = typer.Argument(..., help="Checkpoint folder or repo id."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (default: a paragraph of about 60 tokens)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the chat template to the prompt."),
    dtype: str = typer.Option("float32", help="float32 (the gate's standard), bfloat16 or float16."),
    device: str = typer.Option("cpu", help="Device for both models."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Required cosine (default 0.99999 at float32)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
    attn: Optional[str] = typer.Option(None, "--attn", help=ATTN_HELP),
) -> None:
    """Compare our logits with transformers' at every prompt position; exit 1 on failure."""
    from lollm.parity import DEFAULT_PROMPT, run_parity

    report = run_parity(model, prompt=prompt or DEFAULT_PROMPT, chat=chat, dtype=dtype, device=device, min_cosine=min_cosine,
                        attn=attn)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        table = Table(title=f"parity: {report.family} {report.dtype} {report.device} attn {report.attn}, {report.num_tokens} positions")
        for col in ("pos", "token", "ours", "ref", "top-5", "cosine", "max |Δ|"):
            table.add_column(col, justify="right")
        for p in report.positions:
            mark = "" if p.ours_argmax == p.ref_argmax else " ✗"
            table.add_row(str(p.position), str(p.token_id), f"{p.ours_argmax}{mark}", str(p.ref_argmax),
                          f"{p.top5_overlap}/5", f"{p.cosine:.7f}", f"{p.max_abs_diff:.2e}")
        out.print(table)
        verdict = "[green]PASS[/green]" if report.passed else "[red]FAIL[/red]"
        out.print(
            f"{verdict}: argmax {report.argmax_matches}/{report.num_tokens}, min cosine {report.min_cosine:.7f} "
            f"(required {report.min_cosine_required}), max |Δ| {report.max_abs_diff:.3e}, min top-5 overlap {report.min_top5_overlap}/5"
        )
        if report.first_diverging_layer is not None:
            i = report.first_diverging_layer
            where = "the embeddings" if i == 0 else f"the output of layer {i - 1}"
            out.print(f"first divergence: hidden state {i} ({where}), cosine {report.layer_cosines[i]:.6f}")
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def trace(
    model_arg: Optional[str] = typer.Argument(None, metavar="MODEL", help="Checkpoint folder, .gguf file or repo id (or give it with -m)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="The model, as an option instead of the MODEL argument."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="The prompt; read from stdin when omitted."),
    output: str = typer.Option("trace.html", "--output", "-o", help="Where to write the page."),
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System message (chat mode only)."),
    no_chat: bool = typer.Option(False, "--no-chat", help="Use the prompt as raw text, without the chat template."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's enable_thinking flag (families with a thinking toggle)."),
    compare: bool = typer.Option(False, "--compare", help="Also run transformers on the same ids and plot each hidden state's divergence (lollm-core[parity])."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option("float32", help="float32 (the default: the numbers of the parity gate), bfloat16, float16."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Refuse longer prompts (the page keeps every attention weight, T² per head)."),
) -> None:
    """Run PROMPT through the model once and write a self-contained HTML page of what happens inside.

    Tokens, the logit lens, attention per layer and head, what the family records of its
    own (DeltaNet gates, MoE routing, soft-caps, per-layer embeddings) and, with --compare,
    the divergence from transformers. See docs/trace.md.
    """
    from lollm.trace.run import run_trace

    if (model_arg is None) == (model is None):
        raise LollmError("lollm trace: give the model once, as MODEL or as --model/-m")
    spec = model_arg if model_arg is not None else model
    if prompt is None:
        if sys.stdin.isatty():
            raise LollmError("give --prompt, or pipe the prompt on stdin")
        prompt = sys.stdin.read().rstrip("\n")
    result = run_trace(spec, prompt=prompt, output=output, system=system, chat=not no_chat, think=think,
                       compare_reference=compare, device=device, dtype=dtype, max_tokens=max_tokens, progress=True)
    t = result.trace
    if not no_chat and not result.templated:
        err.print("[dim]note: the checkpoint has no chat template; using the prompt as raw text[/dim]")
    line = f"wrote {result.path} ({result.size / 1e6:.2f} MB): {len(t.ids)} tokens, {t.num_layers} layers, " \
           f"{len(t.attention)} attention layers, {len(t.internals)} family records"
    if t.divergence is not None:
        d = t.divergence
        line += "; divergence: " + ("none above the gate" if d.first is None else f"first at hidden state {d.first}")
    out.print(escape(line), soft_wrap=True)


@app.command()
def bench(
    model: str = typer.Argument(..., help="Checkpoint folder or repo id."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16."),
    prompt_tokens: int = typer.Option(512, help="Prefill length."),
    new_tokens: int = typer.Option(64, help="Decode steps."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's)."),
    no_reference: bool = typer.Option(False, "--no-reference", help="Skip transformers."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
    attn: Optional[str] = typer.Option(None, "--attn", help=ATTN_HELP),
) -> None:
    """Prefill and decode tok/s, load time and peak memory, ours beside transformers in one run."""
    from lollm.attention import resolve_backend
    from lollm.bench import run_bench

    attn = resolve_backend(attn)
    result = run_bench(model, dtype=dtype, prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                       reference=not no_reference, threads=threads, attn=attn)
    ratios = {k: result.ratio(k) for k in ("prefill_tok_s", "decode_tok_s", "load_seconds")}
    if as_json:
        print(json.dumps({"rows": result.rows, "ratios": ratios}, indent=2))
        return
    table = Table(title=f"bench: {model} ({dtype}, attn {attn}, prompt {prompt_tokens}, decode {new_tokens})")
    for col in ("engine", "load s", "load peak MB", "weights MB", "peak/weights", "prefill tok/s", "decode tok/s"):
        table.add_column(col, justify="right")
    for r in result.rows:
        table.add_row(r["engine"], f"{r['load_seconds']:.2f}", f"{r['load_peak_bytes'] / 1e6:.0f}",
                      f"{r['weights_bytes'] / 1e6:.0f}", f"{r['load_peak_bytes'] / r['weights_bytes']:.2f}",
                      f"{r['prefill_tok_s']:.1f}", f"{r['decode_tok_s']:.2f}")
    out.print(table)
    if ratios["decode_tok_s"] is not None:
        out.print(f"ratio lollm/transformers: prefill {ratios['prefill_tok_s']:.2f}×, decode {ratios['decode_tok_s']:.2f}×")


@app.command()
def inspect(
    model: str = typer.Argument(..., help="A .gguf file or a safetensors checkpoint folder."),
    tensors: bool = typer.Option(True, "--tensors/--no-tensors", help="Print the tensor table."),
    as_json: bool = typer.Option(False, "--json", help="Print everything as JSON (arrays summarized)."),
) -> None:
    """Show what is inside a checkpoint: metadata, tensors (name, shape, type, bytes), totals per type."""
    from lollm.inventory import inspect_checkpoint, summarize

    inv = inspect_checkpoint(model)
    totals = inv.totals()
    if as_json:
        print(json.dumps({
            "path": str(inv.path), "format": inv.fmt,
            "metadata": {k: summarize(v) for k, v in inv.metadata.items()},
            "tensors": [{"name": t.name, "shape": list(t.shape), "type": t.type, "bytes": t.nbytes} for t in inv.tensors],
            "totals": {k: {"tensors": n, "bytes": b} for k, (n, b) in totals.items()},
            "total_bytes": inv.total_bytes,
        }, indent=2, ensure_ascii=False))
        return
    meta = Table(title=f"{inv.path} ({inv.fmt}): metadata")
    meta.add_column("key")
    meta.add_column("value")
    for key, value in inv.metadata.items():
        meta.add_row(escape(str(key)), escape(summarize(value)))
    out.print(meta)
    if tensors:
        table = Table(title=f"{len(inv.tensors)} tensors")
        for col, justify in (("name", "left"), ("shape", "left"), ("type", "left"), ("bytes", "right")):
            table.add_column(col, justify=justify)
        for t in inv.tensors:
            table.add_row(escape(t.name), "×".join(map(str, t.shape)) or "scalar", t.type, f"{t.nbytes:,}")
        out.print(table)
    summary = Table(title="totals per type")
    for col in ("type", "tensors", "bytes"):
        summary.add_column(col, justify="right")
    for kind, (n, b) in totals.items():
        summary.add_row(kind, str(n), f"{b:,}")
    summary.add_row("all", str(len(inv.tensors)), f"{inv.total_bytes:,}")
    out.print(summary)


def main() -> None:
    """Console-script entry point: run the Typer app, turning LollmError into one clean line."""
    # Standalone mode: click itself prints usage errors (status 2), --help, and
    # turns typer.Exit(code) into that exit status; our own errors pass through it.
    try:
        app()
    except LollmError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
