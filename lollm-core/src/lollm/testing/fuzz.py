"""Property-based tests of untrusted checkpoint values: mutated configs and GGUF metadata.

A checkpoint from anywhere is untrusted, so every family must turn *any*
config.json or GGUF metadata into either a model or a clean
:class:`lollm.errors.LollmError`, quickly and in bounded memory. This module
gives a family's tests what they need to say so with hypothesis:

* :func:`mutated` - a strategy of copies of a real (shrunk) config dict or GGUF
  metadata with one to three changes: a value replaced by junk (wrong types,
  zero, negatives, huge numbers, NaN, infinities, nested junk, lists with
  nulls, numbers just off the right one), a key removed, or a junk key added,
  at any depth (``text_config``, ``rope_parameters`` ...);
* :func:`check_clean` - runs one example under a CPU-time limit and a memory
  limit and fails unless it returns or raises a LollmError;
* :func:`load_and_generate` - what one example does: the family's ``load``,
  then two greedy tokens through the shared loop;
* :func:`fuzz_settings` - the budget: small and derandomized in CI
  (``max_examples`` as given, the same examples every run), larger and random
  when ``LOLLM_FUZZ_EXAMPLES`` is set (the nox session ``fuzz``).

Usage in a family's tests::

    @fuzz_settings(max_examples=40)
    @given(raw=mutated(TINY_CONFIG))
    def test_config_fuzz(raw, tiny_weights):
        check_clean(lambda: load_and_generate(load, raw, tiny_weights, "safetensors"))

hypothesis is test tooling (``lollm-core[test]``): import this module from tests only.
"""

from __future__ import annotations

import copy
import math
import os
import resource
import signal
import sys
from typing import Callable, TypeVar

from hypothesis import HealthCheck, event, settings
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st

from lollm.errors import LollmError
from lollm.generate.loop import GenerationResult, generate
from lollm.load.loader import Checkpoint, TensorSource
from lollm.load.options import LoadOptions
from lollm.model import CausalLM
from lollm.sampling_params import SamplingParams
from lollm.testing.loading import load_with

#: What an example's ``run`` returns (:func:`check_clean` hands it back).
T = TypeVar("T")

#: CPU seconds one example may take (its normal figure is well under a tenth of a second).
CPU_SECONDS = 5.0
#: Address space one example may add to the process (a run that asks for more fails).
MEMORY_BYTES = 4 * 2**30

#: Single junk values a GGUF file can hold too (no null)...
_VALUES = st.one_of(
    st.booleans(),
    st.sampled_from([0, -1, 1, 2, 3, 7, 2**31, 2**63, 10**9, 10**12, 10**30]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0.0, -1.0, 0.5, 1.0, 1e-300, 1e300, math.nan, math.inf, -math.inf]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "abc", "true", "false", "2", "1e6", "null", "silu", "default", "full_attention"]),
    st.text(max_size=6),
)
#: ... and those of JSON (null too).
_ATOMS = st.none() | _VALUES

_JUNK = st.recursive(
    _ATOMS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)

#: GGUF values have no null and no objects: numbers, booleans, strings and (nested) arrays.
_GGUF_JUNK = st.recursive(
    _VALUES,
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=8,
)


def _paths(value: object, prefix: tuple = (), skip: tuple = ()) -> list[tuple]:
    """Every place in a nested dict/list a mutation can reach (dict keys and list indices), but the ``skip`` keys."""
    out = []
    if isinstance(value, dict):
        for key, child in value.items():
            if key in skip:
                continue
            out.append(prefix + (key,))
            out += _paths(child, prefix + (key,), skip)
    elif isinstance(value, list):
        for i, child in enumerate(value[:8]):
            out.append(prefix + (i,))
            out += _paths(child, prefix + (i,))
    return out


def _near(value: object) -> st.SearchStrategy:
    """Values close to a valid one: off by one, doubled, halved, negated, zero, or another type."""
    if isinstance(value, bool):
        return st.sampled_from([not value, int(value), str(value).lower(), None])
    if isinstance(value, int):
        return st.sampled_from([value - 1, value + 1, 2 * value, value // 2, -value, 0, str(value), [value]])
    if isinstance(value, float):
        rounded = [int(value)] if math.isfinite(value) else []
        return st.sampled_from([-value, 0.0, value * 1e6, value / 1e6, math.nan, str(value), *rounded])
    if isinstance(value, list):
        return st.sampled_from([value[:-1], value + value[-1:], [None] + value[1:], value[::-1]]) if value else st.just([None])
    return st.nothing()


@st.composite
def mutated(
    draw: Callable, base: dict, gguf: bool = False, max_changes: int = 3, key_prefix: str = "", skip: tuple = (),
) -> dict:
    """A copy of ``base`` (a config dict or GGUF metadata) with 1 .. ``max_changes`` changes.

    Each change picks a key (at any depth) and replaces its value with junk or a near
    miss, removes it, or adds a junk key beside it (named ``key_prefix`` + junk text:
    ``"qwen2."`` makes added GGUF keys land in the family's namespace). ``gguf=True``
    draws only values a GGUF file can hold (no null, no objects). Keys named in ``skip``
    (a vision tower's config a text family never reads) are left alone, so the examples
    spend their changes on what the family reads.
    """
    out = copy.deepcopy(base)
    junk = _GGUF_JUNK if gguf else _JUNK
    # hypothesis prefers the first entries of sampled_from; a seeded Random picks every key alike
    pick = draw(st.randoms(use_true_random=False))
    for _ in range(draw(st.integers(min_value=1, max_value=max_changes))):
        paths = _paths(out, skip=skip)
        if not paths:
            break
        path = pick.choice(paths)
        parent = out
        for step in path[:-1]:
            parent = parent[step]
        key = path[-1]
        action = draw(st.sampled_from(["junk", "near", "near", "remove", "add"]))
        if action == "remove" and isinstance(parent, dict):
            del parent[key]
        elif action == "add" and isinstance(parent, dict):
            parent[key_prefix + draw(st.text(min_size=1, max_size=12))] = draw(junk)
        elif action == "near" and not isinstance(parent[key], (dict, str, type(None))):
            parent[key] = draw(_near(parent[key]))
        else:
            parent[key] = draw(junk)
    return out


def fuzz_settings(max_examples: int = 30) -> settings:
    """The example budget: ``max_examples``, derandomized (the same examples every run, no database) in CI;
    with ``LOLLM_FUZZ_EXAMPLES=N`` (the nox session ``fuzz``): N random examples, failures kept in hypothesis' database."""
    common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                        HealthCheck.function_scoped_fixture])
    wanted = os.environ.get("LOLLM_FUZZ_EXAMPLES")
    if wanted:
        return settings(max_examples=int(wanted), derandomize=False, **common)
    return settings(max_examples=max_examples, derandomize=True, database=None, **common)


class CPUTimeExceeded(Exception):
    """An example used more than its CPU seconds (a hang or a runaway loop)."""


def _virtual_memory_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def check_clean(run: Callable[[], T], *, cpu_seconds: float = CPU_SECONDS,
                memory_bytes: int = MEMORY_BYTES) -> T | LollmError:
    """Run one example; it must return, or raise a LollmError, within ``cpu_seconds`` of CPU time
    and without growing the address space by more than ``memory_bytes``.

    CPU time (the process's, all threads) is bounded with ``ITIMER_PROF``; memory with the soft
    ``RLIMIT_AS`` (Linux), so an allocation past the limit fails instead of swapping. Returns what
    ``run`` returned, or the LollmError it raised; any other exception (a traceback from torch,
    json, jinja2 ..., a MemoryError, the time limit) fails the test with the example.
    """
    timed_out = []

    def on_alarm(signum, frame):
        timed_out.append(True)
        raise CPUTimeExceeded(f"the example used more than {cpu_seconds} s of CPU time")

    limit_memory = sys.platform.startswith("linux")
    if limit_memory:
        old_limit = resource.getrlimit(resource.RLIMIT_AS)
        wanted = _virtual_memory_bytes() + memory_bytes
        hard = old_limit[1]
        resource.setrlimit(resource.RLIMIT_AS, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
    old_handler = signal.signal(signal.SIGPROF, on_alarm)
    signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
    try:
        try:
            result = run()
        except LollmError as exc:
            result = exc
        # a CPUTimeExceeded that the code under test swallowed still fails the example
        assert not timed_out, f"the example used more than {cpu_seconds} s of CPU time"
        if currently_in_test_context():  # hypothesis' statistics: how many loaded, how many were refused
            event(f"ended in {type(result).__name__}")
        return result
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old_handler)
        if limit_memory:
            resource.setrlimit(resource.RLIMIT_AS, old_limit)


def load_and_generate(load: Callable[[Checkpoint, LoadOptions], CausalLM], raw: dict, weights: TensorSource, fmt: str,
                      prompt: tuple[int, ...] = (0, 1, 2)) -> GenerationResult:
    """One example: the family's ``load`` on (``raw``, ``weights``), then two greedy tokens through the loop."""
    model = load_with(load, raw, weights, fmt)
    return generate(model, list(prompt), max_new_tokens=2, sampling=SamplingParams(temperature=0.0))
