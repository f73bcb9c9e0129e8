"""Decode speed by torch thread count, on the machine as it is and with a busy-loop load beside it.

For one GGUF (default: the real Qwen2.5-Coder-0.5B, packed weights), in rounds that
alternate the condition (as is / busy) and, inside each, the thread count
(1, 2, ..., the cores allowed, and lollm's default of :mod:`lollm.load.threads`), this
prints decode tokens/s; then, per condition, the median of each count and the
default's ratio to the best fixed count. "busy" starts one busy-loop process per
allowed core (``while True: pass``) for the measurement, and stops it after.

The OpenMP wait policy is read by the OpenMP runtime when it starts, so each
policy runs in its own child process (``OMP_WAIT_POLICY`` unset, then PASSIVE).

    python lollm-core/benchmarks/bench_threads.py [--model PATH] [--rounds 3] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BUSY_LOOP = "while True: pass"


def start_busy(n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    time.sleep(0.3)  # let them reach the run queue
    return procs


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def worker(path: str, rounds: int, new_tokens: int) -> dict:
    """In this process (one OpenMP policy): every condition and thread count, alternating; tok/s per round."""
    import torch

    from lollm.proof.bench import prompt_ids
    from lollm.generate.loop import generate
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams
    from lollm.load.threads import allowed_cores, choose_threads

    loaded = open_model(path, LoadOptions(device="cpu", dtype="float32", weights="quantized"))
    ids = prompt_ids(loaded.tokenizer, 64)
    greedy = SamplingParams(temperature=0.0)
    allowed = allowed_cores()
    counts = list(range(1, allowed + 1))
    figures: dict[str, dict[str, list[float]]] = {c: {} for c in ("as is", "busy")}
    chosen: dict[str, list[int]] = {c: [] for c in figures}
    loads: dict[str, list[float]] = {c: [] for c in figures}

    def decode(threads: int) -> float:
        torch.set_num_threads(threads)
        r = generate(loaded.model, ids, max_new_tokens=new_tokens + 1, sampling=greedy, attn=loaded.attn)
        return r.decode_tokens_per_second

    decode(allowed)  # warm-up
    for _ in range(rounds):
        for condition in figures:
            busy = start_busy(allowed) if condition == "busy" else []
            try:
                loads[condition].append(os.getloadavg()[0])
                for name in [str(c) for c in counts] + ["default"]:
                    if name == "default":
                        choice = choose_threads()
                        chosen[condition].append(choice.threads)
                        threads = choice.threads
                    else:
                        threads = int(name)
                    figures[condition].setdefault(name, []).append(decode(threads))
            finally:
                stop_busy(busy)
    return {"figures": figures, "chosen": chosen, "loads": loads, "allowed": allowed}


def report(policy: str, r: dict) -> None:
    print(f"\nOMP_WAIT_POLICY={policy} ({r['allowed']} cores allowed): decode tok/s per round, median")
    for condition, by_threads in r["figures"].items():
        loads = ", ".join(f"{x:.1f}" for x in r["loads"][condition])
        print(f"  {condition} (load average at each round: {loads}; default chose {r['chosen'][condition]} threads)")
        medians = {name: statistics.median(v) for name, v in by_threads.items()}
        for name, values in by_threads.items():
            rounds = " ".join(f"{v:.2f}" for v in values)
            print(f"    threads {name:>7}: {medians[name]:6.2f}   ({rounds})")
        best = max((m, n) for n, m in medians.items() if n != "default")
        print(f"    default / best fixed ({best[1]} threads): {medians['default'] / best[0]:.2f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="A GGUF (default: the real Qwen2.5-Coder-0.5B)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--policies", default="default,PASSIVE", help="OMP_WAIT_POLICY values to run (default: unset)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from lollm.cli.real_models import fetch_gguf

        args.model = str(fetch_gguf("qwen2.5-coder-0.5b-instruct"))
    if args.worker:
        print(json.dumps(worker(args.model, args.rounds, args.new_tokens)))
        return
    print(f"bench_threads: {args.model}, {args.rounds} rounds, {args.new_tokens} decode tokens per measurement")
    for policy in args.policies.split(","):
        env = dict(os.environ)
        env.pop("OMP_WAIT_POLICY", None)
        if policy != "default":
            env["OMP_WAIT_POLICY"] = policy
        cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--rounds", str(args.rounds),
               "--new-tokens", str(args.new_tokens)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"worker for OMP_WAIT_POLICY={policy} failed:\n{done.stderr[-2000:]}")
        report(policy, json.loads(done.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
