"""The kit's converter check (section 12) catches a GGUF reader bug that every other kit test passes (issue 38).

The bug (``lollm.testing.mutation.MUTANTS["qwen2"]``, ``gguf_gate_up_swapped``): a copy of qwen2 whose GGUF
name map reads ``blk.{i}.ffn_gate.weight`` as ``up_proj`` and ``blk.{i}.ffn_up.weight`` as ``gate_proj``.
The shapes agree, so the file loads; the safetensors path never reads that map, so parity, cached decode,
self-consistency, bfloat16 and both config schemas pass. Only a GGUF the converter wrote shows it. The
suite runs the unchanged copy through every kit check first (the converter's GGUF included: it must pass).
"""

from __future__ import annotations

from lollm.testing.mutation import ALL_JUDGING_TESTS, GGUF_READER_BUGS, MUTANTS, run_suite


def test_a_gguf_reader_bug_fails_only_the_converter_check(tmp_path):
    bugs = [b for b in GGUF_READER_BUGS if b in MUTANTS["qwen2"][1]]
    assert bugs == ["gguf_gate_up_swapped"]
    result = run_suite("qwen2", tmp_path, bugs, tests=ALL_JUDGING_TESTS)
    assert result.ok, (result.clean.outcomes, result.caught)
    assert result.clean.outcomes["test_converter_gguf_parity_with_the_reference"][0] == "passed", result.clean.outcomes
    assert result.caught == {"gguf_gate_up_swapped": ["test_converter_gguf_parity_with_the_reference"]}, result.caught
