"""The checks the ``lollm`` commands make before the weights load, each error a LollmError naming its flag.

Two stages, in the order a command runs them:

1. before torch is imported or the checkpoint read (a typo costs nothing):
   :func:`check_run_flags` (it calls :func:`lollm.load.options.check_threads`), :func:`check_ctx_size`,
   :func:`check_attn`, :func:`check_family`, :func:`check_model_exists`, and what needs no model at all:
   :func:`require_extra` (the optional extras a command imports), :func:`check_port_free` (``serve``);
2. with the checkpoint open (configs, tokenizer, tensor table) and its family routed,
   before the weights stream in: :func:`open_for_command` (it takes the command's
   :class:`lollm.load.options.LoadOptions` and returns them resolved: device, dtype, attention backend,
   quantization and family, each decided once); and once loaded, :func:`check_draft_head`.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from lollm.cli.report import err, plugin_warnings
from lollm.errors import CheckpointError, GenerationError, LollmError
from lollm.load.hub import check_fetchable
from lollm.load.loader import looks_like_repo_id
from lollm.load.local_names import locate, unknown_model
from lollm.load.options import DEVICE_PATTERN, LoadOptions, check_threads
from lollm.load.plugins import get_registry
from lollm.sampling_params import check_sampling_value, check_seed

if TYPE_CHECKING:  # pragma: no cover - names for the annotations only (lollm.load.pipeline imports torch)
    from lollm.load.pipeline import LoadedModel, Prepared

# Lazy imports below: lollm.attention and lollm.load.pipeline import torch, and these checks run before torch is
# imported (a typo costs nothing); they are imported where a check needs them.

__all__ = ["check_attn", "check_ctx_size", "check_draft_head", "check_family", "check_model_exists", "check_port_free",
           "check_run_flags", "check_serve_flags", "open_for_command", "require_extra"]

#: The optional extras of lollm-core, each with the modules of it that a command imports.
EXTRAS = {"serve": ("starlette", "uvicorn"), "chat": ("prompt_toolkit",), "parity": ("transformers",)}


def check_run_flags(*, max_new_tokens: Optional[int], seed: Optional[int], device: str, threads: Optional[int], mtp: bool,
                    draft_tokens: int, sampling: dict[str, float | int | None]) -> None:
    """The flags of ``run``, ``chat`` and ``serve``, checked before torch is imported; each error names its flag."""
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
    if not DEVICE_PATTERN.match(device):
        raise LollmError(f"unknown device {device!r} (use auto, cpu, cuda, cuda:N or mps)")
    check_threads(threads)
    if mtp and draft_tokens < 1:
        raise LollmError(f"--draft-tokens must be >= 1, got {draft_tokens}")


def check_ctx_size(ctx_size: Optional[int]) -> None:
    """``--ctx-size``: None (the default) or at least 2 positions (a prompt token and one to generate).

    A value above the model's context is lowered to it (as the help says); 0 or
    a negative number is an error naming the flag, never a silent default.
    """
    if ctx_size is not None and ctx_size < 2:
        raise LollmError(f"--ctx-size must be at least 2 positions (a prompt token and one generated), got {ctx_size}; "
                         f"leave it out for the default (4096, at most the model's context)")


def check_serve_flags(*, port: int, max_running: int, kv_blocks: Optional[int], max_batch_tokens: int,
                      max_queue: int) -> None:
    """``lollm serve``'s port and engine sizes, before the model loads (not a traceback from the socket after it)."""
    if not 0 <= port <= 65535:
        raise LollmError(f"--port must be a TCP port from 0 to 65535, got {port}")
    for flag, value in (("--max-running", max_running), ("--kv-blocks", kv_blocks),
                        ("--max-batch-tokens", max_batch_tokens), ("--max-queue", max_queue)):
        if value is not None and value < 1:
            raise LollmError(f"{flag} must be >= 1, got {value}")


def check_port_free(host: str, port: int) -> None:
    """``lollm serve``: the address must be free now, before the model loads (one error line, not uvicorn's after it).

    Binds ``(host, port)`` as uvicorn will (``SO_REUSEADDR``) and lets go at once. Port 0 (any free port)
    and the ranks of ``--tp`` other than 0 (``$RANK``; they serve no HTTP) are not checked. Raises
    LollmError naming the address when it is in use, or cannot be bound (an address not of this machine).
    """
    if port == 0 or os.environ.get("RANK", "0") != "0":
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise LollmError(f"--host {host}: cannot be resolved to an address ({exc.strerror or exc})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LollmError(f"--port {port}: {host}:{port} is already in use (another lollm serve?); stop what "
                                 f"listens there or give another --port") from None
            raise LollmError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None


def require_extra(extra: str, command: str) -> None:
    """LollmError naming ``extra`` and its pip line when one of its modules is not installed (nothing is imported).

    ``command`` is what needs it, for the message (``lollm chat``, ``--compare``).
    """
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise LollmError(f"{command} needs the {extra} extra ({module} is missing): pip install 'lollm-core[{extra}]'")


def check_attn(options: LoadOptions) -> None:
    """The name of the backend given by --attn or $LOLLM_ATTN, checked before the model is looked for
    (lollm.attention imports torch: only when one is named). The backend is chosen once, with the
    device, by :func:`lollm.load.pipeline.prepare`."""
    if options.attn is not None or os.environ.get("LOLLM_ATTN"):
        from lollm.attention import check_backend_name

        check_backend_name(options.attn)


def check_family(family: Optional[str]) -> None:
    """The plugins, before the model is looked for: ``$LOLLM_LOAD_PLUGINS`` warnings on stderr, and a
    ``--family`` name that no installed family has (the registry imports no torch and no model code)."""
    registry = get_registry()
    plugin_warnings(registry)
    if family is not None:
        registry.family_named(family)


def check_model_exists(spec: str) -> None:
    """A path that does not exist, and is not a local model's name either, is an error now, before torch is imported.

    The names are those ``lollm list`` shows (:mod:`lollm.load.local_names`); a hub id must be cached or the
    hub must answer (:func:`lollm.load.hub.check_fetchable`: under a second, one error line otherwise).
    """
    if locate(spec) is not None:
        return
    repo, colon, quant = spec.partition(":")
    if colon and Path(repo).expanduser().is_file():
        raise CheckpointError(f"{repo} is a local file: ':{quant}' only picks a .gguf file of a Hugging Face repo; give the file alone")
    if looks_like_repo_id(spec):
        check_fetchable(spec)  # cached, or the hub answers: else one error line now, not after torch loads
        return
    if colon and quant and looks_like_repo_id(repo):
        check_fetchable(repo, quant)
        return
    raise unknown_model(spec)


def check_mmproj_exists(mmproj: Optional[str]) -> None:
    """``--mmproj FILE`` names a file (LollmError naming the flag otherwise), checked before torch is imported.

    What the file holds is read with the model (:func:`lollm.vision.load.open_vision`).
    """
    if mmproj is not None and not Path(mmproj).expanduser().is_file():
        raise LollmError(f"--mmproj {mmproj}: no such file (the mmproj GGUF of llama.cpp's convert_hf_to_gguf.py "
                         "--mmproj, which holds a GGUF model's vision tower)")


def open_for_command(model: str, options: LoadOptions, *, threads: Optional[int], think: Optional[bool], mtp: bool,
                     tp_timeout: Optional[float] = None) -> Prepared:
    """Step 2 of ``run``, ``chat`` and ``serve``: :func:`lollm.load.pipeline.open_checkpoint`, its advice on the
    threads printed dim on stderr.

    Returns the :class:`lollm.load.pipeline.Prepared` record: the checkpoint, its family, the template flags
    of ``--think``, and the resolved options (device, dtype, attention backend, quantization, family) that
    ``open_model`` takes as they are. Raises LollmError naming the flag.
    """
    from lollm.load.pipeline import open_checkpoint

    return open_checkpoint(model, options, threads=threads, think=think, mtp=mtp, tp_timeout=tp_timeout,
                           note=lambda line: err.print(f"[dim]{line}[/dim]", soft_wrap=True))


def check_draft_head(loaded: LoadedModel, model: str, mtp: bool) -> None:
    """``--mtp`` on a loaded model without draft-head tensors is an error naming the checkpoint."""
    if mtp and not getattr(loaded.model, "has_draft_head", False):
        raise LollmError(f"--mtp: the checkpoint {model} carries no draft-head tensors (mtp.*), so it cannot draft")
