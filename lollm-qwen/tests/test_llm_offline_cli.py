"""``lollm run --prompts-file`` through the batched engine, and ``lollm bench --concurrency``, on a tiny qwen2.

The batched run must print what the prompts print run one at a time (``lollm run -p``), in
input order: the text (or the JSON object) of each, with its header and statistics line.
The bench is only read for its figures: no assertion on a speed.
"""

from __future__ import annotations

import json
import re

import pytest

from _qwen_tiny import chat_checkpoint  # noqa: F401  (a fixture)

PROMPTS = ["hello there", "tell me a story about a cat", "2+2", "the quick brown fox jumps over the lazy dog"]
GREEDY = ("--temperature", "0", "-n", "8", "--threads", "1")


@pytest.fixture(scope="module")
def invoke():
    """The CLI in this process; returns typer's Result (stdout, stderr, exit_code, exception)."""
    from typer.testing import CliRunner

    from lollm.cli import app

    def call(*args):
        done = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200", "NO_COLOR": "1"})
        assert done.exit_code == 0, f"{done.stdout}\n{done.stderr}\n{done.exception!r}"
        return done

    return call


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


@pytest.fixture(scope="module")
def alone(invoke, chat_checkpoint):
    """Each prompt's JSON object from a run of its own."""
    return {flags: [json.loads(invoke("run", chat_checkpoint, "-p", p, *flags, "--json").stdout) for p in PROMPTS]
            for flags in (GREEDY, ("--temperature", "0.9", "--seed", "3", "-n", "8", "--threads", "1"))}


def test_prompts_file_as_json_equals_runs_of_their_own(invoke, chat_checkpoint, prompts_file, alone):
    for flags, want in alone.items():
        done = invoke("run", chat_checkpoint, "--prompts-file", prompts_file, *flags, "--json")
        got = [json.loads(line) for line in done.stdout.splitlines()]
        assert [g["prompt"] for g in got] == PROMPTS
        for g, w in zip(got, want):
            assert (g["text"], g["ids"], g["stop_reason"], g["prompt_ids"]) == (w["text"], w["ids"], w["stop_reason"],
                                                                                  w["prompt_ids"])
            assert g["batched"]["ttft_seconds"] > 0 and "batched" not in w


def test_prompts_file_as_text_equals_runs_of_their_own(invoke, chat_checkpoint, prompts_file, alone):
    done = invoke("run", chat_checkpoint, "--prompts-file", prompts_file, *GREEDY)
    assert done.stdout == "".join(w["text"] + "\n" for w in alone[GREEDY])
    headers = re.findall(r"\[prompt (\d)/4\]", done.stderr)
    assert headers == ["1", "2", "3", "4"]
    assert len(re.findall(r"\[\d+ tokens · load .* stop: \w+ · qwen2 on cpu float32\]", done.stderr)) == 4
    assert re.search(r"\[batched: 4 prompts in one engine · \d+ tokens in [\d.]+ s · [\d.]+ tok/s output", done.stderr)


def test_stop_strings_batched_as_alone(invoke, chat_checkpoint, prompts_file, alone):
    stop = next(w["text"][2:4] for w in alone[GREEDY] if len(w["text"]) > 4)
    done = invoke("run", chat_checkpoint, "--prompts-file", prompts_file, *GREEDY, "--stop", stop, "--json")
    for p, line in zip(PROMPTS, done.stdout.splitlines()):
        one = json.loads(invoke("run", chat_checkpoint, "-p", p, *GREEDY, "--stop", stop, "--json").stdout)
        got = json.loads(line)
        assert (got["text"], got["ids"], got["stop_reason"]) == (one["text"], one["ids"], one["stop_reason"])


def test_prompt_lookup_runs_one_at_a_time_and_says_why(invoke, chat_checkpoint, prompts_file, alone):
    done = invoke("run", chat_checkpoint, "--prompts-file", prompts_file, *GREEDY, "--prompt-lookup", "--json")
    assert "--prompt-lookup decodes speculatively, which the engine does not: one prompt at a time" in done.stderr
    got = [json.loads(line) for line in done.stdout.splitlines()]
    assert [g["ids"] for g in got] == [w["ids"] for w in alone[GREEDY]] and "batched" not in got[0]


def test_bench_concurrency_prints_the_figures(invoke, chat_checkpoint):
    args = ("bench", chat_checkpoint, "--concurrency", "2,1", "--rounds", "1", "--prompt-tokens", "8",
            "--new-tokens", "4", "--threads", "1")
    text = invoke(*args).stdout
    for col in ("output tok/s", "× vs 1", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms"):
        assert col in text, text
    assert re.search(r"│\s+1 │\s+[\d.]+ │\s+1\.00× │", text) and re.search(r"│\s+2 │\s+[\d.]+ │\s+[\d.]+× │", text)
    data = json.loads(invoke(*args, "--json").stdout)
    assert [level["concurrency"] for level in data["levels"]] == [1, 2] and data["base_concurrency"] == 1
    for level in data["levels"]:
        assert level["output_tok_s"] > 0 and level["ttft_p95_s"] >= level["ttft_p50_s"] > 0
        assert level["itl_p50_s"] > 0 and len(level["rounds_output_tok_s"]) == 1
    assert data["levels"][0]["ratio_to_1"] == 1.0


@pytest.mark.parametrize("value, needle", [("0,2", "every level must be >= 1"), ("a,2", "whole numbers"),
                                           ("2,2", "given twice"),
                                           ("1,100000000", "GiB of KV cache, more than half the")])
def test_bench_concurrency_refuses_bad_levels(chat_checkpoint, value, needle):
    from typer.testing import CliRunner

    from lollm.cli import app
    from lollm.errors import LollmError

    done = CliRunner().invoke(app, ["bench", str(chat_checkpoint), "--concurrency", value])
    assert isinstance(done.exception, LollmError) and needle in str(done.exception) and "--concurrency" in str(done.exception)


def test_a_bad_prompt_of_the_file_is_counted_as_the_headers_count(chat_checkpoint, tmp_path):
    """The second prompt is too long for the context: the error names it 2/2, as its header would."""
    from typer.testing import CliRunner

    from lollm.cli import app
    from lollm.errors import GenerationError

    path = tmp_path / "prompts.txt"
    context = json.loads((chat_checkpoint / "config.json").read_text())["max_position_embeddings"]
    path.write_text("hello\n" + "fox " * (context + 10) + "\n")
    done = CliRunner().invoke(app, ["run", str(chat_checkpoint), "--prompts-file", str(path), *GREEDY])
    assert isinstance(done.exception, GenerationError), done.stdout
    assert str(done.exception).startswith("prompt 2/2: the prompt has "), done.exception
