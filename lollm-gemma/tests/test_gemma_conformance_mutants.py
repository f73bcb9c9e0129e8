"""The conformance kit fails a copy of gemma3 with one deliberate bug (issue 11's proof).

Each test copies the installed ``lollm_gemma.gemma3`` package to a temporary
folder, replaces one exact piece of its source (the replacement refuses to run
when the piece is not there exactly once, so a refactor of gemma3 breaks this
test loudly), registers the copy in place of gemma3, and runs the kit's numeric
tests on a sensitive tiny checkpoint (tests/test_gemma_conformance.py): the
unchanged copy must pass them, each mutant must fail the tests named below with
the kit's own message.
"""

from __future__ import annotations

import pytest

from lollm.testing.mutation import NUMERIC_TESTS, copy_family, run_kit
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint

from test_gemma_conformance import sensitive_gemma3

PACKAGE = "lollm_gemma.gemma3"

#: name -> (file, exact old text, new text, {kit test that must fail: text its message must hold})
MUTATIONS = {
    "rope_scaling_ignored": (
        "blocks.py", "inv_freq = inv_freq / rope.factor", "inv_freq = inv_freq",
        {"test_parity_with_the_reference": "parity failed", "test_cached_decode_matches_the_reference": "parity failed"},
    ),
    "rope_base_times_2": (
        "blocks.py", "inv_freq = 1.0 / (rope.theta**exponents)", "inv_freq = 1.0 / ((2 * rope.theta)**exponents)",
        {"test_parity_with_the_reference": "parity failed", "test_cached_decode_matches_the_reference": "parity failed"},
    ),
    "norm_eps_ignored": (
        "blocks.py", "self.eps = eps", "self.eps = 1e-6",
        {"test_parity_with_the_reference": "parity failed", "test_cached_decode_matches_the_reference": "parity failed"},
    ),
    # the window is read one too small: cache and mask agree, so only the reference can tell
    "sliding_window_off_by_one": (
        "config.py", 'sliding_window=read.positive_int("sliding_window", at_most=MAX_CONTEXT),',
        'sliding_window=read.positive_int("sliding_window", at_most=MAX_CONTEXT) - 1,',
        {"test_parity_with_the_reference": "parity failed", "test_cached_decode_matches_the_reference": "parity failed"},
    ),
    # a one-token decode step of a global layer reads positions 1.. and drops position 0
    "decode_drops_a_position": (
        "kv.py", "return self.k[:, :, :end], self.v[:, :, :end]",
        "first = 1 if k.shape[2] == 1 and end > 1 else 0\n        return self.k[:, :, first:end], self.v[:, :, first:end]",
        {"test_prefill_all_equals_prefill_then_decode": "prefill-all vs chunks",
         "test_cached_decode_matches_the_reference": "cached forward in chunks"},
    ),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(sensitive_gemma3(), tmp_path_factory.mktemp("gemma3"), schema="hub",
                                 init_std=SENSITIVE_INIT_STD)


def test_the_unchanged_copy_passes_the_kit(checkpoint, tmp_path):
    copy = copy_family(PACKAGE, tmp_path / "src", "copy_gemma3_clean")
    run = run_kit(PACKAGE, copy, "gemma3", checkpoint, tmp_path)
    assert not run.failed, run.failed
    assert sorted(run.passed) == sorted(NUMERIC_TESTS), run.outcomes  # the checkpoint's sensitivity included


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_kit_fails_a_copy_with_one_bug(mutation, checkpoint, tmp_path):
    filename, old, new, must_fail = MUTATIONS[mutation]
    copy = copy_family(PACKAGE, tmp_path / "src", f"mutant_gemma3_{mutation}", {filename: [(old, new)]})
    # only the kit tests expected to fail run (the unchanged copy above passes all of them,
    # the checkpoint's sensitivity test included), to keep the suite fast
    run = run_kit(PACKAGE, copy, "gemma3", checkpoint, tmp_path, tests=sorted(must_fail))
    missing = set(must_fail) - set(run.failed)
    assert not missing, f"{mutation}: the kit passed {sorted(missing)}; outcomes {run.outcomes}"
    for name, needle in must_fail.items():
        assert needle in run.failed[name], f"{mutation}: {name} failed without the kit's message: {run.failed[name][-2000:]}"


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_the_blind_spots_of_issue_38_pass_every_float32_check_and_fail_the_new_ones(family, tmp_path):
    """Issue 38's two bugs that the kit once passed, on the suite's own checkpoint (kit_config, written
    by transformers 5): Gemma's norm cast before its (1 + w) (bit-identical at float32) fails only the
    bfloat16 test; sliding layers reading 'rope_theta' for 'rope_local_base_freq' (gemma3; the kit's
    checkpoint spells RoPE as 'rope_parameters') fails only the test of both config schemas."""
    from lollm.testing.mutation import ALL_JUDGING_TESTS, BLIND_SPOT_BUGS, MUTANTS, run_suite

    bugs = [b for b in BLIND_SPOT_BUGS if b in MUTANTS[family][1]]
    result = run_suite(family, tmp_path, bugs, tests=ALL_JUDGING_TESTS)
    assert not result.clean.failed, result.clean.failed
    expected = {"norm_cast_before_scale": ["test_bfloat16_parity_with_the_reference"],
                "local_rope_from_rope_theta": ["test_both_config_schemas_give_the_same_logits"]}
    assert result.caught == {b: expected[b] for b in bugs}, result.caught


@pytest.mark.parametrize("mutation", [None, "patch_order_transposed", "position_embedding_dropped", "merge_one_token_off"])
@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_the_vision_check_passes_the_family_and_fails_each_vision_mutant(family, mutation, tmp_path):
    """The unchanged copy passes both vision tests; each catalogue mutant (lollm.testing.vision_mutants: gemma3's
    SigLIP and merge, gemma4's tower beside its folder, copied with lollm_gemma) fails those named in its
    FAILS, with the kit's message, and passes the other (a right tower with a wrong merge)."""
    from lollm.testing.mutation import check_vision_mutant

    check_vision_mutant(family, mutation, tmp_path)
