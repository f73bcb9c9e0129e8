"""The options the ``lollm`` commands share, each declared once, and the one function that makes LoadOptions of them.

A flag that several commands take is a typer ``Annotated`` type here: a command takes
``--device`` by writing ``device: Device = "auto"``. The flag's names, metavar and help
come from this module; the default stays in the command's signature, where a reader of
the command sees it. A command that says more about a flag than the others (each
``--tp`` names its own torchrun line) writes ``with_help(Tp, "...")``: the same flag and
metavar, its own help.

The flags that change how a checkpoint loads become one :class:`lollm.load.options.LoadOptions`
through :func:`load_options`; the commands hand that record to ``open_model``,
``run_parity``, ``run_bench`` and to the checks of :mod:`lollm.cli.checks`.

:class:`App` and :class:`Command` print every command's ``--help`` as click writes it:
each valued flag with its metavar, never typer's type labels (tests/test_help_text.py).

Nothing here imports torch (a typo in a flag costs nothing), except :func:`load_options`
under ``--tp N``, which reads torchrun's environment through :mod:`lollm.load.tensor_parallel`.
"""

from __future__ import annotations

import json
from copy import copy
from pathlib import Path
from typing import Annotated, Any, List, Optional, get_args

import click
import typer

from lollm.cli.help import Context, Group
from lollm.errors import LollmError
from lollm.generate.structured import ConstraintError, OutputConstraint, check_constraint
from lollm.load.options import LoadOptions

# Lazy import below: lollm.load.tensor_parallel imports torch; only --tp N reads torchrun's environment through it.


class Command(typer.core.TyperCommand):
    """A command whose help names each argument by its metavar alone (MODEL, TEXT), without typer's ``<str>``,
    wrapped at spaces only (:class:`lollm.cli.help.HelpFormatter`: a flag name is never cut at its hyphen)."""

    context_class = Context

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
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


class App(typer.Typer):
    """typer.Typer whose commands are :class:`Command` (a command added later gets the same help for free), listed
    by :class:`lollm.cli.help.Group`: in sections (each command's ``rich_help_panel``), each with its first sentence."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=Group, **kwargs)

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or Command, **kwargs)


def with_help(alias: object, help: str) -> object:
    """The option (or argument) type ``alias`` of this module with another help text, for one command."""
    base, info = get_args(alias)
    info = copy(info)
    info.help = help
    return Annotated[base, info]


# -- naming the model: one mechanism for every command ------------------------------
#
# A command that takes a model declares both parameters and calls which_model:
#
#     def cmd(model_arg: ModelArg = None, ..., model_opt: ModelOpt = None):
#         model, _ = which_model(model_opt, model_arg)

ModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False,
    help="Checkpoint folder, .gguf file, Hugging Face repo id, or org/name:QUANT for a GGUF repo.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="MODEL", show_default=False, help="The model, given as an option instead of the MODEL argument.")]


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


# -- how the model loads: the fields of LoadOptions, and torch's threads ------------------

ATTN_HELP = "Attention backend: sdpa (the default and reference), eager (scores written out), triton (lollm-core[triton]). Default: $LOLLM_ATTN, else sdpa."
FAMILY_HELP = "The family (by name, see lollm families) that serves the model, when several installed plugins claim its type."
WEIGHTS_HELP = ("auto: a GGUF's blocks stay packed (int4/int8 kernels), safetensors load as float; "
                "float: dequantize everything (the reference path); quantized: packed, or an error.")
QUANTIZE_HELP = "Quantize a float (safetensors) checkpoint at load: int8 (per channel) or int4 (groups, see --group-size)."

Family = Annotated[Optional[str], typer.Option("--family", metavar="FAMILY", help=FAMILY_HELP)]
Device = Annotated[str, typer.Option("--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps.")]
Dtype = Annotated[str, typer.Option(
    "--dtype", metavar="DTYPE", help="auto (float32 on CPU, the checkpoint's dtype elsewhere), float32, bfloat16, float16.")]
Attn = Annotated[Optional[str], typer.Option("--attn", metavar="BACKEND", help=ATTN_HELP)]
Weights = Annotated[str, typer.Option("--weights", metavar="MODE", help=WEIGHTS_HELP)]
Quantize = Annotated[Optional[str], typer.Option("--quantize", metavar="KIND", help=QUANTIZE_HELP)]
GroupSize = Annotated[int, typer.Option("--group-size", metavar="N", help="int4 group size for --quantize int4.")]
#: each command gives ``--tp`` its own help (its torchrun line): ``with_help(Tp, ...)``
Tp = Annotated[int, typer.Option("--tp", metavar="N", help="Tensor parallel over N processes started by torchrun (docs/tensor-parallel.md).")]
Threads = Annotated[Optional[int], typer.Option(
    "--threads", metavar="N", help="CPU threads torch computes with (default: the cores free when the command starts, "
                                   "at least 1; see docs/quantized-execution.md).")]


def load_options(command: str, *, device: str = "auto", dtype: str = "auto", attn: Optional[str] = None,
                 weights: Optional[str] = None, quantize: Optional[str] = None, group_size: int = 32, tp: int = 1,
                 family: Optional[str] = None, progress: bool = False) -> LoadOptions:
    """The :class:`LoadOptions` of ``command``'s flags (``--device``, ``--dtype``, ``--attn``, ``--weights`` ...).

    Under ``--tp N`` (N != 1) torchrun's environment is checked first
    (:func:`lollm.load.process_group.check_launch`; its error's launch line names
    ``command``). Raises LollmError naming the flag: that check's, or
    LoadOptions' own (a dtype, weights or quantize value outside its choices).
    """
    if tp != 1:
        from lollm.load.process_group import check_launch

        check_launch(tp, command=command)
    return LoadOptions(device=device, dtype=dtype, attn=attn, weights=weights, quantize=quantize, group_size=group_size,
                       tp=tp, family=family, progress=progress)


# -- what to generate, and how to sample ------------------------------------------------

CTX_HELP = "Positions of the cache kept across turns / requests (default: 4096, at most the model's context)."
CONTEXT_SHIFT_HELP = ("When the conversation outgrows the context: drop the oldest turns (the system message stays) and "
                      "go on, as ollama and llama.cpp's context shift do; --no-context-shift stops with an error that "
                      "says how to continue (/drop N, /reset).")

Prompt = Annotated[Optional[str], typer.Option("--prompt", "-p", metavar="TEXT", help="The prompt; read from stdin when omitted.")]
System = Annotated[Optional[str], typer.Option("--system", "-s", metavar="TEXT", help="System message (chat mode only).")]
NoChat = Annotated[bool, typer.Option("--no-chat", help="Use the prompt as raw text, without the chat template.")]
ImageFiles = Annotated[list[str], typer.Option(
    "--image", metavar="FILE",
    help="An image for the prompt (PNG, JPEG, GIF, WebP; repeat for several); the model needs a vision tower "
         "(docs/vision.md). Each goes where the prompt writes the family's placeholder (<start_of_image> for "
         "Gemma 3), else before the prompt's text. Video and audio are not read.")]
MmprojFile = Annotated[Optional[str], typer.Option(
    "--mmproj", metavar="FILE",
    help="The vision tower of a GGUF model: the mmproj GGUF file llama.cpp's convert_hf_to_gguf.py --mmproj writes, "
         "for the images (--image; /image in chat). A safetensors model carries its tower in its own files.")]
#: each command says what ``--think`` decides there: ``with_help(Think, ...)``
Think = Annotated[Optional[bool], typer.Option("--think/--no-think", help="The chat template's enable_thinking flag (templates that read it).")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", "-n", metavar="N", help="Most tokens to generate.")]
Temperature = Annotated[Optional[float], typer.Option(
    "--temperature", metavar="X", help="0 = greedy. Default: generation_config, then the family's.")]
TopK = Annotated[Optional[int], typer.Option("--top-k", metavar="N", help="Keep the k most likely tokens (0 = off).")]
TopP = Annotated[Optional[float], typer.Option("--top-p", metavar="X", help="Nucleus sampling mass (1 = off).")]
MinP = Annotated[Optional[float], typer.Option("--min-p", metavar="X", help="Drop tokens below min_p × the top probability.")]
RepetitionPenalty = Annotated[Optional[float], typer.Option(
    "--repetition-penalty", metavar="X", help="> 1 discourages repeats.")]
Seed = Annotated[Optional[int], typer.Option("--seed", metavar="N", help="Random seed for sampling (0 .. 2**64-1).")]
Stop = Annotated[List[str], typer.Option("--stop", metavar="TEXT", help="Stop string (repeatable).")]
Mtp = Annotated[bool, typer.Option("--mtp", help="Self-speculative decoding with the checkpoint's MTP head.")]
#: each command says which drafters it has: ``with_help(DraftTokens, ...)`` (chat and serve have --mtp alone)
DraftTokens = Annotated[int, typer.Option("--draft-tokens", metavar="N", help="Tokens drafted per step with --mtp or --prompt-lookup.")]
PromptLookup = Annotated[bool, typer.Option(
    "--prompt-lookup", help="Speculative decoding with drafts copied from the prompt and the output so far (any model; "
                            "same output, faster when the answer repeats the prompt, e.g. code edits; see --draft-tokens).")]
CtxSize = Annotated[Optional[int], typer.Option("--ctx-size", "-c", metavar="N", help=CTX_HELP)]
ContextShift = Annotated[bool, typer.Option("--context-shift/--no-context-shift", help=CONTEXT_SHIFT_HELP)]
ParseSpecial = Annotated[bool, typer.Option(
    "--parse-special/--no-parse-special",
    help="Whether special-token text written in the prompt or system message (e.g. <|im_end|>) becomes control tokens "
         "(the default, as in transformers) or stays plain text.")]
#: every command says what its ``--json`` prints: ``with_help(Json, ...)``
Json = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


# -- structured output: one constraint (lollm.generate.structured), from at most one of three flags ----------

JsonSchemaFlag = Annotated[Optional[str], typer.Option(
    "--json-schema", metavar="FILE|JSON",
    help="The output is JSON following this JSON schema (a file, or the schema itself); docs/structured-output.md.")]
RegexFlag = Annotated[Optional[str], typer.Option(
    "--regex", metavar="PATTERN", help="The whole output matches this regular expression (Rust regex syntax).")]
GrammarFlag = Annotated[Optional[str], typer.Option(
    "--grammar", metavar="FILE", help="The output follows this grammar (llguidance's Lark syntax; docs/structured-output.md).")]


def output_constraint(json_schema: Optional[str], regex: Optional[str], grammar: Optional[str]) -> Optional[OutputConstraint]:
    """The :class:`lollm.generate.structured.OutputConstraint` of ``--json-schema`` / ``--regex`` / ``--grammar`` (None: none).

    ``--json-schema`` is a file when one exists at that path, else the schema's JSON text (a value
    that starts like neither JSON nor an existing file is a missing file); ``--grammar`` is a file only.
    The constraint is checked now (:func:`lollm.generate.structured.check_constraint`), before a model
    loads. Raises LollmError naming the flag: two of them given, an unreadable file, a schema
    that is not a JSON object, or what cannot be enforced (an unsupported schema keyword ...).
    """
    given = [name for name, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
             if value is not None]
    if len(given) > 1:
        raise LollmError(f"{' and '.join(given)}: give at most one constraint on the output")
    if not given:
        return None

    def read(path: str, flag: str) -> str:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise LollmError(f"{flag} {path}: cannot read the file: {error}") from None

    if json_schema is not None:
        if not Path(json_schema).is_file() and not json_schema.lstrip().startswith(("{", "[")):
            raise LollmError(f"--json-schema {json_schema}: no such file (a schema given inline starts with '{{')")
        text = read(json_schema, "--json-schema") if Path(json_schema).is_file() else json_schema
        try:
            schema = json.loads(text)
        except ValueError as error:
            raise LollmError(f"--json-schema: neither a file nor valid JSON ({error})") from None
        if not isinstance(schema, dict):
            raise LollmError(f"--json-schema: a JSON schema is a JSON object, got {type(schema).__name__}")
        constraint = OutputConstraint.json_schema(schema)
    elif regex is not None:
        constraint = OutputConstraint.regex(regex)
    else:
        if not Path(grammar).is_file():
            raise LollmError(f"--grammar takes a file path, and {grammar} is no file")
        constraint = OutputConstraint.grammar(read(grammar, "--grammar"))
    try:
        check_constraint(constraint)
    except ConstraintError as error:
        raise LollmError(f"{given[0]}: {error}") from None
    return constraint


def sampling_flags(temperature: Optional[float], top_k: Optional[int], top_p: Optional[float], min_p: Optional[float],
                   repetition_penalty: Optional[float]) -> dict[str, float | int | None]:
    """The sampling flags a user gave, by :class:`lollm.sampling_params.SamplingParams` field (None: not given)."""
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty)
