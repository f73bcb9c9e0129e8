"""Tool calls through a live ``lollm serve``, with the official openai client.

A tiny random qwen2 carries the real Qwen2.5 tokenizer and chat template (taken
from the real checkpoint): its output is noise, so a call whose arguments
validate can only come from the grammar that ``tool_choice`` "required" or a
named function imposes (lollm.serve.tools + lollm.generate.structured). At temperature 1,
over many seeds, every call must validate against its function's schema
(the ``jsonschema`` package, an independent checker); the streamed deltas of a
seed must concatenate to the call the same seed gives without streaming.

The round trip (call, tool result, final answer) runs on the real Qwen2.5 0.5B GGUF.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest

from lollm.testing import serving

REPO = Path(__file__).resolve().parents[2]
NAME = "tiny-qwen-tools"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "units": {"type": "string", "enum": ["C", "F"]},  # optional
    "note": {"type": "string", "maxLength": 6},  # optional
}}
BOOKING = {"type": "object", "additionalProperties": False, "required": ["guest", "nights"], "properties": {
    "guest": {"type": "object", "additionalProperties": False, "required": ["adults"], "properties": {
        "adults": {"type": "integer", "minimum": 1, "maximum": 4}, "children": {"type": "integer", "minimum": 0, "maximum": 3}}},
    "nights": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "enum": ["fri", "sat", "sun"]}},
    "late_checkout": {"type": "boolean"},
}}
SCHEMAS = {"get_weather": WEATHER, "book_hotel": BOOKING}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days, and a hotel for two adults on Friday."}]
SEEDS = range(12)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, qwen25_dir) -> Path:
    """A tiny random qwen2 of Qwen2.5's vocabulary, with the real tokenizer, template and end ids."""
    from lollm.cli.hub_configs import hub_config
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    raw = shrink_config(hub_config("Qwen__Qwen2.5-0.5B"), vocab_size=151936, bos_token_id=151643, eos_token_id=151645,
                        tie_word_embeddings=True)
    folder = write_tiny_checkpoint(raw, tmp_path_factory.mktemp("tiny-qwen-tools"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (qwen25_dir / name).exists():
            shutil.copy(qwen25_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def client(folder):
    with serving.run_server(folder, "--model-name", NAME, "--ctx-size", "2048") as url:
        yield serving.openai_client(url)


def ask(client, seed: int, tool_choice, **options):
    options = {"temperature": 1.0, "seed": seed, "max_tokens": 120, **options}
    return client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, **options)


def valid_calls(choice) -> list[tuple[str, str]]:
    """(name, arguments) of each call of ``choice``, after checking each against its function's schema.

    An answer cut by max_tokens (finish "length") holds its unfinished call as content.
    """
    calls = choice.message.tool_calls
    if choice.finish_reason == "length":
        assert choice.message.content.lstrip().startswith("<tool_call>") and "</tool_call>" not in choice.message.content
    else:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)
    return [(call.function.name, call.function.arguments) for call in calls]


@pytest.mark.parametrize("seed", SEEDS)
def test_required_gives_a_call_that_validates(client, seed):
    choice = ask(client, seed, "required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and len(valid_calls(choice)) == 1


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_required_with_parallel_calls_gives_calls_that_validate(client, seed):
    # the noise goes on writing calls until it draws the end id or reaches max_tokens
    valid_calls(ask(client, seed, "required", max_tokens=300).choices[0])


@pytest.mark.parametrize("seed", SEEDS)
def test_a_named_function_gets_one_call_that_validates(client, seed):
    choice = ask(client, seed, {"type": "function", "function": {"name": "book_hotel"}}, parallel_tool_calls=False).choices[0]
    assert [name for name, _ in valid_calls(choice)] == ["book_hotel"]


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_streamed_deltas_concatenate_to_the_call(client, seed):
    answer = ask(client, seed, "required", max_tokens=200).choices[0]
    whole = valid_calls(answer)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in ask(client, seed, "required", max_tokens=200, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] = (part.function.name if part.function else None) or call["name"]
            call["arguments"] += (part.function.arguments or "") if part.function else ""
    assert finish == answer.finish_reason and content == (answer.message.content or "")
    assert sorted(calls) == list(range(len(calls))) and all(c["id"].startswith("call_") for c in calls.values())
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == whole


def test_auto_on_noise_is_content_and_never_a_crash(client):
    # the random model writes no <tool_call> block: the answer is its text, finish "length" or "stop"
    choice = ask(client, 0, "auto", max_tokens=16).choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)


def test_tool_messages_render_and_bad_ones_are_refused(client):
    import openai

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "snow"}'}]
    reply = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert reply.usage.prompt_tokens > 100  # the tools, the call and its result are in the prompt
    bad = [{**call, "function": {**call["function"], "arguments": "{oops"}}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not valid JSON"):
        client.chat.completions.create(model=NAME, messages=MESSAGES + [{"role": "assistant", "tool_calls": bad}],
                                       max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="does not offer"):
        ask(client, 0, {"type": "function", "function": {"name": "launch"}})
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters .*uniqueItems"):  # named
        client.chat.completions.create(model=NAME, messages=MESSAGES, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                "xs": {"type": "array", "uniqueItems": True}}}}}])


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_a_forced_function_without_parameters_gets_empty_arguments(client, seed):
    # OpenAI reads a missing 'parameters' as none: the noise must not invent arguments
    choice = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[{"type": "function", "function": {
        "name": "ping"}}], tool_choice={"type": "function", "function": {"name": "ping"}}, temperature=1.0, seed=seed,
        max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [("ping", {})]


# -- Qwen3.5's XML call format: the same noise, its template, its grammar -------------------------


@pytest.fixture(scope="module")
def xml_client(folder, tmp_path_factory):
    """The tiny model with Qwen3.5's chat template (whose calls are <function=...> blocks; its <tool_call> is Qwen2.5's id)."""
    from lollm.cli.hub_configs import hub_file

    xml = tmp_path_factory.mktemp("tiny-qwen-xml") / "model"
    shutil.copytree(folder, xml)
    shutil.copy(hub_file("Qwen__Qwen3.5-0.8B", "chat_template.jinja"), xml / "chat_template.jinja")
    with serving.run_server(xml, "--model-name", NAME, "--ctx-size", "2048") as url:
        yield serving.openai_client(url)


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_xml_format_forced_calls_validate(xml_client, seed):
    # strings are enums or bounded (maxLength): the grammar then forces the closing tag
    choice = ask(xml_client, seed, "required", max_tokens=240).choices[0]
    valid_calls(choice)
    named = ask(xml_client, seed, {"type": "function", "function": {"name": "book_hotel"}}, parallel_tool_calls=False)
    assert [name for name, _ in valid_calls(named.choices[0])] == ["book_hotel"]


# -- the real model: a round trip, and the README's snippet -------------------------------------------


@pytest.mark.real
def test_round_trip_on_the_real_model():
    from lollm.cli.real_models import fetch_gguf

    # no --model-name: the server answers to the name the README's snippet sends, as the README's `lollm serve` line starts it
    with serving.run_server(fetch_gguf("qwen2.5-coder-0.5b-instruct"), "--ctx-size", "2048") as url:
        namespace = run_readme_snippet(url, "qwen2.5-coder-0.5b-instruct")
    first, final = namespace["first"].choices[0], namespace["final"].choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.finish_reason == "stop" and final.message.tool_calls is None
    assert "sunny" in final.message.content or "21" in final.message.content  # the tool's result reached the model
    # the README says what a user sees here (the 0.5B model echoes the call and the result): it must be true
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    said = re.search(r"# On the 0\.5B coder model this prints .*?:\n((?:#   .*\n)+)", readme)
    assert said, "README.md's tool-call snippet no longer says what the final reply is on the 0.5B model"
    assert final.message.content == "\n".join(line[4:] for line in said.group(1).splitlines())


def run_readme_snippet(url: str, model: str) -> dict:
    """Run README.md's tool-call snippet against ``url``; its variables."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- tested: tool-call snippet -->\s*```python\n(.*?)```", readme, re.S)
    assert match, "README.md has no python block after '<!-- tested: tool-call snippet -->'"
    code = match.group(1)
    assert re.search(r'model="([^"]+)"', code).group(1) == model
    namespace: dict = {}
    exec(compile(code.replace(re.search(r'base_url="([^"]+)"', code).group(1), url), "README.md", "exec"), namespace)
    return namespace
