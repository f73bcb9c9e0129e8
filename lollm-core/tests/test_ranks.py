"""lollm.load.ranks: the protocol that keeps tensor-parallel ranks in step, on one process and over 2 gloo processes."""

from __future__ import annotations

import json

import pytest
import torch

from lollm.load import ranks
from lollm.errors import LollmError


def test_one_process_needs_no_protocol():
    assert ranks.is_leader(None)
    assert ranks.broadcast(None, {"job": 1}) == {"job": 1}
    assert ranks.leader_decides(None, lambda: 7) == 7
    assert ranks.agree(None, True) is True and ranks.agree(None, False) is False
    handled = []
    ranks.follow(None, handled.append)  # nothing to follow: returns at once
    assert handled == []
    ranks.finish(None)


def _rank_main(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from lollm.load.tensor_parallel import Group

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = Group(rank=rank, world=world, backend="gloo", device=torch.device("cpu"))
    handled: list = []
    if ranks.is_leader(group):  # the leader sends each job, then runs it itself; None ends the followers' loop
        for job in (["a", 1], ["b", 2]):
            ranks.broadcast(group, job)
            handled.append(job)
        ranks.broadcast(group, None)
    else:
        ranks.follow(group, handled.append)
    # the leader's flags win: a follower that says True hears the leader's False
    flags = [ranks.agree(group, i == 1 if rank == 0 else True) for i in range(3)]
    try:
        ranks.leader_decides(group, lambda: (_ for _ in ()).throw(LollmError("the leader's own words")))
        error = None
    except LollmError as exc:
        error = str(exc)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"handled": handled, "flags": flags, "error": error}, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.serial  # two processes want both cores: nox runs it alone, after the parallel pass
def test_follow_agree_and_leader_decides_over_gloo(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "seen")
    mp.spawn(_rank_main, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True)
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            seen = json.load(f)
        assert seen["handled"] == [["a", 1], ["b", 2]]
        assert seen["flags"] == [False, True, False]
        assert seen["error"] == "the leader's own words"  # raised on every rank, with the leader's message
