"""Structured output (lollm.generate.structured) on a tiny random qwen2 that carries the REAL Qwen2.5 tokenizer and template.

The model's weights are random: at temperature 1 its text is noise over 151,936 ids, so
only the constraint can make the output valid JSON / match the regex. Each output is
checked by an independent route: the ``jsonschema`` package, Python's ``re``, ``json``,
and a scan of the whitespace outside JSON strings. Then the same through ``lollm serve``
(response_format, 400s naming the feature, finish_reason "length") and ``lollm run``.
"""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest

from _qwen_tiny import real_config
from lollm.generate.loop import generate, stop_token_ids
from lollm.load.options import LoadOptions
from lollm.generate.sampling import SamplingParams
from lollm.generate.structured import ConstraintError, OutputConstraint, compile_constraint, tagged_json

SEEDS = range(8)
NAME = "tiny-real-tokenizer"
MESSAGES = [{"role": "user", "content": "Describe an order as JSON."}]

#: Bounded schemas: every string, number and array has a limit, so a complete answer always exists within the budget.
SCHEMAS = {
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "integer_range": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                                                       "floor": {"type": "integer", "minimum": -3, "maximum": 12}},
                      "required": ["age", "floor"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "ok"], "properties": {
        "ok": {"type": "boolean"},
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "address": {"type": "object", "additionalProperties": False, "required": ["zip"],
                        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "array_bounds": {"type": "object", "additionalProperties": False, "required": ["tags", "scores"], "properties": {
        "tags": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"enum": ["a", "b", "c"]}},
        "scores": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
    "optional_fields": {"type": "object", "additionalProperties": False, "required": ["id"], "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 500}, "note": {"type": "string", "maxLength": 6},
        "flag": {"type": "boolean"}, "kind": {"enum": ["x", "y"]}}},
}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, qwen25_dir):
    """A tiny random qwen2 (vocab 151,936) with the real Qwen2.5 tokenizer files and chat template."""
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    raw = shrink_config(real_config("qwen2"), vocab_size=151936)
    folder = write_tiny_checkpoint(raw, tmp_path_factory.mktemp("qwen2-real-tokenizer"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen25_dir / name, folder / name)
    if (qwen25_dir / "chat_template.jinja").exists():
        shutil.copy(qwen25_dir / "chat_template.jinja", folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def loaded(tiny_folder):
    from lollm.load.pipeline import open_model

    return open_model(str(tiny_folder), LoadOptions(device="cpu", dtype="float32"))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP's barriers make them wait."""
    from lollm.testing.serving import one_torch_thread

    with one_torch_thread():
        yield


def _run(loaded, constraint, *, seed, max_new_tokens=160, speculative=0):
    ckpt = loaded.checkpoint
    stops = stop_token_ids(ckpt.generation_config, ckpt.config, loaded.tokenizer)
    compiled = None if constraint is None else compile_constraint(constraint, loaded.tokenizer,
                                                                  vocab_size=loaded.model.vocab_size, stop_ids=stops)
    ids = loaded.tokenizer.encode_chat(MESSAGES, add_generation_prompt=True)
    return generate(loaded.model, ids, max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=1.0, seed=seed),
                    stop_ids=stops, tokenizer=loaded.tokenizer, constraint=compiled)


def free_whitespace(text: str) -> list[str]:
    """Whitespace outside JSON strings that is not the one space after ',' or ':' (an independent scan)."""
    found, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and not (ch == '"' and not escaped)
            continue
        if ch == '"':
            in_string = True
        elif ch.isspace() and not (ch == " " and i > 0 and text[i - 1] in ",:"):
            found.append(f"{ch!r} at {i}")
    return found


def test_without_a_constraint_the_tiny_model_writes_no_json(loaded):
    """The control: the same model, prompt and seeds, unconstrained, never produce valid JSON."""
    for seed in range(3):
        text = _run(loaded, None, seed=seed, max_new_tokens=24).text
        with pytest.raises(ValueError):
            json.loads(text)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates_for_many_seeds(loaded, name):
    schema = SCHEMAS[name]
    texts = set()
    for seed in SEEDS:
        result = _run(loaded, OutputConstraint.json_schema(schema), seed=seed)
        assert result.stop_reason == "eos", (seed, result.stop_reason, result.text)
        jsonschema.validate(json.loads(result.text), schema)
        assert free_whitespace(result.text) == [], result.text
        texts.add(result.text)
    assert len(texts) > 1  # temperature 1 varies the answers: the constraint chose among many


def test_json_object_output_is_an_object(loaded):
    # an open object can run on: give it room, and accept a cut only as "max_new_tokens"
    for seed in range(3):
        result = _run(loaded, OutputConstraint.json_object(), seed=seed, max_new_tokens=60)
        assert result.text.startswith("{")
        if result.stop_reason == "eos":
            assert isinstance(json.loads(result.text), dict)
        else:
            assert result.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[a-z]{2,6}", r"(yes|no|maybe)( because [A-Z][a-z]{1,5}\.)?",
                                     r"#[0-9a-f]{6}"])
def test_regex_output_matches(loaded, pattern):
    for seed in SEEDS:
        result = _run(loaded, OutputConstraint.regex(pattern), seed=seed)
        assert result.stop_reason == "eos"
        assert re.fullmatch(pattern, result.text), (seed, result.text)


def test_tagged_json_is_a_tool_call_block(loaded):
    """The grammar the tools side asks for: Qwen's <tool_call> wrapper around arguments that validate."""
    params = SCHEMAS["integer_range"]
    call = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": "get_age"}, "arguments": params}}
    for seed in range(4):
        result = _run(loaded, tagged_json("<tool_call>\n", call, "\n</tool_call>"), seed=seed)
        found = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", result.text, re.S)
        assert found, result.text
        body = json.loads(found.group(1))
        assert body["name"] == "get_age"
        jsonschema.validate(body["arguments"], params)


def test_cut_by_max_new_tokens_stops_with_that_reason(loaded):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40}}, "required": ["text"]}
    result = _run(loaded, OutputConstraint.json_schema(schema), seed=0, max_new_tokens=5)
    assert result.stop_reason == "max_new_tokens" and len(result.new_ids) == 5


@pytest.mark.parametrize("keyword, schema", [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
    ("not", {"not": {"type": "string"}}),
])
def test_unsupported_schema_keywords_are_named(loaded, keyword, schema):
    ckpt = loaded.checkpoint
    with pytest.raises(ConstraintError, match=keyword):
        compile_constraint(OutputConstraint.json_schema(schema), loaded.tokenizer, vocab_size=loaded.model.vocab_size,
                           stop_ids=stop_token_ids(ckpt.generation_config, ckpt.config, loaded.tokenizer))


# -- lollm serve: response_format ------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(loaded):
    from starlette.testclient import TestClient

    from lollm.serve.server import ModelServer, create_app

    with TestClient(create_app(ModelServer(loaded, name=NAME, context=512))) as test_client:
        yield test_client


def _chat(client, response_format, **fields):
    body = {"model": NAME, "messages": MESSAGES, "temperature": 1.0, "max_tokens": 160, "response_format": response_format,
            **fields}
    return client.post("/v1/chat/completions", json=body)


def test_serve_json_schema_answers_validate(client):
    schema = SCHEMAS["nested"]
    for seed in range(4):
        answer = _chat(client, {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": True}},
                       seed=seed)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_serve_streamed_json_equals_the_answer(client):
    form = {"type": "json_schema", "json_schema": {"name": "tags", "schema": SCHEMAS["array_bounds"]}}
    whole = _chat(client, form, seed=3).json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={"model": NAME, "messages": MESSAGES, "temperature": 1.0,
                                                            "max_tokens": 160, "seed": 3, "stream": True,
                                                            "response_format": form}) as events:
        lines = [line[6:] for line in events.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines if json.loads(line)["choices"])
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMAS["array_bounds"])


def test_serve_json_object_regex_grammar_and_completions(client):
    answer = _chat(client, {"type": "json_object"}, seed=1, max_tokens=200, temperature=0)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"].startswith("{")
    text = _chat(client, {"type": "regex", "regex": "[0-9]{4}"}, seed=1).json()["choices"][0]["message"]["content"]
    assert re.fullmatch("[0-9]{4}", text)
    text = _chat(client, {"type": "grammar", "grammar": 'start: "ja" | "nein"'}, seed=2).json()["choices"][0]["message"]["content"]
    assert text in ("ja", "nein")
    body = {"model": NAME, "prompt": "Numbers:", "max_tokens": 20, "seed": 0, "response_format": {"type": "regex", "regex": "[1-9]{2,3}"}}
    answer = client.post("/v1/completions", json=body).json()
    assert re.fullmatch("[1-9]{2,3}", answer["choices"][0]["text"]) and answer["choices"][0]["finish_reason"] == "stop"


def test_serve_cut_answer_has_finish_reason_length(client):
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 40}}, "required": ["text"]}
    answer = _chat(client, {"type": "json_schema", "json_schema": {"name": "long", "schema": schema}}, max_tokens=4, seed=0)
    assert answer.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("form, named", [
    ({"type": "json_schema", "json_schema": {"name": "u", "schema": {"type": "array", "uniqueItems": True}}}, "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {"type": "string"}}}}, "not"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "(?=a)b"}}}, "look-around"),
    ({"type": "regex", "regex": "(unclosed"}, "regex"),
    ({"type": "grammar", "grammar": "start: missing_rule"}, "missing_rule"),
    ({"type": "xml"}, "'type' is one of"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}}, "json_schema"),
    ({"type": "regex", "regex": "[0-9]", "grammar": "start: x"}, "takes only"),
    ("json", "'type' is one of"),
    ({"type": {}}, "'type' is one of"),  # found by schemathesis: an unhashable 'type' was a 500
    ({"type": ["json_object"]}, "'type' is one of"),
])
def test_serve_refuses_what_it_cannot_enforce_with_a_400_naming_it(client, form, named):
    answer = _chat(client, form)
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"].startswith("response_format")


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {},
                                                                         "additionalProperties": False}}}]


@pytest.mark.parametrize("choice", [None, "auto", "required"])
def test_serve_refuses_response_format_with_tools_unless_tool_choice_is_none(client, choice):
    # under "auto" the JSON grammar rules out the call marker: no call could ever come out
    fields = {"tools": TOOLS, **({} if choice is None else {"tool_choice": choice})}
    answer = _chat(client, {"type": "json_object"}, **fields)
    assert answer.status_code == 400, answer.text
    assert "response_format" in answer.json()["error"]["message"] and answer.json()["error"]["param"] == "tool_choice"
    assert _chat(client, {"type": "json_object"}, tools=TOOLS, tool_choice="none", max_tokens=8).status_code == 200


OPEN_ADDRESS = {"type": "object", "additionalProperties": False, "required": ["address"], "properties": {
    "address": {"type": "object", "properties": {"zip": {"type": "string", "maxLength": 5}}}}}


def test_serve_strict_schema_needs_closed_objects_as_openai_does(client):
    strict = _chat(client, {"type": "json_schema", "json_schema": {"name": "a", "schema": OPEN_ADDRESS, "strict": True}})
    assert strict.status_code == 400, strict.text
    assert strict.json()["error"]["param"] == "response_format.json_schema.schema.properties.address"
    assert "additionalProperties" in strict.json()["error"]["message"]
    for loose in ({"strict": False}, {}):  # plain JSON-Schema semantics: extra keys allowed, nothing refused
        answer = _chat(client, {"type": "json_schema", "json_schema": {"name": "a", "schema": OPEN_ADDRESS, **loose}},
                       max_tokens=8)
        assert answer.status_code == 200, answer.text


def test_open_object_finds_the_first_object_without_additional_properties_false():
    from lollm.generate.structured import open_object

    closed = {"type": "object", "additionalProperties": False}
    assert open_object(SCHEMAS["nested"]) is None and open_object({"type": "string"}) is None
    assert open_object({"type": "object"}) == ""
    assert open_object({**closed, "properties": {"a": {"type": "array", "items": {"properties": {}}}}}) == ".properties.a.items"
    assert open_object({"anyOf": [closed, {"type": ["object", "null"]}]}) == ".anyOf[1]"
    assert open_object({**closed, "$defs": {"P": {"type": "object", "additionalProperties": True}}}) == ".$defs.P"


# -- lollm run --json-schema / --regex / --grammar ----------------------------------------------------


def _lollm_run(*args):
    from typer.testing import CliRunner

    from lollm.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1"})


def test_run_json_schema_from_a_file_and_inline(tiny_folder, tmp_path):
    schema = SCHEMAS["optional_fields"]
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    for given in (path, json.dumps(schema)):
        done = _lollm_run("run", tiny_folder, "-p", "An order, please.", "--json-schema", given, "--temperature", "1",
                          "--seed", "5", "-n", "160", "--json")
        assert done.exit_code == 0, done.output
        record = json.loads(done.stdout)
        jsonschema.validate(json.loads(record["text"]), schema)


def test_run_regex_and_grammar(tiny_folder, tmp_path):
    done = _lollm_run("run", tiny_folder, "-p", "Code?", "--regex", "[A-Z]{2}-[0-9]{3}", "--temperature", "1", "--seed", "2",
                      "--json")
    assert done.exit_code == 0, done.output
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", json.loads(done.stdout)["text"])
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: "yes" | "no"\n')
    done = _lollm_run("run", tiny_folder, "-p", "Yes or no?", "--grammar", grammar, "--temperature", "1", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["text"] in ("yes", "no")


@pytest.mark.parametrize("args, named", [
    (["--json-schema", '{"type": "array", "uniqueItems": true}'], "uniqueItems"),
    (["--json-schema", "[1, 2]"], "JSON object"),
    (["--json-schema", "{not json"], "neither a file nor valid JSON"),
    (["--json-schema", "/tmp/nonexist.json"], "--json-schema /tmp/nonexist.json: no such file"),
    (["--regex", "[0-9]", "--grammar", "g.lark"], "--regex and --grammar"),
    (["--grammar", "/nonexistent/g.lark"], "--grammar takes a file path, and /nonexistent/g.lark is no file"),
    (["--grammar", 'start: "yes"'], "--grammar takes a file path"),
    (["--regex", "(("], "--regex: regex '((' cannot be enforced: invalid regex"),
])
def test_run_refuses_a_bad_constraint_before_loading(args, named):
    """Checked before the model is even looked for: the model named here does not exist. One line, no traceback."""
    done = _lollm_run("run", "/nonexistent/model", "-p", "hi", *args)
    assert done.exit_code != 0
    said = done.output + str(done.exception or "")  # lollm.cli.main prints a LollmError's message; the app raises it
    assert named in said and "/nonexistent/model" not in said, said
    assert "\n" not in str(done.exception or "").strip(), said
