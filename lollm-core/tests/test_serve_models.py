"""Several models behind one ``lollm serve`` (lollm.serve.models): the request's ``model`` picks one.

Two tiny random checkpoints, a qwen2 and a gemma3 (lollm.testing.tiny, vocabulary of 512 ids,
ChatML tokenizer), served at once by the application in this process (uvicorn in a thread).
What each test proves:

* requests to both, interleaved and at once, answer each model's own greedy text (a reference
  run of lollm in the test process); /v1/models lists both with whether each is loaded;
* a memory budget that holds one model only: asking for the other unloads the least recently
  used, and asking for the first again reloads it and answers the same text as before;
* an unknown model is a 404 naming the models served, in each API's error shape (Chat
  Completions, Completions, Messages, Responses); a missing one a 400;
* a model whose load fails (a corrupt weights file) is a 500 naming the model and the cause
  for its requests alone: the others still answer;
* /metrics labels every series with ``model``;
* while only busy models could be unloaded, a load waits (never unloading a model with a
  request in flight), and goes on once one is idle (lollm.serve.models, no model needed);
* the command line: a folder of models, names, a clash, the flags that take one model only.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from lollm.cli.hub_configs import hub_config
from lollm.errors import LollmError
from lollm.load.options import LoadOptions
from lollm.serve.app import create_app
from lollm.serve.model_server import ModelServer
from lollm.serve.models import ModelEntry, ServedModels, weight_bytes
from lollm.serve.requests import body_limit
from lollm.testing import serving
from lollm.testing.tiny import shrink_config, write_tiny_checkpoint, write_tiny_tokenizer

pytest.importorskip("lollm_gemma", reason="lollm-gemma serves the tiny gemma3")  # installed in every CI session that runs this

CONTEXT = 64
QUESTION = [{"role": "user", "content": "Tell me about the quick brown fox."}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A folder of models: ``qwen`` (a tiny qwen2) and ``gemma`` (a tiny gemma3), each with a ChatML tokenizer."""
    site = tmp_path_factory.mktemp("models")
    qwen = serving.write_chat_checkpoint(site / "qwen")
    raw = shrink_config(hub_config("google__gemma-3-1b-it"), num_hidden_layers=2, sliding_window=8, vocab_size=512,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.1)
    gemma = write_tiny_tokenizer(write_tiny_checkpoint(raw, site / "gemma", schema="hub"), vocab_size=512)
    return {"qwen": qwen, "gemma": gemma}


@pytest.fixture(scope="module")
def references(folders) -> dict[str, serving.Reference]:
    with serving.one_torch_thread():
        return {name: serving.Reference(folder) for name, folder in folders.items()}


def expected(references: dict[str, serving.Reference], name: str, max_tokens: int = 8) -> str:
    reference = references[name]
    with serving.one_torch_thread():
        return reference.generate(reference.chat_ids(QUESTION), max_tokens).text


def entry(name: str, folder: Path, references: dict[str, serving.Reference], **fields: object) -> ModelEntry:
    """The model ``folder`` as ``lollm serve`` would serve it, named ``name`` (float32 on the CPU); ``fields``: more
    of ModelEntry's fields (``has_template``)."""
    from lollm.load.pipeline import open_model

    def load() -> ModelServer:
        return ModelServer(open_model(str(folder), LoadOptions(device="cpu", dtype="float32")), name=name,
                           context=CONTEXT)

    size = weight_bytes(references[name].loaded.checkpoint.weights, 4) if name in references else 0
    return ModelEntry(name, str(folder), size, load=load, **fields)


@contextmanager
def served(entries: list[ModelEntry], budget: int | None = None) -> Iterator[tuple[str, ServedModels]]:
    """The models behind uvicorn in a thread, the first loaded as ``lollm serve`` loads it; yields (root, models)."""
    models = ServedModels(entries, budget_bytes=budget, max_body_bytes=body_limit(CONTEXT))
    models.load_first()
    try:
        with serving.app_in_thread(create_app(models)) as root:
            yield root, models
    finally:
        models.close()


def ask(client, model: str, max_tokens: int = 8) -> str:
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=max_tokens, temperature=0)
    assert answer.model == model
    return answer.choices[0].message.content


def loaded_flags(root: str) -> dict[str, bool]:
    status, body = serving.http(root + "/v1/models")
    assert status == 200
    return {m["id"]: m["loaded"] for m in body["data"]}


def test_two_models_answer_interleaved_and_at_once(folders, references, caplog):
    import logging

    want = {name: expected(references, name) for name in folders}
    assert want["qwen"] != want["gemma"]  # two different models, so a mix-up would show
    with served([entry(n, f, references) for n, f in folders.items()]) as (root, models):
        assert loaded_flags(root) == {"qwen": True, "gemma": False}  # the first at start, the others on first use
        client = serving.openai_client(root + "/v1")
        with caplog.at_level(logging.INFO, logger="lollm.serve.server"):
            for name in ["gemma", "qwen", "gemma", "qwen"]:
                assert ask(client, name) == want[name]
        lines = [r.getMessage() for r in caplog.records if ": prompt " in r.getMessage()]
        assert [line.split(":")[0] for line in lines] == [f"/v1/chat/completions ({n})" for n in ["gemma", "qwen"] * 2]
        assert loaded_flags(root) == {"qwen": True, "gemma": True}
        answers: dict[int, str] = {}
        order = ["qwen", "gemma"] * 3
        threads = [threading.Thread(target=lambda i=i, n=n: answers.__setitem__(i, ask(client, n)))
                   for i, n in enumerate(order)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert [answers.get(i) for i in range(len(order))] == [want[n] for n in order]
        samples = serving.metrics(root + "/v1")
        assert samples["lollm_requests_total{model=qwen,outcome=completed}"] == 5
        assert samples["lollm_requests_total{model=gemma,outcome=completed}"] == 5
        assert samples["lollm_kv_blocks_total{model=gemma}"] > 0 and "lollm_kv_blocks_total" not in samples
        assert [m["loads"] for m in serving.http(root + "/health")[1]["models"]] == [1, 1]


def test_a_budget_unloads_the_least_recently_used_and_a_reload_answers_the_same(folders, references):
    want = {name: expected(references, name) for name in folders}
    entries = [entry(n, f, references) for n, f in folders.items()]
    budget = max(e.weight_bytes for e in entries) + 1  # one model at a time
    assert sum(e.weight_bytes for e in entries) > budget
    with served(entries, budget) as (root, models):
        client = serving.openai_client(root + "/v1")
        assert ask(client, "qwen") == want["qwen"]
        first_load = weakref.ref(models.entries["qwen"].server.model)
        assert ask(client, "gemma") == want["gemma"]
        assert loaded_flags(root) == {"qwen": False, "gemma": True}
        gc.collect()
        assert first_load() is None  # the unloaded model's memory is let go: nothing holds its weights
        assert ask(client, "qwen") == want["qwen"]  # loaded again
        assert loaded_flags(root) == {"qwen": True, "gemma": False}
        assert [e.loads for e in models.entries.values()] == [2, 1]
    biggest = max(entries, key=lambda e: e.weight_bytes)
    with pytest.raises(LollmError, match=rf"--memory-budget .* the model '{biggest.name}' .* alone needs about"):
        ServedModels(entries, budget_bytes=biggest.weight_bytes - 1, max_body_bytes=1 << 20)


def test_an_unknown_model_is_a_404_naming_the_models_served_in_each_api_shape(folders, references):
    with served([entry(n, f, references) for n, f in folders.items()]) as (root, _):
        bodies = {"/v1/chat/completions": {"messages": QUESTION},
                  "/v1/completions": {"prompt": "hello"},
                  "/v1/messages": {"messages": QUESTION, "max_tokens": 4},
                  "/v1/messages/count_tokens": {"messages": QUESTION},
                  "/v1/responses": {"input": "hello"}}
        for path, body in bodies.items():
            status, _, answer = serving.post(root + path, {"model": "gpt-4o", **body})
            assert status == 404, (path, answer)
            if path.startswith("/v1/messages"):  # Anthropic's shape
                assert answer["type"] == "error" and answer["error"]["type"] == "not_found_error"
                message = answer["error"]["message"]
            else:
                assert answer["error"]["code"] == "model_not_found" and answer["error"]["param"] == "model"
                message = answer["error"]["message"]
            assert "'gpt-4o'" in message and "'qwen', 'gemma'" in message, (path, message)
        status, _, answer = serving.post(root + "/v1/chat/completions", {"messages": QUESTION})
        assert status == 400 and "'qwen', 'gemma'" in answer["error"]["message"] and answer["error"]["param"] == "model"


def test_a_model_that_fails_to_load_is_an_error_for_its_requests_alone(folders, references, tmp_path):
    broken = shutil.copytree(folders["gemma"], tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short: the header promises tensors the file lacks
    entries = [entry(n, f, references) for n, f in folders.items()] + [entry("broken", broken, references)]
    with served(entries) as (root, _):
        for path, body in (("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4}),
                           ("/v1/messages", {"messages": QUESTION, "max_tokens": 4})):
            status, _, answer = serving.post(root + path, {"model": "broken", **body})
            message = answer["error"]["message"]
            assert status == 500 and "the model 'broken'" in message and "failed to load" in message, answer
            assert "model.safetensors" in message  # the cause names the file
        client = serving.openai_client(root + "/v1")
        assert ask(client, "gemma") == expected(references, "gemma")
        assert loaded_flags(root) == {"qwen": True, "gemma": True, "broken": False}


class Busy:
    """A stand-in ModelServer whose requests are in flight until :attr:`done` is set (no model)."""

    def __init__(self, name: str):
        self.name, self.model, self.done, self.engine_loop = name, None, False, None
        self.closed = False

    def live_jobs(self) -> int:
        return 0 if self.done else 1

    def close(self) -> None:
        self.closed = True


def test_a_load_waits_while_every_loaded_model_is_busy_and_never_unloads_one(monkeypatch):
    import lollm.load.quantized as quantized

    monkeypatch.setattr(quantized, "model_bytes", lambda model: 0)  # the stand-ins hold no weights
    first, second = Busy("a"), Busy("b")
    entries = [ModelEntry("a", "a", 10, load=lambda: first), ModelEntry("b", "b", 10, load=lambda: second)]
    models = ServedModels(entries, budget_bytes=15, max_body_bytes=1 << 20)
    models.load_first()
    entries[0].resident_bytes = 10

    async def scenario() -> None:
        waiting = asyncio.create_task(models._ready(entries[1]))
        await asyncio.sleep(0.3)
        assert not waiting.done() and not first.closed  # "a" has a request in flight: "b" waits for room
        first.done = True
        assert await asyncio.wait_for(waiting, 10) is second
        assert first.closed and entries[0].server is None

    asyncio.run(scenario())


def test_the_command_line_names_the_models_of_a_folder_and_refuses_a_clash(tmp_path):
    from lollm.cli.serve_command import check_several, model_specs, served_name

    for name in ("b-model", "a-model"):
        (tmp_path / "site" / name).mkdir(parents=True)
        (tmp_path / "site" / name / "config.json").write_text(json.dumps({}))
    for name in ("c.gguf", "mmproj-c.gguf", "d.gguf"):
        (tmp_path / "site" / name).write_bytes(b"")
    specs = model_specs(None, [str(tmp_path / "site")])
    assert [served_name(s.model) for s in specs] == ["a-model", "b-model", "c", "d"]  # mmproj: a projector, not a model
    assert [s.mmproj for s in specs] == [None, None, str(tmp_path / "site" / "mmproj-c.gguf"), None]  # paired by name
    assert [s.model for s in model_specs(None, [str(tmp_path / "site" / "a-model")])] == [str(tmp_path / "site" / "a-model")]
    assert served_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct"
    with pytest.raises(LollmError, match=r"--model-name serves one model; 2 were given"):
        check_several(["x", "y"], tp=1, mtp=False, model_name="z", memory_budget=None)
    with pytest.raises(LollmError, match=r"--memory-budget must be a number of gigabytes > 0, got -1"):
        check_several(["x"], tp=1, mtp=False, model_name=None, memory_budget=-1)
    same = [ModelEntry("m", "one/m", 0, load=lambda: None), ModelEntry("m", "two/m.gguf", 0, load=lambda: None)]
    with pytest.raises(LollmError, match=r"two models are named 'm': one/m and two/m.gguf"):
        ServedModels(same, max_body_bytes=1 << 20)


def test_lollm_serve_a_folder_of_models(folders, references):
    """The command end to end: ``lollm serve FOLDER --memory-budget GB`` serves the models it holds, in name order."""
    budget = max(references[name].loaded.checkpoint.weights.nbytes() for name in folders) * 1.5 / 1e9
    with serving.run_server(folders["qwen"].parent, "--ctx-size", str(CONTEXT), "--memory-budget", f"{budget:.6f}") as base:
        assert loaded_flags(base.removesuffix("/v1")) == {"gemma": True, "qwen": False}
        client = serving.openai_client(base)
        for name in ("qwen", "gemma"):
            assert ask(client, name) == expected(references, name)
        assert loaded_flags(base.removesuffix("/v1")) == {"gemma": True, "qwen": False}  # the budget holds one


def test_the_messages_api_refuses_in_its_own_shape(folders, references):
    """The guard's 403 and 415 and the key's 401 on /v1/messages are Anthropic-shaped, and the 401 names x-api-key;
    on the OpenAI endpoints they keep OpenAI's shape, and the 401 names only the Bearer header."""
    from starlette.testclient import TestClient

    from lollm.serve.guard import Guard, GuardConfig

    models = ServedModels([entry("qwen", folders["qwen"], references)], api_key="sesame", max_body_bytes=1 << 20)
    models.load_first()
    body = {"model": "qwen", "messages": QUESTION, "max_tokens": 2}
    try:
        with TestClient(Guard(create_app(models), GuardConfig(allowed_hosts=("testserver",)))) as client:
            answers = {
                415: client.post("/v1/messages", content=json.dumps(body), headers={"content-type": "text/plain"}),
                403: client.post("/v1/messages", json=body, headers={"origin": "http://elsewhere.example"}),
                401: client.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})}
            kinds = {415: "invalid_request_error", 403: "permission_error", 401: "authentication_error"}
            for status, answer in answers.items():
                assert answer.status_code == status and answer.json()["type"] == "error", (status, answer.text)
                assert answer.json()["error"]["type"] == kinds[status]
            assert "'x-api-key: <key>' or 'Authorization: Bearer <key>'" in answers[401].json()["error"]["message"]
            plain = client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer wrong"})
            assert plain.status_code == 401 and plain.json()["error"]["code"] == "invalid_api_key"
            assert "x-api-key" not in plain.json()["error"]["message"]
            plain = client.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "text/plain"})
            assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
            assert client.post("/v1/messages", json=body, headers={"x-api-key": "sesame"}).status_code == 200
    finally:
        models.close()


def test_a_request_the_shutdown_stopped_logs_finish_shutdown(references, caplog):
    """The log line of a request the shutdown stopped says "finish shutdown", as its client was told."""
    import logging
    from types import SimpleNamespace

    from lollm.generate.loop import GenerationResult

    server = ModelServer(references["qwen"].loaded, name="qwen", context=CONTEXT, batched=False)
    result = GenerationResult(prompt_ids=[1, 2], new_ids=[3], stop_reason="cancelled", prefill_seconds=0.01)
    try:
        with caplog.at_level(logging.INFO, logger="lollm.serve.server"):
            server.report(SimpleNamespace(shutdown=True, endpoint="/v1/chat/completions", ids=[1, 2]), result, "cancelled")
            server.report(SimpleNamespace(shutdown=False, endpoint="/v1/chat/completions", ids=[1, 2]), result, "cancelled")
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if "finish" in r.getMessage()]
    assert [line.rsplit("finish ", 1)[1] for line in lines] == ["shutdown", "cancelled"], lines


def test_a_second_ctrl_c_quits_without_a_traceback(folders):
    """Ctrl-C twice while streams run (uvicorn's force quit): the server exits 0 and logs no traceback (its
    lifespan task, which lollm does not use, is off: cancelled, it logged starlette's CancelledError)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    port = serving.free_port()
    env = {**os.environ, "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "lollm.cli", "serve", str(folders["qwen"]), "--port", str(port),
                              "--ctx-size", "2048"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    root = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": "qwen", "messages": QUESTION, "max_tokens": 2000, "stream": True}).encode()

    def stream() -> None:
        request = urllib.request.Request(root + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as answer:
                answer.read()
        except OSError:
            pass

    try:
        deadline = time.monotonic() + 120
        while not _answers(root + "/health"):
            assert child.poll() is None and time.monotonic() < deadline, "lollm serve did not start"
            time.sleep(0.2)
        for _ in range(4):
            threading.Thread(target=stream, daemon=True).start()
        while "lollm_requests_running 0.0" in _metrics_text(root):  # until the streams run (one may end soon: eos)
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        output, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, output[-3000:]
    assert "shutting down: requests running" in output and "Traceback" not in output, output[-3000:]


def _answers(url: str) -> bool:
    try:
        return serving.http(url)[0] == 200
    except OSError:
        return False


def _metrics_text(root: str) -> str:
    import urllib.request

    with urllib.request.urlopen(root + "/metrics", timeout=30) as answer:
        return answer.read().decode()


def test_lollm_serve_keeps_no_reference_to_an_unloaded_first_model(folders, monkeypatch):
    """``lollm serve A B``, in this process: once the model loaded at start is unloaded, nothing holds it.

    The command's own frames (the banner's model, the --tp check) once kept the first model's ModelServer
    for the server's whole life, so unloading it freed nothing (issue 40: RSS never went down). uvicorn's
    run is replaced by the check: unload the first model, then look for it with a weak reference.
    """
    from typer.testing import CliRunner

    from lollm.cli import app
    from lollm.serve.shutdown import DrainingServer

    seen: dict[str, object] = {}

    def run(runner: DrainingServer) -> None:
        models = runner.model_server
        first = models.first
        model, engine = weakref.ref(first.server.model), weakref.ref(first.server.engine_loop.engine)
        models.unload(first, why="in the test")
        gc.collect()
        seen.update(model=model(), engine=engine(), loaded=first.server)

    monkeypatch.setattr(DrainingServer, "run", run)
    done = CliRunner().invoke(app, ["serve", str(folders["qwen"]), str(folders["gemma"]), "--ctx-size", str(CONTEXT),
                                    "--port", "0"])
    assert done.exit_code == 0, done.output
    assert seen == {"model": None, "engine": None, "loaded": None}


def test_a_packed_gguf_is_estimated_at_the_size_it_loads_in(folders, tmp_path):
    """A GGUF loaded with its blocks packed (``--weights auto``) counts its matrices at their file bytes.

    Measured on the loaded model (lollm.load.quantized.model_bytes); counted as float32, the estimate
    was about 4 times the loaded size, and a small --memory-budget refused the model at start (issue 40).
    """
    from lollm.load.pipeline import open_model
    from lollm.load.quantized import model_bytes
    from lollm.testing.gguf_writer import write_tiny_gguf

    path = write_tiny_gguf(folders["qwen"], tmp_path / "qwen.gguf", "Q8_0")
    loaded = open_model(str(path), LoadOptions(device="cpu", dtype="float32", weights="auto"))
    assert loaded.options.quantization.mode == "gguf"
    held, weights = model_bytes(loaded.model), loaded.checkpoint.weights
    estimate = weight_bytes(weights, 4, packed=True)
    assert abs(estimate - held) <= 0.05 * held, (estimate, held)
    assert weight_bytes(weights, 4) > 2 * held  # the float32 count the estimate was before


def test_a_chat_request_to_a_model_without_a_chat_template_evicts_nothing(folders, references):
    """A chat request (Chat Completions, Messages, count_tokens, Responses) to an unloaded model whose tokenizer has
    no chat template is a 400 at once: nothing is unloaded, nothing loaded (it took a 9 s load to learn it, issue 40).
    /v1/models tells which models chat (lollm's ``chat`` field)."""
    entries = [entry("qwen", folders["qwen"], references), entry("gemma", folders["gemma"], references,
                                                                 has_template=lambda: False)]
    with served(entries, max(e.weight_bytes for e in entries) + 1) as (root, models):
        conversation = [{"role": "user", "content": "Hi"}]
        for path, body, field, shape in (
                ("/v1/chat/completions", {"messages": conversation}, "messages", "openai"),
                ("/v1/messages", {"messages": conversation, "max_tokens": 4}, "messages", "anthropic"),
                ("/v1/messages/count_tokens", {"messages": conversation}, "messages", "anthropic"),
                ("/v1/responses", {"input": "Hi"}, "input", "openai")):
            status, answer = serving.http(root + path, json.dumps({"model": "gemma", **body}).encode())
            assert status == 400, (path, answer)
            error = answer["error"]
            assert "'gemma' has no chat template" in error["message"], (path, answer)
            if shape == "openai":
                assert error["param"] == field, (path, answer)
            else:
                assert answer["type"] == "error" and error["type"] == "invalid_request_error", (path, answer)
        assert loaded_flags(root) == {"qwen": True, "gemma": False}
        assert models.entries["gemma"].loads == 0
        status, listing = serving.http(root + "/v1/models")
        assert {m["id"]: m["chat"] for m in listing["data"]} == {"qwen": True, "gemma": False}
