"""The sampler: each filter alone, greedy, seeded draws, and where the settings come from."""

from __future__ import annotations

import math

import pytest
import torch

from lollm.errors import GenerationError, LollmError
from lollm.generate.sampling import (
    Sampler,
    SamplingParams,
    apply_repetition_penalty,
    apply_temperature,
    min_p_filter,
    resolve_sampling,
    top_k_filter,
    top_p_filter,
)

NEG_INF = float("-inf")


def kept(logits: torch.Tensor) -> set[int]:
    """Ids a filter left finite."""
    return {i for i, v in enumerate(logits.tolist()) if v != NEG_INF}


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is exactly ``probs`` (up to float rounding)."""
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


# -- repetition penalty ------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -2.0, 4.0, -1.0, 3.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 4.0, -1.0, 3.0]
    # the input is not modified in place
    assert logits.tolist() == [2.0, -2.0, 4.0, -1.0, 3.0]


def test_repetition_penalty_applies_once_per_id_even_when_repeated():
    logits = torch.tensor([8.0, -8.0, 1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 0, 0, 1, 1]), 2.0)
    assert out.tolist() == [4.0, -16.0, 1.0]


def test_repetition_penalty_below_one_encourages_repeats():
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0]), torch.tensor([0, 1]), 0.5)
    assert out.tolist() == [4.0, -1.0]


def test_repetition_penalty_neutral_cases_return_the_logits():
    logits = torch.tensor([1.0, -1.0])
    assert torch.equal(apply_repetition_penalty(logits, torch.tensor([0, 1]), 1.0), logits)
    assert torch.equal(apply_repetition_penalty(logits, torch.tensor([], dtype=torch.long), 3.0), logits)


# -- temperature -------------------------------------------------------------


def test_repetition_penalty_reads_the_ids_on_the_logits_device():
    """On a GPU the logits live on the device and the generate loop's ids on the CPU; gather and
    scatter must see one device (CUDA refuses a mix). Without a GPU here, a dispatch mode records
    the devices each of those ops receives, with the logits on the "meta" device."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    seen = []

    class Devices(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("gather", "scatter")):
                tensors = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
                seen.append({t.device.type for t in tensors})
            return func(*args, **(kwargs or {}))

    with Devices():
        out = apply_repetition_penalty(torch.randn(10, device="meta"), torch.tensor([1, 2, 2]), 1.3)
    assert out.device.type == "meta"
    assert len(seen) == 2 and all(devices == {"meta"} for devices in seen), seen


def test_temperature_divides_the_logits():
    logits = torch.tensor([1.0, 2.0, -4.0])
    assert apply_temperature(logits, 0.5).tolist() == [2.0, 4.0, -8.0]
    assert apply_temperature(logits, 2.0).tolist() == [0.5, 1.0, -2.0]
    assert apply_temperature(logits, 1.0).tolist() == [1.0, 2.0, -4.0]


def test_lower_temperature_sharpens_the_distribution():
    logits = torch.tensor([1.0, 2.0, 3.0])
    p_cold = torch.softmax(apply_temperature(logits, 0.5), -1)
    p_hot = torch.softmax(apply_temperature(logits, 2.0), -1)
    assert p_cold[2] > torch.softmax(logits, -1)[2] > p_hot[2]


# -- top-k -------------------------------------------------------------------


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([0.1, 5.0, 3.0, -1.0, 4.0])
    assert kept(top_k_filter(logits, 2)) == {1, 4}
    assert kept(top_k_filter(logits, 1)) == {1}


def test_top_k_keeps_ties_with_the_kth():
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0])
    assert kept(top_k_filter(logits, 2)) == {1, 2, 3}


def test_top_k_off_or_larger_than_vocab_keeps_all():
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert kept(top_k_filter(logits, 0)) == {0, 1, 2}
    assert kept(top_k_filter(logits, 3)) == {0, 1, 2}
    assert kept(top_k_filter(logits, 10)) == {0, 1, 2}


# -- top-p -------------------------------------------------------------------


def test_top_p_keeps_the_smallest_set_reaching_p():
    # sorted: id2 0.5, id0 0.25, id3 0.15, id1 0.1
    logits = logits_of([0.25, 0.1, 0.5, 0.15])
    assert kept(top_p_filter(logits, 0.6)) == {2, 0}  # 0.5 < 0.6 <= 0.75
    assert kept(top_p_filter(logits, 0.8)) == {2, 0, 3}  # 0.75 < 0.8 <= 0.9
    assert kept(top_p_filter(logits, 0.95)) == {0, 1, 2, 3}


def test_top_p_always_keeps_the_most_likely_token():
    logits = logits_of([0.1, 0.7, 0.2])
    assert kept(top_p_filter(logits, 0.01)) == {1}
    assert kept(top_p_filter(logits, 0.7 - 1e-3)) == {1}


def test_top_p_one_is_off():
    logits = logits_of([0.1, 0.7, 0.2])
    assert torch.equal(top_p_filter(logits, 1.0), logits)


# -- min-p -------------------------------------------------------------------


def test_min_p_drops_tokens_below_the_scaled_top_probability():
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    # threshold 0.2 * 0.5 = 0.1: 0.05 goes
    assert kept(min_p_filter(logits, 0.2)) == {0, 1, 2}
    # threshold 0.5 * 0.5 = 0.25
    assert kept(min_p_filter(logits, 0.5)) == {0, 1}
    assert kept(min_p_filter(logits, 1.0)) == {0}
    assert kept(min_p_filter(logits, 0.0)) == {0, 1, 2, 3}


# -- the sampler -------------------------------------------------------------


def test_greedy_takes_the_argmax_after_the_penalty():
    logits = torch.tensor([1.0, 3.0, 2.9])
    greedy = Sampler(SamplingParams(temperature=0.0))
    assert greedy(logits, torch.tensor([], dtype=torch.long)) == 1
    # penalizing id 1 (3.0 -> 1.5) makes id 2 the argmax
    penalized = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert penalized(logits, torch.tensor([1])) == 2


def test_greedy_ignores_the_seed_and_is_always_the_same():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    picks = {Sampler(SamplingParams(temperature=0.0, seed=s))(logits, torch.tensor([], dtype=torch.long)) for s in range(5)}
    assert picks == {int(logits.argmax())}


def draws(params: SamplingParams, logits: torch.Tensor, n: int = 40) -> list[int]:
    sampler = Sampler(params)
    return [sampler(logits, torch.tensor([], dtype=torch.long)) for _ in range(n)]


def test_seeded_sampling_is_reproducible_and_the_seed_matters():
    logits = torch.zeros(1000)  # uniform: draws differ from step to step
    a = draws(SamplingParams(temperature=1.0, seed=1234), logits)
    b = draws(SamplingParams(temperature=1.0, seed=1234), logits)
    c = draws(SamplingParams(temperature=1.0, seed=4321), logits)
    assert a == b
    assert a != c
    assert len(set(a)) > 10


def test_sampling_respects_the_filters():
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    picks = draws(SamplingParams(temperature=1.0, top_k=2, seed=0), logits, 200)
    assert set(picks) == {1, 2}
    picks = draws(SamplingParams(temperature=5.0, min_p=0.9, seed=0), logits, 50)
    assert set(picks) <= {1, 2}
    picks = draws(SamplingParams(temperature=1.0, top_p=0.01, seed=0), logits, 50)
    assert set(picks) == {1}


def test_sampler_accepts_half_precision_logits():
    logits = torch.tensor([0.0, 9.0, 1.0], dtype=torch.bfloat16)
    assert Sampler(SamplingParams(temperature=0.0))(logits, torch.tensor([], dtype=torch.long)) == 1
    assert Sampler(SamplingParams(temperature=0.1, seed=3))(logits, torch.tensor([], dtype=torch.long)) == 1


# -- where the settings come from --------------------------------------------


FAMILY = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}


def test_resolve_neutral_when_nothing_is_given():
    p = resolve_sampling({}, {}, {})
    assert p == SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (1.0, 0, 1.0, 0.0, 1.0)


def test_resolve_family_defaults_over_neutral():
    p = resolve_sampling({}, {}, FAMILY)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.7, 20, 0.8, 0.0, 1.05)


def test_resolve_generation_config_over_family_defaults():
    p = resolve_sampling({}, {"temperature": 0.6, "top_k": 40, "do_sample": True}, FAMILY)
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 40, 0.8)


def test_resolve_user_over_everything_and_none_is_not_given():
    user = {"temperature": 1.3, "top_k": None, "top_p": 0.5, "min_p": None, "repetition_penalty": None}
    p = resolve_sampling(user, {"temperature": 0.6, "top_k": 40, "top_p": 0.9}, FAMILY, seed=7)
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.seed) == (1.3, 40, 0.5, 1.05, 7)


def test_resolve_null_values_in_generation_config_are_ignored():
    p = resolve_sampling({}, {"temperature": None, "top_p": None}, FAMILY)
    assert (p.temperature, p.top_p) == (0.7, 0.8)


def test_resolve_do_sample_false_means_greedy():
    p = resolve_sampling({}, {"do_sample": False, "temperature": 0.6}, FAMILY)
    assert p.greedy
    # other user flags do not undo it
    assert resolve_sampling({"top_k": 5}, {"do_sample": False}, FAMILY).greedy


def test_resolve_do_sample_false_yields_to_a_user_temperature():
    p = resolve_sampling({"temperature": 0.9}, {"do_sample": False}, FAMILY)
    assert p.temperature == 0.9 and not p.greedy


def test_resolve_user_temperature_zero_is_greedy():
    assert resolve_sampling({"temperature": 0.0}, {"do_sample": True, "temperature": 0.6}, FAMILY).greedy


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ],
)
def test_invalid_values_raise_generation_error(kwargs, word):
    with pytest.raises(GenerationError, match=word) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, LollmError)
    # through resolve_sampling too, from any source
    with pytest.raises(GenerationError, match=word):
        resolve_sampling(kwargs, {}, {})
    with pytest.raises(GenerationError, match=word):
        resolve_sampling({}, kwargs, {})


def test_non_numeric_values_raise_generation_error_naming_the_key():
    with pytest.raises(GenerationError, match="temperature"):
        resolve_sampling({}, {"temperature": "hot"}, {})
    with pytest.raises(GenerationError, match="top_k"):
        resolve_sampling({}, {"top_k": [1]}, {})


# -- types, seeds and where each value came from -----------------------------------


def test_top_k_must_be_a_whole_number_and_the_error_names_the_file():
    with pytest.raises(GenerationError, match=r"/ckpt/generation_config.json: top_k must be a whole number, got 2.5"):
        resolve_sampling({}, {"top_k": 2.5}, {}, generation_config_name="/ckpt/generation_config.json")
    assert resolve_sampling({}, {"top_k": 40.0}, {}).top_k == 40  # a whole float is taken as it is
    with pytest.raises(GenerationError, match=r"--top-k: top_k must be >= 0"):
        resolve_sampling({"top_k": -3}, {}, {})
    with pytest.raises(GenerationError, match="family default: top_p"):
        resolve_sampling({}, {}, {"top_p": 7})


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30, 1.5, True])
def test_seed_outside_the_generator_range_is_an_error(seed):
    with pytest.raises(GenerationError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
def test_seed_at_both_ends_of_the_range_works(seed):
    draws = [Sampler(SamplingParams(seed=seed))(torch.zeros(50), torch.tensor([], dtype=torch.long)) for _ in range(2)]
    assert draws[0] == draws[1]


def test_resolve_records_where_each_value_came_from():
    p = resolve_sampling({"top_p": 0.5}, {"temperature": 0.6}, FAMILY)
    assert p.sources == {
        "temperature": "generation_config.json", "top_k": "family default", "top_p": "flag",
        "min_p": "neutral", "repetition_penalty": "family default",
    }
    greedy = resolve_sampling({}, {"do_sample": False}, FAMILY)
    assert greedy.sources["temperature"] == "generation_config.json (do_sample: false)"
    assert p == SamplingParams(temperature=0.6, top_k=20, top_p=0.5, repetition_penalty=1.05)  # sources do not count


def test_describe_names_the_settings_that_apply_and_their_sources():
    from lollm.generate.sampling import describe_sampling

    greedy = resolve_sampling({"temperature": 0.0}, {}, FAMILY)
    line = describe_sampling(greedy)
    assert line == "sampling: greedy (temperature 0, flag) · repetition_penalty 1.05 (family default)"
    full = describe_sampling(greedy, everything=True)
    assert "top_k 20 (family default)" in full and "min_p 0 (neutral)" in full
    assert describe_sampling(resolve_sampling({}, {}, {}, seed=4)) == "sampling: temperature 1 (neutral) · seed 4"


# -- non-finite logits ------------------------------------------------------------------


NOTHING = torch.tensor([], dtype=torch.long)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_from_the_model_are_a_clear_error(bad, temperature):
    logits = torch.tensor([0.5, bad, 1.0])
    with pytest.raises(GenerationError, match="the model produced non-finite logits") as info:
        Sampler(SamplingParams(temperature=temperature, seed=0))(logits, NOTHING)
    assert "rms_norm" in str(info.value) or "epsilon" in str(info.value)


def test_a_repetition_penalty_that_overflows_is_named():
    logits = torch.tensor([5.0, 1.0, -2.0])
    with pytest.raises(GenerationError, match="repetition_penalty 1e-300"):
        Sampler(SamplingParams(temperature=0.0, repetition_penalty=1e-300))(logits, torch.tensor([0]))


def test_a_temperature_that_overflows_is_named():
    with pytest.raises(GenerationError, match="temperature 1e-45"):
        Sampler(SamplingParams(temperature=1e-45, seed=0))(torch.tensor([5.0, 1.0]), NOTHING)
