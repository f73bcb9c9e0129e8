"""Structured output on the real Qwen2.5-Coder-0.5B-Instruct GGUF through a live ``lollm serve``.

The official ``openai`` client's ``chat.completions.parse`` with a pydantic model (the
README's snippet, run as written), and a strict schema's answer validated by ``jsonschema``.
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


@pytest.fixture(scope="module")
def real_server():
    from lollm.cli.real_models import fetch_gguf

    with serving.run_server(fetch_gguf("qwen2.5-coder-0.5b-instruct"), "--model-name", "qwen", "--threads", "2") as url:
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
            model="qwen", messages=[{"role": "user", "content": "Describe the Python language."}], max_tokens=80,
            temperature=1.0, seed=seed, response_format={"type": "json_schema",
                                                         "json_schema": {"name": "language", "schema": schema, "strict": True}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
