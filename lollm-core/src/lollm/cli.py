"""The ``lollm`` command line.

Commands::

    lollm run       MODEL --prompt TEXT      generate text, streamed to stdout
    lollm chat      MODEL                    a conversation in the terminal (the cache carries over)
    lollm serve     MODEL                    an OpenAI-compatible HTTP server
    lollm families                           the installed family plugins
    lollm tokenize  MODEL TEXT [--chat]      how text becomes token ids
    lollm parity    MODEL                    our logits against transformers'
    lollm trace     MODEL --prompt TEXT      one forward pass, drawn as a self-contained HTML page
    lollm bench     MODEL                    prefill/decode speed and memory, beside transformers
    lollm inspect   MODEL [--filter PATTERN] a summary, the metadata and the tensors (natural order) of a GGUF file or safetensors folder
    lollm new-family NAME --like FAMILY      a new family distribution, copied from an installed one
    lollm list      [--json]                 the models in the Hugging Face cache and lollm's cache
    lollm pull      REPO[:QUANT]             download a model through huggingface_hub

Every command that takes a model accepts it either way: ``lollm CMD MODEL``
or ``lollm CMD -m MODEL`` (see :func:`which_model`).

Any :class:`lollm.errors.LollmError` is printed as one ``error:`` line on
stderr with exit status 2; ``parity`` exits 1 when the gate fails; Ctrl-C
exits 130 (``run`` first ends its output and prints the statistics of what
it generated). Flags are checked before torch is imported or a checkpoint
is read, so a typo costs nothing.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lollm.options import LoadOptions
from lollm.errors import LollmError


class _Command(typer.core.TyperCommand):
    """A command whose help names each argument by its metavar alone (MODEL, TEXT), without typer's ``<str>``."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """The Arguments and Options sections of ``--help``, as click writes them (plain text, never rich markup).

        An option's row is click's own (``-n, --max-new-tokens N``: every valued option
        declares its metavar; a flag shows none); an argument's row is its metavar and help.
        """
        rows: dict[str, list[tuple[str, str]]] = {"argument": [], "option": []}
        for param in self.get_params(ctx):
            if getattr(param, "hidden", False):
                continue
            if param.param_type_name == "argument":
                rows["argument"].append((param.metavar or param.name.upper(), getattr(param, "help", None) or ""))
            else:
                record = param.get_help_record(ctx)
                if record is not None:
                    rows["option"].append(record)
        for title, kind in (("Arguments", "argument"), ("Options", "option")):
            if rows[kind]:
                with formatter.section(title):
                    formatter.write_dl(rows[kind])


class _App(typer.Typer):
    """typer.Typer whose commands are :class:`_Command` (a command added later gets the same help for free)."""

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


# rich_markup_mode=None: click's plain help, read literally ("lollm-core[triton]" stays as written; rich markup ate it)
app = _App(
    help="lollm: a study-first LLM inference engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
# Piped output (CI logs, files) gets wide lines instead of rich's 80-column default.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)


ATTN_HELP = "Attention backend: sdpa (the default and reference), eager (scores written out), triton (lollm-core[triton]). Default: $LOLLM_ATTN, else sdpa."
CTX_HELP = "Positions of the cache kept across turns / requests (default: 4096, at most the model's context)."
FAMILY_HELP = "The family (by name, see lollm families) that serves the model, when several installed plugins claim its type."
CONTEXT_SHIFT_HELP = ("When the conversation outgrows the context: drop the oldest turns (the system message stays) and "
                      "go on, as ollama and llama.cpp's context shift do; --no-context-shift stops with an error that "
                      "says how to continue (/drop N, /reset).")


# -- naming the model: one mechanism for every command ------------------------------
#
# A command that takes a model declares both parameters and calls which_model:
#
#     def cmd(model: Optional[str] = model_argument(), ..., model_opt: Optional[str] = model_option()):
#         model, _ = which_model(model_opt, model)


def model_argument(help: str = "Checkpoint folder, .gguf file, Hugging Face repo id, or org/name:QUANT for a GGUF repo.") -> Any:
    """The positional ``MODEL`` parameter (optional, since ``-m/--model`` may name the model instead)."""
    return typer.Argument(None, metavar="MODEL", show_default=False, help=help)


def model_option() -> Any:
    """The ``-m/--model`` parameter: the same as the positional ``MODEL``."""
    return typer.Option(None, "--model", "-m", metavar="MODEL", show_default=False,
                        help="The model, given as an option instead of the MODEL argument.")


def which_model(option: Optional[str], *positionals: Optional[str], extra: int = 0) -> tuple[str, list[str]]:
    """The model a command was given (``-m/--model``, else its first positional argument) and the other positionals.

    ``positionals`` are the command's positional parameters in order (MODEL
    first); with ``-m``, click has bound the first positional text to MODEL,
    so every positional given is shifted into the ``extra`` ones that follow
    MODEL. Raises a usage error (typer.BadParameter: exit 2, with the usage)
    when the model is missing or empty, or more positionals are given than the
    command takes.
    """
    hint = "MODEL (or -m/--model)"
    given = [p for p in positionals if p is not None]
    if option is None:
        if not given:
            raise typer.BadParameter("missing; give the model as the first argument or with -m/--model", param_hint=hint)
        spec, rest = given[0], given[1:]
    else:
        spec, rest = option, given
    if not spec.strip():
        raise typer.BadParameter("empty", param_hint=hint)
    if len(rest) > extra:
        raise typer.BadParameter(
            f"the model is {spec!r}, and {rest[extra]!r} is one argument too many (name the model once)", param_hint=hint
        )
    return spec, rest


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        core = version("lollm-core")
        out.print(f"lollm {core} (lollm-core {core}, Python {sys.version.split()[0]})")
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


def _messages(prompt: str, system: Optional[str]) -> list[dict[str, str]]:
    messages = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return messages


WEIGHTS_HELP = ("auto: a GGUF's blocks stay packed (int4/int8 kernels), safetensors load as float; "
                "float: dequantize everything (the reference path); quantized: packed, or an error.")
QUANTIZE_HELP = "Quantize a float (safetensors) checkpoint at load: int8 (per channel) or int4 (groups, see --group-size)."


def _execution_note(loaded) -> str:
    """What the statistics line adds after the dtype: packed weights (their mode; the line above gives
    the details) and the tensor-parallel degree; empty for a plain float run in one process."""
    note = ""
    summary = getattr(loaded.model, "weights_summary", None)
    if summary is not None and summary.packed:
        note += f" · weights packed ({summary.requested})"
    if getattr(loaded, "tp", None) is not None:
        note += f" · tp {loaded.tp.world}"
    return note


def _weights_summary(loaded) -> None:
    """One dim line on stderr saying how the weights were kept (packed or float)."""
    summary = getattr(loaded.model, "weights_summary", None)
    if summary is not None and summary.requested != "float":
        note = "" if summary.packed else f" (note: the family {loaded.family.family.name!r} keeps every weight float)"
        err.print("[dim]" + escape(summary.line() + note) + "[/dim]", soft_wrap=True)


@app.command()
def run(
    model_arg: Optional[str] = model_argument(),
    family_name: Optional[str] = typer.Option(None, "--family", metavar="FAMILY", help=FAMILY_HELP),
    model: Optional[str] = model_option(),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", metavar="TEXT", help="The prompt; read from stdin when omitted."),
    system: Optional[str] = typer.Option(None, "--system", "-s", metavar="TEXT", help="System message (chat mode only)."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", metavar="N", help="Most tokens to generate."),
    temperature: Optional[float] = typer.Option(None, metavar="X", help="0 = greedy. Default: generation_config, then the family's."),
    top_k: Optional[int] = typer.Option(None, "--top-k", metavar="N", help="Keep the k most likely tokens (0 = off)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", metavar="X", help="Nucleus sampling mass (1 = off)."),
    min_p: Optional[float] = typer.Option(None, "--min-p", metavar="X", help="Drop tokens below min_p × the top probability."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", metavar="X", help="> 1 discourages repeats."),
    seed: Optional[int] = typer.Option(None, metavar="N", help="Random seed for sampling (0 .. 2**64-1)."),
    stop: List[str] = typer.Option([], "--stop", metavar="TEXT", help="Stop string (repeatable)."),
    no_chat: bool = typer.Option(False, "--no-chat", help="Use the prompt as raw text, without the chat template."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's enable_thinking flag (templates that read it). Default: the template's own default."),
    mtp: bool = typer.Option(False, "--mtp", help="Self-speculative decoding with the checkpoint's draft (MTP) head; same output, faster when drafts are accepted."),
    draft_tokens: int = typer.Option(3, "--draft-tokens", metavar="N", help="Tokens drafted per step with --mtp."),
    device: str = typer.Option("auto", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option("auto", metavar="DTYPE", help="auto (float32 on CPU, the checkpoint's dtype elsewhere), float32, bfloat16, float16."),
    threads: Optional[int] = typer.Option(None, "--threads", metavar="N", help="CPU threads torch computes with (default: torch's choice, usually one per core)."),
    prompts_file: Optional[str] = typer.Option(None, "--prompts-file", metavar="FILE", help="Generate for every prompt of this file, one per line (a .jsonl file: one JSON string per line; '-': stdin); the model loads once."),
    parse_special: bool = typer.Option(True, "--parse-special/--no-parse-special", help="Whether special-token text written in the prompt or system message (e.g. <|im_end|>) becomes control tokens (the default, as in transformers) or stays plain text."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per prompt (text, ids, timings, stop reason, sampling) instead of streaming the text."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show every sampling setting and where it came from, not only those that change something."),
    attn: Optional[str] = typer.Option(None, "--attn", metavar="BACKEND", help=ATTN_HELP),
    weights: str = typer.Option("auto", "--weights", metavar="MODE", help=WEIGHTS_HELP),
    quantize: Optional[str] = typer.Option(None, "--quantize", metavar="KIND", help=QUANTIZE_HELP),
    group_size: int = typer.Option(32, "--group-size", metavar="N", help="int4 group size for --quantize int4: 32 or 128 (64, 256 also work)."),
    tp: int = typer.Option(1, "--tp", metavar="N", help="Tensor parallel over N processes started by torchrun: `torchrun --nproc-per-node N -m lollm run --tp N …` (float weights; docs/tensor-parallel.md)."),
) -> None:
    """Generate a continuation of PROMPT, streamed to stdout; statistics go to stderr."""
    model, _ = which_model(model, model_arg)
    # 1. What can be checked without torch and without reading the checkpoint.
    user = _sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    _check_run_flags(max_new_tokens=max_new_tokens, seed=seed, device=device, threads=threads, mtp=mtp,
                     draft_tokens=draft_tokens, sampling=user)
    if system is not None and no_chat:
        raise LollmError("--system needs the chat template; it cannot be used with --no-chat")
    _check_attn(attn)
    _check_family(family_name)
    if tp != 1:  # --tp N: torchrun's environment, before anything loads
        from lollm.tensor_parallel import check_launch

        check_launch(tp)
    _check_model_exists(model)
    prompts = _read_prompts(prompt, prompts_file)

    # 2. The checkpoint (configs, tokenizer, tensor table) and its family: checks that need them, before the weights load.
    from lollm.generate import stop_token_ids
    from lollm.pipeline import open_model
    from lollm.sampling import describe_sampling, resolve_sampling

    checkpoint, family, template_flags = _open_checkpoint(model, device=device, attn=attn, threads=threads, think=think,
                                                          mtp=mtp, weights=weights, quantize=quantize, group_size=group_size,
                                                          family_name=family_name)
    tokenizer = checkpoint.tokenizer
    if no_chat or tokenizer.chat_template is None:
        if not no_chat:
            err.print("[dim]note: the checkpoint has no chat template; using the prompt as raw text[/dim]")
        if system:
            raise LollmError("--system needs the chat template; it cannot be used with --no-chat or a model without one")
        all_ids = [tokenizer.encode(p, parse_special=parse_special) for p in prompts]
    else:
        all_ids = [tokenizer.encode_chat(_messages(p, system), add_generation_prompt=True, parse_special=parse_special,
                                         **template_flags) for p in prompts]
    sampling = resolve_sampling(user, checkpoint.generation_config, family.sampling_defaults, seed=seed,
                                generation_config_name=str(checkpoint.path / "generation_config.json"))

    # 3. The weights, then one generation per prompt.
    loaded = open_model(checkpoint, LoadOptions(device=device, dtype=dtype, progress=True, attn=attn, weights=weights, quantize=quantize, group_size=group_size, tp=tp, family=family_name))
    if loaded.tp is not None and loaded.tp.rank != 0:
        _silence_this_rank()  # --tp: every rank computes, rank 0 alone prints
    _weights_summary(loaded)
    _check_draft_head(loaded, model, mtp)
    stops = stop_token_ids(checkpoint.generation_config, checkpoint.config, tokenizer)
    if not as_json:
        err.print("[dim]" + escape(describe_sampling(sampling, everything=verbose)) + "[/dim]", soft_wrap=True)
    for number, (text, ids) in enumerate(zip(prompts, all_ids), start=1):
        if len(prompts) > 1 and not as_json:
            err.print(f"[dim]\\[prompt {number}/{len(prompts)}][/dim]")
        _generate_one(loaded, text, ids, sampling=sampling, stops=stops, stop_strings=stop, max_new_tokens=max_new_tokens,
                      draft_tokens=draft_tokens if mtp else 0, as_json=as_json)
    if loaded.tp is not None:
        from lollm.tensor_parallel import shutdown

        shutdown()


def _silence_this_rank() -> None:
    """Under --tp, ranks other than 0 write nothing: stdout goes to /dev/null, stderr keeps errors only."""
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    err.quiet = True


_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def _sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty) -> dict[str, Any]:
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)


def _check_run_flags(*, max_new_tokens: Optional[int], seed: Optional[int], device: str, threads: Optional[int], mtp: bool,
                     draft_tokens: int, sampling: dict[str, Any]) -> None:
    """The flags of ``run``, ``chat`` and ``serve``, checked before torch is imported; each error names its flag."""
    from lollm.errors import GenerationError
    from lollm.sampling_params import check_sampling_value, check_seed

    if max_new_tokens is not None and max_new_tokens < 1:
        raise LollmError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    for key, value in sampling.items():
        if value is not None:
            try:
                check_sampling_value(key, value)
            except GenerationError as exc:
                raise LollmError(f"--{key.replace('_', '-')}: {exc}") from None
    if seed is not None:
        try:
            check_seed(seed)
        except GenerationError as exc:
            raise LollmError(f"--seed: {exc}") from None
    if not _DEVICE.match(device):
        raise LollmError(f"unknown device {device!r} (use auto, cpu, cuda, cuda:N or mps)")
    _check_threads(threads)
    if mtp and draft_tokens < 1:
        raise LollmError(f"--draft-tokens must be >= 1, got {draft_tokens}")


#: ``--threads`` is refused above this many threads per core the process may run on.
THREADS_PER_CORE = 4


def threads_limit() -> int:
    """The most ``--threads`` accepted: :data:`THREADS_PER_CORE` times the cores this process may run on.

    The cores are those of ``os.sched_getaffinity`` where the system has it (a
    container or ``taskset`` may allow fewer than the machine has), else
    ``os.cpu_count()``. More threads than cores only adds switching; a million
    exhausts the machine's thread limit before torch ever computes.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return THREADS_PER_CORE * max(cores, 1)


def _check_threads(threads: Optional[int]) -> None:
    """``--threads`` between 1 and :func:`threads_limit`, before torch sees it; LollmError naming the flag otherwise."""
    if threads is None:
        return
    if threads < 1:
        raise LollmError(f"--threads must be >= 1, got {threads}")
    limit = threads_limit()
    if threads > limit:
        raise LollmError(f"--threads {threads} is more than lollm allows here: at most {limit} ({THREADS_PER_CORE} per "
                         f"core, {limit // THREADS_PER_CORE} cores); leave it out for torch's default (one per core)")


def _check_ctx_size(ctx_size: Optional[int]) -> None:
    """``--ctx-size``: None (the default) or at least 2 positions (a prompt token and one to generate).

    A value above the model's context is lowered to it (as the help says); 0 or
    a negative number is an error naming the flag, never a silent default.
    """
    if ctx_size is not None and ctx_size < 2:
        raise LollmError(f"--ctx-size must be at least 2 positions (a prompt token and one generated), got {ctx_size}; "
                         f"leave it out for the default (4096, at most the model's context)")


def _check_attn(attn: Optional[str]) -> None:
    """The backend named by --attn or $LOLLM_ATTN, checked before the model is looked for (lollm.attention
    imports torch: only when one is named; its device check comes again in :func:`_open_checkpoint`)."""
    if attn is not None or os.environ.get("LOLLM_ATTN"):
        from lollm.attention import resolve_backend

        resolve_backend(attn)


def _check_family(family: Optional[str]) -> None:
    """The plugins, before the model is looked for: ``$LOLLM_LOAD_PLUGINS`` warnings on stderr, and a
    ``--family`` name that no installed family has (the registry imports no torch and no model code)."""
    from lollm.plugins import get_registry

    registry = get_registry()
    for line in registry.warnings():
        err.print(f"[yellow]warning:[/yellow] {escape(line)}", soft_wrap=True)
    if family is not None:
        registry.family_named(family)


def _open_checkpoint(model: str, *, device: str, attn: Optional[str], threads: Optional[int], think: Optional[bool],
                     mtp: bool, weights: str = "auto", quantize: Optional[str] = None,
                     group_size: int = 32, family_name: Optional[str] = None) -> tuple[Any, Any, dict[str, bool]]:
    """Step 2 of ``run``, ``chat`` and ``serve``: the checkpoint (configs, tokenizer, tensor table) and its family,
    with every check that needs them, before the weights load.

    Sets torch's thread count, checks the attention backend on the device and the
    ``--weights``/``--quantize``/``--group-size`` flags against the checkpoint's format
    (lollm.pipeline.pick_quantization), routes the checkpoint (``--family``: by that name),
    and decides ``--think`` from the chat template itself. Returns ``(checkpoint, family, template_flags)``; raises LollmError naming the flag.
    """
    import torch

    from lollm.attention import resolve_backend
    from lollm.conversation import thinking_flags
    from lollm.loader import load_checkpoint
    from lollm.pipeline import pick_device, pick_quantization, route

    if threads is not None:
        torch.set_num_threads(threads)
    dev = pick_device(device)
    resolve_backend(attn, dev)
    checkpoint = load_checkpoint(model)
    pick_quantization(LoadOptions(weights=weights, quantize=quantize, group_size=group_size), checkpoint.fmt, dev)
    family = route(checkpoint, family_name).family
    if mtp and not family.capabilities.speculative_head:
        raise LollmError(f"--mtp: the family {family.name!r} has no speculative (MTP) head")
    template_flags = thinking_flags(checkpoint.tokenizer, think, model)  # decided from the chat template itself
    return checkpoint, family, template_flags


def _check_draft_head(loaded: Any, model: str, mtp: bool) -> None:
    if mtp and not getattr(loaded.model, "has_draft_head", False):
        raise LollmError(f"--mtp: the checkpoint {model} carries no draft-head tensors (mtp.*), so it cannot draft")


def _check_model_exists(spec: str) -> None:
    """A local path that does not exist is an error now, before torch is imported (hub ids are checked when fetched)."""
    from lollm.loader import _looks_like_repo_id

    if Path(spec).expanduser().exists():
        return
    repo, colon, quant = spec.partition(":")
    if colon and Path(repo).expanduser().is_file():
        from lollm.errors import CheckpointError

        raise CheckpointError(f"{repo} is a local file: ':{quant}' only picks a .gguf file of a Hugging Face repo; give the file alone")
    if _looks_like_repo_id(spec) or (colon and quant and _looks_like_repo_id(repo)):
        return
    from lollm.errors import CheckpointError

    raise CheckpointError(
        f"{spec}: no such file or folder, and not a Hugging Face repo id of the form 'org/name' (or 'org/name:QUANT' for GGUF)"
    )


#: The most bytes one input may hold: a ``--prompts-file``, ``tokenize --file``, or a prompt or text piped on stdin.
MAX_INPUT_BYTES = 16 * 2**20


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def _read_stdin(what: str) -> str:
    """Everything piped on stdin, as UTF-8 text (bytes as they come, no newline translation).

    Raises LollmError when stdin is a terminal (nothing was piped: give ``what``), holds
    more than :data:`MAX_INPUT_BYTES` (``lollm run < /dev/zero`` ends there), or is not UTF-8.
    """
    if sys.stdin is None or sys.stdin.isatty():
        raise LollmError(f"give {what}, or pipe it on stdin")
    stream = getattr(sys.stdin, "buffer", None)
    try:
        data = (sys.stdin if stream is None else stream).read(MAX_INPUT_BYTES + 1)
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise LollmError(f"stdin is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise LollmError(f"cannot read stdin: {exc.strerror or exc}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise LollmError(f"stdin holds more than {_mib(MAX_INPUT_BYTES)}, the most lollm reads from one input")
    return text


def _file_kind(mode: int) -> str:
    """What a file of ``st_mode`` is, in words (for the error that refuses it)."""
    for test, words in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def _read_text_file(path: str, what: str) -> str:
    """The UTF-8 text of the regular file ``path``, read exactly as it is (a ``\\r\\n`` stays).

    ``what`` names the flag in the errors. Raises LollmError when the file cannot be
    opened, is anything but a regular file (a folder, a FIFO, ``/dev/zero``: opened
    without blocking and refused before a byte is read; ``-`` reads stdin instead),
    holds more than :data:`MAX_INPUT_BYTES`, or is not UTF-8.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO's open would wait for a writer
    except OSError as exc:
        raise LollmError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise LollmError(f"{what} {path}: is {_file_kind(mode)}, not a regular file (give '-' to read stdin)")
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(MAX_INPUT_BYTES + 1)  # a file that grows, or /proc's, is bounded all the same
        except OSError as exc:
            raise LollmError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise LollmError(f"{what} {path}: larger than {_mib(MAX_INPUT_BYTES)}, the most lollm reads from one input file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LollmError(f"{what} {path}: not UTF-8 text: {exc}") from None


def _read_prompts(prompt: Optional[str], prompts_file: Optional[str]) -> list[str]:
    """The prompts of one ``run``: --prompt, the lines of --prompts-file, or stdin. Empty prompts are errors."""
    if prompt is not None and prompts_file is not None:
        raise LollmError("give --prompt or --prompts-file, not both")
    if prompts_file is not None:
        text = _read_stdin("--prompts-file -") if prompts_file == "-" else _read_text_file(prompts_file, "--prompts-file")
        prompts = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue  # blank lines separate nothing
            if prompts_file.endswith(".jsonl"):
                try:
                    line = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise LollmError(f"{prompts_file} line {number}: not valid JSON: {exc.msg}") from None
                if not isinstance(line, str) or not line:
                    raise LollmError(f"{prompts_file} line {number}: expected a non-empty JSON string, got {line!r}")
            prompts.append(line)
        if not prompts:
            raise LollmError(f"--prompts-file {prompts_file}: holds no prompt")
        return prompts
    if prompt is None:
        prompt = _read_stdin("--prompt").rstrip("\n")  # the newline that ends a piped line is not part of the prompt
        if not prompt:
            raise LollmError("the prompt read from stdin is empty: there is nothing to continue")
    if not prompt:
        raise LollmError("--prompt is empty: there is nothing to continue")
    return [prompt]


def _generate_one(loaded: Any, prompt: str, ids: list[int], *, sampling: Any, stops: set[int], stop_strings: list[str],
                  max_new_tokens: int, draft_tokens: int, as_json: bool) -> None:
    """One generation of ``run``: the text streamed (or one JSON object), then its statistics; Ctrl-C exits 130."""
    from lollm.generate import GenerationResult, generate

    new_ids: list[int] = []
    pieces: list[str] = []
    started = time.perf_counter()
    first_token_at: list[float] = []

    def on_token(token_id: int, logprobs: Any) -> None:
        if not new_ids:
            first_token_at.append(time.perf_counter())
        new_ids.append(token_id)

    def show(piece: str) -> None:
        pieces.append(piece)
        if not as_json:
            sys.stdout.write(piece)
            sys.stdout.flush()

    try:
        result = generate(
            loaded.model, ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stops,
            stop_strings=stop_strings, tokenizer=loaded.tokenizer, on_text=show, on_token=on_token,
            speculative_tokens=draft_tokens, attn=loaded.attn,
        )
    except KeyboardInterrupt:
        # Ctrl-C: what was generated so far, with the timings the loop would have reported.
        now = time.perf_counter()
        first = first_token_at[0] if first_token_at else now
        result = GenerationResult(prompt_ids=list(ids), new_ids=list(new_ids), text="".join(pieces), stop_reason="interrupted",
                                  prefill_seconds=first - started, decode_seconds=now - first)
        _report(loaded, prompt, result, sampling, as_json=as_json, speculative=draft_tokens > 0)
        raise typer.Exit(130)
    _report(loaded, prompt, result, sampling, as_json=as_json, speculative=draft_tokens > 0)


def _report(loaded: Any, prompt: str, result: Any, sampling: Any, *, as_json: bool, speculative: bool) -> None:
    """The end of one generation: a JSON object on stdout, or a newline and the statistics line on stderr."""
    dtype = str(loaded.dtype).removeprefix("torch.")
    if as_json:
        data = {
            "prompt": prompt, "text": result.text, "ids": result.new_ids, "prompt_ids": result.prompt_ids,
            "stop_reason": result.stop_reason,
            "timings": {
                "load_seconds": loaded.load_seconds, "prefill_seconds": result.prefill_seconds,
                "decode_seconds": result.decode_seconds, "prefill_tokens_per_second": result.prefill_tokens_per_second,
                "decode_tokens_per_second": result.decode_tokens_per_second,
            },
            "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                         "min_p": sampling.min_p, "repetition_penalty": sampling.repetition_penalty, "seed": sampling.seed,
                         "sources": dict(sampling.sources)},
            "family": loaded.family.family.name, "device": str(loaded.device), "dtype": dtype,
        }
        if speculative:
            data["mtp"] = {"drafted": result.drafted, "accepted": result.accepted}
        print(json.dumps(data, ensure_ascii=False))
        sys.stdout.flush()
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    err.print(
        "[dim]" + escape(f"[{len(result.new_ids)} tokens · load {loaded.load_seconds:.2f} s · prompt {len(result.prompt_ids)} tokens at "
        f"{result.prefill_tokens_per_second:.1f} tok/s · decode {result.decode_tokens_per_second:.1f} tok/s · stop: {result.stop_reason} · "
        f"{loaded.family.family.name} on {loaded.device} {dtype}{_execution_note(loaded)}]") + "[/dim]",
        soft_wrap=True,
    )
    if speculative:
        err.print(
            f"[dim]MTP: {result.accepted} of {result.drafted} drafted tokens accepted "
            f"(acceptance rate {result.acceptance_rate:.1%})[/dim]",
            soft_wrap=True,
        )


@app.command("new-family")
def new_family(
    name: str = typer.Argument(..., metavar="NAME", help="The new family's name: a lowercase Python identifier."),
    like: str = typer.Option(..., "--like", metavar="FAMILY", help="The installed family to copy (qwen2 the usual start)."),
    model_type: Optional[str] = typer.Option(None, "--model-type", metavar="TYPE", help="The config.json model_type the family claims (default: the reference's, renamed; NAME for --like qwen2)."),
    into: Path = typer.Option(Path("."), "--into", metavar="PATH", help="Where to write the folder lollm-NAME."),
) -> None:
    """Write a new family distribution lollm-NAME, copied from an installed family, that installs and passes its own tests."""
    from lollm.new_family import describe, render

    out.print(escape(describe(render(name, like, into, model_type=model_type))), soft_wrap=True)


@app.command()
def families(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a plugin is broken, two plugins claim one type, or $LOLLM_LOAD_PLUGINS names a distribution that is not an installed plugin."),
) -> None:
    """List the installed family plugins (no model code is imported), and those $LOLLM_LOAD_PLUGINS leaves out."""
    from lollm.plugins import FIRST_PARTY_MODEL_TYPES, LOAD_PLUGINS_ENV, get_registry

    # the diagnostic command tries again the plugins other commands skip as remembered hangs
    registry = get_registry(retry_hung=True)
    trouble = bool(registry.broken or registry.conflicts or registry.unmatched)
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
            "load_plugins": None if registry.allowlist is None else list(registry.allowlist.values()),
            "skipped": [{"plugin": k.plugin, "distribution": k.distribution, "version": k.version} for k in registry.skipped],
            "warnings": registry.warnings(),
            "install_hints": [{"kind": h.kind, "key": h.key, "install": h.install, "source": h.source} for h in registry.hints],
        }
        print(json.dumps(data, indent=2))
        if strict and trouble:
            raise typer.Exit(1)
        return
    if not registry.families and registry.skipped:
        out.print(f"No family plugin is loaded: {LOAD_PLUGINS_ENV} leaves out every installed one.")
    elif not registry.families:
        firsts = ", ".join(sorted(set(FIRST_PARTY_MODEL_TYPES.values())))
        out.print(f"No family plugin is installed. Install one, e.g. pip install lollm-qwen (first-party: {firsts})")
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
        err.print(f"[red]{escape(slot)} is claimed by several families:[/red] {escape(who)} "
                  f"(choose with --family NAME)")
    for k in registry.skipped:
        err.print(f"[dim]skipped {escape(k.distribution)} {escape(k.version)} (plugin {escape(repr(k.plugin))}): "
                  f"not named in {LOAD_PLUGINS_ENV}[/dim]", soft_wrap=True)
    for line in registry.warnings():
        err.print(f"[yellow]warning:[/yellow] {escape(line)}", soft_wrap=True)
    if strict and trouble:
        raise typer.Exit(1)


@app.command()
def tokenize(
    model: Optional[str] = model_argument("Checkpoint folder, .gguf file or repo id (only the tokenizer is read)."),
    text: Optional[str] = typer.Argument(None, metavar="TEXT", show_default=False, help="The text to tokenize; '-' (or nothing, when piped) reads stdin."),
    chat: bool = typer.Option(False, "--chat", help="Wrap TEXT as a user message with the chat template."),
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT", help="System message for --chat."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's enable_thinking flag, for --chat (templates that read it)."),
    as_json: bool = typer.Option(False, "--json", help="Print {ids, pieces} as JSON."),
    file: Optional[str] = typer.Option(None, "--file", "-f", metavar="FILE", help="Read the text from this file (UTF-8, exactly as it is: a final newline counts)."),
    parse_special: bool = typer.Option(True, "--parse-special/--no-parse-special", help="Whether special-token text in TEXT (e.g. <|im_end|>) becomes control tokens (the default, as in transformers) or stays plain text."),
    model_opt: Optional[str] = model_option(),
) -> None:
    """Show the token ids and pieces of TEXT: how the model sees it."""
    model, rest = which_model(model_opt, model, text, extra=1)
    text = _read_tokenize_text(rest[0] if rest else None, file)

    from lollm.loader import download_repo, _looks_like_repo_id
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
        from lollm.conversation import thinking_flags

        flags = thinking_flags(tokenizer, think, model)
        rendered = tokenizer.apply_chat_template(_messages(text, system), add_generation_prompt=True, **flags)
        ids = tokenizer.encode_chat(_messages(text, system), add_generation_prompt=True, parse_special=parse_special,
                                    **flags)
    else:
        rendered, ids = text, tokenizer.encode(text, parse_special=parse_special)
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


def _read_tokenize_text(text: Optional[str], file: Optional[str]) -> str:
    """The text of ``tokenize``: the argument, --file, or stdin ('-' or no argument), read exactly as it is."""
    if file is not None:
        if text is not None:
            raise LollmError("give TEXT or --file, not both")
        return _read_text_file(file, "--file")
    if text == "-" or text is None:
        return _read_stdin("TEXT, --file FILE")
    return text


@app.command()
def parity(
    model: Optional[str] = model_argument("Checkpoint folder or repo id."),
    family_name: Optional[str] = typer.Option(None, "--family", metavar="FAMILY", help=FAMILY_HELP),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", metavar="TEXT", help="Prompt text (default: a paragraph of about 60 tokens)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the chat template to the prompt."),
    dtype: str = typer.Option("float32", metavar="DTYPE", help="float32 (the gate's standard), bfloat16 or float16."),
    device: str = typer.Option("cpu", metavar="DEVICE", help="Device for both models."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", metavar="X", help="Required cosine (default 0.99999 at float32; 0.98 with packed weights)."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON."),
    attn: Optional[str] = typer.Option(None, "--attn", metavar="BACKEND", help=ATTN_HELP),
    weights: Optional[str] = typer.Option(None, "--weights", metavar="MODE", help="float (the default, the gate's standard; auto with --quantize), or quantized / auto: our packed weights against transformers' float32 (a looser gate)."),
    quantize: Optional[str] = typer.Option(None, "--quantize", metavar="KIND", help=QUANTIZE_HELP),
    group_size: int = typer.Option(32, "--group-size", metavar="N", help="int4 group size for --quantize int4."),
    tp: int = typer.Option(1, "--tp", metavar="N", help="Our model split over N processes started by torchrun: `torchrun --nproc-per-node N -m lollm parity --tp N …`; the reference runs whole on rank 0 (docs/tensor-parallel.md)."),
    model_opt: Optional[str] = model_option(),
) -> None:
    """Compare our logits with transformers' at every prompt position; exit 1 on failure."""
    model, _ = which_model(model_opt, model)
    _check_family(family_name)
    if tp != 1:  # --tp N: torchrun's environment, before anything loads
        from lollm.tensor_parallel import check_launch

        check_launch(tp, command="parity")
    from lollm.parity import DEFAULT_PROMPT, run_parity

    options = LoadOptions(device=device, dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                          group_size=group_size, family=family_name, tp=tp)
    report = run_parity(model, prompt=prompt or DEFAULT_PROMPT, chat=chat, options=options, min_cosine=min_cosine)
    if tp != 1 and _tp_rank() != 0:
        _silence_this_rank()  # every rank holds rank 0's report: rank 0 prints it, every rank exits with its verdict
    _print_parity(report, as_json)
    if tp != 1:
        _tp_finish()  # rank 0 has printed before any rank exits (torchrun stops the others when one exits 1)
    raise typer.Exit(0 if report.passed else 1)


def _tp_rank() -> int:
    """This process's rank in the --tp group (0 without one)."""
    from lollm.tensor_parallel import current

    group = current()
    return 0 if group is None else group.rank


def _tp_finish() -> None:
    """The end of a --tp command: wait for every rank (rank 0 has printed), then leave the group."""
    import torch.distributed as dist

    from lollm.tensor_parallel import shutdown

    sys.stdout.flush()
    dist.barrier()
    shutdown()


def _print_parity(report: Any, as_json: bool) -> None:
    """The parity report: JSON, or the table of positions and the verdict line."""
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
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


@app.command()
def trace(
    model_arg: Optional[str] = model_argument(),
    family_name: Optional[str] = typer.Option(None, "--family", metavar="FAMILY", help=FAMILY_HELP),
    model_opt: Optional[str] = model_option(),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", metavar="TEXT", help="The prompt; read from stdin when omitted."),
    output: str = typer.Option("trace.html", "--output", "-o", metavar="FILE", help="Where to write the page: a new file, or a regular file it replaces (never a symlink, FIFO or device)."),
    system: Optional[str] = typer.Option(None, "--system", "-s", metavar="TEXT", help="System message (chat mode only)."),
    no_chat: bool = typer.Option(False, "--no-chat", help="Use the prompt as raw text, without the chat template."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's enable_thinking flag (families with a thinking toggle)."),
    compare: bool = typer.Option(False, "--compare", help="Also run transformers on the same ids and plot each hidden state's divergence (lollm-core[parity])."),
    device: str = typer.Option("auto", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option("float32", metavar="DTYPE", help="float32 (the default: the numbers of the parity gate), bfloat16, float16."),
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
    _check_family(family_name)
    if prompt is None:
        prompt = _read_stdin("--prompt").rstrip("\n")
    from lollm.trace.run import run_trace  # (imports torch: after the checks above)

    options = LoadOptions(device=device, dtype=dtype, progress=True, family=family_name)
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
    model: Optional[str] = model_argument("Checkpoint folder, .gguf file or repo id."),
    family_name: Optional[str] = typer.Option(None, "--family", metavar="FAMILY", help=FAMILY_HELP),
    dtype: str = typer.Option("float32", metavar="DTYPE", help="float32 or bfloat16."),
    prompt_tokens: int = typer.Option(512, metavar="N", help="Prefill length."),
    new_tokens: int = typer.Option(64, metavar="N", help="Decode steps."),
    threads: Optional[int] = typer.Option(None, metavar="N", help="torch threads (default: torch's)."),
    rounds: int = typer.Option(3, "--rounds", metavar="N", help="Alternating rounds (A B A B ...); medians are reported."),
    no_reference: bool = typer.Option(False, "--no-reference", help="Skip transformers."),
    weights: str = typer.Option("auto", "--weights", metavar="MODE", help=WEIGHTS_HELP),
    quantize: Optional[str] = typer.Option(None, "--quantize", metavar="KIND", help=QUANTIZE_HELP),
    group_size: int = typer.Option(32, "--group-size", metavar="N", help="int4 group size for --quantize int4."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
    attn: Optional[str] = typer.Option(None, "--attn", metavar="BACKEND", help=ATTN_HELP),
    tp: int = typer.Option(1, "--tp", metavar="N", help="Our model split over N CPU processes started by torchrun: `torchrun --nproc-per-node N -m lollm bench --tp N --no-reference …`; every rank runs the rounds, rank 0 prints (docs/tensor-parallel.md)."),
    model_opt: Optional[str] = model_option(),
) -> None:
    """Prefill and decode tok/s, load time and peak memory: ours beside transformers, in alternating rounds."""
    model, _ = which_model(model_opt, model)
    if rounds < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise LollmError("--rounds, --prompt-tokens and --new-tokens must be at least 1")
    _check_threads(threads)  # before torch is imported
    from lollm.attention import resolve_backend
    from lollm.bench import run_bench

    if tp != 1:  # --tp N: torchrun's environment, before anything loads
        from lollm.tensor_parallel import check_launch

        if not no_reference:
            raise LollmError(f"--tp {tp}: bench cannot compare with transformers under --tp (it would run whole in one "
                             f"process while the other ranks wait, not the same work); add --no-reference to bench "
                             f"lollm alone over {tp} processes")
        check_launch(tp, command="bench")
        if int(os.environ["RANK"]) != 0:
            _silence_this_rank()  # every rank runs the same rounds; rank 0 alone prints its figures
    attn = resolve_backend(attn)
    _check_family(family_name)
    options = LoadOptions(device="cpu", dtype=dtype, attn=attn, weights=weights, quantize=quantize,
                          group_size=group_size, family=family_name, tp=tp)
    result = run_bench(model, options, prompt_tokens=prompt_tokens, new_tokens=new_tokens, reference=not no_reference,
                       threads=threads, rounds=rounds,
                       log=None if as_json else lambda line: err.print(f"[dim]{escape(line)}[/dim]"))
    _print_bench(result, model=model, dtype=dtype, new_tokens=new_tokens, rounds=rounds, weights=weights,
                 quantize=quantize, attn=attn, tp=tp, as_json=as_json)
    if tp != 1:
        _tp_finish()


def _print_bench(result: Any, *, model: str, dtype: str, new_tokens: int, rounds: int, weights: str,
                 quantize: Optional[str], attn: str, tp: int, as_json: bool) -> None:
    """The bench figures: JSON, or the table, the ratios and the machine's load."""
    from lollm.bench import machine_load

    names = [e.name for e in result.engines]
    ratios = {}
    if "transformers" in names:
        ratios = {k: {"median": result.ratio("lollm", "transformers", k), "rounds": result.ratios("lollm", "transformers", k)}
                  for k in ("prefill_tok_s", "decode_tok_s")}
    if as_json:
        print(json.dumps({"rows": result.rows, "ratios_lollm_over_transformers": ratios, "note": result.note,
                          "threads": result.threads, "tp": tp, "machine": machine_load()}, indent=2))
        return
    kept = ("weights " + (f"--quantize {quantize}" if quantize else weights)) + ", "
    split = "" if tp == 1 else f"--tp {tp}: rank 0's load and shard, steps of all {tp} ranks together; "
    title = (f"bench: {model} ({dtype}, {kept}attn {attn}, prompt {result.prompt_tokens}, decode {new_tokens}, {rounds} rounds, "
             f"{result.threads} threads{' per process' if tp != 1 else ''}; {split}medians)")
    table = Table(title=escape(title))
    for col in ("engine", "load s", "load peak MB", "weights MB", "peak/weights", "prefill tok/s", "decode tok/s"):
        table.add_column(col, justify="right")
    for e in result.engines:
        table.add_row(e.name, f"{e.load_seconds:.2f}", f"{e.load_peak_bytes / 1e6:.0f}", f"{e.weights_bytes / 1e6:.0f}",
                      f"{e.load_peak_bytes / max(e.weights_bytes, 1):.2f}", f"{e.median('prefill_tok_s'):.1f}",
                      f"{e.median('decode_tok_s'):.2f}")
    out.print(table)
    for key, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
        if ratios:
            per_round = " ".join(f"{r:.2f}" for r in ratios[key]["rounds"])
            out.print(f"lollm/transformers {label}: {ratios[key]['median']:.2f}× (median of the per-round ratios {per_round})")
    decode = result.by_name("lollm").median("decode_tok_s")
    if tp != 1 and decode > 0:
        out.print(f"--tp {tp}: {1000 / decode:.2f} ms per decode step, each step computed by {tp} processes together "
                  f"(compare with the same command without --tp, one process)")
    if result.note:
        out.print(result.note)
    out.print(f"[dim]{escape(machine_load())}: figures are noisy on a shared machine; read the per-round ratios[/dim]")


@app.command()
def inspect(
    model: Optional[str] = model_argument("A .gguf file or a safetensors checkpoint folder."),
    tensors: bool = typer.Option(True, "--tensors/--no-tensors", help="Print the tensor table."),
    pattern: Optional[str] = typer.Option(None, "--filter", metavar="PATTERN", help="Only the tensors whose name holds PATTERN (attn_q), or, when it has * ? or [, matches it as a glob (blk.1.*); an error when none does."),
    as_json: bool = typer.Option(False, "--json", help="Print everything as JSON (arrays summarized)."),
    model_opt: Optional[str] = model_option(),
) -> None:
    """Show what is inside a checkpoint: a summary (format, architecture, parameters, bytes, tensors per type), its metadata, then its tensors (name, shape, type, bytes) in natural order (blk.2 before blk.10)."""
    model, _ = which_model(model_opt, model)
    from lollm.inventory import inspect_checkpoint, summarize

    inv = inspect_checkpoint(model)
    rows = inv.select(pattern)
    if as_json:
        totals = inv.totals()
        print(json.dumps({
            "path": str(inv.path), "format": inv.fmt, "summary": inv.summary(), "filter": pattern,
            "metadata": {k: summarize(v) for k, v in inv.metadata.items()},
            "tensors": [{"name": t.name, "shape": list(t.shape), "type": t.type, "bytes": t.nbytes} for t in rows],
            "totals": {k: {"tensors": n, "bytes": b} for k, (n, b) in totals.items()},
            "total_bytes": inv.total_bytes,
        }, indent=2, ensure_ascii=False))
        return
    _print_summary(inv)
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


def _print_summary(inv: Any) -> None:
    """The first table of ``inspect``: the checkpoint at a glance (lollm.inventory.Inventory.summary)."""
    s = inv.summary()
    table = Table(title=escape(f"{inv.path} ({inv.fmt})"), show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("format", s["format"])
    table.add_row("architecture", escape(s["architecture"] or "(not named)"))
    table.add_row("tensors", f"{s['tensors']:,}")
    table.add_row("parameters", f"{s['parameters']:,}" + (f" ({s['parameters'] / 1e6:,.1f} M)" if s["parameters"] >= 1e6 else ""))
    table.add_row("bytes", _size(s["bytes"]))
    table.add_row("types", escape(", ".join(f"{kind} {n} ({_size(b)})" for kind, (n, b) in inv.totals().items()) or "-"))
    out.print(table)


def _size(nbytes: int) -> str:
    """Bytes for a person: ``1,432 B`` below one MiB, else ``300.2 MiB``."""
    return f"{nbytes:,} B" if nbytes < 2**20 else f"{nbytes / 2**20:,.1f} MiB"


@app.command()
def chat(
    model_arg: Optional[str] = model_argument(),
    family_name: Optional[str] = typer.Option(None, "--family", metavar="FAMILY", help=FAMILY_HELP),
    system: Optional[str] = typer.Option(None, "--system", "-s", metavar="TEXT", help="System message, kept across /reset."),
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens", "-n", metavar="N", help="Most tokens per answer."),
    temperature: Optional[float] = typer.Option(None, metavar="X", help="0 = greedy. Default: generation_config, then the family's."),
    top_k: Optional[int] = typer.Option(None, "--top-k", metavar="N", help="Keep the k most likely tokens (0 = off)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", metavar="X", help="Nucleus sampling mass (1 = off)."),
    min_p: Optional[float] = typer.Option(None, "--min-p", metavar="X", help="Drop tokens below min_p × the top probability."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", metavar="X", help="> 1 discourages repeats."),
    seed: Optional[int] = typer.Option(None, metavar="N", help="Random seed for sampling (0 .. 2**64-1)."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="The chat template's enable_thinking flag (templates that read it)."),
    mtp: bool = typer.Option(False, "--mtp", help="Self-speculative decoding with the checkpoint's MTP head."),
    draft_tokens: int = typer.Option(3, "--draft-tokens", metavar="N", help="Tokens drafted per step with --mtp."),
    ctx_size: Optional[int] = typer.Option(None, "--ctx-size", "-c", metavar="N", help=CTX_HELP),
    context_shift: bool = typer.Option(True, "--context-shift/--no-context-shift", help=CONTEXT_SHIFT_HELP),
    device: str = typer.Option("auto", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option("auto", metavar="DTYPE", help="auto (float32 on CPU, the checkpoint's dtype elsewhere), float32, bfloat16, float16."),
    threads: Optional[int] = typer.Option(None, "--threads", metavar="N", help="CPU threads torch computes with (default: torch's choice, usually one per core)."),
    weights: str = typer.Option("auto", "--weights", metavar="MODE", help=WEIGHTS_HELP),
    quantize: Optional[str] = typer.Option(None, "--quantize", metavar="KIND", help=QUANTIZE_HELP),
    group_size: int = typer.Option(32, "--group-size", metavar="N", help="int4 group size for --quantize int4."),
    model_opt: Optional[str] = model_option(),
) -> None:
    """Chat with MODEL in the terminal: /stats, /drop N, /reset, /quit; Ctrl-C stops an answer, Ctrl-D quits."""
    model, _ = which_model(model_opt, model_arg)
    user = _sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    _check_run_flags(max_new_tokens=max_new_tokens, seed=seed, device=device, threads=threads, mtp=mtp,
                     draft_tokens=draft_tokens, sampling=user)
    _check_ctx_size(ctx_size)
    _check_family(family_name)
    _check_model_exists(model)

    from lollm.conversation import ChatSession, repl
    from lollm.generate import stop_token_ids
    from lollm.pipeline import open_model
    from lollm.sampling import resolve_sampling

    checkpoint, family, template_flags = _open_checkpoint(model, device=device, attn=None, threads=threads, think=think,
                                                          mtp=mtp, weights=weights, quantize=quantize, group_size=group_size,
                                                          family_name=family_name)
    sampling = resolve_sampling(user, checkpoint.generation_config, family.sampling_defaults, seed=seed,
                                generation_config_name=str(checkpoint.path / "generation_config.json"))
    loaded = open_model(checkpoint, LoadOptions(device=device, dtype=dtype, progress=True, weights=weights, quantize=quantize, group_size=group_size, family=family_name))
    _weights_summary(loaded)
    _check_draft_head(loaded, model, mtp)
    session = ChatSession(
        loaded, sampling=sampling, stop_ids=stop_token_ids(checkpoint.generation_config, checkpoint.config, loaded.tokenizer),
        system=system, template_flags=template_flags, max_new_tokens=max_new_tokens,
        speculative_tokens=draft_tokens if mtp else 0, context=ctx_size, context_shift=context_shift,
    )
    err.print(f"[dim]lollm chat: {escape(model)} ({family.name} on {loaded.device} "
              f"{str(loaded.dtype).removeprefix('torch.')}, context {session.cache.max_tokens})[/dim]", soft_wrap=True)
    repl(session, note=lambda line: err.print(f"[dim]{escape(line)}[/dim]", soft_wrap=True))


@app.command()
def serve(
    model_arg: Optional[str] = model_argument(),
    family_name: Optional[str] = typer.Option(None, "--family", metavar="FAMILY", help=FAMILY_HELP),
    host: str = typer.Option("127.0.0.1", metavar="HOST", help="Address to listen on (0.0.0.0: every interface; think of --api-key)."),
    port: int = typer.Option(8000, metavar="PORT", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", metavar="KEY", help="Require 'Authorization: Bearer KEY' on every /v1 request."),
    model_name: Optional[str] = typer.Option(None, "--model-name", metavar="NAME", help="The model id clients send (default: the checkpoint's folder or file name)."),
    ctx_size: Optional[int] = typer.Option(None, "--ctx-size", "-c", metavar="N", help=CTX_HELP),
    temperature: Optional[float] = typer.Option(None, metavar="X", help="Default for requests that give none (then generation_config, then the family's)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", metavar="N", help="Default top-k for requests."),
    top_p: Optional[float] = typer.Option(None, "--top-p", metavar="X", help="Default top-p for requests."),
    min_p: Optional[float] = typer.Option(None, "--min-p", metavar="X", help="Default min-p for requests."),
    repetition_penalty: Optional[float] = typer.Option(None, "--repetition-penalty", metavar="X", help="Default repetition penalty."),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", help="Default enable_thinking (a request's chat_template_kwargs wins)."),
    mtp: bool = typer.Option(False, "--mtp", help="Self-speculative decoding with the checkpoint's MTP head."),
    draft_tokens: int = typer.Option(3, "--draft-tokens", metavar="N", help="Tokens drafted per step with --mtp."),
    device: str = typer.Option("auto", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option("auto", metavar="DTYPE", help="auto (float32 on CPU, the checkpoint's dtype elsewhere), float32, bfloat16, float16."),
    threads: Optional[int] = typer.Option(None, "--threads", metavar="N", help="CPU threads torch computes with (default: torch's choice, usually one per core)."),
    weights: str = typer.Option("auto", "--weights", metavar="MODE", help=WEIGHTS_HELP),
    quantize: Optional[str] = typer.Option(None, "--quantize", metavar="KIND", help=QUANTIZE_HELP),
    group_size: int = typer.Option(32, "--group-size", metavar="N", help="int4 group size for --quantize int4."),
    tp: int = typer.Option(1, "--tp", metavar="N", help="Tensor parallel over N processes started by torchrun: `torchrun --nproc-per-node N -m lollm serve --tp N …`; rank 0 serves HTTP, every rank generates (docs/tensor-parallel.md)."),
    model_opt: Optional[str] = model_option(),
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models)."""
    model, _ = which_model(model_opt, model_arg)
    user = _sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    _check_run_flags(max_new_tokens=None, seed=None, device=device, threads=threads, mtp=mtp, draft_tokens=draft_tokens,
                     sampling=user)
    _check_ctx_size(ctx_size)
    if not 0 <= port <= 65535:  # before the model loads, not a traceback from the socket after it
        raise LollmError(f"--port must be a TCP port from 0 to 65535, got {port}")
    if tp != 1:  # --tp N: torchrun's environment, before anything loads
        from lollm.tensor_parallel import check_launch

        check_launch(tp, command="serve")

    from lollm.conversation import DEFAULT_CONTEXT
    from lollm.pipeline import open_model
    from lollm.server import ModelServer, require_serve_extra, serve as run_server

    _check_family(family_name)
    require_serve_extra()
    _check_model_exists(model)
    checkpoint, family, template_flags = _open_checkpoint(model, device=device, attn=None, threads=threads, think=think,
                                                          mtp=mtp, weights=weights, quantize=quantize, group_size=group_size,
                                                          family_name=family_name)
    if tp != 1:  # the other ranks wait for requests in a collective: far longer than torch's 30-minute default
        from lollm.pipeline import pick_device
        from lollm.tensor_parallel import init

        init(tp, pick_device(device), timeout=SERVE_TP_TIMEOUT)
    loaded = open_model(checkpoint, LoadOptions(device=device, dtype=dtype, progress=True, weights=weights, quantize=quantize, group_size=group_size, family=family_name, tp=tp))
    if loaded.tp is not None and loaded.tp.rank != 0:
        _silence_this_rank()
    _weights_summary(loaded)
    _check_draft_head(loaded, model, mtp)
    name = model_name or (Path(model).stem if Path(model).suffix == ".gguf" else Path(model.rstrip("/")).name)
    server = ModelServer(
        loaded, name=name, context=ctx_size or min(DEFAULT_CONTEXT, loaded.model.max_context),
        sampling_flags=user, template_flags=template_flags, draft_tokens=draft_tokens if mtp else 0, api_key=api_key,
    )
    if loaded.tp is not None and loaded.tp.rank != 0:
        server.follow()  # every generation rank 0 runs, until rank 0 stops
        _tp_finish()
        return
    split = "" if loaded.tp is None else f", --tp {tp}"
    try:  # the banner (URL, model, family, context, a curl line, the chat page) comes once it listens
        run_server(server, host=host, port=port, family=f"{family.name} on {loaded.device}{split}")
    finally:
        if loaded.tp is not None and server.stop_followers():
            _tp_finish()


#: Seconds a --tp rank of `lollm serve` may wait in a collective for rank 0's next request (a week).
SERVE_TP_TIMEOUT = 7 * 24 * 3600.0


@app.command("list")
def list_(
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (size in bytes)."),
) -> None:
    """The models on this machine: the Hugging Face cache and lollm's cache ($LOLLM_CACHE), with the family that runs each."""
    from lollm.models import list_models, rows_json
    from lollm.testing.real_models import cache_dir

    rows = list_models()
    if as_json:
        print(rows_json(rows))
        return
    if not rows:
        out.print(f"No model in the Hugging Face cache or in {escape(str(cache_dir()))}. "
                  f"Fetch one: lollm pull org/name (or org/name:Q4_K_M for a GGUF repo).")
        return
    table = Table(title="Models on this machine (run one: lollm run SPEC --prompt TEXT)")
    for col, justify in (("model", "left"), ("format", "left"), ("quant", "left"), ("size", "right"),
                         ("family", "left"), ("cache", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for r in rows:
        table.add_row(escape(r.spec if r.source == "hf" and r.fmt == "safetensors" else r.name), r.fmt,
                      escape(r.quant), f"{r.size / 2**20:,.1f} MiB", escape(r.family), r.source)
    out.print(table)
    out.print("A hub repo id runs as shown; a file of lollm's cache runs by its full path, its spec in "
              "lollm list --json.", style="dim")


@app.command()
def pull(
    spec: str = typer.Argument(..., metavar="REPO[:QUANT]", show_default=False,
                               help="A Hugging Face repo id (org/name), or org/name:QUANT for the one .gguf file of that quant."),
) -> None:
    """Download a model into the Hugging Face cache (huggingface_hub's progress bar), then print its path and how to run it."""
    from lollm.models import pull as fetch

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
