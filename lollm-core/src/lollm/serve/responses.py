"""OpenAI's Responses API at ``POST /v1/responses`` (and ``GET /v1/responses/{id}``): what Codex and the OpenAI
Agents SDK speak.

As for the Messages API (lollm.serve.messages), a request is translated into the Chat
Completions request it means (:func:`chat_body`), prepared as any other, and its answer
shaped the Responses way: a ``response`` object whose ``output`` is a list of items
(``reasoning``, ``message``, ``function_call``), whole (:meth:`Responses.answer`) or as
semantic events (:class:`ResponsesShaper`)::

    instructions                        -> a system message first (not carried to a next response)
    input: a string                     -> one user message
    input items: messages (input_text)  -> messages of their role
      input_image (a data: URL)         -> an image_url content part (images.py: the tower, the placeholders)
      function_call                     -> an assistant message's tool_calls
      function_call_output              -> a tool message (tool_call_id: the call_id)
      reasoning (reasoning_text)        -> the next assistant message's reasoning_content
    max_output_tokens                   -> max_tokens
    temperature, top_p                  -> the same
    seed (lollm's extension, as in Chat Completions) -> the same: a sampled answer repeats
    text.format json_schema / json_object -> response_format
    tools (type function), tool_choice, parallel_tool_calls -> the chat tools, as they are
    reasoning.effort                    -> reasoning_effort (the template's enable_thinking)
    previous_response_id                -> that response's conversation first (its input and output)

State: with ``store`` (the default), a response is kept in a :class:`ResponseStore` of this
server's process: at most :data:`STORE_SIZE` responses, each for :data:`STORE_SECONDS`
(the least recently stored goes first), and at most :data:`STORE_BYTES` of conversation (its
images' data: URLs are most of it); a ``previous_response_id`` or a GET of an id it no
longer holds is a 404. Source: OpenAI's API reference (Responses, streaming events).

Images: a message's ``input_image`` part, ``{"type": "input_image", "image_url": "data:image/png;base64,...",
"detail": "auto"}``, becomes the chat part ``{"type": "image_url", "image_url": {"url": ...}}`` and runs as
an image in a chat completion does (lollm.serve.images). Only ``data:`` URLs (the server fetches nothing);
a ``file_id`` (this server keeps no files) is a 400 naming the part; ``detail`` (auto, low, high) is
accepted without effect, as in chat completions (each tower reads an image at its own resolution). An image's refusal names its Responses field,
``input[i].content[j].image_url`` (:func:`renamed` maps the chat request's ``messages[k]`` back).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections import OrderedDict

from lollm.generate.loop import GenerationResult
from lollm.serve.answers import AnswerParts, answer_parts
from lollm.serve.model_server import ModelServer
from lollm.serve.requests import IMAGE_DETAILS, ApiError, Body, PreparedRequest, parse_body, short_repr
from lollm.serve.stream import sse
from lollm.serve.tool_formats import ToolCall

#: Responses one server keeps for previous_response_id and GET, and for how long (seconds).
STORE_SIZE = 1024
STORE_SECONDS = 3600
#: The most bytes of stored conversations (as JSON) one server keeps: a few images' data: URLs, not thousands.
STORE_BYTES = 256 * 1024 * 1024
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "stream", "text", "tools",
          "tool_choice", "parallel_tool_calls", "reasoning", "store", "previous_response_id"}
#: Fields accepted with any value that change nothing here.
IGNORED_FIELDS = {"metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier"}
#: Fields accepted only with their neutral value (or null).
NEUTRAL = {"truncation": "disabled", "background": False, "include": []}
#: A chat field named in an error -> the Responses field it came from.
PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "reasoning_effort": "reasoning.effort",
          "messages": "input"}
ROLES = ("user", "system", "developer", "assistant")


class ResponseStore:
    """Stored responses by id: the response object and the conversation it ends (chat messages), bounded in count
    (``size``) and age (``seconds``); thread-safe."""

    def __init__(self, size: int = STORE_SIZE, seconds: float = STORE_SECONDS, max_bytes: int = STORE_BYTES):
        self.size, self.seconds, self.max_bytes = size, seconds, max_bytes
        self._items: OrderedDict[str, tuple[float, dict[str, object], list[dict[str, object]], int]] = OrderedDict()
        self._bytes = 0  # the stored conversations' JSON bytes
        self._lock = threading.Lock()

    def put(self, response: dict[str, object], conversation: list[dict[str, object]]) -> None:
        """Keep ``response`` and its ``conversation``; the least recently stored go while more than ``size``
        responses or ``max_bytes`` of conversation are held (one larger than ``max_bytes`` is not kept)."""
        size = len(json.dumps(conversation, ensure_ascii=False))
        with self._lock:
            self._items[response["id"]] = (time.monotonic(), response, conversation, size)
            self._bytes += size
            while self._items and (len(self._items) > self.size or self._bytes > self.max_bytes):
                self._bytes -= self._items.popitem(last=False)[1][3]

    def get(self, ident: object, param: str = "previous_response_id") -> tuple[dict[str, object], list[dict[str, object]]]:
        """(response, conversation) of ``ident``; ApiError 404 naming ``param`` when it is not (or no longer) held."""
        with self._lock:
            now = time.monotonic()
            while self._items and now - next(iter(self._items.values()))[0] > self.seconds:
                self._bytes -= self._items.popitem(last=False)[1][3]
            held = self._items.get(ident) if isinstance(ident, str) else None
        if held is None:
            raise ApiError(404, f"no response {short_repr(ident)} is stored here (this server keeps the last "
                                f"{self.size} stored responses for {self.seconds} s, in memory)",
                           param=param, code="response_not_found", kind="not_found")
        return copy.deepcopy(held[1]), copy.deepcopy(held[2])


def _refuse(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", param=where)


def _text(content: object, where: str, images: bool = False) -> str | list[dict[str, object]]:
    """A message's content: a string, or input_text / output_text parts joined. With ``images`` (a user, system or
    developer message) input_image parts are read too: then the content is chat parts, text and image_url
    (:func:`_image`), in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(where, "must be a string or a list of input_text parts")
    parts: list[dict[str, object]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == "input_image":
            parts.append(_image(part, f"{where}[{j}]"))
        elif kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            allowed = "input_text, output_text and input_image" if images else "input_text and output_text"
            raise _refuse(f"{where}[{j}]", f"only {allowed} parts are supported here (no files, audio or video), "
                                           f"got {short_repr(part)}")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image(part: dict, where: str) -> dict[str, object]:
    """An ``input_image`` part as the chat request's ``image_url`` part (decoded and checked there, by
    lollm.serve.requests.read_image_part); ApiError 400 naming the field for a ``file_id``, a ``detail`` that is
    not auto, low or high, an image_url that is not a data: URL (the server fetches nothing), an unknown field."""
    unknown = set(part) - {"type", "image_url", "file_id", "detail"}
    if unknown:
        raise _refuse(f"{where}.{sorted(unknown)[0]}", "is not an input_image field lollm reads (image_url, detail)")
    if part.get("file_id") is not None:
        raise _refuse(f"{where}.file_id", "file_id images are not supported (this server keeps no files): send the "
                                          "image in image_url as a data: URL (data:image/png;base64,...)")
    if part.get("detail") not in IMAGE_DETAILS:
        raise _refuse(f"{where}.detail", f"must be one of auto, low, high (or left out), got {short_repr(part['detail'])}")
    url = part.get("image_url")
    if not isinstance(url, str) or not url.startswith("data:"):
        raise _refuse(f"{where}.image_url", "only data: URLs are accepted (data:image/png;base64,...); the server "
                                            f"fetches nothing, got {short_repr(url)}")
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant(out: list[dict[str, object]]) -> dict[str, object]:
    """The assistant message at the end of ``out``, opened when the last message is not one."""
    if not out or out[-1]["role"] != "assistant" or out[-1].get("closed"):
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def chat_messages(items: object, origins: dict[int, str] | None = None) -> list[dict[str, object]]:
    """``input`` (a string or a list of items) as chat messages; ApiError 400 naming the item that cannot be read.

    origins: filled with ``{chat message's index: "input[i]"}`` for each message whose content may hold images
    (so an image's refusal by the chat request can name its Responses field: :func:`renamed`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _refuse("input", "must be a string or a non-empty list of items")
    out: list[dict[str, object]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            assistant = item["role"] == "assistant"
            text = _text(item.get("content"), f"{where}.content", images=not assistant)
            if assistant:
                _assistant(out)["content"] += text
            else:
                out.append({"role": "system" if item["role"] == "developer" else item["role"], "content": text})
                if origins is not None:
                    origins[len(out) - 1] = where
        elif kind == "function_call" and isinstance(item.get("name"), str) and isinstance(item.get("call_id"), str):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            _assistant(out).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or []
            text = "\n".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)) \
                if isinstance(parts, list) else ""
            _assistant(out)["reasoning_content"] = text
        else:
            raise _refuse(where, "an input item must be a message (role user, system, developer or assistant), a "
                                 f"function_call, a function_call_output or a reasoning item; got {short_repr(item)}")
    return out


def chat_text_format(value: object, chat: Body) -> None:
    """``text`` (its ``format``) as the chat request's ``response_format``."""
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"} or value.get("verbosity") not in (None, "medium"):
        raise _refuse("text", "must be an object like {\"format\": {\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}} "
                              f"(verbosity: only medium), got {short_repr(value)}")
    spec = value.get("format")
    kind = spec.get("type") if isinstance(spec, dict) else None
    if spec is None or kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema" and isinstance(spec.get("schema"), dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": spec.get("name", "output"), "schema": spec["schema"], "strict": spec.get("strict")}}
    else:
        raise _refuse("text.format", f"must be of type text, json_object or json_schema (with a schema), got {short_repr(spec)}")


def chat_tools(body: Body, chat: Body) -> None:
    """``tools`` (function tools: name, description, parameters at the top) and ``tool_choice`` in chat's shapes."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _refuse("tools", "must be a list of tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise _refuse(f"tools[{i}].type", "only function tools are supported (no built-in tools such as "
                                                  f"web_search), got {short_repr(tool)}")
            function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
            chat["tools"].append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice.name", "must name the function (a string)")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]


def chat_body(body: Body, history: list[dict[str, object]],
              origins: dict[int, str] | None = None) -> tuple[Body, list[dict[str, object]]]:
    """(the Chat Completions request a Responses request ``body`` means, its conversation without the instructions)
    after the ``history`` of a previous response; ApiError 400 naming the Responses field that cannot be honoured.
    origins: filled as :func:`chat_messages` fills it, with the indexes of the chat request's ``messages``."""
    for key, value in body.items():
        if key in FIELDS or key in IGNORED_FIELDS or (key in NEUTRAL and value in (None, NEUTRAL[key])):
            continue
        raise ApiError(400, f"unsupported parameter {short_repr(key)} (value {short_repr(value)}): lollm serve's "
                            "/v1/responses does not implement it", param=str(key)[:100], code="unsupported_parameter")
    found: dict[int, str] = {}
    conversation = history + chat_messages(body.get("input"), found)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _refuse("instructions", "must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    if origins is not None:
        origins.update({len(system) + len(history) + k: where for k, where in found.items()})
    chat: Body = {"model": body.get("model"), "messages": system + conversation}
    for name, chat_name in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                            ("seed", "seed"), ("stream", "stream")):
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    if body.get("text") is not None:
        chat_text_format(body["text"], chat)
    chat_tools(body, chat)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise _refuse("reasoning", f"must be an object like {{\"effort\": \"medium\"}}, got {short_repr(reasoning)}")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat, conversation


#: A chat request's image field, ``messages[k].content[j].image_url.url``: k is mapped back to ``input[i]``.
CHAT_IMAGE = re.compile(r"messages\[(\d+)\](\.content\[\d+\])(\.image_url)?(\.url)?")


def renamed(error: ApiError, origins: dict[int, str] | None = None) -> ApiError:
    """``error`` (raised for the translated chat request) naming the Responses field it came from.

    origins: ``{chat message's index: "input[i]"}`` (:func:`chat_body`): a refused image part of chat message k
    becomes ``input[i].content[j].image_url``, in the param and in the message."""
    param = error.param or ""
    new = PARAMS.get(param, param)
    if param.startswith("tools[") and ".function." in param:
        new = param.replace(".function.", ".")
    chat_image = CHAT_IMAGE.fullmatch(param)
    if chat_image and int(chat_image[1]) in (origins or {}):
        where = origins[int(chat_image[1])] + chat_image[2]
        new = where + (chat_image[3] or "")
        message = error.message.replace(f"messages[{chat_image[1]}]{chat_image[2]}", where)
        return ApiError(error.status, message, param=new, code=error.code, kind=error.kind, headers=error.headers)
    if new and new != param:
        message = error.message.replace(repr(param), repr(new))
        return ApiError(error.status, message, param=new, code=error.code, kind=error.kind, headers=error.headers)
    return error


# -- output items ------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(ident: str, text: str) -> dict[str, object]:
    return {"type": "reasoning", "id": ident, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def output_text(text: str) -> dict[str, object]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(ident: str, text: str, status: str) -> dict[str, object]:
    return {"type": "message", "id": ident, "status": status, "role": "assistant", "content": [output_text(text)]}


def call_item(ident: str, call: ToolCall) -> dict[str, object]:
    return {"type": "function_call", "id": ident, "call_id": call.id, "name": call.name, "arguments": call.arguments,
            "status": "completed"}


def as_messages(output: list[dict[str, object]]) -> list[dict[str, object]]:
    """A response's output items as the chat messages a next response's conversation continues from."""
    return chat_messages(output) if output else []


class Responses:
    """The Responses API of one server: its :class:`ResponseStore`, and how each request is prepared and answered."""

    def __init__(self, store: ResponseStore | None = None):
        self.store = store or ResponseStore()

    def prepare(self, server: ModelServer, raw: bytes) -> PreparedRequest:
        """A Responses request read, translated (after its previous response's conversation) and prepared."""
        body = parse_body(raw)
        history: list[dict[str, object]] = []
        if body.get("previous_response_id") is not None:
            history = self.store.get(body["previous_response_id"])[1]
        origins: dict[int, str] = {}
        try:
            chat, conversation = chat_body(body, history, origins)
            plan = server.prepare_body(chat, "chat")
        except ApiError as error:
            raise renamed(error, origins) from None
        if body.get("store") is not None and not isinstance(body["store"], bool):
            raise _refuse("store", "must be true or false")
        plan.extra = {"body": body, "conversation": conversation, "id": new_id("resp"), "created_at": int(time.time())}
        return plan

    def response(self, server: ModelServer, plan: PreparedRequest, output: list[dict[str, object]],
                 result: GenerationResult | None, status: str, reasoning: str) -> dict[str, object]:
        """The ``response`` object (its fields echoed from the request); stored when ``status`` is final and
        ``store`` is not false."""
        body, extra = plan.extra["body"], plan.extra
        cut = result is not None and result.stop_reason in ("max_new_tokens", "context")
        status = "incomplete" if status == "completed" and cut else status
        response = {
            "id": extra["id"], "object": "response", "created_at": extra["created_at"], "status": status,
            "model": server.name, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"), "store": body.get("store") is not False,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "text": body.get("text") or {"format": {"type": "text"}}, "reasoning": body.get("reasoning"),
            "metadata": body.get("metadata") or {}, "usage": None}
        if result is not None:
            prompt, new = len(result.prompt_ids), len(result.new_ids)
            thought = len(server.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
            response["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": result.reused_tokens},
                                 "output_tokens": new, "output_tokens_details": {"reasoning_tokens": min(thought, new)},
                                 "total_tokens": prompt + new}
            if response["store"]:
                self.store.put(response, extra["conversation"] + as_messages(output))
        return response

    def answer(self, server: ModelServer, plan: PreparedRequest, result: GenerationResult) -> dict[str, object]:
        """The whole answer: a ``response`` whose output is the reasoning, the message, the function calls."""
        parts: AnswerParts = answer_parts(plan.job, result)
        output = [reasoning_item(new_id("rs"), parts.reasoning)] if parts.reasoning else []
        if parts.content or not parts.calls:
            cut = result.stop_reason in ("max_new_tokens", "context")
            output.append(message_item(new_id("msg"), parts.content, "incomplete" if cut else "completed"))
        output.extend(call_item(new_id("fc"), call) for call in parts.calls)
        return self.response(server, plan, output, result, "completed", parts.reasoning)

    def retrieve(self, ident: str) -> dict[str, object]:
        """``GET /v1/responses/{id}``: a stored response; ApiError 404 when it is not held."""
        return self.store.get(ident, "response_id")[0]

    def shaper(self, server: ModelServer, plan: PreparedRequest) -> ResponsesShaper:
        return ResponsesShaper(self, server, plan)


class ResponsesShaper:
    """The Responses API's stream (a :class:`lollm.serve.stream.Shaper`): ``response.created`` and
    ``response.in_progress``; per output item ``response.output_item.added``, its deltas
    (``response.reasoning_text.delta``, ``response.output_text.delta`` inside a content part,
    ``response.function_call_arguments.delta``), their ``.done`` events and ``response.output_item.done``;
    then ``response.completed`` (or ``response.incomplete``) with the whole response. Every event has a
    ``sequence_number``."""

    def __init__(self, api: Responses, server: ModelServer, plan: PreparedRequest):
        self.api, self.server, self.plan = api, server, plan
        self.output: list[dict[str, object]] = []  # the items so far (the open one last)
        self.open: str | None = None  # the open item's type: "reasoning" or "message"
        self.sequence = 0

    def event(self, kind: str, payload: dict[str, object]) -> str:
        self.sequence += 1
        return sse({"type": kind, "sequence_number": self.sequence - 1, **payload}, event=kind)

    def opening(self) -> list[str]:
        response = self.api.response(self.server, self.plan, [], None, "in_progress", "")
        return [self.event("response.created", {"response": response}),
                self.event("response.in_progress", {"response": response})]

    def _where(self) -> dict[str, object]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        item, where, self.open = self.output[-1], self._where(), None
        if item.get("status") == "in_progress":
            item["status"] = "completed"
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            events = [self.event("response.reasoning_text.done", {**where, "content_index": 0, "text": text})]
        else:
            part = item["content"][0]
            events = [self.event("response.output_text.done", {**where, "content_index": 0, "text": part["text"], "logprobs": []}),
                      self.event("response.content_part.done", {**where, "content_index": 0, "part": part})]
        return events + [self.event("response.output_item.done", {"output_index": where["output_index"], "item": item})]

    def _item(self, kind: str) -> list[str]:
        """Open an item of ``kind`` unless it is the open one."""
        if self.open == kind:
            return []
        events = self._close()
        empty = reasoning_item(new_id("rs"), "") if kind == "reasoning" else message_item(new_id("msg"), "", "in_progress")
        self.output.append(empty)
        self.open = kind
        events.append(self.event("response.output_item.added", {"output_index": len(self.output) - 1, "item": empty}))
        if kind == "message":
            events.append(self.event("response.content_part.added", {**self._where(), "content_index": 0,
                                                                     "part": output_text("")}))
        return events

    def reasoning(self, text: str, entries: list) -> list[str]:
        events = self._item("reasoning")
        self.output[-1]["content"][0]["text"] += text
        return events + [self.event("response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": text})]

    def text(self, text: str, entries: list) -> list[str]:
        events = self._item("message")
        self.output[-1]["content"][0]["text"] += text
        return events + [self.event("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text,
                                                                   "logprobs": []})]

    def call(self, call: ToolCall, entries: list) -> list[str]:
        events = self._close()
        item = call_item(new_id("fc"), call)
        self.output.append(item)
        where = self._where()
        return events + [
            self.event("response.output_item.added", {"output_index": where["output_index"],
                                                      "item": {**item, "arguments": "", "status": "in_progress"}}),
            self.event("response.function_call_arguments.delta", {**where, "delta": call.arguments}),
            self.event("response.function_call_arguments.done", {**where, "name": call.name, "arguments": call.arguments}),
            self.event("response.output_item.done", {"output_index": where["output_index"], "item": item})]

    def closing(self, result: GenerationResult | None, entries: list) -> list[str]:
        events = []
        if result is not None and not any(item["type"] in ("message", "function_call") for item in self.output):
            events = self._item("message")  # an answer of no text and no call still has its message, as a whole one
        if result is not None and result.stop_reason in ("max_new_tokens", "context") and self.open == "message":
            self.output[-1]["status"] = "incomplete"
        events += self._close()
        thought = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")
        response = self.api.response(self.server, self.plan, self.output, result, "completed", thought)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, {"response": response})]

    def failure(self, error: ApiError) -> list[str]:
        return [self.event("error", {"code": error.code, "message": error.message, "param": error.param})]
