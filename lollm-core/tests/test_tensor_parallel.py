"""lollm.load.tensor_parallel: the launch checks, a plan applied to a toy model, and its collectives over gloo.

The families' own tests (each distribution's tests/test_tensor_parallel_*.py)
run real checkpoints under torchrun; here the mechanism is tested on a toy
model small enough to read: an embedding, a column-split then row-split MLP
pair, and an output head, with an uneven vocabulary (11 rows over 2 ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from lollm.load.quantized import Quantization
from lollm.load.tensor_parallel import (
    Colwise,
    Group,
    Rowwise,
    Sharding,
    TensorParallelError,
    Vocab,
    check_launch,
    init,
)
from lollm.load.build import WeightLayout, build_model
from lollm.load.options import LoadOptions
from lollm.load.weights import load_weights

ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


# -- launch checks ---------------------------------------------------------------------
def test_tp_one_needs_nothing():
    check_launch(1, environ={})
    assert init(1, torch.device("cpu"), environ={}) is None


def test_tp_below_one_is_refused():
    with pytest.raises(TensorParallelError, match=r"--tp 0: give the number of processes"):
        check_launch(0, environ={})


def test_missing_torchrun_environment_names_the_variables_and_the_command():
    with pytest.raises(TensorParallelError) as info:
        check_launch(2, environ={"RANK": "0"})
    message = str(info.value)
    assert "torchrun --nproc-per-node 2 -m lollm run --tp 2" in message
    assert "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT" in message and "RANK," not in message.split("no ")[1][:5]


def test_world_size_other_than_tp_is_refused():
    with pytest.raises(TensorParallelError, match=r"--tp 4 but torchrun started 2 processes"):
        check_launch(4, environ=ENV)


def test_unavailable_backend_is_named(monkeypatch):
    monkeypatch.setenv("LOLLM_TP_BACKEND", "no-such-backend")
    with pytest.raises(TensorParallelError, match=r"no 'no-such-backend' backend for torch.distributed"):
        init(2, torch.device("cpu"), environ=ENV)


@pytest.mark.parametrize("command", [["run", "-p", "hi"], ["parity"], ["bench", "--no-reference"], ["serve"]])
def test_cli_without_torchrun_is_one_error_line(command):
    """Each command that takes --tp says so before looking for the model, naming its own torchrun line."""
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    proc = subprocess.run([sys.executable, "-m", "lollm", command[0], "no-such-model", "--tp", "2", *command[1:]],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --tp 2 runs one process per shard, started by torchrun"), lines
    assert f"torchrun --nproc-per-node 2 -m lollm {command[0]} --tp 2" in lines[0]


def test_bench_refuses_the_transformers_comparison_under_tp():
    """bench --tp benches lollm alone: without --no-reference it is one error line naming the flag."""
    proc = subprocess.run([sys.executable, "-m", "lollm", "bench", "no-such-model", "--tp", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --tp 2: bench cannot compare with transformers"), lines
    assert "--no-reference" in lines[0]


# -- a toy model -----------------------------------------------------------------------
@dataclass(frozen=True)
class ToyConfig:
    vocab: int = 11
    hidden: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 2
    width: int = 12


class Toy(nn.Module):
    """embed -> (q, k: by heads) -> o (rows) -> up (columns) -> down (rows) -> head; shapes from the config."""

    def __init__(self, c: ToyConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim, bias=True)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=True)
        self.up = nn.Linear(c.hidden, c.width, bias=False)
        self.down = nn.Linear(c.width, c.hidden, bias=False)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, ids):
        c, T = self.config, len(ids)
        x = self.embed(ids)  # (T, C)
        q = self.q(x).view(T, c.heads, c.head_dim)  # (T, H, D): this rank's heads
        k = self.k(x).view(T, c.kv_heads, c.head_dim)  # (T, K, D)
        k = k.repeat_interleave(c.heads // c.kv_heads, dim=1)  # query head h reads KV head h // (H/K)
        x = x + self.o(torch.tanh(q * k).reshape(T, -1))
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(x)  # (T, V)


PLAN = {
    "embed": Vocab(),
    "q": Colwise("heads"),
    "k": Colwise("kv_heads", replicate=True),
    "o": Rowwise("heads"),
    "up": Colwise("width"),
    "down": Rowwise("width"),
    "head": Vocab(),
}


class DictSource:
    """The loader's TensorSource interface over a dict of tensors."""

    fmt = "safetensors"

    def __init__(self, tensors):
        self.tensors = tensors

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name):
        return self.tensors[name].clone()


def toy_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in Toy(ToyConfig()).state_dict().items()}


def shard(rank: int, world: int, weights=None, config=ToyConfig()):
    group = Group(rank=rank, world=world, backend="gloo", device=torch.device("cpu"))
    source = DictSource(weights or toy_weights())
    tp = Sharding(PLAN, config, group)
    model = tp.build(Toy)
    load_weights(model, source, lambda n: n, device="cpu", dtype=torch.float32, sharding=tp)
    return tp, model


def test_build_cuts_each_tensor_to_this_ranks_slice():
    full = toy_weights()
    for rank in range(2):
        tp, model = shard(rank, 2, full)
        assert model.config.heads == 2 and model.config.kv_heads == 1 and model.config.width == 6
        assert torch.equal(model.q.weight, full["q.weight"][rank * 4:(rank + 1) * 4])  # 2 heads of 2 rows
        assert torch.equal(model.q.bias, full["q.bias"][rank * 4:(rank + 1) * 4])
        assert torch.equal(model.o.weight, full["o.weight"][:, rank * 4:(rank + 1) * 4])
        assert torch.equal(model.down.weight, full["down.weight"][:, rank * 6:(rank + 1) * 6])
        # the row-split bias is added once: rank 0 holds it, rank 1 zeros
        assert torch.equal(model.o.bias, full["o.bias"] if rank == 0 else torch.zeros_like(full["o.bias"]))
        # 11 vocabulary rows: 6 on rank 0, 5 on rank 1
        rows = (0, 6) if rank == 0 else (6, 11)
        assert torch.equal(model.embed.weight, full["embed.weight"][rows[0]:rows[1]])
        assert torch.equal(model.head.weight, full["head.weight"][rows[0]:rows[1]])
        assert tp.unmatched == []


def test_kv_heads_shared_when_ranks_outnumber_them():
    full = toy_weights()
    for rank in range(4):
        _, model = shard(rank, 4, full)
        assert model.config.kv_heads == 1
        kv = rank * 2 // 4  # ranks 0, 1 -> KV head 0; ranks 2, 3 -> KV head 1
        assert torch.equal(model.k.weight, full["k.weight"][kv * 2:(kv + 1) * 2])
        assert torch.equal(model.q.weight, full["q.weight"][rank * 2:(rank + 1) * 2])  # one query head each


def test_a_split_that_does_not_divide_names_the_field():
    with pytest.raises(TensorParallelError, match=r"--tp 3 does not divide heads = 4"):
        shard(0, 3)
    with pytest.raises(TensorParallelError, match=r"--tp 8 does not divide heads = 4"):
        shard(0, 8)


#: The toy's declarations, as a family gives them to lollm.load.build.build_model.
LAYOUT = WeightLayout(name_maps={"safetensors": lambda n: n}, tp_plan=PLAN, quantizable=r"q\.weight|up\.weight")


def options(group=None, quantization=Quantization("float")) -> LoadOptions:
    """Resolved LoadOptions on the CPU: what open_model hands a family's load."""
    return LoadOptions(device="cpu", dtype="float32", tp=1 if group is None else group.world,
                       quantization=quantization, tensor_parallel=group)


def test_packed_weights_are_refused():
    group = Group(rank=0, world=2, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(TensorParallelError, match=r"--tp runs float weights; use --weights float"):
        build_model(Toy, ToyConfig(), DictSource(toy_weights()), "safetensors", options(group, Quantization("int8", 32)), LAYOUT)


def test_build_model_takes_the_group_from_the_options():
    """The tensor-parallel setting reaches the build only through LoadOptions.tensor_parallel."""
    full = toy_weights()
    whole = build_model(Toy, ToyConfig(), DictSource(full), "safetensors", options(), LAYOUT)
    assert getattr(whole, "tensor_parallel", None) is None and whole.config.heads == 4
    assert torch.equal(whole.q.weight, full["q.weight"])
    group = Group(rank=1, world=2, backend="gloo", device=torch.device("cpu"))
    share = build_model(Toy, ToyConfig(), DictSource(full), "safetensors", options(group), LAYOUT)
    assert share.tensor_parallel.group is group and share.config.heads == 2
    assert torch.equal(share.q.weight, full["q.weight"][4:8])  # rank 1's two heads of two rows


def test_a_plan_of_unknown_specs_is_refused():
    group = Group(rank=0, world=2, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(TensorParallelError, match=r"TP_PLAN\['q'\] is 'colwise'"):
        Sharding({"q": "colwise"}, ToyConfig(), group)


# -- the collectives, in 2 gloo processes ------------------------------------------------
def _rank_main(rank: int, world: int, store: str, ids: torch.Tensor, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    _, model = shard(rank, world)
    with torch.inference_mode():
        logits = model(ids)
    if rank == 0:
        torch.save(logits, out)
    # both ranks leave together: a rank that tears down gloo while its peer is still inside a collective
    # can make both abort at exit ("terminate called without an active exception", seen once in CI)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.serial  # two processes want both cores: nox runs it alone, after the parallel pass
def test_toy_forward_over_gloo_equals_one_process(tmp_path):
    """Two processes (4 would cost a minute of imports on a 2-core CI; qwen2's test runs 4 under torchrun)."""
    import torch.multiprocessing as mp

    world = 2
    ids = torch.tensor([0, 3, 5, 6, 10, 7])  # ids on both sides of every vocabulary boundary
    torch.manual_seed(0)
    ref = Toy(ToyConfig())
    ref.load_state_dict(toy_weights())
    with torch.inference_mode():
        expected = ref(ids)
    out = tmp_path / "logits.pt"
    mp.spawn(_rank_main, args=(world, str(tmp_path / "store"), ids, str(out)), nprocs=world, join=True)
    got = torch.load(out)
    assert got.shape == expected.shape == (6, 11)
    assert (got - expected).abs().max().item() <= 1e-6
