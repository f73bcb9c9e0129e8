"""The commands that show what is installed and what a checkpoint holds: ``families``, ``tokenize``,
``inspect``, ``list``, ``pull``; and ``new-family``, which writes a new family distribution."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from lollm.cli import report as show
from lollm.cli.inputs import messages, read_tokenize_text
from lollm.cli.inventory import inspect_checkpoint
from lollm.cli.models import list_models, rows_json
from lollm.cli.models import pull as fetch
from lollm.cli.new_family import describe, render
from lollm.cli.options import Json, ModelArg, ModelOpt, ParseSpecial, Think, which_model, with_help
from lollm.cli.report import out
from lollm.errors import LollmError
from lollm.load.hub import download_repo
from lollm.load.loader import looks_like_repo_id
from lollm.load.local_names import locate
from lollm.load.plugins import get_registry
from lollm.tokenizer import load_gguf_tokenizer, load_tokenizer

# Lazy imports below: lollm.load.pipeline imports torch, and only tokenize --chat needs it (template_flags);
# lollm.cli.real_models, for lollm list's empty answer only (why it waits: lollm.cli.models).


def new_family(
    name: str = typer.Argument(..., metavar="NAME", help="The new family's name: a lowercase Python identifier."),
    like: str = typer.Option(..., "--like", metavar="FAMILY", help="The installed family to copy (qwen2 the usual start)."),
    model_type: Optional[str] = typer.Option(None, "--model-type", metavar="TYPE", help="The config.json model_type the family claims (default: the reference's, renamed; NAME for --like qwen2)."),
    into: Path = typer.Option(Path("."), "--into", metavar="PATH", help="Where to write the folder lollm-NAME."),
) -> None:
    """Write a new family distribution, lollm-NAME, copied from an installed family. It installs and passes its own tests."""
    out.print(escape(describe(render(name, like, into, model_type=model_type))), soft_wrap=True)


def families(
    as_json: with_help(Json, "Machine-readable output.") = False,
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when a plugin is broken, two plugins claim one type, or $LOLLM_LOAD_PLUGINS names a distribution that is not an installed plugin."),
) -> None:
    """List the installed family plugins. No model code is imported; those $LOLLM_LOAD_PLUGINS leaves out are listed too."""
    # the diagnostic command tries again the plugins other commands skip as remembered hangs
    registry = get_registry(retry_hung=True)
    if as_json:
        print(json.dumps(show.families_json(registry), indent=2))
    else:
        show.families_table(registry)
    if strict and (registry.broken or registry.conflicts or registry.unmatched):
        raise typer.Exit(1)


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

    folder = locate(model) or Path(model)  # a path, or the name lollm list shows
    if folder.is_file() and folder.suffix == ".gguf":
        tokenizer = load_gguf_tokenizer(folder)  # built from the file's tokenizer.* metadata
    else:
        if not folder.exists() and looks_like_repo_id(model):
            folder = download_repo(model)
        tokenizer = load_tokenizer(folder)
    if think is not None and not chat:
        raise LollmError("--think/--no-think applies to the chat template: add --chat")
    if chat:
        from lollm.load.pipeline import template_flags

        flags = template_flags(tokenizer, think, model)
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


def inspect(
    model_arg: with_help(ModelArg, "A .gguf file, a safetensors checkpoint folder, or a name lollm list shows.") = None,
    tensors: bool = typer.Option(True, "--tensors/--no-tensors", help="Print the tensor table."),
    pattern: Optional[str] = typer.Option(None, "--filter", metavar="PATTERN", help="Only the tensors whose name holds PATTERN (attn_q), or, when it has * ? or [, matches it as a glob (blk.1.*); an error when none does."),
    as_json: with_help(Json, "Print everything as JSON (arrays summarized).") = False,
    model_opt: ModelOpt = None,
) -> None:
    """Show what is inside a checkpoint, without loading it. A summary (format, architecture, parameters, bytes, tensors per type), its metadata, then its tensors (name, shape, type, bytes) in natural order (blk.2 before blk.10)."""
    model, _ = which_model(model_opt, model_arg)
    inv = inspect_checkpoint(model)
    rows = inv.select(pattern)
    if as_json:
        print(json.dumps(show.inventory_json(inv, rows, pattern), indent=2, ensure_ascii=False))
        return
    show.inventory(inv, rows, pattern, tensors=tensors)


def list_(
    as_json: with_help(Json, "Machine-readable output (size in bytes).") = False,
) -> None:
    """List the models on this machine, by the name every command takes. They come from the Hugging Face cache and lollm's cache ($LOLLM_CACHE), each with the family that runs it."""
    rows = list_models()
    if as_json:
        print(rows_json(rows))
        return
    if not rows:
        from lollm.cli.real_models import cache_dir

        out.print(f"No model in the Hugging Face cache or in {escape(str(cache_dir()))}. "
                  f"Fetch one: lollm pull org/name (or org/name:Q4_K_M for a GGUF repo).")
        return
    show.models_table(rows)


def pull(
    spec: str = typer.Argument(..., metavar="REPO[:QUANT]", show_default=False,
                               help="A Hugging Face repo id (org/name), or org/name:QUANT for the one .gguf file of that quant."),
) -> None:
    """Download a model from the Hugging Face hub (it needs the hub). It goes into the Hugging Face cache, with huggingface_hub's progress bar; then its path and how to run it are printed."""
    path = fetch(spec)
    out.print(f"pulled {escape(spec)} to {escape(str(path))}", soft_wrap=True)
    out.print(f"run it: lollm run {escape(spec)} --prompt 'Hello'", soft_wrap=True)
