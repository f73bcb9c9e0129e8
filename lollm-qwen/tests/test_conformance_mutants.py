"""The conformance kit fails a copy of qwen2 with one deliberate bug (issue 11's proof, qwen side).

Each test copies the installed ``lollm_qwen.qwen2`` package to a temporary folder,
replaces one exact piece of its source (refused when the piece is not there exactly
once, so a refactor of qwen2 breaks this test loudly), registers the copy in place of
qwen2 and runs the kit's numeric tests on a sensitive tiny checkpoint with YaRN RoPE
scaling (tests/test_conformance.py). The unchanged copy must pass, each mutant must
fail the tests named below with the kit's message. (qwen2 has no sliding window: the
off-by-one window mutant is gemma3's, in lollm-gemma's tests.)
"""

from __future__ import annotations

import pytest

from lollm.testing.mutation import NUMERIC_TESTS, copy_family, run_kit
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint

from test_conformance import sensitive_qwen2_yarn

PACKAGE = "lollm_qwen.qwen2"
PARITY = {"test_parity_with_the_reference": "parity failed", "test_cached_decode_matches_the_reference": "parity failed"}

#: name -> (file, exact old text, new text, {kit test that must fail: text its message must hold})
MUTATIONS = {
    "rope_scaling_ignored": (
        "blocks.py", 'if rope.rope_type == "default":', 'if rope.rope_type == "default" or rope.rope_type == "yarn":', PARITY,
    ),
    "rope_base_times_2": ("blocks.py", "base = rope.theta", "base = 2 * rope.theta", PARITY),
    "norm_eps_ignored": ("blocks.py", "self.eps = eps", "self.eps = 1e-6", PARITY),
    # a one-token decode step reads positions 1.. and drops position 0
    "decode_drops_a_position": (
        "kv.py", "return self.k[layer, :, :, :end], self.v[layer, :, :, :end]",
        "first = 1 if k.shape[2] == 1 and end > 1 else 0\n"
        "        return self.k[layer, :, :, first:end], self.v[layer, :, :, first:end]",
        {"test_prefill_all_equals_prefill_then_decode": "prefill-all vs chunks",
         "test_cached_decode_matches_the_reference": "cached forward in chunks"},
    ),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(sensitive_qwen2_yarn(), tmp_path_factory.mktemp("qwen2"), schema="hub",
                                 init_std=SENSITIVE_INIT_STD)


def test_the_unchanged_copy_passes_the_kit(checkpoint, tmp_path):
    copy = copy_family(PACKAGE, tmp_path / "src", "copy_qwen2_clean")
    run = run_kit(PACKAGE, copy, "qwen2", checkpoint, tmp_path)
    assert not run.failed, run.failed
    assert sorted(run.passed) == sorted(NUMERIC_TESTS), run.outcomes  # the checkpoint's sensitivity included


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_kit_fails_a_copy_with_one_bug(mutation, checkpoint, tmp_path):
    filename, old, new, must_fail = MUTATIONS[mutation]
    copy = copy_family(PACKAGE, tmp_path / "src", f"mutant_qwen2_{mutation}", {filename: [(old, new)]})
    # only the kit tests expected to fail run (the unchanged copy above passes all of them,
    # the checkpoint's sensitivity test included), to keep the suite fast
    run = run_kit(PACKAGE, copy, "qwen2", checkpoint, tmp_path, tests=sorted(must_fail))
    missing = set(must_fail) - set(run.failed)
    assert not missing, f"{mutation}: the kit passed {sorted(missing)}; outcomes {run.outcomes}"
    for name, needle in must_fail.items():
        assert needle in run.failed[name], f"{mutation}: {name} failed without the kit's message: {run.failed[name][-2000:]}"


def test_the_kit_fails_a_checkpoint_that_cannot_see_the_bugs(tmp_path):
    """transformers' default initialisation and the hub's epsilon (1e-6): the coverage check refuses the
    checkpoint (an ignored epsilon cannot show); with the old fixed bound of 1e-3, so does the sensitivity test."""
    from lollm.testing.tiny import shrink_config

    from _qwen_tiny import real_config

    blind = write_tiny_checkpoint(shrink_config(real_config("qwen2")), tmp_path / "blind", schema="hub")
    copy = copy_family(PACKAGE, tmp_path / "src", "copy_qwen2_blind")
    run = run_kit(PACKAGE, copy, "qwen2", blind, tmp_path, attributes={"parity_max_abs_diff": 1e-3},
                  tests=["test_checkpoint_covers_every_feature", "test_reference_checkpoint_is_sensitive"])
    assert set(run.failed) == {"test_checkpoint_covers_every_feature", "test_reference_checkpoint_is_sensitive"}, run.outcomes
    coverage = run.failed["test_checkpoint_covers_every_feature"]
    assert "norm epsilon rms_norm_eps (1e-06)" in coverage and "SENSITIVE_NORM_EPS" in coverage, coverage
    message = run.failed["test_reference_checkpoint_is_sensitive"]
    assert "the tiny checkpoint is insensitive to rope_theta" in message, message
    assert "norm_eps" in message and "init_std" in message, message
