"""The protocol that keeps tensor-parallel ranks in step, written once for every command.

Under ``--tp N`` torchrun starts N copies of the same command (docs/tensor-parallel.md).
Every rank runs the model's forward (each holds its share of the weights and the
collectives meet inside the forward), but only rank 0, the *leader*, talks to the
user. Four rules keep the copies in step, and ``run``, ``serve``, ``parity`` and
``bench`` all follow them through this module:

1. :func:`silence_followers`: ranks other than 0 print nothing (stdout to /dev/null,
   stderr errors only), so the user reads one copy of the output.
2. :func:`leader_decides`: work only the leader can do (read the prompt from a user,
   build the transformers reference, accept an HTTP request) runs on rank 0, and
   its result, or its error, is broadcast; every rank then goes on with the same value.
   A server decides again and again: the leader broadcasts each job, the followers
   run them in :func:`follow` until it broadcasts None; and before each generation
   step :func:`agree` gives every rank the leader's cancel flag, so all stop at the
   same token.
3. Every rank makes the same sequence of forward calls: generation is greedy or
   seeded identically on every rank, so the tokens agree without being sent.
4. :func:`finish`: before any rank exits, all meet at a barrier (rank 0 has
   printed), then leave the group; torchrun stops the others as soon as one exits
   with an error, so the leader must be done first. Drop the model (and the
   tensors the collectives produced) before calling it: under gloo, a model freed
   after the group was destroyed aborted a rank at exit ("terminate called without
   an active exception") in about one run in four of the gemma tensor-parallel
   tests; freed first, 0 in 8 (measured on this 2-core CPU).

On one process (``group is None``) every function here is a no-op or a plain call.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from lollm.errors import LollmError

# Lazy imports below: torch and torch.distributed (and tensor_parallel, which imports torch), only on
# the ranks of a --tp run, so that the CLI imports this module torch-free.
if TYPE_CHECKING:  # pragma: no cover - names for the annotations only
    from rich.console import Console

    from lollm.load.process_group import Group

T = TypeVar("T")


def is_leader(group: Group | None) -> bool:
    """Whether this process talks to the user: rank 0, or the only process (``group is None``)."""
    return group is None or group.rank == 0


def silence_followers(group: Group | None, console: Console | None = None) -> None:
    """Rule 1: on ranks other than 0, stdout goes to /dev/null and ``console`` (a rich Console) goes quiet."""
    if is_leader(group):
        return
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if console is not None:
        console.quiet = True


def broadcast(group: Group | None, value: object = None) -> Any:
    """The leader's ``value`` on every rank (``torch.distributed.broadcast_object_list``); others pass anything."""
    if group is None:
        return value
    import torch.distributed as dist

    message = [value if group.rank == 0 else None]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def leader_decides(group: Group | None, work: Callable[[], T]) -> T:
    """Rule 2: ``work()`` on the leader only; its result on every rank.

    A LollmError raised by ``work`` on the leader is sent instead and raised on every
    rank with the leader's message, so all ranks fail alike instead of waiting forever.
    """
    if group is None:
        return work()
    outcome: tuple[str, Any] | None = None
    if group.rank == 0:
        try:
            outcome = ("value", work())
        except LollmError as exc:  # the other ranks wait in the broadcast: tell them, then fail like them
            outcome = ("error", str(exc))
    kind, value = broadcast(group, outcome)
    if kind == "error":
        raise LollmError(value)
    return value


def follow(group: Group | None, handle: Callable[[Any], None]) -> None:
    """Rule 2 as a loop, on a follower: ``handle(work)`` for each ``work`` the leader broadcasts, until it sends None.

    The leader sends each piece of work with ``broadcast(group, work)`` (before it
    runs the same work itself) and ends the loop with ``broadcast(group, None)``.
    ``handle`` must make the same collective calls as the leader's run of ``work``.
    On one process (``group is None``) it returns at once.
    """
    while (work := broadcast(group, None)) is not None:
        handle(work)


def agree(group: Group | None, flag: bool) -> bool:
    """Rule 2 for one flag, asked often: the leader's ``flag`` on every rank (others pass anything).

    One int32 broadcast (on the group's device under nccl), far cheaper than
    :func:`broadcast` of an object: ``serve`` asks it before every generation step.
    """
    if group is None:
        return flag
    import torch
    import torch.distributed as dist

    value = torch.tensor([int(flag)], dtype=torch.int32, device=group.device if group.backend == "nccl" else "cpu")
    dist.broadcast(value, src=0)
    return bool(value.item())


def finish(group: Group | None) -> None:
    """Rule 4: the end of a ``--tp`` command: every rank meets at a barrier, then leaves the group."""
    if group is None:
        return
    import torch.distributed as dist

    from lollm.load.process_group import shutdown

    sys.stdout.flush()
    dist.barrier()
    shutdown()
