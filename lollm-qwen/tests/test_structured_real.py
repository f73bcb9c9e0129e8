"""Structured output on the real Qwen2.5-Coder-0.5B-Instruct GGUF through a live ``lollm serve``.

The official ``openai`` client's ``chat.completions.parse`` with a pydantic model (the
README's snippet, run as written), a strict schema's answer validated by ``jsonschema``, and the
official ``anthropic`` client on /v1/messages (text, stream, a forced tool call, output_config, count_tokens).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from lollm.testing import serving

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.real
#: The name the server answers to without --model-name: the GGUF's name without .gguf, as `lollm list` shows it
SERVED = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def real_server():
    from lollm.cli.real_models import fetch_gguf

    # no --model-name: the server answers to the name the README's snippets send (the file's name without .gguf)
    with serving.run_server(fetch_gguf("qwen2.5-coder-0.5b-instruct"), "--threads", "2") as url:
        yield url


def test_the_readme_json_schema_snippet_parses_into_the_pydantic_model(real_server):
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- tested: openai json-schema snippet -->\s*```python\n(.*?)```", readme, re.S)
    assert match, "README.md has no python block after '<!-- tested: openai json-schema snippet -->'"
    code = match.group(1)
    url = re.search(r'base_url="([^"]+)"', code).group(1)
    namespace: dict = {}
    exec(compile(code.replace(url, real_server), "README.md", "exec"), namespace)  # prints the parsed city
    city, reply = namespace["city"], namespace["reply"]
    assert isinstance(city, namespace["City"])  # parse() validated the JSON against the pydantic model
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content) == city.model_dump()


def test_a_strict_schema_with_enums_and_ranges_validates(real_server):
    schema = {"type": "object", "additionalProperties": False, "required": ["language", "year", "paradigms"],
              "properties": {"language": {"type": "string", "maxLength": 20},
                             "year": {"type": "integer", "minimum": 1950, "maximum": 2030},
                             "paradigms": {"type": "array", "minItems": 1, "maxItems": 3,
                                           "items": {"enum": ["functional", "object-oriented", "procedural", "logic"]}}}}
    client = serving.openai_client(real_server)
    for seed in range(2):
        reply = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "Describe the Python language."}], max_tokens=80,
            temperature=1.0, seed=seed, response_format={"type": "json_schema",
                                                         "json_schema": {"name": "language", "schema": schema, "strict": True}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_the_anthropic_sdk_on_the_real_model(real_server):
    """Messages through the official ``anthropic`` SDK: the stream's text equals the whole answer's (greedy, sent as an
    older SDK or a raw client sends it), a tool_use under tool_choice any validates against its input_schema,
    output_config gives JSON that validates, and count_tokens equals the usage's input_tokens."""
    from anthropic import Anthropic

    client = Anthropic(base_url=real_server.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300)
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    request = dict(model=SERVED, max_tokens=40, messages=question, extra_body={"temperature": 0})
    reply = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
    assert "Paris" in reply.content[0].text and streamed == reply.content[0].text
    assert client.messages.count_tokens(model=SERVED, messages=question).input_tokens == reply.usage.input_tokens

    weather = {"name": "get_weather", "description": "The current weather in a city",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                                "required": ["city"], "additionalProperties": False}}
    call = client.messages.create(model=SERVED, max_tokens=60, tools=[weather], tool_choice={"type": "any"},
                                  messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert call.stop_reason == "tool_use", call
    uses = [block for block in call.content if block.type == "tool_use"]
    assert uses and all(use.name == "get_weather" for use in uses)
    jsonschema.validate(uses[0].input, weather["input_schema"])

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["city", "country"], "additionalProperties": False}
    shaped = client.messages.create(model=SERVED, max_tokens=60, messages=question,
                                    output_config={"format": {"type": "json_schema", "schema": schema}})
    assert shaped.stop_reason == "end_turn", shaped
    jsonschema.validate(json.loads(shaped.content[0].text), schema)
