"""How many threads torch computes with: the cores this process may use that are free right now.

A decode step on the CPU is a few hundred small matrix-vector products, each split
over torch's intra-op threads (OpenMP). At the end of each one, every thread waits
for the slowest. On an idle machine that costs little; on a machine where other
processes hold the cores, one of our threads is often descheduled for a whole
time slice (milliseconds) and the others wait for it at every product: the step
gets many times slower than with fewer threads (issue 23 measured decode at 2
threads on 2 busy cores 3-10x slower than at 1).

So the default is the number of cores that are free when the command starts::

    allowed = len(os.sched_getaffinity(0))    the cores this process may run on (taskset, containers)
    others  = runnable threads of other processes right now (/proc/loadavg's 4th field, minus this one)
    threads = max(1, allowed - others)

One exception: with ``OMP_WAIT_POLICY=PASSIVE`` OpenMP's waiting threads sleep
instead of spinning, the collapse does not happen, and every allowed core is used
(measured three times on the busy 2-core machine: 2 threads 1.15-1.32x the decode
of 1; docs/quantized-execution.md, "Threads").

The count of runnable threads is an instant reading (the 1-minute load average
lags by a minute); it is read a few times over a few milliseconds and the smallest
count kept, so a process that only flickers through the run queue does not cost
a core. ``--threads N`` overrides the choice, and so does ``OMP_NUM_THREADS`` when it is set
(a user who pinned it, or a test runner giving each worker one core, has chosen already).

lollm-core/benchmarks/bench_threads.py measures the choice against every fixed
count, on the idle and on a busy machine (docs/quantized-execution.md, "Threads").
"""

from __future__ import annotations

# Lazy imports below: torch, only when the threads are set (choosing them is torch-free, for the CLI).

import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    """The threads chosen and what they were chosen from.

    threads: intra-op threads for torch (>= 1).
    allowed: cores this process may run on.
    others:  runnable threads of other processes seen when choosing (None: not measurable here).
    given:   True when the user named the count (``--threads``).
    """

    threads: int
    allowed: int
    others: int | None
    given: bool = False

    @property
    def note(self) -> str | None:
        """One line for the user when the machine is loaded and fewer threads than cores were chosen, else None."""
        if self.given or self.others is None or self.threads >= self.allowed:
            return None
        return (f"note: the machine is busy ({self.others} other runnable thread{'s' if self.others != 1 else ''} on "
                f"{self.allowed} cores): computing with {self.threads} thread{'s' if self.threads > 1 else ''} "
                f"(--threads N to choose)")


def allowed_cores() -> int:
    """Cores this process may run on: ``os.sched_getaffinity`` where the system has it, else ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def runnable_others(samples: int = 5, interval: float = 0.002) -> int | None:
    """Runnable threads of other processes: the smallest of ``samples`` readings of /proc/loadavg (Linux), minus 1.

    The 4th field of /proc/loadavg, ``R/T``, counts the threads that are running or
    waiting for a core, this one (the reader) included. None where the file is missing.
    """
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]))
        except (OSError, IndexError, ValueError):
            return None
        if i + 1 < samples:
            time.sleep(interval)
    return max(0, min(counts) - 1)


def environment_threads() -> int | None:
    """``OMP_NUM_THREADS`` when it is set to a positive int (the user, or a test runner giving each worker one
    core, chose already), else None. A value that is not a positive int is left to OpenMP and ignored here."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def waits_passively() -> bool:
    """Whether ``OMP_WAIT_POLICY`` is PASSIVE (any case): OpenMP's waiting threads sleep, so a busy core
    no longer makes the others spin through its time slice, and fewer threads would only lose."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def choose_threads(given: int | None = None) -> ThreadChoice:
    """``given`` when the user named it (``--threads``, else ``OMP_NUM_THREADS``), else the free cores:
    ``max(1, allowed_cores() - runnable_others())``; every allowed core under ``OMP_WAIT_POLICY=PASSIVE``."""
    allowed = allowed_cores()
    if given is None:
        given = environment_threads()
    if given is not None:
        return ThreadChoice(given, allowed, None, given=True)
    others = runnable_others()
    threads = allowed if others is None or waits_passively() else max(1, allowed - others)
    return ThreadChoice(threads, allowed, others)


def apply_threads(given: int | None = None) -> ThreadChoice:
    """Choose (:func:`choose_threads`) and set torch's intra-op threads; the choice, whose ``note`` a command prints."""
    import torch

    choice = choose_threads(given)
    torch.set_num_threads(choice.threads)
    return choice
