"""lollm.load.threads: the default thread count is the free cores, read from the affinity mask and the run queue."""

from __future__ import annotations

import io

import pytest

from lollm.load import threads
@pytest.fixture
def machine(monkeypatch):
    """``machine(cores, runnable...)``: a process allowed ``cores`` cores, /proc/loadavg reading each count in turn."""

    def make(cores: int, *runnable: int):
        readings = iter(runnable)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the test runner sets it for its workers
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        monkeypatch.setattr(threads.time, "sleep", lambda s: None)

        def fake_open(path, *a, **k):
            assert path == "/proc/loadavg"
            return io.StringIO(f"1.00 1.00 1.00 {next(readings)}/200 12345\n")

        monkeypatch.setattr("builtins.open", fake_open)

    return make


def test_an_idle_machine_gets_every_allowed_core(machine):
    machine(4, 1, 1, 1, 1, 1)  # only the reader itself runs
    choice = threads.choose_threads()
    assert (choice.threads, choice.allowed, choice.others) == (4, 4, 0) and choice.note is None


def test_busy_cores_are_left_out_and_said_in_one_line(machine):
    machine(2, 3, 2, 4, 2, 3)  # the fewest readings: 2 runnable, the reader and one other
    choice = threads.choose_threads()
    assert (choice.threads, choice.others) == (1, 1)
    assert choice.note == ("note: the machine is busy (1 other runnable thread on 2 cores): computing with 1 thread "
                           "(--threads N to choose)")


def test_never_fewer_than_one_thread_and_a_given_count_wins(machine):
    machine(2, 9, 9, 9, 9, 9)
    assert threads.choose_threads().threads == 1
    given = threads.choose_threads(3)
    assert (given.threads, given.given, given.note) == (3, True, None)


def test_without_proc_loadavg_every_allowed_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)

    def missing(*a, **k):
        raise FileNotFoundError("/proc/loadavg")

    monkeypatch.setattr("builtins.open", missing)
    choice = threads.choose_threads()
    assert (choice.threads, choice.others, choice.note) == (3, None, None)


@pytest.mark.parametrize("value, expected", [("1", 1), ("3", 3), ("", None), ("0", None), ("two", None)])
def test_omp_num_threads_set_by_the_user_is_the_choice(monkeypatch, machine, value, expected):
    machine(4, 1, 1, 1, 1, 1)  # an idle 4-core machine: the default would be 4
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    choice = threads.choose_threads()
    assert choice.threads == (4 if expected is None else expected)
    assert choice.given == (expected is not None) and choice.note is None


@pytest.mark.parametrize("policy, expected", [("PASSIVE", 2), (" passive ", 2), ("ACTIVE", 1), ("", 1)])
def test_a_passive_wait_policy_keeps_every_core_on_a_busy_machine(monkeypatch, machine, policy, expected):
    """Sleeping waiters do not collapse on a busy core (measured: 2 threads beat 1 there), so the busy
    rule only applies while OpenMP's threads spin."""
    machine(2, 2, 2, 2, 2, 2)  # the reader and one other runnable thread on 2 cores
    monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    choice = threads.choose_threads()
    assert (choice.threads, choice.others) == (expected, 1)
    assert (choice.note is None) == (expected == 2)
