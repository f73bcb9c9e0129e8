"""lollm.LLM (offline batches through the engine) on the toy batched model of _toy_batched.py.

Every completion is held to the single-sequence loop run alone on the same prompt:
greedy tokens, seeded samples, text, stop strings and finish reasons. The model is
the toy causal LM with a tiny byte-level tokenizer of the same vocabulary (320 ids),
wrapped as a LoadedModel; the family without ``cache_layers()`` is the same toy with
that method hidden, and once more the documented lollm-toy family loaded from a folder.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _toy_batched import ToyLM
from lollm.engine import EngineConfig
from lollm.errors import GenerationError
from lollm.generate.loop import generate
from lollm.engine.llm import LLM, Completion, engine_config_for
from lollm.load.pipeline import LoadedModel
from lollm.generate.sampling import SamplingParams
from lollm.testing.tiny import write_tiny_tokenizer
from lollm.tokenizer import load_tokenizer

VOCAB = 320
GREEDY = SamplingParams(temperature=0)
PROMPTS = ["hello there", "the quick brown fox jumps", "a", "one two three four five six seven", "tea"]


class Unbatched(ToyLM):
    """The toy model of a family that cannot run batched: no ``cache_layers()``."""

    def __getattribute__(self, name):
        if name == "cache_layers":
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB))


@pytest.fixture(scope="module")
def tokenizer_raw(tmp_path_factory):
    return load_tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok-raw"), vocab_size=VOCAB, chat_template=False))


def loaded_of(model, tokenizer) -> LoadedModel:
    """The toy model as `open_model` would hand it over (no generation_config, no family defaults)."""
    checkpoint = SimpleNamespace(generation_config={}, config={}, path=Path("toy"), tokenizer=tokenizer)
    family = SimpleNamespace(family=SimpleNamespace(name="toy", sampling_defaults={}))
    return LoadedModel(checkpoint, family, model, torch.device("cpu"), torch.float32, 0.0)


@pytest.fixture(scope="module", params=[False, True], ids=["attention", "attention+recurrent"])
def llm(request, tokenizer):
    return LLM.from_loaded(loaded_of(ToyLM(vocab_size=VOCAB, recurrent=request.param), tokenizer))


def alone(llm: LLM, ids: list[int], sampling=GREEDY, n: int = 8, stop=()):
    return generate(llm.model, ids, max_new_tokens=n, sampling=sampling, stop_ids=llm.stop_ids, stop_strings=stop,
                    tokenizer=llm.tokenizer)


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)


# -- each completion equals its prompt run alone -----------------------------------------------


def test_greedy_completions_equal_solo_runs_in_input_order(llm):
    done = llm.generate(PROMPTS, GREEDY, max_new_tokens=8)
    assert llm.batched and [c.index for c in done] == list(range(len(PROMPTS)))
    for c, text in zip(done, PROMPTS):
        assert c.prompt == text and c.prompt_ids == chat_ids(llm.tokenizer, text)  # as `lollm run`: the template
        solo = alone(llm, c.prompt_ids)
        assert (c.token_ids, c.text, c.finish_reason) == (solo.new_ids, solo.text, solo.stop_reason), text
        assert c.batched and c.prompt_tokens == len(c.prompt_ids)
        assert len(c.token_times) == len(c.token_ids) and c.token_times == sorted(c.token_times) and c.ttft > 0
        assert len(c.inter_token_latencies) == len(c.token_ids) - 1


def test_token_id_prompts_and_finishing_order(llm):
    """Prompts that finish in another order than given still come back in input order."""
    prompts = [[(5 * i + j) % VOCAB for j in range(3 + 9 * i)] for i in range(4)]
    finished: list[int] = []
    done = llm.generate(prompts, GREEDY, max_new_tokens=6, on_completion=lambda c: finished.append(c.index))
    assert sorted(finished) == [0, 1, 2, 3] and [c.index for c in done] == [0, 1, 2, 3]
    for c, ids in zip(done, prompts):
        assert c.prompt == ids and c.token_ids == alone(llm, ids, n=6).new_ids


def test_seeded_sampling_equals_solo(llm):
    settings = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, repetition_penalty=1.0 + 0.1 * s) for s in range(4)]
    prompts = PROMPTS[:4]
    done = llm.generate(prompts, settings, max_new_tokens=10)
    for c, params in zip(done, settings):
        assert c.token_ids == alone(llm, c.prompt_ids, params, n=10).new_ids


def test_stop_strings_are_trimmed_as_run_trims_them(llm):
    ids = chat_ids(llm.tokenizer, PROMPTS[1])
    full = alone(llm, ids, n=12).text
    stop = full[3:5] if len(full) > 5 else full[-1:]
    done = llm.generate([PROMPTS[1], PROMPTS[0]], GREEDY, max_new_tokens=12, stop=[stop])
    solo = alone(llm, ids, n=12, stop=[stop])
    assert (done[0].text, done[0].finish_reason, done[0].token_ids) == (solo.text, solo.stop_reason, solo.new_ids)
    assert stop not in done[0].text


def test_more_prompts_than_running_slots(tokenizer, monkeypatch):
    """A small pool and two slots: the rest wait (and some are preempted), each still equals its run alone."""
    from lollm.engine.scheduler import Scheduler

    preempted = []
    original = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, req: preempted.append(req) or original(self, req))
    llm = LLM.from_loaded(loaded_of(ToyLM(vocab_size=VOCAB), tokenizer),
                          engine=EngineConfig(kv_blocks=16, block_size=4, max_sequences=2, max_batch_tokens=8))
    running: list[int] = []
    done = llm.generate(PROMPTS, GREEDY, max_new_tokens=8,
                        on_completion=lambda c: running.append(llm._engine.stats()["running"]))
    for c in done:
        assert c.token_ids == alone(llm, c.prompt_ids).new_ids
    assert max(running) <= 2 and preempted


def test_the_engine_is_kept_and_its_prefix_cache_serves_the_next_call(tokenizer):
    llm = LLM.from_loaded(loaded_of(ToyLM(vocab_size=VOCAB, recurrent=False), tokenizer))  # whole blocks, no snapshots
    first = llm.generate([PROMPTS[3], PROMPTS[0]], GREEDY, max_new_tokens=4)[0]
    engine = llm._engine
    again = llm.generate([PROMPTS[3]], GREEDY, max_new_tokens=4)  # a smaller batch fits the kept pool
    assert llm._engine is engine and again[0].cached_tokens >= 16 and first.cached_tokens == 0
    assert again[0].token_ids == first.token_ids
    llm.generate(PROMPTS, GREEDY, max_new_tokens=4)  # a larger one gets a new engine
    assert llm._engine is not engine
    assert engine.scheduler.pool.num_used == 0  # every block back in the pool (named ones stay cached)


def test_chat_conversations(llm):
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    one = llm.chat(conv, GREEDY, max_new_tokens=5)
    many = llm.chat([conv, conv[1:]], GREEDY, max_new_tokens=5)
    ids = llm.tokenizer.encode_chat(conv, add_generation_prompt=True)
    assert one[0].prompt_ids == many[0].prompt_ids == ids and one[0].token_ids == alone(llm, ids, n=5).new_ids
    with_system = llm.generate("hi", GREEDY, max_new_tokens=5, system="be brief")
    assert with_system[0].prompt_ids == ids


def test_raw_text_without_a_template_as_run_does(tokenizer_raw, caplog):
    llm = LLM.from_loaded(loaded_of(ToyLM(vocab_size=VOCAB), tokenizer_raw))
    with caplog.at_level(logging.WARNING, logger="lollm"):
        done = llm.generate(["hello", "tea"], GREEDY, max_new_tokens=3)
        llm.generate(["hello"], GREEDY, max_new_tokens=3)
    assert done[0].prompt_ids == tokenizer_raw.encode("hello")
    assert sum("no chat template" in r.message for r in caplog.records) == 1  # said once
    with pytest.raises(GenerationError, match="chat=True: the checkpoint has no chat template"):
        llm.generate("hello", chat=True)
    with pytest.raises(GenerationError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_chat_false_is_raw_text(llm):
    done = llm.generate("hello", GREEDY, max_new_tokens=3, chat=False)
    assert done[0].prompt_ids == llm.tokenizer.encode("hello")


# -- the fallback: one prompt at a time ------------------------------------------------------


def test_a_family_without_cache_layers_runs_one_by_one_and_says_so(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="lollm"):
        llm = LLM.from_loaded(loaded_of(Unbatched(vocab_size=VOCAB), tokenizer))
    assert not llm.batched and "cannot run batched" in llm.single_reason
    assert sum("cannot run batched" in r.message for r in caplog.records) == 1
    batched = LLM.from_loaded(loaded_of(ToyLM(vocab_size=VOCAB), tokenizer))
    want = batched.generate(PROMPTS, GREEDY, max_new_tokens=6)
    got = llm.generate(PROMPTS, GREEDY, max_new_tokens=6)
    for a, b in zip(got, want):
        assert (a.index, a.token_ids, a.text, a.finish_reason) == (b.index, b.token_ids, b.text, b.finish_reason)
        assert not a.batched and len(a.token_times) == len(a.token_ids)


@pytest.mark.parametrize("batched", [True, False])
def test_the_toy_family_loaded_from_a_folder(tmp_path, monkeypatch, batched):
    """LLM(path) loads as `lollm run` does. The documented toy family runs batched; without its
    cache_layers() (taken from its class here) it falls back to one prompt at a time. Both equal solo runs."""
    from _core_helpers import write_site
    from test_cli_run import write_checkpoint
    from test_example_plugin import EXAMPLE

    import lollm.load.plugins as plugins

    site = write_site(tmp_path / "site", "lollm-toy", "0.1.0", {"toy": "lollm_toy.plugin"},
                      {"lollm_toy": EXAMPLE / "src" / "lollm_toy"})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(plugins, "_REGISTRY", None)
    llm = LLM(str(write_checkpoint(tmp_path / "toy")), device="cpu", threads=1)
    if not batched:
        monkeypatch.delattr(type(llm.model), "cache_layers")
        llm = LLM(str(write_checkpoint(tmp_path / "toy2")), device="cpu", threads=1)
    done = llm.generate(["hello", "the quick brown fox"], GREEDY, max_new_tokens=4)
    assert llm.batched == batched and [len(c.token_ids) > 0 for c in done] == [True, True]
    assert all(c.batched == batched for c in done)
    for c in done:
        assert c.token_ids == generate(llm.model, c.prompt_ids, max_new_tokens=4, sampling=GREEDY,
                                       stop_ids=llm.stop_ids).new_ids


# -- bad input is named ------------------------------------------------------------------------

BAD = [
    ([], {}, "no prompts"),
    (["ok", ""], {}, "prompts[1] is empty"),
    (["ok", 3], {}, "prompts[1]: expected a str or a list of token ids"),
    (42, {}, "prompts must be a str or a list, got int"),
    (["ok", [1, 2]], {}, "mix text and token ids"),
    ([[1, 2], []], {}, "prompts[1]: the prompt is empty"),
    ([[1, 2], [1, VOCAB]], {}, f"prompts[1]: the prompt holds the token id {VOCAB}"),
    ([[1, 2], [1] * 200], {}, "prompts[1]: the prompt has 200 tokens, but the model's context is 128"),
    (["a", "b"], {"sampling": [GREEDY]}, "1 SamplingParams for 2 prompts"),
    (["a"], {"sampling": {"temperature": 0}}, "sampling must be a SamplingParams"),
    (["a"], {"max_new_tokens": 0}, "max_new_tokens must be a whole number >= 1"),
    (["a"], {"chat": False, "system": "x"}, "system= needs the chat template"),
    (["a"], {"logprobs": -1}, "logprobs must be a whole number >= 0"),
    (["a"], {"constraint": "json"}, "constraint must be a lollm.generate.structured.OutputConstraint"),
]


@pytest.mark.parametrize("prompts, kwargs, message", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input_is_named(llm, prompts, kwargs, message):
    with pytest.raises(GenerationError, match=re.escape(message)):
        llm.generate(prompts, **kwargs)


def test_bad_conversations_and_a_pool_too_small(llm, tokenizer):
    with pytest.raises(GenerationError, match="conversation 1: expected a non-empty list of messages"):
        llm.chat([[{"role": "user", "content": "hi"}], []])
    small = LLM.from_loaded(loaded_of(ToyLM(vocab_size=VOCAB), tokenizer), engine=EngineConfig(kv_blocks=2, block_size=4))
    with pytest.raises(GenerationError, match=r"prompts\[1\]: .* cannot fit the engine's KV pool"):
        small.generate([[1, 2], list(range(1, 7))], GREEDY, max_new_tokens=4)


def test_a_constraint_compiled_for_another_vocabulary_is_refused(llm):
    from lollm.generate.structured import CompiledConstraint

    other = CompiledConstraint.__new__(CompiledConstraint)
    other.vocab_size = VOCAB + 1
    with pytest.raises(GenerationError, match=f"compiled for {VOCAB + 1} ids, the model has {VOCAB}"):
        llm.generate(["a"], constraint=other)


def test_engine_sizing(monkeypatch):
    model = ToyLM(vocab_size=VOCAB)
    config = engine_config_for(model, [40, 17, 100])
    assert config.max_sequences == 3 and config.kv_blocks == 3 + 2 + 7  # 16 positions a block
    assert engine_config_for(model, [16] * 100).max_sequences == 64
    import lollm.generate.memory

    monkeypatch.setattr(lollm.generate.memory, "free_memory", lambda device: 4 * 1024)  # half of it: 2 blocks of 1 KiB
    with pytest.raises(GenerationError, match="a request of 100 positions needs"):
        engine_config_for(model, [40, 100])


def test_completion_figures():
    c = Completion(0, "p", [1, 2], token_ids=[5, 6, 7], token_times=[0.5, 0.75, 1.5])
    assert (c.ttft, c.inter_token_latencies, c.decode_tokens_per_second, c.prompt_tokens) == (0.5, [0.25, 0.75], 2.0, 2)


def test_import_lollm_stays_cheap_and_exports_the_api():
    code = ("import sys, lollm; assert 'torch' not in sys.modules; "
            "from lollm import LLM, SamplingParams, Completion; assert 'torch' not in sys.modules; print(LLM.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "LLM", done.stderr
