"""The config files of real hub checkpoints, shipped with lollm-core as package data.

Every first-party family is tested on the *real* config.json of a published
checkpoint (so every key the real model has is present), shrunk to tiny
dimensions by :func:`lollm.testing.tiny.shrink_config`. Those files travel
inside this package (``lollm/cli/data/hub_configs/<org>__<model>/``), so the
tests of any distribution, and a plugin author's own tests, run from a clone
of the repository (or a plain ``pip install lollm-core``) with nothing laid
beside it. Each folder's SOURCE.md says where its files were found.

``$LOLLM_HUB_CONFIGS`` points at another folder of the same layout instead.

They live with the commands: ``lollm new-family`` writes its tiny test config from one, and
the kit (:mod:`lollm.testing`, the layer above) builds its tiny models from them; no checkpoint
loads through them.

Usage::

    from lollm.cli.hub_configs import hub_config, hub_file
    raw = hub_config("Qwen__Qwen3-0.6B")                       # config.json as a dict
    template = hub_file("google__gemma-3-270m-it", "chat_template.jinja").read_text()
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lollm.errors import CheckpointError

#: The folder inside the package that holds one sub-folder per hub checkpoint.
PACKAGED = Path(__file__).resolve().parent / "data" / "hub_configs"


def hub_configs_dir() -> Path:
    """``$LOLLM_HUB_CONFIGS`` when set, else the copy shipped with lollm-core."""
    override = os.environ.get("LOLLM_HUB_CONFIGS")
    return Path(override) if override else PACKAGED


def available() -> list[str]:
    """The checkpoint names (``org__model``) there are files for, sorted."""
    return sorted(p.name for p in hub_configs_dir().iterdir() if p.is_dir())


def hub_file(name: str, filename: str) -> Path:
    """The path of ``filename`` of checkpoint ``name``; CheckpointError naming both when it is absent."""
    path = hub_configs_dir() / name / filename
    if not path.is_file():
        raise CheckpointError(f"no hub file {filename!r} for {name!r} in {hub_configs_dir()} (known: {', '.join(available())})")
    return path


def hub_config(name: str, filename: str = "config.json") -> dict[str, Any]:
    """A JSON file of a hub checkpoint (config.json by default), as a dict."""
    return json.loads(hub_file(name, filename).read_text(encoding="utf-8"))
