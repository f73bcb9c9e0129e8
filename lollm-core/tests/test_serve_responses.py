"""OpenAI's Responses API (``POST /v1/responses``) through the official ``openai`` SDK, on the toy family.

Under Qwen2.5's real template (tools, no thinking): ``responses.create`` gives lollm's own
greedy text; ``responses.stream`` gives the same text and the same final response;
``responses.parse`` with a pydantic model gives a parsed object; a function call's
arguments validate, and its output sent back as ``function_call_output`` continues the
conversation; ``previous_response_id`` continues a stored one (404 for an unknown id);
``store: false`` keeps nothing. Under Qwen3.5's (thinking): the thinking comes as a
``reasoning`` item, never in the message.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from lollm.generate.loop import generate
from lollm.sampling_params import resolve_sampling
from lollm.testing import serving

from _serve_apis import NAME, load_toy, served, toy_site, write_toy  # noqa: F401  (toy_site: a fixture)

QUESTION = "Tell me about the quick brown fox."
INSTRUCTIONS = "You are a tiny random model."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


class Place(BaseModel):
    city: str = Field(max_length=10)
    days: int


@pytest.fixture(scope="module")
def loaded(toy_site, tmp_path_factory):
    return load_toy(toy_site, write_toy(tmp_path_factory.mktemp("toy") / "toy", "qwen2.5"))


@pytest.fixture(scope="module")
def root(loaded):
    with served(loaded) as url:
        yield url


@pytest.fixture(scope="module")
def client(root):
    return serving.openai_client(root + "/v1")


def greedy(loaded, messages: list[dict], max_tokens: int):
    """lollm's own greedy generation on the prompt of ``messages``: (prompt ids, result)."""
    ids = loaded.tokenizer.encode_chat(messages, add_generation_prompt=True, parse_special=False)
    sampling = resolve_sampling({"temperature": 0.0}, loaded.checkpoint.generation_config,
                                loaded.family.family.sampling_defaults)
    return ids, generate(loaded.model, ids, max_new_tokens=max_tokens, sampling=sampling, stop_ids=[0],
                         tokenizer=loaded.tokenizer)


def test_create_and_stream_give_the_reference_text(client, loaded):
    ids, expected = greedy(loaded, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}], 20)
    request = dict(model=NAME, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=20, temperature=0)
    reply = client.responses.create(**request)
    assert reply.output_text == expected.text and reply.object == "response" and reply.model == NAME
    assert reply.status == ("completed" if expected.stop_reason == "eos" else "incomplete")
    assert reply.usage.input_tokens == len(ids) and reply.usage.output_tokens == len(expected.new_ids)

    deltas, kinds = [], []
    with client.responses.stream(**request) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
    final = event.response  # response.completed, or response.incomplete (get_final_response wants the first only)
    assert "".join(deltas) == expected.text and len(deltas) > 1
    assert final.output_text == expected.text and final.usage.output_tokens == reply.usage.output_tokens
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if reply.status == "completed" else "response.incomplete"]


def test_parse_with_a_pydantic_model(client):
    for _ in range(3):
        reply = client.responses.parse(model=NAME, input=QUESTION, text_format=Place, max_output_tokens=120,
                                       temperature=1)
        assert isinstance(reply.output_parsed, Place), reply


def test_a_function_call_and_its_output(client):
    reply = client.responses.create(model=NAME, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=300, temperature=1)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and reply.status == "completed", reply
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = [{"role": "user", "content": QUESTION}, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    again = client.responses.create(model=NAME, input=follow, tools=[WEATHER], max_output_tokens=4, temperature=0)
    assert again.usage.input_tokens > reply.usage.input_tokens
    # the same conversation, continued from the stored response instead of sent again
    chained = client.responses.create(model=NAME, previous_response_id=reply.id, tools=[WEATHER], max_output_tokens=4,
                                      temperature=0, input=[follow[-1]])
    assert chained.usage.input_tokens == again.usage.input_tokens and chained.output_text == again.output_text


def test_previous_response_id_continues_the_conversation(client, loaded):
    first = client.responses.create(model=NAME, input=QUESTION, max_output_tokens=8, temperature=0)
    second = client.responses.create(model=NAME, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"}]
    ids, expected = greedy(loaded, messages, 8)
    assert second.usage.input_tokens == len(ids) and second.output_text == expected.text
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_an_unknown_or_unstored_response_is_a_404(client):
    import openai

    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        client.responses.create(model=NAME, input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    unstored = client.responses.create(model=NAME, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_is_bounded():
    from lollm.serve.requests import ApiError
    from lollm.serve.responses import ResponseStore

    store = ResponseStore(size=2, seconds=3600)
    for ident in ("a", "b", "c"):
        store.put({"id": ident}, [])
    with pytest.raises(ApiError) as refused:
        store.get("a")
    assert refused.value.status == 404 and "2 stored responses" in refused.value.message
    assert store.get("c")[0] == {"id": "c"}
    aged = ResponseStore(size=2, seconds=0)
    aged.put({"id": "a"}, [])
    with pytest.raises(ApiError):
        aged.get("a")


BAD = [
    ({"input": QUESTION, "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
    ({"input": QUESTION, "text": {"format": {"type": "regex"}}}, "text.format"),
    ({"input": QUESTION, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": QUESTION, "top_logprobs": 2}, "top_logprobs"),
    ({"input": QUESTION, "reasoning": {"effort": "high"}}, "reasoning.effort"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[field for _, field in BAD])
def test_a_bad_request_is_a_400_naming_the_field(root, body, field):
    status, _, answer = serving.post(root + "/v1/responses", {"model": NAME, **body})
    assert status == 400 and answer["error"]["param"] == field, answer
    assert field in answer["error"]["message"], answer


@pytest.fixture(scope="module")
def thinking(toy_site, tmp_path_factory):
    loaded = load_toy(toy_site, write_toy(tmp_path_factory.mktemp("toy35") / "toy", "qwen3.5", think_often=True))
    with served(loaded) as url:
        yield serving.openai_client(url + "/v1")


@pytest.mark.parametrize("streaming", [False, True])
def test_the_thinking_is_a_reasoning_item(thinking, streaming):
    # seeded (lollm's extension): unseeded, a draw that closes the thinking at once leaves no reasoning item
    request = dict(model=NAME, input=QUESTION, reasoning={"effort": "medium"}, max_output_tokens=600, temperature=1,
                   extra_body={"seed": 3},
                   text={"format": {"type": "json_schema", "name": "place", "schema": Place.model_json_schema()}})
    if streaming:
        with thinking.responses.stream(**request) as stream:
            reply = stream.get_final_response()
    else:
        reply = thinking.responses.create(**request)
    assert [item.type for item in reply.output] == ["reasoning", "message"], reply
    assert reply.output[0].content[0].text and "</think>" not in reply.output[0].content[0].text
    Place.model_validate_json(reply.output_text)
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens < reply.usage.output_tokens
