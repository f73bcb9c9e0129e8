"""The shared generate loop, driven by a tiny deterministic model and a fake tokenizer."""

from __future__ import annotations

import codecs

import pytest
import torch
from torch import nn

from lollm.errors import GenerationError, LollmError
from lollm.generate.loop import Step, generate, generate_steps, stop_token_ids, stream_text
from lollm.generate.prompt_cache import PromptCache
from lollm.generate.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class FakeCache:
    def __init__(self, max_tokens: int):
        self.length = 0
        self.max_tokens = max_tokens


class SuccessorLM(nn.Module):
    """Follows lollm/model.py's protocol; the most likely next token is always ``(last id + 1) % V``.

    With ``constant`` logits it ignores its input instead. It records every
    forward (input ids, cache length, logits_to_keep) so tests can count them.
    """

    def __init__(self, vocab_size: int = 32, max_context: int = 64, constant: torch.Tensor | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.num_layers = 1
        self.eos_token_ids = ()
        self.scale = nn.Parameter(torch.ones(()))  # so the loop can find the device
        self.constant = constant
        self.calls: list[tuple[list[int], int, int]] = []
        self.caches: list[FakeCache] = []

    def new_cache(self, max_tokens: int) -> FakeCache:
        cache = FakeCache(max_tokens)
        self.caches.append(cache)
        return cache

    def forward(self, input_ids, cache=None, *, logits_to_keep=0, hidden_states=None):
        assert input_ids.dtype == torch.long and input_ids.dim() == 2 and input_ids.shape[0] == 1
        start = cache.length if cache is not None else 0
        self.calls.append((input_ids[0].tolist(), start, logits_to_keep))
        T = input_ids.shape[1]
        if cache is not None:
            assert cache.length + T <= cache.max_tokens, "the loop overflowed the cache it asked for"
            cache.length += T
        if self.constant is not None:
            logits = self.constant.expand(1, T, self.vocab_size).clone()
        else:
            nxt = (input_ids[0] + 1) % self.vocab_size
            logits = torch.full((1, T, self.vocab_size), -5.0)
            logits[0, torch.arange(T), nxt] = 5.0
        logits = logits * self.scale
        return logits[:, -logits_to_keep:] if logits_to_keep else logits


class FakeStreamDecoder:
    def __init__(self, tokenizer, skip_special_tokens):
        self.tokenizer = tokenizer
        self.skip = tokenizer.special_ids if skip_special_tokens else set()
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id):
        if token_id in self.skip:
            return ""
        return self.utf8.decode(self.tokenizer.table[token_id])

    def flush(self):
        return self.utf8.decode(b"", final=True)


class FakeTokenizer:
    """Token id -> bytes from a table; unknown ids read as ``<id>``."""

    def __init__(self, pieces: dict[int, bytes | str], eos_token_id=None, special_ids=()):
        self.table = {i: (p.encode() if isinstance(p, str) else p) for i, p in pieces.items()}
        self.eos_token_id = eos_token_id
        self.special_ids = set(special_ids)

    def stream_decoder(self, *, skip_special_tokens=False):
        return FakeStreamDecoder(self, skip_special_tokens)


def run(model, prompt, n, tokenizer=None, **kwargs):
    pieces: list[str] = []
    result = generate(
        model, prompt, max_new_tokens=n, sampling=kwargs.pop("sampling", GREEDY), tokenizer=tokenizer,
        on_text=pieces.append, **kwargs,
    )
    return result, pieces


# -- the forward calls -------------------------------------------------------


def test_prefill_once_then_one_forward_per_new_token():
    model = SuccessorLM()
    result, _ = run(model, [1, 2, 3], 5)
    assert result.new_ids == [4, 5, 6, 7, 8]
    assert result.prompt_ids == [1, 2, 3]
    assert result.stop_reason == "max_new_tokens"
    # the prompt in one forward asking for the last logits only, then each sampled token once
    assert model.calls == [([1, 2, 3], 0, 1), ([4], 3, 0), ([5], 4, 0), ([6], 5, 0), ([7], 6, 0)]
    # one cache, sized for the prompt and the new tokens (lollm.generate.memory first sizes it from a build on the meta device)
    assert {c.max_tokens for c in model.caches} == {model.caches[-1].max_tokens} and model.caches[-1].max_tokens >= 3 + 5
    assert result.prefill_seconds > 0 and result.decode_seconds >= 0


def test_max_new_tokens_one_runs_only_the_prefill():
    model = SuccessorLM()
    result, _ = run(model, [7], 1)
    assert result.new_ids == [8]
    assert len(model.calls) == 1


def test_max_new_tokens_caps_the_output():
    for n in (2, 9):
        result, _ = run(SuccessorLM(), [0], n)
        assert len(result.new_ids) == n
        assert result.stop_reason == "max_new_tokens"


def test_repetition_penalty_sees_the_prompt_and_the_generated_ids():
    constant = torch.tensor([0.0, 3.0, 2.9, 2.8, 2.7, 2.6, 2.5, 2.4])
    model = SuccessorLM(vocab_size=8, constant=constant)
    result, _ = run(model, [1], 4, sampling=SamplingParams(temperature=0.0, repetition_penalty=2.0))
    # id 1 is in the prompt, so 2 wins first; each pick is then penalized in turn
    assert result.new_ids == [2, 3, 4, 5]


# -- stopping ------------------------------------------------------------------


PIECES = {i: f"<{i}>" for i in range(32)}


def test_eos_stops_and_is_in_new_ids_but_not_in_the_text():
    tok = FakeTokenizer(PIECES, special_ids={6})
    result, pieces = run(SuccessorLM(), [3], 10, tokenizer=tok, stop_ids={6})
    assert result.new_ids == [4, 5, 6]
    assert result.stop_reason == "eos"
    assert result.text == "<4><5>"
    assert "".join(pieces) == result.text


def test_eos_text_is_left_out_even_when_the_tokenizer_would_print_it():
    tok = FakeTokenizer(PIECES)  # 6 is not special here: it would decode to "<6>"
    result, _ = run(SuccessorLM(), [3], 10, tokenizer=tok, stop_ids={6, 30})
    assert result.new_ids == [4, 5, 6] and result.text == "<4><5>"


def test_without_a_tokenizer_only_ids_are_produced():
    result, pieces = run(SuccessorLM(), [3], 10, stop_ids={5})
    assert result.new_ids == [4, 5] and result.text == "" and pieces == []


STORY = {10: "Hel", 11: "lo", 12: " wo", 13: "rld", 14: "! ", 15: "Bye", 16: ".", 17: "x"}


@pytest.mark.parametrize(
    "stop, text",
    [
        ("o wor", "Hell"),  # spans three tokens
        ("world", "Hello "),
        ("Hello", ""),  # at the very start
        ("! B", "Hello world"),
        ("ld!", "Hello wor"),
        ("Bye.", "Hello world! "),
    ],
)
def test_stop_string_cuts_the_text_and_is_never_streamed(stop, text):
    model = SuccessorLM()
    result, pieces = run(model, [9], 20, tokenizer=FakeTokenizer(STORY), stop_strings=[stop])
    assert result.stop_reason == "stop_string"
    assert result.text == text
    assert "".join(pieces) == result.text
    # the loop stopped at the token that completed the stop string
    full = "".join(STORY[i] for i in result.new_ids)
    assert stop in full and stop not in full[: -len(STORY[result.new_ids[-1]])]


def test_a_partial_stop_string_that_never_completes_is_released():
    result, pieces = run(SuccessorLM(), [9], 5, tokenizer=FakeTokenizer(STORY), stop_strings=["world?", "rld!!"])
    assert result.stop_reason == "max_new_tokens"
    assert result.text == "Hello world! "
    assert "".join(pieces) == result.text


def test_held_back_text_is_released_at_eos():
    result, pieces = run(SuccessorLM(), [9], 20, tokenizer=FakeTokenizer(STORY), stop_ids={13}, stop_strings=["lo worm"])
    assert result.stop_reason == "eos"
    assert result.text == "Hello wo"
    assert "".join(pieces) == result.text


def test_the_earliest_of_several_stop_strings_wins():
    tok = FakeTokenizer({10: "ab", 11: "cd"})
    result, pieces = run(SuccessorLM(), [9], 5, tokenizer=tok, stop_strings=["bc", "a"])
    assert result.text == "" and pieces == []
    result, pieces = run(SuccessorLM(), [9], 5, tokenizer=tok, stop_strings=["cd", "bc"])
    assert result.text == "a" and "".join(pieces) == "a"


def test_stream_never_splits_a_utf8_character():
    smile = "😀".encode()
    tok = FakeTokenizer({10: b"a" + smile[:2], 11: smile[2:], 12: "é".encode()[:1], 13: "é".encode()[1:] + b"z"})
    result, pieces = run(SuccessorLM(), [9], 4, tokenizer=tok)
    assert result.text == "a😀éz"
    assert "".join(pieces) == result.text
    assert all("\ufffd" not in p for p in pieces)


def test_context_full_stops_with_reason_context():
    model = SuccessorLM(max_context=8)
    result, _ = run(model, [0, 1, 2, 3, 4, 5], 10)
    assert result.new_ids == [6, 7]
    assert result.stop_reason == "context"
    assert model.caches[0].max_tokens <= 8


# -- bad requests ------------------------------------------------------------


def test_prompt_that_fills_the_context_raises():
    with pytest.raises(GenerationError, match="context is 4") as info:
        run(SuccessorLM(max_context=4), [1, 2, 3, 4], 1)
    assert "4 tokens" in str(info.value)
    with pytest.raises(GenerationError):
        run(SuccessorLM(max_context=4), [1, 2, 3, 4, 5], 1)


def test_empty_prompt_raises():
    with pytest.raises(GenerationError, match="empty") as info:
        run(SuccessorLM(), [], 3)
    assert isinstance(info.value, LollmError)


def test_non_positive_max_new_tokens_raises():
    with pytest.raises(GenerationError, match="max_new_tokens"):
        run(SuccessorLM(), [1], 0)


def test_stop_strings_without_a_tokenizer_raise():
    with pytest.raises(GenerationError, match="tokenizer"):
        run(SuccessorLM(), [1], 3, stop_strings=["x"])


# -- stop_token_ids ----------------------------------------------------------


def test_stop_token_ids_is_the_union_of_every_source():
    tok = FakeTokenizer({}, eos_token_id=7)
    assert stop_token_ids({"eos_token_id": [1, 2]}, {"eos_token_id": 3}, tok) == {1, 2, 3, 7}
    assert stop_token_ids({"eos_token_id": 5}, {"eos_token_id": [5, 6]}) == {5, 6}
    assert stop_token_ids({}, {}, FakeTokenizer({})) == set()
    assert stop_token_ids({"eos_token_id": None}, {}, tok) == {7}


# -- self-speculative decoding ---------------------------------------------------


class RollbackCache(FakeCache):
    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length


class DraftingLM(SuccessorLM):
    """A SuccessorLM with a draft head that guesses wrong whenever the true next id is a multiple of 5."""

    has_draft_head = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.draft_calls: list[tuple[int, int, int]] = []

    def new_cache(self, max_tokens):
        cache = RollbackCache(max_tokens)
        self.caches.append(cache)
        return cache

    def draft(self, cache, pending, num_tokens):
        self.draft_calls.append((cache.length, pending, num_tokens))
        out, last = [], pending
        for _ in range(num_tokens):
            true = (last + 1) % self.vocab_size
            guess = (true + 7) % self.vocab_size if true % 5 == 0 else true
            out.append(guess)
            last = guess
        return out


@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_decoding_equals_plain_greedy(k):
    plain, _ = run(SuccessorLM(), [1, 2], 20)
    model = DraftingLM()
    spec, _ = run(model, [1, 2], 20, speculative_tokens=k)
    assert spec.new_ids == plain.new_ids
    assert spec.stop_reason == plain.stop_reason
    assert 0 < spec.accepted < spec.drafted
    assert len(model.calls) < len(plain.new_ids)  # fewer forwards than plain decoding
    assert all(n <= k for _, _, n in model.draft_calls)


def test_speculative_decoding_equals_plain_sampling_with_the_same_seed():
    sampling = SamplingParams(temperature=8.0, top_k=6, seed=11)
    plain, _ = run(SuccessorLM(), [3], 25, sampling=sampling)
    spec, _ = run(DraftingLM(), [3], 25, sampling=sampling, speculative_tokens=3)
    assert spec.new_ids == plain.new_ids
    assert len(set(plain.new_ids)) > 3  # really sampled, not a fixed chain


def test_speculative_decoding_stops_at_eos_and_stop_strings():
    tok = FakeTokenizer(STORY)
    plain, _ = run(SuccessorLM(), [9], 20, tokenizer=tok, stop_ids={14})
    spec, pieces = run(DraftingLM(), [9], 20, tokenizer=tok, stop_ids={14}, speculative_tokens=4)
    assert spec.new_ids == plain.new_ids == [10, 11, 12, 13, 14] and spec.stop_reason == "eos"
    assert spec.text == "Hello world" == "".join(pieces)
    spec, pieces = run(DraftingLM(), [9], 20, tokenizer=tok, stop_strings=["wor"], speculative_tokens=4)
    assert spec.text == "Hello " == "".join(pieces) and spec.stop_reason == "stop_string"


def test_speculative_decoding_never_goes_past_the_context():
    plain, _ = run(SuccessorLM(max_context=12), [0, 1, 2], 50)
    model = DraftingLM(max_context=12)
    spec, _ = run(model, [0, 1, 2], 50, speculative_tokens=5)
    assert spec.new_ids == plain.new_ids and len(spec.new_ids) == 9
    assert spec.stop_reason == plain.stop_reason == "context"
    assert model.caches[0].max_tokens <= 12


def test_speculative_decoding_needs_a_draft_head():
    with pytest.raises(GenerationError, match="draft head"):
        run(SuccessorLM(), [1], 5, speculative_tokens=2)


# -- the layers: the step generator and the text wrapper ------------------------------------------


def steps_of(model, prompt, n, **kwargs):
    return generate_steps(model, prompt, max_new_tokens=n, sampling=kwargs.pop("sampling", GREEDY), **kwargs)


def test_the_step_generator_yields_one_step_per_token_and_the_last_says_why():
    model = SuccessorLM()
    steps = list(steps_of(model, [1, 2, 3], 4))
    assert all(isinstance(s, Step) for s in steps)
    assert [s.token for s in steps] == [4, 5, 6, 7]
    assert [s.finish for s in steps] == [None, None, None, "max_new_tokens"]
    assert all(s.logprobs is None and not s.drafted and not s.accepted for s in steps)
    assert [s.time for s in steps] == sorted(s.time for s in steps)
    assert model.calls == [([1, 2, 3], 0, 1), ([4], 3, 0), ([5], 4, 0), ([6], 5, 0)]
    # the context ends it: the last step says "context", never more steps than the context holds
    steps = list(steps_of(SuccessorLM(max_context=8), [0, 1, 2, 3, 4, 5], 10))
    assert [s.token for s in steps] == [6, 7] and steps[-1].finish == "context"


def test_the_step_generator_runs_the_model_only_for_the_steps_asked_for():
    model = SuccessorLM()
    steps = steps_of(model, [1, 2], 10)
    assert model.calls == []  # checked, not run yet
    first = next(steps)
    assert first.token == 3 and model.calls == [([1, 2], 0, 1)]  # the prefill gives the first token
    assert next(steps).token == 4 and len(model.calls) == 2
    steps.close()
    assert len(model.calls) == 2


def test_the_step_generator_checks_the_request_before_it_runs():
    model = SuccessorLM(max_context=4)
    for prompt, n, match in [([], 3, "empty"), ([1], 0, "max_new_tokens"), ([1, 2, 3, 4], 1, "context is 4"),
                             ([99], 1, "vocabulary")]:
        with pytest.raises(GenerationError, match=match):
            steps_of(model, prompt, n)
    with pytest.raises(GenerationError, match="draft head"):
        steps_of(model, [1], 2, speculative_tokens=2)
    assert model.calls == []


def test_the_step_generator_gives_logprobs_when_asked():
    steps = list(steps_of(SuccessorLM(), [1], 3, logprobs=2))
    assert [s.logprobs.token for s in steps] == [s.token for s in steps] == [2, 3, 4]
    assert all(len(s.logprobs.top) == 2 and s.logprobs.top[0][0] == s.token for s in steps)
    assert generate(SuccessorLM(), [1], max_new_tokens=3, sampling=GREEDY, logprobs=2).logprobs == [s.logprobs for s in steps]


def test_speculative_steps_are_plain_steps_with_the_drafts_marked():
    plain = [s.token for s in steps_of(SuccessorLM(), [1, 2], 20)]
    steps = list(steps_of(DraftingLM(), [1, 2], 20, speculative_tokens=3))
    assert [s.token for s in steps] == plain
    assert [s.finish for s in steps][-1] == "max_new_tokens" and all(s.finish is None for s in steps[:-1])
    assert all(s.drafted for s in steps if s.accepted) and not steps[0].drafted
    result = generate(DraftingLM(), [1, 2], max_new_tokens=20, sampling=GREEDY, speculative_tokens=3)
    assert (result.drafted, result.accepted) == (sum(s.drafted for s in steps), sum(s.accepted for s in steps))


def test_closing_the_steps_records_what_the_prompt_cache_holds():
    model = SuccessorLM()
    cache = PromptCache(model, 32)
    steps = steps_of(model, [1, 2, 3], 10, prompt_cache=cache)
    assert [next(steps).token for _ in range(3)] == [4, 5, 6]
    steps.close()
    assert cache.ids == [1, 2, 3, 4, 5]  # the last token was never run
    result = generate(model, [1, 2, 3, 4, 5, 6, 7], max_new_tokens=2, sampling=GREEDY, prompt_cache=cache)
    assert result.reused_tokens == 5 and result.new_ids == [8, 9]


def text_of(model, prompt, n, tokenizer=None, *, stop_ids=frozenset(), stop_strings=(), should_stop=None, **kwargs):
    steps = steps_of(model, prompt, n, **kwargs)
    return list(stream_text(steps, tokenizer, stop_ids=stop_ids, stop_strings=stop_strings, should_stop=should_stop))


@pytest.mark.parametrize("stop", [None, "o wor", "world", "Hello", "! B", "ld!", "Bye.", "zzz"])
@pytest.mark.parametrize("k", [0, 3])
def test_the_text_wrapper_concatenates_to_the_text_of_generate_and_stops_at_the_same_token(stop, k):
    tok = FakeTokenizer(STORY)
    stops = [stop] if stop else []
    model = DraftingLM if k else SuccessorLM
    pieces = text_of(model(), [9], 8, tok, stop_strings=stops, speculative_tokens=k)
    result, streamed = run(model(), [9], 8, tokenizer=tok, stop_strings=stops, speculative_tokens=k)
    assert "".join(p.text for p in pieces) == result.text == "".join(streamed)
    assert [p.step.token for p in pieces] == result.new_ids
    assert [p.stop_reason for p in pieces] == [None] * (len(pieces) - 1) + [result.stop_reason]


def test_the_text_wrapper_leaves_out_the_eos_text_and_flushes_what_it_held():
    tok = FakeTokenizer(STORY)
    pieces = text_of(SuccessorLM(), [9], 20, tok, stop_ids={13}, stop_strings=["lo worm"])
    assert [p.step.token for p in pieces] == [10, 11, 12, 13]
    assert [p.text for p in pieces] == ["", "", "He", "llo wo"]  # the last 6 characters held back (a possible "lo worm")
    assert pieces[-1].stop_reason == "eos"


def test_the_text_wrapper_asks_should_stop_between_steps_and_stops_asking_for_steps():
    model = SuccessorLM()
    asked = []
    pieces = text_of(model, [9], 20, FakeTokenizer(STORY), should_stop=lambda: asked.append(1) or len(asked) == 2)
    assert [p.step.token for p in pieces] == [10, 11] and pieces[-1].stop_reason == "cancelled"
    assert "".join(p.text for p in pieces) == "Hello"
    assert len(model.calls) == 2  # the prefill and one step: no forward for a step nobody asked for
    with pytest.raises(GenerationError, match="tokenizer"):
        stream_text(steps_of(model, [1], 3), None, stop_strings=["x"])
