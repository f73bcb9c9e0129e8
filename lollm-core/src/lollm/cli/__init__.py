"""The ``lollm`` command line.

Commands::

    lollm run       MODEL --prompt TEXT      generate text, streamed to stdout (--prompts-file: many, batched)
    lollm chat      MODEL                    a conversation in the terminal (the cache carries over)
    lollm serve     MODEL                    an OpenAI-compatible HTTP server
    lollm families                           the installed family plugins
    lollm tokenize  MODEL TEXT [--chat]      how text becomes token ids
    lollm parity    MODEL                    our logits against transformers'
    lollm trace     MODEL --prompt TEXT      one forward pass, drawn as a self-contained HTML page
    lollm bench     MODEL                    prefill/decode speed and memory, beside transformers
                    (--concurrency 1,4,16: the batched engine's throughput and latency per level)
    lollm inspect   MODEL [--filter PATTERN] a summary, the metadata and the tensors (natural order) of a GGUF file or safetensors folder
    lollm new-family NAME --like FAMILY      a new family distribution, copied from an installed one
    lollm list      [--json]                 the models in the Hugging Face cache and lollm's cache
    lollm pull      REPO[:QUANT]             download a model through huggingface_hub

Every command that takes a model accepts it either way: ``lollm CMD MODEL``
or ``lollm CMD -m MODEL`` (see :func:`lollm.cli.options.which_model`).

Any :class:`lollm.errors.LollmError` is printed as one ``error:`` line on
stderr with exit status 2; ``parity`` exits 1 when the gate fails; Ctrl-C
exits 130 (``run`` first ends its output and prints the statistics of what
it generated). Flags are checked before torch is imported or a checkpoint
is read, so a typo costs nothing.

This module holds the commands; their plumbing lives beside it: the shared
flags and the LoadOptions made of them in :mod:`lollm.cli.options`, the checks
before the weights load in :mod:`lollm.cli.checks`, the prompts and files read
in :mod:`lollm.cli.inputs`, and what is printed in :mod:`lollm.cli.report`.
Under ``--tp N`` the commands keep their ranks in step through :mod:`lollm.load.ranks`.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape

from lollm.cli import report as show
from lollm.cli.checks import (check_attn, check_ctx_size, check_draft_head, check_family, check_model_exists,
                              check_run_flags, check_serve_flags, check_threads, open_checkpoint)
from lollm.cli.inputs import encode_prompts, messages, read_prompts, read_stdin, read_tokenize_text
from lollm.cli.options import (App, Attn, ContextShift, CtxSize, Device, DraftTokens, Dtype, Family, GrammarFlag,
                               GroupSize, Json, JsonSchemaFlag, MaxNewTokens, MinP, ModelArg, ModelOpt, Mtp, NoChat, ParseSpecial, Prompt, PromptLookup, Quantize, RegexFlag,
                               RepetitionPenalty, Seed, Stop, System, Temperature, Think, Threads, TopK, TopP, Tp,
                               Weights, load_options, output_constraint, sampling_flags, which_model, with_help)
from lollm.cli.report import err, out
from lollm.errors import LollmError
from lollm.load.options import LoadOptions
from lollm.load.ranks import finish, is_leader, silence_followers

# rich_markup_mode=None: click's plain help, read literally ("lollm-core[triton]" stays as written; rich markup ate it)
app = App(
    help="lollm: a study-first LLM inference engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from lollm.family import CONTRACT_VERSION

        core = version("lollm-core")
        out.print(f"lollm {core} (lollm-core {core}, plugin contract {CONTRACT_VERSION}, Python {sys.version.split()[0]})")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version of lollm and exit."),
    debug: bool = typer.Option(False, "--debug", help="Let a plugin's exception through with its traceback instead of one error line (as LOLLM_DEBUG=1)."),
) -> None:
    """lollm: a study-first LLM inference engine."""
    if debug:
        from lollm.family import DEBUG_ENV

        # an environment variable, not a global: the plugin guard reads it, and torchrun's ranks inherit it
        os.environ[DEBUG_ENV] = "1"


@app.command()
def run(
    model_arg: ModelArg = None,
    family_name: Family = None,
    model_opt: ModelOpt = None,
    prompt: Prompt = None,
    system: System = None,
    max_new_tokens: MaxNewTokens = 256,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    min_p: MinP = None,
    repetition_penalty: RepetitionPenalty = None,
    seed: Seed = None,
    stop: Stop = [],
    json_schema: JsonSchemaFlag = None,
    regex: RegexFlag = None,
    grammar: GrammarFlag = None,
    no_chat: NoChat = False,
    think: with_help(Think, "The chat template's enable_thinking flag (templates that read it). Default: the template's own default.") = None,
    mtp: with_help(Mtp, "Self-speculative decoding with the checkpoint's draft (MTP) head; same output, faster when drafts are accepted.") = False,
    prompt_lookup: PromptLookup = False,
    draft_tokens: DraftTokens = 3,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    prompts_file: Optional[str] = typer.Option(None, "--prompts-file", metavar="FILE", help="Generate for every prompt of this file, one per line (a .jsonl file: one JSON string per line; '-': stdin, plain text one per line); the model loads once."),
    parse_special: ParseSpecial = True,
    as_json: with_help(Json, "Print one JSON object per prompt (text, ids, timings, stop reason, sampling) instead of streaming the text.") = False,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every sampling setting and where it came from, not only those that change something."),
    attn: Attn = None,
    weights: Weights = "auto",
    quantize: Quantize = None,
    group_size: with_help(GroupSize, "int4 group size for --quantize int4: 32 or 128 (64, 256 also work).") = 32,
    tp: with_help(Tp, "Tensor parallel over N processes started by torchrun: `torchrun --nproc-per-node N -m lollm run --tp N …` (float weights; docs/tensor-parallel.md).") = 1,
) -> None:
    """Generate a continuation of PROMPT, streamed to stdout; statistics go to stderr."""
    model, _ = which_model(model_opt, model_arg)
    # 1. What can be checked without torch and without reading the checkpoint.
    user = sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    check_run_flags(max_new_tokens=max_new_tokens, seed=seed, device=device, threads=threads, mtp=mtp or prompt_lookup,
                    draft_tokens=draft_tokens, sampling=user)
    from lollm.generate.drafting import drafter_from_flags

    drafter = drafter_from_flags(mtp=mtp, prompt_lookup=prompt_lookup, draft_tokens=draft_tokens)
    if system is not None and no_chat:
        raise LollmError("--system needs the chat template; it cannot be used with --no-chat")
    constraint = output_constraint(json_schema, regex, grammar)
    options = load_options("run", device=device, dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                           group_size=group_size, tp=tp, family=family_name, progress=True)
    check_attn(options)
    check_family(options.family)
    check_model_exists(model)
    prompts = read_prompts(prompt, prompts_file)

    # 2. The checkpoint (configs, tokenizer, tensor table) and its family: checks that need them, before the weights load.
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import resolve_sampling

    checkpoint, family, template_flags = open_checkpoint(model, options, threads=threads, think=think, mtp=mtp)
    all_ids = encode_prompts(checkpoint.tokenizer, prompts, system=system, no_chat=no_chat, parse_special=parse_special,
                             template_flags=template_flags, note=lambda line: err.print(f"[dim]{line}[/dim]"))
    sampling = resolve_sampling(user, checkpoint.generation_config, family.sampling_defaults, seed=seed,
                                generation_config_name=str(checkpoint.path / "generation_config.json"))

    # 3. The weights, then one generation per prompt (--tp: every rank computes, rank 0 alone prints).
    loaded = open_model(checkpoint, options)
    silence_followers(loaded.tp, err)
    show.weights_summary(loaded)
    check_draft_head(loaded, model, mtp)
    _generate_all(loaded, prompts, all_ids, sampling=sampling, stop_strings=stop, max_new_tokens=max_new_tokens,
                  drafter=drafter, as_json=as_json, verbose=verbose, constraint=constraint)
    group = loaded.tp
    del loaded  # lollm.load.ranks rule 4: the model goes before the group
    finish(group)  # --tp: every rank meets rank 0, which has printed, before any leaves


def _generate_all(loaded: Any, prompts: list[str], all_ids: list[list[int]], *, sampling: Any, stop_strings: list[str],
                  max_new_tokens: int, drafter: Any, as_json: bool, verbose: bool, constraint: Any = None) -> None:
    """Step 3 of ``run``, once the weights are in: the sampling line, then one generation per prompt.

    Several prompts run batched through one engine when the model can (:mod:`lollm.cli.batch`), else
    one after another (a note says why). ``constraint``: the :class:`lollm.generate.structured.OutputConstraint`
    of --json-schema / --regex / --grammar (None: free text), compiled here once for the model's vocabulary.
    """
    from lollm.generate.loop import stop_token_ids
    from lollm.generate.sampling import describe_sampling
    from lollm.generate.structured import compile_constraint

    checkpoint = loaded.checkpoint
    stops = stop_token_ids(checkpoint.generation_config, checkpoint.config, loaded.tokenizer)
    if constraint is not None:
        constraint = compile_constraint(constraint, loaded.tokenizer, vocab_size=loaded.model.vocab_size, stop_ids=stops)
    if not as_json:
        err.print("[dim]" + escape(describe_sampling(sampling, everything=verbose)) + "[/dim]", soft_wrap=True)
    if len(prompts) > 1:
        from lollm.cli.batch import batch_reason, run_batched

        reason = batch_reason(loaded, drafter)
        if reason is None:
            return run_batched(loaded, prompts, all_ids, sampling=sampling, stop_strings=stop_strings,
                               max_new_tokens=max_new_tokens, as_json=as_json, constraint=constraint)
        show.note(f"note: {reason}")
    for number, (text, ids) in enumerate(zip(prompts, all_ids), start=1):
        if len(prompts) > 1 and not as_json:
            err.print(f"[dim]\\[prompt {number}/{len(prompts)}][/dim]")
        _generate_one(loaded, text, ids, sampling=sampling, stops=stops, stop_strings=stop_strings,
                      max_new_tokens=max_new_tokens, drafter=drafter, as_json=as_json, constraint=constraint)


def _generate_one(loaded: Any, prompt: str, ids: list[int], *, sampling: Any, stops: set[int], stop_strings: list[str],
                  max_new_tokens: int, drafter: Any, as_json: bool, constraint: Any = None) -> None:
    """One generation of ``run``: the text streamed (or one JSON object), then its statistics; Ctrl-C exits 130."""
    from lollm.generate.loop import GenerationResult, generate

    new_ids: list[int] = []
    pieces: list[str] = []
    started = time.perf_counter()
    first_token_at: list[float] = []

    def on_token(token_id: int, logprobs: Any) -> None:
        if not new_ids:
            first_token_at.append(time.perf_counter())
        new_ids.append(token_id)

    def on_text(piece: str) -> None:
        pieces.append(piece)
        if not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()

    try:
        result = generate(
            loaded.model, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stops,
            stop_strings=stop_strings, tokenizer=loaded.tokenizer, on_text=on_text, on_token=on_token,
            drafter=drafter, attn=loaded.attn, constraint=constraint,
        )
    except KeyboardInterrupt:
        # Ctrl-C: what was generated so far, with the timings the loop would have reported.
        now = time.perf_counter()
        first = first_token_at[0] if first_token_at else now
        result = GenerationResult(prompt_ids=list(ids), new_ids=list(new_ids), text="".join(pieces), stop_reason="interrupted",
                                  prefill_seconds=first - started, decode_seconds=now - first)
        show.generation(loaded, prompt, result, sampling, as_json=as_json, drafter=drafter)
        raise typer.Exit(130)
    show.generation(loaded, prompt, result, sampling, as_json=as_json, drafter=drafter)


@app.command("new-family")
def new_family(
    name: str = typer.Argument(..., metavar="NAME", help="The new family's name: a lowercase Python identifier."),
    like: str = typer.Option(..., "--like", metavar="FAMILY", help="The installed family to copy (qwen2 the usual start)."),
    model_type: Optional[str] = typer.Option(None, "--model-type", metavar="TYPE", help="The config.json model_type the family claims (default: the reference's, renamed; NAME for --like qwen2)."),
    into: Path = typer.Option(Path("."), "--into", metavar="PATH", help="Where to write the folder lollm-NAME."),
) -> None:
    """Write a new family distribution lollm-NAME, copied from an installed family, that installs and passes its own tests."""
    from lollm.cli.new_family import describe, render

    out.print(escape(describe(render(name, like, into, model_type=model_type))), soft_wrap=True)


@app.command()
def families(
    as_json: with_help(Json, "Machine-readable output.") = False,
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a plugin is broken, two plugins claim one type, or $LOLLM_LOAD_PLUGINS names a distribution that is not an installed plugin."),
) -> None:
    """List the installed family plugins (no model code is imported), and those $LOLLM_LOAD_PLUGINS leaves out."""
    from lollm.load.plugins import get_registry

    # the diagnostic command tries again the plugins other commands skip as remembered hangs
    registry = get_registry(retry_hung=True)
    if as_json:
        print(json.dumps(show.families_json(registry), indent=2))
    else:
        show.families_table(registry)
    if strict and (registry.broken or registry.conflicts or registry.unmatched):
        raise typer.Exit(1)


@app.command()
def tokenize(
    model_arg: with_help(ModelArg, "Checkpoint folder, .gguf file or repo id (only the tokenizer is read).") = None,
    text: Optional[str] = typer.Argument(None, metavar="TEXT", show_default=False, help="The text to tokenize; '-' (or nothing, when piped) reads stdin."),
    chat: bool = typer.Option(False, "--chat", help="Wrap TEXT as a user message with the chat template."),
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT", help="System message for --chat."),
    think: with_help(Think, "The chat template's enable_thinking flag, for --chat (templates that read it).") = None,
    as_json: with_help(Json, "Print {ids, pieces} as JSON.") = False,
    file: Optional[str] = typer.Option(None, "--file", "-f", metavar="FILE", help="Read the text from this file (UTF-8, exactly as it is: a final newline counts)."),
    parse_special: with_help(ParseSpecial, "Whether special-token text in TEXT (e.g. <|im_end|>) becomes control tokens (the default, as in transformers) or stays plain text.") = True,
    model_opt: ModelOpt = None,
) -> None:
    """Show the token ids and pieces of TEXT: how the model sees it."""
    model, rest = which_model(model_opt, model_arg, text, extra=1)
    text = read_tokenize_text(rest[0] if rest else None, file)

    from lollm.load.loader import download_repo, _looks_like_repo_id
    from lollm.tokenizer import load_gguf_tokenizer, load_tokenizer

    folder = Path(model)
    if folder.is_file() and folder.suffix == ".gguf":
        tokenizer = load_gguf_tokenizer(folder)  # built from the file's tokenizer.* metadata
    else:
        if not folder.exists() and _looks_like_repo_id(model):
            folder = download_repo(model)
        tokenizer = load_tokenizer(folder)
    if think is not None and not chat:
        raise LollmError("--think/--no-think applies to the chat template: add --chat")
    if chat:
        from lollm.generate.conversation import thinking_flags

        flags = thinking_flags(tokenizer, think, model)
        rendered = tokenizer.apply_chat_template(messages(text, system), add_generation_prompt=True, **flags)
        ids = tokenizer.encode_chat(messages(text, system), add_generation_prompt=True, parse_special=parse_special,
                                    **flags)
    else:
        rendered, ids = text, tokenizer.encode(text, parse_special=parse_special)
    pieces = tokenizer.pieces(ids)
    if as_json:
        print(json.dumps({"text": rendered, "ids": ids, "pieces": pieces}, ensure_ascii=False))
        return
    show.tokens_table(ids, pieces)


@app.command()
def parity(
    model_arg: with_help(ModelArg, "Checkpoint folder or repo id.") = None,
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
) -> None:
    """Compare our logits with transformers' at every prompt position; exit 1 on failure."""
    model, _ = which_model(model_opt, model_arg)
    check_family(family_name)
    options = load_options("parity", device=device, dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                           group_size=group_size, tp=tp, family=family_name)
    from lollm.proof.parity import DEFAULT_PROMPT, run_parity
    from lollm.load.tensor_parallel import current

    report = run_parity(model, prompt=prompt or DEFAULT_PROMPT, chat=chat, options=options, min_cosine=min_cosine)
    group = current()  # --tp: every rank holds rank 0's report: rank 0 prints it, every rank exits with its verdict
    silence_followers(group, err)
    show.parity(report, as_json)
    finish(group)  # rank 0 has printed before any rank exits (torchrun stops the others when one exits 1)
    raise typer.Exit(0 if report.passed else 1)


@app.command()
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
) -> None:
    """Run PROMPT through the model once and write a self-contained HTML page of what happens inside.

    Tokens, the logit lens, attention per layer and head, what the family records of its
    own (DeltaNet gates, MoE routing, soft-caps, per-layer embeddings) and, with --compare,
    the divergence from transformers. See docs/trace.md.
    """
    spec, _ = which_model(model_opt, model_arg)
    if not output:
        raise LollmError("-o/--output is empty: give the path of the page to write (default trace.html)")
    if max_tokens < 1:
        raise LollmError(f"--max-tokens must be >= 1, got {max_tokens}")
    check_family(family_name)
    options = load_options("trace", device=device, dtype=dtype, family=family_name, progress=True)
    if prompt is None:
        prompt = read_stdin("--prompt").rstrip("\n")
    from lollm.cli.trace.run import run_trace  # (imports torch: after the checks above)

    result = run_trace(spec, prompt=prompt, output=output, system=system, chat=not no_chat, think=think,
                       compare_reference=compare, options=options, max_tokens=max_tokens)
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
    """Prefill and decode tok/s, load time and peak memory: ours beside transformers, in alternating rounds."""
    model, _ = which_model(model_opt, model_arg)
    if rounds < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise LollmError("--rounds, --prompt-tokens and --new-tokens must be at least 1")
    check_threads(threads)  # before torch is imported
    if concurrency is not None:
        from lollm.cli.batch import bench_concurrency, parse_levels

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


@app.command()
def inspect(
    model_arg: with_help(ModelArg, "A .gguf file or a safetensors checkpoint folder.") = None,
    tensors: bool = typer.Option(True, "--tensors/--no-tensors", help="Print the tensor table."),
    pattern: Optional[str] = typer.Option(None, "--filter", metavar="PATTERN", help="Only the tensors whose name holds PATTERN (attn_q), or, when it has * ? or [, matches it as a glob (blk.1.*); an error when none does."),
    as_json: with_help(Json, "Print everything as JSON (arrays summarized).") = False,
    model_opt: ModelOpt = None,
) -> None:
    """Show what is inside a checkpoint: a summary (format, architecture, parameters, bytes, tensors per type), its metadata, then its tensors (name, shape, type, bytes) in natural order (blk.2 before blk.10)."""
    model, _ = which_model(model_opt, model_arg)
    from lollm.load.inventory import inspect_checkpoint

    inv = inspect_checkpoint(model)
    rows = inv.select(pattern)
    if as_json:
        print(json.dumps(show.inventory_json(inv, rows, pattern), indent=2, ensure_ascii=False))
        return
    show.inventory(inv, rows, pattern, tensors=tensors)


@app.command()
def chat(
    model_arg: ModelArg = None,
    family_name: Family = None,
    system: with_help(System, "System message, kept across /reset.") = None,
    max_new_tokens: with_help(MaxNewTokens, "Most tokens per answer.") = 1024,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    min_p: MinP = None,
    repetition_penalty: RepetitionPenalty = None,
    seed: Seed = None,
    think: Think = None,
    mtp: Mtp = False,
    draft_tokens: DraftTokens = 3,
    ctx_size: CtxSize = None,
    context_shift: ContextShift = True,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    weights: Weights = "auto",
    quantize: Quantize = None,
    group_size: GroupSize = 32,
    model_opt: ModelOpt = None,
) -> None:
    """Chat with MODEL in the terminal: /stats, /drop N, /reset, /quit; Ctrl-C stops an answer, Ctrl-D quits."""
    model, _ = which_model(model_opt, model_arg)
    user = sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    check_run_flags(max_new_tokens=max_new_tokens, seed=seed, device=device, threads=threads, mtp=mtp,
                    draft_tokens=draft_tokens, sampling=user)
    check_ctx_size(ctx_size)
    options = load_options("chat", device=device, dtype=dtype, weights=weights, quantize=quantize, group_size=group_size,
                           family=family_name, progress=True)
    check_family(options.family)
    check_model_exists(model)

    from lollm.generate.conversation import ChatSession, repl
    from lollm.generate.loop import stop_token_ids
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import resolve_sampling

    checkpoint, family, template_flags = open_checkpoint(model, options, threads=threads, think=think, mtp=mtp)
    sampling = resolve_sampling(user, checkpoint.generation_config, family.sampling_defaults, seed=seed,
                                generation_config_name=str(checkpoint.path / "generation_config.json"))
    loaded = open_model(checkpoint, options)
    show.weights_summary(loaded)
    check_draft_head(loaded, model, mtp)
    session = ChatSession(
        loaded, sampling=sampling, stop_ids=stop_token_ids(checkpoint.generation_config, checkpoint.config, loaded.tokenizer),
        system=system, template_flags=template_flags, max_new_tokens=max_new_tokens,
        speculative_tokens=draft_tokens if mtp else 0, context=ctx_size, context_shift=context_shift,
    )
    err.print(f"[dim]lollm chat: {escape(model)} ({family.name} on {loaded.device} "
              f"{str(loaded.dtype).removeprefix('torch.')}, context {session.cache.max_tokens})[/dim]", soft_wrap=True)
    repl(session, note=show.note)


@app.command()
def serve(
    model_arg: ModelArg = None,
    family_name: Family = None,
    host: str = typer.Option("127.0.0.1", metavar="HOST", help="Address to listen on (0.0.0.0: every interface; think of --api-key)."),
    port: int = typer.Option(8000, metavar="PORT", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", metavar="KEY", help="Require 'Authorization: Bearer KEY' on every /v1 request."),
    model_name: Optional[str] = typer.Option(None, "--model-name", metavar="NAME", help="The model id clients send (default: the checkpoint's folder or file name)."),
    ctx_size: CtxSize = None,
    temperature: with_help(Temperature, "Default for requests that give none (then generation_config, then the family's).") = None,
    top_k: with_help(TopK, "Default top-k for requests.") = None,
    top_p: with_help(TopP, "Default top-p for requests.") = None,
    min_p: with_help(MinP, "Default min-p for requests.") = None,
    repetition_penalty: with_help(RepetitionPenalty, "Default repetition penalty.") = None,
    think: with_help(Think, "Default enable_thinking (a request's chat_template_kwargs wins).") = None,
    mtp: Mtp = False,
    draft_tokens: DraftTokens = 3,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    weights: Weights = "auto",
    quantize: Quantize = None,
    group_size: GroupSize = 32,
    tp: with_help(Tp, "Tensor parallel over N processes started by torchrun: `torchrun --nproc-per-node N -m lollm serve --tp N …`; rank 0 serves HTTP, every rank generates (docs/tensor-parallel.md).") = 1,
    max_running: int = typer.Option(16, "--max-running", metavar="N", help="The batched engine runs at most N requests at once (docs/serving.md)."),
    kv_blocks: Optional[int] = typer.Option(None, "--kv-blocks", metavar="N", help="KV cache blocks (16 positions each) in the engine's pool (default: --max-running sequences of up to 2048 positions, at most half the free memory)."),
    max_batch_tokens: int = typer.Option(256, "--max-batch-tokens", metavar="N", help="The most tokens in one engine step: decode tokens plus prefill chunks."),
    max_queue: int = typer.Option(128, "--max-queue", metavar="N", help="At most N requests wait to run; one more gets 503 with Retry-After."),
    model_opt: ModelOpt = None,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models)."""
    model, _ = which_model(model_opt, model_arg)
    user = sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    check_run_flags(max_new_tokens=None, seed=None, device=device, threads=threads, mtp=mtp, draft_tokens=draft_tokens,
                    sampling=user)
    check_ctx_size(ctx_size)
    check_serve_flags(port=port, max_running=max_running, kv_blocks=kv_blocks, max_batch_tokens=max_batch_tokens,
                      max_queue=max_queue)
    options = load_options("serve", device=device, dtype=dtype, weights=weights, quantize=quantize,
                           group_size=group_size, tp=tp, family=family_name, progress=True)

    from lollm.generate.conversation import DEFAULT_CONTEXT
    from lollm.load.pipeline import open_model
    from lollm.serve.server import ModelServer, require_serve_extra, serve as run_server

    check_family(options.family)
    require_serve_extra()
    check_model_exists(model)
    checkpoint, family, template_flags = open_checkpoint(model, options, threads=threads, think=think, mtp=mtp)
    if tp != 1:  # the other ranks wait for requests in a collective: far longer than torch's 30-minute default
        from lollm.load.pipeline import pick_device
        from lollm.load.tensor_parallel import init

        init(tp, pick_device(device), timeout=SERVE_TP_TIMEOUT)
    loaded = open_model(checkpoint, options)
    silence_followers(loaded.tp, err)
    show.weights_summary(loaded)
    check_draft_head(loaded, model, mtp)
    name = model_name or (Path(model).stem if Path(model).suffix == ".gguf" else Path(model.rstrip("/")).name)
    server = ModelServer(
        loaded, name=name, context=ctx_size or min(DEFAULT_CONTEXT, loaded.model.max_context),
        sampling_flags=user, template_flags=template_flags, draft_tokens=draft_tokens if mtp else 0, api_key=api_key,
        max_running=max_running, kv_blocks=kv_blocks, max_batch_tokens=max_batch_tokens, max_queue=max_queue,
    )
    if not is_leader(loaded.tp):
        server.follow()  # every generation rank 0 runs, until rank 0 stops
        finish(loaded.tp)
        return
    split = "" if loaded.tp is None else f", --tp {tp}"
    try:  # the banner (URL, model, family, context, a curl line, the chat page) comes once it listens
        run_server(server, host=host, port=port, family=f"{family.name} on {loaded.device}{split}")
    finally:
        if loaded.tp is not None and server.stop_followers():
            finish(loaded.tp)


#: Seconds a --tp rank of `lollm serve` may wait in a collective for rank 0's next request (a week).
SERVE_TP_TIMEOUT = 7 * 24 * 3600.0


@app.command("list")
def list_(
    as_json: with_help(Json, "Machine-readable output (size in bytes).") = False,
) -> None:
    """The models on this machine: the Hugging Face cache and lollm's cache ($LOLLM_CACHE), with the family that runs each."""
    from lollm.cli.models import list_models, rows_json
    from lollm.testing.real_models import cache_dir

    rows = list_models()
    if as_json:
        print(rows_json(rows))
        return
    if not rows:
        out.print(f"No model in the Hugging Face cache or in {escape(str(cache_dir()))}. "
                  f"Fetch one: lollm pull org/name (or org/name:Q4_K_M for a GGUF repo).")
        return
    show.models_table(rows)


@app.command()
def pull(
    spec: str = typer.Argument(..., metavar="REPO[:QUANT]", show_default=False,
                               help="A Hugging Face repo id (org/name), or org/name:QUANT for the one .gguf file of that quant."),
) -> None:
    """Download a model into the Hugging Face cache (huggingface_hub's progress bar), then print its path and how to run it."""
    from lollm.cli.models import pull as fetch

    path = fetch(spec)
    out.print(f"pulled {escape(spec)} to {escape(str(path))}", soft_wrap=True)
    out.print(f"run it: lollm run {escape(spec)} --prompt 'Hello'", soft_wrap=True)


class _WatchedStdout:
    """sys.stdout, remembering a failed write: main() then knows the OSError came from the output."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.error: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main() -> None:
    """Console-script entry point: run the Typer app, turning LollmError into one clean line."""
    # Standalone mode: click itself prints usage errors (status 2), --help, and
    # turns typer.Exit(code) into that exit status; our own errors pass through it.
    stdout = sys.stdout = _WatchedStdout(sys.stdout)
    try:
        try:
            app()
        finally:
            sys.stdout.flush()  # inside the try: a failing last write is reported like any other
    except LollmError as exc:
        err.quiet = False  # a --tp rank other than 0 still reports its error
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except OSError as exc:
        if exc is not stdout.error:
            raise
        # stdout cannot take the output (a full disk, /dev/full, a closed pipe): point it at
        # /dev/null so the interpreter's own last flush cannot fail again, and say so once.
        os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        if exc.errno == errno.EPIPE:
            sys.exit(1)  # the reader went away (| head): nothing to report, as click does
        err.print(f"[red]error:[/red] cannot write the output to stdout: {escape(exc.strerror or str(exc))}",
                  highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
