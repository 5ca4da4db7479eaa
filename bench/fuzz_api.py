"""Fuzz the HTTP API for longer than CI does: the strategies of ``tests/api/test_api_fuzz.py``
(``tests/api_strategies.py``) against one real ``localllm serve``, sequentially.

    python bench/fuzz_api.py [--examples 2000] [--minutes 10] [--seed 0] [--model PATH | --url URL]

Stops after ``--examples`` requests or ``--minutes``, whichever comes first. Every answer is
checked as in the test (no 5xx, no dropped connection, OpenAI-shaped errors, streams ending with
``data: [DONE]``, a normal request answered 200 afterwards); problems are listed with the request
that caused them, and the exit status is 1 if there were any. Prints a table of the statuses seen
by kind of request, and what /metrics says once idle. Without ``--model`` or ``--url`` it serves a
tiny random model (fast; ``--model`` takes a GGUF path or catalog name instead).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

import httpx
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
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings


class _Stop(Exception):
    """Raised inside the hypothesis loop once the time or example budget is spent."""


def fuzz(
    url: str,
    examples: int,
    minutes: float,
    seed_value: int,
    server: ServerProcess | None,
    max_request_bytes: int | None,
):
    counts: Counter[tuple[str, str]] = Counter()
    problems: list[tuple[FuzzRequest, str, list[str]]] = []
    deadline = time.monotonic() + minutes * 60
    done = 0
    client = httpx.Client(base_url=url, timeout=httpx.Timeout(120.0))

    @seed(seed_value)
    @settings(
        max_examples=10**9,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        verbosity=Verbosity.quiet,
        suppress_health_check=list(HealthCheck),
    )
    @given(req=api_requests())
    def one(req: FuzzRequest) -> None:
        nonlocal done
        if done >= examples or time.monotonic() > deadline:
            raise _Stop
        done += 1
        res = req.send(client)
        counts[(req.kind + (" stream" if req.wants_stream else ""), res.label)] += 1
        found = check_response(req, res, max_request_bytes)
        try:
            probe = client.post(PROBE_PATH, json=PROBE_BODY)
            if probe.status_code != 200:
                found.append(f"the probe after it got {probe.status_code}: {probe.text[:300]}")
        except httpx.TransportError as exc:
            found.append(f"the probe after it failed: {exc!r}")
        if server is not None and server.proc.poll() is not None:
            found.append(f"the server exited with {server.proc.returncode}")
        if found:
            problems.append((req, res.label, found))
            print(f"PROBLEM #{len(problems)}: {req!r}\n  -> {res.label}: {found}", flush=True)
            if server is not None and server.proc.poll() is not None:
                raise _Stop
        if done % 100 == 0:
            print(f"{done} requests, {len(problems)} problems", flush=True)

    start = time.monotonic()
    try:
        one()
    except _Stop:
        pass
    elapsed = time.monotonic() - start

    # Idle state once everything has ended: nothing running, no KV block held.
    gauges: dict[str, float] = {}
    for _ in range(50):
        try:
            from prometheus_client.parser import text_string_to_metric_families

            text = client.get("/metrics").text
        except httpx.TransportError:
            break
        gauges = {
            s.name.removeprefix("localllm:"): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name
            in (
                "localllm:num_requests_running",
                "localllm:num_requests_waiting",
                "localllm:kv_cache_usage_perc",
            )
        }
        if gauges and all(v == 0 for v in gauges.values()):
            break
        time.sleep(0.2)
    client.close()
    return counts, problems, gauges, done, elapsed


def table(counts: Counter) -> str:
    statuses = sorted({s for _, s in counts}, key=lambda s: (not s.isdigit(), s))
    kinds = sorted({k for k, _ in counts})
    head = "| kind | " + " | ".join(statuses) + " | total |\n|" + "---|" * (len(statuses) + 2) + "\n"
    rows = []
    for k in kinds:
        cells = [str(counts.get((k, s), "")) for s in statuses]
        rows.append(f"| {k} | " + " | ".join(cells) + f" | {sum(counts[(k, s)] for s in statuses)} |")
    total = [str(sum(counts[(k, s)] for k in kinds)) for s in statuses]
    rows.append("| **all** | " + " | ".join(total) + f" | {sum(counts.values())} |")
    return head + "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="requests to send at most")
    ap.add_argument("--minutes", type=float, default=10.0, help="time budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="GGUF path or catalog name to serve (default: a tiny random model)")
    ap.add_argument("--url", help="fuzz a running server instead (it must answer the probe request)")
    args = ap.parse_args()

    server = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        model = args.model
        if model is None:
            from tiny_models import write_tiny_model

            model = str(write_tiny_model(Path(tempfile.mkdtemp(prefix="localllm-fuzz-")) / "tiny.gguf"))
        server = ServerProcess(model, *SERVER_ARGS)
        url = server.wait_ready()
        print(f"serving {model} at {url} (logs in {server.log_dir})", flush=True)
    try:
        counts, problems, gauges, done, elapsed = fuzz(
            url, args.examples, args.minutes, args.seed, server, None if args.url else MAX_REQUEST_BYTES
        )
    finally:
        if server is not None:
            server.terminate()

    print(f"\n{done} requests in {elapsed:.0f} s, seed {args.seed}; statuses by kind of request:\n")
    print(table(counts))
    print(f"\nidle afterwards: {gauges or 'unreadable'}")
    leaked = not gauges or any(v != 0 for v in gauges.values())
    print(f"problems: {len(problems)}" + ("" if not leaked else "; state NOT idle after the run"))
    for i, (req, label, found) in enumerate(problems, 1):
        print(f"\n#{i} {label}: {req!r}\n   " + "\n   ".join(found))
    if server is not None and "Traceback" in server.stderr_path.read_text(errors="replace"):
        print(f"\nthe server logged tracebacks: see {server.stderr_path}")
    return 1 if problems or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
