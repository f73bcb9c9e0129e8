"""The benchmark: our engine and transformers on the same checkpoint, in the same run.

Each engine runs in its own child process, one after the other, so that the
two never share memory and each one's peak memory is its own. Every worker
measures, on the same token ids:

* load time (seconds) and the load's peak memory above the process's memory
  before loading (from ``ru_maxrss``), beside the size of the model's weights;
* prefill: one forward over a ``prompt_tokens``-long prompt, in tokens/s;
* decode: ``new_tokens`` greedy steps after that prompt, in tokens/s.

A caveat on memory: when the file already stores the target dtype, both
engines keep the tensors backed by the file's memory map, so their pages are
counted when first touched (in prefill), not during the load; the load peak is
then far below the weights' size. Converting (bf16 file, fp32 model) or
dequantizing (GGUF) loads show the real peak.

The parent prints both rows and the ratios ours / transformers. Figures are
noisy on a shared machine; compare the ratios of one run, never absolute
numbers across runs.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

BENCH_TEXT = (
    "In the beginning of computing, programs were written as sequences of numbers that a machine would read "
    "and execute one after the other. Over the decades people invented assemblers, then compilers, then whole "
    "languages and libraries, so that a single line could stand for thousands of instructions. "
)


def _rss_kib() -> int:
    """Current resident set size of this process, in KiB (Linux /proc; falls back to ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_kib() -> int:
    """Peak resident set size of this process, in KiB.

    Linux /proc's VmHWM first: ``ru_maxrss`` carries a parent's peak over fork + exec,
    so a worker started from a big process (a notebook holding a model) would report
    the parent's memory as its own.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def _weights_bytes(model) -> int:
    seen, total = set(), 0
    for p in list(model.parameters()) + list(model.buffers()):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def _prompt_ids(tokenizer, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(BENCH_TEXT, add_special_tokens=False)
    return ids[:n]


class _Stamps:
    """A transformers streamer that only records when each chunk of ids arrives."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def worker(engine: str, spec: str, dtype_name: str, prompt_tokens: int, new_tokens: int, threads: int | None) -> dict[str, Any]:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from lollm.loader import load_checkpoint
    from lollm.pipeline import pick_dtype

    checkpoint = load_checkpoint(spec)
    dtype = pick_dtype(dtype_name, torch.device("cpu"), checkpoint.config)
    ids = _prompt_ids(checkpoint.tokenizer, prompt_tokens)
    baseline = _rss_kib()
    start = time.perf_counter()
    if engine == "lollm":
        from lollm.pipeline import open_model

        model = open_model(spec, device="cpu", dtype=dtype_name).model
    else:
        from transformers import AutoModelForCausalLM

        if checkpoint.fmt == "gguf":  # transformers dequantizes the same GGUF file itself
            gguf_path = checkpoint.weights.gguf.path
            model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(checkpoint.path), dtype=dtype)
        model.eval()
    load_seconds = time.perf_counter() - start
    load_peak = _peak_kib() - baseline
    prompt = torch.tensor([ids])

    with torch.inference_mode():
        if engine == "lollm":
            from lollm.generate import generate
            from lollm.sampling import SamplingParams

            greedy = SamplingParams(temperature=0.0)
            generate(model, ids[:16], max_new_tokens=4, sampling=greedy)  # warm-up
            result = generate(model, ids, max_new_tokens=new_tokens + 1, sampling=greedy)  # 1 prefill + new_tokens decode steps
            prefill = result.prefill_seconds
            decode_steps = len(result.new_ids) - 1
            decode = result.decode_seconds
        else:
            kwargs = dict(do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
            model.generate(prompt[:, :16], max_new_tokens=4, min_new_tokens=4, **kwargs)  # warm-up
            start = time.perf_counter()
            model(prompt, logits_to_keep=1)
            prefill = time.perf_counter() - start
            # decode: one generate call; a streamer stamps the time each token comes out, so the
            # decode rate is measured between the first and the last generated token, as for ours
            stamps = _Stamps()
            model.generate(prompt, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, streamer=stamps, **kwargs)
            decode = stamps.times[-1] - stamps.times[1]  # times[0] is the prompt itself
            decode_steps = len(stamps.times) - 2
    return {
        "engine": engine,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "load_seconds": load_seconds,
        "weights_bytes": _weights_bytes(model),
        "load_peak_bytes": load_peak * 1024,
        "prompt_tokens": len(ids),
        "prefill_tok_s": len(ids) / prefill,
        "decode_tokens": decode_steps,
        "decode_tok_s": decode_steps / decode if decode > 0 else 0.0,
    }


@dataclass
class BenchResult:
    rows: list[dict[str, Any]]

    def ratio(self, key: str) -> float | None:
        by = {r["engine"]: r for r in self.rows}
        if "lollm" in by and "transformers" in by and by["transformers"][key]:
            return by["lollm"][key] / by["transformers"][key]
        return None


def run_bench(spec: str, *, dtype: str = "float32", prompt_tokens: int = 512, new_tokens: int = 64,
              reference: bool = True, threads: int | None = None, attn: str | None = None) -> BenchResult:
    """Run the workers one after the other and collect their figures.

    ``attn``: the attention backend of our engine (lollm.attention; None: ``LOLLM_ATTN``, else sdpa),
    checked here and handed to the worker as ``LOLLM_ATTN``.
    """
    from lollm.attention import ENV_VAR, resolve_backend

    attn = resolve_backend(attn)
    rows = []
    for engine in ["lollm"] + (["transformers"] if reference else []):
        cmd = [sys.executable, "-m", "lollm.bench", engine, spec, dtype, str(prompt_tokens), str(new_tokens), str(threads or 0)]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", ENV_VAR: attn})
        if done.returncode != 0:
            from lollm.errors import LollmError

            raise LollmError(f"the {engine} benchmark worker failed:\n{done.stderr.strip()[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return BenchResult(rows)


if __name__ == "__main__":  # the child process of run_bench
    engine, spec, dtype_name, prompt_tokens, new_tokens, threads = sys.argv[1:7]
    print(json.dumps(worker(engine, spec, dtype_name, int(prompt_tokens), int(new_tokens), int(threads) or None)))
