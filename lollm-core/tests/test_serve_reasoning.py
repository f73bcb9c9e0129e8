"""Thinking kept apart from the answer (lollm.serve.reasoning), on the toy family under Qwen3.5's and Qwen3's real
templates, through the official clients.

* the splitter gives the same reasoning and content whatever the pieces the text comes in;
* the thinking text appears only in the reasoning fields: ``message.reasoning_content`` and its
  stream deltas (Chat Completions), ``thinking`` blocks (Messages); the content holds no marker;
* ``reasoning_effort`` / ``thinking`` switch the template's ``enable_thinking``;
* a JSON schema binds only what follows ``</think>``: 8 seeds at temperature 1 think, then
  answer JSON that validates (Qwen3.5's template opens the thinking; Qwen3's lets the model open it).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from lollm.generate.loop import generate
from lollm.generate.structured import OutputConstraint
from lollm.sampling_params import resolve_sampling
from lollm.serve.reasoning import ReasoningSplitter, after_thinking, split
from lollm.testing import serving

from _serve_apis import NAME, anthropic_client, load_toy, served, toy_site, write_toy  # noqa: F401  (toy_site: a fixture)

QUESTION = [{"role": "user", "content": "Where is the fox?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}
THINK_ON = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.mark.parametrize("state, text, expected", [
    ("start", "<think>\nhmm\n</think>\n\nYes.", ("hmm", "Yes.")),
    ("start", "  <think>a</think>b", ("a", "b")),
    ("start", "No <think> here", ("", "No <think> here")),
    ("start", "<thi", ("", "<thi")),
    ("inside", "\nstill thinking \n", ("still thinking", "")),
    ("inside", "x</think>\n\n</think>", ("x", "</think>")),
    ("answer", "<think>a</think>b", ("", "<think>a</think>b")),
])
def test_the_splitter_reads_any_cut_the_same(state, text, expected):
    assert split(state, text) == expected
    for seed in range(30):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1)))
        splitter = ReasoningSplitter(state)
        events = [e for a, b in zip([0, *cuts], [*cuts, len(text)]) for e in splitter.feed(text[a:b])] + splitter.finish()
        assert ("".join(t for k, t in events if k == "reasoning"), "".join(t for k, t in events if k == "content")) == expected


def test_a_constraint_after_thinking_keeps_the_rest_of_its_grammar():
    lark = after_thinking(OutputConstraint.regex("[0-9]+"), "inside").value
    assert lark.startswith("start: lollm_thinking \"\\n\\n\" lollm_answer\n") and "lollm_answer: /" in lark
    assert after_thinking(OutputConstraint.regex("[0-9]+"), "answer") == OutputConstraint.regex("[0-9]+")
    assert after_thinking(OutputConstraint.regex("[0-9]+"), None) == OutputConstraint.regex("[0-9]+")


@pytest.fixture(scope="module")
def qwen35_loaded(toy_site, tmp_path_factory):
    return load_toy(toy_site, write_toy(tmp_path_factory.mktemp("toy35") / "toy", "qwen3.5", think_often=True))


@pytest.fixture(scope="module")
def qwen35(qwen35_loaded):
    with served(qwen35_loaded) as root:
        yield root


@pytest.fixture(scope="module")
def qwen3(toy_site, tmp_path_factory):
    loaded = load_toy(toy_site, write_toy(tmp_path_factory.mktemp("toy3") / "toy", "qwen3", think_often=True))
    with served(loaded) as root:
        yield root


def greedy_parts(loaded, max_tokens: int) -> tuple[str, str]:
    """(thinking, answer) of lollm's own greedy generation on QUESTION with thinking on, cut at the first </think>
    (Qwen3.5's template opened the thinking in the prompt; no </think>: all of it is thinking), each stripped of the
    whitespace around it."""
    ids = loaded.tokenizer.encode_chat(QUESTION, add_generation_prompt=True, parse_special=False, enable_thinking=True)
    assert loaded.tokenizer.decode(ids).endswith("<think>\n")
    sampling = resolve_sampling({"temperature": 0.0}, loaded.checkpoint.generation_config,
                                loaded.family.family.sampling_defaults)
    text = generate(loaded.model, ids, max_new_tokens=max_tokens, sampling=sampling, stop_ids=[0],
                    tokenizer=loaded.tokenizer).text
    thinking, _, answer = text.partition("</think>")
    return thinking.strip(), answer.lstrip()


def test_chat_completions_put_the_thinking_in_reasoning_content(qwen35, qwen35_loaded):
    client = serving.openai_client(qwen35 + "/v1")
    request = dict(model=NAME, messages=QUESTION, max_tokens=300, temperature=0, extra_body=THINK_ON)
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    assert (reasoning, message.content) == greedy_parts(qwen35_loaded, 300) and reasoning and "</think>" not in reasoning
    thought, content = [], []
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            thought.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            content.append(choice.delta.content or "")
    assert "".join(thought) == reasoning and "".join(content) == message.content

    off = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=40, temperature=0,
                                         reasoning_effort="none")
    assert off.choices[0].message.model_extra.get("reasoning_content") is None
    assert off.usage.prompt_tokens > reply.usage.prompt_tokens  # the template wrote an empty <think></think> itself


def test_messages_put_the_thinking_in_thinking_blocks(qwen35, qwen35_loaded):
    client = anthropic_client(qwen35)
    request = dict(model=NAME, max_tokens=300, messages=QUESTION, thinking={"type": "enabled", "budget_tokens": 1024},
                   extra_body={"temperature": 0})
    reply = client.messages.create(**request)
    thinking, answer = greedy_parts(qwen35_loaded, 300)
    assert [block.type for block in reply.content] == ["thinking"] + (["text"] if answer else []), reply
    assert (reply.content[0].thinking, "".join(b.text for b in reply.content[1:])) == (thinking, answer)
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in reply.content]


@pytest.mark.parametrize("template", ["qwen35", "qwen3"])
def test_thinking_then_json_that_validates_on_8_seeds(template, request):
    """The model thinks freely, then the schema binds its answer; the thinking is never part of the JSON."""
    client = serving.openai_client(request.getfixturevalue(template) + "/v1")
    thought = 0
    for seed in range(8):
        reply = client.chat.completions.create(
            model=NAME, messages=QUESTION, max_tokens=700, temperature=1, seed=seed, extra_body=THINK_ON,
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}})
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop", (seed, message)
        jsonschema.validate(json.loads(message.content), SCHEMA)
        thought += bool(message.model_extra.get("reasoning_content"))
    assert thought >= (8 if template == "qwen35" else 0)  # Qwen3.5's template opens the thinking; Qwen3's model may


def test_a_forced_tool_call_after_thinking(qwen35):
    client = anthropic_client(qwen35)
    tool = {"name": "locate", "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                               "required": ["city"]}}
    reply = client.messages.create(model=NAME, max_tokens=600, messages=QUESTION, tools=[tool],
                                   tool_choice={"type": "any"}, thinking={"type": "adaptive"},
                                   extra_body={"temperature": 1, "seed": 3})  # unseeded, the thinking may close at once
    assert reply.content[0].type == "thinking" and reply.stop_reason == "tool_use", reply
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert calls and all(c.name == "locate" for c in calls)
    for call in calls:
        jsonschema.validate(call.input, tool["input_schema"])
