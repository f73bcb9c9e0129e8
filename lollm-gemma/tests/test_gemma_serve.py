"""lollm serve on a tiny gemma3 (sliding-window rings of 6 positions), through the official openai client.

Every conversation here is several windows long, so the prompt cache's
rollback rule and ring snapshots are what make the answers right.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _gemma_testing import WINDOW, hub_config

from lollm.testing import serving

NAME = "tiny-gemma3"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """gemma-3-270m shrunk (window 6), varied greedy output, a 512-id ChatML tokenizer whose id 0 ends a turn."""
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint, write_tiny_tokenizer

    raw = shrink_config(hub_config("google__gemma-3-270m-it"), num_hidden_layers=6, sliding_window=WINDOW,
                        vocab_size=512, eos_token_id=0, initializer_range=0.1)
    out = write_tiny_checkpoint(raw, tmp_path_factory.mktemp("serve-gemma3"))
    return write_tiny_tokenizer(out, vocab_size=512)


@pytest.fixture(scope="module")
def server(folder):
    with serving.run_server(folder, "--model-name", NAME) as url:
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


def test_gemma4_think_is_decided_by_its_template(tiny, tmp_path):
    """Gemma 4's chat template reads enable_thinking, so `lollm run --think` works on gemma4 (it was refused
    because the family declared no toggle); the flag changes the prompt as the template says."""
    import shutil

    from typer.testing import CliRunner

    from lollm.cli import app
    from lollm.cli.hub_configs import hub_file
    from lollm.testing.tiny import write_tiny_tokenizer

    folder = tmp_path / "gemma4"
    shutil.copytree(tiny("gemma4-e2b-text", "transformers5"), folder)
    write_tiny_tokenizer(folder, vocab_size=512, chat_template=False)
    shutil.copy(hub_file("google__gemma-4-E2B-it", "chat_template.jinja"), folder / "chat_template.jinja")
    runner = CliRunner()
    for flag in ("--think", "--no-think"):
        result = runner.invoke(app, ["run", "-m", str(folder), "-p", "hi", flag, "-n", "2", "--temperature", "0"])
        assert result.exit_code == 0, result.output
    shown = {flag: runner.invoke(app, ["tokenize", str(folder), "hi", "--chat", flag, "--json"]) for flag in ("--think", "--no-think")}
    import json

    on, off = (json.loads(shown[f].stdout)["text"] for f in ("--think", "--no-think"))
    assert on != off and "<|think|>" in on and "<|think|>" not in off
