"""--think / --no-think: the Qwen3.5 chat template's enable_thinking flag, ids equal to transformers'."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from lollm.tokenizer import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is 17 * 23?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "Seven."},
        {"role": "user", "content": "Another, with a reason: héllo 😀"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory, qwen_tokenizer_files):
    folder = tmp_path_factory.mktemp("qwen3_5-tokenizer")
    for f in qwen_tokenizer_files:
        shutil.copy(f, folder)
    return folder


def _reference_ids(tok, messages, **flags):
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **flags)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_enable_thinking_matches_transformers(messages, tokenizer_folder):
    ours = load_tokenizer(tokenizer_folder)
    ref = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    ids = {}
    for name, flags in (("on", {"enable_thinking": True}), ("off", {"enable_thinking": False}), ("default", {})):
        ids[name] = ours.encode_chat(messages, add_generation_prompt=True, **flags)
        assert ids[name] == _reference_ids(ref, messages, **flags), name
    assert ids["on"] != ids["off"]
    # Qwen3.5's template thinks only when asked: its default is --no-think (an empty think block)
    assert ids["default"] == ids["off"]
    assert ours.decode(ids["on"]).endswith("<|im_start|>assistant\n<think>\n")
    assert ours.decode(ids["off"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
