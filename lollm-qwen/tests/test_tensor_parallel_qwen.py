"""Tensor parallel (docs/tensor-parallel.md): torchrun with N gloo processes gives the one-process logits.

Each case writes a tiny random checkpoint with transformers, runs a prefill and
greedy decode steps through the cache in this process, then the same in N
processes under ``python -m torch.distributed.run`` (each loading only its
shard), and compares: logits within 1e-5 (float32; the all-reduce adds the
partial sums in another order), the same greedy ids, and each rank holding
1/N of the split tensors (lollm.testing.tensor_parallel). Set
``LOLLM_TP_DEVICE=cuda`` to run them with NCCL on GPUs
(lollm-core/benchmarks/gpu_tp_check.sh).
"""

from __future__ import annotations

import json

import pytest

from _qwen_tiny import chat_checkpoint, tiny_checkpoint  # noqa: F401  (fixtures)

from lollm.testing.tensor_parallel import check_tensor_parallel, torchrun_lollm

# torchrun's ranks want both cores: nox runs these tests alone, after the parallel pass (noxfile.py, _pytest)
pytestmark = pytest.mark.serial


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_two_processes_equal_one(family, tiny_checkpoint, tmp_path):  # noqa: F811
    folder = tiny_checkpoint(family)
    report = check_tensor_parallel(folder, 2, tmp_path)
    assert report["unmatched"] == [], f"TP_PLAN patterns that match nothing: {report['unmatched']}"
    # the split tensors are nearly all of the model (norms are the rest)
    assert report["full_split_bytes"] > 0.95 * report["full_bytes"]


def test_four_processes_share_kv_heads(tiny_checkpoint, tmp_path):  # noqa: F811
    """4 ranks, 2 KV heads: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1 (GQA groups kept whole)."""
    folder = tiny_checkpoint("qwen2")  # 4 query heads, 2 KV heads
    report = check_tensor_parallel(folder, 4, tmp_path, even=False)
    full = report["full_split_bytes"]
    for rank in report["ranks"]:
        # more than 1/4 (the shared k/v projections), well under 1/2
        assert full / 4 < rank["split_bytes"] < full / 3, rank


# -- the commands under torchrun: lollm parity --tp 2 -----------------------------------
def test_parity_command_over_two_processes(chat_checkpoint):  # noqa: F811
    """`lollm parity --tp 2`: our model split over 2 gloo ranks against transformers on rank 0; one report, exit 0."""
    proc = torchrun_lollm(2, ["parity", str(chat_checkpoint), "--tp", "2", "-p", "Hello there, how are you?", "--json"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # rank 1 prints nothing: stdout is exactly one JSON report
    assert report["passed"] and report["tp"] == 2
    assert report["argmax_matches"] == report["num_tokens"] > 1
    assert report["min_cosine"] >= 0.99999 and report["max_abs_diff"] < 1e-4


def test_parity_command_verdict_is_every_ranks_exit_status(chat_checkpoint):  # noqa: F811
    """A gate that cannot pass (cosine 1.5): rank 0 prints FAIL once, and every rank exits 1."""
    proc = torchrun_lollm(2, ["parity", str(chat_checkpoint), "--tp", "2", "-p", "Hello", "--min-cosine", "1.5"])
    assert proc.returncode != 0
    assert proc.stdout.count("FAIL:") == 1, proc.stdout[-3000:]
    # torchrun names each failed rank with its exit code
    assert "exitcode  : 1" in proc.stderr or "exitcode: 1" in proc.stderr, proc.stderr[-3000:]


# -- lollm bench --tp 2 ------------------------------------------------------------------
def test_bench_command_over_two_processes(chat_checkpoint):  # noqa: F811
    """`lollm bench --tp 2 --no-reference`: both ranks run the rounds; rank 0 alone prints its figures; exit 0."""
    proc = torchrun_lollm(2, ["bench", str(chat_checkpoint), "--tp", "2", "--no-reference", "--prompt-tokens", "8",
                              "--new-tokens", "4", "--rounds", "2", "--json"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # one JSON document: rank 1 printed nothing
    assert result["tp"] == 2
    [row] = result["rows"]
    assert row["engine"] == "lollm" and len(row["rounds"]["decode_tok_s"]) == 2
    assert all(v > 0 for v in row["rounds"]["decode_tok_s"] + row["rounds"]["prefill_tok_s"])


def test_bench_command_table_printed_once(chat_checkpoint):  # noqa: F811
    proc = torchrun_lollm(2, ["bench", str(chat_checkpoint), "--tp", "2", "--no-reference", "--prompt-tokens", "8",
                              "--new-tokens", "4", "--rounds", "1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ms per decode step") == 1, proc.stdout
    assert proc.stdout.count("rank 0's load and shard") == 1, proc.stdout
