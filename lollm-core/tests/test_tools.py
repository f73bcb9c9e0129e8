"""lollm.serve.tools: the call formats, the parser on tricky text, and the real chat templates rendering tools.

The templates are the real ones (lollm.cli.hub_configs: Qwen2.5, Qwen3,
Qwen3.5, Gemma 3 and 4); a call rendered by a template in an earlier assistant
turn must read back, through the format :func:`format_of` picks for that
template, as the same call: the template and the parser are independent routes
to one format.
"""

from __future__ import annotations

import json
import random

import pytest

from lollm.cli.hub_configs import hub_configs_dir
from lollm.tokenizer.chat import ChatTemplate
from lollm.serve.tool_formats import GEMMA4, QWEN_JSON, QWEN_XML, JsonCalls, ToolCall, ToolRequestError, format_of
from lollm.serve.tools import MarkerText, ToolCallParser, read_tools, split_calls, template_tool_calls

pytest_plugins = ["conftest_gguf"]  # the qwen25_gguf fixture: the real Qwen2.5 GGUF

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "units": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name[4:]}", "parameters": schema}}
         for name, schema in SCHEMAS.items()]


def read(fmt, text: str, pieces: int | None = None, seed: int = 0, **options) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]) of ``text`` fed whole, or cut into random pieces of 1..pieces characters."""
    parser = ToolCallParser(fmt, SCHEMAS, **options)
    events, at, rng = [], 0, random.Random(seed)
    while at < len(text):
        step = len(text) if pieces is None else rng.randint(1, pieces)
        events += parser.feed(text[at:at + step])
        at += step
    content, calls = split_calls(events + parser.finish())
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in calls)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_two_calls_after_content():
    assert read(QWEN_JSON, TWO_CALLS) == ("Let me check.", [("get_weather", {"city": "Paris", "days": 2}),
                                                           ("get_time", {})])


@pytest.mark.parametrize("seed", range(40))
def test_any_cut_into_pieces_reads_the_same(seed):
    # the stream and the whole text go through the same parser: pieces change nothing
    text = TWO_CALLS + "\n\nDone <tool_ca ll> <tool_call>\n{bad json}\n</tool_call> tail"
    assert read(QWEN_JSON, text, pieces=7, seed=seed) == read(QWEN_JSON, text)


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # malformed JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # cut before the end marker
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # a function not offered
    '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {}, "extra": 1}\n</tool_call>',  # not {name, arguments}
    '<tool_call>\n[1, 2]\n</tool_call>',
    '<tool_call>' + "[" * 5000 + "</tool_call>",  # deeper than json's recursion
])
def test_a_block_that_does_not_parse_is_content(text):
    assert read(QWEN_JSON, text) == (text, [])


def test_a_bad_block_beside_a_good_one():
    bad = '<tool_call>\n{"name": 1}\n</tool_call>'
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert read(QWEN_JSON, bad + "\n" + good) == (bad, [("get_time", {})])


def test_text_that_only_looks_like_a_marker_is_content():
    text = "Use <tool_c and <tool_calls> or </tool_call> as you like; 2 < 3."
    assert read(QWEN_JSON, text, pieces=3) == (text, [])


def test_held_whitespace_and_partial_markers_come_out_at_the_end():
    assert read(QWEN_JSON, "Answer: 42  \n<tool_") == ("Answer: 42  \n<tool_", [])


def test_one_call_only_closed_by_the_stop_string():
    # parallel_tool_calls false: the generation stops on '</tool_call>', which the text then lacks
    parser = ToolCallParser(QWEN_JSON, SCHEMAS, max_calls=1)
    events = parser.feed('<tool_call>\n{"name": "get_time", "arguments": {}}\n')
    content, calls = split_calls(events + parser.finish(closed=True))
    assert content == "" and [c.name for c in calls] == ["get_time"]


def test_xml_format_reads_values_by_their_schema():
    text = ("I will look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    assert read(QWEN_XML, text, pieces=5) == ("I will look.", [("get_weather", {"city": "New York", "days": 3})])
    wrong = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    assert read(QWEN_XML, wrong) == (wrong, [])  # 'three' is no integer
    untyped = "<tool_call>\n<function=get_weather>\n<parameter=x>\n[1]\n</parameter>\n<parameter=y>\nhi\n</parameter>\n</function>\n</tool_call>"
    assert read(QWEN_XML, untyped) == ("", [("get_weather", {"x": [1], "y": "hi"})])  # not in the schema: JSON, else text


def test_gemma4_format_reads_its_value_syntax():
    text = '<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3,extra:{a:[1,true,null,<|"|>b<|"|>]}}<tool_call|>'
    assert read(GEMMA4, text, pieces=4) == ("", [("get_weather", {"city": 'Paris, "FR"', "days": 3,
                                                                  "extra": {"a": [1, True, None, "b"]}})])
    for bad in ('<|tool_call>call:get_weather{city:Paris}<tool_call|>', '<|tool_call>call:get_weather{days:3,}<tool_call|>'):
        assert read(GEMMA4, bad) == (bad, [])


def test_streamed_deltas_concatenate_to_the_call():
    call = ToolCall("call_x", "get_weather", '{"city": "Paris"}')
    deltas = call.deltas(3)
    assert deltas[0]["id"] == "call_x" and deltas[0]["function"]["name"] == "get_weather"
    assert all(d["index"] == 3 for d in deltas)
    assert "".join(d["function"]["arguments"] for d in deltas) == call.arguments


# -- the real templates ----------------------------------------------------------------------------


def template_source(folder: str) -> str | None:
    path = hub_configs_dir() / folder
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    return json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")


TEMPLATES = {"Qwen__Qwen2.5-7B-Instruct": QWEN_JSON, "Qwen__Qwen3-4B": QWEN_JSON, "Qwen__Qwen3.5-0.8B": QWEN_XML,
             "google__gemma-4-E2B-it": GEMMA4, "google__gemma-3-270m-it": None}


@pytest.mark.parametrize("folder", TEMPLATES)
def test_format_of_each_real_template(folder):
    assert format_of(template_source(folder)) is TEMPLATES[folder]


SPECIALS = {"bos_token": "<bos>", "eos_token": "<eos>"}


@pytest.mark.parametrize("folder", [f for f, fmt in TEMPLATES.items() if fmt is not None])
def test_a_rendered_call_reads_back_as_the_same_call(folder):
    fmt = TEMPLATES[folder]
    arguments = {"city": "São Paulo", "days": 2}
    sent = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": template_tool_calls(sent, "messages[2]")},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'}]
    text = ChatTemplate(template_source(folder), folder).render(messages, add_generation_prompt=True, tools=TOOLS,
                                                               special_tokens=SPECIALS)
    assert '"get_weather"' in text or "get_weather{" in text  # the tools are offered in the system turn
    assert "clear" in text  # and the result renders
    start = text.index(fmt.start, text.index("Weather?"))
    end = text.index(fmt.end, start) + len(fmt.end)
    assert read(fmt, text[start:end]) == ("", [("get_weather", arguments)])


# -- a request's tools ---------------------------------------------------------------------------


QWEN25 = template_source("Qwen__Qwen2.5-7B-Instruct")


def test_read_tools_defaults_and_choices():
    request = read_tools({"tools": TOOLS}, QWEN25)
    assert (request.choice, request.name, request.parallel, request.fmt) == ("auto", None, True, QWEN_JSON)
    assert read_tools({"tools": TOOLS, "tool_choice": "none"}, QWEN25) is None
    assert read_tools({"tool_choice": "none"}, QWEN25) is None
    named = read_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                        "parallel_tool_calls": False}, QWEN25)
    assert (named.choice, named.name, named.parallel, named.stops()) == ("function", "get_time", False, ["</tool_call>"])


@pytest.mark.parametrize("body, param, words", [
    ({"tools": "all"}, "tools", "list"),
    ({"tools": [{"type": "function"}]}, "tools[0]", '"type": "function"'),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name", "two tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters", "schema"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "does not offer"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
])
def test_read_tools_refuses_naming_the_field(body, param, words):
    with pytest.raises(ToolRequestError, match=words) as error:
        read_tools(body, QWEN25)
    assert error.value.param == param


def test_a_template_without_tools_is_refused_with_the_reason():
    with pytest.raises(ToolRequestError, match="does not render tools") as error:
        read_tools({"tools": TOOLS}, template_source("google__gemma-3-270m-it"))
    assert error.value.param == "tools"


@pytest.mark.parametrize("arguments, words", [("{not json", "not valid JSON"), ("[1]", "JSON object")])
def test_tool_call_messages_need_object_arguments(arguments, words):
    call = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]
    with pytest.raises(ToolRequestError, match=words):
        template_tool_calls(call, "messages[1]")


def test_the_answer_of_a_whole_text():
    request = read_tools({"tools": TOOLS}, QWEN25)
    malformed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    assert request.answer(malformed, "eos") == (malformed, [])  # content, and the server says finish "stop"
    content, calls = request.answer(TWO_CALLS, "eos")
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    single = read_tools({"tools": TOOLS, "parallel_tool_calls": False}, QWEN25)
    cut = '<tool_call>\n{"name": "get_time", "arguments": {}}\n'  # stopped on the '</tool_call>' stop string
    assert [c.name for c in single.answer(cut, "stop_string")[1]] == ["get_time"]
    assert single.answer(cut, "max_new_tokens") == (cut, [])  # cut by max_tokens: the unfinished call is content


def test_a_forced_call_is_a_grammar_of_the_format_and_the_schemas():
    named = read_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                        "parallel_tool_calls": False}, QWEN25).grammar
    assert named.kind == "grammar" and '"<tool_call>\\n"' in named.value and '"\\n</tool_call>"' in named.value
    assert '"const": "get_weather"' in named.value and "get_time" not in named.value and "block)*" not in named.value
    required = read_tools({"tools": TOOLS, "tool_choice": "required"}, QWEN25).grammar
    assert '"anyOf"' in required.value and '"const": "get_time"' in required.value and "block)*" in required.value
    assert read_tools({"tools": TOOLS}, QWEN25).grammar is None  # auto: free text
    with pytest.raises(ToolRequestError, match="does not have yet"):  # no grammar of Gemma 4's format yet: refused
        read_tools({"tools": TOOLS, "tool_choice": "required"}, template_source("google__gemma-4-E2B-it"))


XML_SCHEMAS = {"get_weather": {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "note": {"type": "string", "maxLength": 12}, "opts": {"type": "object", "properties": {"a": {"type": "boolean"}}}}},
    "get_time": {"type": "object", "properties": {}}}
XML_GOOD = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=note>\nhi <b>\nok'
            '\n</parameter>\n<parameter=opts>\n{"a": true}\n</parameter>\n</function>\n</tool_call>\n'
            '<tool_call>\n<function=get_time>\n</function>\n</tool_call>')


@pytest.mark.parametrize("text, allowed", [
    (XML_GOOD, True),
    (XML_GOOD.replace("Rome", "Oslo"), False),  # not in the enum
    (XML_GOOD.replace("<parameter=city>\nRome\n</parameter>\n", ""), False),  # a required parameter missing
    (XML_GOOD.replace("hi <b>\nok", "a note far too long"), False),  # over maxLength
    (XML_GOOD.replace('{"a": true}', '{"a": 1}'), False),  # not a boolean
    (XML_GOOD.replace("Rome\n</parameter>", "Rome\n</parameter>\n</parameter>"), False),  # the value ended at the tag
])
def test_the_xml_grammar_on_the_real_tokenizer(qwen25_gguf, text, allowed):
    from lollm.generate.structured import ConstraintError, compile_constraint
    from lollm.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(qwen25_gguf)
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    grammar = QWEN_XML.constraint(XML_SCHEMAS, parallel=True)
    matcher = compile_constraint(grammar, tokenizer, vocab_size=151936, stop_ids=end).matcher()
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token)
        accepted = matcher.can_end
    except ConstraintError:
        accepted = False
    assert accepted is allowed
    if allowed:  # and the parser reads what the grammar allowed
        parser = ToolCallParser(QWEN_XML, XML_SCHEMAS)
        calls = split_calls(parser.feed(text) + parser.finish())[1]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Rome", "note": "hi <b>\nok", "opts": {"a": True}}), ("get_time", {})]


@pytest.mark.parametrize("spec, words", [({"type": "string", "pattern": "^a"}, "pattern"), ({"enum": [1, 2]}, "no 'type'")])
def test_the_xml_grammar_refuses_what_it_cannot_enforce(spec, words):
    with pytest.raises(ToolRequestError, match=words):
        QWEN_XML.constraint({"f": {"type": "object", "properties": {"x": spec}}}, parallel=False)


def test_special_markers_are_decoded_for_the_parser(qwen25_gguf):
    # Gemma 4's markers are special tokens; Qwen's <|im_start|> stands in for one here (its <tool_call> is not special)
    from lollm.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(qwen25_gguf)
    fmt = JsonCalls("special", "<|im_start|>", "<|im_end|>", sign="")
    assert QWEN_JSON.marker_ids(tokenizer) == frozenset()
    keep = fmt.marker_ids(tokenizer)
    assert keep == {tokenizer.encode("<|im_start|>", add_special_tokens=False)[0],
                    tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]}
    ids = tokenizer.encode('hi <|im_start|>{"name": "get_time", "arguments": {}}<|im_end|>', add_special_tokens=False)
    plain = tokenizer.stream_decoder(skip_special_tokens=True)
    assert "".join(plain.push(i) for i in ids) + plain.flush() == 'hi {"name": "get_time", "arguments": {}}'
    kept = MarkerText(tokenizer, keep).stream_decoder(skip_special_tokens=True)  # as generate asks for it
    text = "".join(kept.push(i) for i in ids) + kept.flush()
    parser = ToolCallParser(fmt, SCHEMAS)
    content, calls = split_calls(parser.feed(text) + parser.finish())
    assert content == "hi" and [c.name for c in calls] == ["get_time"]
    assert MarkerText(tokenizer, keep).eos_token_id == tokenizer.eos_token_id  # the rest is the tokenizer's own


# -- findings of a first user: what a forced call promises --------------------------------------


def test_a_function_without_parameters_takes_none(qwen25_gguf):
    # OpenAI reads a missing 'parameters' as no parameters: a forced call's arguments are {} and nothing else
    from lollm.generate.structured import ConstraintError, compile_constraint
    from lollm.tokenizer import load_gguf_tokenizer

    tools = [{"type": "function", "function": {"name": "ping"}}]
    request = read_tools({"tools": tools, "tool_choice": "required"}, QWEN25)
    assert request.schemas["ping"] == {"type": "object", "properties": {}, "additionalProperties": False}
    tokenizer = load_gguf_tokenizer(qwen25_gguf)
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    compiled = compile_constraint(request.grammar, tokenizer, vocab_size=151936, stop_ids=end)

    def allowed(arguments: str) -> bool:
        matcher = compiled.matcher()
        try:
            for token in tokenizer.encode(f'<tool_call>\n{{"name": "ping", "arguments": {arguments}}}\n</tool_call>',
                                          add_special_tokens=False):
                matcher.accept(token)
        except ConstraintError:
            return False
        return matcher.can_end

    assert allowed("{}") and not allowed('{"host": "example.org"}')
    xml = read_tools({"tools": tools, "tool_choice": "required"}, template_source("Qwen__Qwen3.5-0.8B")).grammar.value
    assert "<parameter=" not in xml  # the XML format's call has no parameter to write


def test_a_named_function_forces_exactly_one_call_whatever_parallel_says():
    for parallel in (None, True):
        body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
        named = read_tools(body if parallel is None else {**body, "parallel_tool_calls": parallel}, QWEN25)
        assert not named.parallel and "block)" not in named.grammar.value and named.stops() == ["</tool_call>"]
        xml = read_tools(body if parallel is None else {**body, "parallel_tool_calls": parallel},
                         template_source("Qwen__Qwen3.5-0.8B"))
        assert "block)*" not in xml.grammar.value
    assert "block)*" in read_tools({"tools": TOOLS, "tool_choice": "required"}, QWEN25).grammar.value


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "tag"}}])
def test_a_forced_schema_that_cannot_be_enforced_names_the_tool_and_the_keyword(choice):
    tools = TOOLS + [{"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
        "xs": {"type": "array", "uniqueItems": True}}}}}]
    with pytest.raises(ToolRequestError) as error:
        read_tools({"tools": tools, "tool_choice": choice}, QWEN25)
    assert error.value.param == "tools[2].function.parameters"
    assert "uniqueItems" in str(error.value) and "'tag'" in str(error.value) and "start:" not in str(error.value)
    assert read_tools({"tools": tools}, QWEN25).grammar is None  # auto: nothing enforced, nothing refused


@pytest.mark.parametrize("choice", [None, "auto", "required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_model_without_any_chat_template_says_so(choice):
    with pytest.raises(ToolRequestError, match="has no chat template") as error:
        read_tools({"tools": TOOLS, "tool_choice": choice}, None)
    assert error.value.param == "messages"
