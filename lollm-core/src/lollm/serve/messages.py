"""Anthropic's Messages API at ``POST /v1/messages`` (and ``/v1/messages/count_tokens``): what the ``anthropic`` SDKs
and Claude Code speak.

A Messages request is translated into the Chat Completions request it means
(:func:`chat_body`), which the server prepares as any other (one template, one set of
checks, the same constrained decoding and tool machinery); the answer is then shaped
the Anthropic way, whole (:func:`answer`) or as its stream of named events
(:class:`MessagesShaper`). The field mapping, field by field, is in docs/serving.md::

    system (string or text blocks)         -> a system message first
    messages[i].content: text blocks       -> the message's text
      tool_use blocks (assistant)          -> its tool_calls (input as the arguments)
      tool_result blocks (user)            -> one tool message each (tool_call_id: the tool_use_id)
      thinking blocks (assistant)          -> its reasoning_content
    max_tokens, stop_sequences             -> max_tokens, stop
    temperature, top_p, top_k              -> the same (absent: the server's defaults)
    seed (lollm's extension, as in Chat Completions) -> the same: a sampled answer repeats
    tools[i] {name, description, input_schema} -> {"type": "function", "function": {name, description, parameters}}
    tool_choice auto / any / tool / none   -> auto / required / a named function / none
      disable_parallel_tool_use            -> parallel_tool_calls: false
    output_config.format (json_schema)     -> response_format json_schema
    thinking enabled / adaptive / disabled -> the template's enable_thinking on / on / off
      budget_tokens                        -> the thinking ends at that many tokens (lollm.serve.thinking_budget)

A field this server cannot honour is a 400 in Anthropic's error shape (:func:`lollm.serve.error_shapes.anthropic_error`)
naming it; ``cache_control`` on any block and ``metadata`` are accepted and change nothing.
Source: Anthropic's API reference (Messages, Count tokens, Streaming, Errors).
"""

from __future__ import annotations

import json
import re
import uuid

from lollm.generate.loop import GenerationResult
from lollm.serve.answers import answer_parts
from lollm.serve.error_shapes import anthropic_error
from lollm.serve.model_server import ModelServer
from lollm.serve.requests import ApiError, Body, PreparedRequest, parse_body, response_format, short_repr
from lollm.serve.stream import sse
from lollm.serve.thinking_budget import ThinkingBudget, check_budget
from lollm.serve.tool_formats import ToolCall

#: The request fields read here; any other is a 400 (IGNORED_FIELDS are accepted and change nothing).
FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "seed", "tools", "tool_choice", "output_config", "thinking"}
IGNORED_FIELDS = {"metadata", "service_tier"}
#: Content-block fields that change nothing here.
IGNORED_BLOCK_FIELDS = {"cache_control", "citations"}
#: lollm.generate.loop's stop reasons -> Anthropic's ``stop_reason`` (a tool call: "tool_use").
STOP_REASON = {"eos": "end_turn", "stop_string": "stop_sequence", "max_new_tokens": "max_tokens",
               "context": "max_tokens", "cancelled": "end_turn",
               "shutdown": "end_turn"}  # a stream the server's shutdown ended: Anthropic has no closer name
#: A chat field named in an error -> the Messages field it came from.
PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format", "reasoning_effort": "thinking",
          "parallel_tool_calls": "tool_choice.disable_parallel_tool_use", "max_tokens": "max_tokens"}


def renamed(error: ApiError) -> ApiError:
    """``error`` (raised for the translated chat request) with its field and message in the Messages API's names."""
    param = error.param or ""
    param = re.sub(r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema", param)
    param = re.sub(r"^tools\[(\d+)\]\.function\.", r"tools[\1].", param)
    param = PARAMS.get(param, param)
    if param and param != error.param:
        message = error.message.replace(repr(error.param), repr(param)).replace(error.param, param)
        return ApiError(error.status, message, param=param, code=error.code, kind=error.kind, headers=error.headers)
    return error


def _refuse(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param=where)


def _check_fields(value: Body, allowed: set[str], where: str) -> None:
    for key in value:
        if key not in allowed and key not in IGNORED_BLOCK_FIELDS:
            raise _refuse(f"{where}.{str(key)[:100]}", "is not supported by lollm serve")


def _text_of(value: object, where: str) -> str:
    """A string, or a list of text blocks joined with newlines (``system``, a tool_result's ``content``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _refuse(where, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _refuse(at, f"only text blocks are supported here, got {short_repr(block)}")
        _check_fields(block, {"type", "text"}, at)
        texts.append(block["text"])
    return "\n".join(texts)


def _assistant(blocks: list[object], where: str) -> dict[str, object]:
    """An assistant message's blocks (text, tool_use, thinking) as one chat message."""
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            _check_fields(block, {"type", "text"}, at)
            texts.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input", {}), dict):
            _check_fields(block, {"type", "id", "name", "input"}, at)
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": block.get("input", {})}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):
            _check_fields(block, {"type", "thinking", "signature"}, at)
            thoughts.append(block["thinking"])
        else:
            raise _refuse(at, "an assistant's content blocks must be text, tool_use {id, name, input} or thinking; "
                              f"got {short_repr(block)}")
    message: dict[str, object] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _image(block: dict, at: str) -> dict[str, object]:
    """An image block ``{"type": "image", "source": {"type": "base64", "media_type", "data"}}`` as the OpenAI
    content part lollm.serve.requests reads (a ``data:`` URL); ApiError 400 for any other source (a ``url``
    source too: the server fetches nothing)."""
    _check_fields(block, {"type", "source"}, at)
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64":
        kind = source.get("type") if isinstance(source, dict) else source
        raise _refuse(f"{at}.source", f"only base64 image sources are supported (the server fetches nothing), "
                                      f"got {short_repr(kind)}")
    _check_fields(source, {"type", "media_type", "data"}, f"{at}.source")
    media, data = source.get("media_type"), source.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise _refuse(f"{at}.source", "a base64 source needs 'media_type' and 'data' strings")
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _user(blocks: list[object], where: str) -> list[dict[str, object]]:
    """A user message's blocks: each tool_result its own tool message (first), then the text (and images,
    as OpenAI content parts) as a user message."""
    results, parts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            _check_fields(block, {"type", "text"}, at)
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            _check_fields(block, {"type", "tool_use_id", "content", "is_error"}, at)
            content = _text_of(block.get("content", ""), f"{at}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        else:
            raise _refuse(at, "a user's content blocks must be text, image (a base64 source) or tool_result "
                              f"{{tool_use_id, content}} (documents are not supported); got {short_repr(block)}")
    if any(p["type"] == "image_url" for p in parts):
        return results + [{"role": "user", "content": parts}]
    text = "\n".join(p["text"] for p in parts)
    return results + ([{"role": "user", "content": text}] if parts or not results else [])


def chat_messages(body: Body) -> list[dict[str, object]]:
    """``system`` and ``messages`` as chat messages; ApiError 400 naming the block that cannot be read."""
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise _refuse("messages", "must be a non-empty list of messages")
    out = [{"role": "system", "content": _text_of(body["system"], "system")}] if body.get("system") is not None else []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _refuse(where, "must be an object with 'role' (user or assistant) and 'content'")
        _check_fields(message, {"role", "content"}, where)
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise _refuse(f"{where}.content", "must be a string or a list of content blocks")
        out.extend([_assistant(blocks, where)] if message["role"] == "assistant" else _user(blocks, where))
    if value[-1].get("role") == "assistant":
        raise _refuse(f"messages[{len(value) - 1}]", "a last assistant message (a prefill to continue) is not "
                                                     "supported: end with a user message")
    return out


def chat_tools(body: Body, chat: Body) -> None:
    """``tools`` and ``tool_choice`` into ``chat``'s (OpenAI's shapes), checked for what only Messages has."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _refuse("tools", "must be a list of tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            at = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                raise _refuse(f"{at}.type", f"only client tools (type 'custom', or none) are supported, got "
                                            f"{short_repr(tool.get('type') if isinstance(tool, dict) else tool)}")
            _check_fields(tool, {"type", "name", "description", "input_schema"}, at)
            if not isinstance(tool.get("input_schema"), dict):
                raise _refuse(f"{at}.input_schema", "must be a JSON schema object")
            function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            chat["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _refuse("tool_choice", f"must be {{\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}}, got {short_repr(choice)}")
    _check_fields(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    if kind == "tool" and not isinstance(choice.get("name"), str):
        raise _refuse("tool_choice.name", "must name the tool (a string)")
    chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none",
                           "tool": {"type": "function", "function": {"name": choice.get("name")}}}[kind]
    if choice.get("disable_parallel_tool_use") is not None:
        if not isinstance(choice["disable_parallel_tool_use"], bool):
            raise _refuse("tool_choice.disable_parallel_tool_use", "must be true or false")
        chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]


def chat_thinking(value: object, chat: Body) -> None:
    """``thinking`` as the chat request's ``reasoning_effort``: enabled / adaptive: on, disabled: off."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise _refuse("thinking", f"must be {{\"type\": \"enabled\", \"budget_tokens\": N}}, {{\"type\": \"adaptive\"}} or "
                                  f"{{\"type\": \"disabled\"}}, got {short_repr(value)}")
    _check_fields(value, {"type", "budget_tokens", "display"}, "thinking")
    budget = value.get("budget_tokens")
    if kind == "enabled" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
        raise _refuse("thinking.budget_tokens", f"must be a positive integer, got {short_repr(budget)}")
    chat["reasoning_effort"] = "none" if kind == "disabled" else "medium"


def chat_output(value: object, chat: Body) -> None:
    """``output_config`` (its ``format``: a JSON schema) as the chat request's ``response_format``."""
    if not isinstance(value, dict):
        raise _refuse("output_config", "must be an object like {\"format\": {\"type\": \"json_schema\", \"schema\": {...}}}")
    _check_fields(value, {"format", "effort"}, "output_config")  # effort: a hint for Claude models, changes nothing
    spec = value.get("format")
    if spec is None:
        return
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise _refuse("output_config.format", f"must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}, got {short_repr(spec)}")
    _check_fields(spec, {"type", "schema"}, "output_config.format")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"],
                                                                      "strict": False}}


def chat_body(body: Body, *, counting: bool = False) -> Body:
    """The Chat Completions request a Messages request ``body`` means (see the module's table); ApiError 400 naming the
    Messages field that cannot be honoured. ``counting``: a count_tokens request (no max_tokens, no sampling)."""
    allowed = FIELDS | IGNORED_FIELDS
    for key in body:
        if key not in allowed:
            raise ApiError(400, f"unsupported parameter {short_repr(key)}: lollm serve's /v1/messages does not implement "
                                "it", param=str(key)[:100], code="unsupported_parameter")
    if body.get("max_tokens") is None and not counting:
        raise _refuse("max_tokens", "is required")
    chat: Body = {"model": body.get("model"), "messages": chat_messages(body)}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "stream"):
        if body.get(name) is not None and not counting:
            chat[name] = body[name]
    if body.get("stop_sequences") is not None:
        if not isinstance(body["stop_sequences"], list):
            raise _refuse("stop_sequences", "must be a list of strings")
        chat["stop"] = body["stop_sequences"]
    chat_tools(body, chat)
    if body.get("thinking") is not None:
        chat_thinking(body["thinking"], chat)
    if body.get("output_config") is not None:
        chat_output(body["output_config"], chat)
    if counting:
        chat["max_tokens"] = 1
    return chat


def thinking_budget(server: ModelServer, body: Body, chat: Body, plan: PreparedRequest) -> None:
    """``thinking.budget_tokens`` kept (lollm.serve.thinking_budget): the plan's ``extra["thinking_budget"]``, when the
    request enables thinking with a budget and the template leaves the model a thinking to write."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled" or plan.job.reasoning in (None, "answer"):
        return
    tools = plan.job.tools
    if tools is not None and tools.grammar is not None:
        wanted, param = tools.grammar, "tools"
    else:
        wanted, param = response_format(chat.get("response_format")), "response_format"
    budget = ThinkingBudget(thinking["budget_tokens"], plan.job.reasoning, server.compile(wanted, param))
    check_budget(budget, plan.job)
    plan.extra["thinking_budget"] = budget


def prepare(server: ModelServer, raw: bytes) -> PreparedRequest:
    """A Messages request body read, translated and prepared (:meth:`ModelServer.prepare_body`); errors in its names."""
    try:
        body = parse_body(raw)
        chat = chat_body(body)
        plan = server.prepare_body(chat, "chat")
        thinking_budget(server, body, chat, plan)
        return plan
    except ApiError as error:
        raise renamed(error) from None


def count_tokens(server: ModelServer, raw: bytes) -> dict[str, int]:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, as a Messages request of the same body would use them."""
    try:
        plan = server.prepare_body(chat_body(parse_body(raw), counting=True), "chat")
    except ApiError as error:
        raise renamed(error) from None
    return {"input_tokens": len(plan.job.ids)}


# -- the answer -------------------------------------------------------------------------------------


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use(call: ToolCall) -> dict[str, object]:
    """A call as a ``tool_use`` block (its id ``toolu_...``; its input the arguments as an object)."""
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def stop_details(server: ModelServer, plan: PreparedRequest, result: GenerationResult, called: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a generation; ``called``: the answer holds tool calls ("tool_use").

    A stop string met is named when it is one of the client's ``stop_sequences`` (the end
    marker of a single tool call is the server's own: that answer ends as "tool_use").
    """
    reason, met = STOP_REASON[result.stop_reason], None
    if reason == "stop_sequence":
        job = plan.job
        own = [s for s in job.stop if job.tools is None or s not in job.tools.stops()]
        tail = server.tokenizer.decode(result.new_ids)[len(result.text):]
        met = next((s for s in own if tail.startswith(s)), own[0] if len(own) == 1 else None)
        reason = "stop_sequence" if met is not None else "end_turn"
    if called and reason in ("end_turn", "stop_sequence"):
        return "tool_use", None
    return reason, met


def answer(server: ModelServer, plan: PreparedRequest, result: GenerationResult) -> dict[str, object]:
    """The whole answer: a ``message`` with its content blocks (thinking, text, tool_use), stop reason and usage."""
    parts = answer_parts(plan.job, result)
    content: list[dict[str, object]] = []
    if parts.reasoning:
        content.append({"type": "thinking", "thinking": parts.reasoning, "signature": ""})
    if parts.content:
        content.append({"type": "text", "text": parts.content})
    content.extend(tool_use(call) for call in parts.calls)
    reason, sequence = stop_details(server, plan, result, bool(parts.calls))
    return {"id": new_id(), "type": "message", "role": "assistant", "model": server.name, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": len(result.prompt_ids), "output_tokens": len(result.new_ids)}}


class MessagesShaper:
    """The Messages API's stream (a :class:`lollm.serve.stream.Shaper`): ``message_start``, then for each content
    block ``content_block_start``, its deltas, ``content_block_stop``; then ``message_delta`` (stop reason, usage) and
    ``message_stop``. A block is opened when its first piece comes and closed when a piece of another kind does."""

    def __init__(self, server: ModelServer, plan: PreparedRequest):
        self.server, self.plan = server, plan
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # the open block's type: "thinking" or "text" (a tool_use closes at once)
        self.called = False

    @staticmethod
    def event(name: str, payload: dict[str, object]) -> str:
        return sse({"type": name, **payload}, event=name)

    def opening(self) -> list[str]:
        message = {"id": new_id(), "type": "message", "role": "assistant", "model": self.server.name, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(self.plan.job.ids), "output_tokens": 0}}
        return [self.event("message_start", {"message": message})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", {"index": self.index})]

    def _block(self, kind: str, delta: dict[str, object]) -> list[str]:
        events = []
        if self.open != kind:
            events = self._close()
            self.index, self.open = self.index + 1, kind
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            events.append(self.event("content_block_start", {"index": self.index, "content_block": start}))
        return events + [self.event("content_block_delta", {"index": self.index, "delta": delta})]

    def reasoning(self, text: str, entries: list) -> list[str]:
        return self._block("thinking", {"type": "thinking_delta", "thinking": text})

    def text(self, text: str, entries: list) -> list[str]:
        return self._block("text", {"type": "text_delta", "text": text})

    def call(self, call: ToolCall, entries: list) -> list[str]:
        events = self._close()
        self.index, self.called = self.index + 1, True
        block = {**tool_use(call), "input": {}}
        return events + [self.event("content_block_start", {"index": self.index, "content_block": block}),
                         self.event("content_block_delta", {"index": self.index, "delta": {
                             "type": "input_json_delta", "partial_json": call.arguments}}),
                         self.event("content_block_stop", {"index": self.index})]

    def closing(self, result: GenerationResult | None, entries: list) -> list[str]:
        events = self._close()
        reason, sequence = stop_details(self.server, self.plan, result, self.called) if result is not None else ("end_turn", None)
        usage = {"output_tokens": len(result.new_ids) if result is not None else 0}
        return events + [self.event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                                      "usage": usage}),
                         self.event("message_stop", {})]

    def failure(self, error: ApiError) -> list[str]:
        return [sse(anthropic_error(error), event="error")]
