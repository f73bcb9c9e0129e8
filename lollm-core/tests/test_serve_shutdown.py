"""`lollm serve` stops on SIGTERM within its deadline and exits 0 (issue 42): a real process on the toy family.

The toy checkpoint here has no end-of-sequence token and a long context, so a request asking for
every token runs for many seconds (about 700 tokens a second on a loaded 2-core machine, slower
as its context grows) and is still running at the deadline. The server runs two requests at once
(``--max-running 2``); two more wait. Then SIGTERM, and the test checks the drain of
lollm.serve.shutdown:

* the port closes at once (a new connection is refused);
* the two queued requests are answered before the deadline: the plain one with 503
  (``server_shutting_down``), the stream with a last chunk whose finish_reason is "shutdown";
* the two running ones go on until the deadline, then the stream ends the same way (and
  ``data: [DONE]``) and the plain one gets 503;
* the process exits with status 0, within the deadline plus 2 s (plus a margin for a machine
  whose CPUs are shared: the bound checked is ``DEADLINE + 2 + MARGIN``; the time measured is in
  the assertion's message), and its log has one line per stopped request and no traceback.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from lollm.testing import serving

from _core_helpers import child_env
from test_cli_run import toy_site, write_checkpoint  # noqa: F401  (fixture: the toy family as a site folder)

DEADLINE = 3.0
#: Seconds allowed above the issue's bound (deadline + 2 s) on a machine shared with other work. The requests
#: ask for every token of a 32768-token context, so a server without a deadline would run for many minutes:
#: a generous margin still tells the two apart. The strict bound is the soak's (nox -s soak), on a whole run.
MARGIN = 25.0
CONTEXT = 32768


@pytest.fixture(scope="module")
def long_toy(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "toy", eos=False, max_position_embeddings=CONTEXT)


def ask(port: int, path: str, stream: bool, out: dict) -> None:
    """POST a request for every token; ``out`` gets status, finish (streams), done ([DONE] seen), code, at (monotonic)."""
    body = {"model": "toy", "max_tokens": 10**9, "temperature": 0, "stream": stream}
    body |= {"messages": [{"role": "user", "content": "go on"}]} if "chat" in path else {"prompt": "go on"}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        out["status"] = response.status
        if response.status != 200 or not stream:
            answer = json.loads(response.read())
            out["code"] = answer.get("error", {}).get("code")
        else:
            for line in response:
                if line.startswith(b"data: [DONE]"):
                    out["done"] = True
                elif line.startswith(b"data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        out["finish"] = choice.get("finish_reason") or out.get("finish")
    except Exception as error:  # recorded: the assertions say what went wrong
        out["error"] = repr(error)
    finally:
        out["at"] = time.monotonic()
        connection.close()


def wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # hang guard
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_sigterm_drains_until_the_deadline_then_exits_0(toy_site, long_toy):  # noqa: F811
    child, port, log = start(toy_site, long_toy, "--ctx-size", str(CONTEXT), "--max-running", "2",
                             "--shutdown-timeout", str(DEADLINE))
    root = f"http://127.0.0.1:{port}"
    answers = {name: {} for name in ("running stream", "running plain", "queued plain", "queued stream")}
    threads = []
    try:
        for name, path in (("running stream", "/v1/chat/completions"), ("running plain", "/v1/completions"),
                           ("queued plain", "/v1/completions"), ("queued stream", "/v1/chat/completions")):
            threads.append(threading.Thread(target=ask, args=(port, path, "stream" in name, answers[name])))
            threads[-1].start()
            key = "lollm_requests_running" if name.startswith("running") else "lollm_requests_waiting"
            count = 1 + name.endswith("plain") if name.startswith("running") else len(threads) - 2
            wait_for(lambda: serving.metrics(root)[key] >= count, f"{name} never got to {key}")
        signalled = time.monotonic()
        child.send_signal(signal.SIGTERM)
        wait_for(lambda: _refused(port), "the port stayed open after SIGTERM", timeout=10)
        status = child.wait(timeout=DEADLINE + 60)  # hang guard; the bound is checked below
        exited = time.monotonic() - signalled
        for thread in threads:
            thread.join(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    text = _log(log)
    assert status == 0, f"exit status {status}\n{text}"
    assert exited <= DEADLINE + 2 + MARGIN, f"exited {exited:.1f} s after SIGTERM\n{text}"
    when = {name: answer["at"] - signalled for name, answer in answers.items()}
    assert answers["queued plain"] | {"at": 0} == {"status": 503, "code": "server_shutting_down", "at": 0}, answers
    assert answers["queued stream"] | {"at": 0} == {"status": 200, "finish": "shutdown", "done": True, "at": 0}, answers
    assert answers["running plain"] | {"at": 0} == {"status": 503, "code": "server_shutting_down", "at": 0}, answers
    assert answers["running stream"] | {"at": 0} == {"status": 200, "finish": "shutdown", "done": True, "at": 0}, answers
    assert max(when["queued plain"], when["queued stream"]) < DEADLINE, when  # at once, not at the deadline
    assert min(when["running plain"], when["running stream"]) >= DEADLINE - 0.1, when  # they ran until the deadline
    stopped = [line for line in text.splitlines() if "server shutting down: generation stopped" in line]
    assert len(stopped) == 4 and "Traceback" not in text, text
    assert "shutting down: requests running 2, queued and refused 2" in text, text


def _up(root: str) -> bool:
    try:
        return serving.http(root + "/health")[0] == 200
    except OSError:
        return False


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return True
    return False


def _log(log) -> str:
    log.seek(0)
    return log.read()[-6000:]


def test_an_idle_server_stops_at_once_on_ctrl_c(toy_site, long_toy):  # noqa: F811
    """SIGINT (Ctrl-C) with nothing running: no wait for the 30 s deadline (25 s allows a busy machine and still tells them apart), exit status 0."""
    child, _, log = start(toy_site, long_toy, "--shutdown-timeout", "30")
    try:
        signalled = time.monotonic()
        child.send_signal(signal.SIGINT)
        status = child.wait(timeout=60)  # hang guard
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert status == 0 and time.monotonic() - signalled < 25, (status, time.monotonic() - signalled, _log(log))


def start(site, checkpoint, *args: str) -> tuple[subprocess.Popen, int, object]:
    """``lollm serve checkpoint ARGS`` in a child process, once /health answers: (process, port, its log file)."""
    port = serving.free_port()
    log = tempfile.TemporaryFile(mode="w+")
    child = subprocess.Popen([sys.executable, "-m", "lollm.cli", "serve", str(checkpoint), "--port", str(port), *args],
                             stdout=log, stderr=subprocess.STDOUT, env=child_env(site, OMP_NUM_THREADS="1"))
    try:
        wait_for(lambda: _up(f"http://127.0.0.1:{port}") or child.poll() is not None, "lollm serve did not start", 180)
    except AssertionError:
        child.kill()
        raise
    assert child.poll() is None, _log(log)
    return child, port, log
