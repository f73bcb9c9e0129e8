"""The tensor-parallel process group: checking torchrun's launch, joining the group, leaving it.

:mod:`lollm.load.tensor_parallel` says how a family's plan splits a model; this module is the
plumbing every rank runs first (docs/tensor-parallel.md): the environment torchrun sets is
checked, the rank joins one ``torch.distributed`` process group with a bounded rendezvous, and
:func:`current` says where this process stands.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from lollm.errors import LollmError
from lollm.load.checks import seconds_from_env

# Lazy imports below: torch.distributed, imported only where a rank joins or leaves a group
# (it is absent from some torch builds, and a single-process run never needs it).

#: The environment torchrun sets for every process it starts.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class TensorParallelError(LollmError):
    """``--tp`` cannot run as asked: no torchrun environment, a wrong world size, a missing backend, an uneven split."""


# ---------------------------------------------------------------------------
# The process group
# ---------------------------------------------------------------------------
@dataclass
class Group:
    """This process's place in the tensor-parallel group.

    rank, world: ``torch.distributed``'s rank and world size (= ``--tp``);
    backend: ``"nccl"`` or ``"gloo"``; device: where this rank computes (on one
    GPU shared by N processes, all of them use it). ``comm_seconds`` and
    ``comm_calls`` count the time spent in collectives when ``timing`` is on
    (the benchmark turns it on; CUDA collectives are synchronised to be timed).
    """

    rank: int
    world: int
    backend: str
    device: torch.device
    timing: bool = False
    comm_seconds: float = 0.0
    comm_calls: int = 0

    def _timed(self, fn, *args):
        if not self.timing:
            return fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        out = fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.comm_seconds += time.perf_counter() - start
        self.comm_calls += 1
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank gets the same sum. Returns ``x``."""
        import torch.distributed as dist

        self._timed(dist.all_reduce, x)
        return x

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``x`` (…, sizes[rank]) along the last dim: (…, sum(sizes))."""
        import torch.distributed as dist

        width = max(sizes)
        if x.shape[-1] < width:  # all_gather takes equal shapes: pad the short ranges
            x = F.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._timed(dist.all_gather, parts, x.contiguous())
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


_group: Group | None = None


def current() -> Group | None:
    """The group :func:`init` joined, or None (one process)."""
    return _group


#: Seconds each rank waits for all the others to join the group (the rendezvous);
#: ``$LOLLM_TP_RENDEZVOUS_TIMEOUT`` overrides it. torchrun starts the ranks together,
#: so they join within the seconds it takes to import torch; five minutes leaves room
#: for a cold disk or a loaded machine, and bounds the wait for a rank that never comes.
RENDEZVOUS_TIMEOUT_SECONDS = 300.0
RENDEZVOUS_TIMEOUT_ENV = "LOLLM_TP_RENDEZVOUS_TIMEOUT"
#: Seconds a collective (all-reduce, broadcast, barrier) waits for the other ranks;
#: ``$LOLLM_TP_TIMEOUT`` overrides it. torch's own default, 30 minutes, written out:
#: between two collectives a rank may load its shard of a large model, or (parity)
#: wait while rank 0 builds the whole reference.
COLLECTIVE_TIMEOUT_SECONDS = 1800.0
COLLECTIVE_TIMEOUT_ENV = "LOLLM_TP_TIMEOUT"
#: The largest timeout either variable accepts: 30 days.
MAX_TIMEOUT_SECONDS = 30 * 24 * 3600.0


def env_seconds(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """The timeout in seconds held by the variable ``name`` (``default`` when unset or empty).

    Raises TensorParallelError naming the variable for text that is not a
    number, and for a number outside (0, :data:`MAX_TIMEOUT_SECONDS`] (``nan``,
    ``inf``, zero and negative values included).
    """
    return seconds_from_env(name, default, MAX_TIMEOUT_SECONDS, error=TensorParallelError, environ=environ)


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for the CPU (``LOLLM_TP_BACKEND`` overrides)."""
    return os.environ.get("LOLLM_TP_BACKEND") or ("nccl" if device.type == "cuda" else "gloo")


def check_launch(tp: int, environ: Mapping[str, str] | None = None, command: str = "run") -> None:
    """Check ``--tp tp`` against torchrun's environment; raises TensorParallelError naming what is wrong.

    ``tp`` < 1; above 1, a missing torchrun variable (:data:`TORCHRUN_ENV`), a
    ``WORLD_SIZE`` other than ``tp``, a value that is not a whole number >= 0
    (negative ones included), and an inconsistent set: ``RANK`` >= ``WORLD_SIZE``,
    ``LOCAL_RANK`` >= ``LOCAL_WORLD_SIZE`` (or ``WORLD_SIZE`` when torchrun's
    ``LOCAL_WORLD_SIZE`` is absent) or above ``RANK``, ``MASTER_PORT`` outside
    1..65535, an empty ``MASTER_ADDR``. ``command``: the lollm command the error's
    example launch line names (``run``, ``parity``, ``bench``).
    """
    env = os.environ if environ is None else environ
    if tp < 1:
        raise TensorParallelError(f"--tp {tp}: give the number of processes, 1 or more")
    if tp == 1:
        return
    missing = [name for name in TORCHRUN_ENV if name not in env]
    if missing:
        raise TensorParallelError(
            f"--tp {tp} runs one process per shard, started by torchrun: "
            f"`torchrun --nproc-per-node {tp} -m lollm {command} --tp {tp} …` "
            f"(this process has no {', '.join(missing)} in its environment)"
        )
    numbers = _launch_numbers(tp, env)
    world = numbers["WORLD_SIZE"]
    if world != tp:
        raise TensorParallelError(f"--tp {tp} but torchrun started {world} processes (WORLD_SIZE): give --nproc-per-node {tp}")
    _check_ranks(tp, numbers)
    env_seconds(RENDEZVOUS_TIMEOUT_ENV, RENDEZVOUS_TIMEOUT_SECONDS, env)
    env_seconds(COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_SECONDS, env)


#: torchrun's variables that hold whole numbers (LOCAL_WORLD_SIZE: set by torchrun, optional here).
_NUMERIC_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def _launch_numbers(tp: int, env: Mapping[str, str]) -> dict[str, int]:
    """torchrun's numeric variables as ints; raises TensorParallelError naming one that is not a whole number >= 0."""
    numbers: dict[str, int] = {}
    for name in _NUMERIC_ENV:
        if name not in env:
            continue
        text = env[name].strip()
        if not text.isascii() or not text.isdigit() or len(text) > 9:
            raise TensorParallelError(f"--tp {tp}: {name}={env[name]!r} is not a whole number from 0 to 999999999 "
                                      f"(torchrun sets it; start the processes with torchrun)")
        numbers[name] = int(text)
    if not env["MASTER_ADDR"].strip():
        raise TensorParallelError(f"--tp {tp}: MASTER_ADDR is empty (torchrun sets it to rank 0's host)")
    return numbers


def _check_ranks(tp: int, n: dict[str, int]) -> None:
    """RANK, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_PORT consistent with WORLD_SIZE; TensorParallelError naming them otherwise.

    A rank outside the world would wait for a process group it can never
    complete, so it is refused before anything connects.
    """
    world, rank, local = n["WORLD_SIZE"], n["RANK"], n["LOCAL_RANK"]
    local_world = n.get("LOCAL_WORLD_SIZE", world)
    bad = None
    if rank >= world:
        bad = f"RANK={rank} is not below WORLD_SIZE={world} (the ranks are 0 to {world - 1})"
    elif local_world < 1 or local_world > world:
        bad = f"LOCAL_WORLD_SIZE={local_world} is not between 1 and WORLD_SIZE={world}"
    elif local >= local_world:
        bad = (f"LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_world}" if "LOCAL_WORLD_SIZE" in n
               else f"LOCAL_RANK={local} is not below WORLD_SIZE={world}")
    elif local > rank:
        bad = f"LOCAL_RANK={local} is above RANK={rank} (a process's rank on its machine is at most its rank overall)"
    elif not 1 <= n["MASTER_PORT"] <= 65535:
        bad = f"MASTER_PORT={n['MASTER_PORT']} is not a TCP port (1 to 65535)"
    if bad:
        raise TensorParallelError(f"--tp {tp}: torchrun's environment is inconsistent: {bad}; start the processes "
                                  f"with `torchrun --nproc-per-node {tp} -m lollm …` rather than setting these by hand")


def init(tp: int, device: torch.device, environ: Mapping[str, str] | None = None,
         timeout: float | None = None) -> Group | None:
    """Join the torchrun process group for ``--tp tp``; None when ``tp`` is 1.

    device: the device the command asked for; on CUDA each rank takes GPU
    ``LOCAL_RANK % device_count`` (so N processes share one GPU when only one
    exists). Returns the :class:`Group` (also kept for :func:`current`).

    Raises TensorParallelError for what :func:`check_launch` refuses (missing
    or inconsistent torchrun variables, a bad timeout variable), when torch has
    no such backend (``torch.distributed.is_backend_available``), and when the
    other ranks do not all join within the rendezvous timeout
    (``$LOLLM_TP_RENDEZVOUS_TIMEOUT``, default :data:`RENDEZVOUS_TIMEOUT_SECONDS`).
    ``timeout``: seconds a collective (all-reduce, broadcast, barrier) may wait
    for the other ranks (None: ``$LOLLM_TP_TIMEOUT``, default
    :data:`COLLECTIVE_TIMEOUT_SECONDS`; ``lollm serve --tp`` waits for requests far longer).
    """
    global _group
    env = os.environ if environ is None else environ
    check_launch(tp, env)
    if tp == 1:
        return None
    if _group is not None:
        return _group
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    rendezvous = env_seconds(RENDEZVOUS_TIMEOUT_ENV, RENDEZVOUS_TIMEOUT_SECONDS, env)
    collective = env_seconds(COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_SECONDS, env) if timeout is None else timeout
    import torch.distributed as dist

    backend = backend_for(device)
    if not dist.is_available() or not dist.is_backend_available(backend):
        raise TensorParallelError(
            f"--tp {tp} on {device.type}: this torch build has no {backend!r} backend for torch.distributed "
            f"(nccl needs a CUDA build of torch, gloo ships with every build)"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TensorParallelError(f"--tp {tp} on {device}: no CUDA device is available")
        device = torch.device("cuda", int(env["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store = _rendezvous(dist, rank, world, rendezvous, env)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective))
        # later store reads (NCCL's lazy communicator set-up at the first collective) wait like a collective
        store.set_timeout(datetime.timedelta(seconds=collective))
    _group = Group(rank=dist.get_rank(), world=world, backend=backend, device=device)
    return _group


def _rendezvous(dist: Any, rank: int, world: int, seconds: float, env: Mapping[str, str]) -> Any:
    """Meet the other ranks through torchrun's store within ``seconds``; return the store for the process group.

    ``torch.distributed.rendezvous("env://")`` connects to (or, on rank 0
    without torchrun's agent, hosts) the TCP store at MASTER_ADDR:MASTER_PORT;
    then every rank sets its key and waits for all ``world`` keys, so a rank
    that never comes (a process that died, a wrong WORLD_SIZE on one machine)
    ends the wait after ``seconds`` instead of the collective timeout. The
    keys carry torchrun's restart count, so a restarted group does not see
    the keys of the attempt before. Raises TensorParallelError naming the
    address, the time and ``$LOLLM_TP_RENDEZVOUS_TIMEOUT``.
    """
    wait = datetime.timedelta(seconds=seconds)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=wait))
        store.set(f"lollm/tp/{attempt}/joined/{rank}", "1")
        store.wait([f"lollm/tp/{attempt}/joined/{r}" for r in range(world)], wait)
    except (RuntimeError, TimeoutError, ValueError, OSError) as exc:  # torch's DistError is a RuntimeError
        why = " ".join(str(exc).split())[:300]
        raise TensorParallelError(
            f"--tp {world}: rank {rank} did not meet all {world} ranks at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')} "
            f"within {seconds:g} s ({RENDEZVOUS_TIMEOUT_ENV}): {type(exc).__name__}: {why}"
        ) from None
    return store


def shutdown() -> None:
    """Leave the process group (at the end of a command)."""
    global _group
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _group = None
