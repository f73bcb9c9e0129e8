"""Every request of `lollm serve` is bounded, and every cancellation is logged (issue 42).

On the toy family in this process (as test_server_hostile.py):

* ``max_tokens`` above what the context can hold is capped to the room left (the prompt plus the
  answer fill the context at most; finish_reason "length"), as llama.cpp's server does with context
  shift off, its default (``n_predict <= n_ctx - n_prompt``, ggml-org/llama.cpp#9544 and #15416); OpenAI
  and vLLM answer 400 instead. No request is unbounded, so none can hold a shutdown for ever;
* a request cancelled before its first token logs its line too ("client went away ... before its
  first token"), on the batched engine and on the one-at-a-time worker: the log counts every
  cancellation the ``cancelled`` counter counts.
"""

from __future__ import annotations

import logging
import time

import pytest

from lollm.serve.app import create_app
from lollm.serve.model_server import ModelServer
from lollm.serve.requests import Job

from test_server_hostile import NAME, loaded  # noqa: F401  (the toy checkpoint, loaded once per module)

CONTEXT = 64


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_above_the_context_is_capped_to_the_room_left(loaded, field):  # noqa: F811
    from starlette.testclient import TestClient

    body = {"model": NAME, "messages": [{"role": "user", "content": "hello"}], field: 10**9, "temperature": 0,
            "repetition_penalty": 1.0}
    with TestClient(create_app(ModelServer(loaded, name=NAME, context=CONTEXT))) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    usage, finish = answer.json()["usage"], answer.json()["choices"][0]["finish_reason"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT, usage
    assert finish == "stop" or usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT, (finish, usage)


@pytest.mark.parametrize("batched", [True, False])
def test_a_cancellation_before_the_first_token_is_logged(loaded, caplog, batched):  # noqa: F811
    server = ModelServer(loaded, name=NAME, context=CONTEXT, batched=batched)
    prepared = server.prepare(b'{"model": "toy", "prompt": "hello", "max_tokens": 4}', "completion")
    job: Job = prepared.job
    job.cancel.set()  # the client went away while its request waited
    try:
        with caplog.at_level(logging.INFO, logger="lollm.serve.server"):
            assert server.submit(job).result(timeout=60) is None
            deadline = time.monotonic() + 30  # the report comes just before the Future resolves; hang guard
            while server.counts["cancelled"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if "client went away" in r.getMessage()]
    assert lines == ["client went away: generation cancelled before its first token"], lines
    assert server.counts == {"completed": 0, "cancelled": 1, "failed": 0}
