"""``lollm run`` and ``lollm chat``: generate from a prompt, or converse in the terminal."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from lollm.cli import report as show
from lollm.cli.batch import batch_reason, run_batched
from lollm.cli.checks import (check_attn, check_ctx_size, check_draft_head, check_family, check_mmproj_exists,
                              check_model_exists, check_run_flags, open_for_command, require_extra)
from lollm.cli.inputs import encode_prompts, image_prompt, read_images, read_prompts
from lollm.cli.options import (Attn, ContextShift, CtxSize, Device, DraftTokens, Dtype, Family, GrammarFlag,
                               GroupSize, ImageFiles, Json, JsonSchemaFlag, MaxNewTokens, MinP, MmprojFile, ModelArg,
                               ModelOpt, Mtp, NoChat, ParseSpecial, Prompt, PromptLookup, Quantize, RegexFlag, RepetitionPenalty, Seed, Stop,
                               System, Temperature, Think, Threads, TopK, TopP, Tp, Weights, load_options,
                               output_constraint, sampling_flags, which_model, with_help)
from lollm.cli.report import err
from lollm.errors import LollmError
from lollm.generate.drafting import drafter_from_flags
from lollm.generate.structured import compile_constraint
from lollm.load.ranks import finish, silence_followers

# Lazy imports below: lollm.load.pipeline, lollm.generate's loop, sampling and conversation, and lollm.cli.chat (over
# the conversation) import torch, which waits until every flag is checked (a typo costs nothing); each command
# imports them after its checks.

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only (these modules import torch)
    from lollm.generate.drafting import Drafter
    from lollm.generate.structured import CompiledConstraint, OutputConstraint
    from lollm.load.pipeline import LoadedModel
    from lollm.sampling_params import SamplingParams


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
    image: ImageFiles = [], mmproj: MmprojFile = None,  # docs/vision.md
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
    """Generate text from a prompt (-p, or stdin), streamed to stdout. Statistics go to stderr."""
    model, _ = which_model(model_opt, model_arg)
    # 1. What can be checked without torch and without reading the checkpoint.
    user = sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    check_run_flags(max_new_tokens=max_new_tokens, seed=seed, device=device, threads=threads, mtp=mtp or prompt_lookup,
                    draft_tokens=draft_tokens, sampling=user)
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
    from lollm.sampling_params import resolve_sampling

    prepared = open_for_command(model, options, threads=threads, think=think, mtp=mtp)  # every choice, made once
    checkpoint = prepared.checkpoint
    pictures = read_images(image, mmproj, prompts=len(prompts), family=prepared.family.family, model=model)
    all_ids = encode_prompts(checkpoint.tokenizer, prompts, system=system, no_chat=no_chat, parse_special=parse_special,
                             template_flags=prepared.template_flags, note=lambda line: err.print(f"[dim]{line}[/dim]"))
    sampling = resolve_sampling(user, checkpoint.generation_config, prepared.family.family.sampling_defaults, seed=seed,
                                generation_config_name=str(checkpoint.path / "generation_config.json"))

    # 3. The weights, then one generation per prompt (--tp: every rank computes, rank 0 alone prints).
    loaded = open_model(checkpoint, prepared.options)  # taken as they are: nothing is decided again
    silence_followers(loaded.tp, err)
    show.weights_summary(loaded)
    check_draft_head(loaded, model, mtp)
    all_ids[0], images = image_prompt(loaded, model, prompts[0], all_ids[0], pictures, mmproj, system=system,
                                      no_chat=no_chat, parse_special=parse_special, template_flags=prepared.template_flags)
    _generate_all(loaded, prompts, all_ids, sampling=sampling, stop_strings=stop, max_new_tokens=max_new_tokens,
                  drafter=drafter, as_json=as_json, verbose=verbose, constraint=constraint, images=images)
    group = loaded.tp
    del loaded  # lollm.load.ranks rule 4: the model goes before the group
    finish(group)  # --tp: every rank meets rank 0, which has printed, before any leaves


def _generate_all(loaded: LoadedModel, prompts: list[str], all_ids: list[list[int]], *, sampling: SamplingParams,
                  stop_strings: list[str], max_new_tokens: int, drafter: Optional[Drafter], as_json: bool, verbose: bool,
                  constraint: Optional[OutputConstraint] = None, images: object = None) -> None:
    """Step 3 of ``run``, once the weights are in: the sampling line, then one generation per prompt.

    Several prompts run batched through one engine when the model can (:mod:`lollm.cli.batch`), else
    one after another (a note says why). ``constraint``: the :class:`lollm.generate.structured.OutputConstraint`
    of --json-schema / --regex / --grammar (None: free text), compiled here once for the model's vocabulary.
    """
    from lollm.generate.loop import stop_token_ids
    from lollm.sampling_params import describe_sampling

    checkpoint = loaded.checkpoint
    stops = stop_token_ids(checkpoint.generation_config, checkpoint.config, loaded.tokenizer)
    if constraint is not None:
        constraint = compile_constraint(constraint, loaded.tokenizer, vocab_size=loaded.model.vocab_size, stop_ids=stops)
    if not as_json:
        err.print("[dim]" + escape(describe_sampling(sampling, everything=verbose)) + "[/dim]", soft_wrap=True)
    if len(prompts) > 1:
        reason = batch_reason(loaded, drafter)
        if reason is None:
            return run_batched(loaded, prompts, all_ids, sampling=sampling, stop_strings=stop_strings,
                               max_new_tokens=max_new_tokens, as_json=as_json, constraint=constraint)
        show.note(f"note: {reason}")
    for number, (text, ids) in enumerate(zip(prompts, all_ids), start=1):
        if len(prompts) > 1 and not as_json:
            err.print(f"[dim]\\[prompt {number}/{len(prompts)}][/dim]")
        _generate_one(loaded, text, ids, sampling=sampling, stops=stops, stop_strings=stop_strings,
                      max_new_tokens=max_new_tokens, drafter=drafter, as_json=as_json, constraint=constraint,
                      images=images)


def _generate_one(loaded: LoadedModel, prompt: str, ids: list[int], *, sampling: SamplingParams, stops: set[int],
                  stop_strings: list[str], max_new_tokens: int, drafter: Optional[Drafter], as_json: bool,
                  constraint: Optional[CompiledConstraint] = None, images: object = None) -> None:
    """One generation of ``run``: the text streamed (or one JSON object), then its statistics; Ctrl-C exits 130.

    ``images``: the prompt's ImageBatch (``--image``; docs/vision.md), None for text."""
    from lollm.generate.loop import GenerationResult, generate

    new_ids: list[int] = []
    pieces: list[str] = []
    started = time.perf_counter()
    first_token_at: list[float] = []

    def on_token(token_id: int, logprobs: object) -> None:
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
            drafter=drafter, attn=loaded.attn, constraint=constraint, images=images,
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
    draft_tokens: with_help(DraftTokens, "Tokens drafted per step with --mtp.") = 3,
    mmproj: with_help(MmprojFile, "The vision tower of a GGUF model, for /image: the mmproj GGUF file llama.cpp's "
                                  "convert_hf_to_gguf.py --mmproj writes (a safetensors model carries its own).") = None,
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
    """Chat with a model in the terminal. /stats, /drop N, /reset, /quit; Ctrl-C stops an answer, Ctrl-D quits."""
    model, _ = which_model(model_opt, model_arg)
    user = sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    check_run_flags(max_new_tokens=max_new_tokens, seed=seed, device=device, threads=threads, mtp=mtp,
                    draft_tokens=draft_tokens, sampling=user)
    check_ctx_size(ctx_size)
    options = load_options("chat", device=device, dtype=dtype, weights=weights, quantize=quantize, group_size=group_size,
                           family=family_name, progress=True)
    check_family(options.family)
    check_model_exists(model)
    check_mmproj_exists(mmproj)
    if terminal_is_interactive():  # line editing comes from the chat extra; piped input needs none
        require_extra("chat", "lollm chat in a terminal")

    from lollm.cli.chat import repl
    from lollm.generate.conversation import ChatSession
    from lollm.generate.loop import stop_token_ids
    from lollm.load.pipeline import open_model
    from lollm.sampling_params import resolve_sampling

    prepared = open_for_command(model, options, threads=threads, think=think, mtp=mtp)
    checkpoint, family, template_flags = prepared.checkpoint, prepared.family.family, prepared.template_flags
    if mmproj is not None and not family.capabilities.vision:
        raise LollmError(f"--mmproj {mmproj}: {model} is of the family {family.name}, which reads no images")
    sampling = resolve_sampling(user, checkpoint.generation_config, family.sampling_defaults, seed=seed,
                                generation_config_name=str(checkpoint.path / "generation_config.json"))
    loaded = open_model(checkpoint, prepared.options)
    show.weights_summary(loaded)
    check_draft_head(loaded, model, mtp)
    session = ChatSession(
        loaded, sampling=sampling, stop_ids=stop_token_ids(checkpoint.generation_config, checkpoint.config, loaded.tokenizer),
        system=system, template_flags=template_flags, max_new_tokens=max_new_tokens,
        speculative_tokens=draft_tokens if mtp else 0, context=ctx_size, context_shift=context_shift, mmproj=mmproj,
    )
    if mmproj is not None:
        session.open_tower()  # a wrong file is said now, not at the first /image
    err.print(f"[dim]lollm chat: {escape(model)} ({family.name} on {loaded.device} "
              f"{str(loaded.dtype).removeprefix('torch.')}, context {session.cache.max_tokens})[/dim]", soft_wrap=True)
    repl(session, note=show.note)


def terminal_is_interactive() -> bool:
    """Whether ``lollm chat`` talks to a terminal (stdin and stdout both), where it edits lines with prompt_toolkit."""
    return sys.stdin.isatty() and sys.stdout.isatty()
