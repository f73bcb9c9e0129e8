"""Peak resident memory of a generation with the prefill whole and in chunks (lollm.generate.prefill), on a real GGUF.

Each measurement runs in its own child process (an allocator keeps what a previous
run freed, so one process would flatter whichever condition comes second), in
rounds that alternate "whole" (``PREFILL_CHUNK_TOKENS`` set past the prompt) and
"chunked" (the default). A child imports torch and lollm, reads its resident memory
(the start), loads the packed model, then generates 8 tokens after a prompt of N
tokens; it reports the peak resident memory above the start (VmHWM) after the load
and after the generation, and the prefill's speed. Printed: MB and × the file.

    python lollm-core/benchmarks/bench_prefill_memory.py [--model PATH] [--prompt-tokens 512,2048] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def worker(path: str, prompt_tokens: int, whole: bool) -> dict:
    import torch

    import lollm.generate.prefill
    from lollm.proof.bench import peak_bytes, prompt_ids, rss_bytes
    from lollm.generate.loop import generate
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams

    start = rss_bytes()
    loaded = open_model(path, LoadOptions(device="cpu", dtype="float32", weights="quantized"))
    loaded_peak = peak_bytes() - start
    ids = prompt_ids(loaded.tokenizer, prompt_tokens)
    if whole:
        lollm.generate.prefill.PREFILL_CHUNK_TOKENS = len(ids)
    with torch.inference_mode():
        r = generate(loaded.model, ids, max_new_tokens=8, sampling=SamplingParams(temperature=0.0), attn=loaded.attn)
    return {"load_peak": loaded_peak, "peak": peak_bytes() - start, "prefill_tok_s": r.prefill_tokens_per_second,
            "chunk": lollm.generate.prefill.PREFILL_CHUNK_TOKENS, "new_ids": r.new_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF (default: the real Qwen2.5-Coder-0.5B)")
    parser.add_argument("--prompt-tokens", default="512,2048")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from lollm.cli.real_models import fetch_gguf

        args.model = str(fetch_gguf("qwen2.5-coder-0.5b-instruct"))
    if args.worker:
        n, how = args.worker.split(":")
        print(json.dumps(worker(args.model, int(n), how == "whole")))
        return
    file_mb = os.path.getsize(args.model) / 1e6
    print(f"bench_prefill_memory: {args.model} ({file_mb:.0f} MB), {args.rounds} alternating rounds, "
          f"peak resident memory above the process with torch and lollm imported")
    for n in (int(x) for x in args.prompt_tokens.split(",")):
        runs: dict[str, list[dict]] = {"whole": [], "chunked": []}
        for _ in range(args.rounds):
            for how in runs:
                cmd = [sys.executable, __file__, "--worker", f"{n}:{how}", "--model", args.model]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{n}:{how} failed:\n{done.stderr[-2000:]}")
                runs[how].append(json.loads(done.stdout.strip().splitlines()[-1]))
        same = runs["whole"][0]["new_ids"] == runs["chunked"][0]["new_ids"]
        print(f"  prompt of {n} tokens (same 8 greedy tokens whole and chunked: {same})")
        for how, rs in runs.items():
            peak = statistics.median(r["peak"] for r in rs) / 1e6
            load = statistics.median(r["load_peak"] for r in rs) / 1e6
            speed = " ".join(f"{r['prefill_tok_s']:.0f}" for r in rs)
            print(f"    {how:8s} (chunk {rs[0]['chunk']:5d}): peak {peak:6.0f} MB = {peak / file_mb:.2f}x the file "
                  f"(after the load {load:.0f} MB = {load / file_mb:.2f}x); prefill tok/s per round {speed}")


if __name__ == "__main__":
    main()
