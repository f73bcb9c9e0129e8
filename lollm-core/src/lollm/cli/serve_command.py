"""``lollm serve``: an OpenAI-compatible HTTP server over the batched engine."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Optional

import typer

from lollm.cli import report as show
from lollm.cli.checks import (check_ctx_size, check_draft_head, check_family, check_model_exists, check_port_free,
                              check_run_flags, check_serve_flags, open_for_command, require_extra)
from lollm.cli.options import (CtxSize, Device, DraftTokens, Dtype, Family, GroupSize, MinP, MmprojFile, ModelOpt, Mtp,
                               Quantize, RepetitionPenalty, Temperature, Think, Threads, TopK, TopP, Tp, Weights,
                               load_options, sampling_flags, with_help)
from lollm.cli.report import err
from lollm.errors import LollmError
from lollm.load.ranks import finish, is_leader, silence_followers

if TYPE_CHECKING:
    from lollm.serve.guard import GuardConfig
    from lollm.serve.models import ModelEntry, ServedModels

# Lazy imports below: lollm.load.pipeline, lollm.generate.conversation and lollm.serve.server import torch (and the
# serve extra), which waits until every flag is checked (a typo costs nothing).


#: The models of ``lollm serve``: one or more, each as a command takes its MODEL, or a folder of them.
ModelArgs = Annotated[Optional[list[str]], typer.Argument(
    metavar="MODEL", show_default=False,
    help="Checkpoint folder, .gguf file, Hugging Face repo id (or org/name:QUANT), or a folder of model folders and "
         ".gguf files; several: each request's \"model\" picks one (docs/serving.md, \"Several models\").")]


def serve(
    model_args: ModelArgs = None,
    family_name: Family = None,
    host: str = typer.Option("127.0.0.1", metavar="HOST", help="Address to listen on (0.0.0.0: every interface; think of --api-key)."),
    port: int = typer.Option(8000, metavar="PORT", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", metavar="KEY", help="Require 'Authorization: Bearer KEY' on every /v1 request."),
    model_name: Optional[str] = typer.Option(None, "--model-name", metavar="NAME", help="The model id clients send (default: MODEL's last part, without .gguf: qwen2.5-coder-0.5b-instruct for the name lollm list shows for the demo's model, or for its path)."),
    ctx_size: CtxSize = None,
    temperature: with_help(Temperature, "Default for requests that give none (then generation_config, then the family's).") = None,
    top_k: with_help(TopK, "Default top-k for requests.") = None,
    top_p: with_help(TopP, "Default top-p for requests.") = None,
    min_p: with_help(MinP, "Default min-p for requests.") = None,
    repetition_penalty: with_help(RepetitionPenalty, "Default repetition penalty.") = None,
    think: with_help(Think, "Default enable_thinking (a request's chat_template_kwargs wins).") = None,
    mtp: Mtp = False,
    draft_tokens: with_help(DraftTokens, "Tokens drafted per step with --mtp.") = 3,
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
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file", metavar="FILE", help="Read the API key from FILE (not shown in the process list, as --api-key is)."),
    shutdown_timeout: float = typer.Option(20.0, "--shutdown-timeout", metavar="SECONDS", help="On SIGTERM or Ctrl-C, running requests may go on this long; then streams end with finish_reason \"shutdown\", others get 503, and the server exits 0."),
    allowed_host: Optional[list[str]] = typer.Option(None, "--allowed-host", metavar="NAME", help="Also answer requests whose Host header is NAME (repeatable; '*': any). Localhost names and IP addresses are always allowed (docs/security.md)."),
    cors_origin: Optional[list[str]] = typer.Option(None, "--cors-origin", metavar="ORIGIN", help="Let web pages of ORIGIN (http://host:port) call the API from a browser (repeatable; default: none)."),
    memory_budget: Optional[float] = typer.Option(None, "--memory-budget", metavar="GB", help="With several models: at most GB gigabytes of weights loaded at once; the least recently used idle model is unloaded to make room (default: no budget)."),
    mmproj: with_help(MmprojFile, "The vision tower of a GGUF model: the mmproj GGUF file llama.cpp's convert_hf_to_gguf.py --mmproj writes (one model; in a folder of models an mmproj file beside its GGUF is paired with it: docs/serving.md, \"Images\"). A safetensors model carries its tower in its own files.") = None,
    model_opt: ModelOpt = None,
) -> None:
    """Serve one model or several over OpenAI- and Anthropic-compatible HTTP APIs, with a chat page for the browser. The page is at /, the API at /v1/chat/completions, /v1/completions, /v1/messages, /v1/responses and /v1/models."""
    specs = with_mmproj(model_specs(model_opt, model_args), mmproj)
    check_several(specs, tp=tp, mtp=mtp, model_name=model_name, memory_budget=memory_budget)
    user = sampling_flags(temperature, top_k, top_p, min_p, repetition_penalty)
    check_run_flags(max_new_tokens=None, seed=None, device=device, threads=threads, mtp=mtp, draft_tokens=draft_tokens,
                    sampling=user)
    check_ctx_size(ctx_size)
    check_serve_flags(port=port, max_running=max_running, kv_blocks=kv_blocks, max_batch_tokens=max_batch_tokens,
                      max_queue=max_queue)
    api_key, guard = access_flags(api_key, api_key_file, shutdown_timeout, host, allowed_host or [], cors_origin or [])
    require_extra("serve", "lollm serve")  # what needs no model, before it loads: the extra, the port
    if tp == 1 or "RANK" in os.environ:  # --tp without torchrun: its own error, next, names the launch line
        check_port_free(host, port)
    options = load_options("serve", device=device, dtype=dtype, weights=weights, quantize=quantize,
                           group_size=group_size, tp=tp, family=family_name, progress=True)

    from lollm.generate.conversation import DEFAULT_CONTEXT
    from lollm.serve.app import require_serve_extra
    from lollm.serve.models import ServedModels
    from lollm.serve.requests import body_limit

    check_family(options.family)
    require_serve_extra()
    for spec in specs:
        check_model_exists(spec.model)
    settings = dict(sampling_flags=user, draft_tokens=draft_tokens if mtp else 0, api_key=api_key,
                    max_running=max_running, kv_blocks=kv_blocks, max_batch_tokens=max_batch_tokens, max_queue=max_queue)

    def opened(spec: str):  # --tp: the other ranks wait for requests in a collective, far longer than torch's default
        return open_for_command(spec, options, threads=threads, think=think, mtp=mtp, tp_timeout=SERVE_TP_TIMEOUT)

    entries = [model_entry(model_name or served_name(spec.model), spec, opened, settings, ctx_size=ctx_size, first=i == 0)
               for i, spec in enumerate(specs)]
    largest = max(body_limit(ctx_size or DEFAULT_CONTEXT, entry.images) for entry in entries)  # each checks its own
    models = ServedModels(entries, budget_bytes=None if memory_budget is None else int(memory_budget * 1e9),
                          api_key=api_key, max_body_bytes=largest)
    label = banner_label(models.load_first().loaded, tp)  # no local keeps the first model: it may be unloaded
    serve_or_follow(models, host=host, port=port, label=label, shutdown_timeout=shutdown_timeout, guard=guard)


def banner_label(loaded, tp: int) -> str:
    """The banner's family and device (``"qwen2 on cpu"``, ``", --tp 2"`` under --tp)."""
    return f"{loaded.family.family.name} on {loaded.device}" + ("" if loaded.tp is None else f", --tp {tp}")


#: Bytes of one weight element in each dtype a model loads in (LoadOptions.dtype, resolved).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def served_name(spec: str) -> str:
    """The name clients send for the model ``spec``: its last part, without .gguf (``org/name`` -> ``name``)."""
    return Path(spec).stem if Path(spec).suffix == ".gguf" else Path(spec.rstrip("/")).name


@dataclass(frozen=True)
class ModelSpec:
    """One model of ``lollm serve``: what the user gave (or a file of a folder of models), and its tower's file.

    model:  a checkpoint folder, a .gguf file, a local name or a hub id (:func:`lollm.load.loader.load_checkpoint`).
    mmproj: a GGUF model's vision tower, llama.cpp's mmproj file (``--mmproj``, or paired in a folder), else None.
    """

    model: str
    mmproj: Optional[str] = None

    def __str__(self) -> str:
        return self.model


def model_specs(option: Optional[str], positionals: Optional[list[str]]) -> list[ModelSpec]:
    """The models given (``-m`` first, then the arguments), each folder of models replaced by the models it holds.

    A folder of models has no config.json of its own and holds model folders (with a config.json) or .gguf
    files, taken in name order; its mmproj files (vision towers, a name holding ``mmproj``) are not models but
    are paired with a GGUF model (:func:`pair_mmproj`). Raises typer.BadParameter when none is given or one is
    empty, LollmError for an mmproj file that pairs with no model.
    """
    given = ([option] if option is not None else []) + list(positionals or [])
    if not given:
        raise typer.BadParameter("missing; give the model as the first argument or with -m/--model",
                                 param_hint="MODEL (or -m/--model)")
    specs: list[ModelSpec] = []
    for spec in given:
        if not spec.strip():
            raise typer.BadParameter("empty", param_hint="MODEL (or -m/--model)")
        specs += models_in_folder(Path(spec).expanduser()) or [ModelSpec(spec)]
    return specs


def is_mmproj(path: Path) -> bool:
    """A vision tower's GGUF file rather than a model: its name holds ``mmproj``, as llama.cpp's converter names
    one (``--mmproj`` writes ``mmproj-NAME.gguf`` for ``--outfile NAME.gguf``) and its ``-hf`` download finds one."""
    return "mmproj" in path.name.lower()


def models_in_folder(folder: Path) -> list[ModelSpec]:
    """The models in ``folder`` when it is a folder of models (:func:`model_specs`), else []."""
    if not folder.is_dir() or (folder / "config.json").exists():
        return []
    inner = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "config.json").exists())
    ggufs = sorted(folder.glob("*.gguf"))
    files = [p for p in ggufs if not is_mmproj(p)]
    if not inner and not files:
        return []
    return [ModelSpec(str(p)) for p in inner] + pair_mmproj(folder, files, [p for p in ggufs if is_mmproj(p)])


def pair_mmproj(folder: Path, files: list[Path], projectors: list[Path]) -> list[ModelSpec]:
    """The GGUF models ``files`` of ``folder``, each with its mmproj file among ``projectors`` (or None).

    One GGUF model: the folder's one mmproj file is its tower, whatever its name (``mmproj-F16.gguf``);
    two mmproj files for it are refused, naming them. Several GGUF models: ``mmproj-NAME.gguf`` goes with
    ``NAME.gguf``, the name llama.cpp's converter writes; an mmproj file named otherwise is refused, naming
    it and the rule (never a guess at which model it fits). Raises LollmError.
    """
    if len(files) == 1 and projectors:
        if len(projectors) > 1:
            raise LollmError(f"{folder} holds {len(projectors)} mmproj files for {files[0].name} "
                             f"({', '.join(p.name for p in projectors)}): keep one there, or give one: "
                             f"lollm serve {files[0]} --mmproj FILE")
        return [ModelSpec(str(files[0]), str(projectors[0]))]
    towers: dict[Path, Path] = {}
    for projector in projectors:
        model = folder / projector.name[len("mmproj-"):]
        if not projector.name.startswith("mmproj-") or model not in files:
            raise LollmError(f"{projector}: in a folder of several GGUF models an mmproj file goes with the model "
                             f"of its name, mmproj-NAME.gguf with NAME.gguf (as llama.cpp's converter names it), and "
                             f"{folder} holds no {model.name if projector.name.startswith('mmproj-') else 'such file'} "
                             f"({', '.join(p.name for p in files)}): rename it, or serve its model alone with --mmproj")
        towers[model] = projector
    return [ModelSpec(str(p), str(towers[p]) if p in towers else None) for p in files]


def with_mmproj(specs: list[ModelSpec], mmproj: Optional[str]) -> list[ModelSpec]:
    """``specs`` with ``--mmproj FILE`` given to its one model; LollmError for several models (each folder's
    mmproj files are paired by name), a model already paired with one, or a FILE that is not a file."""
    if mmproj is None:
        return specs
    if len(specs) != 1:
        raise LollmError(f"--mmproj serves one model; {len(specs)} were given ({', '.join(map(str, specs[:4]))}"
                         f"{', ...' if len(specs) > 4 else ''}): in a folder of models, name each mmproj file "
                         "mmproj-NAME.gguf beside NAME.gguf, or serve one model at a time")
    if specs[0].mmproj is not None:
        raise LollmError(f"--mmproj {mmproj}: the folder's model {specs[0].model} has its mmproj file already, "
                         f"{specs[0].mmproj}; give one of them")
    if not Path(mmproj).expanduser().is_file():
        raise LollmError(f"--mmproj {mmproj}: no such file")
    return [ModelSpec(specs[0].model, str(Path(mmproj).expanduser()))]


def check_several(specs: list[ModelSpec], *, tp: int, mtp: bool, model_name: Optional[str],
                  memory_budget: Optional[float]) -> None:
    """The flags that take one model only (--tp, --mtp, --model-name), and --memory-budget's value."""
    if memory_budget is not None and not (0 < memory_budget < float("inf")):
        raise LollmError(f"--memory-budget must be a number of gigabytes > 0, got {memory_budget}")
    if len(specs) == 1:
        return
    for flag, given in (("--tp", tp != 1), ("--mtp", mtp), ("--model-name", model_name is not None)):
        if given:
            raise LollmError(f"{flag} serves one model; {len(specs)} were given ({', '.join(map(str, specs[:4]))}"
                             f"{', ...' if len(specs) > 4 else ''}): serve them without {flag}, or one at a time")


def model_entry(name: str, spec: ModelSpec, opened: Callable, settings: dict, *, ctx_size: Optional[int],
                first: bool) -> ModelEntry:
    """The :class:`lollm.serve.models.ModelEntry` of ``spec``: its checkpoint opened now (configs, tokenizer, tensor
    table: the weights' size), its weights loaded by the entry's ``load`` (at start for the first, else on first use).

    A model other than the first that cannot be opened (or whose mmproj file cannot go with it) is served as a
    failed one: its requests get the error.
    """
    from lollm.generate.conversation import DEFAULT_CONTEXT
    from lollm.load.pipeline import open_model
    from lollm.serve.images import reads_images
    from lollm.serve.model_server import ModelServer
    from lollm.serve.models import ModelEntry, weight_bytes

    try:
        prepared = opened(spec.model)
        check_mmproj(prepared, spec)
    except LollmError as error:
        if first:
            raise
        err.print(f"[yellow]{name}: {error}; its requests get this error, the other models are served[/yellow]")
        return ModelEntry(name, spec.model, 0, load=None, error=str(error))

    def load() -> ModelServer:
        loaded = open_model(prepared.checkpoint, prepared.options)
        silence_followers(loaded.tp, err)
        show.weights_summary(loaded)
        check_draft_head(loaded, spec.model, settings["draft_tokens"] > 0)
        return ModelServer(loaded, name=name, context=ctx_size or min(DEFAULT_CONTEXT, loaded.model.max_context),
                           template_flags=prepared.template_flags, mmproj=spec.mmproj, **settings)

    quantization = prepared.options.quantization
    size = weight_bytes(prepared.checkpoint.weights, DTYPE_BYTES.get(prepared.options.dtype, 4),
                        packed=quantization is not None and quantization.mode == "gguf", quantization=quantization)
    return ModelEntry(name, spec.model, size, load=load, images=reads_images(prepared.family.family,
                                                                             prepared.checkpoint, spec.mmproj),
                      has_template=lambda: prepared.checkpoint.tokenizer.chat_template is not None)


def check_mmproj(prepared, spec: ModelSpec) -> None:
    """An mmproj file goes with a GGUF model of a family that reads images: else LollmError naming both, before
    any weight loads (its tensors are read on the first image request, lollm.vision.load.open_vision)."""
    if spec.mmproj is None:
        return
    family = prepared.family.family
    if prepared.checkpoint.fmt != "gguf":
        raise LollmError(f"--mmproj {spec.mmproj}: an mmproj file goes with a GGUF model; {spec.model} is "
                         f"{prepared.checkpoint.fmt}, whose own files hold the tower")
    if not family.capabilities.vision:
        raise LollmError(f"mmproj {spec.mmproj}: the family {family.name} of {spec.model} reads no images "
                         "(it declares no vision tower, docs/plugins.md)")


def serve_or_follow(models: ServedModels, *, host: str, port: int, label: str, shutdown_timeout: float,
                    guard: GuardConfig) -> None:
    """Rank 0 (or the only process) serves HTTP until it is stopped; under --tp (one model) the other ranks follow its jobs."""
    from lollm.serve.app import serve as run_server

    server = models.load_first()
    tp = server.loaded.tp
    if not is_leader(tp):
        server.follow()  # every generation rank 0 runs, until rank 0 stops
        finish(tp)
        return
    if tp is None:
        server = None  # only --tp needs it below; held here, an unloaded first model could never be freed
    try:  # the banner (URL, model, family, context, a curl line, the chat page) comes once it listens
        served = models if len(models.entries) > 1 else models.first.server  # one model: as a one-model server always was
        signalled = run_server(served, host=host, port=port, family=label, shutdown_timeout=shutdown_timeout, guard=guard)
    finally:
        if tp is not None and server.stop_followers():
            finish(tp)
    if signalled is not True:
        return
    # Stopped by a signal and every request answered: exit 0 now. The interpreter's own teardown of the model
    # takes 1 to 2 s more on a busy CPU, past the "deadline + 2 s" a shutdown promises; nothing is left to save.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


#: Seconds a --tp rank of `lollm serve` may wait in a collective for rank 0's next request (a week).
SERVE_TP_TIMEOUT = 7 * 24 * 3600.0


def access_flags(api_key: Optional[str], api_key_file: Optional[Path], shutdown_timeout: float, host: str,
                 allowed_host: list[str], cors_origin: list[str]) -> tuple[Optional[str], GuardConfig]:
    """The key (--api-key or --api-key-file) and who may call (lollm.serve.guard), checked before the model loads."""
    from lollm.serve.guard import GuardConfig, check_cors_origin, read_api_key_file

    if api_key is not None and api_key_file is not None:
        raise LollmError("give --api-key or --api-key-file, not both")
    if api_key is not None and not api_key.strip():
        raise LollmError("--api-key is empty: give a key, or leave the flag out")
    if not (shutdown_timeout >= 0 and shutdown_timeout < float("inf")):
        raise LollmError(f"--shutdown-timeout must be a number of seconds >= 0, got {shutdown_timeout}")
    for name in allowed_host:
        if not name.strip() or "/" in name:
            raise LollmError(f"--allowed-host {name!r}: give a host name as a Host header carries it (no scheme, no path)")
    key = read_api_key_file(api_key_file) if api_key_file is not None else api_key
    guard = GuardConfig(bound=host, allowed_hosts=tuple(h.strip().lower() for h in allowed_host),
                        cors_origins=tuple(check_cors_origin(o) for o in cors_origin))
    return key, guard
