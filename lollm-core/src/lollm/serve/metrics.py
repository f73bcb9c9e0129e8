"""``GET /metrics`` of ``lollm serve``: what the server is doing, in Prometheus' text format.

Made with the official client library (``prometheus-client``, in the ``serve`` extra), on a
registry of the server's own (never the library's global one), so two servers in one
process (tests) keep their numbers apart. The metrics (docs/serving.md, "Metrics"):

========================================  =========  ================================================
name                                      type       what
========================================  =========  ================================================
lollm_requests_running                    gauge      requests in the running batch (prefill or decode)
lollm_requests_waiting                    gauge      requests queued, not running yet
lollm_kv_blocks_used / _total             gauge      KV blocks held by requests / in the pool (engine)
lollm_kv_window_blocks_used / _total      gauge      the same in the sliding-window layers' own pool
lollm_generated_tokens_total              counter    tokens generated; its rate is the output tok/s
lollm_prompt_tokens_total                 counter    prompt tokens of finished requests
lollm_prompt_cached_tokens_total          counter    of those, the ones the prefix cache supplied
lollm_time_to_first_token_seconds         histogram  from a request's arrival to its first token
lollm_engine_step_requests                histogram  requests that got a token in one engine step
lollm_requests_total{outcome}             counter    finished requests: completed, cancelled, failed
========================================  =========  ================================================

With several models (lollm.serve.models) each model's server has its own registry, and
``/metrics`` shows them together, every series labelled ``model="<name>"`` (:func:`labelled_by_model`).

Gauges read their value when scraped (``Gauge.set_function``), from a ``stats()`` callable:
the engine's :meth:`~lollm.engine.Engine.stats`, or the single-sequence worker's counts.
"""

from __future__ import annotations

from typing import Callable

# Lazy imports below: prometheus-client is part of the optional ``serve`` extra, imported inside the
# functions that use it, so this module loads (and /metrics answers 501) without it.

#: Time-to-first-token buckets, seconds: from a warm tiny model to a long prompt on a CPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Requests per engine step: powers of two up to the largest --max-running worth trying.
STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: The Content-Type of the text format (version 0.0.4), as Prometheus asks for it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metrics_available() -> bool:
    """Whether ``prometheus-client`` is installed (``pip install 'lollm-core[serve]'``)."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


class ServerMetrics:
    """The metrics of one server on their own ``CollectorRegistry``.

    stats: called at each scrape; returns a dict with "running" and "waiting" (ints), and with a
           batched engine "kv_blocks_used" and "kv_blocks_total" (the kv gauges exist only then),
           and "kv_window_blocks_used" / "_total" for a model with sliding-window layers.
    Raises ImportError when prometheus-client is missing (see :func:`metrics_available`).
    """

    def __init__(self, stats: Callable[[], dict[str, int]], *, kv_blocks: bool):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        gauges = {"running": "requests in the running batch (prefill or decode)",
                  "waiting": "requests queued, not running yet"}
        if kv_blocks:
            gauges |= {"kv_blocks_used": "KV cache blocks held by requests",
                       "kv_blocks_total": "KV cache blocks in the pool"}
            if "kv_window_blocks_used" in stats():  # sliding-window layers: their own pool (lollm.engine.cache)
                gauges |= {"kv_window_blocks_used": "sliding-window layers' KV blocks held by requests",
                           "kv_window_blocks_total": "sliding-window layers' KV blocks in their pool"}
        for key, text in gauges.items():
            name = f"lollm_requests_{key}" if key in ("running", "waiting") else f"lollm_{key}"
            Gauge(name, text, registry=registry).set_function(lambda key=key: stats()[key])
        self.generated = Counter("lollm_generated_tokens", "tokens generated (rate: output tokens per second)",
                                 registry=registry)
        self.prompt = Counter("lollm_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.cached = Counter("lollm_prompt_cached_tokens", "prompt tokens the cache supplied (not computed again)",
                              registry=registry)
        self.ttft = Histogram("lollm_time_to_first_token_seconds", "seconds from a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.step = Histogram("lollm_engine_step_requests", "requests that got a new token in one engine step",
                              buckets=STEP_BUCKETS, registry=registry)
        self.requests = Counter("lollm_requests", "finished requests by outcome", ["outcome"], registry=registry)

    def token(self, time_to_first: float | None = None) -> None:
        """One token generated; ``time_to_first``: it was its request's first, after that many seconds."""
        self.generated.inc()
        if time_to_first is not None:
            self.ttft.observe(time_to_first)

    def engine_step(self, requests: int) -> None:
        """One engine step gave a token to ``requests`` requests."""
        self.step.observe(requests)

    def finished(self, outcome: str, prompt_tokens: int, cached_tokens: int) -> None:
        """A request ended ("completed", "cancelled", "failed"), with its prompt's size and cached part."""
        self.requests.labels(outcome=outcome).inc()
        self.prompt.inc(prompt_tokens)
        self.cached.inc(cached_tokens)

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def metrics_for(stats: Callable[[], dict[str, int]], *, kv_blocks: bool) -> ServerMetrics | None:
    """A :class:`ServerMetrics`, or None when prometheus-client is not installed (``/metrics`` then says so)."""
    return ServerMetrics(stats, kv_blocks=kv_blocks) if metrics_available() else None


def labelled_by_model(metrics: dict[str, ServerMetrics]) -> bytes:
    """The series of several models' metrics (``{model name: ServerMetrics}``) in one text, each with ``model="name"``.

    Each metric family appears once, holding every model's samples (Prometheus' text format
    allows a family's HELP and TYPE lines only once).
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric

    families: dict[str, Metric] = {}
    for model, server_metrics in metrics.items():
        for family in server_metrics.registry.collect():
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            merged.samples += [sample._replace(labels={**sample.labels, "model": model}) for sample in family.samples]

    class Merged:  # a collector: what prometheus-client's registry asks each one for
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(Merged())
    return generate_latest(registry)
