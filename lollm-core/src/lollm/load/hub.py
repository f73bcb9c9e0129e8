"""Fetching from the Hugging Face hub: the local cache first, then one quick look at whether the hub answers.

A spec that names no file, folder or local model (:mod:`lollm.load.local_names`) but reads as a
repo id goes through here:

1. the hub cache (``huggingface_hub`` with ``local_files_only=True``): a model pulled once runs
   offline, with no request at all;
2. with ``HF_HUB_OFFLINE`` set, that is all: an error that says so;
3. else :func:`check_reachable` opens one TCP connection to the hub (or to the proxy that
   ``HTTPS_PROXY`` names) for at most :data:`PROBE_SECONDS`. No answer is one error naming the
   hub and pointing to ``lollm list``, at once: huggingface_hub would otherwise retry with
   back-off for half a minute, a warning a retry;
4. only then the download, through huggingface_hub (its progress bar).

Every error is a CheckpointError naming the repo. Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from lollm.errors import CheckpointError

# Lazy imports below: huggingface_hub, only when a repo is looked up.

#: Files fetched from a hub repo: configs, safetensors weights and tokenizer files only.
HUB_ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
]

#: The longest wait, in seconds, for the hub (or the proxy) to accept a TCP connection, DNS included.
PROBE_SECONDS = 1.0

#: Part N of M of a split GGUF file (``…-00001-of-00003.gguf``).
SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for the local cache only (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _address(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` the hub's HTTPS requests first connect to: the proxy for ``endpoint``, else the endpoint."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        via = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        return via.hostname or "", via.port or (443 if via.scheme == "https" else 80)
    return host, parts.port or (443 if parts.scheme == "https" else 80)


def check_reachable(spec: str, timeout: float = PROBE_SECONDS) -> None:
    """Raise CheckpointError naming ``spec`` unless the hub (or its proxy) accepts a TCP connection within ``timeout`` s.

    The connection is tried in a daemon thread, so a DNS lookup that hangs cannot hold the command
    past ``timeout``. The error is one line: what was asked, that the hub cannot be reached and why,
    and where the local models are listed.
    """
    from huggingface_hub import constants

    host, port = _address(constants.ENDPOINT)
    result: list[BaseException | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as exc:
            result.append(exc)

    thread = threading.Thread(target=connect, name="lollm-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    if result and result[0] is None:
        return
    why = f"{type(result[0]).__name__}: {result[0]}" if result else f"no answer within {timeout:g} s"
    raise CheckpointError(
        f"{spec}: not a model on this machine (lollm list shows them), and the Hugging Face hub at "
        f"{constants.ENDPOINT} cannot be reached ({host}:{port}, {why}); set HF_HUB_OFFLINE=1 to stop looking"
    )


def download_repo(repo_id: str) -> Path:
    """Fetch the allow-listed files of a hub repo; the local cache is tried first.

    Honours ``HF_HUB_OFFLINE=1`` (then only the cache is used). Raises
    CheckpointError naming the repo when it cannot be found or fetched, or the hub cannot be reached.
    """
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True))
    except Exception as cached_exc:  # not (fully) in the cache
        if offline():
            raise CheckpointError(
                f"{repo_id}: not a model on this machine (lollm list shows them), and HF_HUB_OFFLINE is set, so the "
                f"hub is not asked{_maybe_a_path(repo_id)}"
            ) from cached_exc
    check_reachable(repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as exc:
        raise CheckpointError(f"{repo_id}: could not fetch from the Hugging Face hub: {type(exc).__name__}: {exc}"
                              f"{_maybe_a_path(repo_id)}") from None


def _maybe_a_path(repo_id: str) -> str:
    """A hint for a repo id that was more likely meant as a local path ('models/x.gguf', 'out/model')."""
    first = repo_id.split("/")[0]
    if repo_id.lower().endswith((".gguf", ".safetensors")) or Path(first).is_dir():
        return f"\n(if you meant a local file or folder: there is no {repo_id} under {Path.cwd()})"
    return ""


def quant_files(files: list[str], quant: str) -> list[str]:
    """The .gguf files of ``files`` whose name carries ``quant`` as a whole token, first parts of a split only; sorted."""
    token = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    matches = sorted(f for f in files if f.endswith(".gguf") and token.search(Path(f).name))
    return [f for f in matches if not SPLIT_GGUF.search(f) or SPLIT_GGUF.search(f).group(1) == "00001"]


def _cached_ggufs(repo_id: str) -> tuple[Path, list[str]] | None:
    """The snapshot folder of ``repo_id`` in the hub cache and its .gguf files; None when the repo is not cached."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=["*.gguf"], local_files_only=True))
    except Exception:
        return None
    return folder, [p.relative_to(folder).as_posix() for p in folder.rglob("*.gguf")]


def _one_file(repo_id: str, quant: str, files: list[str], where: str) -> str:
    """The one file of ``files`` that carries ``quant``; CheckpointError listing ``files`` (found in ``where``) otherwise."""
    firsts = quant_files(files, quant)
    listing = "\n  ".join(sorted(files)) or "(none)"
    if not firsts:
        raise CheckpointError(f"{repo_id}: no .gguf file carries the quant {quant!r}{where}. Files there:\n  {listing}")
    if len(firsts) > 1:
        raise CheckpointError(f"{repo_id}: several .gguf files carry the quant {quant!r}{where}: {', '.join(firsts)}. "
                              f"Files there:\n  {listing}")
    return firsts[0]


def _from_cache(repo_id: str, quant: str) -> Path | None:
    """The cached .gguf file of ``repo_id`` that carries ``quant``, or None to ask the hub.

    With ``HF_HUB_OFFLINE`` set the cache is all there is: a cached repo without exactly one such
    file, or no cached repo, raises CheckpointError (listing the cached files, or saying the hub is not asked).
    """
    cached = _cached_ggufs(repo_id)
    if cached is not None:
        folder, files = cached
        if len(quant_files(files, quant)) == 1 or offline():
            return folder / _one_file(repo_id, quant, files, " in the local cache (HF_HUB_OFFLINE is set)")
    if offline():
        raise CheckpointError(f"{repo_id}:{quant}: not a model on this machine (lollm list shows them), and "
                              f"HF_HUB_OFFLINE is set, so the hub is not asked")
    return None


def hub_gguf_file(repo_id: str, quant: str) -> Path:
    """Find and fetch the one .gguf file of ``repo_id`` whose name carries ``quant`` (``owner/name:Q4_K_M``).

    The hub cache is read first: a file pulled once is found there, offline. Returns its path in the
    hub cache (of a split file, its first part). Raises CheckpointError when no file or more than one
    matches, when the hub cannot be reached, or the files cannot be listed or fetched (with
    ``HF_HUB_OFFLINE`` set, only the local cache is read).
    """
    from huggingface_hub import HfApi, hf_hub_download

    cached = _from_cache(repo_id, quant)
    if cached is not None:
        return cached
    check_reachable(f"{repo_id}:{quant}")
    try:
        files = [f for f in HfApi().list_repo_files(repo_id) if f.endswith(".gguf")]
    except Exception as exc:
        raise CheckpointError(f"{repo_id}: could not list its GGUF files from the Hugging Face hub: "
                              f"{type(exc).__name__}: {exc}") from None
    name = _one_file(repo_id, quant, files, "")
    try:
        return Path(hf_hub_download(repo_id, name))
    except Exception as exc:
        raise CheckpointError(f"{repo_id}: could not fetch {name}: {type(exc).__name__}: {exc}") from None


def check_fetchable(repo_id: str, quant: str | None = None) -> None:
    """Before anything heavy: a repo (``quant``: its GGUF of that quant) that is not cached must be fetchable.

    Not cached and ``HF_HUB_OFFLINE`` set, or the hub unreachable (:func:`check_reachable`), raise
    CheckpointError at once, so that ``lollm run org/name`` fails in about a second instead of after
    torch is imported. A cached repo passes without a request.
    """
    from huggingface_hub import snapshot_download

    if quant is not None:
        if _from_cache(repo_id, quant) is None:  # offline, it raises: the cached files' listing, or no such repo
            check_reachable(f"{repo_id}:{quant}")
        return
    try:
        snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS, local_files_only=True)
        return
    except Exception:  # not (fully) in the cache
        pass
    if offline():
        raise CheckpointError(f"{repo_id}: not a model on this machine (lollm list shows them), and HF_HUB_OFFLINE is "
                              f"set, so the hub is not asked{_maybe_a_path(repo_id)}")
    check_reachable(repo_id)
