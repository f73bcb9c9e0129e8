"""The answers of ``lollm serve`` in OpenAI's shapes: whole answers, streamed chunks, and each request's log line.

Every function here is plain data in, plain data out (no HTTP, no model): a
:class:`~lollm.generate.loop.GenerationResult` and the tokenizer (to spell each
token of the logprobs) become the JSON object OpenAI's clients read.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable, Protocol, TypedDict

from lollm.generate.loop import GenerationResult
from lollm.generate.sequence import TokenLogprobs
from lollm.serve.reasoning import split
from lollm.serve.requests import Job
from lollm.serve.tool_formats import ToolCall
from lollm.tokenizer import Tokenizer

#: lollm.generate.loop's stop reasons -> OpenAI's ``finish_reason``.
#: The stop reason of a stream the server's shutdown ended (lollm.serve.shutdown): its finish_reason too,
#: as vLLM's "abort" names an aborted request.
SHUTDOWN = "shutdown"
FINISH_REASON = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "context": "length", "cancelled": "stop",
                 SHUTDOWN: SHUTDOWN}


def request_line(endpoint: str, result: GenerationResult, images: int = 0) -> str:
    """One request's log line: endpoint, prompt / cached / generated tokens, time to first token, tok/s, finish.

    Time to first token is the prefill (the uncached part of the prompt's
    forward plus the first sample), in milliseconds; tok/s counts the tokens
    after the first over the decode time (``-`` when there were none).
    ``images``: how many images the prompt holds, shown as ``images=N`` when any.
    """
    new = len(result.new_ids)
    speed = f"{(new - 1) / result.decode_seconds:.1f}" if new > 1 and result.decode_seconds > 0 else "-"
    finish = FINISH_REASON[result.stop_reason] if result.stop_reason != "cancelled" else "cancelled"
    shown = f" images={images}," if images else ""
    return (f"{endpoint or '-'}: prompt {len(result.prompt_ids)} tokens (cached {result.reused_tokens}),{shown} "
            f"generated {new}, first token {1000 * result.prefill_seconds:.0f} ms, {speed} tok/s, finish {finish}")


class Usage(TypedDict):
    """``usage`` of an answer: tokens of the prompt (of which ``cached_tokens`` came from the prefix cache) and of the answer."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class TextLogprobs(TypedDict):
    """Completions-style (legacy) logprobs: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # where each token's text starts in the generated text, in characters


class Chunk(Protocol):
    """Makes one streamed chunk of a request: ``text`` (None: the first chunk, the assistant's role), the
    logprobs of the tokens since the last chunk, the finish reason (None until the last), tool-call deltas,
    reasoning text (chat only)."""

    def __call__(self, text: str | None, entries: list[TokenLogprobs] | None, finish: str | None,
                 calls: list[dict[str, object]] | None = None, reasoning: str | None = None) -> dict[str, object]: ...


@dataclass
class AnswerParts:
    """A whole generation read as an answer: the thinking, the content, the tool calls, OpenAI's finish reason.

    Every API shapes its answer from these (Chat Completions, Messages, Responses), and
    its stream from the same readers fed piece by piece, so the two always agree.
    """

    reasoning: str
    content: str
    calls: list[ToolCall]
    finish: str  # "stop", "length" or "tool_calls"


def answer_parts(job: Job, result: GenerationResult) -> AnswerParts:
    """The thinking split off (lollm.serve.reasoning), then the tool calls read from the rest (lollm.serve.tools)."""
    reasoning, content = split(job.reasoning, result.text) if job.reasoning is not None else ("", result.text)
    calls: list[ToolCall] = []
    if job.tools is not None:
        content, calls = job.tools.answer(content, result.stop_reason)
    finish = FINISH_REASON[result.stop_reason]
    return AnswerParts(reasoning, content, calls, "tool_calls" if calls and finish == "stop" else finish)


def usage(result: GenerationResult) -> Usage:
    prompt, completion = len(result.prompt_ids), len(result.new_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": result.reused_tokens}}


def content_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> list[dict[str, object]]:
    """Chat-style logprobs: token text, log-probability, UTF-8 bytes, and the top alternatives."""

    def one(token: int, logprob: float) -> dict[str, object]:
        data = tokenizer.token_bytes(token)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def text_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs], offset: int = 0) -> TextLogprobs:
    """Completions-style (legacy) logprobs of ``entries``, whose text starts ``offset`` characters into the answer."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        text = tokenizer.token_bytes(e.token).decode("utf-8", errors="replace")
        tokens.append(text)
        offset += len(text)
    top = [{tokenizer.token_bytes(t).decode("utf-8", errors="replace"): lp for t, lp in e.top} for e in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
            "text_offset": offsets}


def content_entries(result: GenerationResult) -> list[TokenLogprobs]:
    """The logprobs of the answer's tokens (an end-of-sequence token that stopped it is not content)."""
    entries = result.logprobs
    return entries[:-1] if entries and result.stop_reason == "eos" else entries


def answer_base(model: str, kind: str) -> dict[str, object]:
    """The fields every answer (and every streamed chunk) of one request of ``kind`` ("chat", "completion") shares."""
    if kind == "chat":
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model}
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model,
            "object": "text_completion"}


def chat_chunks(tokenizer: Tokenizer, base: dict[str, object]) -> Chunk:
    def chunk(text: str | None, entries: list[TokenLogprobs] | None, finish: str | None,
              calls: list[dict[str, object]] | None = None, reasoning: str | None = None) -> dict[str, object]:
        delta: dict[str, object] = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = calls
        if reasoning:
            delta["reasoning_content"] = reasoning
        lp = {"content": content_logprobs(tokenizer, entries)} if entries else None
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    return chunk


def completion_chunks(tokenizer: Tokenizer, base: dict[str, object]) -> Chunk:
    offset = 0  # characters of the answer sent so far: where the next chunk's logprobs start

    def chunk(text: str | None, entries: list[TokenLogprobs] | None, finish: str | None,
              calls: list[dict[str, object]] | None = None, reasoning: str | None = None) -> dict[str, object]:
        # calls, reasoning: chat only
        nonlocal offset
        lp = None
        if entries:
            lp = text_logprobs(tokenizer, entries, offset)
            offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return {**base, "choices": [{"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish}]}

    return chunk


def chat_answer(tokenizer: Tokenizer, base: dict[str, object], job: Job, result: GenerationResult) -> dict[str, object]:
    lp = {"content": content_logprobs(tokenizer, content_entries(result))} if job.logprobs is not None else None
    parts = answer_parts(job, result)
    message: dict[str, object] = {"role": "assistant", "content": parts.content}
    if parts.calls:
        message = {"role": "assistant", "content": parts.content or None,
                   "tool_calls": [c.message_entry() for c in parts.calls]}
    if parts.reasoning:
        message["reasoning_content"] = parts.reasoning
    return {**base, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": parts.finish}],
            "usage": usage(result)}


def completion_answer(tokenizer: Tokenizer, base: dict[str, object], job: Job, result: GenerationResult) -> dict[str, object]:
    lp = text_logprobs(tokenizer, content_entries(result)) if job.logprobs is not None else None
    return {**base,
            "choices": [{"index": 0, "text": result.text, "logprobs": lp, "finish_reason": FINISH_REASON[result.stop_reason]}],
            "usage": usage(result)}


#: kind of request -> how its streamed chunks and its whole answer are made
CHUNKS: dict[str, Callable[[Tokenizer, dict[str, object]], Chunk]] = {"chat": chat_chunks, "completion": completion_chunks}
ANSWERS: dict[str, Callable[[Tokenizer, dict[str, object], Job, GenerationResult], dict[str, object]]] = {
    "chat": chat_answer, "completion": completion_answer}
