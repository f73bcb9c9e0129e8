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

import pytest

from _qwen_tiny import tiny_checkpoint  # noqa: F401  (fixture)

from lollm.testing.tensor_parallel import check_tensor_parallel


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
