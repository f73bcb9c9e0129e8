"""lollm serve on a tiny qwen3_5 (DeltaNet states + attention, MTP on), through the official openai client.

The server drafts with the MTP head (--mtp); greedy answers must still be the
plain model's, and the prompt cache resumes the recurrent states from snapshots.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import qwen3_5_tiny as tiny
from lollm.testing import serving

NAME = "tiny-qwen3_5"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A lively tiny qwen3_5 with MTP tensors, a 512-id ChatML tokenizer whose id 0 ends a turn."""
    from lollm.testing.tiny import write_tiny_tokenizer

    out = tiny.write_tiny("qwen3_5", "text", tmp_path_factory.mktemp("serve-qwen3_5"), mtp=True, lively=True,
                          eos_token_id=0)
    return write_tiny_tokenizer(out, vocab_size=512, thinking=True)


@pytest.fixture(scope="module")
def server(folder):
    with serving.run_server(folder, "--model-name", NAME, "--mtp") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return serving.openai_client(server)


@pytest.fixture(scope="module")
def reference(folder):
    with serving.one_torch_thread():  # tiny models: threads only wait for each other
        yield serving.Reference(folder)


def test_chat(client, reference):
    serving.check_chat(client, NAME, reference)


def test_completions(client, reference):
    serving.check_completions(client, NAME, reference)


def test_logprobs(client, reference):
    serving.check_logprobs(client, NAME, reference)


def test_stop_strings(client, reference):
    serving.check_stop_strings(client, NAME, reference)


def test_disconnect_cancels_the_generation(client, server):
    serving.check_disconnect_cancels(client, NAME, server)


def test_concurrent_requests(client, reference):
    serving.check_concurrent_requests(client, NAME, reference)


def test_thinking_per_request(client, reference):
    """chat_template_kwargs reaches the template: enable_thinking false adds the empty think block."""
    messages = [{"role": "user", "content": "Think about it."}]
    for flag in (True, False):
        reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": flag}})
        ids = reference.chat_ids(messages, enable_thinking=flag)
        assert reply.usage.prompt_tokens == len(ids)
        assert reply.choices[0].message.content == reference.generate(ids, 4).text
    on, off = (len(reference.chat_ids(messages, enable_thinking=f)) for f in (True, False))
    assert off > on  # "<think>\n\n</think>\n\n" after the assistant header
