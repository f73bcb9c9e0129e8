"""Tensor parallel decode: time per step with 1, 2 and 4 processes, and the all-reduce share of it.

    nox -s bench_tp                 # every installed family, small random checkpoints
    python lollm-core/benchmarks/bench_tp.py --families qwen2 --steps 32 --rounds 2

For each family a small random checkpoint (hidden 256, 4 layers, 8 query heads,
4 KV heads, vocabulary 8192) is written once with transformers. Then, in
alternating rounds (1 2 4 1 2 4 …), ``python -m torch.distributed.run`` starts N
gloo processes (N = 1 runs the same worker without torchrun), each loading its
shard; the worker prefills 32 tokens and times ``--steps`` greedy decode steps,
with the collectives timed (:attr:`lollm.load.tensor_parallel.Group.timing`). The
table gives the median per-step time over the rounds and the share of it spent
inside ``all_reduce`` / ``all_gather`` (rank 0; waiting for the slower rank
counts as communication).

On a 2-core CPU the ranks share one memory bus and two cores: no speed-up is
expected, and the figures read as the overhead of splitting (docs/tensor-parallel.md).
Never a timed assert: it prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from lollm.load.options import LoadOptions

SMALL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
         "intermediate_size": 512, "vocab_size": 8192}

#: family -> (hub config, take its text_config, extra overrides)
FAMILIES = {
    "qwen2": ("Qwen__Qwen2.5-0.5B", False, {}),
    "qwen3": ("Qwen__Qwen3-0.6B", False, {"head_dim": 32}),
    "gemma2": ("google__gemma-2-2b-it", False, {"head_dim": 32, "sliding_window": 16}),
    "gemma3": ("google__gemma-3-1b-it", False, {"head_dim": 32, "sliding_window": 16}),
    "gemma4": ("google__gemma-4-E2B-it", True, {"head_dim": 32, "global_head_dim": 64, "num_key_value_heads": 4,
                                                "sliding_window": 16, "num_hidden_layers": 10, "num_kv_shared_layers": 5,
                                                "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 8192}),
    "qwen3_5": ("Qwen__Qwen3.5-0.8B", True, {"head_dim": 32, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                             "linear_key_head_dim": 32, "linear_value_head_dim": 32}),
    "qwen3_5_moe": ("Qwen__Qwen3.5-35B-A3B", True, {"head_dim": 32, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                                    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "num_experts": 16,
                                                    "num_experts_per_tok": 4, "moe_intermediate_size": 128,
                                                    "shared_expert_intermediate_size": 128}),
}


def write_checkpoint(family: str, folder: Path) -> Path:
    from lollm.cli.hub_configs import hub_configs_dir
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    hub, text, overrides = FAMILIES[family]
    raw = json.loads((hub_configs_dir() / hub / "config.json").read_text(encoding="utf-8"))
    if text:
        raw = {**raw["text_config"], "model_type": raw["text_config"]["model_type"]}
        raw.setdefault("tie_word_embeddings", True)
    raw = shrink_config(raw, **{**SMALL, **overrides})
    if family == "qwen3_5_moe":
        raw.pop("intermediate_size", None)
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = raw["layer_types"][: raw["num_hidden_layers"]]
    return write_tiny_checkpoint(raw, folder)


def worker(folder: str, nproc: int, steps: int, out: str) -> None:
    """One measurement: prefill 32 tokens, then ``steps`` timed decode steps; rank 0 writes JSON to ``out``."""
    import torch

    from lollm.load.pipeline import open_model
    from lollm.load.tensor_parallel import shutdown

    torch.manual_seed(0)
    loaded = open_model(folder, LoadOptions(device="cpu", dtype="float32", tp=nproc))
    model, group = loaded.model, loaded.tp
    prompt = torch.randint(0, 8192, (1, 32))
    with torch.inference_mode():
        cache = model.new_cache(32 + steps + 1)
        nxt = int(model(prompt, cache)[0, -1].argmax())
        if group is not None:
            group.timing, group.comm_seconds, group.comm_calls = True, 0.0, 0
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            nxt = int(model(torch.tensor([[nxt]]), cache)[0, -1].argmax())
            times.append(time.perf_counter() - start)
    if group is None or group.rank == 0:
        total = sum(times)
        comm = group.comm_seconds if group is not None else 0.0
        calls = group.comm_calls / steps if group is not None else 0
        Path(out).write_text(json.dumps({"step_ms": 1000 * statistics.median(times), "comm_share": comm / total,
                                         "collectives_per_step": calls}))
    if group is not None:
        shutdown()


def measure(folder: Path, nproc: int, steps: int, threads: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    me = [str(Path(__file__).resolve()), "--worker", str(folder), str(nproc), str(steps), str(out)]
    if nproc == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(29600 + os.getpid() % 300), *me]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    out.unlink()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--worker", nargs=4, metavar=("FOLDER", "N", "STEPS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        folder, n, steps, out = args.worker
        worker(folder, int(n), int(steps), out)
        return

    from importlib.metadata import entry_points

    installed = {ep.name for ep in entry_points(group="lollm.families")}
    procs = [int(p) for p in args.procs.split(",")]
    cache = Path(os.path.expanduser(os.environ.get("LOLLM_CACHE", "~/.cache/lollm"))) / "bench" / "tp"
    print(f"tensor-parallel decode, gloo on CPU ({os.cpu_count()} cores, {args.threads} thread(s) per process), "
          f"{args.steps} steps, {args.rounds} rounds in order {' '.join(map(str, procs))} (medians)")
    print(f"{'family':<12} {'N':>2} {'ms/step':>9} {'vs N=1':>7} {'collective share':>17} {'collectives/step':>17}")
    for family in args.families.split(","):
        dist = {"qwen2": "lollm-qwen", "qwen3": "lollm-qwen", "qwen3_5": "lollm-qwen3_5", "qwen3_5_moe": "lollm-qwen3_5"}
        plugin = dist.get(family, "lollm-gemma")
        if not any(name in installed for name in (family, plugin, plugin.removeprefix("lollm-"))):
            print(f"{family:<12} (not installed: skipped)")
            continue
        folder = cache / family
        if not (folder / "model.safetensors").exists():
            write_checkpoint(family, folder)
        rows: dict[int, list[dict]] = {n: [] for n in procs}
        for _ in range(args.rounds):
            for n in procs:
                rows[n].append(measure(folder, n, args.steps, args.threads))
        base = statistics.median(r["step_ms"] for r in rows[procs[0]])
        for n in procs:
            ms = statistics.median(r["step_ms"] for r in rows[n])
            share = statistics.median(r["comm_share"] for r in rows[n])
            calls = rows[n][0]["collectives_per_step"]
            print(f"{family:<12} {n:>2} {ms:>9.2f} {ms / base:>6.2f}x {100 * share:>16.1f}% {calls:>17.0f}")


if __name__ == "__main__":
    main()
