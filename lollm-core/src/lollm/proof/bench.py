"""The benchmark: our engine beside a reference on the same checkpoint, in alternating rounds.

Both engines are loaded in one process, then measured in rounds that
alternate A B A B: each round runs, for each engine, the same prefill of a
``prompt_tokens``-long prompt and ``new_tokens`` greedy decode steps. On a
shared machine the load changes from minute to minute; alternating gives both
engines the same share of it, and the ratio taken *within* each round cancels
most of it. The report gives, per engine, the median over rounds, and for the
comparison the median of the per-round ratios (ours / reference).

Memory: each load's peak resident memory above the process's memory just
before it (Linux: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``),
beside the bytes of the weights the model holds.

The reference is transformers reading exactly the file(s) lollm read
(:func:`lollm.proof.parity.reference_weights`); without transformers installed the
benchmark prints our figures and says what the reference needs. For a GGUF,
where ``llama-cpp-python`` is installed, llama.cpp runs beside both on the same
file with the same threads (:class:`LlamaCppEngine`).

Effective bandwidth: a decode step reads every weight once, so the bytes of the
weights (lollm: the packed tensors it holds; llama.cpp: the file) times decode
tokens per second is the memory traffic a step sustains (GB/s). Set beside the
machine's bandwidth it says whether decode is held back by memory or by compute.

:class:`Engine` is the small interface a benchmarked engine follows.

Under ``--tp N`` (lollm alone, no reference) every rank runs the same rounds,
greedy, so the ranks make the same forward calls without sending anything
(rule 3 of :mod:`lollm.load.ranks`); silencing the followers and meeting at the
end (rules 1 and 4) are the command's part.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from lollm.attention import resolve_backend
from lollm.errors import LollmError
from lollm.generate.loop import GenerationResult, generate
from lollm.load.loader import Checkpoint, load_checkpoint
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model, pick_dtype
from lollm.load.quantized import model_bytes
from lollm.load.threads import apply_threads
from lollm.proof.parity import load_reference_model, reference_weights
from lollm.sampling_params import SamplingParams
from lollm.tokenizer import Tokenizer

# Lazy imports below: llama_cpp, in LlamaCppEngine.load, the optional ``lollm-core[bench]`` extra;
# transformers, through lollm.proof.parity.load_reference_model, the optional ``parity`` extra.

BENCH_TEXT = (
    "In the beginning of computing, programs were written as sequences of numbers that a machine would read "
    "and execute one after the other. Over the decades people invented assemblers, then compilers, then whole "
    "languages and libraries, so that a single line could stand for thousands of instructions. "
)

#: Said instead of the reference's figures when transformers is not installed.
NO_REFERENCE = "reference: transformers is not installed, so only lollm's figures are shown (pip install 'lollm-core[parity]')"
NO_LLAMA_CPP = ("llama.cpp: llama-cpp-python is not installed, so llama.cpp is not measured beside this GGUF "
                "(pip install 'lollm-core[bench]'; --no-llama-cpp leaves it out without this note)")


def _status_kib(field_name: str) -> int | None:
    """The value of ``field_name`` (``VmRSS``, ``VmHWM``) in /proc/self/status, in KiB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Current resident memory of this process in bytes (Linux /proc; elsewhere the peak, ru_maxrss)."""
    kib = _status_kib("VmRSS")
    if kib is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    return kib * 1024


def reset_peak() -> bool:
    """Reset this process's peak-RSS counter (Linux ``clear_refs`` 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """Peak resident memory of this process in bytes since the last :func:`reset_peak` (VmHWM)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        return rss_bytes()
    return kib * 1024


def prompt_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    """``n`` token ids of :data:`BENCH_TEXT` repeated: the same prompt for every engine."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(BENCH_TEXT, add_special_tokens=False)
    return ids[:n]


class Engine(Protocol):
    """A benchmarked engine: ``load`` once, then ``prefill`` and ``decode`` in every round.

    name:          the row's label.
    weights_bytes: bytes of the weights the loaded model holds (0 when unknown).
    prefill(ids) -> seconds of one forward over ``ids`` from an empty cache.
    decode(ids, n) -> (steps, seconds): ``n`` greedy steps after the prompt ``ids``,
                   timed from the first generated token to the last.
    """

    name: str
    weights_bytes: int

    def load(self) -> None: ...

    def prefill(self, ids: list[int]) -> float: ...

    def decode(self, ids: list[int], n: int) -> tuple[int, float]: ...


class LollmEngine:
    """lollm through :func:`lollm.load.pipeline.open_model` with ``options`` (a :class:`lollm.load.options.LoadOptions`).

    Every generation runs with the attention backend the load chose (``LoadedModel.attn``).
    """

    def __init__(self, spec: str, options: LoadOptions, name: str = "lollm"):
        self.spec, self.options, self.name = spec, options, name
        self.weights_bytes = 0

    def load(self) -> None:
        self.loaded = open_model(self.spec, self.options)
        self.model = self.loaded.model
        self.weights_bytes = model_bytes(self.model)

    def _generate(self, ids: list[int], n: int) -> GenerationResult:
        """``n`` greedy tokens after ``ids``, with the load's attention backend."""
        with torch.inference_mode():
            return generate(self.model, ids, max_new_tokens=n, sampling=SamplingParams(temperature=0.0),
                            attn=self.loaded.attn)

    def prefill(self, ids: list[int]) -> float:
        return self._generate(ids, 1).prefill_seconds

    def decode(self, ids: list[int], n: int) -> tuple[int, float]:
        result = self._generate(ids, n + 1)  # the first token comes out of the prefill
        return len(result.new_ids) - 1, result.decode_seconds


class LlamaCppEngine:
    """llama.cpp through ``llama-cpp-python`` on the same GGUF, fed the same token ids; greedy by argmax of its logits.

    ``threads`` are llama.cpp's own (``n_threads`` and ``n_threads_batch``), set to torch's so both
    compute with as many. ``weights_bytes`` is the file's size (llama.cpp computes on its blocks as stored).
    """

    name = "llama.cpp"

    def __init__(self, path: str, threads: int, n_ctx: int):
        self.path, self.threads, self.n_ctx = path, threads, n_ctx
        self.weights_bytes = os.path.getsize(path)

    def load(self) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=self.path, n_threads=self.threads, n_threads_batch=self.threads, n_ctx=self.n_ctx,
                         n_batch=min(self.n_ctx, 512), verbose=False)

    def _next(self) -> int:
        """The greedy next id: the argmax of llama.cpp's logits at the last position it ran.

        Read from the context (``llama_get_logits``: the last token's row when, as here, ``logits_all`` is off);
        llama-cpp-python 0.3.36 no longer copies them into ``Llama.scores``, whose rows past ``n_batch`` do not exist.
        """
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - start

    def decode(self, ids: list[int], n: int) -> tuple[int, float]:
        self.llm.reset()
        self.llm.eval(ids)
        token = self._next()  # the first token comes out of the prefill
        start = time.perf_counter()
        for _ in range(n):
            self.llm.eval([token])
            token = self._next()
        return n, time.perf_counter() - start


def llama_cpp_available() -> bool:
    """Whether ``llama-cpp-python`` is installed (the ``bench`` extra; it builds llama.cpp on install)."""
    return importlib.util.find_spec("llama_cpp") is not None


class _Stamps:
    """A transformers streamer that only records when each chunk of ids arrives."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        """Called by ``generate`` with each chunk of ids (the prompt first, then one per new token)."""
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersEngine:
    """transformers' ``AutoModelForCausalLM`` on exactly the weights lollm read (:func:`lollm.proof.parity.load_reference_model`)."""

    name = "transformers"

    def __init__(self, checkpoint: Checkpoint, dtype: torch.dtype):
        self.checkpoint, self.dtype = checkpoint, dtype
        self.weights_bytes = 0

    def load(self) -> None:
        self.model = load_reference_model(self.checkpoint, self.dtype)
        self.weights_bytes = model_bytes(self.model)

    def prefill(self, ids: list[int]) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            self.model(torch.tensor([ids]), logits_to_keep=1)
            return time.perf_counter() - start

    def decode(self, ids: list[int], n: int) -> tuple[int, float]:
        kwargs = dict(do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
        stamps = _Stamps()  # stamps the time each token comes out, so decode is timed as for ours
        with torch.inference_mode():
            self.model.generate(torch.tensor([ids]), max_new_tokens=n + 1, min_new_tokens=n + 1, streamer=stamps, **kwargs)
        return len(stamps.times) - 2, stamps.times[-1] - stamps.times[1]  # times[0] is the prompt itself


@dataclass
class EngineFigures:
    """One engine's measurements: the load, then per round prefill and decode tokens/s."""

    name: str
    load_seconds: float = 0.0
    load_peak_bytes: int = 0
    weights_bytes: int = 0
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    #: the same two by this process's CPU time (all its threads) instead of the wall clock: on a machine other
    #: processes keep busy, what the work costs rather than how often the scheduler let it run
    prefill_cpu_tok_s: list[float] = field(default_factory=list)
    decode_cpu_tok_s: list[float] = field(default_factory=list)

    def median(self, key: str) -> float:
        """The median over rounds of the list field ``key`` (``decode_tok_s`` ...); 0.0 before any round."""
        values = getattr(self, key)
        return statistics.median(values) if values else 0.0

    @property
    def bandwidth_gb_s(self) -> float:
        """Effective bandwidth of decode: weight bytes × median decode tokens/s, in GB/s (1e9 bytes)."""
        return self.weights_bytes * self.median("decode_tok_s") / 1e9

    def to_json(self) -> dict[str, object]:
        """The medians (tokens/s, GB/s), the load's seconds and bytes, and every round's figures."""
        return {
            "engine": self.name, "load_seconds": self.load_seconds, "load_peak_bytes": self.load_peak_bytes,
            "weights_bytes": self.weights_bytes, "prefill_tok_s": self.median("prefill_tok_s"),
            "decode_tok_s": self.median("decode_tok_s"), "decode_gb_s": self.bandwidth_gb_s,
            "prefill_cpu_tok_s": self.median("prefill_cpu_tok_s"), "decode_cpu_tok_s": self.median("decode_cpu_tok_s"),
            "rounds": {"prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s,
                       "prefill_cpu_tok_s": self.prefill_cpu_tok_s, "decode_cpu_tok_s": self.decode_cpu_tok_s},
        }


@dataclass
class BenchResult:
    """Figures of every engine, in the order they ran in each round."""

    engines: list[EngineFigures]
    prompt_tokens: int
    new_tokens: int
    threads: int
    note: str = ""  # e.g. why the reference is missing

    def by_name(self, name: str) -> EngineFigures:
        """The figures of the engine called ``name``; StopIteration when none ran."""
        return next(e for e in self.engines if e.name == name)

    def ratios(self, ours: str, reference: str, key: str) -> list[float]:
        """Per-round ratios ``ours / reference`` of ``key`` (``prefill_tok_s`` or ``decode_tok_s``)."""
        a, b = getattr(self.by_name(ours), key), getattr(self.by_name(reference), key)
        return [x / y for x, y in zip(a, b) if y > 0]

    def ratio(self, ours: str, reference: str, key: str) -> float | None:
        """The median of the per-round ratios (None when there is no reference round)."""
        r = self.ratios(ours, reference, key)
        return statistics.median(r) if r else None

    @property
    def rows(self) -> list[dict[str, object]]:
        """One :meth:`EngineFigures.to_json` per engine (``lollm bench --json``)."""
        return [e.to_json() for e in self.engines]


def measure_load(engine: Engine) -> EngineFigures:
    """Load ``engine``, timing it and taking its peak memory above the memory just before."""
    gc.collect()
    reset_peak()
    before = rss_bytes()
    start = time.perf_counter()
    engine.load()
    seconds = time.perf_counter() - start
    return EngineFigures(engine.name, seconds, max(0, peak_bytes() - before), engine.weights_bytes)


def alternate(engines: list[Engine], figures: list[EngineFigures], ids: list[int], new_tokens: int, rounds: int,
              log: Callable[[str], None] | None = None) -> None:
    """Run ``rounds`` rounds; in each, every engine in turn (A B A B ...) does one prefill and one decode.

    Each is timed by the wall clock and by this process's CPU time; a decode runs its own prefill
    first, whose CPU time (that of the prefill just before) is taken off.
    """
    for engine in engines:  # warm-up: first calls allocate caches and pick kernels
        engine.prefill(ids[:16])
        engine.decode(ids[:16], 2)
    for r in range(rounds):
        for engine, fig in zip(engines, figures):
            cpu = time.process_time()
            fig.prefill_tok_s.append(len(ids) / engine.prefill(ids))
            prefill_cpu, cpu = time.process_time() - cpu, time.process_time()
            steps, seconds = engine.decode(ids, new_tokens)
            decode_cpu = time.process_time() - cpu - prefill_cpu
            fig.decode_tok_s.append(steps / seconds if seconds > 0 else 0.0)
            fig.prefill_cpu_tok_s.append(len(ids) / max(prefill_cpu, 1e-9))
            fig.decode_cpu_tok_s.append(steps / max(decode_cpu, 1e-9))
            if log is not None:
                log(f"round {r + 1}/{rounds}: {engine.name}: prefill {fig.prefill_tok_s[-1]:.1f} tok/s, "
                    f"decode {fig.decode_tok_s[-1]:.2f} tok/s")


def run_bench(spec: str, options: LoadOptions | None = None, *, prompt_tokens: int = 512, new_tokens: int = 64,
              reference: bool = True, threads: int | None = None, rounds: int = 3, log: Callable[[str], None] | None = None,
              ids: list[int] | None = None, llama_cpp: bool = True) -> BenchResult:
    """lollm (loaded with ``options``, a :class:`lollm.load.options.LoadOptions`) beside transformers, and llama.cpp.

    ``options``: None means float32 float weights on the CPU (``lollm bench`` passes ``weights="auto"``).
    Its attention backend is checked before anything loads; transformers runs its own attention
    at the same dtype. The benchmark runs on the CPU: another device is refused.

    Both are loaded in this process and measured in ``rounds`` alternating
    rounds, on ``ids`` when given (else ``prompt_tokens`` ids of :data:`BENCH_TEXT`). Without transformers installed the reference is skipped and
    ``BenchResult.note`` says so. For a GGUF with ``llama_cpp`` on and ``llama-cpp-python``
    installed, :class:`LlamaCppEngine` runs in the same rounds (with or without transformers); not installed,
    ``BenchResult.note`` says so (:data:`NO_LLAMA_CPP`). Raises LollmError
    when the reference cannot read the same weights as lollm, or for a device other than the CPU.
    """
    options = options or LoadOptions(device="cpu", dtype="float32")
    if options.device not in ("auto", "cpu"):
        raise LollmError(f"lollm bench measures on the CPU; --device {options.device} is not supported here")
    options = options.replace(device="cpu", attn=resolve_backend(options.attn))
    apply_threads(threads)  # ``threads``, else lollm.load.threads' default (the free cores), as for `lollm run`
    note = ""
    if reference and importlib.util.find_spec("transformers") is None:
        reference, note = False, NO_REFERENCE
    checkpoint = load_checkpoint(spec)
    if reference:
        reference_weights(checkpoint)  # refuse before loading anything when transformers would read other files
    ids = ids if ids is not None else prompt_ids(checkpoint.tokenizer, prompt_tokens)
    engines: list[Engine] = [LollmEngine(spec, options)]
    if reference:
        engines.append(TransformersEngine(checkpoint, pick_dtype(options.dtype, torch.device("cpu"), checkpoint.config)))
    if llama_cpp and checkpoint.fmt == "gguf" and llama_cpp_available():
        gguf = checkpoint.weights.gguf.path  # the one file both read
        engines.append(LlamaCppEngine(str(gguf), torch.get_num_threads(), len(ids) + new_tokens + 16))
    elif llama_cpp and checkpoint.fmt == "gguf":
        note = "\n".join(filter(None, [note, NO_LLAMA_CPP]))
    figures = [measure_load(engine) for engine in engines]
    alternate(engines, figures, ids, new_tokens, rounds, log)
    return BenchResult(figures, len(ids), new_tokens, torch.get_num_threads(), note)


def machine_load() -> str:
    """The 1-minute load average beside the CPU count, to read the figures by (``"load 1.3 on 2 CPUs"``)."""
    try:
        return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    except OSError:
        return f"{os.cpu_count()} CPUs"
