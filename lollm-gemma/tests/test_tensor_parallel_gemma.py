"""Tensor parallel (docs/tensor-parallel.md): torchrun with 2 gloo processes gives the one-process logits.

For each tiny checkpoint: a prefill and greedy decode steps through the cache
(sliding-window ring included) in this process and in 2 processes under
``python -m torch.distributed.run``, each loading only its shard; logits within
1e-5 (float32), the same greedy ids, each rank holding 1/2 of the split tensors
(lollm.testing.tensor_parallel). ``LOLLM_TP_DEVICE=cuda`` runs them with NCCL.
"""

from __future__ import annotations

import pytest

from lollm.testing.tensor_parallel import check_tensor_parallel

# torchrun's ranks want both cores: nox runs these tests alone, after the parallel pass (noxfile.py, _pytest)
pytestmark = pytest.mark.serial


@pytest.mark.parametrize("name", ["gemma2", "gemma3-1b", "gemma4-e2b-text"])
def test_two_processes_equal_one(name, tiny, tmp_path):
    """gemma4-e2b-text: per-layer embeddings (their table split by vocabulary rows), KV-sharing layers."""
    report = check_tensor_parallel(tiny(name), 2, tmp_path)
    assert report["unmatched"] == [], f"TP_PLAN patterns that match nothing: {report['unmatched']}"


def test_global_kv_head_shared_by_both_ranks(tiny, tmp_path):
    """gemma4 with attention_k_eq_v: the global layers have 1 KV head (and no v_proj): both ranks keep it."""
    report = check_tensor_parallel(tiny("gemma4-k-eq-v"), 2, tmp_path, even=False)
    full = report["full_split_bytes"]
    for rank in report["ranks"]:
        assert full / 2 < rank["split_bytes"] < 0.6 * full, rank
