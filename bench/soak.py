"""Soak test: minutes of mixed, partly hostile load on one real ``localllm serve`` from many
concurrent clients; at the end nothing may have failed on the server's side or leaked.

    python bench/soak.py [--minutes 10] [--clients 16] [--seed 0] [--model PATH | --url URL [--pid PID]]
                         [--write-docs]

Each client (asyncio + httpx, loopback only) loops until the time is up, one request at a time,
drawing its kind: chat and text completions (plain, streamed, ``n`` > 1), streams it drops after
a few chunks, requests it abandons before the answer, invalid requests (400), bodies over
``--max-request-bytes`` (413, declared or chunked), wrong content types (415); every generation
request carries a random ``priority``. Expected answers are counted by kind and status; a 5xx, a
connection the server dropped, a stream without ``data: [DONE]`` or with an error event, or a
status the kind should not get is *unexpected* (must be 0; 429 from a full queue is expected).
Then the server is left idle: no running or waiting request and no KV block in use (from
/metrics), and /health 200. Also reported: the server's RSS at the start and the end (VmRSS of
/proc/PID/status) and the tokens it generated. Exit status 1 if anything was unexpected.

``--write-docs`` writes the tables into docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import httpx
from _report import write_section

DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ["time", "person", "year", "way", "day", "thing", "world", "life", "hand", "part", "child", "eye", "woman", "place", "work", "week", "case", "point", "company", "number", "group", "problem", "fact", "river", "mountain", "city", "light", "music", "story", "garden", "window", "letter", "engine", "market", "island", "bridge", "winter", "summer", "forest", "ocean", "planet", "signal", "memory"]

# kind -> relative weight
KINDS = {
    "chat": 18,
    "completion": 12,
    "chat stream": 14,
    "completion stream": 8,
    "n > 1": 6,
    "stream disconnect": 8,
    "abort before answer": 7,
    "bad request": 10,
    "oversize body": 4,
    "wrong content type": 4,
}
EXPECTED = {"bad request": {400}, "oversize body": {413}, "wrong content type": {415}}
# What a client does to itself (not a server failure).
OWN_ENDINGS = ("disconnected", "aborted")


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (kind, outcome) -> count
    unexpected: list[str] = field(default_factory=list)
    completion_tokens: int = 0

    def add(self, kind: str, outcome: str, problem: str | None = None) -> None:
        self.outcomes[(kind, outcome)] += 1
        if problem is not None:
            self.unexpected.append(f"{kind}: {problem}")
            if len(self.unexpected) <= 20:
                print(f"UNEXPECTED {kind}: {problem}", flush=True)


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


MAX_TOKENS = 48  # --max-tokens: the most a request asks for (drawn from [min(4, it), it])


def _gen_fields(rng: random.Random) -> dict:
    fields = {
        "max_tokens": rng.randint(min(4, MAX_TOKENS), MAX_TOKENS),
        "priority": rng.choice([0, 0, rng.randint(-10, 10), 2**40]),
    }
    if rng.random() < 0.5:
        fields["temperature"] = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.2:
        fields["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.1:
        fields["stop"] = [rng.choice(WORDS)]
    return fields


def _chat_body(rng: random.Random) -> dict:
    messages = [{"role": "user", "content": f"Tell me about {_words(rng, 2, 12)}."}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "You are a concise assistant."})
    return {"messages": messages, **_gen_fields(rng)}


def _completion_body(rng: random.Random) -> dict:
    return {"prompt": f"The {_words(rng, 3, 30)}", **_gen_fields(rng)}


def _bad_body(rng: random.Random) -> bytes | dict:
    return rng.choice(
        [
            {"messages": [], "max_tokens": 4},
            {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"prompt": "hi", "max_tokens": "ten"},
            {"prompt": "hi", "max_tokens": 10**9},
            {"prompt": "hi", "n": 1000},
            {"prompt": [10**9]},
            {"prompt": "hi", "top_p": 0},
            {"prompt": "hi", "logprobs": 99},
            {"prompt": "hi", "stop": ["x"] * 100},
            b'{"prompt": "\\ud800", "max_tokens": 2}',
            b'{"prompt": "hi", "max_tokens": 1e999}',
            b"{not json",
            b"[]",
        ]
    )


@dataclass
class Config:
    url: str
    deadline: float
    max_request_bytes: int
    seed: int


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict, drop_after: int | None
) -> tuple[str, str | None]:
    """(outcome, problem) of one streamed request; ``drop_after``: close after that many events."""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return str(r.status_code), _status_problem(r.status_code, r.text)
        events = 0
        text = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events += 1
                text.append(line)
                if drop_after is not None and events >= drop_after and line != "data: [DONE]":
                    return "disconnected", None  # leaving the block closes the connection mid-stream
        if not text or text[-1] != "data: [DONE]":
            return "200", f"stream did not end with [DONE]: {text[-2:]}"
        errors = [t for t in text if t.startswith('data: {"error"')]
        if errors:
            return "200", f"stream error event: {errors[0][:300]}"
        return "200", None


def _status_problem(status: int, text: str) -> str | None:
    if status == 429:
        return None
    return f"HTTP {status}: {text[:300]}"


async def one_request(
    client: httpx.AsyncClient, kind: str, rng: random.Random, cfg: Config, tally: Tally
) -> None:
    json_headers = {"Content-Type": "application/json"}
    try:
        if kind in ("chat", "completion", "n > 1"):
            chat = kind == "chat" or (kind == "n > 1" and rng.random() < 0.5)
            body = _chat_body(rng) if chat else _completion_body(rng)
            if kind == "n > 1":
                body["n"] = rng.randint(2, 4)
                body["temperature"] = 1.0
            r = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
            problem = None if r.status_code == 200 else _status_problem(r.status_code, r.text)
            if r.status_code == 200:
                data = r.json()
                tally.completion_tokens += data["usage"]["completion_tokens"]
                if len(data["choices"]) != body.get("n", 1):
                    problem = f"{len(data['choices'])} choices for n={body.get('n', 1)}"
            tally.add(kind, str(r.status_code), problem)
        elif kind in ("chat stream", "completion stream", "stream disconnect"):
            chat = kind == "chat stream" or (kind == "stream disconnect" and rng.random() < 0.5)
            body = _chat_body(rng) if chat else _completion_body(rng)
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            drop = rng.randint(1, 6) if kind == "stream disconnect" else None
            if drop is not None:
                body["max_tokens"] = MAX_TOKENS
            path = "/v1/chat/completions" if chat else "/v1/completions"
            outcome, problem = await _stream(client, path, body, drop)
            tally.add(kind, outcome, problem)
        elif kind == "abort before answer":
            body = _chat_body(rng) if rng.random() < 0.5 else _completion_body(rng)
            body["max_tokens"] = MAX_TOKENS
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            try:
                r = await asyncio.wait_for(client.post(path, json=body), timeout=rng.uniform(0.02, 0.5))
            except asyncio.TimeoutError:
                tally.add(kind, "aborted")  # the cancelled request closed its connection
            else:
                tally.add(
                    kind,
                    str(r.status_code),
                    None if r.status_code == 200 else _status_problem(r.status_code, r.text),
                )
        elif kind == "bad request":
            body = _bad_body(rng)
            path = (
                "/v1/completions" if isinstance(body, bytes) or "prompt" in body else "/v1/chat/completions"
            )
            if isinstance(body, bytes):
                r = await client.post(path, content=body, headers=json_headers)
            else:
                r = await client.post(path, json=body)
            tally.add(kind, str(r.status_code), _expect(kind, r))
        elif kind == "oversize body":
            size = cfg.max_request_bytes + rng.choice([1, 1024, cfg.max_request_bytes])
            data = b'{"prompt":"' + b"x" * size + b'","max_tokens":1}'
            if rng.random() < 0.5:

                async def chunks():
                    for i in range(0, len(data), 65536):
                        yield data[i : i + 65536]

                r = await client.post("/v1/completions", content=chunks(), headers=json_headers)
            else:
                r = await client.post("/v1/completions", content=data, headers=json_headers)
            tally.add(kind, str(r.status_code), _expect(kind, r))
        elif kind == "wrong content type":
            ctype = rng.choice(
                ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
            )
            headers = {"Content-Type": ctype} if ctype else {}
            content = b'{"prompt": "hi", "max_tokens": 2}'
            r = await client.post(
                rng.choice(["/v1/completions", "/v1/chat/completions"]), content=content, headers=headers
            )
            tally.add(kind, str(r.status_code), _expect(kind, r))
    except httpx.TransportError as exc:
        tally.add(kind, "dropped", f"connection dropped: {type(exc).__name__}: {exc}")


def _expect(kind: str, r: httpx.Response) -> str | None:
    if r.status_code in EXPECTED[kind]:
        try:
            shaped = set(r.json()["error"]) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            shaped = False
        return None if shaped else f"HTTP {r.status_code} without an OpenAI-shaped error: {r.text[:300]}"
    return f"HTTP {r.status_code}, expected {sorted(EXPECTED[kind])}: {r.text[:300]}"


async def client_loop(index: int, client: httpx.AsyncClient, cfg: Config, tally: Tally) -> None:
    rng = random.Random(cfg.seed * 1000 + index)
    kinds, weights = list(KINDS), list(KINDS.values())
    while time.monotonic() < cfg.deadline:
        await one_request(client, rng.choices(kinds, weights)[0], rng, cfg, tally)


def read_metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.labels.get("le")
    }


def idle_state(url: str, wait_s: float = 30.0) -> dict[str, float]:
    """Running/waiting requests and KV usage once idle (polled up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        m = read_metrics(url)
        state = {
            "running": m.get("localllm:num_requests_running", -1),
            "waiting": m.get("localllm:num_requests_waiting", -1),
            "kv_usage": m.get("localllm:kv_cache_usage_perc", -1),
        }
        if all(v == 0 for v in state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def run_load(cfg: Config, clients: int, tally: Tally) -> None:
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=cfg.url, timeout=httpx.Timeout(300.0), limits=limits) as client:
        await asyncio.gather(*(client_loop(i, client, cfg, tally) for i in range(clients)))


def tables(tally: Tally) -> tuple[str, int]:
    """The per-kind table, and the number of requests."""
    outcomes = sorted({o for _, o in tally.outcomes}, key=lambda o: (not o.isdigit(), o))
    head = "| kind | " + " | ".join(outcomes) + " | total |\n|" + "---|" * (len(outcomes) + 2) + "\n"
    rows = []
    for kind in KINDS:
        counts = [tally.outcomes.get((kind, o), 0) for o in outcomes]
        rows.append(f"| {kind} | " + " | ".join(str(c or "") for c in counts) + f" | {sum(counts)} |")
    totals = [sum(tally.outcomes.get((k, o), 0) for k in KINDS) for o in outcomes]
    rows.append("| **all** | " + " | ".join(str(t) for t in totals) + f" | {sum(totals)} |")
    return head + "\n".join(rows), sum(totals)


def main() -> int:
    global MAX_TOKENS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="GGUF path or catalog name to serve")
    ap.add_argument("--url", help="soak a running server (loopback) instead of starting one")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-waiting", type=int, default=None, help="passed to the server (429s past it)")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument(
        "--max-request-bytes", default="1MiB", help="the server's limit (given to it, or its setting)"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="most output tokens a request asks for"
    )
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    MAX_TOKENS = max(1, args.max_tokens)

    from localllm.config.engine import parse_bytes

    max_request_bytes = parse_bytes(args.max_request_bytes)
    server = None
    num_blocks = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
        host = httpx.URL(url).host
        if host not in ("127.0.0.1", "localhost", "::1"):
            ap.error("--url must be a loopback address")
    else:
        from api_server import ServerProcess

        extra = ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory]
        extra += ["--max-request-bytes", str(max_request_bytes)]
        if args.max_waiting is not None:
            extra += ["--max-waiting", str(args.max_waiting)]
        if args.threads is not None:
            extra += ["--threads", str(args.threads)]
        server = ServerProcess(args.model, *extra)
        url = server.wait_ready(timeout=300)
        pid = server.proc.pid
        m = re.search(r"KV cache: (\d+) blocks", server.output())
        num_blocks = int(m.group(1)) if m else None
        print(f"serving {args.model} at {url} (pid {pid}, logs in {server.log_dir})", flush=True)

    try:
        # warm-up, then the starting point
        httpx.post(
            f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=300
        ).raise_for_status()
        before = read_metrics(url)
        rss_start = rss_mib(pid)
        tally = Tally()
        start = time.monotonic()
        cfg = Config(url, start + args.minutes * 60, max_request_bytes, args.seed)
        print(f"{args.clients} clients for {args.minutes:g} min...", flush=True)
        asyncio.run(run_load(cfg, args.clients, tally))
        elapsed = time.monotonic() - start
        drain = max(0.0, elapsed - args.minutes * 60)
        idle = idle_state(url)
        health = httpx.get(f"{url}/health", timeout=30).status_code
        after = read_metrics(url)
        rss_end = rss_mib(pid)
    finally:
        if server is not None:
            status = server.terminate()
            if status != 0:
                print(f"the server exited with {status}:\n{server.output()[-3000:]}")

    per_kind, total = tables(tally)
    generated = after.get("localllm:generation_tokens_total", 0) - before.get(
        "localllm:generation_tokens_total", 0
    )
    served = sum(c for (k, o), c in tally.outcomes.items() if o == "200")
    by_status = Counter()
    for (_, o), c in tally.outcomes.items():
        by_status[o] += c
    kv_blocks = "n/a"
    if idle["kv_usage"] >= 0:
        kv_blocks = f"{idle['kv_usage'] * 100:.1f}% of the KV cache"
        if num_blocks is not None:
            kv_blocks = f"{round(idle['kv_usage'] * num_blocks)} of {num_blocks} blocks ({kv_blocks})"
    leaked = any(v != 0 for v in idle.values()) or health != 200
    fmt_rss = lambda v: "n/a" if v is None else f"{v:.0f} MiB"
    summary = [
        (
            "duration",
            (
                f"{elapsed - drain:.0f} s of load from {args.clients} concurrent clients "
                f"(+{drain:.0f} s for the requests then in flight)"
            ),
        ),
        ("requests sent", f"{total} ({total / elapsed:.1f}/s)"),
        ("answered 200", str(served)),
        (
            "refused as expected (400 / 413 / 415 / 429)",
            " / ".join(str(by_status.get(s, 0)) for s in ("400", "413", "415", "429")),
        ),
        (
            "ended by the client (dropped streams / aborted)",
            f"{by_status['disconnected']} / {by_status['aborted']}",
        ),
        ("**unexpected** (5xx, dropped connections, bad streams, wrong status)", str(len(tally.unexpected))),
        ("after idle: running / waiting requests", f"{idle['running']:.0f} / {idle['waiting']:.0f}"),
        ("after idle: KV blocks in use", kv_blocks),
        ("/health after the run", str(health)),
        ("server RSS start -> end", f"{fmt_rss(rss_start)} -> {fmt_rss(rss_end)}"),
        (
            "tokens generated (server) / in 200 non-streamed answers",
            f"{generated:.0f} / {tally.completion_tokens}",
        ),
    ]
    summary_md = "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in summary)
    import torch

    model = Path(args.model).name if not args.url else args.url
    stamp = (
        f"{datetime.date.today()} on {platform.machine()} with {os.cpu_count()} cores, torch {torch.__version__}; "
        f"{model}, max_num_seqs {args.max_num_seqs}, seed {args.seed}"
    )
    cmd = f"python bench/soak.py --minutes {args.minutes:g} --clients {args.clients}"
    if args.max_tokens != 48:
        cmd += f" --max-tokens {args.max_tokens}"
    if args.threads is not None:
        cmd += f" --threads {args.threads}"
    text = (
        f"`{cmd} --write-docs` ({stamp}):\n\n{summary_md}\n\nRequests by kind and outcome:\n\n{per_kind}\n"
    )
    print()
    print(text)
    for problem in tally.unexpected[:50]:
        print(f"  unexpected: {problem}")
    if args.write_docs:
        write_section("soak", text)
    return 1 if tally.unexpected or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
