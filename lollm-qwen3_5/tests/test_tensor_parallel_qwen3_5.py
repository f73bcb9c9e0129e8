"""Tensor parallel (docs/tensor-parallel.md): torchrun with 2 gloo processes gives the one-process logits.

qwen3_5: Gated DeltaNet layers split by heads (their conv window and recurrent
state in the cache with them) beside gated full attention; qwen3_5_moe: every
expert split by its width, one all-reduce per MoE block. Both with the MTP
head's tensors loaded (its layer is split the same way). A prefill (the
chunked delta rule) and greedy decode steps (the recurrent one) in this process
and in 2 processes under ``python -m torch.distributed.run``: logits within 1e-5
(float32), the same greedy ids, each rank holding 1/2 of the split tensors.
``LOLLM_TP_DEVICE=cuda`` runs them with NCCL.
"""

from __future__ import annotations

import pytest

from qwen3_5_tiny import write_tiny

from lollm.testing.tensor_parallel import check_tensor_parallel

# torchrun's ranks want both cores: nox runs these tests alone, after the parallel pass (noxfile.py, _pytest)
pytestmark = pytest.mark.serial


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_two_processes_equal_one(family, tmp_path):
    folder = write_tiny(family, "text", tmp_path / "ckpt", mtp=True)
    report = check_tensor_parallel(folder, 2, tmp_path, prompt_len=70)  # > 64: two chunks of the chunked rule
    assert report["unmatched"] == [], f"TP_PLAN patterns that match nothing: {report['unmatched']}"
