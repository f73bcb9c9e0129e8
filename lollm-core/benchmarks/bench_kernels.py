"""The kernel options for the packed decode step, measured side by side on this CPU (issue 23).

Part 1, one packed matrix (per-channel int8 codes, 4864 x 896: Qwen2.5-0.5B's MLP
gate/up), for 1, 4 and 7 activation rows (a decode step, verify rows of prompt lookup),
in rounds that alternate the options:

* ``eager``: today's route, ``torch.ops.aten._weight_int8pack_mm`` (bf16 activations);
* ``compile``: ``torch.compile`` of the same module (inductor's C++ code generation),
  and ``compile max-autotune``: ``mode="max-autotune-no-cudagraphs"`` with
  ``torch._inductor.config.freezing = True``;
* ``int_mm row``: int8 activations with one scale per row, one ``torch._int_mm``
  (int8 x int8 -> int32), rescaled by the row's and the channel's scales;
* ``int_mm q8_0``: int8 activations with one scale per 32 values (llama.cpp's Q8_0
  activation scheme): one ``torch._int_mm`` per block of 32 columns;
* ``inductor q8_0``: the Q8_0 scheme written as a broadcast product and sum over each
  block in int32, compiled by inductor (its own vectorized integer loop).

Each option prints its time per call (wall clock and this process's CPU time, the
median over rounds) and its max |Δ| against the float product of the dequantized
weights; compiled options print their compile time.

Part 2, the whole model (default: the real Qwen2.5-Coder-0.5B GGUF, packed weights):
the accuracy of int8 activations (Q8_0 and per row) over a prompt (max |Δ| of the
logits and top-1 agreement against today's route) and the per-row route's decode
speed against today's, alternating; then ``torch.compile`` of the whole forward (decode
steps through the shared loop), each compile mode in its own child process against
eager in alternating rounds: compile time and decode tok/s.

Part 3, torchao's CPU configurations on one float linear of the same shape, when
torchao is importable (``pip install --no-deps torchao``: it must not replace torch).

    python lollm-core/benchmarks/bench_kernels.py [--model PATH] [--rounds 5] [--threads N] [--skip-model]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

N, K, BLOCK = 4864, 896, 32
ROWS = (1, 4, 7)


def _timed(fn, x, calls: int) -> tuple[float, float]:
    """Microseconds per call of ``fn(x)``: (wall clock, process CPU time)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - wall) / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


def quantize_q8_0(x):
    """int8 codes (M, K) and one float32 scale per 32 values (M, K // 32): llama.cpp's Q8_0 activations."""
    import torch

    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(-1).clamp(min=1e-12) / 127
    codes = torch.round(blocks / scale[..., None]).to(torch.int8)
    return codes.reshape(x.shape[0], -1), scale


def q8_0_int_mm(x, codes_t, w_scale):
    """Q8_0 activations through one ``torch._int_mm`` per block of 32 columns; (M, N) float32."""
    import torch

    xq, xs = quantize_q8_0(x)
    y = torch.zeros(x.shape[0], codes_t.shape[1])
    for b in range(xq.shape[1] // BLOCK):
        cols = slice(b * BLOCK, (b + 1) * BLOCK)
        y += torch._int_mm(xq[:, cols].contiguous(), codes_t[cols].contiguous()).float() * xs[:, b : b + 1]
    return y * w_scale


def q8_0_blocks(x, codes, w_scale):
    """Q8_0 activations, each block's dot product in int32 (broadcast product, sum): the form inductor compiles."""
    import torch

    xq, xs = quantize_q8_0(x)
    m = x.shape[0]
    dots = (xq.view(m, 1, -1, BLOCK).to(torch.int32) * codes.view(1, N, -1, BLOCK).to(torch.int32)).sum(-1)  # (M, N, B)
    return (dots.float() * xs[:, None, :]).sum(-1) * w_scale


def row_int_mm(x, codes_t, w_scale):
    """int8 activations with one scale per row: one ``torch._int_mm``; (M, N) float32."""
    import torch

    xf = x.float()
    xs = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    xq = torch.round(xf / xs).to(torch.int8)
    return torch._int_mm(xq, codes_t).float() * xs * w_scale


def part_matrix(rounds: int) -> None:
    import torch

    from lollm.load.quantized import Int8Linear

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) * 0.01 + 0.001
    layer = Int8Linear(codes[None], scale[None])
    codes_t = codes.t().contiguous()
    exact_w = codes.float() * scale[:, None]
    options = {
        "eager": layer,
        "int_mm row": lambda x: row_int_mm(x, codes_t, scale),
        "int_mm q8_0": lambda x: q8_0_int_mm(x, codes_t, scale),
    }
    compile_s = {}
    for name, build in (("compile", lambda: torch.compile(layer)),
                        ("compile max-autotune", lambda: torch.compile(layer, mode="max-autotune-no-cudagraphs")),
                        ("inductor q8_0", lambda: torch.compile(lambda x: q8_0_blocks(x, codes, scale)))):
        torch._inductor.config.freezing = name == "compile max-autotune"
        fn = build()
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                for m in ROWS:
                    fn(torch.randn(m, K, dtype=torch.float32))
        except Exception as e:  # an option that does not compile here is a figure too
            print(f"  {name}: does not compile here: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        compile_s[name] = time.perf_counter() - start
        options[name] = fn
    torch._inductor.config.freezing = False
    print(f"\nPart 1: one packed matrix {N} x {K}, per-channel int8 codes; median of {rounds} alternating rounds")
    print("  compile time (s, all three row counts): " + ", ".join(f"{n} {s:.1f}" for n, s in compile_s.items()))
    for m in ROWS:
        x = torch.randn(m, K, generator=g)
        exact = x @ exact_w.t()
        print(f"  {m} row{'s' if m > 1 else ''}: x ~ N(0, 1); the float product's largest |value| is {float(exact.abs().max()):.1f}")
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in options}
        with torch.inference_mode():
            for _ in range(rounds):
                for name, fn in options.items():
                    calls = 3 if name == "int_mm q8_0" else 20
                    fn(x)
                    times[name].append(_timed(fn, x, calls))
            print(f"  {m} row{'s' if m > 1 else ''}: option: wall us (cpu us) per call, max |Δ| vs the float product")
            base = statistics.median(t[0] for t in times["eager"])
            for name, fn in options.items():
                wall = statistics.median(t[0] for t in times[name])
                cpu = statistics.median(t[1] for t in times[name])
                err = float((fn(x).float() - exact).abs().max())
                print(f"    {name:22s} {wall:10.0f} ({cpu:8.0f})   {wall / base:6.2f}x eager   max |Δ| {err:.4f}")


def _q8_0_forward(self, x):
    """Int8Linear.forward with Q8_0 activations (the accuracy run: int32 block dots, exact in float64)."""
    import torch

    flat = x.reshape(-1, self.in_features)
    groups, n, gs = self.codes.shape
    if gs % BLOCK:
        return _ORIGINAL_FORWARD(self, x)
    xq, xs = quantize_q8_0(flat)
    w = self.codes.permute(1, 0, 2).reshape(n, -1).double()  # (N, K) exact integers
    blocks = xq.shape[1] // BLOCK
    dots = torch.einsum("mbk,nbk->mnb", xq.double().view(-1, blocks, BLOCK), w.view(n, blocks, BLOCK))
    w_scale = self.scale.double().repeat_interleave(gs // BLOCK, dim=0).t()  # (N, blocks)
    y = (dots * xs.double()[:, None, :] * w_scale[None]).sum(-1).to(x.dtype).reshape(*x.shape[:-1], n)
    return y if self.bias is None else y + self.bias


_ORIGINAL_FORWARD = None


def _row_forward(self, x):
    """Int8Linear.forward with int8 activations, one scale per row, through one ``torch._int_mm`` (per-channel
    weights only; grouped ones keep today's route)."""
    if self.codes.shape[0] != 1:
        return _ORIGINAL_FORWARD(self, x)
    flat = x.reshape(-1, self.in_features)
    y = row_int_mm(flat, self.codes[0].t(), self.scale[0]).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
    return y if self.bias is None else y + self.bias




def part_accuracy(path: str, prompt_tokens: int, rounds: int, new_tokens: int) -> None:
    """Int8 activations in the whole model: Q8_0 (per 32) and per row, against today's route; the per-row
    route's decode speed too (it is the only one faster per matrix)."""
    import torch

    global _ORIGINAL_FORWARD
    from lollm.proof.bench import prompt_ids
    from lollm.generate.loop import generate
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.load.quantized import Int8Linear
    from lollm.generate.sampling import SamplingParams

    loaded = open_model(path, LoadOptions(device="cpu", dtype="float32", weights="quantized"))
    ids = prompt_ids(loaded.tokenizer, prompt_tokens)
    _ORIGINAL_FORWARD = Int8Linear.forward
    routes = {"today": _ORIGINAL_FORWARD, "Q8_0 activations": _q8_0_forward, "per-row int8 activations": _row_forward}
    print(f"\nPart 2a: int8 activations in the whole model, {len(ids)}-token prompt of {path}")
    logits = {}
    try:
        with torch.inference_mode():
            for name, forward in routes.items():
                Int8Linear.forward = forward
                logits[name] = loaded.model(torch.tensor([ids]), None)[0]
        today = logits["today"]
        for name in list(routes)[1:]:
            agree = float((today.argmax(-1) == logits[name].argmax(-1)).float().mean())
            print(f"  {name}: max |Δ| of the logits vs today's {float((today - logits[name]).abs().max()):.3f} "
                  f"(logits {float(today.min()):.1f} .. {float(today.max()):.1f}), top-1 agreement {agree:.4f}")
        speeds: dict[str, list[tuple[float, float]]] = {"today": [], "per-row int8 activations": []}
        for _ in range(rounds):
            for name in speeds:
                Int8Linear.forward = routes[name]
                cpu = time.process_time()
                r = generate(loaded.model, ids[:32], max_new_tokens=new_tokens + 1,
                             sampling=SamplingParams(temperature=0.0), attn=loaded.attn)
                speeds[name].append((r.decode_tokens_per_second, new_tokens / (time.process_time() - cpu)))
    finally:
        Int8Linear.forward = _ORIGINAL_FORWARD
    for name, values in speeds.items():
        rows = " ".join(f"{w:.2f}" for w, _ in values)
        print(f"  decode {name:26s} {statistics.median(w for w, _ in values):6.2f} tok/s wall, "
              f"{statistics.median(c for _, c in values):6.2f} by CPU time (rounds {rows})")


def worker(path: str, mode: str, rounds: int, new_tokens: int) -> dict:
    """In this process: eager decode against ``torch.compile`` of the model's forward in ``mode``, alternating."""
    import torch

    from lollm.proof.bench import prompt_ids
    from lollm.generate.loop import generate
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams

    loaded = open_model(path, LoadOptions(device="cpu", dtype="float32", weights="quantized"))
    model, ids, greedy = loaded.model, prompt_ids(loaded.tokenizer, 32), SamplingParams(temperature=0.0)
    from lollm.load.quantized import BlockEmbedding

    for module in model.modules():  # its lookup dequantizes in numpy, which dynamo cannot trace: left eager
        if isinstance(module, BlockEmbedding):
            module.forward = torch.compiler.disable(module.forward)
    eager_forward = model.forward
    kwargs = {} if mode == "default" else {"mode": mode}
    torch._inductor.config.freezing = mode != "default"
    compiled_forward = torch.compile(eager_forward, **kwargs)

    def decode(forward) -> tuple[float, float, list[int]]:
        model.forward = forward
        cpu = time.process_time()
        r = generate(model, ids, max_new_tokens=new_tokens + 1, sampling=greedy, attn=loaded.attn)
        steps = len(r.new_ids) - 1
        return r.decode_tokens_per_second, steps / max(time.process_time() - cpu, 1e-9), r.new_ids

    start = time.perf_counter()
    _, _, compiled_ids = decode(compiled_forward)  # compiles: the prefill's shape, then the decode steps
    compile_s = time.perf_counter() - start
    _, _, eager_ids = decode(eager_forward)
    out = {"compile_s": compile_s, "same_tokens": compiled_ids == eager_ids, "eager": [], "compiled": []}
    for _ in range(rounds):
        for name, forward in (("eager", eager_forward), ("compiled", compiled_forward)):
            out[name].append(decode(forward)[:2])
    return out


def part_compile_model(path: str, rounds: int, new_tokens: int, threads: int, timeout: float) -> None:
    print(f"\nPart 2b: torch.compile of the whole forward, decode through the shared loop ({new_tokens} tokens, "
          f"{rounds} alternating rounds, each mode in its own process)")
    for mode in ("default", "max-autotune-no-cudagraphs"):
        cmd = [sys.executable, __file__, "--worker", mode, "--model", path, "--rounds", str(rounds),
               "--new-tokens", str(new_tokens), "--threads", str(threads)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"  {mode}: did not finish in {timeout:.0f} s (compile included)")
            continue
        if done.returncode:
            errors = [line for line in done.stderr.splitlines() if "Error" in line] or done.stderr.splitlines()[-1:]
            print(f"  {mode}: failed: {errors[0][:300] if errors else done.returncode}")
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        med = {n: (statistics.median(w for w, _ in r[n]), statistics.median(c for _, c in r[n])) for n in ("eager", "compiled")}
        print(f"  {mode}: compile (first generation) {r['compile_s']:.1f} s; same greedy tokens as eager: {r['same_tokens']}")
        for n in ("eager", "compiled"):
            rows = " ".join(f"{w:.2f}" for w, _ in r[n])
            print(f"    {n:9s} decode {med[n][0]:6.2f} tok/s wall, {med[n][1]:6.2f} tok/s of CPU time   ({rows})")
        print(f"    compiled / eager: {med['compiled'][0] / med['eager'][0]:.2f}x wall, "
              f"{med['compiled'][1] / med['eager'][1]:.2f}x CPU time")


def part_torchao(rounds: int) -> None:
    """torchao's CPU configs on one float 4864 x 896 linear (when torchao imports beside this torch)."""
    import copy
    import importlib.util

    import torch

    if importlib.util.find_spec("torchao") is None:
        print("\nPart 3: torchao is not installed (pip install --no-deps torchao; it must not replace torch)")
        return
    import torchao
    from torchao import quantization as q

    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(K, N, bias=False).requires_grad_(False)
    base.weight.data = torch.randn(N, K, generator=g) * 0.02
    configs = {
        "Int8WeightOnlyConfig": lambda: q.Int8WeightOnlyConfig(),
        "Int8DynamicActivationInt8WeightConfig": lambda: q.Int8DynamicActivationInt8WeightConfig(),
        # torchao 0.18 names no CPU packing for int4 (its formats: plain, preshuffled, plain_int32, tile_packed_to_4d)
        "Int4WeightOnlyConfig(tile_packed_to_4d)": lambda: q.Int4WeightOnlyConfig(group_size=32,
                                                                                  int4_packing_format="tile_packed_to_4d"),
        "Int8DynamicActivationIntxWeightConfig": lambda: q.Int8DynamicActivationIntxWeightConfig(),
    }
    print(f"\nPart 3: torchao {torchao.__version__} on one bfloat16 nn.Linear {N} x {K} (eager; max |Δ| vs float)")
    for rows in ROWS:
        x = torch.randn(rows, K, generator=g)
        exact = base(x)
        print(f"  {rows} row{'s' if rows > 1 else ''}: option: wall us (cpu us) per call")
        for name, make in configs.items():
            layer = copy.deepcopy(base).to(torch.bfloat16)
            try:
                q.quantize_(layer, make())
                with torch.inference_mode():
                    y = layer(x.to(torch.bfloat16))
                    wall, cpu = statistics.median(_timed(layer, x.to(torch.bfloat16), 20) for _ in range(rounds))
            except Exception as e:
                print(f"    {name:38s} does not run here: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            print(f"    {name:38s} {wall:8.0f} ({cpu:6.0f})   max |Δ| {float((y.float() - exact).abs().max()):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF (default: the real Qwen2.5-Coder-0.5B)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="the accuracy run's prompt")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: lollm.load.threads' choice)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for each compiled model's process")
    parser.add_argument("--skip-model", action="store_true", help="parts 1 and 3 only")
    parser.add_argument("--only-torchao", action="store_true", help="part 3 only")
    parser.add_argument("--only-activations", action="store_true", help="part 2a only")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from lollm.load.threads import apply_threads

    threads = apply_threads(args.threads).threads
    if args.model is None and not args.skip_model:
        from lollm.cli.real_models import fetch_gguf

        args.model = str(fetch_gguf("qwen2.5-coder-0.5b-instruct"))
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.rounds, args.new_tokens)))
        return
    import torch

    print(f"bench_kernels: torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{threads} threads")
    if args.only_activations:
        part_accuracy(args.model, args.prompt_tokens, args.rounds, args.new_tokens)
        return
    if args.only_torchao:
        part_torchao(args.rounds)
        return
    part_matrix(args.rounds)
    part_torchao(args.rounds)
    if not args.skip_model:
        part_accuracy(args.model, args.prompt_tokens, args.rounds, args.new_tokens)
        part_compile_model(args.model, args.rounds, args.new_tokens, threads, args.timeout)


if __name__ == "__main__":
    main()
