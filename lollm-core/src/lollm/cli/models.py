"""Where models are on this machine, and how to fetch one: ``lollm list`` and ``lollm pull``.

Two caches are listed, the Hugging Face hub cache and lollm's own (``$LOLLM_CACHE`` or
``~/.cache/lollm``); :mod:`lollm.load.local_names` finds the models there and names each
one, so that the name ``lollm list`` prints is the name ``lollm run``, ``chat`` and ``serve``
find the model by (the demo's GGUF is ``qwen2.5-coder-0.5b-instruct``).

Each model is one :class:`ModelRow`: its name, its format, its
quantization (the ggml type names that hold most of its bytes, from the GGUF header; the
safetensors dtype), its size on disk and the installed family that would serve it, found
by the router exactly as ``lollm run`` finds it. Nothing here imports torch.

``pull`` fetches through huggingface_hub with its own progress bar, using the loader's
spec grammar: ``org/name`` (the allow-listed safetensors files) or ``org/name:QUANT`` (the
one ``.gguf`` file whose name carries the quant type).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from lollm.cli.inventory import inspect_checkpoint
from lollm.errors import CheckpointError, LollmError
from lollm.files import read_json
from lollm.load.hub import download_repo, hub_gguf_file, offline
from lollm.load.local_names import local_models
from lollm.load.loader import looks_like_repo_id
from lollm.load.plugins import get_registry
from lollm.load.registry import GGUF_ARCHITECTURE, MODEL_TYPE, Registry


@dataclass(frozen=True)
class ModelRow:
    """One model on disk.

    name: the short name every command takes (``lollm run NAME``, see :mod:`lollm.load.local_names`);
    spec: the same name (the field scripts read before the names were short);
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
            return f"none installed ({hints[0].command()})"
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


def list_models() -> list[ModelRow]:
    """Every model in the hub cache, then in lollm's cache, by the name every command accepts.

    Reads headers only (no weights, no network); the names come from :func:`lollm.load.local_names.local_models`.
    Raises CheckpointError when the hub cache cannot be read.
    """
    registry = get_registry()
    rows = []
    for model in local_models():
        fmt, quant, family = describe(model.path, registry)
        files = [model.path] if model.path.is_file() else [p for p in model.path.iterdir() if p.is_file()]
        if model.source == "hf" and model.fmt == "safetensors":
            files = [p for p in files if not p.name.endswith(".gguf")]
        size = sum(p.stat().st_size for p in files)
        rows.append(ModelRow(model.name, model.name, model.source, fmt, quant, size, family, str(model.path)))
    return rows


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
    if offline():
        raise CheckpointError(f"{spec}: HF_HUB_OFFLINE is set, and lollm pull needs the network; "
                              f"unset it to download (lollm list shows what is already cached)")
    if quant:
        return hub_gguf_file(repo, quant)
    folder = download_repo(repo)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{repo}: no config.json with .safetensors weights there; for a GGUF repo name "
                              f"the quant: lollm pull {repo}:Q4_K_M (the ggml type in the file's name)")
    return folder
