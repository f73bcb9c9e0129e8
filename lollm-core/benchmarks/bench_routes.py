"""The issue's speed goals on every CPU route: prefill and decode against llama.cpp, 16 requests at once, prompt lookup.

lollm's native kernel picks its route once per process (lollm.native: the AMX tiles where the CPU
lends them; ``LOLLM_AMX=0`` the AVX-512 VNNI loops; ``LOLLM_ISA=avx2`` the AVX2 build). Most users'
CPUs have no AMX, so every figure is reported per route. For each route, in a process of its own,
this runs:

1. ``lollm bench FILE`` with llama.cpp beside it (rounds alternating A B A B, 2 threads each):
   prefill tok/s on a 512-token prompt and decode tok/s over 64 tokens, and their ratios;
2. ``lollm bench FILE --concurrency 1,16``: output tok/s of the batched engine with 1 and with 16
   requests submitted at once (prompt 128, 64 new tokens), the batching factor;
3. ``bench_speculative.py --gguf FILE``: prompt-lookup decode on a code edit against lollm's and
   llama.cpp's plain decode, alternating.

llama.cpp runs through llama-cpp-python where it is importable (``nox -s bench_routes`` installs it;
a llama.cpp built elsewhere serves through ``PYTHONPATH`` = its python package and
``LLAMA_CPP_LIB_PATH`` = its ``build/bin``). Usage::

    python lollm-core/benchmarks/bench_routes.py FILE.gguf [--routes default,vnni,avx2] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROUTES = {"default": {}, "vnni": {"LOLLM_AMX": "0"}, "avx2": {"LOLLM_ISA": "avx2"}, "portable": {"LOLLM_ISA": "portable"}}
HERE = Path(__file__).parent


def run(title: str, command: list[str], env: dict[str, str]) -> None:
    """Run ``command`` with ``env`` added, its output shown as it comes."""
    print(f"\n## {title}\n$ {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(command)}", flush=True)
    done = subprocess.run(command, env={**os.environ, **env})
    if done.returncode:
        print(f"(exit status {done.returncode})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--routes", default="default,vnni,avx2", help=f"comma-separated, of {', '.join(ROUTES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: bench, concurrency, lookup")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    lollm = [sys.executable, "-m", "lollm"]
    for route in args.routes.split(","):
        env = ROUTES[route]
        print(f"\n# route {route}", flush=True)
        common = ["--no-reference", "--threads", str(args.threads), "--rounds", str(args.rounds)]
        if "bench" not in skip:
            run("prefill 512 and decode 64, beside llama.cpp", [*lollm, "bench", args.gguf, *common], env)
        if "concurrency" not in skip:
            run("16 requests at once", [*lollm, "bench", args.gguf, *common, "--no-llama-cpp", "--concurrency", "1,16",
                                        "--prompt-tokens", "128", "--new-tokens", "64"], env)
        if "lookup" not in skip:
            run("prompt lookup on a code edit", [sys.executable, str(HERE / "bench_speculative.py"), "--gguf", args.gguf,
                                                 "--prompts", "code edit", "--draft-tokens", "6", "--rounds", str(args.rounds),
                                                 "--threads", str(args.threads)], env)


if __name__ == "__main__":
    main()
