"""Bounded reads of untrusted files: the one way lollm opens a checkpoint's JSON and tokenizer files.

Every file a checkpoint carries is untrusted (docs/security-checkpoints.md): it may be a folder, a
FIFO, a device, a broken link, far too big, not UTF-8, or JSON nested deep enough to overflow a
parser. :func:`read_file` and :func:`read_json` refuse each of these with an error naming the file;
:func:`is_present` says whether a regular file is there. The loader (:mod:`lollm.load.loader`) and
the tokenizer files (:mod:`lollm.tokenizer.loading`) both read through here.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from lollm.errors import CheckpointError, LollmError


#: The largest JSON file lollm reads from a checkpoint: config.json, generation_config.json,
#: the shard index, tokenizer_config.json ... (the largest real ones are well under 1 MiB).
MAX_JSON_BYTES = 16 * 2**20
#: tokenizer.json and vocab.json hold the whole vocabulary (about 35 MB for 262k tokens).
MAX_TOKENIZER_JSON_BYTES = 256 * 2**20
#: How deeply objects and arrays may nest in a JSON file (real ones: under 10 levels).
MAX_JSON_DEPTH = 64


def is_present(path: Path, *, error: type[LollmError] = CheckpointError) -> bool:
    """Whether a checkpoint file is there: True for a regular file (links are followed: the
    Hugging Face cache is made of links), False when nothing is there; ``error`` naming the path
    when something else is (a folder, a FIFO, a device such as /dev/zero, a broken link)."""
    if "\0" in str(path):
        raise error(f"{str(path)!r} is not a usable file name: it holds a NUL character")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise error(f"{path} is a broken link") from None
        return False
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{path} is {_kind(mode)}, not a regular file; lollm reads checkpoint files only from regular files")
    return True


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_file(path: Path, *, max_bytes: int, what: str = "file", error: type[LollmError] = CheckpointError) -> bytes:
    """The bytes of ``path``: a regular file (links followed) of at most ``max_bytes`` bytes.

    The file is opened without blocking and checked on the open descriptor, so a FIFO or a
    device put in the place of a checkpoint file is refused, never waited on or read forever.
    Raises ``error`` naming the path when it is missing, not a regular file, or too big.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{what}: {path} does not exist") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError:  # a NUL in the path
        raise error(f"{what}: {str(path)!r} is not a usable file name (it holds a NUL character)") from None
    # Checked on the bare descriptor: Python refuses to wrap a folder's descriptor in a file object.
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise error(f"{path} is {_kind(info.st_mode)}, not a regular file; lollm reads checkpoint files only from regular files")
    if info.st_size > max_bytes:
        os.close(fd)
        raise error(f"{path} is {info.st_size:,} bytes; lollm reads at most {max_bytes:,} bytes from such a file")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:  # it grew while we read it
        raise error(f"{path} is more than {max_bytes:,} bytes; lollm reads at most that much from such a file")
    return data


def _json_depth(value: Any) -> int:
    """How deeply objects and arrays nest in ``value`` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def read_json(
    path: Path, *, what: str, error: type[LollmError] = CheckpointError, max_bytes: int = MAX_JSON_BYTES
) -> dict[str, Any]:
    """Read a JSON object from ``path``; ``error`` (CheckpointError by default) naming the file when it
    is missing, not a regular file, larger than ``max_bytes``, not UTF-8, not valid JSON, nested
    deeper than :data:`MAX_JSON_DEPTH`, or not an object at the top level."""
    data = read_file(path, max_bytes=max_bytes, what=what, error=error)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text: {exc}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise error(f"{path}: its JSON nests too deeply to read (more than {MAX_JSON_DEPTH} levels are refused)") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object at the top level, found {type(value).__name__}")
    if _json_depth(value) > MAX_JSON_DEPTH:
        raise error(f"{path}: its JSON nests more than {MAX_JSON_DEPTH} levels deep; a {what} never does")
    return value
