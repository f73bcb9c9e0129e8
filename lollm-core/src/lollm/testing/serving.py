"""Checks of a live ``lollm serve`` through the official ``openai`` client, for every family's tests.

A test starts the server in a child process on a tiny checkpoint (with a
tokenizer and a chat template) and runs these checks against it; each one
compares what the server answers with what lollm itself computes in the test
process on the same checkpoint (greedy, so the text is determined)::

    with run_server(folder, "--model-name", "tiny") as url:
        client = openai_client(url)
        reference = Reference(folder)
        check_chat(client, "tiny", reference)

The ``openai`` package comes with ``lollm-core[test]``.

:func:`app_in_thread` serves an application made in the test process (``lollm.serve.server.create_app``)
with uvicorn in a thread, for tests that change the server from inside (a tokenizer that blocks).
``python -m lollm.testing.serving [EXAMPLES]`` runs schemathesis against a live ``lollm serve`` on a
tiny qwen2 (``nox -s schemathesis``; needs lollm-qwen, transformers and schemathesis).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Iterator

import torch

from lollm.generate.loop import GenerationResult, generate, stop_token_ids
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model
from lollm.sampling_params import resolve_sampling
from lollm.cli.hub_configs import hub_config
from lollm.testing.tiny import shrink_config, write_tiny_checkpoint, write_tiny_tokenizer

# Lazy imports below: uvicorn, openai and prometheus_client (optional extras: lollm-core[serve] and [test]),
# each imported by the one helper that needs it.
if TYPE_CHECKING:  # openai's classes only name types here
    from openai import OpenAI
    from openai.types.chat import ChatCompletion

GREEDY = {"temperature": 0.0}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, object]]:
    """GET (or POST ``body``) ``url``; returns (status, parsed JSON body)."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@contextmanager
def run_server(folder: str | Path, *args: str, timeout: float = 180, nproc: int = 1) -> Iterator[str]:
    """``lollm serve folder ARGS`` in a child process on a free port; yields its base URL (``.../v1``).

    Waits until /health answers; stops the child (its own process id) on exit. On a
    failure to start, the AssertionError shows the server's output. ``nproc`` > 1:
    started by ``python -m torch.distributed.run --nproc-per-node nproc`` (give ``--tp nproc`` in ARGS).
    """
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    # one thread: tiny models gain nothing from more, and on a busy machine OpenMP's barriers make them wait
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
                                      "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    child = subprocess.Popen([sys.executable, *launcher, "-m", "lollm.cli", "serve", str(folder), "--port", str(port), *args],
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    root = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if http(root + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise AssertionError(f"lollm serve did not start (exit {child.poll()}):\n{log.read()[-4000:]}")
            time.sleep(0.2)
        yield root + "/v1"
    finally:
        child.terminate()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        log.close()


@contextmanager
def app_in_thread(app: Callable[..., Awaitable[None]], timeout: float = 60) -> Iterator[str]:
    """``app`` (an ASGI application) served by uvicorn in a daemon thread of this process; yields its root URL.

    Binds a free port on 127.0.0.1; waits (at most ``timeout`` seconds) until uvicorn has started, and on
    exit asks it to stop and waits for the thread. Signal handlers stay the main thread's.
    """
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise AssertionError("uvicorn did not start in its thread")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread while inside (the reference runs of tiny models), as before afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def openai_client(base_url: str, api_key: str = "unused", **kwargs: object) -> OpenAI:
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120, **kwargs)


class Reference:
    """lollm in the test process, on the same checkpoint: what the server must answer (greedy)."""

    def __init__(self, folder: str | Path):
        self.loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        ckpt = self.loaded.checkpoint
        self.stop_ids = stop_token_ids(ckpt.generation_config, ckpt.config, self.tokenizer)

    def chat_ids(self, messages: list[dict[str, str]], **flags: object) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True, parse_special=False, **flags)

    def generate(self, ids: list[int], max_tokens: int, stop: tuple[str, ...] = (), logprobs: int | None = None,
                 **sampling_flags: object) -> GenerationResult:
        """Greedy, with the other sampling settings resolved as the server does (a family's repetition penalty ...)."""
        sampling = resolve_sampling({**GREEDY, **sampling_flags}, self.loaded.checkpoint.generation_config,
                                    self.loaded.family.family.sampling_defaults)
        return generate(self.model, ids, max_new_tokens=max_tokens, sampling=sampling, stop_ids=self.stop_ids,
                        stop_strings=stop, tokenizer=self.tokenizer, logprobs=logprobs)


CONVERSATION = [
    {"role": "system", "content": "You are a tiny random model."},
    {"role": "user", "content": "Tell me about the quick brown fox."},
]


def check_chat(client, model: str, reference: Reference, max_tokens: int = 24) -> None:
    """Non-streaming and streaming chat give the reference's greedy text; usage counts tokens and cached ones."""
    ids = reference.chat_ids(CONVERSATION)
    expected = reference.generate(ids, max_tokens)
    reply = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=max_tokens, **GREEDY)
    assert reply.choices[0].message.content == expected.text, (reply.choices[0].message.content, expected.text)
    assert reply.choices[0].finish_reason == ("stop" if expected.stop_reason == "eos" else "length")
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(expected.new_ids)
    assert reply.model == model and reply.object == "chat.completion"

    pieces, finish, usage = [], None, None
    stream = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == expected.text and len([p for p in pieces if p]) > 1, pieces
    assert finish == reply.choices[0].finish_reason
    # the same prompt again: all of it but its last token comes from the prompt cache (one request at a time),
    # or every full KV block of it but the one holding its last token (the batched engine's prefix cache)
    assert usage is not None and usage.prompt_tokens_details.cached_tokens == cached_again(client, len(ids)), usage

    # the conversation goes on: the previous prompt is reused at least up to its last token (the
    # answer's text, tokenized again, may part from the ids generated; a ring or a recurrent state
    # then resumes from the snapshot taken before the prompt's last token)
    follow = CONVERSATION + [{"role": "assistant", "content": expected.text}, {"role": "user", "content": "And then?"}]
    again = client.chat.completions.create(model=model, messages=follow, max_tokens=4, **GREEDY)
    follow_ids = reference.chat_ids(follow)
    assert again.choices[0].message.content == reference.generate(follow_ids, 4).text
    assert again.usage.prompt_tokens_details.cached_tokens >= cached_again(client, len(ids)), again.usage


def cached_again(client, prompt_tokens: int) -> int:
    """Prompt tokens the server takes from its cache when a prompt of ``prompt_tokens`` comes again.

    One request at a time (a PromptCache): all but the last. The batched engine (``/health``
    says ``batching``): every full block of ``block_size`` before the last token, since its
    prefix cache shares whole blocks only (a model with recurrent state as well: its prompt chunks
    stop at that boundary, where the engine saves a state snapshot); none with no prefix cache.
    """
    batching = health(str(client.base_url).rstrip("/")).get("batching")
    if batching is None:
        return prompt_tokens - 1
    if not batching["prefix_caching"]:
        return 0
    size = batching["block_size"]
    return (prompt_tokens - 1) // size * size


def check_completions(client, model: str, reference: Reference, max_tokens: int = 16) -> None:
    """/v1/completions on plain text and on token ids, streaming and not."""
    prompt = "Once upon a time there was"
    ids = reference.tokenizer.encode(prompt)
    expected = reference.generate(ids, max_tokens)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **GREEDY)
    assert reply.choices[0].text == expected.text and reply.object == "text_completion"
    assert reply.usage.completion_tokens == len(expected.new_ids)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, **GREEDY)
    assert by_ids.choices[0].text == expected.text
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def check_logprobs(client, model: str, reference: Reference, max_tokens: int = 6) -> None:
    """logprobs / top_logprobs equal log_softmax of a plain forward (no cache) at each generated position."""
    ids = reference.chat_ids(CONVERSATION)
    plain = {"repetition_penalty": 1.0}  # so that greedy picks the most likely token
    expected = reference.generate(ids, max_tokens, **plain)
    reply = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=max_tokens, logprobs=True,
                                           top_logprobs=3, extra_body=plain, **GREEDY)
    content = reply.choices[0].logprobs.content
    tokens = expected.new_ids[:-1] if expected.stop_reason == "eos" else expected.new_ids
    assert len(content) == len(tokens), (len(content), len(tokens))
    with torch.inference_mode():
        logits = reference.model(torch.tensor([ids + expected.new_ids]))[0, len(ids) - 1 :]
    truth = torch.log_softmax(logits.float(), dim=-1)
    for i, (entry, token) in enumerate(zip(content, tokens)):
        assert bytes(entry.bytes) == reference.tokenizer.token_bytes(token)
        assert abs(entry.logprob - float(truth[i, token])) < 1e-3, (i, entry.logprob, float(truth[i, token]))
        top = [(t.logprob, bytes(t.bytes)) for t in entry.top_logprobs]
        assert len(top) == 3 and top == sorted(top, key=lambda x: -x[0])
        best = torch.topk(truth[i], 3)
        assert [reference.tokenizer.token_bytes(int(t)) for t in best.indices] == [b for _, b in top]
        assert top[0][0] == entry.logprob  # greedy: the chosen one is the most likely
    # the legacy completions form: parallel lists
    legacy = client.completions.create(model=model, prompt="hello world", max_tokens=3, logprobs=2, **GREEDY)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) >= 1
    assert "".join(lp.tokens).startswith(legacy.choices[0].text[: len(lp.tokens[0])])


def check_stop_strings(client, model: str, reference: Reference, max_tokens: int = 40) -> None:
    """A stop string from the middle of the greedy text ends the answer just before it."""
    ids = reference.chat_ids(CONVERSATION)
    full = reference.generate(ids, max_tokens).text
    stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].strip() and full.find(full[i : i + 2]) == i)
    reply = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=max_tokens, stop=[stop, "\x00never"],
                                           **GREEDY)
    assert reply.choices[0].message.content == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def health(base_url: str) -> dict[str, object]:
    return http(base_url.removesuffix("/v1") + "/health")[1]


def check_disconnect_cancels(client, model: str, base_url: str) -> None:
    """A client that closes its stream after a few chunks cancels the generation (counted by /health)."""
    before = health(base_url)["requests"]
    stream = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=100_000, stream=True,
                                            temperature=0.0)
    received = 0
    for chunk in stream:
        received += 1
        if received == 4:
            break
    stream.close()
    deadline = time.monotonic() + 120
    while health(base_url)["requests"]["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the server did not cancel the generation of the client that went away"
        time.sleep(0.2)
    after = health(base_url)["requests"]
    assert after["completed"] == before["completed"], "the abandoned generation ran to its end"
    # and the server goes on serving
    reply = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=2, temperature=0.0)
    assert reply.choices[0].finish_reason in ("length", "stop")


def check_concurrent_requests(client, model: str, reference: Reference, max_tokens: int = 12) -> None:
    """Requests sent at once (streaming and not, different prompts) all finish, each with its own right answer."""
    questions = ["What is a fox?", "Count to three.", "Say hello.", "Why is the sky blue?"]
    jobs = [[{"role": "user", "content": q}] for q in questions]
    expected = [reference.generate(reference.chat_ids(m), max_tokens).text for m in jobs]
    assert [text for text, _ in ask_at_once(client, model, jobs, max_tokens)] == expected


def metrics(base_url: str) -> dict[str, float]:
    """``GET /metrics`` parsed with prometheus-client's own parser: {sample name (labels appended): value}.

    A histogram's buckets read ``name_bucket{le=1.0}``; a counter's sample is ``name_total``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=60) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


ENGINE_METRICS = ("lollm_requests_running", "lollm_requests_waiting", "lollm_kv_blocks_used", "lollm_kv_blocks_total",
                  "lollm_generated_tokens_total", "lollm_prompt_cached_tokens_total", "lollm_prompt_tokens_total",
                  "lollm_time_to_first_token_seconds_count", "lollm_engine_step_requests_count")


def check_metrics(client, model: str, base_url: str) -> None:
    """/metrics parses (prometheus-client's parser), names every metric, and counts one request's tokens."""
    before = metrics(base_url)
    assert set(ENGINE_METRICS) <= set(before), sorted(set(ENGINE_METRICS) - set(before))
    assert before["lollm_kv_blocks_total"] == health(base_url)["batching"]["kv_blocks"]
    reply = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=5, **GREEDY)
    after = metrics(base_url)
    grown = after["lollm_generated_tokens_total"] - before["lollm_generated_tokens_total"]
    assert grown == reply.usage.completion_tokens, (grown, reply.usage)
    assert after["lollm_time_to_first_token_seconds_count"] == before["lollm_time_to_first_token_seconds_count"] + 1
    cached = after["lollm_prompt_cached_tokens_total"] - before["lollm_prompt_cached_tokens_total"]
    assert cached == reply.usage.prompt_tokens_details.cached_tokens
    assert after["lollm_requests_running"] == 0 and after["lollm_kv_blocks_used"] == 0  # idle: every block is back


def _questions(n: int) -> list[list[dict[str, str]]]:
    """``n`` different chat requests of different lengths."""
    words = "fox dog sky tree river stone cloud bird".split()
    return [[{"role": "user", "content": f"Question {i}: " + " ".join(words[(i + k) % len(words)] for k in range(1 + i % 7))}]
            for i in range(n)]


def ask_at_once(client, model: str, jobs: list[list[dict[str, str]]], max_tokens: int) -> list[tuple[str, str]]:
    """Every chat of ``jobs`` sent at the same moment (one thread each, odd ones streamed): (text, finish) of each.

    Raises the first error a request met (a 5xx is an ``openai.InternalServerError``).
    """
    answers: dict[int, tuple[str, str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def ask(i: int) -> None:
        try:
            start.wait(timeout=60)
            if i % 2:
                stream = client.chat.completions.create(model=model, messages=jobs[i], max_tokens=max_tokens, stream=True,
                                                        **GREEDY)
                pieces, finish = [], None
                for chunk in stream:
                    for choice in chunk.choices:
                        pieces.append(choice.delta.content or "")
                        finish = choice.finish_reason or finish
                answers[i] = ("".join(pieces), finish)
            else:
                reply = client.chat.completions.create(model=model, messages=jobs[i], max_tokens=max_tokens, **GREEDY)
                answers[i] = (reply.choices[0].message.content, reply.choices[0].finish_reason)
        except BaseException as error:  # raised below
            errors.append(error)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return [answers[i] for i in range(len(jobs))]


def check_batched_equals_alone(client, model: str, reference: Reference, n: int = 32, max_tokens: int = 6) -> None:
    """``n`` requests at once all complete (no 5xx), each with the answer it gets alone, which is the reference's.

    Greedy: batching must not mix requests up, so each answer is token for token that of the same request
    sent by itself; every fourth is also that of lollm's single-sequence loop in this process.
    """
    jobs = _questions(n)
    alone = [ask_at_once(client, model, [job], max_tokens)[0] for job in jobs]
    for job, (text, finish) in list(zip(jobs, alone))[::4]:
        expected = reference.generate(reference.chat_ids(job), max_tokens)
        assert text == expected.text and finish == ("stop" if expected.stop_reason == "eos" else "length"), (job, text)
    together = ask_at_once(client, model, jobs, max_tokens)
    assert together == alone, [(i, a, b) for i, (a, b) in enumerate(zip(together, alone)) if a != b]


def check_engine_batches(client, model: str, base_url: str, n: int = 8, max_tokens: int = 16) -> None:
    """``n`` requests at once share engine steps: some step gave a token to more than one request (/metrics)."""
    before = metrics(base_url)
    ask_at_once(client, model, _questions(n), max_tokens)
    after = metrics(base_url)
    steps = after["lollm_engine_step_requests_count"] - before["lollm_engine_step_requests_count"]
    single = after["lollm_engine_step_requests_bucket{le=1.0}"] - before["lollm_engine_step_requests_bucket{le=1.0}"]
    assert steps > single, f"every one of the {steps} engine steps served a single request: nothing was batched"


def check_disconnect_frees_blocks(client, model: str, base_url: str) -> None:
    """A client that closes its stream mid-answer: the request is cancelled and its KV blocks go back to the pool."""
    before = health(base_url)["requests"]
    stream = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=100_000, stream=True, **GREEDY)
    for received, _ in enumerate(stream):
        if received == 4:
            break
    assert metrics(base_url)["lollm_kv_blocks_used"] > 0  # the request holds its blocks while it runs
    stream.close()
    deadline = time.monotonic() + 120  # hang guard, far above the few steps it takes
    while health(base_url)["requests"]["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the server did not cancel the generation of the client that went away"
        time.sleep(0.1)
    assert health(base_url)["requests"]["completed"] == before["completed"], "the abandoned generation ran to its end"
    while (now := metrics(base_url))["lollm_kv_blocks_used"] or now["lollm_requests_running"]:
        assert time.monotonic() < deadline, f"the cancelled request kept its blocks: {now}"
        time.sleep(0.1)


def post(url: str, body: dict[str, object]) -> tuple[int, dict[str, str], dict[str, object]]:
    """POST ``body`` as JSON; (status, headers with lower-case names, parsed JSON answer)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.loads(error.read())


def check_full_queue_is_a_503(client, model: str, base_url: str) -> None:
    """On a server of ``--max-running 1 --max-queue 1``: one request runs, one waits, the next gets 503 + Retry-After.

    The running one is a stream left open (it runs until its client goes away), so the queue stays full
    for as long as the test needs it; when it closes, the waiting one runs and completes.
    """
    running = client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=100_000, stream=True, **GREEDY)
    next(iter(running))  # the first chunk: it is in the engine
    waiting: list[ChatCompletion] = []
    second = threading.Thread(target=lambda: waiting.append(
        client.chat.completions.create(model=model, messages=CONVERSATION, max_tokens=2, **GREEDY)))
    second.start()
    deadline = time.monotonic() + 60  # hang guard
    while metrics(base_url)["lollm_requests_waiting"] < 1:
        assert time.monotonic() < deadline and second.is_alive(), "the second request never waited"
        time.sleep(0.05)
    status, headers, body = post(base_url + "/chat/completions", {"model": model, "messages": CONVERSATION, "max_tokens": 2})
    running.close()
    second.join(timeout=120)
    assert status == 503, (status, body)
    assert int(headers["retry-after"]) >= 1
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == "server_overloaded"
    assert waiting and waiting[0].choices[0].finish_reason in ("stop", "length")  # the queued one was served


# -- schemathesis against a live server (nox -s schemathesis) ----------------------------------

#: The schemathesis checks run: no 5xx, only documented statuses, content types and headers, and
#: answers that match their schema. (Not "positive data acceptance": a request the schema allows
#: may still be refused, e.g. by the chat template or a temperature that overflows the logits.)
SCHEMATHESIS_CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
                       "response_headers_conformance,response_schema_conformance")


def write_chat_checkpoint(folder: str | Path) -> Path:
    """A tiny random qwen2 that chats (ChatML tokenizer of 512 ids), written in ``folder``.

    Needs lollm-qwen to serve it and transformers (lollm-core[parity]) to write it.
    """
    raw = shrink_config(hub_config("Qwen__Qwen2.5-0.5B"), vocab_size=512, bos_token_id=0, eos_token_id=0,
                        initializer_range=0.1, tie_word_embeddings=False)
    return write_tiny_tokenizer(write_tiny_checkpoint(raw, folder), vocab_size=512)


def run_schemathesis(examples: int, *extra: str) -> int:
    """Start ``lollm serve`` on a tiny qwen2 and run ``schemathesis run`` against its /openapi.json.

    ``examples`` cases at most per operation and phase; ``extra`` goes to schemathesis, which runs in a
    temporary folder (with the checkpoint). Returns its exit status.
    """
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_chat_checkpoint(Path(tmp) / "tiny-qwen2")
        with run_server(folder, "--model-name", "tiny", "--ctx-size", "64") as url:
            command = [str(Path(sys.executable).parent / "schemathesis"), "run", url.removesuffix("/v1") + "/openapi.json",
                       "--checks", SCHEMATHESIS_CHECKS, "--max-examples", str(examples), "--request-timeout", "60",
                       *extra]
            print("$", " ".join(command), flush=True)
            return subprocess.run(command, cwd=tmp).returncode  # its caches and reports stay out of the repository


if __name__ == "__main__":
    sys.exit(run_schemathesis(int(sys.argv[1]) if len(sys.argv) > 1 else 50, *sys.argv[2:]))
