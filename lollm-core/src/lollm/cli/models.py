"""Where models are on this machine, and how to fetch one: ``lollm list`` and ``lollm pull``.

Two caches are listed:
  * the Hugging Face hub cache (``$HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``),
    read through ``huggingface_hub.scan_cache_dir`` (never by walking its folders here: the
    library owns that layout);
  * lollm's own cache (``$LOLLM_CACHE`` or ``~/.cache/lollm``, see
    :func:`lollm.cli.real_models.cache_dir`): the ``.gguf`` files and the safetensors
    checkpoint folders (a ``config.json`` beside ``*.safetensors``) found under it.

Each model is one :class:`ModelRow`: what to pass to ``lollm run``, its format, its
quantization (the ggml type names that hold most of its bytes, from the GGUF header; the
safetensors dtype), its size on disk and the installed family that would serve it, found
by the router exactly as ``lollm run`` finds it. Nothing here imports torch.

``pull`` fetches through huggingface_hub with its own progress bar, using the loader's
spec grammar: ``org/name`` (the allow-listed safetensors files) or ``org/name:QUANT`` (the
one ``.gguf`` file whose name carries the quant type).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from lollm.cli.inventory import inspect_checkpoint
from lollm.errors import CheckpointError, LollmError
from lollm.files import read_json
from lollm.load.loader import hub_gguf_file, looks_like_repo_id, download_repo
from lollm.load.plugins import get_registry
from lollm.load.registry import GGUF_ARCHITECTURE, MODEL_TYPE, Registry

# Lazy imports below: huggingface_hub (a scan of its cache) only where lollm list reads that cache; and
# lollm.cli.real_models, so that importing the package lollm.cli leaves it out and `python -m lollm.cli.real_models`
# runs it once, as __main__ (runpy warns about a module the package already imported).

#: Name prefixes of the work folders in lollm's cache that are never listed: hidden ones, tempfile's
#: ``tmp…`` (real_models joins the chunk wheels there) and ``safetensors-…`` (a conversion under way).
SKIP_PREFIXES = (".", "tmp", "safetensors-")


@dataclass(frozen=True)
class ModelRow:
    """One model on disk.

    name: the hub repo id, or the path inside lollm's cache; spec: what ``lollm run`` takes;
    source: ``hf`` (the hub cache) or ``lollm`` (lollm's cache); fmt: ``safetensors`` or ``gguf``;
    quant: ggml type names or a safetensors dtype, largest share first; size: bytes on disk;
    family: the installed family that serves it, or ``none installed`` and what would;
    path: the local file or folder.
    """

    name: str
    spec: str
    source: str
    fmt: str
    quant: str
    size: int
    family: str
    path: str


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _quant(totals: dict[str, tuple[int, int]]) -> str:
    """Type names ordered by the bytes they hold (``Q4_K, Q6_K, F32``): the first is what the model mostly is."""
    return ", ".join(kind for kind, _ in sorted(totals.items(), key=lambda item: -item[1][1])) or "-"


def _family(registry: Registry, *, model_type: object = None, gguf_architecture: object = None) -> str:
    """The family name that the router picks, or ``none installed`` with the distribution that would serve it."""
    kind, key = (MODEL_TYPE, model_type) if gguf_architecture is None else (GGUF_ARCHITECTURE, gguf_architecture)
    if not isinstance(key, str) or not key:
        return f"unknown (no {kind})"
    try:
        entry = registry.route(model_type) if gguf_architecture is None else registry.route(gguf_architecture=key)
        return entry.family.name
    except LollmError as exc:
        hints = registry.install_hints(kind, key)
        if hints:
            return f"none installed (pip install {hints[0].install})"
        first = str(exc).splitlines()[0]
        return "none installed" if "no installed lollm family" in first else first


def describe(path: Path, registry: Registry) -> tuple[str, str, str]:
    """``(fmt, quant, family)`` of a ``.gguf`` file or a checkpoint folder; a file that cannot be read says why in quant."""
    fmt = "gguf" if path.suffix == ".gguf" else "safetensors"
    try:
        inv = inspect_checkpoint(str(path))
        if fmt == "gguf":
            family = _family(registry, gguf_architecture=inv.metadata.get("general.architecture"))
        else:
            family = _family(registry, model_type=read_json(path / "config.json", what="config").get("model_type"))
        return fmt, _quant(inv.totals()), family
    except LollmError as exc:
        return fmt, f"unreadable: {str(exc).splitlines()[0]}", "-"


def _hf_rows(registry: Registry) -> Iterable[ModelRow]:
    """One row per safetensors checkpoint and per ``.gguf`` file in the newest snapshot of each cached model repo.

    Raises CheckpointError when the cache path ($HF_HUB_CACHE) is a file; a missing cache lists nothing.
    """
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return
    except ValueError as exc:  # the cache path is a file
        raise CheckpointError(f"the Hugging Face cache cannot be read: {exc}") from None
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda rev: rev.last_modified)
        folder = Path(newest.snapshot_path)
        files = {Path(f.file_path).relative_to(folder).as_posix(): f for f in newest.files}
        for gguf in sorted(f for f in files if f.endswith(".gguf")):
            path = Path(files[gguf].file_path)
            fmt, quant, family = describe(path, registry)
            yield ModelRow(f"{repo.repo_id}/{gguf}", str(path), "hf", fmt, quant, files[gguf].size_on_disk, family, str(path))
        if "config.json" in files and any(f.endswith(".safetensors") and "/" not in f for f in files):
            size = sum(f.size_on_disk for name, f in files.items() if not name.endswith(".gguf"))
            fmt, quant, family = describe(folder, registry)
            yield ModelRow(repo.repo_id, repo.repo_id, "hf", fmt, quant, size, family, str(folder))


def _lollm_rows(root: Path, registry: Registry) -> Iterable[ModelRow]:
    """The ``.gguf`` files and safetensors folders under lollm's cache, sorted by path."""
    if not root.is_dir():
        return
    found = [p for p in root.rglob("*.gguf") if p.is_file()]
    found += [p.parent for p in root.rglob("config.json") if any(p.parent.glob("*.safetensors"))]
    for path in sorted(set(found)):
        rel = path.relative_to(root).parts
        if any(part.startswith(SKIP_PREFIXES) for part in (rel if path.is_dir() else rel[:-1])):
            continue
        files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
        fmt, quant, family = describe(path, registry)
        name = str(path.relative_to(root))
        yield ModelRow(name, str(path), "lollm", fmt, quant, sum(p.stat().st_size for p in files), family, str(path))


def list_models() -> list[ModelRow]:
    """Every model in the hub cache, then in lollm's cache. Reads headers only (no weights, no network)."""
    from lollm.cli.real_models import cache_dir

    registry = get_registry()
    return [*_hf_rows(registry), *_lollm_rows(cache_dir(), registry)]


def rows_json(rows: list[ModelRow]) -> str:
    """The rows as a JSON array of objects (the :class:`ModelRow` fields; size in bytes)."""
    return json.dumps([asdict(r) for r in rows], indent=2, ensure_ascii=False)


def pull(spec: str) -> Path:
    """Download ``org/name`` or ``org/name:QUANT`` into the Hugging Face cache; return the local folder or file.

    huggingface_hub shows its own progress bar. Raises CheckpointError when HF_HUB_OFFLINE is set
    (pulling needs the network), for a spec that is not a repo id, when the hub cannot be reached,
    and when the repo has no file of that quant (the files there are listed) or no safetensors
    checkpoint (then the GGUF form is suggested).
    """
    repo, colon, quant = spec.partition(":")
    if not looks_like_repo_id(repo) or (colon and not quant):
        raise CheckpointError(f"{spec}: lollm pull takes a Hugging Face repo id, 'org/name' or 'org/name:QUANT' (e.g. Q4_K_M)")
    if _offline():
        raise CheckpointError(f"{spec}: HF_HUB_OFFLINE is set, and lollm pull needs the network; "
                              f"unset it to download (lollm list shows what is already cached)")
    if quant:
        return hub_gguf_file(repo, quant)
    folder = download_repo(repo)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{repo}: no config.json with .safetensors weights there; for a GGUF repo name "
                              f"the quant: lollm pull {repo}:Q4_K_M (the ggml type in the file's name)")
    return folder
