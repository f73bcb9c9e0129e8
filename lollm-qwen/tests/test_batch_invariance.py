"""Batch invariance on the real Qwen2.5-Coder-0.5B-Instruct GGUF, on every CPU route this machine can run.

8 and then 16 greedy requests of mixed prompt lengths, some arriving mid-decode, through one engine:
every logit each request samples from equals, bit for bit, the logit it samples from alone
(lollm.testing.invariance). Each route runs in a process of its own, because lollm.native picks the
route once per process: the default (AMX tiles where the CPU lends them), the AVX-512 VNNI loops
(``LOLLM_AMX=0``), and the AVX2 build (``LOLLM_ISA=avx2``); where the CPU has no AMX the default
route is the VNNI loops, run once (lollm.testing.invariance.cpu_routes). The portable build is checked on small
matrices in lollm-core's tests: on a 0.5B model it would take minutes.
"""

from __future__ import annotations

import pytest

from lollm.cli.real_models import fetch_gguf
from lollm.testing.invariance import cpu_routes, run_route

#: default, vnni and avx2, each once: without AMX tiles the default route is the VNNI loops (cpu_routes)
ROUTES = cpu_routes()


@pytest.mark.real
@pytest.mark.parametrize("route", list(ROUTES))
def test_real_gguf_logits_equal_alone_and_batched(route):
    done = run_route(str(fetch_gguf("qwen2.5-coder-0.5b-instruct")), ROUTES[route])
    assert done.returncode == 0, f"route {route}:\n{done.stdout}\n{done.stderr[-3000:]}"
    assert "16 requests: every logit equal" in done.stdout, done.stdout
