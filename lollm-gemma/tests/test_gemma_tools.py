"""Tools on Gemma templates, through the server's request path (in process, no HTTP).

Gemma 3's real chat template ignores ``tools``: a request with tools is a 400
that says why, not a prompt that silently drops them. Gemma 4's real template
declares them in its own syntax; its calls are read (``tool_choice`` "auto"),
and forcing one is refused, since lollm has no grammar of that format yet.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lollm.serve.server import ApiError, ModelServer
from lollm.cli.hub_configs import hub_file
from lollm.testing.tiny import write_tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def server_with_template(tiny, tmp_path, name: str, hub_folder: str) -> ModelServer:
    from lollm.load.pipeline import open_model

    folder = tmp_path / name
    shutil.copytree(tiny(name, "transformers5"), folder)
    write_tiny_tokenizer(folder, vocab_size=512, chat_template=False)
    shutil.copy(hub_file(hub_folder, "chat_template.jinja"), folder / "chat_template.jinja")
    return ModelServer(open_model(str(folder)), name="tiny", context=512)


def body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}], **fields}).encode()


def test_gemma3_template_refuses_tools_and_says_why(tiny, tmp_path):
    server = server_with_template(tiny, tmp_path, "gemma3-270m", "google__gemma-3-270m-it")
    with pytest.raises(ApiError, match="does not render tools") as error:
        server.prepare(body(tools=TOOLS), "chat")
    assert error.value.status == 400 and error.value.param == "tools"
    assert server.prepare(body(tools=TOOLS, tool_choice="none"), "chat").job.tools is None  # a plain chat


def test_gemma4_template_declares_tools_and_reads_its_calls(tiny, tmp_path):
    server = server_with_template(tiny, tmp_path, "gemma4-e2b-text", "google__gemma-4-E2B-it")
    plan = server.prepare(body(tools=TOOLS), "chat")
    assert plan.job.tools.fmt.name == "gemma4" and plan.job.constraint is None
    prompt = server.tokenizer.decode(plan.job.ids)
    assert "declaration:get_weather{description:" in prompt and "<|tool>" in prompt
    with pytest.raises(ApiError, match="grammar of the gemma4 call format") as error:
        server.prepare(body(tools=TOOLS, tool_choice="required"), "chat")
    assert error.value.param == "tool_choice"
