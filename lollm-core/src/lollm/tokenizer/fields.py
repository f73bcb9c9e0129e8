"""A tokenizer's files read within bounds, and each JSON field checked for its type.

Every failure is a :class:`~lollm.errors.TokenizerError` naming the file (and the key inside it);
:mod:`lollm.tokenizer.loading` reads through these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lollm.errors import TokenizerError
from lollm.files import MAX_JSON_BYTES, MAX_TOKENIZER_JSON_BYTES, is_present, read_file, read_json

#: The files that hold a whole vocabulary may be large (lollm.files.MAX_TOKENIZER_JSON_BYTES);
#: every other tokenizer file is held to lollm.files.MAX_JSON_BYTES.
_LARGE_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")


def max_bytes_for(path: Path) -> int:
    """The most bytes lollm reads of the tokenizer file ``path``: a vocabulary file's limit, or the JSON one."""
    return MAX_TOKENIZER_JSON_BYTES if path.name in _LARGE_FILES else MAX_JSON_BYTES


def file_present(path: Path) -> bool:
    """A tokenizer file is there (a regular file, links followed); absent: False; a folder, FIFO,
    device or broken link in its place: TokenizerError naming it (never silently skipped)."""
    return is_present(path, error=TokenizerError)


def read_json_object(path: Path) -> dict:
    """Parse a JSON file whose top level must be an object; every failure is a TokenizerError naming the file."""
    return read_json(path, what="tokenizer file", error=TokenizerError, max_bytes=max_bytes_for(path))


def read_text(path: Path) -> str:
    """The whole text file ``path`` (within :func:`max_bytes_for`); TokenizerError when it is not UTF-8."""
    data = read_file(path, max_bytes=max_bytes_for(path), what="tokenizer file", error=TokenizerError)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerError(f"{path} is not UTF-8 text") from None


#: How an error names the JSON type a key must have.
_KIND_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "true or false"}


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)


def _json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (what the file's author wrote)."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


def require_field(mapping: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``mapping[key]``, checked to be of type ``kind``; ``where`` names the file (and path inside it)."""
    if key not in mapping:
        raise TokenizerError(f"{where}: missing key {key!r}")
    return optional_field(mapping, key, kind, where, required=True)


def optional_field(mapping: dict, key: str, kind: type | tuple[type, ...], where: str, default: Any = None,
                   *, required: bool = False) -> Any:
    """``mapping[key]`` checked to be of type ``kind`` (a boolean is never an int); ``default`` when
    the key is absent or null (unless ``required``). TokenizerError names ``where``, the key and both types."""
    value = mapping.get(key)
    if value is None and not required:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise TokenizerError(f"{where}: {key!r} must be {_kind_name(kind)}, not {_json_type(value)}")
    return value
