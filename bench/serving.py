"""The HTTP API under load: `localllm serve` with continuous and with static batching, driven by
``openai.AsyncOpenAI`` with seeded Poisson arrivals at several request rates.

    python bench/serving.py [--model PATH] [--rates 2,8,inf] [--requests 32] [--seed 0] [--write-docs]

Each request streams a completion of a mixed-length prompt (short questions, ~250-token
documents, some sharing a long prefix) and a mixed output length (``ignore_eos``, so lengths are
exact). Reports output throughput and TTFT / TPOT / ITL p50 and p99 per batching mode and rate.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact river mountain city light music story garden window "
    "letter engine market island bridge winter summer forest ocean planet signal memory"
).split()
SHARED_PREFIX = "You are a careful assistant. Answer briefly and precisely. " + " ".join(WORDS * 3)


@dataclass(slots=True)
class Job:
    arrival: float
    prompt: str
    max_tokens: int


@dataclass(slots=True)
class Result:
    ttft: float
    e2e: float
    num_tokens: int
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.num_tokens - 1) if self.num_tokens > 1 else None


def make_workload(n: int, rate: float, seed: int) -> list[Job]:
    """``n`` jobs with Poisson arrivals at ``rate``/s (all at t=0 for an infinite rate)."""
    rng = random.Random(seed)
    t = 0.0
    jobs = []
    for _ in range(n):
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        kind = rng.random()
        words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
        if kind < 0.3:
            prompt = f"{SHARED_PREFIX}\nQuestion: {words(rng.randint(5, 20))}?"
        elif kind < 0.5:
            prompt = f"Summarize: {words(rng.randint(150, 250))}"
        else:
            prompt = f"Tell me about {words(rng.randint(3, 30))}."
        jobs.append(Job(t, prompt, rng.choice([8, 16, 32, 64])))
    return jobs


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def serve_command() -> list[str]:
    """``localllm serve`` through the main CLI."""
    return [sys.executable, "-m", "localllm.cli", "serve"]


class Server:
    """``localllm serve`` on a free loopback port, stopped with SIGTERM."""

    def __init__(self, model: str, *args: str) -> None:
        self.out = Path(tempfile.mkstemp(prefix="localllm-bench-serve-")[1])
        cmd = [*serve_command(), model, "--host", "127.0.0.1", "--port", "0", *args]
        with open(self.out, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            m = re.search(r"localllm serving .* at (http://\S+)", self.out.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"localllm serve did not start:\n{self.out.read_text(errors='replace')}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def run_jobs(url: str, jobs: list[Job]) -> tuple[list[Result], float]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        model = (await client.models.list()).data[0].id

        async def one(job: Job, t0: float) -> Result:
            await asyncio.sleep(max(0.0, t0 + job.arrival - time.perf_counter()))
            start = time.perf_counter()
            times = []
            stream = await client.completions.create(
                model=model,
                prompt=job.prompt,
                max_tokens=job.max_tokens,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.perf_counter())
            itls = [b - a for a, b in zip(times, times[1:], strict=False)]
            return Result(times[0] - start, times[-1] - start, job.max_tokens, itls)

        await one(Job(0.0, "Hello", 2), time.perf_counter())  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(j, t0) for j in jobs))
        return results, time.perf_counter() - t0


def row(batching: str, rate: float, results: list[Result], elapsed: float) -> list[str]:
    ttft = [r.ttft for r in results]
    tpot = [r.tpot for r in results if r.tpot is not None]
    itl = [x for r in results for x in r.itls]
    tokens = sum(r.num_tokens for r in results)
    ms = lambda v: f"{v * 1000:.0f}"  # noqa: E731
    return [
        batching,
        "inf" if math.isinf(rate) else f"{rate:g}",
        f"{tokens / elapsed:.1f}",
        f"{pct(ttft, 50):.2f}",
        f"{pct(ttft, 99):.2f}",
        ms(pct(tpot, 50)),
        ms(pct(tpot, 99)),
        ms(pct(itl, 50)),
        ms(pct(itl, 99)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument(
        "--rates", default="2,8,inf", help="request rates (req/s) to sweep; inf sends all at once"
    )
    ap.add_argument("--requests", type=int, default=32, help="requests per rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--batching", default="continuous,static")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    rows = []
    for batching in args.batching.split(","):
        server = Server(
            args.model,
            "--batching",
            batching,
            "--kv-cache-memory",
            "512MiB",
            "--max-num-seqs",
            str(args.max_num_seqs),
        )
        try:
            for rate in rates:
                jobs = make_workload(args.requests, rate, args.seed)
                results, elapsed = asyncio.run(run_jobs(server.url, jobs))
                rows.append(row(batching, rate, results, elapsed))
                print(" | ".join(rows[-1]), flush=True)
        finally:
            server.stop()

    import torch

    header = [
        "batching",
        "rate (req/s)",
        "output tok/s",
        "TTFT p50 (s)",
        "TTFT p99 (s)",
        "TPOT p50 (ms)",
        "TPOT p99 (ms)",
        "ITL p50 (ms)",
        "ITL p99 (ms)",
    ]
    table = (
        "| "
        + " | ".join(header)
        + " |\n|"
        + "---|" * len(header)
        + "\n"
        + "\n".join("| " + " | ".join(r) + " |" for r in rows)
    )
    stamp = (
        f"{datetime.date.today()} on {platform.machine()} with {os.cpu_count()} cores, "
        f"torch {torch.__version__}; "
        f"{Path(args.model).name}, {args.requests} streamed completions per rate (8-64 output tokens, "
        f"prompts of 7-234 tokens, 30% sharing a 146-token prefix), seed {args.seed}, "
        f"max_num_seqs {args.max_num_seqs}"
    )
    text = (
        f"`python bench/serving.py --rates {args.rates} --requests {args.requests} "
        f"--batching {args.batching} --write-docs` "
        f"({stamp}):\n\n{table}\n"
    )
    print(text)
    if args.write_docs:
        write_section("serving", text)


if __name__ == "__main__":
    main()
