"""lollm serve --tp 2 on a tiny qwen2: rank 0 serves HTTP, both gloo ranks generate in lockstep.

The answers are compared with what lollm computes in this process, unsplit, on
the same checkpoint (lollm.testing.serving): greedy chat and completions,
streamed and not, stop strings, a client that goes away (every rank stops at
the same token, or the next request would hang), concurrent requests, and
sampled requests: with a seed they equal the one-process draw; without one
rank 0 picks the seed for every rank, and greedy answers stay right after them
(ranks that drew different tokens would fall out of step).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lollm.testing import serving

from _qwen_tiny import chat_checkpoint  # noqa: F401  (a fixture)

# torchrun's ranks want both cores: nox runs these tests alone, after the parallel pass (noxfile.py, _pytest)
pytestmark = pytest.mark.serial

NAME = "tiny-qwen2-tp"


@pytest.fixture(scope="module")
def folder(chat_checkpoint) -> Path:  # noqa: F811
    return chat_checkpoint


@pytest.fixture(scope="module")
def server(folder):
    with serving.run_server(folder, "--model-name", NAME, "--tp", "2", nproc=2) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return serving.openai_client(server)


@pytest.fixture(scope="module")
def reference(folder):
    with serving.one_torch_thread():
        yield serving.Reference(folder)


def test_chat(client, reference):
    serving.check_chat(client, NAME, reference)


def test_completions(client, reference):
    serving.check_completions(client, NAME, reference)


def test_stop_strings(client, reference):
    serving.check_stop_strings(client, NAME, reference)


def test_disconnect_cancels_the_generation_on_every_rank(client, server):
    serving.check_disconnect_cancels(client, NAME, server)


def test_concurrent_requests(client, reference):
    serving.check_concurrent_requests(client, NAME, reference)


def test_sampling_with_a_seed_is_the_one_process_draw(client, reference):
    prompt = "Once upon a time there was"
    ids = reference.tokenizer.encode(prompt)
    from lollm.generate.loop import generate
    from lollm.generate.sampling import resolve_sampling

    loaded = reference.loaded
    sampling = resolve_sampling({"temperature": 0.9}, loaded.checkpoint.generation_config,
                                loaded.family.family.sampling_defaults, seed=1234)
    expected = generate(reference.model, ids, max_new_tokens=12, sampling=sampling, stop_ids=reference.stop_ids,
                        tokenizer=reference.tokenizer)
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0.9, seed=1234)
    assert reply.choices[0].text == expected.text


def test_sampling_without_a_seed_keeps_the_ranks_in_step(client, reference):
    """Sampled answers, then greedy follow-ups (by token ids) that reuse them from the prompt cache.

    Ranks that drew different tokens would hold different ids in their caches (and
    have fed a mix of both to the model): the follow-up would go wrong or hang.
    """
    by_bytes: dict[bytes, int] = {}
    for token in range(reference.model.vocab_size):
        by_bytes.setdefault(reference.tokenizer.token_bytes(token), token)
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids = reference.chat_ids(messages)
    for _ in range(3):
        sampled = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=1.0,
                                                 logprobs=True)
        drawn = [by_bytes[bytes(entry.bytes)] for entry in sampled.choices[0].logprobs.content]
        follow = ids + drawn + reference.tokenizer.encode(" and then")
        reply = client.completions.create(model=NAME, prompt=follow, max_tokens=6, temperature=0.0)
        assert reply.usage.prompt_tokens_details.cached_tokens >= len(ids) + len(drawn) - 1, reply.usage
        assert reply.choices[0].text == reference.generate(follow, 6).text
