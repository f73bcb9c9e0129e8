"""The loader: turn a model spec into a :class:`Checkpoint`.

The loader is deliberately dumb. It finds the files, reads config.json and
generation_config.json as plain dicts, and exposes the weights *keyed by the
file's own tensor names*; it never renames a tensor and knows nothing about
any architecture. The family that serves the checkpoint owns the name map.

Specs it understands, tried in this order:
  * a local folder holding ``config.json`` and ``model.safetensors`` (or shards
    listed in ``model.safetensors.index.json``);
  * a local ``.gguf`` file (read by :mod:`lollm.gguf`; the metadata plays the
    part of config.json and the tokenizer is built from it);
  * the name ``lollm list`` shows for a model already on this machine
    (:mod:`lollm.load.local_names`: ``qwen2.5-coder-0.5b-instruct`` for the demo's GGUF);
  * a Hugging Face repo id ``org/name`` (:mod:`lollm.load.hub`: the local cache
    first, then one quick check that the hub answers; ``HF_HUB_OFFLINE=1`` is honoured);
  * ``org/name:QUANT`` for a GGUF repo on the hub: the one ``.gguf`` file whose
    name carries that quant type (``Q4_K_M``) is fetched; none or several raise
    and list the files there.

Pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) are refused:
unpickling runs arbitrary code. Remote code (``auto_map``) is never run.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lollm.errors import CheckpointError, ConfigError
from lollm.files import is_present, read_json
# Moved to lollm.files; still importable from here until lollm-core 0.3 (docs/plugins.md, 10).
from lollm.files import MAX_JSON_BYTES, MAX_JSON_DEPTH, MAX_TOKENIZER_JSON_BYTES, read_file  # noqa: F401
# The hub's side of a spec (the cache first, one quick probe, then the download) lives in lollm.load.hub.
from lollm.load.hub import HUB_ALLOW_PATTERNS, SPLIT_GGUF, download_repo, hub_gguf_file  # noqa: F401
from lollm.load.local_names import resolve_local, unknown_model

# Lazy imports below: torch, safetensors, huggingface_hub, the tokenizer and the GGUF reader are imported
# where they are used, so that naming a checkpoint (and the CLI's checks of a spec) stays torch-free and fast.
if TYPE_CHECKING:  # pragma: no cover
    import torch

    from lollm.tokenizer import Tokenizer

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


#: safetensors' own bound on the JSON header of a file (its ``MAX_HEADER_SIZE``), in bytes.
MAX_SAFETENSORS_HEADER = 100_000_000
#: safetensors' dtype names -> the torch dtype of the same bytes (little-endian, as the format stores them).
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}


def _safetensors_header(path: Path) -> tuple[int, list[tuple[str, Any]]] | None:
    """Where the data of a safetensors file starts and its header as ``(key, value)`` pairs, in file order.

    The format (safetensors' README): 8 bytes, a little-endian u64 ``N``; ``N`` bytes of JSON, an
    object ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``; then
    the data, which the offsets index from its start. Objects come back as lists of pairs so that
    a name written twice is still seen (a dict, and safetensors' own parser, keep only the last).
    None when the header is not even that shape: safetensors' own check then says what is wrong.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            size = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 <= size <= MAX_SAFETENSORS_HEADER:
                return None
            text = f.read(size)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        pairs = json.loads(text, object_pairs_hook=list) if len(text) == size else None
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past Python's stack
        return None
    return (8 + size, pairs) if isinstance(pairs, list) else None


def _refuse_duplicates(path: Path, pairs: list) -> None:
    """CheckpointError naming a tensor the header lists twice.

    safetensors keeps the last entry of a name and then reports "incomplete metadata" (or an
    "invalid offset"), since the bytes of the first one belong to no tensor; the fault is the repetition.
    """
    seen: set[str] = set()
    for item in pairs:
        if isinstance(item, tuple):  # a (key, value) pair of the top-level object
            if item[0] in seen:
                raise CheckpointError(
                    f"{path}: the header lists the tensor {item[0]!r} twice; a safetensors file names each tensor once"
                )
            seen.add(item[0])


def _tensor_table(pairs: list[tuple[str, Any]]) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """``{name: (dtype, shape, begin, end)}`` from a header the safetensors library has validated."""
    table = {}
    for name, info in pairs:
        if name != "__metadata__":
            info = dict(info)
            begin, end = info["data_offsets"]
            table[name] = (info["dtype"], tuple(info["shape"]), begin, end)
    return table


class TensorSource:
    """Read-only access to the tensors of a safetensors checkpoint, by their names in the file.

    Nothing is read at construction but the headers (names, shapes, dtypes, offsets), each parsed
    once and validated once by the safetensors library. :meth:`read` and :meth:`read_slice` then
    copy a tensor's bytes straight from its offsets into a new CPU tensor, so one read costs the
    tensor's size and never a pass over the header again. (Opening a file through
    ``safetensors.safe_open`` parses its whole header; opened again for every read, a file of n
    tensors took time in n squared to read: 4,000 tensors 10 s of CPU, now 0.03 s.)
    No memory map stays open while a model is built, so the peak stays near one model copy.
    The bytes are read as little-endian, the format's order (every platform torch ships for).
    """

    fmt = "safetensors"

    def __init__(self, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self._where: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, str] = {}
        self._span: dict[str, tuple[int, int]] = {}  # absolute byte offsets of the data in its file
        for path in files:
            header = _safetensors_header(path)
            if header is not None:
                _refuse_duplicates(path, header[1])
            try:
                with safe_open(str(path), framework="pt"):
                    pass  # the library's check of the header: dtypes, shapes, offsets that tile the data
            except SafetensorError as exc:
                raise CheckpointError(f"{path}: not a valid safetensors file (truncated or corrupted?): {exc}") from None
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read: {exc}") from None
            if header is None:  # safetensors read a header we could not: never expected
                raise CheckpointError(f"{path}: its safetensors header could not be read")
            table = _tensor_table(header[1])
            for name in sorted(table):  # safetensors' own order (its keys() sorts them)
                if name in self._where:
                    raise CheckpointError(f"tensor {name!r} appears in both {self._where[name]} and {path}")
                dtype, shape, begin, end = table[name]
                self._where[name], self._shape[name], self._dtype[name] = path, shape, dtype
                self._span[name] = (header[0] + begin, header[0] + end)

    def names(self) -> list[str]:
        """All tensor names: each file's sorted, the files in order."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape[name]

    def dtype(self, name: str) -> str:
        """The dtype as the file stores it (safetensors names: ``F32``, ``BF16``, ``F16``, ``I64`` …)."""
        return self._dtype[name]

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def _torch_dtype(self, name: str) -> "torch.dtype":
        import torch

        if name not in self._where:
            raise CheckpointError(f"no tensor named {name!r} in the checkpoint")
        dtype = getattr(torch, SAFETENSORS_DTYPES.get(self._dtype[name], ""), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{self._where[name]}: tensor {name!r} is stored as {self._dtype[name]}, a type lollm does not read")
        return dtype

    def _read_spans(self, name: str, spans: list[tuple[int, int]], shape: tuple[int, ...]) -> "torch.Tensor":
        """A new tensor of ``shape`` from the bytes ``spans`` (offsets into the tensor's data), in order."""
        import torch

        dtype, path, base = self._torch_dtype(name), self._where[name], self._span[name][0]
        buffer = bytearray(sum(stop - start for start, stop in spans))
        view, filled = memoryview(buffer), 0
        try:
            with open(path, "rb", buffering=0) as f:
                for start, stop in spans:
                    f.seek(base + start)
                    end = filled + stop - start
                    while filled < end:
                        got = f.readinto(view[filled:end])
                        if not got:
                            raise CheckpointError(f"{path}: the file ends inside tensor {name!r} (truncated since it was opened?)")
                        filled += got
        except OSError as exc:
            raise CheckpointError(f"{path}: reading tensor {name!r} failed: {exc.strerror or exc}") from None
        del view
        if not buffer:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).view(shape)

    def read(self, name: str) -> "torch.Tensor":
        """Copy one tensor out of its file (CPU, the file's dtype). Raises CheckpointError naming it."""
        self._torch_dtype(name)  # an unknown name or type is an error naming it
        start, stop = self._span[name]
        return self._read_spans(name, [(0, stop - start)], self._shape[name])

    def read_slice(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> "torch.Tensor":
        """Copy only ``ranges`` (``[(start, stop), …]`` along ``dim``) of one tensor out of its file.

        Only those bytes are read: a tensor-parallel rank never holds the whole tensor
        (docs/tensor-parallel.md). The pieces come concatenated along ``dim``. Row-major layout:
        for each index of the dimensions before ``dim``, each range is one run of bytes.
        """
        itemsize = self._torch_dtype(name).itemsize
        shape = self._shape[name]
        if not 0 <= dim < len(shape) or not all(0 <= a <= b <= shape[dim] for a, b in ranges):
            raise CheckpointError(f"tensor {name!r} of shape {shape} has no slice {ranges} along dimension {dim}")
        outer = math.prod(shape[:dim])
        run = math.prod(shape[dim + 1:]) * itemsize  # bytes of one index along dim
        spans = [((i * shape[dim] + a) * run, (i * shape[dim] + b) * run) for i in range(outer) for a, b in ranges]
        sliced = shape[:dim] + (sum(b - a for a, b in ranges),) + shape[dim + 1:]
        return self._read_spans(name, spans, sliced)

    def nbytes(self) -> int:
        """Total size of the tensors as stored in the file(s), in bytes."""
        sizes = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}
        total = 0
        for name, shape in self._shape.items():
            n = 1
            for d in shape:
                n *= d
            total += n * sizes.get(self._dtype[name], 4)
        return total


@dataclass
class Checkpoint:
    """A located checkpoint: raw configs, the weights by file names, and where the tokenizer lives.

    Fields:
      spec:              what the user typed (folder or repo id).
      path:              the local folder holding the files.
      fmt:               ``"safetensors"`` or ``"gguf"``.
      config:            config.json as a dict, untouched (for GGUF: the file's metadata).
      generation_config: generation_config.json as a dict (empty when absent).
      weights:           :class:`TensorSource` (or :class:`lollm.gguf.GGUFTensorSource`)
                         keyed by the file's tensor names.
    """

    spec: str
    path: Path
    fmt: str
    config: dict[str, Any]
    generation_config: dict[str, Any]
    weights: TensorSource
    _tokenizer: Tokenizer | None = field(default=None, repr=False)

    @property
    def model_type(self) -> str:
        """config.json's ``model_type``; for GGUF, ``general.architecture`` (what the router keys on)."""
        if self.fmt == "gguf":
            return self.config["general.architecture"]
        return self.config["model_type"]

    @property
    def tokenizer(self) -> "Tokenizer":
        """The checkpoint's tokenizer, built on first use (tokenizer files in :attr:`path`, or GGUF metadata)."""
        if self._tokenizer is None:
            if self.fmt == "gguf":
                from lollm.tokenizer import load_gguf_tokenizer

                gguf = getattr(self.weights, "gguf", None)  # errors name the file, not just "GGUF metadata"
                source = f"GGUF file {gguf.path}" if gguf is not None else f"GGUF file {self.spec}"
                self._tokenizer = load_gguf_tokenizer(self.config, source=source)
                if gguf is not None:
                    gguf.release_header_pages()  # the tokenizer holds its own tables now
            else:
                from lollm.tokenizer import load_tokenizer

                self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer


def _shard_path(folder: Path, index: Path, shard: object) -> Path:
    """The path of a shard the index names: a plain file name (or relative path) inside ``folder``.

    Raises CheckpointError naming the index and the entry for anything else: not a string, a
    control character (a NUL cannot be in a file name), a path outside the folder, or an entry
    that names no file (``.``, ``sub/``, ``a//b``: pathlib would quietly read them as the folder).
    """
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: 'weight_map' names the shard {shard!r}; expected a file name")
    if any(ord(c) < 32 or c == "\x7f" for c in shard):
        raise CheckpointError(f"{index}: 'weight_map' names the shard {shard!r}, which holds a control character; "
                              f"expected a file name")
    parts = Path(shard).parts
    if Path(shard).is_absolute() or ".." in parts or "\\" in shard or shard.startswith("~"):
        raise CheckpointError(
            f"{index}: the shard {shard!r} is not inside the checkpoint folder; lollm loads only files "
            f"named relative to {folder} (no absolute paths, no '..')"
        )
    if any(part in ("", ".") for part in shard.split("/")):
        raise CheckpointError(f"{index}: 'weight_map' names the shard {shard!r}, which is not a file name "
                              f"(an empty or '.' part names a folder, not a safetensors file)")
    return folder / shard


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if is_present(index):
        data = read_json(index, what="shard index")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map'")
        files: list[Path] = []
        for shard in weight_map.values():
            p = _shard_path(folder, index, shard)
            if p in files:
                continue
            try:
                present = is_present(p)
            except CheckpointError as exc:
                raise CheckpointError(f"{index} lists shard {shard!r}, but {exc}") from None
            if not present:
                raise CheckpointError(f"{index} lists shard {shard!r}, which is missing from {folder}")
            files.append(p)
        return files
    single = folder / "model.safetensors"
    if is_present(single):
        return [single]
    others = sorted(p for p in folder.glob("*.safetensors") if is_present(p))
    if others:
        return others
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{folder} holds only pickle checkpoints ({', '.join(pickles)}); lollm refuses them because "
            f"unpickling can run arbitrary code. Convert them to safetensors first."
        )
    raise CheckpointError(f"{folder}: no model.safetensors, model.safetensors.index.json or *.safetensors found")


def load_folder(folder: Path, spec: str | None = None) -> Checkpoint:
    """Build a :class:`Checkpoint` from a local folder. Raises CheckpointError / ConfigError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    config = read_json(folder / "config.json", what="checkpoint config")
    if "model_type" not in config:
        raise ConfigError(f"{folder / 'config.json'} has no 'model_type' key, so no family can be chosen for it")
    if not isinstance(config["model_type"], str) or not config["model_type"]:
        raise ConfigError(f"{folder / 'config.json'}: 'model_type' must be a non-empty string, got {config['model_type']!r}")
    gen_path = folder / "generation_config.json"
    generation_config = read_json(gen_path, what="generation config") if is_present(gen_path) else {}
    weights = TensorSource(_weight_files(folder))
    return Checkpoint(spec or str(folder), folder, "safetensors", config, generation_config, weights)


def looks_like_repo_id(spec: str) -> bool:
    """True when ``spec`` reads as a hub repo id (``owner/name``: two non-empty parts, not a relative or home path).

    Only the shape is checked, nothing is fetched: a folder of that name on disk wins where callers look first.
    """
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def load_gguf(path: Path, spec: str | None = None) -> Checkpoint:
    """Open a single GGUF file: metadata as the config, tensors as a lazy source. Raises GGUFError."""
    from lollm.gguf import GGUFTensorSource

    split = SPLIT_GGUF.search(path.name)
    if split:
        raise CheckpointError(
            f"{path} is part {int(split.group(1))} of a GGUF split into {int(split.group(2))} files; lollm reads "
            f"single files only. Merge the parts first (llama.cpp: llama-gguf-split --merge FIRST_PART OUT.gguf)."
        )
    source = GGUFTensorSource(path)
    metadata = source.metadata
    if not isinstance(metadata.get("general.architecture"), str):
        raise ConfigError(f"{path}: the GGUF metadata has no 'general.architecture', so no family can be chosen for it")
    return Checkpoint(spec or str(path), path.parent, "gguf", metadata, {}, source)


def load_checkpoint(spec: str | os.PathLike) -> Checkpoint:
    """Locate and open a checkpoint from a spec: a path, then a local model's name, then a hub repo id.

    Raises CheckpointError for a missing path, a pickle-only checkpoint, a
    truncated safetensors file or an unreachable repo; ConfigError for a
    config.json without ``model_type``.
    """
    text = str(spec)
    path = Path(text).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix in PICKLE_SUFFIXES:
                raise CheckpointError(f"{path} is a pickle checkpoint; lollm refuses them because unpickling can run arbitrary code")
            if path.suffix == ".gguf":
                return load_gguf(path, text)
            if path.suffix == ".safetensors":
                return load_folder(path.parent, text)
            raise CheckpointError(f"{path} is a file; give the folder holding config.json and the weights")
        return load_folder(path, text)
    local = resolve_local(text)  # a name lollm list shows, before any hub lookup
    if local is not None:
        return load_gguf(local, text) if local.suffix == ".gguf" else load_folder(local, text)
    repo, colon, quant = text.partition(":")
    if colon and repo and (repo.endswith(".gguf") or Path(repo).expanduser().exists()):
        raise CheckpointError(
            f"{text}: {repo} is a local path, and ':{quant}' picks a quant only among the files of a hub repo "
            f"('org/name:QUANT'); give the local .gguf file's path alone"
        )
    if colon and quant and looks_like_repo_id(repo):
        return load_gguf(hub_gguf_file(repo, quant), text)
    if looks_like_repo_id(text):
        return load_folder(download_repo(text), text)
    raise unknown_model(text)
