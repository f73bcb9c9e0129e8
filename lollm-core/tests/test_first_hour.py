"""The first hour (issue 41): the names ``lollm list`` prints work as they are, the hub is given up at
once when it cannot be reached, and every check that needs no model runs before the model loads.

The checks are proven in order, not only present: the ``loader_must_not_run`` fixture replaces every
way a command loads a model with one that fails the test, so a check moved after the load fails here.
The model is the documented toy family (docs/examples/lollm-toy), as in test_cli_run.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from _core_helpers import child_env
from test_cli_run import GREEDY, invoke, ok, toy_site, write_checkpoint  # noqa: F401  (fixtures)
from test_list_pull import hub_repo, write_tiny_gguf

from lollm.errors import LollmError


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """lollm's cache (``$LOLLM_CACHE``) holding the toy checkpoint as ``toymodel/safetensors``; no hub cache."""
    own = tmp_path / "lollm-cache"
    folder = write_checkpoint(own / "toymodel" / "safetensors")
    monkeypatch.setenv("LOLLM_CACHE", str(own))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return own, folder


@pytest.fixture
def loader_must_not_run(monkeypatch):
    """Every way a command loads a model fails the test: a check that runs after it cannot pass unseen."""
    import lollm.cli.trace.run as trace_run
    import lollm.load.pipeline as pipeline
    import lollm.proof.parity as parity

    loads: list[str] = []

    def load(spec, *args, **kwargs):
        loads.append(str(getattr(spec, "spec", spec)))
        raise AssertionError(f"the model {spec} was loaded before the check")

    for module, name in ((pipeline, "open_checkpoint"), (pipeline, "open_model"), (trace_run, "open_model"),
                         (parity, "run_parity")):
        monkeypatch.setattr(module, name, load)
    return loads


def failed_with(done, message: str) -> None:
    """The command stopped on a LollmError (exit status 2 through main) that says ``message``, and loaded nothing."""
    assert isinstance(done.exception, LollmError), (done.exception, done.output)
    assert message in str(done.exception), str(done.exception)


# -- the names lollm list prints ---------------------------------------------------------------------


def test_the_name_lollm_list_prints_runs_as_it_is(invoke, caches):
    own, folder = caches
    [row] = json.loads(ok(invoke("list", "--json")).stdout)
    assert (row["name"], row["path"]) == ("toymodel-safetensors", str(folder))
    by_name = ok(invoke("run", "toymodel-safetensors", "-p", "hello", *GREEDY))
    by_path = ok(invoke("run", folder, "-p", "hello", *GREEDY))
    assert by_name.stdout == by_path.stdout and by_name.stdout.strip()
    assert ok(invoke("tokenize", "toymodel-safetensors", "hello", "--json")).stdout == \
        ok(invoke("tokenize", folder, "hello", "--json")).stdout
    assert json.loads(ok(invoke("inspect", "toymodel-safetensors", "--json")).stdout)["summary"]["tensors"] > 0
    # the longer name (the path inside lollm's cache, as lollm list printed it before) is taken too
    assert ok(invoke("run", "toymodel/safetensors", "-p", "hello", *GREEDY)).stdout == by_path.stdout


def test_chat_and_serve_take_the_listed_name(invoke, caches, loader_must_not_run):
    for args in (("chat", "toymodel-safetensors"), ("serve", "toymodel-safetensors", "--port", "0")):
        done = invoke(*args, stdin="")
        assert isinstance(done.exception, AssertionError), (args, done.exception, done.output)  # it got to the load
    assert loader_must_not_run == ["toymodel-safetensors", "toymodel-safetensors"]


def test_two_models_of_one_short_name_keep_their_longer_names(tmp_path, monkeypatch):
    from lollm.load.loader import load_checkpoint
    from lollm.load.local_names import local_models, resolve_local

    own = tmp_path / "cache"
    for where in ("a", "b"):
        write_tiny_gguf(own / where / "m.gguf", "qwen2")
    write_tiny_gguf(own / "c" / "other.gguf", "qwen2")
    monkeypatch.setenv("LOLLM_CACHE", str(own))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    names = {m.name: m.path for m in local_models() if m.source == "lollm"}
    assert names == {"a/m.gguf": own / "a" / "m.gguf", "b/m.gguf": own / "b" / "m.gguf", "other": own / "c" / "other.gguf"}
    assert resolve_local("m") is None  # never a silent pick of one of them
    assert load_checkpoint("other").path == own / "c"


def test_a_pulled_gguf_runs_by_the_repo_and_quant_lollm_list_prints(tmp_path):
    """In a child process, so that huggingface_hub reads this HF_HUB_CACHE: the hub cache's GGUF, offline."""
    hub = tmp_path / "hub"
    write_tiny_gguf(hub_repo(hub, "lollm-test-org/tiny-GGUF") / "tiny-q8_0.gguf", "qwen2")
    code = ("from lollm.load.local_names import local_models, resolve_local\n"
            "[m] = local_models(); print(m.name, resolve_local(m.name) == m.path)")
    env = child_env(HF_HUB_CACHE=str(hub), LOLLM_CACHE=str(tmp_path / "own"), HF_HUB_OFFLINE="1")
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["lollm-test-org/tiny-GGUF:Q8_0", "True"]


# -- the hub, when it cannot be reached ------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args", [("run", "lollm-test-org/not-here", "-p", "hi"),
                                  ("run", "lollm-test-org/not-here-GGUF:Q4_K_M", "-p", "hi"),
                                  ("pull", "lollm-test-org/not-here-GGUF:Q4_K_M")])
def test_an_unreachable_hub_is_one_error_line_pointing_to_lollm_list(tmp_path, args):
    import subprocess

    env = child_env(HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}", HF_HUB_CACHE=str(tmp_path / "hub"),
                    LOLLM_CACHE=str(tmp_path / "own"))
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    done = subprocess.run([sys.executable, "-m", "lollm.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.splitlines()  # no "Retrying in 1s" from huggingface_hub, no traceback
    assert line.startswith(f"error: {args[1]}: not a model on this machine (lollm list shows them), and the "
                           f"Hugging Face hub at http://127.0.0.1:") and "cannot be reached" in line


def test_a_hub_that_does_not_answer_is_given_up_in_under_two_seconds(monkeypatch):
    """A DNS lookup or a connection that hangs: the probe waits PROBE_SECONDS, never the 10 s of socket timeouts."""
    import lollm.load.hub as hub

    import threading

    release = threading.Event()

    def hang(*args, **kwargs):
        release.wait(30)
        raise OSError("the test let the hung connection go")

    monkeypatch.setattr(hub.socket, "create_connection", hang)
    started = time.perf_counter()
    with pytest.raises(LollmError, match=r"cannot be reached \(.*no answer within 1 s\)"):
        hub.check_reachable("org/model")
    # the probe gives up after 1 s; the hung connection would hold it 30 s: a busy machine's bound in between
    assert time.perf_counter() - started < 15.0
    release.set()


def test_hf_hub_offline_names_itself_and_asks_nothing(monkeypatch):
    import lollm.load.hub as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "check_reachable", lambda *a, **k: pytest.fail("the hub was probed under HF_HUB_OFFLINE"))
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent")
    with pytest.raises(LollmError, match="HF_HUB_OFFLINE is set, so the hub is not asked"):
        hub.check_fetchable("lollm-test-org/not-here")


# -- every check that needs no model, before the model loads ----------------------------------------


def test_a_port_in_use_is_one_error_line_and_status_2_before_the_load(invoke, caches, loader_must_not_run):
    _, folder = caches
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        failed_with(invoke("serve", folder, "--port", str(port)),
                    f"--port {port}: 127.0.0.1:{port} is already in use (another lollm serve?)")
    assert loader_must_not_run == []


def test_a_port_in_use_exits_2_with_one_line(tmp_path):
    """The same through main(), in a child: the status and the one line a user sees (no model is named that exists)."""
    import subprocess

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "lollm.cli", "serve", str(tmp_path), "--port", str(port)],
                              capture_output=True, text=True, env=child_env(), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"error: --port {port}: 127.0.0.1:{port} is already in use (another lollm "
                                        f"serve?); stop what listens there or give another --port"]


@pytest.mark.parametrize("command, missing, message", [
    (("serve", "--port", "0"), "uvicorn", "lollm serve needs the serve extra (uvicorn is missing): pip install 'lollm-core[serve]'"),
    (("chat",), "prompt_toolkit", "lollm chat in a terminal needs the chat extra (prompt_toolkit is missing)"),
    (("parity",), "transformers", "lollm parity needs the parity extra (transformers is missing)"),
    (("trace", "-p", "hi", "--compare"), "transformers", "lollm trace --compare needs the parity extra"),
])
def test_a_missing_extra_is_named_before_the_load(invoke, caches, loader_must_not_run, monkeypatch, tmp_path,
                                                  command, missing, message):
    import lollm.cli.run as run

    monkeypatch.setattr(run, "terminal_is_interactive", lambda: True)  # chat edits lines only in a terminal
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: import fails, find_spec finds nothing
    monkeypatch.chdir(tmp_path)
    _, folder = caches
    failed_with(invoke(command[0], folder, *command[1:]), message)
    assert loader_must_not_run == []


@pytest.mark.parametrize("output, message", [("missing-folder/trace.html", "the folder missing-folder of --output does not exist"),
                                             (".", "is a folder; the page replaces only a regular file")])
def test_an_output_path_that_cannot_be_written_is_named_before_the_load(invoke, caches, loader_must_not_run, tmp_path,
                                                                        monkeypatch, output, message):
    monkeypatch.chdir(tmp_path)
    _, folder = caches
    failed_with(invoke("trace", folder, "-p", "hi", "-o", output), message)
    assert loader_must_not_run == []


def test_an_output_folder_without_write_permission_is_named(tmp_path, monkeypatch):
    """As root every folder is writable, so the refusal is checked through os.access."""
    from lollm.cli.trace import page

    monkeypatch.setattr(page.os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(LollmError, match="cannot write in the folder .* of --output"):
        page.check_output(tmp_path / "trace.html")


@pytest.mark.parametrize("flag, value, message", [
    ("--json-schema", '{"type": "string", "format": "nonsense"}', "--json-schema: json_schema cannot be enforced"),
    ("--regex", "(", "--regex: regex '(' cannot be enforced"),
])
def test_a_constraint_that_does_not_compile_is_named_before_the_load(invoke, caches, loader_must_not_run, flag, value,
                                                                     message):
    _, folder = caches
    failed_with(invoke("run", folder, "-p", "hi", flag, value), message)
    assert loader_must_not_run == []
