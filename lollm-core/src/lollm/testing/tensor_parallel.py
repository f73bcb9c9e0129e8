"""Tensor-parallel equality checks: N processes under torchrun against one process (docs/tensor-parallel.md).

A family's test calls :func:`check_tensor_parallel` on a tiny checkpoint::

    report = check_tensor_parallel(folder, nproc=2)

It runs the same forward passes twice: in this process, and in ``nproc``
processes started by ``python -m torch.distributed.run`` (torchrun), each
loading its shard through :func:`lollm.load.pipeline.open_model` with ``tp=nproc``
(gloo on the CPU, or NCCL with ``device="cuda"``). Both runs feed a fixed
random prompt (a prefill of every position), then greedy decode steps through
the KV/recurrent cache, in float32. It asserts the logits of every position
within ``atol`` and the same greedy ids, and that each rank's split tensors
hold 1/N of the bytes they hold in one process.

The worker (``python -m lollm.testing.tensor_parallel FOLDER OUT NPROC …``)
writes rank 0's logits and every rank's weight bytes to ``OUT``.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model
from lollm.load.ranks import finish

#: Absolute tolerance on float32 logits. The sums an all-reduce adds in another order
#: (o_proj, down_proj as N partial sums) differ by a few float32 ulps of the hidden
#: state; on the tiny checkpoints (logits of order 1) that stays well under 1e-5.
ATOL = 1e-5


def record(model, prompt: list[int], steps: int, device="cpu") -> dict[str, Any]:
    """Prefill ``prompt`` then ``steps`` greedy decode steps through the model's cache.

    Returns ``{"prefill": (T, V) float32, "decode": (steps, V) float32, "ids": [steps ints]}``.
    """
    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + steps + 1)
        logits = model(torch.tensor([prompt], dtype=torch.long, device=device), cache)[0].float()  # (T, V)
        prefill = logits.cpu().clone()
        ids, decode = [], []
        nxt = int(logits[-1].argmax())
        for _ in range(steps):
            ids.append(nxt)
            logits = model(torch.tensor([[nxt]], dtype=torch.long, device=device), cache)[0, -1].float()
            decode.append(logits.cpu().clone())
            nxt = int(logits.argmax())
    return {"prefill": prefill, "decode": torch.stack(decode), "ids": ids}


def param_bytes(model) -> int:
    """Bytes of the model's parameters (shared ones once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def split_bytes_full(model, names: set[str]) -> int:
    """Bytes of the parameters ``names`` in a one-process model (the unsplit sizes of what a rank splits)."""
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in names and id(p) not in seen:  # a tied head and embedding count once
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_lollm(nproc: int, args: list[str], *, timeout: float = 180.0) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node nproc -m lollm ARGS…`` (one thread per rank); its result.

    For the commands' own ``--tp`` tests (``lollm parity --tp 2``, ``lollm bench --tp 2``):
    the caller checks the exit status and what rank 0 printed.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "lollm", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def run_torchrun(folder: Path, nproc: int, out: Path, prompt: list[int], steps: int, *, device: str = "cpu",
                 timeout: float = 120.0) -> dict[str, Any]:
    """Run the worker under ``python -m torch.distributed.run --nproc-per-node nproc``; its record.

    Raises AssertionError with the processes' output when torchrun fails.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "lollm.testing.tensor_parallel", str(folder), str(out), str(nproc), json.dumps(prompt), str(steps), device]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return torch.load(out, weights_only=True)


def check_tensor_parallel(folder: Path, nproc: int, tmp: Path, *, prompt_len: int = 12, steps: int = 4,
                          atol: float = ATOL, device: str | None = None, even: bool = True) -> dict[str, Any]:
    """Assert that ``nproc`` processes give the one-process logits (within ``atol``) and greedy ids.

    Also asserts that each rank holds the replicated tensors whole and, with
    ``even`` (N divides every split count), exactly 1/N of the split tensors'
    bytes; where N exceeds the KV heads (``even=False``) ranks share KV heads and
    hold more: the report gives the figure. ``device``: ``cpu`` (gloo) or
    ``cuda`` (NCCL); None reads ``$LOLLM_TP_DEVICE`` (default ``cpu``). Returns a
    report: max |diff| for prefill and decode, per-rank bytes, unmatched plan patterns.
    """
    device = device or os.environ.get("LOLLM_TP_DEVICE", "cpu")
    loaded = open_model(str(folder), LoadOptions(device=device, dtype="float32"))
    vocab = loaded.model.lm_head.weight.shape[0]
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = record(loaded.model, prompt, steps, device=loaded.device)
    out = run_torchrun(folder, nproc, tmp / f"tp{nproc}.pt", prompt, steps, device=device)
    prefill_diff = (out["prefill"] - ref["prefill"]).abs().max().item()
    decode_diff = (out["decode"] - ref["decode"]).abs().max().item()
    assert out["prefill"].shape == ref["prefill"].shape
    assert prefill_diff <= atol, f"--tp {nproc}: prefill logits differ by {prefill_diff:.3g} > {atol}"
    assert decode_diff <= atol, f"--tp {nproc}: decode logits differ by {decode_diff:.3g} > {atol}"
    assert out["ids"] == ref["ids"], f"--tp {nproc}: greedy ids {out['ids']} != {ref['ids']}"

    full_split = split_bytes_full(loaded.model, set(out["split_names"]))
    total = param_bytes(loaded.model)
    report = {"prefill_max_diff": prefill_diff, "decode_max_diff": decode_diff, "ids": out["ids"],
              "full_bytes": total, "full_split_bytes": full_split, "ranks": out["ranks"], "unmatched": out["unmatched"]}
    # what each rank holds: the replicated tensors whole, and its slice of the split ones
    for rank in report["ranks"]:
        assert rank["replicated_bytes"] == total - full_split, f"--tp {nproc}: a rank replicates {rank}, expected {total - full_split}"
    if even:
        for rank in report["ranks"]:
            assert rank["split_bytes"] * nproc == full_split, (
                f"--tp {nproc}: a rank holds {rank['split_bytes']} bytes of split tensors, not 1/{nproc} of {full_split}")
    return report


def _worker(folder: str, out: str, nproc: int, prompt: list[int], steps: int, device: str) -> None:
    loaded = open_model(folder, LoadOptions(device=device, dtype="float32", tp=nproc))
    tp = loaded.model.tensor_parallel
    rec = record(loaded.model, prompt, steps, device=loaded.device)
    split, rest = tp.sharded_bytes(loaded.model)
    where = loaded.device if loaded.tp.backend == "nccl" else "cpu"  # NCCL gathers GPU tensors only
    mine = torch.tensor([split, rest], dtype=torch.int64, device=where)
    every = [torch.zeros_like(mine) for _ in range(nproc)]
    dist.all_gather(every, mine)
    if loaded.tp.rank == 0:
        rec["ranks"] = [{"split_bytes": int(e[0]), "replicated_bytes": int(e[1])} for e in every]
        rec["split_names"] = sorted(tp.slices)
        rec["unmatched"] = list(tp.unmatched)
        torch.save(rec, out)
    group = loaded.tp
    del loaded, tp, rec, mine, every  # rule 4 of lollm.load.ranks: drop the model before the group goes
    gc.collect()
    finish(group)  # every rank meets in a barrier (rank 0 has written), then leaves


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
