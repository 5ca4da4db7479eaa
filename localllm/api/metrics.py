"""Prometheus metrics in vLLM's style (``localllm:`` instead of ``vllm:``), in a registry of their own.

Gauges and counters are read from :meth:`AsyncEngine.stats` at scrape time, so they are always
current and counters stay monotonic; latency histograms are observed from the deltas the
handlers receive (``RequestOutput.timings``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from localllm.async_engine import AsyncEngine
from localllm.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"localllm:{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"localllm:{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", s.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prefix cache queries, in tokens.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prefix cache hits, in tokens.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions of running requests.", s.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens of accepted requests.", s.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter(
            "nonfinite_logits_rows",
            "Sampled rows whose logits held NaN/inf (their request failed) or overflowed at the temperature.",
            s.num_nonfinite_rows,
        )
        yield counter("model_step_failures", "Model steps that raised (retried, then isolated).", s.num_step_failures)
        health = self.engine.health()
        yield gauge(
            "engine_seconds_since_heartbeat",
            "Seconds since the engine loop last finished a step or idled (the watchdog's measure).",
            health.seconds_since_heartbeat,
        )
        yield gauge("engine_stalled", "1 while a step has run longer than the stall timeout.", float(health.stalled))
        yield gauge("engine_alive", "1 while the engine loop runs.", float(self.engine.is_alive))
        success = CounterMetricFamily(
            "localllm:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason in sorted(set(s.request_success) | {"stop", "length", "abort", "error"}):
            success.add_metric([self.model_name, reason], s.request_success.get(reason, 0))
        yield success


class Metrics:
    """The registry behind ``GET /metrics`` of one server."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(engine, model_name))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"localllm:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", _TOKEN_LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first being scheduled.", _LATENCY_BUCKETS
        )

        self.embedding_batch_size = Histogram(
            "localllm:embedding_batch_size", "Sequences per embedding batch (the dynamic batching window's).",
            ["model_name"], buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry,
        ).labels(model_name)
        batcher = getattr(engine, "embeddings", None)
        if batcher is not None:
            batcher.on_batch = self.embedding_batch_size.observe

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Observes the latency histograms from the deltas of one API request (all its samples)."""

    __slots__ = ("metrics", "last_time")

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.last_time: dict[tuple[str, int], float] = {}

    def observe(self, out: RequestOutput) -> None:
        m = self.metrics
        key = (out.req_id, out.index)
        last = self.last_time.get(key)
        if last is None:
            t = out.timings
            if t.ttft is not None:
                m.time_to_first_token.observe(t.ttft)
            if t.queue_time is not None:
                m.request_queue_time.observe(t.queue_time)
        else:
            m.inter_token_latency.observe(max(out.time - last, 0.0))
        self.last_time[key] = out.time
        if out.finished:
            m.e2e_request_latency.observe(max(out.time - out.timings.arrival, 0.0))
