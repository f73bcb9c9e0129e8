"""The text the ``lollm`` commands read: prompts from a flag, a file or stdin, bounded and checked before torch.

Every input (``--prompts-file``, ``tokenize --file``, a prompt or text piped on stdin)
holds at most :data:`MAX_INPUT_BYTES`, must be UTF-8, and a file must be a regular
file: a FIFO, a device or a folder is refused before a byte is read. Each error is a
LollmError naming the flag.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Any, Optional

from lollm.errors import LollmError

#: The most bytes one input may hold: a ``--prompts-file``, ``tokenize --file``, or a prompt or text piped on stdin.
MAX_INPUT_BYTES = 16 * 2**20


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def read_stdin(what: str) -> str:
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


def read_text_file(path: str, what: str) -> str:
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


def read_prompts(prompt: Optional[str], prompts_file: Optional[str]) -> list[str]:
    """The prompts of one ``run``: --prompt, the lines of --prompts-file, or stdin. Empty prompts are errors."""
    if prompt is not None and prompts_file is not None:
        raise LollmError("give --prompt or --prompts-file, not both")
    if prompts_file is not None:
        text = read_stdin("--prompts-file -") if prompts_file == "-" else read_text_file(prompts_file, "--prompts-file")
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
        prompt = read_stdin("--prompt").rstrip("\n")  # the newline that ends a piped line is not part of the prompt
        if not prompt:
            raise LollmError("the prompt read from stdin is empty: there is nothing to continue")
    if not prompt:
        raise LollmError("--prompt is empty: there is nothing to continue")
    return [prompt]


def read_tokenize_text(text: Optional[str], file: Optional[str]) -> str:
    """The text of ``tokenize``: the argument, --file, or stdin ('-' or no argument), read exactly as it is."""
    if file is not None:
        if text is not None:
            raise LollmError("give TEXT or --file, not both")
        return read_text_file(file, "--file")
    if text == "-" or text is None:
        return read_stdin("TEXT, --file FILE")
    return text


def messages(prompt: str, system: Optional[str]) -> list[dict[str, str]]:
    """The chat messages of one prompt: the system message (when given), then the user's."""
    turns = []
    if system:
        turns.append({"role": "system", "content": system})
    turns.append({"role": "user", "content": prompt})
    return turns


def encode_prompts(tokenizer: Any, prompts: list[str], *, system: Optional[str], no_chat: bool, parse_special: bool,
                   template_flags: dict[str, bool], note: Any) -> list[list[int]]:
    """The ids of each of ``run``'s prompts: through the chat template, or as raw text.

    Raw text with ``--no-chat``, or when the tokenizer has no chat template (then
    ``note`` is called with a line saying so). Raises LollmError when ``--system`` is
    given without a template to put it in.
    """
    if no_chat or tokenizer.chat_template is None:
        if not no_chat:
            note("note: the checkpoint has no chat template; using the prompt as raw text")
        if system:
            raise LollmError("--system needs the chat template; it cannot be used with --no-chat or a model without one")
        return [tokenizer.encode(p, parse_special=parse_special) for p in prompts]
    return [tokenizer.encode_chat(messages(p, system), add_generation_prompt=True, parse_special=parse_special,
                                  **template_flags) for p in prompts]


def read_images(paths: list[str], mmproj: Optional[str], *, prompts: int, family: Any, model: str) -> list[Any]:
    """The ``--image`` files, decoded and checked (lollm.vision.image: every hostile case refused), before the weights load.

    mmproj: the ``--mmproj`` file, which needs images and must exist (LollmError; its contents are read later).

    prompts: how many prompts the command got; images go with one prompt (LollmError otherwise).
    family: the checkpoint's :class:`lollm.family.Family`; one without vision (``Capabilities.vision``
    False) is an ImageError naming ``model``. Returns RGB PIL images, in the order given; ImageError
    naming the file for a refused image.
    """
    if mmproj is not None and not paths:
        raise LollmError("--mmproj holds a vision tower: it goes with --image")
    from lollm.cli.checks import check_mmproj_exists

    check_mmproj_exists(mmproj)
    if not paths:
        return []
    if prompts != 1:
        raise LollmError(f"--image goes with one prompt (-p), not with {prompts} prompts (--prompts-file)")
    from lollm.vision.image import read_image_file
    from lollm.vision.prompt import require_tower

    images = [read_image_file(path) for path in paths]
    if not family.capabilities.vision:
        require_tower(None, f"{model} (family {family.name})")
    return images


def image_prompt(loaded: Any, model: str, prompt: str, ids: list[int], images: list[Any], mmproj: Optional[str], *,
                 system: Optional[str], no_chat: bool, parse_special: bool,
                 template_flags: dict[str, bool]) -> tuple[list[int], Any]:
    """``run --image``: the prompt's ids with each image's placeholder tokens, and its ImageBatch (docs/vision.md).

    Without images: ``ids`` (the text prompt's, as encoded before) and None. ``mmproj``: the tower's
    own GGUF file for a GGUF model (:func:`lollm.vision.load.open_vision`).

    The family's placeholder (``<start_of_image>`` for Gemma 3) goes where the user wrote it, or once
    per image before the prompt's text when it wrote none; then the chat template (unless ``no_chat``),
    the expansion to the image's tokens, the tokenizer, the placement. Raises ImageError for a model
    without a vision tower (naming ``model``), placeholders that do not match, images the context cannot hold.
    """
    if not images:
        return ids, None
    from lollm.vision.load import open_vision, prepare_prompt
    from lollm.vision.prompt import require_tower

    tower = require_tower(open_vision(loaded, mmproj), model)
    placeholder = tower.spec.placeholder
    if placeholder not in prompt:
        prompt = " ".join([placeholder] * len(images) + [prompt])
    chat = not no_chat and loaded.tokenizer.chat_template is not None
    text = loaded.tokenizer.apply_chat_template(messages(prompt, system), **template_flags) if chat else prompt
    if not parse_special:
        raise LollmError("--image needs special tokens parsed (each image's placeholder tokens are special tokens): "
                         "drop --no-parse-special")
    ready = prepare_prompt(text, images, tower, loaded.tokenizer, model=model, max_context=loaded.model.max_context,
                           add_special_tokens=not chat)
    return ready.ids, ready.images
