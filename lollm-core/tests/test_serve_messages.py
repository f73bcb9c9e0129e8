"""Anthropic's Messages API (``POST /v1/messages``) through the official ``anthropic`` SDK, on the toy family.

The toy model chats under Qwen2.5's real template (tools, no thinking): each greedy answer
equals what lollm's own loop generates on the prompt the template makes of the same
conversation; a streamed answer's text equals the whole one's; a forced tool call's input
validates against its ``input_schema``; ``output_config.format`` gives JSON that validates;
``count_tokens`` equals the usage's ``input_tokens``; a bad request is a 400 in Anthropic's
error shape naming its field. (Thinking blocks: test_serve_reasoning.py.)
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from lollm.generate.loop import generate
from lollm.sampling_params import resolve_sampling
from lollm.testing import serving

from _serve_apis import NAME, anthropic_client, load_toy, served, toy_site, write_toy  # noqa: F401  (toy_site: a fixture)

#: The anthropic SDK (2.17) sends no temperature, top_p or top_k; older SDKs and raw clients do, and the server
#: honours them: here they ride in the body as such a client sends them.
GREEDY = {"temperature": 0}
SAMPLED = {"temperature": 1, "top_k": 0}
SYSTEM = "You are a tiny random model."
QUESTION = [{"role": "user", "content": "Tell me about the quick brown fox."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def loaded(toy_site, tmp_path_factory):
    return load_toy(toy_site, write_toy(tmp_path_factory.mktemp("toy") / "toy", "qwen2.5"))


@pytest.fixture(scope="module")
def root(loaded):
    with served(loaded) as url:
        yield url


@pytest.fixture(scope="module")
def client(root):
    return anthropic_client(root)


def reference(loaded, messages: list[dict], max_tokens: int, **flags: object):
    """lollm's own greedy generation on the prompt the template makes of ``messages``: (prompt ids, result)."""
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode_chat(messages, add_generation_prompt=True, parse_special=False, **flags)
    sampling = resolve_sampling({"temperature": 0.0}, loaded.checkpoint.generation_config,
                                loaded.family.family.sampling_defaults)
    stops = [tokenizer.token_to_id("<|endoftext|>")]
    return ids, generate(loaded.model, ids, max_new_tokens=max_tokens, sampling=sampling, stop_ids=stops,
                         tokenizer=tokenizer)


def test_create_and_stream_give_the_reference_text(client, loaded):
    ids, expected = reference(loaded, [{"role": "system", "content": SYSTEM}, *QUESTION], 24)
    reply = client.messages.create(model=NAME, max_tokens=24, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.model == NAME
    assert [block.type for block in reply.content] == ["text"] and reply.content[0].text == expected.text
    assert reply.stop_reason == ("end_turn" if expected.stop_reason == "eos" else "max_tokens")
    assert reply.usage.input_tokens == len(ids) and reply.usage.output_tokens == len(expected.new_ids)

    with client.messages.stream(model=NAME, max_tokens=24, system=[{"type": "text", "text": SYSTEM}],
                                messages=QUESTION, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == expected.text and len(pieces) > 1, pieces
    assert final.content[0].text == expected.text and final.stop_reason == reply.stop_reason
    assert final.usage.input_tokens == len(ids) and final.usage.output_tokens == len(expected.new_ids)


def test_count_tokens_equals_the_prompt_of_the_answer(client):
    request = {"model": NAME, "system": SYSTEM, "messages": QUESTION, "tools": [WEATHER]}
    counted = client.messages.count_tokens(**request)
    reply = client.messages.create(max_tokens=2, extra_body=GREEDY, **request)
    assert counted.input_tokens == reply.usage.input_tokens > 100  # the tools are in the prompt


def test_a_stop_sequence_is_named(client, loaded):
    _, expected = reference(loaded, QUESTION, 24)
    stop = expected.text[5:8]  # three characters the greedy answer writes
    reply = client.messages.create(model=NAME, max_tokens=24, messages=QUESTION, extra_body=GREEDY, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert "".join(block.text for block in reply.content) == expected.text[:expected.text.index(stop)]


@pytest.mark.parametrize("streaming", [False, True])
def test_a_tool_round_trip(client, streaming):
    """tool_choice any: a tool_use whose input validates; its tool_result goes back and the model answers.

    One call (disable_parallel_tool_use): a random model given the choice may chain calls past any max_tokens."""
    request = dict(model=NAME, max_tokens=400, messages=QUESTION, tools=[WEATHER],
                   tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   extra_body=SAMPLED)
    if streaming:
        with client.messages.stream(**request) as stream:
            reply = stream.get_final_message()
    else:
        reply = client.messages.create(**request)
    assert reply.stop_reason == "tool_use", reply
    calls = [block for block in reply.content if block.type == "tool_use"]
    assert calls and all(call.name == "get_weather" and call.id.startswith("toolu_") for call in calls)
    for call in calls:
        jsonschema.validate(call.input, WEATHER["input_schema"])
    follow = [*QUESTION, {"role": "assistant", "content": reply.content},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny, 21 C"}]}]
    again = client.messages.create(model=NAME, max_tokens=8, messages=follow, tools=[WEATHER], extra_body=GREEDY)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert again.usage.input_tokens > reply.usage.input_tokens  # the call and its result are in the prompt


def test_a_named_tool_and_no_parallel_calls(client):
    reply = client.messages.create(model=NAME, max_tokens=200, messages=QUESTION, tools=[WEATHER], extra_body=SAMPLED,
                                   tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    calls = [block for block in reply.content if block.type == "tool_use"]
    assert len(calls) == 1 and reply.stop_reason == "tool_use"
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])


@pytest.mark.parametrize("attempt", range(3))
def test_output_config_gives_json_that_validates(client, attempt):
    schema = WEATHER["input_schema"]
    reply = client.messages.create(model=NAME, max_tokens=120, messages=QUESTION, extra_body=SAMPLED,
                                   output_config={"format": {"type": "json_schema", "schema": schema}})
    assert reply.stop_reason == "end_turn", reply
    jsonschema.validate(json.loads(reply.content[0].text), schema)


BAD = [
    ({"messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 4, "messages": QUESTION, "frequency": 1}, "frequency"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": QUESTION, "stop_sequences": "END"}, "stop_sequences"),
    ({"max_tokens": 4, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"max_tokens": 4, "messages": QUESTION, "output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ({"max_tokens": 4, "messages": [*QUESTION, {"role": "assistant", "content": "The fox"}]}, "messages[1]"),
    ({"max_tokens": 0, "messages": QUESTION}, "max_tokens"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[field for _, field in BAD])
def test_a_bad_request_is_an_anthropic_400_naming_the_field(root, body, field):
    status, _, answer = serving.post(root + "/v1/messages", {"model": NAME, **body})
    assert status == 400, answer
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    assert field in answer["error"]["message"], answer


def test_the_sdk_raises_the_400_and_an_unknown_model_is_a_404(client):
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=NAME, max_tokens=0, messages=QUESTION)
    with pytest.raises(anthropic.NotFoundError, match="toy"):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=QUESTION)


def test_the_api_key_is_read_from_x_api_key(loaded):
    import anthropic

    with served(loaded, api_key="secret") as url:
        reply = anthropic_client(url, api_key="secret").messages.create(model=NAME, max_tokens=2, messages=QUESTION)
        assert reply.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError):
            anthropic_client(url, api_key="wrong").messages.create(model=NAME, max_tokens=2, messages=QUESTION)
