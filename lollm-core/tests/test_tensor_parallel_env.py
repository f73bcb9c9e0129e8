"""An inconsistent torchrun environment fails at once, and every rendezvous is bounded (issue 22, class 7).

* RANK >= WORLD_SIZE, negative or non-numeric values, LOCAL_RANK missing or out of
  range, a port that is no port: one error naming the variables, before anything
  connects (a rank outside the world used to wait 30 minutes for peers that never come);
* ``$LOLLM_TP_RENDEZVOUS_TIMEOUT`` / ``$LOLLM_TP_TIMEOUT``: a number of seconds in
  (0, 30 days]; anything else is an error naming the variable;
* a rank whose peers never come gives up after the rendezvous timeout, with one
  error naming the address and the variable; two ranks that do come meet and all-reduce.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from _core_helpers import child_env
from lollm.load.tensor_parallel import TensorParallelError, check_launch

ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


@pytest.mark.parametrize("changes, needle", [
    ({"RANK": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "7", "LOCAL_RANK": "1"}, "RANK=7 is not below WORLD_SIZE=2"),
    ({"RANK": "-1"}, "RANK='-1' is not a whole number"),
    ({"WORLD_SIZE": "-2"}, "WORLD_SIZE='-2' is not a whole number"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not a whole number"),
    ({"LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not a whole number"),
    ({"RANK": "1", "LOCAL_RANK": "2"}, "LOCAL_RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "LOCAL_RANK=1 is not below LOCAL_WORLD_SIZE=1"),
    ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 is not between 1 and WORLD_SIZE=2"),
    ({"LOCAL_RANK": "1"}, "LOCAL_RANK=1 is above RANK=0"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0 is not a TCP port"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not a whole number"),
    ({"MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ({"RANK": "1" * 40}, "is not a whole number from 0 to 999999999"),
])
def test_an_inconsistent_environment_names_the_variables(changes, needle):
    with pytest.raises(TensorParallelError) as info:
        check_launch(2, environ={**ENV, **changes})
    message = str(info.value)
    assert needle in message and message.startswith("--tp 2: "), message
    assert "\n" not in message


def test_a_missing_local_rank_is_named():
    env = {k: v for k, v in ENV.items() if k != "LOCAL_RANK"}
    with pytest.raises(TensorParallelError, match=r"this process has no LOCAL_RANK in its environment"):
        check_launch(2, environ=env)


def test_a_consistent_environment_passes():
    check_launch(2, environ={**ENV, "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    check_launch(4, environ={**ENV, "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})


@pytest.mark.parametrize("variable", ["LOLLM_TP_RENDEZVOUS_TIMEOUT", "LOLLM_TP_TIMEOUT"])
@pytest.mark.parametrize("value", ["1e309", "inf", "nan", "0", "-5", "soon", "2592001"])
def test_a_timeout_out_of_bounds_names_the_variable(variable, value):
    with pytest.raises(TensorParallelError, match=rf"{variable} must be"):
        check_launch(2, environ={**ENV, variable: value})


def test_cli_refuses_a_rank_outside_the_world_in_one_line():
    env = child_env(**{**ENV, "RANK": "3", "LOCAL_RANK": "1"})
    done = subprocess.run([sys.executable, "-m", "lollm", "run", "no-such-model", "--tp", "2", "-p", "hi"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --tp 2: torchrun's environment is inconsistent: "
                                                   "RANK=3 is not below WORLD_SIZE=2"), lines


# -- the rendezvous, in child processes ---------------------------------------------------------

JOIN = """
import json, sys, torch
from lollm.errors import LollmError
from lollm.load.tensor_parallel import init, shutdown
try:
    group = init(2, torch.device("cpu"))
except LollmError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
x = torch.tensor([float(group.rank + 1)])
group.all_reduce(x)
print(json.dumps({"rank": group.rank, "sum": x.item()}))
shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, port: int, **extra: str) -> dict[str, str]:
    env = child_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    return env


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_whose_peer_never_comes_gives_up_after_the_rendezvous_timeout(rank):
    """Rank 0 hosts the store and waits for rank 1; rank 1 looks for rank 0's store. Neither comes.

    The child's limit (120 s) is a hang guard far above the 2 s asked for; torch's
    default would wait 30 minutes.
    """
    port = free_port()
    done = subprocess.run([sys.executable, "-c", JOIN], capture_output=True, text=True, timeout=120,
                          env=rank_env(rank, port, LOLLM_TP_RENDEZVOUS_TIMEOUT="2"))
    assert done.returncode == 0, done.stderr
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert f"--tp 2: rank {rank} did not meet all 2 ranks at 127.0.0.1:{port} within 2 s " \
           f"(LOLLM_TP_RENDEZVOUS_TIMEOUT)" in error, error


@pytest.mark.serial  # two processes want both cores
def test_two_ranks_that_come_meet_and_all_reduce():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", JOIN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=rank_env(rank, port, LOLLM_TP_RENDEZVOUS_TIMEOUT="120")) for rank in (0, 1)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["rank"] for r in results) == [0, 1] and all(r["sum"] == 3.0 for r in results), results
