"""Shared helpers of the tests of lollm serve's other APIs (Messages, Responses) and of separated reasoning.

The server runs in the test process on the toy family (docs/examples/lollm-toy) with a
context of 2048 positions, under a REAL chat template copied from the hub
(lollm.cli.hub_configs): Qwen2.5's (tools, no thinking), Qwen3's (tools; the answer may
open ``<think>``) or Qwen3.5's (XML tools; with ``enable_thinking`` the template opens
the thinking itself). The toy tokenizer knows every marker these templates write
(``<|im_start|>``, ``<think>``, ``</think>``; ``<tool_call>`` is plain text to it).

``think_often``: the toy's final norm and output head are changed so that ``</think>`` has
the same logit at every step (a few per cent of the probability), so a sampled thinking ends
after tens of tokens, not hundreds (a random model would rarely close it).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from safetensors.torch import load_file, save_file

import lollm.load.plugins as plugins
from lollm.cli.hub_configs import hub_file
from lollm.load.options import LoadOptions
from lollm.serve.app import create_app
from lollm.serve.model_server import ModelServer
from lollm.testing import serving

from _core_helpers import write_site
from test_cli_run import write_checkpoint
from test_example_plugin import EXAMPLE

NAME = "toy"
CONTEXT = 2048

#: template name -> (hub folder, file holding the template)
TEMPLATES = {"qwen2.5": ("Qwen__Qwen2.5-7B-Instruct", "tokenizer_config.json"),
             "qwen3": ("Qwen__Qwen3-4B", "tokenizer_config.json"),
             "qwen3.5": ("Qwen__Qwen3.5-0.8B", "chat_template.jinja")}


def real_template(name: str) -> str:
    folder, filename = TEMPLATES[name]
    text = hub_file(folder, filename).read_text(encoding="utf-8")
    return json.loads(text)["chat_template"] if filename.endswith(".json") else text


def write_toy(folder: Path, template: str, *, think_often: bool = False) -> Path:
    """The toy checkpoint (2048 positions) in ``folder`` with the real chat template ``template``."""
    write_checkpoint(folder, max_position_embeddings=CONTEXT)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = real_template(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if think_often:
        close = json.loads((folder / "tokenizer.json").read_text())["added_tokens"][-1]
        assert close["content"] == "</think>", close
        tensors = load_file(str(folder / "model.safetensors"))
        # one hidden unit of the final norm is a constant 3.5 (weight 0, bias 3.5), read by </think> alone, whose
        # logit is then that constant: about 3 % of the probability at temperature 1 (the other 319 logits spread
        # with a standard deviation of about 1.7), so a sampled thinking ends after some 30 tokens
        tensors["model.norm.weight"][0], tensors["model.norm.bias"][0] = 0.0, 3.5
        tensors["lm_head.weight"][:, 0] = 0.0
        tensors["lm_head.weight"][close["id"]] = 0.0
        tensors["lm_head.weight"][close["id"], 0] = 1.0
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory) -> Path:
    return write_site(tmp_path_factory.mktemp("site") / "toy", "lollm-toy", "0.1.0", {"toy": "lollm_toy.plugin"},
                      {"lollm_toy": EXAMPLE / "src" / "lollm_toy"})


def load_toy(site: Path, folder: Path):
    from lollm.load.pipeline import open_model

    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(site))
        patch.setattr(plugins, "_REGISTRY", None)
        return open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))


@contextmanager
def served(loaded, **settings: object) -> Iterator[str]:
    """A ModelServer of ``loaded`` (named :data:`NAME`) behind uvicorn in a thread; yields its root URL."""
    server = ModelServer(loaded, name=NAME, context=CONTEXT, **settings)
    try:
        with serving.app_in_thread(create_app(server)) as root:
            yield root
    finally:
        server.close()


def anthropic_client(root: str, api_key: str = "unused"):
    """The official ``anthropic`` client of the server at ``root`` (no retries)."""
    from anthropic import Anthropic

    return Anthropic(base_url=root, api_key=api_key, max_retries=0, timeout=120)
