"""`lollm serve` against hostile requests (issue 22, class 1): no request stalls the others, none gets a 500.

The server runs in this process on the toy family (docs/examples/lollm-toy,
made visible as an installed distribution without pip): through Starlette's
TestClient for single requests, and through uvicorn in a thread where two
requests must overlap (lollm.testing.serving.app_in_thread). What each test
proves:

* a text too long for the context is refused before it is tokenized, and a
  body over the size limit with a 413, read or not;
* tokenizing runs off the event loop: /health answers while a tokenizer is busy;
* deeply nested JSON, NaN, huge integers and a tiny top_p are 4xx or a normal
  answer, never a 500;
* a bug is a 500 with a JSON body and exactly one log line;
* /openapi.json describes the endpoints, and random bodies built from it and
  around it (hypothesis) get only the statuses it lists.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lollm.load.plugins as plugins
from lollm.load.options import LoadOptions
from lollm.generate.sampling import Sampler, SamplingParams, top_p_filter
from lollm.serve.app import create_app
from lollm.serve.model_server import ModelServer
from lollm.serve.requests import MAX_JSON_DEPTH, body_limit
from lollm.testing import serving

from _core_helpers import write_site
from test_cli_run import write_checkpoint
from test_example_plugin import EXAMPLE

NAME = "toy"
CONTEXT = 64
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The toy checkpoint (with a ChatML template) loaded in this process, its family seen through a site folder."""
    from lollm.load.pipeline import open_model

    site = write_site(tmp_path_factory.mktemp("site") / "toy", "lollm-toy", "0.1.0", {"toy": "lollm_toy.plugin"},
                      {"lollm_toy": EXAMPLE / "src" / "lollm_toy"})
    folder = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "toy")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(site))
        patch.setattr(plugins, "_REGISTRY", None)
        model = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
        assert model.tokenizer.chat_template is not None
    return model


@pytest.fixture(scope="module")
def server(loaded):
    return ModelServer(loaded, name=NAME, context=CONTEXT)


@pytest.fixture(scope="module")
def client(server):
    from starlette.testclient import TestClient

    with TestClient(create_app(server), raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture
def no_tokenizing(server, monkeypatch):
    """The tokenizer fails the test if it is asked to encode anything."""

    def refuse(*args, **kwargs):
        raise AssertionError("the text was tokenized")

    monkeypatch.setattr(server.tokenizer, "encode", refuse)
    monkeypatch.setattr(server.tokenizer, "encode_chat", refuse)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()["error"]
    assert body["message"] and "Traceback" not in body["message"]
    return body


# -- sizes: refused before the work, not after ---------------------------------------------------


def test_a_text_too_long_for_the_context_is_refused_before_it_is_tokenized(server, client, no_tokenizing):
    long = "x" * ((CONTEXT - 1) * server.token_bytes_bound + 1)  # at least CONTEXT tokens, whatever the merges
    body = error_of(client.post("/v1/completions", json={"model": NAME, "prompt": long}), 400)
    assert body["code"] == "context_length_exceeded" and body["param"] == "prompt"
    chat = {"model": NAME, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": long}]}
    body = error_of(client.post("/v1/chat/completions", json=chat), 400)
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    ids = error_of(client.post("/v1/completions", json={"model": NAME, "prompt": [1] * CONTEXT}), 400)
    assert ids["code"] == "context_length_exceeded"


def test_the_text_bound_is_an_upper_bound_on_what_one_token_stands_for(server, client):
    """So the early check never refuses a text that could fit: no token stands for more bytes than the bound."""
    longest = max(len(server.tokenizer.token_bytes(t)) for t in range(server.tokenizer.vocab_size))
    assert longest <= server.token_bytes_bound
    text = "the quick brown fox"
    reply = client.post("/v1/completions", json={"model": NAME, "prompt": text, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(client, no_tokenizing, chunked):
    limit = body_limit(CONTEXT)
    data = json.dumps({"model": NAME, "prompt": "y" * limit}).encode()
    content = iter([data[i : i + 65536] for i in range(0, len(data), 65536)]) if chunked else data
    response = client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    body = error_of(response, 413)
    assert body["code"] == "request_too_large" and f"{limit:,}" in body["message"]
    assert "images" not in body["message"]  # a text model's limit has no room for images (lollm-gemma's vision test)


def test_the_issue_s_8_mib_prompt_gets_its_413_over_http(server, no_tokenizing):
    """A client that writes all of its body before reading (urllib) still reads the 413: the server drains it."""
    data = json.dumps({"model": NAME, "prompt": "z" * (8 << 20)}).encode()
    with serving.app_in_thread(create_app(server)) as root:
        status, body = serving.http(root + "/v1/completions", data)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert serving.http(root + "/health")[0] == 200


# -- the event loop stays free ------------------------------------------------------------------------


def test_health_answers_while_a_prompt_is_being_tokenized(server, monkeypatch):
    """Tokenizing blocks its thread, not the event loop: /health answers while the tokenizer is busy."""
    busy, release, tokenized = threading.Event(), threading.Event(), threading.Event()
    encode = server.tokenizer.encode

    def slow_encode(text, **kwargs):
        busy.set()
        release.wait(timeout=20)  # hang guard: with the tokenizer on the event loop, /health waits this long
        tokenized.set()
        return encode(text, **kwargs)

    monkeypatch.setattr(server.tokenizer, "encode", slow_encode)
    with serving.app_in_thread(create_app(server)) as root:
        answers = []
        body = json.dumps({"model": NAME, "prompt": "hello there", "max_tokens": 2, "temperature": 0}).encode()
        worker = threading.Thread(target=lambda: answers.append(serving.http(root + "/v1/completions", body)))
        worker.start()
        try:
            assert busy.wait(timeout=60), "the request never reached the tokenizer"
            status, health = serving.http(root + "/health")
            answered_while_busy = not tokenized.is_set()
        finally:
            release.set()
            worker.join(timeout=60)
    assert status == 200 and health["status"] == "ok"
    assert answered_while_busy, "/health waited for the tokenizer: tokenizing ran on the event loop"
    assert answers and answers[0][0] == 200, answers


def test_one_request_at_a_time_has_a_bounded_queue_too(loaded, monkeypatch):
    """The single-sequence path (a family without cache_layers(): the toy's class here, with the method
    taken away): one runs, one waits, the next gets 503."""
    monkeypatch.delattr(type(loaded.model), "cache_layers")
    one_at_a_time = ModelServer(loaded, name=NAME, context=CONTEXT, max_queue=1)
    assert one_at_a_time.engine_loop is None and "cache_layers" in one_at_a_time.single_reason
    release, running = threading.Event(), threading.Event()
    run = one_at_a_time.run

    def held(job):
        running.set()
        release.wait(timeout=60)  # hang guard
        return run(job)

    monkeypatch.setattr(one_at_a_time, "run", held)
    body = {"model": NAME, "prompt": "hello", "max_tokens": 1, "temperature": 0}
    with serving.app_in_thread(create_app(one_at_a_time)) as root:
        answers = []
        ask = lambda: answers.append(serving.post(root + "/v1/completions", body))  # noqa: E731
        first = threading.Thread(target=ask)
        first.start()
        assert running.wait(timeout=60)
        second = threading.Thread(target=ask)
        second.start()
        try:
            deadline = time.monotonic() + 60  # hang guard
            while one_at_a_time.pending < 1:
                assert second.is_alive() and time.monotonic() < deadline, answers
                time.sleep(0.02)
            status, headers, error = serving.post(root + "/v1/completions", body)
        finally:
            release.set()
            first.join(timeout=60)
            second.join(timeout=60)
    assert status == 503 and int(headers["retry-after"]) >= 1 and error["error"]["code"] == "server_overloaded"
    assert [a[0] for a in answers] == [200, 200]


# -- hostile values: 4xx or an answer, never a 500 ----------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE = {
    "deep prompt": (f'{{"model": "toy", "prompt": {nested(100_000)}}}', 400),
    "deep stop": (f'{{"model": "toy", "prompt": "hi", "stop": {nested(900)}}}', 400),
    "deep unknown field": (f'{{"model": "toy", "prompt": "hi", "metadata": {nested(MAX_JSON_DEPTH + 1)}}}', 400),
    "deep object": ('{"model": "toy", "prompt": "hi", "metadata": ' + '{"a": ' * 5000 + "1" + "}" * 5001, 400),
    "NaN": ('{"model": "toy", "prompt": "hi", "temperature": NaN}', 400),
    "Infinity": ('{"model": "toy", "prompt": "hi", "top_p": -Infinity}', 400),
    "1e400": ('{"model": "toy", "prompt": "hi", "temperature": 1e400}', 400),
    "huge top_k": ('{"model": "toy", "prompt": "hi", "top_k": 1' + "0" * 400 + "}", 400),
    "huge max_tokens": ('{"model": "toy", "prompt": "hi", "max_tokens": 1' + "0" * 4000 + "}", 400),
    "too many digits": ('{"model": "toy", "prompt": "hi", "seed": 1' + "0" * 5000 + "}", 400),
    "lone surrogate": ('{"model": "toy", "prompt": "\\ud800"}', 400),
    "not UTF-8": (b'{"model": "toy", "prompt": "\xff\xfe"}', 400),
    "not an object": ("[1, 2]", 400),
    "tiny top_p": ('{"model": "toy", "prompt": "hi", "top_p": 1e-300, "temperature": 1.0, "max_tokens": 3}', 200),
    "tiny top_p chat": ('{"model": "toy", "messages": [{"role": "user", "content": "hi"}], "top_p": 1e-300, '
                        '"temperature": 1, "max_tokens": 3, "stream": true}', 200),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_bodies_get_a_4xx_or_an_answer_never_a_500(client, case):
    raw, status = HOSTILE[case]
    path = "/v1/chat/completions" if "messages" in str(raw) else "/v1/completions"
    response = client.post(path, content=raw if isinstance(raw, bytes) else raw.encode(),
                           headers={"Content-Type": "application/json"})
    if status == 200:
        assert response.status_code == 200, response.text[:500]
        assert '"error"' not in response.text, response.text[:500]  # a stream's error event included
    else:
        error_of(response, status)


def test_a_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    kept = top_p_filter(logits, 1e-300)
    assert torch.isfinite(kept).tolist() == [False, True, False, False]
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1e-300, seed=0))
    assert {sampler(logits, torch.tensor([], dtype=torch.long)) for _ in range(20)} == {1}


# -- a bug: one 500 with a JSON body, one log line -----------------------------------------------------


@pytest.mark.parametrize("path", ["engine", "single"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_exception_is_a_500_with_a_json_body_and_one_log_line(loaded, monkeypatch, caplog, stream, path):
    from starlette.testclient import TestClient

    def broken(*args):
        raise RuntimeError("the worker broke\nsecond line of the message")

    # the batched engine's step, or the single worker's run (a family without cache_layers(), or --mtp)
    server = ModelServer(loaded, name=NAME, context=CONTEXT, batched=path == "engine")
    assert (server.engine_loop is not None) == (path == "engine")
    monkeypatch.setattr(*((server.engine_loop.engine, "step") if path == "engine" else (server, "run")), broken)
    try:
        with TestClient(create_app(server), raise_server_exceptions=False) as client, \
                caplog.at_level(logging.DEBUG, logger="lollm.serve.server"):
            caplog.clear()
            response = client.post("/v1/chat/completions", json={"model": NAME, "messages": HELLO, "stream": stream})
    finally:
        server.close()
    if stream:  # the answer had begun: the error comes as an event
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        body = events[-1]["error"]
    else:
        body = error_of(response, 500)
    assert body["type"] == "server_error" and "internal error" in body["message"] and "broke" not in body["message"]
    errors = [r for r in caplog.records if r.name == "lollm.serve.server" and r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    line = errors[0].getMessage()
    assert "\n" not in line and errors[0].exc_info is None, line
    assert "RuntimeError: the worker broke" in line and "in broken" in line, line


def test_a_wrong_method_is_a_405_with_allow_and_an_unknown_path_a_404(client):
    response = client.get("/v1/completions")
    error_of(response, 405)
    assert "POST" in response.headers.get("allow", "")
    assert error_of(client.get("/v1/nowhere"), 404)["type"] == "not_found"


# -- /openapi.json and the requests around it -----------------------------------------------------------


def test_openapi_describes_the_endpoints(server, client):
    response = client.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.0")
    assert set(schema["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
                                    "/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/{response_id}"}
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    request = chat["requestBody"]["content"]["application/json"]["schema"]
    assert request["properties"]["model"]["enum"] == [NAME] and set(request["required"]) == {"model", "messages"}
    assert {"200", "400", "404", "413", "500", "503"} <= set(chat["responses"])
    prompt = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert json.dumps(server.model.vocab_size - 1) in json.dumps(prompt["properties"]["prompt"])


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", 3]),
                                 "content": st.text(max_size=40) | JSON_VALUES})
FIELDS = {
    "model": st.sampled_from([NAME, NAME, "gpt-4o", None]),
    "max_tokens": st.integers(-2, 8) | JSON_VALUES,
    "temperature": st.floats(0, 3) | st.sampled_from([0, 1e-300, 1e300]) | JSON_VALUES,
    "top_p": st.floats(1e-320, 1) | JSON_VALUES,
    "top_k": st.integers(-2, 400) | JSON_VALUES,
    "min_p": st.floats(0, 1) | JSON_VALUES,
    "repetition_penalty": st.floats(0.01, 5) | JSON_VALUES,
    "seed": st.integers(-1, 2**64) | JSON_VALUES,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=17) | JSON_VALUES,
    "stream": st.booleans() | JSON_VALUES,
    "logprobs": st.booleans() | st.integers(-1, 21) | JSON_VALUES,
    "top_logprobs": st.integers(-1, 21) | JSON_VALUES,
    "n": st.sampled_from([1, 2]),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "messages", "x"]), JSON_VALUES, max_size=2),
}
CHAT_BODY = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=3) | JSON_VALUES},
                                  optional={k: v for k, v in FIELDS.items()})
COMPLETION_BODY = st.fixed_dictionaries(
    {"prompt": st.text(max_size=60) | st.lists(st.integers(-1, 400), max_size=5) | JSON_VALUES},
    optional={k: v for k, v in FIELDS.items() if k not in ("top_logprobs", "chat_template_kwargs")})


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["chat", "completion"]), chat=CHAT_BODY, completion=COMPLETION_BODY)
def test_random_bodies_get_only_the_statuses_the_schema_lists(client, kind, chat, completion):
    """The CI's bounded run of what `nox -s schemathesis` does at length: random bodies, in and out of the schema."""
    path, body = ("/v1/chat/completions", chat) if kind == "chat" else ("/v1/completions", completion)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # the answer's length changes nothing here but the time
    response = client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    listed = client.get("/openapi.json").json()["paths"][path]["post"]["responses"]
    assert str(response.status_code) in listed and response.status_code != 500, (body, response.text[:500])
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif '"error"' in response.text:  # a stream may end in an error event: a refused value, never a bug
        assert "internal error" not in response.text, (body, response.text[-500:])


def test_schemathesis_cases_get_only_the_answers_the_schema_documents(server):
    """A bounded schemathesis run in process (what `nox -s schemathesis` does at length against a live server):
    cases generated from /openapi.json, valid and invalid, get no 5xx and only documented statuses, content
    types and answer shapes."""
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(server))
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    cases = st.one_of(schema.as_strategy(schemathesis.GenerationMode.POSITIVE),
                      schema.as_strategy(schemathesis.GenerationMode.NEGATIVE))

    @settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case):
        case.call_and_validate(checks=checks)

    check()


def test_a_request_without_a_model_says_so(client):
    """No "model" in the body: a 400 naming the parameter and this server's model (not "the model None")."""
    answer = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "model" and error["code"] == "missing_required_parameter"
    assert f"the request has no 'model': name the model this server serves, {NAME!r}" == error["message"]
