"""``lollm parity``, ``lollm trace`` and ``lollm bench``: prove, look inside, and measure."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from lollm.cli import report as show
from lollm.cli.batch import bench_concurrency, parse_levels
from lollm.cli.checks import check_family, check_mmproj_exists, require_extra
from lollm.cli.inputs import read_stdin
from lollm.cli.options import (Attn, Device, Dtype, Family, GroupSize, Json, MmprojFile, ModelArg, ModelOpt, NoChat,
                               Prompt, Quantize, System, Think, Threads, Tp, Weights, load_options, which_model,
                               with_help)
from lollm.cli.report import err, out
from lollm.errors import LollmError
from lollm.load.options import LoadOptions, check_threads
from lollm.load.ranks import finish, silence_followers

if TYPE_CHECKING:  # pragma: no cover - the name for an annotation only (lollm.cli.trace.run imports torch)
    from lollm.cli.trace.run import TraceResult

# Lazy imports below: lollm.proof, lollm.attention, lollm.load.pipeline and lollm.cli.trace.run import torch, which
# waits until every flag is checked (a typo costs nothing); each command imports them after its checks.


def parity(
    model_arg: with_help(ModelArg, "Checkpoint folder, .gguf file or repo id (a GGUF is compared with transformers on its dequantized weights).") = None,
    family_name: Family = None,
    prompt: with_help(Prompt, "Prompt text (default: a paragraph of about 60 tokens).") = None,
    chat: bool = typer.Option(False, "--chat", help="Apply the chat template to the prompt."),
    dtype: with_help(Dtype, "float32 (the gate's standard), bfloat16 or float16.") = "float32",
    device: with_help(Device, "Device for both models.") = "cpu",
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", metavar="X", help="Required cosine (default 0.99999 at float32; 0.98 with packed weights)."),
    as_json: with_help(Json, "Print the full report as JSON.") = False,
    attn: Attn = None,
    weights: with_help(Weights, "float (the default, the gate's standard; auto with --quantize), or quantized / auto: our packed weights against transformers' float32 (a looser gate).") = None,
    quantize: Quantize = None,
    group_size: GroupSize = 32,
    tp: with_help(Tp, "Our model split over N processes started by torchrun: `torchrun --nproc-per-node N -m lollm parity --tp N …`; the reference runs whole on rank 0 (docs/tensor-parallel.md).") = 1,
    model_opt: ModelOpt = None,
    image: Optional[list[str]] = typer.Option(None, "--image", metavar="FILE", help="Compare the image path too (repeatable): the prompt gets each image, ours reads it through the family's vision tower, the reference is transformers' whole *ForConditionalGeneration on the same pixels (docs/vision.md)."),
    mmproj: with_help(MmprojFile, "Refused, with the way to go: transformers reads no mmproj file, so a GGUF's image "
                                  "path has no reference on the same weights (compare its safetensors checkpoint).") = None,
) -> None:
    """Compare our logits with transformers' at every prompt position. Exit 1 on failure."""
    model, _ = which_model(model_opt, model_arg)
    if mmproj is not None or (image and model.lower().endswith(".gguf")):  # before anything loads
        from lollm.proof.parity_images import refuse_gguf_images

        refuse_gguf_images(model)
    check_family(family_name)
    options = load_options("parity", device=device, dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                           group_size=group_size, tp=tp, family=family_name)
    require_extra("parity", "lollm parity")  # transformers is the reference: missing, say so before our model loads
    from lollm.proof.parity import DEFAULT_PROMPT, run_parity
    from lollm.load.process_group import current

    report = run_parity(model, prompt=prompt or DEFAULT_PROMPT, chat=chat, options=options, min_cosine=min_cosine,
                        images=image or ())
    group = current()  # --tp: every rank holds rank 0's report: rank 0 prints it, every rank exits with its verdict
    silence_followers(group, err)
    show.parity(report, as_json)
    finish(group)  # rank 0 has printed before any rank exits (torchrun stops the others when one exits 1)
    raise typer.Exit(0 if report.passed else 1)


def trace(
    model_arg: ModelArg = None,
    family_name: Family = None,
    model_opt: ModelOpt = None,
    prompt: Prompt = None,
    output: str = typer.Option("trace.html", "--output", "-o", metavar="FILE", help="Where to write the page: a new file, or a regular file it replaces (never a symlink, FIFO or device)."),
    system: System = None,
    no_chat: NoChat = False,
    think: with_help(Think, "The chat template's enable_thinking flag (families with a thinking toggle).") = None,
    compare: bool = typer.Option(False, "--compare", help="Also run transformers on the same ids and plot each hidden state's divergence (lollm-core[parity])."),
    device: Device = "auto",
    dtype: with_help(Dtype, "float32 (the default: the numbers of the parity gate), bfloat16, float16.") = "float32",
    max_tokens: int = typer.Option(256, "--max-tokens", metavar="N", help="Refuse longer prompts (the page keeps every attention weight, T² per head); the model's context and the memory free bound it too."),
    image: Optional[list[str]] = typer.Option(None, "--image", metavar="FILE", help="Put an image in the prompt (repeatable): the page draws its tokens on the picture and the attention the last positions gave each of them (docs/vision.md)."),
    mmproj: MmprojFile = None,
) -> None:
    """Run a prompt through the model once and draw what happens inside as an HTML page.

    Tokens, the logit lens, attention per layer and head, the values a family shows of its
    own (DeltaNet gates, MoE routing, soft-caps, per-layer embeddings) and, with --compare,
    where each hidden state parts from transformers. See docs/trace.md.
    """
    spec, _ = which_model(model_opt, model_arg)
    if not output:
        raise LollmError("-o/--output is empty: give the path of the page to write (default trace.html)")
    if max_tokens < 1:
        raise LollmError(f"--max-tokens must be >= 1, got {max_tokens}")
    check_family(family_name)
    options = load_options("trace", device=device, dtype=dtype, family=family_name, progress=True)
    check_mmproj_exists(mmproj)
    if mmproj is not None and not image:
        raise LollmError("--mmproj holds a vision tower: it goes with --image")
    if compare:
        require_extra("parity", "lollm trace --compare")
    from lollm.cli.trace.page import check_output

    check_output(output)  # a page that could not be written is said now, before anything loads
    if prompt is None:
        prompt = read_stdin("--prompt").rstrip("\n")
    from lollm.cli.trace.run import run_trace  # (imports torch: after the checks above)

    result = run_trace(spec, prompt=prompt, output=output, system=system, chat=not no_chat, think=think,
                       compare_reference=compare, options=options, max_tokens=max_tokens,
                       log=lambda line: err.print(f"[dim]{escape(line)}[/dim]", soft_wrap=True), images=image or (),
                       mmproj=mmproj)
    if not no_chat and not result.templated:
        err.print("[dim]note: the checkpoint has no chat template; using the prompt as raw text[/dim]")
    out.print(escape(trace_summary(result)), soft_wrap=True)


def trace_summary(result: TraceResult) -> str:
    """``lollm trace``'s last line: what the page holds, in the words of its panels (docs/trace.md)."""
    t = result.trace
    line = (f"wrote {result.path} ({result.size / 1e6:.2f} MB): {len(t.ids)} tokens through {t.num_layers} layers; "
            f"the logit lens of every layer, the attention of {len(t.attention)} layers")
    family = t.meta.get("family", "the family")
    own = list(dict.fromkeys(record.name for record in t.internals))
    if own:
        line += f"; {family}'s own values: {', '.join(own)}"
    else:
        line += f"; {family} shows no values of its own beyond these"
    if t.divergence is not None:
        d = t.divergence
        line += "; beside transformers: " + ("every hidden state agrees within the gate" if d.first is None
                                             else f"hidden state {d.first} is the first to part from it")
    return line


def bench(
    model_arg: with_help(ModelArg, "Checkpoint folder, .gguf file or repo id.") = None,
    family_name: Family = None,
    dtype: with_help(Dtype, "float32 or bfloat16.") = "float32",
    prompt_tokens: int = typer.Option(512, metavar="N", help="Prefill length."),
    new_tokens: int = typer.Option(64, metavar="N", help="Decode steps."),
    threads: with_help(Threads, "torch threads (default: the free cores, as for lollm run).") = None,
    rounds: int = typer.Option(3, "--rounds", metavar="N", help="Alternating rounds (A B A B ...); medians are reported."),
    no_reference: bool = typer.Option(False, "--no-reference", help="Skip transformers."),
    no_llama_cpp: bool = typer.Option(False, "--no-llama-cpp", help="Skip llama.cpp (run beside a GGUF where llama-cpp-python is installed)."),
    weights: Weights = "auto",
    quantize: Quantize = None,
    group_size: GroupSize = 32,
    as_json: with_help(Json, "Print the figures as JSON.") = False,
    attn: Attn = None,
    tp: with_help(Tp, "Our model split over N CPU processes started by torchrun: `torchrun --nproc-per-node N -m lollm bench --tp N --no-reference …`; every rank runs the rounds, rank 0 prints (docs/tensor-parallel.md).") = 1,
    concurrency: Optional[str] = typer.Option(None, "--concurrency", metavar="N,N,...", help="Measure the batched engine instead: at each level, N requests of --prompt-tokens and --new-tokens submitted at once; output tok/s, TTFT and inter-token latency p50/p95 (docs/offline-batch.md)."),
    model_opt: ModelOpt = None,
) -> None:
    """Measure prefill and decode speed, load time and peak memory. Ours beside transformers, in alternating rounds."""
    model, _ = which_model(model_opt, model_arg)
    if rounds < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise LollmError("--rounds, --prompt-tokens and --new-tokens must be at least 1")
    check_threads(threads)  # before torch is imported
    if concurrency is not None:
        levels = parse_levels(concurrency)
        if tp != 1:
            raise LollmError(f"--concurrency measures the batched engine, which does not run under --tp {tp}")
        check_family(family_name)
        options = load_options("bench", device="cpu", dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                               group_size=group_size, family=family_name)
        return bench_concurrency(model, options, levels=levels, prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                                 rounds=rounds, threads=threads, as_json=as_json)
    LoadOptions(tp=tp)  # an impossible --tp is named before what it would mean for the reference
    if tp != 1 and not no_reference:
        raise LollmError(f"--tp {tp}: bench cannot compare with transformers under --tp (it would run whole in one "
                         f"process while the other ranks wait, not the same work); add --no-reference to bench "
                         f"lollm alone over {tp} processes")
    options = load_options("bench", device="cpu", dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                           group_size=group_size, tp=tp, family=family_name)
    from lollm.attention import resolve_backend
    from lollm.proof.bench import run_bench
    from lollm.load.pipeline import join_tensor_parallel

    options = join_tensor_parallel(options)  # --tp: this rank's group, so that rank 0 alone prints from here on
    silence_followers(options.tensor_parallel, err)  # every rank runs the same rounds
    options = options.replace(attn=resolve_backend(options.attn))
    check_family(options.family)
    result = run_bench(model, options, prompt_tokens=prompt_tokens, new_tokens=new_tokens, reference=not no_reference,
                       threads=threads, rounds=rounds, llama_cpp=tp == 1 and not no_llama_cpp,
                       log=None if as_json else lambda line: err.print(f"[dim]{escape(line)}[/dim]"))
    show.bench(result, model=model, options=options, new_tokens=new_tokens, rounds=rounds, as_json=as_json)
    finish(options.tensor_parallel)
