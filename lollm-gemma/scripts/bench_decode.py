"""Decode speed of lollm's gemma3 beside transformers', on the same checkpoint, in one run.

    python lollm-gemma/scripts/bench_decode.py [FOLDER] [--prompt-tokens 512] [--new-tokens 64] [--threads N] [--rounds R]

FOLDER defaults to the real Gemma 3 270M derived by
``lollm.cli.real_models.derive_safetensors("gemma-3-270m")``. Both engines run
fp32 on the CPU, greedy, batch 1, on the same token ids, one after the other in
child processes (so they never share memory). Each one: a warm-up generation,
then the timed one. Prefill = the prompt's forward; decode tok/s = (new_tokens - 1)
steps after the first token, measured the same way for both:
* lollm:        lollm.generate.loop.generate (its own prefill/decode timers);
* transformers: model.generate with max_new_tokens=N+1 minus max_new_tokens=1.

(`lollm bench` does the same for any family, but it needs lollm's tokenizer for
the prompt, and the SentencePiece-style tokenizer of Gemma is not written yet;
this script makes the ids with transformers' tokenizer instead.)

On a shared machine the figures swing with the load of other processes. The
engines therefore run alternately, ``--rounds`` times each (lollm, transformers,
lollm, ...), and each engine's best round is reported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

TEXT = (
    "In the beginning of computing, programs were written as sequences of numbers that a machine would read "
    "and execute one after the other. Over the decades people invented assemblers, then compilers, then whole "
    "languages and libraries, so that a single line could stand for thousands of instructions. "
)


def prompt_ids(folder: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(TEXT)["input_ids"]
    while len(ids) < n:
        ids += tok(TEXT, add_special_tokens=False)["input_ids"]
    return ids[:n]


def worker(engine: str, folder: str, ids: list[int], new_tokens: int, threads: int) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        if engine == "lollm":
            from lollm.generate.loop import generate
            from lollm.load.options import LoadOptions
            from lollm.load.pipeline import open_model
            from lollm.generate.sampling import SamplingParams

            model = open_model(folder, LoadOptions(device="cpu", dtype="float32")).model
            greedy = SamplingParams(temperature=0.0)
            generate(model, ids[:16], max_new_tokens=4, sampling=greedy)  # warm-up
            result = generate(model, ids, max_new_tokens=new_tokens, sampling=greedy)
            prefill, decode = result.prefill_seconds, result.decode_seconds
            steps, out = len(result.new_ids) - 1, result.new_ids
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            kw = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)
            model.generate(prompt[:, :16], max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
            start = time.perf_counter()
            model(prompt, logits_to_keep=1)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kw)
            one = time.perf_counter() - start
            start = time.perf_counter()
            full = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
            decode = time.perf_counter() - start - one
            steps, out = new_tokens - 1, full[0, len(ids):].tolist()
    return {"engine": engine, "threads": torch.get_num_threads(), "prefill_tok_s": len(ids) / prefill,
            "decode_tok_s": steps / decode, "new_ids": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.folder is None:
        from lollm.cli.real_models import derive_safetensors

        args.folder = str(derive_safetensors("gemma-3-270m"))
    if args.worker:
        ids = json.loads(sys.stdin.read())
        print(json.dumps(worker(args.worker, args.folder, ids, args.new_tokens, args.threads)))
        return 0
    ids = prompt_ids(args.folder, args.prompt_tokens)
    rows: dict[str, dict] = {}
    for _ in range(args.rounds):
        for engine in ("lollm", "transformers"):
            cmd = [sys.executable, __file__, args.folder, "--worker", engine, "--new-tokens", str(args.new_tokens),
                   "--threads", str(args.threads)]
            done = subprocess.run(cmd, input=json.dumps(ids), capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"  round: {engine:<13} prefill {row['prefill_tok_s']:8.1f} tok/s   decode {row['decode_tok_s']:6.2f} tok/s",
                  file=sys.stderr)
            best = rows.get(engine)
            if best is None or row["decode_tok_s"] > best["decode_tok_s"]:
                rows[engine] = row
    print(f"{args.folder}: {len(ids)}-token prompt, {args.new_tokens} new tokens, fp32, greedy, best of {args.rounds}")
    for engine, r in rows.items():
        print(f"  {engine:<13} prefill {r['prefill_tok_s']:8.1f} tok/s   decode {r['decode_tok_s']:6.2f} tok/s   ({r['threads']} threads)")
    ours, theirs = rows["lollm"], rows["transformers"]
    print(f"  ratio lollm/transformers: prefill {ours['prefill_tok_s'] / theirs['prefill_tok_s']:.2f}x, "
          f"decode {ours['decode_tok_s'] / theirs['decode_tok_s']:.2f}x")
    print(f"  same greedy tokens: {ours['new_ids'] == theirs['new_ids']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
