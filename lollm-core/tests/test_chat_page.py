"""The chat page at ``/`` of ``lollm serve`` and the server's log lines (issue 24, items 5 and 6).

The page is driven in a real headless Chromium (lollm.testing.browser) against
the server running in this process on the toy family (as in
test_server_hostile.py), through uvicorn in a thread. What each test proves:

* a message typed in the page streams an answer from /v1/chat/completions and
  the reply shows its statistics line (tokens, tok/s, first token) taken from
  the stream's usage chunk; the conversation is sent whole with the next message;
* a ``<script>`` in the user's text or the model's text is shown as text, never run;
* with ``--api-key`` the page asks for the key and works once it is given;
* every generation logs one line (endpoint, prompt / cached / generated tokens,
  time to first token, tok/s, finish reason), and the banner names the URL,
  the model, the family, the context, the chat page and a curl line.
"""

from __future__ import annotations

import json
import logging
import shlex
import time

import pytest

import lollm.serve.model_server as model_server_module
from lollm.generate.loop import GenerationResult
from lollm.serve.answers import request_line
from lollm.serve.app import banner, create_app
from lollm.serve.model_server import ModelServer
from lollm.serve.models import ModelEntry, ServedModels
from lollm.testing import serving
from lollm.testing.browser import Browser

from test_server_hostile import NAME, loaded  # noqa: F401  (the toy checkpoint, loaded once per module)

HOSTILE = "<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\">"
TYPED = "<script>window.pwned=3</script>"  # short: the toy's context is 128 positions


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


def _open(browser: Browser, url: str, timeout: float = 60) -> None:
    browser.errors()
    browser.driver.get(url)
    _wait(browser, "return document.body && document.body.dataset.ready === 'true'", timeout)


def _wait(browser: Browser, script: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # a hang guard far above the second these take
    while not browser.js(script):
        assert time.monotonic() < deadline, f"the page never satisfied: {script}"
        time.sleep(0.05)


def _say(browser: Browser, text: str) -> None:
    """Type ``text`` and send it; wait until its reply has statistics or an error."""
    from selenium.webdriver.common.by import By

    before = int(browser.js("return Number(document.body.dataset.replies || 0)"))
    box = browser.driver.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    browser.click("#send")
    _wait(browser, f"return Number(document.body.dataset.replies || 0) > {before}")


def test_page_streams_an_answer_with_its_statistics(loaded, browser):  # noqa: F811
    server = ModelServer(loaded, name=NAME, context=64)
    with serving.app_in_thread(create_app(server)) as root:
        _open(browser, root + "/")
        assert browser.texts("#model option") == [NAME]
        assert browser.js("return getComputedStyle(document.getElementById('key-box')).display") == "none"  # no key asked
        browser.js("document.getElementById('max_tokens').value = '5'; document.getElementById('temperature').value = '0'")
        _say(browser, "hello")
        assert browser.texts(".msg.error") == []
        stats = browser.texts(".msg.assistant .stats")[-1]
        assert stats.startswith("5 tokens · ") and "tok/s" in stats and "first token" in stats and "length" in stats, stats
        first = browser.texts(".msg.assistant .text")[-1]
        prompt = int(stats.split(" · prompt ")[1].split()[0])
        # the conversation goes on: the second request holds both turns, so its prompt is longer
        _say(browser, "again")
        stats = browser.texts(".msg.assistant .stats")[-1]
        assert int(stats.split(" · prompt ")[1].split()[0]) > prompt + 5, stats
        assert browser.texts(".msg .role") == ["user", "assistant", "user", "assistant"]
        assert browser.texts(".msg.assistant .text")[0] == first
        assert browser.errors() == []


def test_page_shows_markup_as_text(loaded, browser, monkeypatch):  # noqa: F811
    """A <script> from the user and from the model lands in the page as text: nothing runs, no element appears."""

    def hostile(model, ids, *, on_text=None, **kwargs):
        on_text(HOSTILE)
        return GenerationResult(prompt_ids=list(ids), new_ids=[1, 2], text=HOSTILE, stop_reason="eos",
                                prefill_seconds=0.01, decode_seconds=0.01)

    monkeypatch.setattr(model_server_module, "generate", hostile)
    server = ModelServer(loaded, name=NAME, context=64, batched=False)  # the single path calls the patched generate
    with serving.app_in_thread(create_app(server)) as root:
        _open(browser, root + "/")
        _say(browser, TYPED)
        assert browser.texts(".msg .text") == [TYPED, HOSTILE]
        assert browser.js("return window.pwned === undefined && document.querySelectorAll('#log script, #log img').length === 0")


def test_page_asks_for_the_api_key(loaded, browser):  # noqa: F811
    server = ModelServer(loaded, name=NAME, context=64, api_key="sesame")
    with serving.app_in_thread(create_app(server)) as root:
        _open(browser, root + "/")
        assert browser.js("return getComputedStyle(document.getElementById('key-box')).display") != "none"
        assert "API key" in browser.texts("#status")[0]
        browser.driver.find_element("id", "api_key").send_keys("sesame")
        browser.js("document.getElementById('max_tokens').value = '3'")
        _say(browser, "hello")
        assert browser.texts(".msg.error") == []
        assert browser.texts(".msg.assistant .stats")[-1].startswith("3 tokens")


def test_page_picks_a_model_and_folds_the_thinking(loaded, browser, monkeypatch):  # noqa: F811
    """Two models: the picker lists both (the second loads on first use) and a message goes to the one picked; a
    thinking answer's reasoning_content sits in a collapsible block above the answer, closed once the answer comes."""

    def thinking(model, ids, *, on_text=None, **kwargs):
        for piece in ("<think>", "I ponder", "</think>", "\n\n", "The answer"):
            on_text(piece)
        return GenerationResult(prompt_ids=list(ids), new_ids=[1, 2, 3], text="<think>I ponder</think>\n\nThe answer",
                                stop_reason="eos", prefill_seconds=0.01, decode_seconds=0.01)

    monkeypatch.setattr(model_server_module, "generate", thinking)  # the single path (batched=False) calls it
    monkeypatch.setattr(model_server_module, "opening", lambda tokenizer, ids: "start")  # as Qwen3's template leaves it
    entries = [ModelEntry(name, name, 0, load=lambda name=name: ModelServer(loaded, name=name, context=64, batched=False))
               for name in (NAME, "other")]
    entries.append(ModelEntry("base", "base", 0, load=lambda: None, has_template=lambda: False))  # never loads
    models = ServedModels(entries, max_body_bytes=1 << 20)
    models.load_first()
    try:
        with serving.app_in_thread(create_app(models)) as root:
            _open(browser, root + "/")
            assert browser.texts("#model option") == [NAME, "other (loads on first use)", "base (no chat template)"]
            assert browser.js("return document.querySelector('#model option[value=base]').disabled") is True
            browser.js("const s = document.getElementById('model'); s.value = 'other'; s.dispatchEvent(new Event('change'))")
            _say(browser, "hello")
            assert browser.texts(".msg.error") == []
            assert browser.texts(".msg.assistant .stats")[-1].endswith(" · other")
            assert browser.texts(".msg.assistant details.thinking .text") == ["I ponder"]
            assert browser.texts(".msg.assistant > .text") == ["The answer"]
            assert browser.js("return document.querySelector('.msg details.thinking').open") is False
            assert browser.texts("#model option") == [NAME, "other", "base (no chat template)"]  # loaded now
            assert browser.errors() == []
    finally:
        models.close()


def test_page_is_one_offline_file(loaded):  # noqa: F811
    """The page loads nothing from elsewhere, and its policy forbids any other origin."""
    from starlette.testclient import TestClient

    with TestClient(create_app(ModelServer(loaded, name=NAME, context=64))) as client:
        answer = client.get("/")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in answer.headers["content-security-policy"]
    assert "http://" not in answer.text and "https://" not in answer.text and " src=" not in answer.text
    assert "innerHTML" not in answer.text and "stream_options" in answer.text


def test_one_log_line_per_request(loaded, caplog):  # noqa: F811
    from starlette.testclient import TestClient

    body = {"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
    with TestClient(create_app(ModelServer(loaded, name=NAME, context=64))) as client, \
            caplog.at_level(logging.INFO, logger="lollm.serve.server"):
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert client.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "lollm.serve.server"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("/v1/chat/completions: prompt ") and "(cached 0), generated 4, first token " in lines[0]
    assert " ms, " in lines[0] and "tok/s, finish length" in lines[0]
    assert lines[1].startswith("/v1/chat/completions: prompt ") and "generated 4" in lines[1]


def test_request_line_reads_a_result():
    result = GenerationResult(prompt_ids=list(range(20)), new_ids=list(range(11)), stop_reason="eos",
                              prefill_seconds=0.25, decode_seconds=2.0, reused_tokens=12)
    assert request_line("/v1/completions", result) == (
        "/v1/completions: prompt 20 tokens (cached 12), generated 11, first token 250 ms, 5.0 tok/s, finish stop")
    one = GenerationResult(prompt_ids=[1], new_ids=[2], stop_reason="max_new_tokens", prefill_seconds=0.1)
    assert request_line("/v1/chat/completions", one).endswith("generated 1, first token 100 ms, - tok/s, finish length")


def test_banner_names_url_model_family_and_a_curl_line(loaded):  # noqa: F811
    lines = banner(ModelServer(loaded, name=NAME, context=64, api_key="sesame-secret"), "toy on cpu", "0.0.0.0", 8123)
    assert lines[0] == "lollm serve: toy (toy on cpu, context 64) at http://127.0.0.1:8123/v1 (API key required: export LOLLM_API_KEY=<the key> for the curl line below)"
    assert lines[1] == "chat page: http://127.0.0.1:8123/"
    curl = shlex.split(lines[2].removeprefix("try: "))  # as a shell reads it
    assert curl[:2] == ["curl", "http://127.0.0.1:8123/v1/chat/completions"]
    assert "Authorization: Bearer $LOLLM_API_KEY" in curl and "sesame-secret" not in "".join(lines)  # never the key
    assert json.loads(curl[curl.index("-d") + 1])["model"] == NAME


def test_a_base_models_banner_shows_a_plain_completion(loaded, monkeypatch):  # noqa: F811
    """Without a chat template /v1/chat/completions answers 400, so the line to paste asks /v1/completions."""
    server = ModelServer(loaded, name=NAME, context=64)
    monkeypatch.setattr(server, "tokenizer", type("Base", (), {"chat_template": None})())
    curl = shlex.split(banner(server, "toy on cpu", "127.0.0.1", 8123)[2].removeprefix("try: "))
    assert curl[:2] == ["curl", "http://127.0.0.1:8123/v1/completions"]
    body = json.loads(curl[curl.index("-d") + 1])
    assert body["model"] == NAME and "prompt" in body and "messages" not in body


def test_the_banner_comes_once_the_server_listens(loaded):  # noqa: F811
    """serve()'s announcer logs the banner only after uvicorn has bound the port, with the port it bound (here
    ``--port 0``: the OS chooses): at the moment each line is logged, the chat page it names answers."""
    import re
    import threading
    import urllib.request

    import uvicorn

    from lollm.serve.app import announce

    server = ModelServer(loaded, name=NAME, context=64)
    runner = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    seen: list[tuple[str, int]] = []

    class Probe(logging.Handler):  # at the moment each line is logged, fetch the chat page at the port it names
        def emit(self, record: logging.LogRecord) -> None:
            port = re.search(r"http://127\.0\.0\.1:(\d+)/", record.getMessage()).group(1)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as answer:
                seen.append((record.getMessage(), answer.status))

    probe = Probe(level=logging.INFO)
    logger = logging.getLogger("lollm.serve.server")
    logger.addHandler(probe)
    before = logger.level
    logger.setLevel(logging.INFO)
    made: list[list[str]] = []

    def lines(port: int) -> list[str]:
        made.append(banner(server, "toy on cpu", "127.0.0.1", port)[:3])  # the lines that name a URL
        return made[-1]

    announcer = threading.Thread(target=announce, args=(runner, lines), daemon=True)
    announcer.start()
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        announcer.join(timeout=60)
        assert not announcer.is_alive()
    finally:
        runner.should_exit = True
        thread.join(timeout=30)
        logger.removeHandler(probe)
        logger.setLevel(before)
    assert len(made) == 1 and seen == [(line, 200) for line in made[0]]
    assert ":0/" not in "".join(made[0])


def test_the_banner_names_the_port_the_os_chose(caplog):
    """``--port 0``: the banner's URLs carry the port the socket was bound to, not 0 (they must answer)."""
    import socket
    from types import SimpleNamespace

    from lollm.serve.app import announce

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        bound = sock.getsockname()[1]
        runner = SimpleNamespace(started=True, should_exit=False, config=SimpleNamespace(port=0),
                                 servers=[SimpleNamespace(sockets=[sock])])
        with caplog.at_level(logging.INFO, logger="lollm.serve.server"):
            announce(runner, lambda port: [f"chat page: http://127.0.0.1:{port}/"])
    assert [r.getMessage() for r in caplog.records] == [f"chat page: http://127.0.0.1:{bound}/"]
    assert bound != 0
