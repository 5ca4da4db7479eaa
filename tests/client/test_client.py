"""The one place for a server's wire formats (localllm/client/http.py), which the CLI, the TUI and
the tray read a server through."""

from __future__ import annotations

import asyncio

from localllm.api.metrics import GATEWAY_GAUGES
from localllm.client.http import asse_chunks, error_message, metric_values, sse_chunks
from localllm.tray.model import parse_gauges
from localllm.tui.backend import parse_metrics

# what `localllm serve` exports for two loaded models: its own gauges, and the same request gauges
# again under vLLM's names for inference gateways
SCRAPE = """# HELP localllm:num_requests_running Requests running
# TYPE localllm:num_requests_running gauge
localllm:num_requests_running{model_name="a"} 2.0
localllm:num_requests_running{model_name="b"} 1.0
localllm:num_requests_waiting{model_name="a"} 4.0
localllm:kv_cache_usage_perc{model_name="a"} 0.25
localllm:spec_decode_num_draft_tokens_total{model_name="a"} 10.0
vllm:num_requests_running{model_name="a"} 2.0
vllm:num_requests_running{model_name="b"} 1.0
vllm:num_requests_waiting{model_name="a"} 4.0
vllm:kv_cache_usage_perc{model_name="a"} 0.25
"""


def test_a_gauge_served_under_two_namespaces_counts_once():
    assert {"num_requests_running", "num_requests_waiting"} <= {g.split(":")[1] for g in GATEWAY_GAUGES}
    values = metric_values(SCRAPE)
    assert values["num_requests_running"] == 3.0 and values["num_requests_waiting"] == 4.0
    assert values["spec_decode_num_draft_tokens"] == 10.0
    assert parse_gauges(SCRAPE) == (3, 4)  # the tray
    stats = parse_metrics(SCRAPE)  # the TUI
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (3, 4, 0.25)
    # a vLLM server: its own namespace
    assert metric_values("vllm:num_requests_running 5\n")["num_requests_running"] == 5.0


def test_server_sent_events_up_to_done():
    lines = [": keep-alive", 'data: {"a": 1}', "", "event: x", 'data: {"b": 2}', "data: [DONE]", 'data: {"c": 3}']
    assert list(sse_chunks(lines)) == [{"a": 1}, {"b": 2}]

    async def lines_async():
        for line in lines:
            yield line

    async def collect():
        return [c async for c in asse_chunks(lines_async())]

    assert asyncio.run(collect()) == [{"a": 1}, {"b": 2}]


def test_error_messages_of_openai_shaped_bodies():
    assert error_message('{"error": {"message": "model x not found", "type": "invalid_request_error"}}') == \
        "model x not found"
    assert error_message("Internal Server Error") == "Internal Server Error"
    assert error_message('{"detail": "no"}') == '{"detail": "no"}'
