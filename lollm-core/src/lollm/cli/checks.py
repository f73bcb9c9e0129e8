"""The checks the ``lollm`` commands make before the weights load, each error a LollmError naming its flag.

Two stages, in the order a command runs them:

1. before torch is imported or the checkpoint read (a typo costs nothing):
   :func:`check_run_flags`, :func:`check_threads`, :func:`check_ctx_size`,
   :func:`check_attn`, :func:`check_family`, :func:`check_model_exists`;
2. with the checkpoint open (configs, tokenizer, tensor table) and its family routed,
   before the weights stream in: :func:`open_checkpoint` (it takes the command's
   :class:`lollm.load.options.LoadOptions`); and once loaded, :func:`check_draft_head`.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from lollm.errors import LollmError
from lollm.load.options import LoadOptions

_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def check_run_flags(*, max_new_tokens: Optional[int], seed: Optional[int], device: str, threads: Optional[int], mtp: bool,
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
    check_threads(threads)
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


def check_threads(threads: Optional[int]) -> None:
    """``--threads`` between 1 and :func:`threads_limit`, before torch sees it; LollmError naming the flag otherwise."""
    if threads is None:
        return
    if threads < 1:
        raise LollmError(f"--threads must be >= 1, got {threads}")
    limit = threads_limit()
    if threads > limit:
        raise LollmError(f"--threads {threads} is more than lollm allows here: at most {limit} ({THREADS_PER_CORE} per "
                         f"core, {limit // THREADS_PER_CORE} cores); leave it out for torch's default (one per core)")


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


def check_attn(options: LoadOptions) -> None:
    """The backend named by --attn or $LOLLM_ATTN, checked before the model is looked for (lollm.attention
    imports torch: only when one is named; its device check comes again in :func:`open_checkpoint`)."""
    if options.attn is not None or os.environ.get("LOLLM_ATTN"):
        from lollm.attention import resolve_backend

        resolve_backend(options.attn)


def check_family(family: Optional[str]) -> None:
    """The plugins, before the model is looked for: ``$LOLLM_LOAD_PLUGINS`` warnings on stderr, and a
    ``--family`` name that no installed family has (the registry imports no torch and no model code)."""
    from lollm.cli.report import plugin_warnings
    from lollm.load.plugins import get_registry

    registry = get_registry()
    plugin_warnings(registry)
    if family is not None:
        registry.family_named(family)


def check_model_exists(spec: str) -> None:
    """A local path that does not exist is an error now, before torch is imported (hub ids are checked when fetched)."""
    from lollm.errors import CheckpointError
    from lollm.load.loader import _looks_like_repo_id

    if Path(spec).expanduser().exists():
        return
    repo, colon, quant = spec.partition(":")
    if colon and Path(repo).expanduser().is_file():
        raise CheckpointError(f"{repo} is a local file: ':{quant}' only picks a .gguf file of a Hugging Face repo; give the file alone")
    if _looks_like_repo_id(spec) or (colon and quant and _looks_like_repo_id(repo)):
        return
    raise CheckpointError(
        f"{spec}: no such file or folder, and not a Hugging Face repo id of the form 'org/name' (or 'org/name:QUANT' for GGUF)"
    )


def open_checkpoint(model: str, options: LoadOptions, *, threads: Optional[int], think: Optional[bool],
                    mtp: bool) -> tuple[Any, Any, dict[str, bool]]:
    """Step 2 of ``run``, ``chat`` and ``serve``: the checkpoint (configs, tokenizer, tensor table) and its family,
    with every check that needs them, before the weights load.

    Sets torch's thread count (``--threads``, else the cores free now: :mod:`lollm.load.threads`, with a
    one-line note on a terminal's stderr when the machine is busy), checks the attention backend (``options.attn``) on
    ``options.device`` and the ``--weights``/``--quantize``/``--group-size`` flags against
    the checkpoint's format (lollm.load.pipeline.pick_quantization), routes the checkpoint
    (``options.family``: by that name), and decides ``--think`` from the chat template
    itself. Returns ``(checkpoint, family, template_flags)``; raises LollmError naming the flag.
    """
    from lollm.attention import resolve_backend
    from lollm.generate.conversation import thinking_flags
    from lollm.load.loader import load_checkpoint
    from lollm.load.pipeline import pick_device, pick_quantization, route

    from lollm.cli.report import err
    from lollm.load.threads import apply_threads

    note = apply_threads(threads).note
    if note is not None and sys.stderr.isatty():  # advice for a person at a terminal, not a line in a log or a pipe
        err.print(f"[dim]{note}[/dim]", soft_wrap=True)
    device = pick_device(options.device)
    resolve_backend(options.attn, device)
    checkpoint = load_checkpoint(model)
    pick_quantization(options, checkpoint.fmt, device)
    family = route(checkpoint, options.family).family
    if mtp and not family.capabilities.speculative_head:
        raise LollmError(f"--mtp: the family {family.name!r} has no speculative (MTP) head")
    template_flags = thinking_flags(checkpoint.tokenizer, think, model)  # decided from the chat template itself
    return checkpoint, family, template_flags


def check_draft_head(loaded: Any, model: str, mtp: bool) -> None:
    """``--mtp`` on a loaded model without draft-head tensors is an error naming the checkpoint."""
    if mtp and not getattr(loaded.model, "has_draft_head", False):
        raise LollmError(f"--mtp: the checkpoint {model} carries no draft-head tensors (mtp.*), so it cannot draft")
