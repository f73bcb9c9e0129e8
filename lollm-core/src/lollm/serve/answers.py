"""The answers of ``lollm serve`` in OpenAI's shapes: whole answers, streamed chunks, and each request's log line."""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from lollm.generate.loop import GenerationResult
from lollm.serve.requests import Job

if TYPE_CHECKING:
    from lollm.serve.model_server import ModelServer

FINISH_REASON = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context": "length", "cancelled": "stop"}


def request_line(endpoint: str, result: GenerationResult) -> str:
    """One request's log line: endpoint, prompt / cached / generated tokens, time to first token, tok/s, finish.

    Time to first token is the prefill (the uncached part of the prompt's
    forward plus the first sample), in milliseconds; tok/s counts the tokens
    after the first over the decode time (``-`` when there were none).
    """
    new = len(result.new_ids)
    speed = f"{(new - 1) / result.decode_seconds:.1f}" if new > 1 and result.decode_seconds > 0 else "-"
    finish = FINISH_REASON[result.stop_reason] if result.stop_reason != "cancelled" else "cancelled"
    return (f"{endpoint or '-'}: prompt {len(result.prompt_ids)} tokens (cached {result.reused_tokens}), "
            f"generated {new}, first token {1000 * result.prefill_seconds:.0f} ms, {speed} tok/s, finish {finish}")



def _base(server: ModelServer, kind: str) -> dict[str, Any]:
    """The fields every answer (and every streamed chunk) of one request shares."""
    if kind == "chat":
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": server.name}
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": server.name,
            "object": "text_completion"}


def _chat_chunks(server: ModelServer, base: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    def chunk(text, entries, finish, calls=None):
        delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = calls
        lp = {"content": server.content_logprobs(entries)} if entries else None
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    return chunk


def _completion_chunks(server: ModelServer, base: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    offset = [0]

    def chunk(text, entries, finish):
        lp = None
        if entries:
            lp = server.text_logprobs(entries, offset[0])
            offset[0] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return {**base, "choices": [{"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}]}

    return chunk


def _chat_answer(server: ModelServer, base: dict[str, Any], job: Job, result: GenerationResult) -> dict[str, Any]:
    lp = {"content": server.content_logprobs(server.content_entries(result))} if job.logprobs is not None else None
    message, finish = {"role": "assistant", "content": result.text}, FINISH_REASON[result.stop_reason]
    if job.tools is not None:  # the text read for calls (lollm.serve.tools), as a stream would have sent it
        content, calls = job.tools.answer(result.text, result.stop_reason)
        if calls:
            message = {"role": "assistant", "content": content or None, "tool_calls": [c.message_entry() for c in calls]}
            finish = "tool_calls" if finish == "stop" else finish  # cut by max_tokens: still "length"
        else:
            message["content"] = content
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}],
            "usage": server.usage(result)}


def _completion_answer(server: ModelServer, base: dict[str, Any], job: Job, result: GenerationResult) -> dict[str, Any]:
    lp = server.text_logprobs(server.content_entries(result)) if job.logprobs is not None else None
    return {**base,
            "choices": [{"index": 0, "text": result.text, "logprobs": lp, "finish_reason": FINISH_REASON[result.stop_reason]}],
            "usage": server.usage(result)}


CHUNKS = {"chat": _chat_chunks, "completion": _completion_chunks}
ANSWERS = {"chat": _chat_answer, "completion": _completion_answer}
