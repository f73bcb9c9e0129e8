"""`lollm chat` driven through a pseudo-terminal (pexpect), as a person types into it.

Two turns (the second reuses the first's cache: the statistics line says how
much), /stats, /reset (the next turn starts cold), Ctrl-C in the middle of an
answer (it stops, the conversation stays, the next turn reuses the partial
answer), Ctrl-D to quit.
"""

from __future__ import annotations

import os
import sys

import pexpect
import pytest

from _qwen_tiny import chat_checkpoint  # noqa: F401  (a fixture)

STATS = r"\[(\d+) tokens · prompt (\d+): (\d+) reused, (\d+) prefilled"


def spawn(folder, *args: str) -> pexpect.spawn:
    env = {**os.environ, "NO_COLOR": "1", "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "lollm.cli", "chat", str(folder), "--temperature", "0", *args],
                          env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    child.expect(">>>")  # prompt_toolkit's prompt: the line editor is up
    return child


def turn(child: pexpect.spawn, text: str) -> tuple[int, int, int, int]:
    """Send a message; return (answer tokens, prompt tokens, reused, prefilled) from the statistics line."""
    child.sendline(text)
    child.expect(STATS)
    numbers = tuple(int(n) for n in child.match.groups())
    child.expect(">>>")
    return numbers


def quit_with_ctrl_d(child: pexpect.spawn) -> None:
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


def test_two_turns_reuse_the_cache_then_reset(chat_checkpoint):
    child = spawn(chat_checkpoint, "-n", "8", "--system", "Be brief.")
    answer1, prompt1, reused1, _ = turn(child, "hello there")
    assert reused1 == 0 and answer1 == 8
    answer2, prompt2, reused2, prefilled2 = turn(child, "and again")
    # the whole first prompt (and more) comes from the cache; only the new part is prefilled
    assert reused2 >= prompt1 and prefilled2 == prompt2 - reused2 and prefilled2 < prompt2 - prompt1

    child.sendline("/stats")
    child.expect(r"last turn: prompt (\d+) tokens: (\d+) reused from the cache \((\w+)\), (\d+) prefilled")
    assert (int(child.match.group(1)), int(child.match.group(2))) == (prompt2, reused2)
    child.expect(">>>")

    child.sendline("/reset")
    child.expect("conversation is cleared")
    child.expect(">>>")
    _, prompt3, reused3, _ = turn(child, "hello there")
    assert (prompt3, reused3) == (prompt1, 0)  # the same first prompt, from a cold cache
    quit_with_ctrl_d(child)


def answer_streams(child: pexpect.spawn) -> None:
    """Wait until an answer is streaming: prompt_toolkit has handed the line over, then text arrives."""
    child.expect_exact("\x1b[?2004l")  # the line editor leaves bracketed-paste mode: the line was sent
    child.expect(r"[^\x1b\r\n]{16}")


def test_ctrl_c_stops_the_answer_and_keeps_the_conversation(chat_checkpoint):
    child = spawn(chat_checkpoint, "-n", "100000", "--ctx-size", "4096")
    child.sendline("tell me a very long story")
    answer_streams(child)
    child.sendintr()  # Ctrl-C
    child.expect(STATS + r".*stopped by Ctrl-C")
    stopped_tokens, prompt1, _, _ = (int(n) for n in child.match.groups())
    assert 0 < stopped_tokens < 4000
    child.expect(">>>")
    child.sendline("/stats")
    child.expect(r"stop: cancelled")
    child.expect(">>>")

    # a new turn: the conversation holds the partial answer, and the cache still serves it
    child.sendline("go on")
    answer_streams(child)
    child.sendintr()  # (this answer would also run to the end of the context: stop it too)
    child.expect(STATS + r".*stopped by Ctrl-C")
    _, prompt2, reused2, _ = (int(n) for n in child.match.groups())
    assert reused2 >= prompt1 and prompt2 > prompt1 + stopped_tokens - 5, (prompt1, stopped_tokens, prompt2, reused2)
    child.expect(">>>")
    quit_with_ctrl_d(child)


@pytest.mark.parametrize("args, needle", [
    (["--think"], "does not read enable_thinking"),
    (["--mtp"], "no speculative (MTP) head"),
])
def test_chat_refuses_flags_the_model_cannot_honour(chat_checkpoint, args, needle):
    from typer.testing import CliRunner

    from lollm.cli import app
    from lollm.errors import LollmError

    result = CliRunner().invoke(app, ["chat", str(chat_checkpoint), *args], input="")
    # the console script prints a LollmError as one `error:` line, exit status 2
    assert isinstance(result.exception, LollmError) and needle in str(result.exception), result.output


def test_chat_takes_the_model_once(chat_checkpoint):
    from typer.testing import CliRunner

    from lollm.cli import app

    result = CliRunner().invoke(app, ["chat", str(chat_checkpoint), "-m", "elsewhere"], input="",
                                env={"COLUMNS": "400", "NO_COLOR": "1"})
    # a usage error (exit 2), as for every command that names the model twice
    assert result.exit_code == 2 and "one argument too many" in result.output, result.output


def test_chat_loads_the_weights_it_is_asked_for(chat_checkpoint, monkeypatch):
    """--quantize/--group-size reach the load as in `lollm run`; a bad combination is refused before it."""
    from typer.testing import CliRunner

    import lollm.cli.chat as chat
    from lollm.cli import app
    from lollm.errors import LollmError
    from lollm.load.quantized import Int4Linear

    sessions = []

    def one_turn(session, **kwargs):  # instead of the terminal loop: one answer through the prompt cache
        sessions.append(session)
        session.reply("hello there")

    monkeypatch.setattr(chat, "repl", one_turn)
    result = CliRunner().invoke(app, ["chat", str(chat_checkpoint), "--temperature", "0", "-n", "4", "--threads", "1",
                                      "--quantize", "int4", "--group-size", "32"], input="")
    assert result.exit_code == 0, result.output
    (session,) = sessions
    model = session.loaded.model
    assert model.weights_summary.packed > 0 and isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)
    assert len(session.last.new_ids) == 4

    refused = CliRunner().invoke(app, ["chat", str(chat_checkpoint), "--weights", "quantized"], input="")
    assert isinstance(refused.exception, LollmError) and "needs --quantize int8 or int4" in str(refused.exception)
    assert len(sessions) == 1  # refused before the session (and the weights) were made
