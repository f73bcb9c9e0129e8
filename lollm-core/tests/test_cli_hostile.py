"""Hostile flags, files and prompts on the command line (issue 22, classes 2, 3, 8 and 10).

Each must end in one ``error:`` line (exit status 2) naming the flag, file or
limit, or in a correct result:

* numbers: ``--threads`` above :func:`lollm.cli.checks.threads_limit` (a million exhausted the
  machine's threads) and ``--ctx-size`` of 0 or less (silently the default) are
  refused before torch is imported, on every command that takes them;
* special files: ``--prompts-file`` and ``tokenize --file`` refuse a folder, a FIFO
  and ``/dev/zero`` before reading a byte, and every input (stdin too) is bounded;
  ``trace -o`` never replaces a symlink, a FIFO or a device node, ``-o ''`` is one
  line, and a failed write leaves what was there and no temporary file;
* ``lollm trace`` refuses a prompt longer than the model's context or whose capture
  would not fit the memory free, before it captures;
* ``lollm chat`` goes on once the context is full (the oldest turns leave, with a
  note), or with ``--no-context-shift`` says how to go on (``/drop N``, ``/reset``).

The children that read what never ends run under an address-space and a
CPU-time limit, so a regression fails here instead of taking the machine.
"""

from __future__ import annotations

import os
import re
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from _core_helpers import child_env
from test_cli_run import PROBE, ckpt, invoke, lollm, ok, toy_site  # noqa: F401  (fixtures)
from lollm.load.options import LoadOptions

STATS = re.compile(r"^\[\d+ tokens · prompt \d+: \d+ reused", re.M)


def _bounded() -> None:
    """In the child: 1 GiB of address space and 60 s of CPU time (what the probes below need is a fraction)."""
    resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))
    resource.setrlimit(resource.RLIMIT_CPU, (60, 60))


def probe(*args: str, site: Path, stdin: str | Path = "") -> subprocess.CompletedProcess:
    """``lollm ARGS`` in a bounded child that reports whether torch was imported; ``stdin``: text, or a file to read."""
    command = [sys.executable, "-c", PROBE, *map(str, args)]
    kwargs = dict(capture_output=True, env=child_env(site), timeout=120, preexec_fn=_bounded)
    if isinstance(stdin, Path):
        with open(stdin, "rb") as source:
            done = subprocess.run(command, stdin=source, **kwargs)
    else:
        done = subprocess.run(command, input=stdin.encode(), **kwargs)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                       done.stderr.decode(errors="replace"))


def one_error_line(done, *needles: str, torch: bool = False) -> str:
    """The single ``error:`` line of a run that exited 2 (asserting the needles are in it)."""
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    if not torch:
        assert lines[-1] == "torch not imported", done.stderr
    return errors[0]


@pytest.fixture
def toy_visible(toy_site, monkeypatch):
    """The toy family visible to this process (as the CliRunner tests see it)."""
    import lollm.load.plugins as plugins

    monkeypatch.syspath_prepend(str(toy_site))
    monkeypatch.setattr(plugins, "_REGISTRY", None)


# -- class 2: bounded numbers ----------------------------------------------------------------------


def test_the_threads_limit_is_cores_times_a_small_factor():
    from lollm.load.options import THREADS_PER_CORE, check_threads, threads_limit
    from lollm.errors import LollmError

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert threads_limit() == THREADS_PER_CORE * cores and 2 <= THREADS_PER_CORE <= 8
    check_threads(threads_limit())  # the limit itself is allowed
    for bad in (threads_limit() + 1, 10**6, 10**30):
        with pytest.raises(LollmError, match=rf"--threads {bad} is more than .* at most {threads_limit()}"):
            check_threads(bad)


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
def test_too_many_threads_is_refused_before_torch_on_every_command(toy_site, ckpt, command):
    from lollm.load.options import threads_limit

    # (one more than the limit: harmless even where the check is missing, unlike the million of the report)
    extra = ["-p", "hi"] if command == "run" else ["--port", "1"] if command == "serve" else []
    done = probe(command, ckpt, "--threads", threads_limit() + 1, *extra, site=toy_site)
    one_error_line(done, "--threads", f"at most {threads_limit()}")


@pytest.mark.parametrize("command", ["chat", "serve"])
@pytest.mark.parametrize("size", ["0", "-5", "1"])
def test_a_ctx_size_below_two_is_refused_before_torch(toy_site, ckpt, command, size):
    extra = ["--port", "1"] if command == "serve" else []  # (a port no one serves, should the check be missing)
    done = probe(command, ckpt, "--ctx-size", size, *extra, site=toy_site)
    one_error_line(done, "--ctx-size must be at least 2 positions", f"got {size}")


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_outside_tcp_is_refused_before_the_model_loads(toy_site, ckpt, port):
    """Seen by a new user: --port 99999 loaded the model, then ended in uvicorn's 99-line traceback."""
    done = probe("serve", ckpt, "--port", port, site=toy_site)
    one_error_line(done, "--port must be a TCP port from 0 to 65535", f"got {port}")


def test_inspect_of_a_missing_file_says_so(toy_site, tmp_path):
    """A missing ``nope.gguf`` is "no such file", not "not a .gguf file" (its name ends in .gguf)."""
    done = probe("inspect", tmp_path / "nope.gguf", site=toy_site)
    one_error_line(done, "nope.gguf: no such file or folder", torch=True)


# -- class 3: special files and bounded inputs ---------------------------------------------------------


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind, needle", [("dev_zero", "a character device"), ("fifo", "a named pipe (FIFO)"),
                                          ("folder", "a folder")])
@pytest.mark.parametrize("command", ["run", "tokenize"])
def test_an_input_file_that_is_not_regular_is_refused_unread(toy_site, ckpt, tmp_path, fifo, command, kind, needle):
    path = {"dev_zero": Path("/dev/zero"), "fifo": fifo, "folder": tmp_path}[kind]
    args = ("run", ckpt, "--prompts-file", path) if command == "run" else ("tokenize", ckpt, "--file", path)
    done = probe(*args, site=toy_site)
    one_error_line(done, str(path), needle, "not a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # left as it was


@pytest.mark.parametrize("args", [("run", "{ckpt}"), ("run", "{ckpt}", "--prompts-file", "-"), ("tokenize", "{ckpt}", "-")])
def test_stdin_is_bounded(toy_site, ckpt, args):
    done = probe(*(a.format(ckpt=ckpt) for a in args), site=toy_site, stdin=Path("/dev/zero"))
    one_error_line(done, "stdin holds more than 16 MiB")


def test_every_input_is_bounded_by_the_documented_limit(invoke, ckpt, tmp_path, monkeypatch):
    import lollm.cli.inputs as inputs
    from lollm.errors import LollmError

    assert inputs.MAX_INPUT_BYTES == 16 * 2**20
    monkeypatch.setattr(inputs, "MAX_INPUT_BYTES", 100)
    path = tmp_path / "prompts.txt"
    path.write_text("hello\n" * 17)  # 102 bytes
    for args, stdin, needle in [
        (("run", ckpt, "--prompts-file", path), None, f"--prompts-file {path}: larger than"),
        (("tokenize", ckpt, "--file", path), None, f"--file {path}: larger than"),
        (("run", ckpt, "--prompts-file", "-"), "hello\n" * 17, "stdin holds more than"),
        (("run", ckpt), "x" * 101, "stdin holds more than"),
    ]:
        done = invoke(*args, stdin=stdin)
        assert isinstance(done.exception, LollmError) and needle in str(done.exception), done.exception
    path.write_text("hello\n" * 16)  # 96 bytes: within the limit
    ok(invoke("tokenize", ckpt, "--file", path, "--json"))


def test_a_file_is_read_exactly_as_it_is(invoke, ckpt, tmp_path):
    import json

    path = tmp_path / "crlf.txt"
    path.write_bytes(b"one\r\ntwo\n")
    assert json.loads(ok(invoke("tokenize", ckpt, "--file", path, "--json")).stdout)["text"] == "one\r\ntwo\n"
    path.write_bytes(b"\xff\xfe")
    assert "not UTF-8 text" in str(invoke("tokenize", ckpt, "--file", path).exception)


# -- class 3: what `lollm trace -o` writes -----------------------------------------------------------


def test_an_empty_output_is_one_error_line_before_torch(toy_site, ckpt):
    done = probe("trace", ckpt, "-p", "hi", "-o", "", site=toy_site)
    one_error_line(done, "-o/--output is empty")


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "fifo", "folder"])
def test_trace_never_replaces_what_is_not_a_regular_file(invoke, ckpt, tmp_path, kind):
    from lollm.errors import LollmError

    target = tmp_path / "target.html"
    target.write_text("keep me")
    out = tmp_path / "out.html"
    if kind == "symlink":
        out.symlink_to(target)
    elif kind == "dangling symlink":
        out.symlink_to(tmp_path / "nowhere.html")
    elif kind == "fifo":
        os.mkfifo(out)
    else:
        out.mkdir()
    before = os.lstat(out)
    done = invoke("trace", ckpt, "-p", "hello", "-o", out)
    words = {"symlink": "a symbolic link", "dangling symlink": "a symbolic link", "fifo": "a named pipe (FIFO)",
             "folder": "a folder"}[kind]
    assert isinstance(done.exception, LollmError), done.output
    assert f"{out} is {words}; the page replaces only a regular file" in str(done.exception)
    after = os.lstat(out)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["target.html", "out.html"])  # nothing else written


def test_a_device_node_is_refused():
    # checked on /dev/null without writing anything (the tests may run as root, where the old code replaced it)
    from lollm.errors import LollmError
    from lollm.cli.trace.page import check_output

    with pytest.raises(LollmError, match=r"/dev/null is a character device; the page replaces only a regular file"):
        check_output("/dev/null")
    with pytest.raises(LollmError, match="-o/--output is empty"):
        check_output("")


def test_the_page_replaces_a_regular_file_whole_or_not_at_all(invoke, ckpt, tmp_path, monkeypatch):
    from lollm.errors import LollmError

    out = tmp_path / "page.html"
    out.write_text("the old page")
    umask = os.umask(0o027)
    try:
        ok(invoke("trace", ckpt, "-p", "hello", "-o", out))
    finally:
        os.umask(umask)
    assert out.read_text().startswith("<!doctype html>") and stat.S_IMODE(out.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["page.html"]

    out.write_text("the old page")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    done = invoke("trace", ckpt, "-p", "hello", "-o", out)
    assert isinstance(done.exception, LollmError) and "No space left on device" in str(done.exception)
    assert out.read_text() == "the old page" and [p.name for p in tmp_path.iterdir()] == ["page.html"]


# -- class 8: the trace checks the prompt before it captures ---------------------------------------------


LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 12


def test_a_prompt_longer_than_the_context_is_one_error_line(toy_site, ckpt, tmp_path):
    out = tmp_path / "t.html"
    done = lollm("trace", str(ckpt), "-p", LONG_PROMPT, "--max-tokens", "100000", "-o", str(out), site=toy_site)
    one_error_line(done, "more than the model's context of 128 positions", "give a shorter prompt", torch=True)
    assert not out.exists()


def test_a_capture_that_would_not_fit_the_memory_is_refused_first(toy_visible, ckpt, tmp_path, monkeypatch):
    import lollm.generate.memory
    import lollm.cli.trace.run as trace_run
    from lollm.errors import LollmError

    captured = []
    monkeypatch.setattr(trace_run, "capture", lambda *a, **k: captured.append(1))
    monkeypatch.setattr(lollm.generate.memory, "free_memory", lambda device: 20_000)
    out = tmp_path / "t.html"
    with pytest.raises(LollmError) as info:
        trace_run.run_trace(str(ckpt), prompt="hello there", output=out, options=LoadOptions(device="cpu"))
    message = str(info.value)
    assert re.search(r"capturing \d+ tokens needs about [\d.]+ KiB on cpu .* but 19\.5 KiB are free: give a prompt of "
                     r"at most about \d+ tokens", message), message
    assert not captured and not out.exists()


def test_the_capture_estimate_reads_the_model(toy_visible, ckpt):
    from lollm.load.pipeline import open_model
    from lollm.cli.trace.capture import capture_shape

    model = open_model(str(ckpt), LoadOptions(device="cpu", dtype="float32")).model
    shape = capture_shape(model)
    # the toy: 2 layers of 4 heads, hidden 32, vocabulary 320; embeddings + 2 states
    assert (shape.heads, shape.max_heads, shape.states, shape.width, shape.vocab) == (8, 4, 3, 32, 320)
    for budget in (0, 10_000, 123_456, 10**9, 10**12):
        T = shape.most_tokens(budget)
        assert shape.bytes(T) <= budget < shape.bytes(T + 1)
    # the attention grows as T²: 10k tokens of Qwen2.5-0.5B (24 × 14 heads) would be ~0.3 TB
    big = type(shape)(336, 14, 25, 896, 151936)
    assert big.bytes(10_000) > 2.5 * 10**11 and big.bytes(256) < 2**30


# -- class 10: a chat whose context is full ----------------------------------------------------------------


CHAT = ("chat", "--temperature", "0", "-n", "8", "--ctx-size", "160")
TURN_NOTE = re.compile(r"\(the context is full: the oldest (\d+) turn\(s\) leave the conversation; (\d+) stay\)")


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory) -> Path:
    """The toy with 256 positions: several short turns fit a --ctx-size of 160."""
    from test_cli_run import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("long") / "toy", max_position_embeddings=256)


def test_a_full_context_drops_the_oldest_turns_and_goes_on(invoke, long_ckpt):
    lines = [f"hi {n}" for n in range(12)]
    done = ok(invoke(*CHAT, long_ckpt, stdin="\n".join(lines) + "\n"))
    assert "error:" not in done.stderr, done.stderr
    assert len(STATS.findall(done.stderr)) == len(lines), done.stderr  # every message answered
    notes = [(int(gone), int(stay)) for gone, stay in TURN_NOTE.findall(done.stderr)]
    # only the oldest go: most of the conversation stays
    assert notes and all(gone >= 1 and stay >= 2 for gone, stay in notes), done.stderr


def test_without_context_shift_the_error_says_how_to_go_on(invoke, long_ckpt):
    lines = [f"hi {n}" for n in range(8)] + ["/drop 3", "/drop x", "hello again"]
    done = ok(invoke(*CHAT, long_ckpt, "--no-context-shift", stdin="\n".join(lines) + "\n"))
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("the conversation is full" in e and "/drop N" in e and "/reset" in e and "--ctx-size" in e
                          for e in errors), done.stderr
    dropped = done.stderr.index("(dropped the oldest 3 turn(s);")
    assert "usage: /drop N" in done.stderr[dropped:]
    assert STATS.search(done.stderr, dropped), done.stderr  # the message after /drop is answered
    assert not TURN_NOTE.search(done.stderr)  # nothing dropped by itself


def test_a_message_too_long_on_its_own_is_refused_and_the_chat_goes_on(invoke, long_ckpt):
    done = ok(invoke(*CHAT, long_ckpt, stdin="hello there " * 60 + "\nhello\n"))
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert re.search(r"this message makes a prompt of \d+ tokens, but the context holds 160 positions .* shorten it", error)
    assert len(STATS.findall(done.stderr)) == 1, done.stderr


def test_a_chat_session_takes_no_silent_default_context(toy_visible, ckpt):
    from lollm.generate.conversation import ChatSession
    from lollm.errors import GenerationError
    from lollm.load.pipeline import open_model
    from lollm.sampling_params import SamplingParams

    loaded = open_model(str(ckpt), LoadOptions(device="cpu", dtype="float32"))
    with pytest.raises(GenerationError, match="at least 2 positions, got 0"):
        ChatSession(loaded, sampling=SamplingParams(temperature=0.0), stop_ids=set(), context=0)


def test_a_piped_line_is_bounded(invoke, ckpt, monkeypatch):
    import lollm.cli.chat as chat
    from lollm.errors import LollmError

    assert chat.MAX_LINE_CHARS == 2**20
    monkeypatch.setattr(chat, "MAX_LINE_CHARS", 100)
    done = invoke("chat", ckpt, stdin="x" * 150 + "\n")
    assert isinstance(done.exception, LollmError) and "longer than 100 characters" in str(done.exception)
