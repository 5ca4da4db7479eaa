"""Prometheus metrics in vLLM's style (``localllm:`` instead of ``vllm:``), in a registry of their own.

Gauges and counters are read from :meth:`AsyncEngine.stats` at scrape time, so they are always
current and counters stay monotonic; latency histograms are observed from the deltas the
handlers receive (``RequestOutput.timings``).

Beside them, the gauges of the Kubernetes Gateway API Inference Extension's model-server protocol
(docs/proposals/003-model-server-protocol), under the names its endpoint picker (and llm-d's)
reads from vLLM: :data:`GATEWAY_GAUGES`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from localllm.engine.async_engine import AsyncEngine
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


GATEWAY_GAUGES = {
    "vllm:num_requests_waiting": "TotalQueuedRequests",
    "vllm:num_requests_running": "TotalRunningRequests",
    "vllm:kv_cache_usage_perc": "KVCacheUtilization",
    "vllm:cache_config_info": "BlockSize (label block_size), NumGPUBlocks (label num_gpu_blocks)",
    "vllm:lora_requests_info": "LoRA adapters (labels max_lora, running_lora_adapters, waiting_lora_adapters)",
}
"""The model-server protocol's metrics (name: what the protocol calls it), all gauges labelled with
``model_name``. localllm serves no LoRA adapters: ``max_lora`` is 0 and both lists are empty."""


def _gateway_families(engines, now: float) -> list[GaugeMetricFamily]:
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled (the inference "
                                "gateway's TotalQueuedRequests).", labels=["model_name"])
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch (the inference "
                                "gateway's TotalRunningRequests).", labels=["model_name"])
    usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use, 1 = full (the "
                              "inference gateway's KVCacheUtilization).", labels=["model_name"])
    cache = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration, in its labels.",
                              labels=["model_name", "block_size", "num_gpu_blocks"])
    lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters running and waiting (none: localllm "
                             "serves none), as of the value's Unix time.",
                             labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    for model_name, s in engines:
        waiting.add_metric([model_name], s.num_waiting)
        running.add_metric([model_name], s.num_running)
        usage.add_metric([model_name], s.kv_cache_usage)
        cache.add_metric([model_name, str(s.block_size), str(s.num_blocks)], 1.0)
        lora.add_metric([model_name, "0", "", ""], now)
    return [waiting, running, usage, cache, lora]


class _EngineCollector(Collector):
    """Every loaded model's gauges and counters, labelled with its name, read at scrape time."""

    def __init__(self, engines: Callable[[], list[tuple[str, AsyncEngine]]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        engines = self.engines()
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(kind, name: str, doc: str, model_name: str, value: float) -> None:
            family = families.get(name)
            if family is None:
                family = families[name] = kind(f"localllm:{name}", doc, labels=["model_name"])
            family.add_metric([model_name], value)

        stats = []
        success = CounterMetricFamily(
            "localllm:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for model_name, engine in engines:
            s = engine.stats()
            stats.append((model_name, s))
            gauge, counter = GaugeMetricFamily, CounterMetricFamily
            add(gauge, "num_requests_running", "Requests in the running batch.", model_name, s.num_running)
            add(gauge, "num_requests_waiting", "Requests waiting to be scheduled.", model_name, s.num_waiting)
            add(gauge, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", model_name,
                s.kv_cache_usage)
            add(counter, "prefix_cache_queries", "Prefix cache queries, in tokens.", model_name,
                s.prefix_cache_queries)
            add(counter, "prefix_cache_hits", "Prefix cache hits, in tokens.", model_name, s.prefix_cache_hits)
            add(counter, "num_preemptions", "Preemptions of running requests.", model_name, s.num_preemptions)
            add(counter, "prompt_tokens", "Prompt tokens of accepted requests.", model_name, s.prompt_tokens)
            add(counter, "generation_tokens", "Generated tokens.", model_name, s.generation_tokens)
            add(counter, "nonfinite_logits_rows",
                "Sampled rows whose logits held NaN/inf (their request failed) or overflowed at the temperature.",
                model_name, s.num_nonfinite_rows)
            add(counter, "model_step_failures", "Model steps that raised (retried, then isolated).", model_name,
                s.num_step_failures)
            add(counter, "spec_decode_num_draft_tokens", "Speculative decoding: tokens drafted and verified.",
                model_name, s.spec_drafted_tokens)
            add(counter, "spec_decode_num_accepted_tokens", "Speculative decoding: drafted tokens the model "
                "agreed with.", model_name, s.spec_accepted_tokens)
            health = engine.health()
            add(gauge, "engine_seconds_since_heartbeat",
                "Seconds since the engine loop last finished a step or idled (the watchdog's measure).",
                model_name, health.seconds_since_heartbeat)
            add(gauge, "engine_stalled", "1 while a step has run longer than the stall timeout.", model_name,
                float(health.stalled))
            add(gauge, "engine_alive", "1 while the engine loop runs.", model_name, float(engine.is_alive))
            for reason in sorted(set(s.request_success) | {"stop", "length", "abort", "error"}):
                success.add_metric([model_name, reason], s.request_success.get(reason, 0))
        yield from families.values()
        yield success
        yield from _gateway_families(stats, time.time())
        loaded = GaugeMetricFamily("localllm:models_loaded", "Models loaded in this server now.")
        loaded.add_metric([], len(engines))
        yield loaded


class Metrics:
    """The registry behind ``GET /metrics`` of one server: every loaded model's, labelled by name.

    ``engines()`` returns the loaded ``(model_name, engine)`` pairs at scrape time."""

    def __init__(self, engines: Callable[[], list[tuple[str, AsyncEngine]]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engines))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"localllm:{name}", doc, ["model_name"], buckets=buckets, registry=self.registry)

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
        self.embedding_batch_size = histogram(
            "embedding_batch_size", "Sequences per embedding batch (the dynamic batching window's).",
            (1, 2, 4, 8, 16, 32, 64),
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def for_model(self, model_name: str, engine: AsyncEngine | None = None) -> ModelMetrics:
        """The histograms of one model (and its embedding batches, when ``engine`` is given)."""
        return ModelMetrics(self, model_name, engine)


class ModelMetrics:
    """One model's children of the histograms; :meth:`tracker` per API request."""

    def __init__(self, metrics: Metrics, model_name: str, engine: AsyncEngine | None) -> None:
        self.model_name = model_name
        self.time_to_first_token = metrics.time_to_first_token.labels(model_name)
        self.inter_token_latency = metrics.inter_token_latency.labels(model_name)
        self.e2e_request_latency = metrics.e2e_request_latency.labels(model_name)
        self.request_queue_time = metrics.request_queue_time.labels(model_name)
        self.embedding_batch_size = metrics.embedding_batch_size.labels(model_name)
        self.render = metrics.render
        batcher = getattr(engine, "embeddings", None)
        if batcher is not None:
            batcher.on_batch = self.embedding_batch_size.observe

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Observes the latency histograms from the deltas of one API request (all its samples)."""

    __slots__ = ("last_time", "metrics")

    def __init__(self, metrics: ModelMetrics) -> None:
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
        elif out.new_token_ids:  # several at once with speculative decoding: the step's time shared among them
            gap = max(out.time - last, 0.0) / len(out.new_token_ids)
            for _ in out.new_token_ids:
                m.inter_token_latency.observe(gap)
        self.last_time[key] = out.time
        if out.finished:
            m.e2e_request_latency.observe(max(out.time - out.timings.arrival, 0.0))
