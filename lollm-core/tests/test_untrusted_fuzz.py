"""Property-based tests of core's readers, and of the fuzz harness itself (lollm.testing.fuzz).

The harness must be able to fail: an example that hangs, takes gigabytes or raises anything
but a LollmError fails the test (checked here on purpose-built bad examples). The families'
own suites (``test_untrusted_<family>.py``) use it on their configs and GGUF metadata.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lollm.load.checks import MAX_LAYERS, ConfigReader
from lollm.errors import CheckpointError, ConfigError, LollmError
from lollm.load.loader import read_json
from lollm.testing.fuzz import CPUTimeExceeded, _JUNK, check_clean, fuzz_settings, mutated

BASE = {"model_type": "m", "num_hidden_layers": 2, "rope_parameters": {"rope_theta": 1e6, "factor": 2.0}, "layer_types": ["a", "b"]}


# ------------------------------------------------------------------ the harness can fail


def test_check_clean_passes_a_lollm_error_and_returns_it():
    def refuse():
        raise ConfigError("x: config.json 'k' is 0")

    assert isinstance(check_clean(refuse), ConfigError)
    assert check_clean(lambda: 3) == 3


def test_check_clean_fails_any_other_exception():
    with pytest.raises(TypeError):
        check_clean(lambda: 1 + "a")


def test_check_clean_stops_a_runaway_loop_by_cpu_time():
    def spin():
        while True:
            pass

    with pytest.raises(CPUTimeExceeded):
        check_clean(spin, cpu_seconds=0.5)


def test_check_clean_fails_an_example_that_swallows_the_time_limit():
    def spin_and_swallow():
        try:
            while True:
                pass
        except Exception:
            raise ConfigError("looks clean") from None

    with pytest.raises(AssertionError, match="more than 0.5 s of CPU time"):
        check_clean(spin_and_swallow, cpu_seconds=0.5)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_check_clean_makes_a_huge_allocation_fail_instead_of_swapping():
    import torch

    with pytest.raises((RuntimeError, MemoryError)):
        check_clean(lambda: torch.empty(8 * 2**30, dtype=torch.uint8), memory_bytes=2**30)
    assert torch.empty(2**20).numel() == 2**20  # the limit is lifted afterwards


@fuzz_settings(max_examples=30)
@given(changed=mutated(BASE))
def test_every_mutation_changes_something(changed):
    assert changed != BASE


# ------------------------------------------------------------------ core's readers


@fuzz_settings(max_examples=60)
@given(value=_JUNK, method=st.sampled_from(["positive_int", "number", "boolean", "string", "token_ids", "mapping", "strings"]))
def test_config_reader_gives_a_value_or_a_config_error(value, method):
    read = ConfigReader({"k": value}, "t: config.json")
    calls = {
        "positive_int": lambda: read.positive_int("k", at_most=MAX_LAYERS),
        "number": lambda: read.number("k", above=0.0, at_most=1e9),
        "boolean": lambda: read.boolean("k"),
        "string": lambda: read.string("k", choices=("a", "b")),
        "token_ids": lambda: read.token_ids("k"),
        "mapping": lambda: read.mapping("k"),
        "strings": lambda: read.strings("k", length=2, choices=("a", "b")),
    }
    result = check_clean(calls[method])
    if isinstance(result, LollmError):
        assert isinstance(result, ConfigError) and "'k'" in str(result) and str(result).startswith("t: config.json")


def nested(depth: int) -> str:
    return '{"a": ' + "[" * depth + "]" * depth + "}"


@fuzz_settings(max_examples=60)
@given(
    text=st.one_of(
        st.binary(max_size=200).map(lambda b: b),
        st.recursive(st.none() | st.booleans() | st.floats() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=20).map(lambda v: json.dumps(v).encode()),
        st.integers(min_value=1, max_value=5000).map(lambda d: nested(d).encode()),
    )
)
def test_read_json_gives_an_object_or_a_checkpoint_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("json") / "config.json"
    path.write_bytes(text)
    result = check_clean(lambda: read_json(path, what="checkpoint config"))
    assert isinstance(result, (dict, CheckpointError))
    if isinstance(result, CheckpointError):
        assert str(path) in str(result)
