"""The Messages API's ``thinking.budget_tokens``, kept (lollm.serve.thinking_budget), on the toy family under Qwen3.5's
and Qwen3's real templates, through the official ``anthropic`` client.

* with a budget of 8 the thinking is the model's first 8 tokens, then the server's ``</think>``
  and the template's gap, then the model's answer: equal to lollm's own greedy generation of
  those two pieces (the reference), and the stream's blocks equal the whole answer's;
* a model that closes its thinking before the budget keeps its own thinking (the same as without a budget);
* a JSON schema binds the answer after a cut thinking (8 seeds, temperature 1);
* Qwen3's template (the model chooses whether it thinks): an answer begun without thinking is not cut by the
  budget; with a budget and a schema, a 400 naming the field.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from lollm.generate.loop import generate
from lollm.sampling_params import resolve_sampling

from _serve_apis import NAME, anthropic_client, load_toy, served, toy_site, write_toy  # noqa: F401  (toy_site: a fixture)

QUESTION = [{"role": "user", "content": "Where is the fox?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}
BUDGET = 8


@pytest.fixture(scope="module")
def plain_loaded(toy_site, tmp_path_factory):
    """Qwen3.5's template opens the thinking; the random toy almost never closes it (the budget must)."""
    return load_toy(toy_site, write_toy(tmp_path_factory.mktemp("plain35") / "toy", "qwen3.5"))


@pytest.fixture(scope="module")
def plain(plain_loaded):
    with served(plain_loaded) as root:
        yield root


@pytest.fixture(scope="module")
def often(toy_site, tmp_path_factory):
    """Qwen3.5's template; the toy closes its thinking after some 30 sampled tokens."""
    with served(load_toy(toy_site, write_toy(tmp_path_factory.mktemp("often35") / "toy", "qwen3.5",
                                             think_often=True))) as root:
        yield root


@pytest.fixture(scope="module")
def qwen3(toy_site, tmp_path_factory):
    with served(load_toy(toy_site, write_toy(tmp_path_factory.mktemp("toy3") / "toy", "qwen3"))) as root:
        yield root


def reference(loaded, max_tokens: int) -> tuple[str, str]:
    """(thinking, answer) by lollm's own greedy generation: BUDGET tokens after the prompt, then ``</think>\\n\\n``
    written in, then the rest of ``max_tokens``; each stripped as the thinking blocks are."""
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode_chat(QUESTION, add_generation_prompt=True, parse_special=False, enable_thinking=True)
    sampling = resolve_sampling({"temperature": 0.0}, loaded.checkpoint.generation_config,
                                loaded.family.family.sampling_defaults)
    first = generate(loaded.model, ids, max_new_tokens=BUDGET, sampling=sampling, stop_ids=[0], tokenizer=tokenizer)
    assert len(first.new_ids) == BUDGET and "</think>" not in first.text  # the thinking did not close by itself
    written = tokenizer.encode("</think>\n\n", add_special_tokens=False, parse_special=True)
    rest = max_tokens - BUDGET - len(written)
    second = generate(loaded.model, ids + first.new_ids + written, max_new_tokens=rest, sampling=sampling,
                      stop_ids=[0], tokenizer=tokenizer)
    return first.text.strip(), second.text.lstrip()


def test_the_thinking_ends_at_the_budget_and_the_answer_follows(plain, plain_loaded):
    client = anthropic_client(plain)
    request = dict(model=NAME, max_tokens=40, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": BUDGET},
                   extra_body={"temperature": 0})
    reply = client.messages.create(**request)
    thinking, answer = reference(plain_loaded, 40)
    assert [b.type for b in reply.content] == ["thinking", "text"], reply
    assert (reply.content[0].thinking, reply.content[1].text) == (thinking, answer)
    assert reply.usage.output_tokens == 40 and reply.stop_reason == "max_tokens"
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in reply.content]

    unbudgeted = client.messages.create(**{**request, "thinking": {"type": "adaptive"}})
    assert [b.type for b in unbudgeted.content] == ["thinking"]  # without the budget the toy thinks to the limit
    assert unbudgeted.content[0].thinking.startswith(thinking) and len(unbudgeted.content[0].thinking) > len(thinking)


def test_a_thinking_closed_before_the_budget_is_the_models_own(often):
    client = anthropic_client(often)
    closed = 0
    for seed in range(4):
        request = dict(model=NAME, max_tokens=300, messages=QUESTION, extra_body={"temperature": 1, "seed": seed})
        free = client.messages.create(**request, thinking={"type": "adaptive"})
        kept = client.messages.create(**request, thinking={"type": "enabled", "budget_tokens": 200})
        if len(free.content) > 1:  # the model closed its thinking, some 30 tokens in, well before the budget
            closed += 1
            assert kept.content[0].thinking == free.content[0].thinking, seed
            assert [b.type for b in kept.content][:2] == ["thinking", "text"], kept
            if closed == 1:  # the stream of a budget the model did not need: the same blocks
                with client.messages.stream(**request, thinking={"type": "enabled", "budget_tokens": 200}) as stream:
                    assert [b.to_dict() for b in stream.get_final_message().content] == [b.to_dict() for b in kept.content]
    assert closed >= 2  # most seeds close the thinking (some 30 tokens in)


def test_json_after_a_cut_thinking_validates_on_8_seeds(plain):
    client = anthropic_client(plain)
    for seed in range(8):
        reply = client.messages.create(
            model=NAME, max_tokens=200, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": BUDGET},
            output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
            extra_body={"temperature": 1, "seed": seed})
        assert [b.type for b in reply.content] == ["thinking", "text"] and reply.stop_reason == "end_turn", (seed, reply)
        jsonschema.validate(json.loads(reply.content[1].text), SCHEMA)


def test_a_budget_with_a_schema_where_the_model_may_not_think_is_refused(qwen3):
    with pytest.raises(anthropic.BadRequestError) as caught:
        anthropic_client(qwen3).messages.create(
            model=NAME, max_tokens=50, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": BUDGET},
            output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert "thinking.budget_tokens" in caught.value.body["error"]["message"]


def test_a_budget_where_the_model_chooses_whether_it_thinks(qwen3):
    """Qwen3's template: the greedy toy answers at once, without <think>; the budget cuts nothing (phase 2 goes on
    with the answer), so the answer is the one without a budget, and the stream equals it."""
    client = anthropic_client(qwen3)
    request = dict(model=NAME, max_tokens=30, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": BUDGET},
                   extra_body={"temperature": 0})
    reply = client.messages.create(**request)
    assert reply.usage.output_tokens == 30 and reply.stop_reason == "max_tokens", reply
    assert reply.content == client.messages.create(**{**request, "thinking": {"type": "adaptive"}}).content
    with client.messages.stream(**request) as stream:
        assert [b.to_dict() for b in stream.get_final_message().content] == [b.to_dict() for b in reply.content]

