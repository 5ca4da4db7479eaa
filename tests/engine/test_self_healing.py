"""A real ``localllm serve`` with faults injected by a launcher (test code only): a request whose
model step fails gets an OpenAI-shaped 500 (in a stream: an error event, then [DONE]) while
everyone else is served; a dead engine loop makes the server exit non-zero within seconds, so
that systemd's ``Restart=on-failure`` / launchd's ``KeepAlive`` start a new one."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from api_server import _READY
from tiny_models import write_tiny_model

STEP_POISON = 200  # a prompt token: model steps with this request in them raise
LOOP_POISON = 201  # a prompt token: the scheduler raises (a bug outside any request)

LAUNCHER = f"""
import sys
from localllm.engine.model_runner import ModelRunner
from localllm.scheduler.scheduler import Scheduler

real_execute, real_schedule = ModelRunner.execute, Scheduler.schedule

def execute(self, out):
    if any({STEP_POISON} in s.request.prompt_token_ids for s in out.scheduled):
        raise RuntimeError("injected kernel fault")
    return real_execute(self, out)

def schedule(self):
    if any({LOOP_POISON} in r.prompt_token_ids for _, r in self.waiting):
        raise AssertionError("injected scheduler bug")
    return real_schedule(self)

ModelRunner.execute, Scheduler.schedule = execute, schedule
from localllm.cli import main
sys.argv = ["localllm", "serve", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("heal") / "tiny.gguf", seed=3)
    log = tmp_path_factory.mktemp("heal-log")
    out, err = open(log / "out", "wb"), open(log / "err", "wb")  # noqa: SIM115 (the server's, for its life)
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(path), "--host", "127.0.0.1", "--port", "0", "--kv-cache-memory", "16MiB"],
        stdout=out, stderr=err,
    )
    deadline = time.monotonic() + 120
    url = None
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        m = _READY.search((log / "out").read_text(errors="replace"))
        url = m.group(1) if m else None
        time.sleep(0.1)
    try:
        assert url, (log / "out").read_text() + (log / "err").read_text()
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _metric(url: str, name: str, label: str = "") -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{label} not in /metrics")


def test_a_failing_request_gets_500_the_others_go_on_and_a_dead_loop_exits_nonzero(server):
    proc, url, log = server
    body = {"prompt": [1, 2, STEP_POISON], "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "internal_error" and "injected kernel fault" in err["message"]

    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "injected kernel fault" in json.loads(events[-2])["error"]["message"]

    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True},
                    timeout=60)  # (sampled: an end-of-text token would end it sooner)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert _metric(url, "localllm:request_success_total", 'finished_reason="error"') == 2
    assert _metric(url, "localllm:model_step_failures_total") >= 4  # two tries for each failed request
    assert _metric(url, "localllm:engine_alive") == 1
    assert _metric(url, "localllm:engine_stalled") == 0

    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, LOOP_POISON], "max_tokens": 2}, timeout=60)
    assert r.status_code == 503, r.text
    assert proc.wait(15) != 0
    assert time.monotonic() - t0 < 15
    stderr = (log / "err").read_text()
    assert "injected scheduler bug" in stderr and "the engine stopped" in stderr
