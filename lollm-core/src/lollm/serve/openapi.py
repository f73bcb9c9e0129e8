"""``GET /openapi.json`` of ``lollm serve``: the OpenAPI 3.0 description of its endpoints."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from lollm.serve.model_server import ModelServer
from lollm.serve.models import ServedModels
from lollm.serve.requests import IGNORED, MAX_INTEGER, RESPONSE_FORMATS, ROLES

#: One object of the OpenAPI description (a schema, an operation, a response), as JSON.
Schema = dict[str, object]

# Written by hand, small and true to what the handlers accept: a request the schema allows may
# still be refused (a template that rejects the messages, a prompt longer than the context, a
# temperature so small the logits overflow), but never with a status the schema does not list.


def _nullable(schema: Schema) -> Schema:
    return {**schema, "nullable": True}


_INTEGER = {"type": "integer", "minimum": -MAX_INTEGER, "maximum": MAX_INTEGER}
_COMMON_REQUEST = {
    "max_tokens": _nullable({**_INTEGER, "minimum": 1, "description": "default: the rest of the context"}),
    "temperature": _nullable({"type": "number", "minimum": 0, "description": "0: greedy"}),
    "top_p": _nullable({"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}),
    "top_k": _nullable({**_INTEGER, "minimum": -1, "description": "-1 or 0: off"}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "repetition_penalty": _nullable({"type": "number", "minimum": 0, "exclusiveMinimum": True}),
    "seed": _nullable({**_INTEGER, "minimum": 0}),
    "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1}}]}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
}
#: The fields that change nothing here, with the only values accepted (null, or the neutral one).
_IGNORED_REQUEST = {name: {"nullable": True, "enum": [value], "description": "accepted, changes nothing"}
                    for name, value in IGNORED.items()}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
_FUNCTION_CALL = {"type": "object", "required": ["name", "arguments"], "properties": {
    "name": {"type": "string"}, "arguments": {"type": "string", "description": "a JSON object, as text"}}}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]}, "function": _FUNCTION_CALL}}
_MESSAGE = {
    "type": "object", "required": ["role"], "additionalProperties": False,
    "properties": {"role": {"type": "string", "enum": list(ROLES)},
                   "content": _nullable({"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}],
                                         "description": "null only for an assistant message with tool_calls"}),
                   "name": _nullable({"type": "string"}), "reasoning_content": _nullable({"type": "string"}),
                   "tool_calls": _nullable({"type": "array", "items": _TOOL_CALL, "description": "an assistant's calls"}),
                   "tool_call_id": _nullable({"type": "string", "description": "a tool message: the call it answers"})},
}
_TOOLS_REQUEST = {
    "tools": _nullable({"type": "array", "maxItems": 128, "description": "functions the model may call (docs/tools.md)",
                        "items": {"type": "object", "required": ["type", "function"], "properties": {
                            "type": {"type": "string", "enum": ["function"]},
                            "function": {"type": "object", "required": ["name"], "properties": {
                                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                "description": {"type": "string"}, "parameters": {"type": "object"}}}}}}),
    "tool_choice": _nullable({"anyOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}),
    "parallel_tool_calls": _nullable({"type": "boolean"}),
}
_RESPONSE_FORMAT = _nullable({"type": "object", "required": ["type"], "description": "docs/structured-output.md", "properties": {
    "type": {"type": "string", "enum": list(RESPONSE_FORMATS)},
    "json_schema": {"type": "object", "required": ["schema"], "properties": {
        "name": {"type": "string"}, "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"})}},
    "regex": {"type": "string", "minLength": 1}, "grammar": {"type": "string", "minLength": 1}}})
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
_FINISH = {"type": "string", "enum": ["stop", "length"]}
_CHAT_FINISH = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
_CHAT_ANSWER = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["chat.completion"]}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "finish_reason": _CHAT_FINISH, "logprobs": _nullable({"type": "object"}),
        "message": {"type": "object", "required": ["role", "content"],
                    "properties": {"role": {"type": "string"}, "content": _nullable({"type": "string"}),
                                   "tool_calls": {"type": "array", "items": _TOOL_CALL}}}}}}}}
_COMPLETION_ANSWER = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion"]}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE,
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "text", "finish_reason"], "properties": {
        "index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH,
        "logprobs": _nullable({"type": "object"})}}}}}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})}}}}
_ERRORS = {
    "400": "a malformed body or field, an unsupported field, a prompt longer than the context (context_length_exceeded)",
    "401": "--api-key is set and the request's key is missing or wrong (invalid_api_key)",
    "404": "a model this server does not serve (model_not_found)",
    "413": "a body over the server's size limit (request_too_large)",
    "500": "a bug in lollm (the server log has one line about it)",
    "503": "the queue is full (lollm serve --max-queue): try again after Retry-After seconds (server_overloaded); "
           "or the server is shutting down (server_shutting_down)",
}


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _generation_operation(summary: str, request: Schema, answer: Schema) -> Schema:
    errors = {status: _json(_ERROR, text) for status, text in _ERRORS.items()}
    errors["503"] = {**errors["503"], "headers": {"Retry-After": {"description": "seconds to wait",
                                                                  "schema": {"type": "integer"}}}}
    event = {"type": "object", "required": ["data"], "description": "one server-sent event (as OpenAPI 3.2 reads a stream)",
             "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE] at the end"}}}
    ok = {"description": "the answer; with stream: true, server-sent events (data: {chunk} ... data: [DONE])",
          "content": {"application/json": {"schema": answer}, "text/event-stream": {"schema": event}}}
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": ok, **errors}}


_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"type": "string", "enum": ["error"]}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_OPEN = {"type": "object", "description": "see docs/serving.md for the fields supported (any other is a 400)"}
_MESSAGE_ANSWER = {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"], "properties": {
    "id": {"type": "string"}, "type": {"type": "string", "enum": ["message"]}, "role": {"type": "string"},
    "model": {"type": "string"}, "content": {"type": "array", "items": {"type": "object", "required": ["type"]}},
    "stop_reason": {"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
    "stop_sequence": _nullable({"type": "string"}),
    "usage": {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
        "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}}}}
_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"], "properties": {
    "id": {"type": "string"}, "object": {"type": "string", "enum": ["response"]}, "created_at": {"type": "integer"},
    "status": {"type": "string", "enum": ["completed", "incomplete"]}, "model": {"type": "string"},
    "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"], "properties": {
        "type": {"type": "string", "enum": ["reasoning", "message", "function_call"]}, "id": {"type": "string"}}}}}}


def _other_api_paths(model: Schema) -> dict[str, dict[str, Schema]]:
    """The Messages and Responses APIs (lollm.serve.messages, lollm.serve.responses): their requests described loosely
    (the handlers check every field, docs/serving.md lists them), their answers and errors exactly."""
    def errors(schema: Schema, *statuses: str) -> dict[str, Schema]:
        return {status: _json(schema, _ERRORS[status]) for status in statuses}

    messages = {**_OPEN, "required": ["model", "max_tokens", "messages"], "properties": {
        "model": model, "max_tokens": {**_INTEGER, "minimum": 1}, "messages": {"type": "array", "minItems": 1},
        "stream": _nullable({"type": "boolean"})}}
    counting = {**_OPEN, "required": ["model", "messages"], "properties": {
        "model": model, "messages": {"type": "array", "minItems": 1}}}
    responses = {**_OPEN, "required": ["model", "input"], "properties": {
        "model": model, "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]},
        "stream": _nullable({"type": "boolean"})}}
    generation = ("400", "401", "404", "413", "500", "503")
    stream = {"type": "object", "description": "one server-sent event, named (event: ..., data: {...})"}
    counted = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}
    return {
        "/v1/messages": {"post": {
            "summary": "Anthropic's Messages API (docs/serving.md)", "requestBody": {
                "required": True, "content": {"application/json": {"schema": messages}}},
            "responses": {"200": {"description": "the message; with stream: true, Anthropic's named events", "content": {
                "application/json": {"schema": _MESSAGE_ANSWER}, "text/event-stream": {"schema": stream}}},
                **errors(_ANTHROPIC_ERROR, *generation)}}},
        "/v1/messages/count_tokens": {"post": {
            "summary": "the prompt's tokens, as /v1/messages would count them", "requestBody": {
                "required": True, "content": {"application/json": {"schema": counting}}},
            "responses": {"200": _json(counted, "the count"), **errors(_ANTHROPIC_ERROR, "400", "401", "404", "413", "500")}}},
        "/v1/responses": {"post": {
            "summary": "OpenAI's Responses API (docs/serving.md)", "requestBody": {
                "required": True, "content": {"application/json": {"schema": responses}}},
            "responses": {"200": {"description": "the response; with stream: true, its semantic events", "content": {
                "application/json": {"schema": _RESPONSE}, "text/event-stream": {"schema": stream}}},
                **errors(_ERROR, *generation)}}},
        "/v1/responses/{response_id}": {"get": {
            "summary": "a stored response (the last 1024, for an hour)", "parameters": [
                {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": _json(_RESPONSE, "the response"), **errors(_ERROR, "401", "500"),
                          "404": _json(_ERROR, "no such response is stored (response_not_found)")}}},
    }


def openapi_schema(server: ModelServer | ServedModels) -> Schema:
    """The OpenAPI 3.0 description of ``server``'s endpoints (served at ``/openapi.json``).

    server: one :class:`ModelServer`, or the models of a server (:class:`ServedModels`); with several,
            the token ids of a prompt have no upper bound here (each model checks its own vocabulary).
    """
    one = server if isinstance(server, ModelServer) else server.first.server if len(server.entries) == 1 else None
    names = [one.name] if one is not None else server.names
    model = {"type": "string", "enum": names, "description": "a served model's name (404 for any other)"}
    chat = {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
        **_IGNORED_REQUEST, "model": model, **_COMMON_REQUEST, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "max_completion_tokens": _COMMON_REQUEST["max_tokens"], "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20, "description": "needs logprobs: true"}),
        "chat_template_kwargs": _nullable({"type": "object", "description": "variables the chat template reads"}),
        "response_format": _RESPONSE_FORMAT, **_TOOLS_REQUEST}}
    token = {"type": "integer", "minimum": 0, **({"maximum": one.model.vocab_size - 1} if one is not None else {})}
    ids = {"type": "array", "minItems": 1, "items": token}
    text = {"type": "string", "minLength": 1}
    prompt = {"anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [text, ids]}}]}
    completion = {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
        **_IGNORED_REQUEST, "model": model, **_COMMON_REQUEST, "prompt": prompt,
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}), "response_format": _RESPONSE_FORMAT}}
    listing = {"type": "object", "required": ["object", "data"], "properties": {"object": {"type": "string"}, "data": {
        "type": "array", "items": {"type": "object", "required": ["id"], "properties": {
            "id": {"type": "string"}, "loaded": {"type": "boolean", "description": "lollm's: whether it is in memory"},
            "vision": {"type": "boolean", "description": "lollm's: whether it may read images (image_url parts)"}}}}}}
    health = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    paths: dict[str, dict[str, Schema]] = {
        "/v1/chat/completions": {"post": _generation_operation("chat: messages through the chat template", chat, _CHAT_ANSWER)},
        "/v1/completions": {"post": _generation_operation("completion of a prompt (text or token ids)", completion,
                                                          _COMPLETION_ANSWER)},
        "/v1/models": {"get": {"summary": "the models served, each with whether it is loaded", "responses": {
            "200": _json(listing, "the model list"), "401": _json(_ERROR, _ERRORS["401"]), "500": _json(_ERROR, _ERRORS["500"])}}},
        "/health": {"get": {"summary": "whether the server is up, and its request counters (no key needed)",
                            "responses": {"200": _json(health, "the server is up")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics: running and waiting requests, KV blocks, tokens, time to "
                                        "first token (no key needed)", "responses": {
            "200": {"description": "Prometheus' text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            "501": _json(_ERROR, "prometheus-client is not installed")}}},
        **_other_api_paths(model),
    }
    _guard_answers(paths)
    schema: Schema = {"openapi": "3.0.3", "info": {"title": "lollm serve", "version": _version()}, "paths": paths}
    if server.api_key is not None:
        schema["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages", "/v1/messages/count_tokens",
                     "/v1/responses", "/v1/responses/{response_id}"):
            for operation in paths[path].values():
                operation["security"] = [{"bearer": []}]
    return schema


def _guard_answers(paths: dict[str, dict[str, Schema]]) -> None:
    """Add the answers of lollm.serve.guard to every operation: 403 (a foreign Host or Origin), and 415 to a POST
    (a body not sent as application/json); each operation added later gets them too."""
    for operations in paths.values():
        for method, operation in operations.items():
            operation["responses"].setdefault("403", _json(_ERROR, "the Host or Origin header names another site "
                                                                   "(host_not_allowed, origin_not_allowed)"))
            if method == "post":
                operation["responses"].setdefault("415", _json(_ERROR, "the body is not sent as application/json "
                                                                       "(unsupported_media_type)"))


def _version() -> str:
    try:
        return version("lollm-core")
    except PackageNotFoundError:
        return "unknown"
