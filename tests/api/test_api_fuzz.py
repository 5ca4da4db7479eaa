"""Property-based fuzzing of the HTTP API against one real ``localllm serve`` (a tiny random model).

Requests come from :mod:`api_strategies` (the protocol's JSON schemas, wrong types, extreme
numbers, odd text, huge and empty lists, extra fields, raw non-JSON bodies, odd content types).
Whatever is sent, the server must answer: never a 5xx, never a dropped connection, errors
OpenAI-shaped, streams ended by ``data: [DONE]``, and a normal request answered 200 afterwards;
once idle, nothing holds a running slot or a KV block. ``bench/fuzz_api.py`` runs the same for longer.
"""

from __future__ import annotations

import time

import httpx
import pytest
from api_server import ServerProcess
from api_strategies import (
    MAX_REQUEST_BYTES,
    PROBE_BODY,
    PROBE_PATH,
    SERVER_ARGS,
    FuzzRequest,
    api_requests,
    check_response,
)
from hypothesis import HealthCheck, given, note, seed, settings
from prometheus_client.parser import text_string_to_metric_families
from tiny_models import write_tiny_model

pytestmark = pytest.mark.timeout(300)



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    proc = ServerProcess(model, *SERVER_ARGS)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60.0)) as c:
        yield c


def _stderr_tail(server: ServerProcess) -> str:
    return server.stderr_path.read_text(errors="replace")[-4000:]


@seed(20261130)
@settings(
    max_examples=120,
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
@given(req=api_requests())
def test_any_request_gets_a_clean_answer(server, client, req: FuzzRequest):
    res = req.send(client)
    note(f"answer: {res.label} {res.body[:1000]!r}")
    problems = check_response(req, res, MAX_REQUEST_BYTES)
    assert not problems, f"{problems}\nserver stderr:\n{_stderr_tail(server)}"
    probe = client.post(PROBE_PATH, json=PROBE_BODY)
    assert probe.status_code == 200, (
        f"{probe.status_code} {probe.text}\nserver stderr:\n{_stderr_tail(server)}"
    )
    assert server.proc.poll() is None, f"the server exited\n{server.output()[-4000:]}"


def test_chunked_oversize_body_gets_413(client):
    """A body over --max-request-bytes sent without Content-Length (chunked) is refused with 413,
    like one that declares its length."""
    body = b'{"prompt":"' + b"x" * (2 * MAX_REQUEST_BYTES) + b'","max_tokens":1}'
    declared = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert declared.status_code == 413, declared.text

    def chunks():
        for i in range(0, len(body), 65536):
            yield body[i : i + 65536]

    chunked = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    assert chunked.json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_streams_to_the_end(client):
    """Found by the fuzz: a body read in chunks (no Content-Length) is buffered by the body check;
    its replay must not tell the streaming response that the client went away."""
    body = b'{"max_tokens":3,"ignore_eos":true,"messages":[{"role":"user","content":"hi"}],"stream":true}'
    with client.stream("POST", "/v1/chat/completions", content=iter([body[:20], body[20:]]),
                       headers={"Content-Type": "application/json"}) as r:
        assert r.status_code == 200
        assert "content-length" not in {k.lower() for k in r.request.headers}
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def _gauges(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name
        in ("localllm:num_requests_running", "localllm:num_requests_waiting", "localllm:kv_cache_usage_perc")
    }


def test_nothing_leaked_after_fuzz(server, client):
    """After the fuzz (this runs after it), an idle server holds no request and no KV block."""
    deadline = time.monotonic() + 10
    while True:
        gauges = _gauges(client)
        if all(v == 0 for v in gauges.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert gauges == {
        "localllm:num_requests_running": 0,
        "localllm:num_requests_waiting": 0,
        "localllm:kv_cache_usage_perc": 0,
    }, gauges
    assert client.get("/health").status_code == 200
    assert "Traceback" not in server.stderr_path.read_text(errors="replace"), _stderr_tail(server)
