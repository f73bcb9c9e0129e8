"""``lollm trace`` end to end: open the model, tokenize the prompt, capture, compare, write the page.

::

    from lollm.cli.trace.run import run_trace
    result = run_trace("path/to/folder", prompt="The capital of France is", output="trace.html")
    result.trace.lens.top_ids[-1, -1]      # the model's own top 5 after the last token
    result.size                            # bytes written
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

import lollm
from lollm.load.options import LoadOptions
from lollm.errors import LollmError
from lollm.load.pipeline import LoadedModel, open_model, template_flags
from lollm.cli.trace.capture import Trace, capture, check_capture, compare
from lollm.cli.trace.page import check_output, write_page
from lollm.proof.parity_images import ImagePrompt, image_prompt, image_reference, refuse_gguf_images

# Lazy import below: lollm.proof.parity, only with --compare (it needs the parity extra's transformers).

#: The longest prompt a trace takes unless told otherwise: attention grows with T² per head.
MAX_TOKENS = 256


def model_label(spec: str | Path) -> str:
    """How the page names the model: a local checkpoint by its folder or file name (never its absolute
    path, which says where the user keeps files, not what ran), anything else (a Hub repo id) as given."""
    text = str(spec)
    if Path(text).expanduser().exists():
        return Path(text.rstrip("/\\")).expanduser().name or text
    return text


@dataclass
class TraceResult:
    trace: Trace
    path: Path
    size: int  # bytes of the page
    templated: bool  # True when the chat template wrapped the prompt


def prompt_ids(loaded: LoadedModel, prompt: str, *, system: str | None = None, chat: bool = True,
               think: bool | None = None) -> tuple[list[int], bool]:
    """The ids of ``prompt`` as ``lollm run`` builds them: through the chat template when the checkpoint has one.

    Returns (ids, templated). Raises LollmError for ``think`` when the chat template does
    not read ``enable_thinking`` (see :func:`lollm.load.pipeline.template_flags`), or for
    ``system`` without a template.
    """
    tokenizer = loaded.tokenizer
    if not chat or tokenizer.chat_template is None:
        if system:
            raise LollmError("--system needs the chat template; it cannot be used with --no-chat or a model without one")
        return tokenizer.encode(prompt), False
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    flags = template_flags(tokenizer, think, loaded.checkpoint.spec)
    return tokenizer.encode_chat(messages, add_generation_prompt=True, **flags), True


def reference_for(loaded: LoadedModel, pictured: ImagePrompt | None = None):
    """The parity gate's reference for this checkpoint (the family's own builder, else transformers).

    pictured: the prompt's images (``--image``): then transformers' whole ``*ForConditionalGeneration`` on
    the same pixels (:func:`lollm.proof.parity_images.image_reference`; LollmError for a GGUF).
    """
    from lollm.proof.parity import default_reference

    family = loaded.family.family
    if pictured is not None:
        build = functools.partial(image_reference, prompt=pictured)
    else:
        build = family.resolve("parity_reference") if family.parity_reference else default_reference
    try:
        return build(loaded.checkpoint, loaded.dtype)
    except ImportError as exc:
        raise LollmError(f"--compare needs transformers: pip install 'lollm-core[parity]' ({exc})") from None


#: What a trace loads with unless told otherwise: float32 float weights on the best device.
TRACE_OPTIONS = LoadOptions(dtype="float32")


def run_trace(spec: str, *, prompt: str, output: str | Path = "trace.html", system: str | None = None, chat: bool = True,
              think: bool | None = None, compare_reference: bool = False, options: LoadOptions = TRACE_OPTIONS,
              max_tokens: int = MAX_TOKENS, log: Callable[[str], None] = lambda line: None,
              images: Sequence[str] = (), mmproj: str | None = None) -> TraceResult:
    """Trace one forward pass of ``prompt`` through the model at ``spec`` and write the page to ``output``.

    compare_reference: also run the parity gate's reference (transformers) and store the
                       divergence of every hidden state (our model is freed first).
    options:           how the model loads (:class:`lollm.load.options.LoadOptions`: device, dtype, ``--family`` ...).
    max_tokens:        refuse longer prompts (the page keeps T² attention weights per head).
    log:               called with one progress line before each long step (loading, the forward pass,
                       the reference, writing the page); ``lollm trace`` prints them on stderr.
    images:            image files (``lollm trace --image``): the prompt gets them (lollm.proof.parity_images'
                       prompt), and the page draws each image's tokens and the attention they received
                       (:mod:`lollm.cli.trace.images`); with ``compare_reference``, the reference is
                       transformers' whole ``*ForConditionalGeneration`` on the same pixels (as ``lollm parity --image``).
    mmproj:            a GGUF model's vision tower file (llama.cpp's mmproj GGUF), for ``images``.
    Raises LollmError subclasses (bad checkpoint, an output path :func:`check_output` refuses, a prompt
    longer than ``max_tokens`` or the model's context or whose capture would not fit the memory free
    (:func:`lollm.cli.trace.capture.check_capture`): these before the capture; no transformers for a comparison).
    """
    output = check_output(output)  # before anything loads
    log(f"loading {model_label(spec)} with {options.dtype} weights (a packed GGUF is unpacked first) ...")
    loaded = open_model(spec, options)
    pictured = None
    if images:
        if compare_reference and loaded.checkpoint.fmt != "safetensors":
            refuse_gguf_images(model_label(spec), "lollm trace --image --compare")
        templated = chat and loaded.tokenizer.chat_template is not None
        if system and not templated:
            raise LollmError("--system needs the chat template; it cannot be used with --no-chat or a model without one")
        flags = template_flags(loaded.tokenizer, think, loaded.checkpoint.spec) if templated else {}
        pictured = image_prompt(loaded, list(images), prompt, chat=templated, model=model_label(spec), mmproj=mmproj,
                                system=system, template_flags=flags)
        ids = pictured.ids
    else:
        ids, templated = prompt_ids(loaded, prompt, system=system, chat=chat, think=think)
    check_capture(loaded.model, ids, max_tokens=max_tokens, device=loaded.device)
    log(f"forward pass: {len(ids)} tokens through the model, keeping every layer's attention and hidden states ...")
    trace = capture(loaded.model, ids, pieces=loaded.tokenizer.pieces, device=loaded.device,
                    images=pictured.images if pictured else None)
    if pictured is not None:
        from lollm.cli.trace.images import image_views

        trace.images = image_views(trace, pictured.images, list(pictured.pixels), pictured.spec)
    trace.meta = {
        "model": model_label(spec), "family": loaded.family.family.name, "format": loaded.checkpoint.fmt,
        "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device),
        "lollm_version": lollm.__version__,
        "prompt_note": "prompt wrapped in the chat template" if templated else "prompt used as raw text",
    }
    if compare_reference:
        required = 0.99999 if loaded.dtype == torch.float32 else 0.99
        model_dtype = loaded.dtype
        loaded.model = None  # one model in memory at a time, as in the parity gate
        gc.collect()
        log(f"reference: transformers on the same {len(ids)} tokens, to compare every hidden state ...")
        reference = reference_for(loaded, pictured)
        compare(trace, reference, required=required)
        del reference
        gc.collect()
        trace.meta["compared"] = f"transformers, {str(model_dtype).removeprefix('torch.')}"
    log(f"writing the page: {output} ...")
    size = write_page(trace, output)
    return TraceResult(trace, output, size, templated)
