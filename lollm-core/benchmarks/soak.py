"""A soak and fault run of `lollm serve` (``nox -s soak``): mixed traffic for a while, then the faults.

::

    python lollm-core/benchmarks/soak.py [--model PATH] [--minutes 30] [--clients 24] [--report soak.json]

Starts ``lollm serve`` on the model (default: the real Qwen2.5-Coder 0.5B GGUF, fetched once) in a
child process and runs five phases against it:

1. **mixed** (``--minutes``): ``--clients`` threads, each sending one request after another, drawn
   from :data:`SCENARIOS`: chat and completions, streams read to the end, streams dropped after a
   few chunks, requests given up after 1 s, bodies the server must refuse (bad JSON, a bad value,
   the wrong Content-Type), prompts sharing a long prefix, tool calls and JSON-schema answers.
2. **overload**: ``--burst`` requests at once; each gets 200, or 503 with Retry-After.
3. **disconnect storm**: streams dropped after their first chunk and requests given up after 0.2 s,
   all at once.
4. after each phase the server must come back to idle: no request running, 0 KV blocks used.
5. **shutdown**: SIGTERM with streams and plain requests in flight; the process must exit 0 within
   ``--shutdown-timeout`` + 2 s, streams ending with finish_reason "shutdown" (or done), others 503.

It samples the server's RSS (``/proc/PID/status``) every ``--rss-every`` seconds and reports: the
status counts per scenario, latency percentiles, RSS (start, max, end, and the least-squares slope
over the second half of the mixed phase, MB per minute), KV blocks after each phase, and the
server's counters (/health, /metrics) beside the client-side counts. It exits 1, naming each, on:
any 5xx but the overload's 503s and the shutdown's, a request that hangs (no answer within
``--hang`` seconds), a traceback or an "internal error" in the server's log, KV blocks still held
once idle, counters that do not match the clients, or an RSS slope above ``--max-slope`` MB/min.
docs/security.md ("Soak") has the figures of the runs so far and the one-hour command.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

MODEL = "qwen2.5-coder-0.5b-instruct"
NAME = "soak"
#: a long text several scenarios share as their prompt's start (the prefix cache's work)
PREFIX = ("You are a careful assistant for a small software team. " * 12 +
          "Answer in one or two sentences, plainly, without lists. ") * 3
WORDS = "fox river stone cloud tree bird lamp road field train window paper garden music winter".split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "score": {"type": "integer"}},
    "required": ["city", "score"], "additionalProperties": False}}}


@dataclass
class Outcome:
    """One request as the client saw it: scenario, status (int, or "timeout", "dropped", "hang", "error: ..."),
    seconds, and for streams the finish_reason (None when it never came)."""

    scenario: str
    status: int | str
    seconds: float
    finish: str | None = None
    code: str | None = None


@dataclass
class Soak:
    """The run's state: the server's address and process, what clients saw, RSS samples, KV blocks per phase."""

    port: int
    process: subprocess.Popen
    log_path: Path
    hang: float
    outcomes: dict[str, list[Outcome]] = field(default_factory=lambda: defaultdict(list))
    rss: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MB)
    kv_after: dict[str, int | None] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    start: float = field(default_factory=time.monotonic)

    def record(self, phase: str, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes[phase].append(outcome)


# -- one request -----------------------------------------------------------------------------------


def post(soak: Soak, path: str, body: bytes, *, content_type: str = "application/json", timeout: float | None = None,
         stream: bool = False, drop_after: int | None = None, hang: float | None = None) -> Outcome:
    """POST ``body``; read the answer (a stream to its end, or ``drop_after`` events, then close the connection).

    timeout: seconds the client waits before it gives up ("timeout"); None: the hang bound (``hang``, default
    ``--hang``; then "hang").
    """
    began = time.monotonic()
    limit = (hang or soak.hang) if timeout is None else timeout
    connection = http.client.HTTPConnection("127.0.0.1", soak.port, timeout=limit)
    try:
        connection.request("POST", path, body, {"Content-Type": content_type})
        response = connection.getresponse()
        if response.status != 200 or not stream:
            data = json.loads(response.read() or b"{}")
            code = data.get("error", {}).get("code") if isinstance(data, dict) else None
            return Outcome("", response.status, time.monotonic() - began, code=code)
        finish, events = None, 0
        for line in response:
            if line.startswith(b"data: {"):
                events += 1
                for choice in json.loads(line[6:]).get("choices", []):
                    finish = choice.get("finish_reason") or finish
                if drop_after is not None and events >= drop_after:
                    return Outcome("", "dropped", time.monotonic() - began, finish)
        return Outcome("", 200, time.monotonic() - began, finish)
    except TimeoutError:
        return Outcome("", "timeout" if timeout is not None else "hang", time.monotonic() - began)
    except (OSError, http.client.HTTPException, ValueError) as error:
        return Outcome("", f"error: {type(error).__name__}", time.monotonic() - began)
    finally:
        connection.close()


def chat(messages: list[dict], max_tokens: int, **extra: object) -> bytes:
    return json.dumps({"model": NAME, "messages": messages, "max_tokens": max_tokens, **extra}).encode()


def question(rng: random.Random) -> str:
    return "Tell me about " + " and ".join(rng.sample(WORDS, 2)) + f" (case {rng.randrange(10**6)})."


def scenario(soak: Soak, name: str, rng: random.Random) -> Outcome:
    """One request of scenario ``name`` (a key of SCENARIOS)."""
    user = [{"role": "user", "content": question(rng)}]
    shared = [{"role": "system", "content": PREFIX}] + user
    chat_path, completion_path = "/v1/chat/completions", "/v1/completions"
    if name == "chat":
        out = post(soak, chat_path, chat(user, rng.randint(8, 48)))
    elif name == "stream":
        out = post(soak, chat_path, chat(user, rng.randint(8, 48), stream=True), stream=True)
    elif name == "drop":
        out = post(soak, chat_path, chat(user, 400, stream=True), stream=True, drop_after=rng.randint(1, 8))
    elif name == "timeout":
        out = post(soak, chat_path, chat(shared, 400), timeout=1.0)
    elif name == "prefix":
        streamed = rng.random() < 0.5
        out = post(soak, chat_path, chat(shared, rng.randint(4, 24), stream=streamed), stream=streamed)
    elif name == "completion":
        out = post(soak, completion_path, json.dumps({"model": NAME, "prompt": question(rng), "max_tokens": 16}).encode())
    elif name == "tool":
        out = post(soak, chat_path, chat([{"role": "user", "content": "Weather in Oslo?"}], 64, tools=TOOLS,
                                         tool_choice="required"))
    elif name == "structured":
        out = post(soak, chat_path, chat(user, 64, response_format=SCHEMA, temperature=0))
    else:
        out = bad_body(soak, rng)
    out.scenario = name
    return out


def bad_body(soak: Soak, rng: random.Random) -> Outcome:
    """A body the server must refuse with a 4xx: bad JSON, a bad value, an unknown field, the wrong type, no model."""
    path = "/v1/chat/completions"
    kind = rng.randrange(5)
    if kind == 0:
        return post(soak, path, b'{"model": "soak", "messages": [')
    if kind == 1:
        return post(soak, path, chat([{"role": "user", "content": "hi"}], 8, temperature=-1))
    if kind == 2:
        return post(soak, path, chat([{"role": "user", "content": "hi"}], 8, frobnicate=True))
    if kind == 3:
        return post(soak, path, chat([{"role": "user", "content": "hi"}], 8), content_type="text/plain")
    return post(soak, path, json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode())


#: scenario -> weight in the mixed phase
SCENARIOS = {"chat": 4, "stream": 4, "drop": 2, "timeout": 1, "prefix": 3, "completion": 2, "tool": 1, "structured": 1,
             "bad": 2}


# -- the server's side -------------------------------------------------------------------------------


def get_json(soak: Soak, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{soak.port}{path}", timeout=30) as answer:
        return json.loads(answer.read())


def metrics(soak: Soak) -> dict[str, float]:
    """/metrics as {sample name with labels: value} (prometheus-client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{soak.port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def rss_mb(pid: int) -> float:
    """The resident set of process ``pid`` in MB (VmRSS of /proc/PID/status; Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def sample_rss(soak: Soak, every: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        try:
            soak.rss.append((time.monotonic() - soak.start, rss_mb(soak.process.pid)))
        except (OSError, RuntimeError):
            return  # the process is gone (the shutdown phase)


def settle(soak: Soak, phase: str, timeout: float = 60) -> None:
    """Wait until the server is idle (nothing running or waiting, 0 KV blocks); record the KV blocks then."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(soak)
        busy = now["lollm_requests_running"] + now["lollm_requests_waiting"]
        if (busy == 0 and now.get("lollm_kv_blocks_used", 0) == 0) or time.monotonic() > deadline:
            soak.kv_after[phase] = int(now.get("lollm_kv_blocks_used", 0))
            return
        time.sleep(0.2)


def start_server(model: str, port: int, args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "lollm.cli", "serve", model, "--port", str(port), "--model-name", NAME,
               "--shutdown-timeout", str(args.shutdown_timeout), *args.server_arg]
    print("$", " ".join(command), flush=True)
    process = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"lollm serve did not start (exit {process.poll()}):\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)


# -- the phases ---------------------------------------------------------------------------------------


def mixed(soak: Soak, seconds: float, clients: int, seed: int) -> None:
    """``clients`` threads send SCENARIOS requests, one after another, until ``seconds`` have passed."""
    until = time.monotonic() + seconds
    names, weights = list(SCENARIOS), list(SCENARIOS.values())

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < until:
            soak.record("mixed", scenario(soak, rng.choices(names, weights)[0], rng))

    at_once(client, clients)


def at_once(work, count: int) -> None:
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def overload(soak: Soak, burst: int) -> None:
    """``burst`` short requests at the same moment: each 200, or 503 with code server_overloaded."""
    gate = threading.Barrier(burst)

    def one(index: int) -> None:
        gate.wait()
        # the last of --max-queue waiting requests runs only after all those before it: a longer bound than --hang
        out = post(soak, "/v1/chat/completions", chat([{"role": "user", "content": f"Say {index}."}], 8),
                   timeout=None, hang=3 * soak.hang)
        out.scenario = "overload"
        soak.record("overload", out)

    at_once(one, burst)


def disconnect_storm(soak: Soak, count: int) -> None:
    """``count`` streams dropped after their first chunk and ``count`` requests given up after 0.2 s, all at once."""
    gate = threading.Barrier(2 * count)

    def one(index: int) -> None:
        gate.wait()
        stream = index < count
        body = chat([{"role": "user", "content": f"Count slowly from {index}."}], 300, stream=stream)
        out = post(soak, "/v1/chat/completions", body, stream=stream, drop_after=1 if stream else None,
                   timeout=None if stream else 0.2)
        out.scenario = "storm"
        soak.record("storm", out)

    at_once(one, 2 * count)


def shutdown(soak: Soak, deadline: float) -> dict[str, object]:
    """SIGTERM with 4 streams and 4 plain requests of 10**9 tokens in flight; the exit status and its time."""
    threads = []
    for index in range(8):
        stream = index % 2 == 0
        body = chat([{"role": "user", "content": f"Write a long story number {index}."}], 10**9, stream=stream)

        def one(body=body, stream=stream) -> None:
            out = post(soak, "/v1/chat/completions", body, stream=stream)
            out.scenario = "shutdown stream" if stream else "shutdown plain"
            soak.record("shutdown", out)

        threads.append(threading.Thread(target=one, daemon=True))
        threads[-1].start()
    until = time.monotonic() + 60
    while metrics(soak)["lollm_requests_running"] < 1 and time.monotonic() < until:
        time.sleep(0.1)
    time.sleep(1.0)
    signalled = time.monotonic()
    soak.process.send_signal(signal.SIGTERM)
    try:
        status = soak.process.wait(timeout=deadline + 60)
    except subprocess.TimeoutExpired:
        soak.process.kill()
        status = "hang"
    exited = time.monotonic() - signalled
    for thread in threads:
        thread.join(timeout=30)
    said = [line.split("INFO:", 1)[-1].strip() for line in soak.log_path.read_text(errors="replace").splitlines()
            if "after the signal" in line]  # the server's own measure, from its signal handler to its last line
    return {"exit_status": status, "seconds_to_exit": round(exited, 2), "bound": deadline + 2,
            "server_says": said[-1] if said else None}


# -- the report -----------------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(pick(0.5), 3), "p95": round(pick(0.95), 3), "p99": round(pick(0.99), 3),
            "max": round(ordered[-1], 3)}


def slope_mb_per_minute(samples: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, MB) samples, in MB per minute (None: fewer than 3 samples)."""
    if len(samples) < 3:
        return None
    xs, ys = [t for t, _ in samples], [m for _, m in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else None


def status_table(soak: Soak) -> dict[str, dict[str, object]]:
    """Per phase and scenario: how many of each status, and latency percentiles of the 200s."""
    table: dict[str, dict[str, object]] = {}
    for phase, outcomes in soak.outcomes.items():
        by = defaultdict(list)
        for out in outcomes:
            by[out.scenario].append(out)
        for name, group in sorted(by.items()):
            table[f"{phase}/{name}"] = {"statuses": dict(Counter(str(o.status) for o in group)),
                                        "latency_s": percentiles([o.seconds for o in group if o.status == 200])}
    return table


def problems(soak: Soak, counters: dict[str, object], shut: dict[str, object], args: argparse.Namespace,
             slope: float | None) -> list[str]:
    """Everything that makes the run fail, one line each."""
    found = []
    for phase, outcomes in soak.outcomes.items():
        for out in outcomes:
            expected_503 = out.status == 503 and out.code in ("server_overloaded", "server_shutting_down")
            if isinstance(out.status, int) and out.status >= 500 and not expected_503:
                found.append(f"{phase}/{out.scenario}: HTTP {out.status} ({out.code})")
            elif out.status == "hang" or str(out.status).startswith("error"):
                found.append(f"{phase}/{out.scenario}: {out.status} after {out.seconds:.1f} s")
            elif out.scenario == "bad" and not (isinstance(out.status, int) and 400 <= out.status < 500):
                found.append(f"{phase}/bad: a body that must be refused got {out.status}")
            elif out.scenario != "bad" and isinstance(out.status, int) and 400 <= out.status < 500:
                found.append(f"{phase}/{out.scenario}: a valid request got HTTP {out.status} ({out.code})")
            elif out.scenario == "shutdown stream" and out.status == 200 and out.finish not in ("shutdown", "stop", "length"):
                found.append(f"shutdown: a stream ended without its last chunk (finish {out.finish})")
    log = soak.log_path.read_text(errors="replace")
    for needle in ("Traceback", "internal error"):
        if needle in log:
            found.append(f"the server's log holds {needle!r} ({log.count(needle)} times)")
    found += [f"{blocks} KV blocks still used after the {phase} phase" for phase, blocks in soak.kv_after.items() if blocks]
    if counters["cancellations_logged"] != counters["server"]["cancelled"]:
        found.append(f"{counters['cancellations_logged']} cancellations logged, {counters['server']['cancelled']} counted")
    if counters["server_finished"] != counters["client_engine_requests"] or counters["server"]["failed"]:
        found.append(f"counters: {counters}")
    if counters["metrics_by_outcome"] != counters["server"]:
        found.append(f"/metrics and /health disagree: {counters['metrics_by_outcome']} vs {counters['server']}")
    if shut["exit_status"] != 0 or shut["seconds_to_exit"] > shut["bound"]:
        found.append(f"shutdown: {shut}")
    if slope is not None and slope > args.max_slope:
        found.append(f"RSS grows {slope:.2f} MB/min over the second half of the mixed phase (bound {args.max_slope})")
    return found


def counters(soak: Soak) -> dict[str, object]:
    """The server's request counters beside the client's count of requests that reached the engine.

    A request reaches the engine when it was accepted (a 200), dropped, or given up by its client
    (those end "cancelled", or "completed" if they finished first); bad bodies and 503s never do.
    """
    server = get_json(soak, "/health")["requests"]
    samples = metrics(soak)
    by_outcome = {k: int(samples.get(f"lollm_requests_total{{outcome={k}}}", 0)) for k in server}
    engine = sum(1 for outcomes in soak.outcomes.values() for o in outcomes
                 if o.scenario != "bad" and (o.status == 200 or o.status in ("dropped", "timeout", "hang")))
    logged = soak.log_path.read_text(errors="replace").count("client went away: generation cancelled")
    return {"server": server, "metrics_by_outcome": by_outcome, "server_finished": sum(server.values()),
            "client_engine_requests": engine, "cancellations_logged": logged}


def rss_summary(soak: Soak, mixed_end: float) -> tuple[dict[str, object], float | None]:
    during = [(t, m) for t, m in soak.rss if t <= mixed_end]
    half = [(t, m) for t, m in during if t >= mixed_end / 2]
    slope = slope_mb_per_minute(half)
    values = [m for _, m in soak.rss] or [0.0]
    return {"start_mb": round(values[0], 1), "max_mb": round(max(values), 1), "end_mb": round(values[-1], 1),
            "samples": len(values), "slope_second_half_mb_per_min": None if slope is None else round(slope, 3),
            "series": [(round(t), round(m, 1)) for t, m in soak.rss]}, slope


def print_report(report: dict[str, object]) -> None:
    print("\n== soak report ==")
    print(f"{'phase/scenario':<26} {'statuses':<44} latency of 200s (s)")
    for key, row in report["table"].items():
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items()))
        latency = " ".join(f"{k} {v}" for k, v in row["latency_s"].items())
        print(f"{key:<26} {statuses:<44} {latency}")
    rss = report["rss"]
    print(f"RSS: start {rss['start_mb']} MB, max {rss['max_mb']} MB, end {rss['end_mb']} MB, slope over the second "
          f"half of the mixed phase {rss['slope_second_half_mb_per_min']} MB/min ({rss['samples']} samples)")
    print(f"KV blocks used once idle after each phase: {report['kv_after']}")
    print(f"counters: {report['counters']}")
    print(f"shutdown: {report['shutdown']}")
    print("problems:" if report["problems"] else "no problems: 0 unexpected 5xx, 0 hangs, 0 tracebacks, 0 leaked blocks")
    for line in report["problems"]:
        print("  -", line)


def run(args: argparse.Namespace) -> dict[str, object]:
    """The five phases against a server started here; the report (also written to ``args.report``)."""
    model = args.model or str(__import__("lollm.cli.real_models", fromlist=["fetch_gguf"]).fetch_gguf(MODEL))
    log_path = Path(args.log or tempfile.mkstemp(prefix="lollm-soak-", suffix=".log")[1])
    from lollm.testing.serving import free_port

    port = free_port()
    soak = Soak(port, start_server(model, port, args, log_path), log_path, args.hang)
    stop = threading.Event()
    threading.Thread(target=sample_rss, args=(soak, args.rss_every, stop), daemon=True).start()
    try:
        print(f"mixed traffic: {args.minutes} min, {args.clients} clients", flush=True)
        mixed(soak, args.minutes * 60, args.clients, args.seed)
        mixed_end = time.monotonic() - soak.start
        settle(soak, "mixed")
        print(f"overload: {args.burst} at once", flush=True)
        overload(soak, args.burst)
        settle(soak, "overload")
        print(f"disconnect storm: {args.storm} dropped streams + {args.storm} given-up requests", flush=True)
        disconnect_storm(soak, args.storm)
        settle(soak, "storm")
        counted = counters(soak)
        print(f"shutdown: SIGTERM with 8 requests in flight (--shutdown-timeout {args.shutdown_timeout})", flush=True)
        shut = shutdown(soak, args.shutdown_timeout)
    finally:
        stop.set()
        if soak.process.poll() is None:
            soak.process.kill()
    rss, slope = rss_summary(soak, mixed_end)
    report = {"model": model, "minutes": args.minutes, "clients": args.clients, "table": status_table(soak), "rss": rss,
              "kv_after": soak.kv_after, "counters": counted, "shutdown": shut, "log": str(log_path)}
    report["problems"] = problems(soak, counted, shut, args, slope)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint to serve (default: the real Qwen2.5-Coder 0.5B GGUF, fetched once)")
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the mixed phase (default 30)")
    parser.add_argument("--clients", type=int, default=24, help="client threads in the mixed phase (default 24)")
    parser.add_argument("--burst", type=int, default=300, help="requests at once in the overload phase")
    parser.add_argument("--storm", type=int, default=48, help="dropped streams (and as many given-up requests)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0, help="lollm serve --shutdown-timeout")
    parser.add_argument("--hang", type=float, default=300.0, help="seconds without an answer that count as a hang")
    parser.add_argument("--max-slope", type=float, default=1.0, help="RSS slope bound, MB per minute (default 1)")
    parser.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", help="write the report as JSON to this file")
    parser.add_argument("--log", help="the server's log file (default: a temporary file, named in the report)")
    parser.add_argument("--server-arg", action="append", default=[], help="one more argument for lollm serve (repeat)")
    args = parser.parse_args()
    report = run(args)
    print_report(report)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    main()
