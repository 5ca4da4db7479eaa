"""Continuous vs static batching on a seeded Poisson workload, through AsyncEngine.

    python bench/batching.py [--model PATH] [--requests 48] [--rate 2.0] [--seed 0] [--write-docs]

The workload mixes prompt lengths (short chats, ~200-token documents, some sharing a long
system prefix) and output lengths; 1 request in 6 has priority -1 (high). Reports output
throughput, TTFT and TPOT p50/p99, and TTFT of high vs normal priority, for each mode.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED_PREFIX = list(range(5000, 5256))  # a 256-token "system prompt" some requests share


@dataclass(slots=True)
class Job:
    arrival: float
    prompt: list[int]
    max_tokens: int
    priority: int


@dataclass(slots=True)
class Result:
    ttft: float
    tpot: float | None
    num_tokens: int
    priority: int


def make_workload(n: int, rate: float, seed: int) -> list[Job]:
    rng = random.Random(seed)
    t = 0.0
    jobs = []
    for i in range(n):
        t += rng.expovariate(rate)
        kind = rng.random()
        if kind < 0.3:
            prompt = SHARED_PREFIX + [rng.randrange(100, 40000) for _ in range(rng.randint(8, 32))]
        elif kind < 0.5:
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(150, 300))]
        else:
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(8, 48))]
        jobs.append(Job(t, prompt, rng.choice([8, 16, 32, 64]), -1 if i % 6 == 5 else 0))
    return jobs


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


async def run_mode(model: str, batching: str, jobs: list[Job]):
    from localllm import SamplingParams
    from localllm.config.engine import EngineConfig
    from localllm.engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(EngineConfig(model=model, batching=batching, kv_cache_memory=512 << 20,
                                                  max_num_seqs=16, max_num_batched_tokens=512))
    # warm-up
    async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0)):
        pass

    async def one(job: Job, t0: float) -> Result:
        await asyncio.sleep(max(0.0, t0 + job.arrival - time.perf_counter()))
        start = time.perf_counter()
        first = last = None
        n = 0
        async for out in engine.generate(job.prompt, SamplingParams(max_tokens=job.max_tokens, temperature=0.0,
                                                                     ignore_eos=True), priority=job.priority):
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            n += len(out.new_token_ids)
        tpot = (last - first) / (n - 1) if n > 1 else None
        return Result(first - start, tpot, n, job.priority)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(j, t0) for j in jobs))
    elapsed = time.perf_counter() - t0
    engine.shutdown()
    return results, elapsed


def summarize(mode: str, results: list[Result], elapsed: float) -> list[str]:
    ttft = [r.ttft for r in results]
    tpot = [r.tpot for r in results if r.tpot is not None]
    hi = [r.ttft for r in results if r.priority < 0]
    lo = [r.ttft for r in results if r.priority >= 0]
    toks = sum(r.num_tokens for r in results)
    return [mode, f"{toks / elapsed:.1f}", f"{pct(ttft, 50):.2f}", f"{pct(ttft, 99):.2f}",
            f"{pct(tpot, 50) * 1000:.0f}", f"{pct(tpot, 99) * 1000:.0f}",
            f"{statistics.median(hi) if hi else float('nan'):.2f}", f"{statistics.median(lo):.2f}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    import torch

    jobs = make_workload(args.requests, args.rate, args.seed)
    rows = []
    for mode in ("continuous", "static"):
        results, elapsed = asyncio.run(run_mode(args.model, mode, jobs))
        rows.append(summarize(mode, results, elapsed))
        print(" | ".join(rows[-1]), flush=True)
    header = ["batching", "output tok/s", "TTFT p50 (s)", "TTFT p99 (s)", "TPOT p50 (ms)", "TPOT p99 (ms)",
              "TTFT p50 high prio (s)", "TTFT p50 normal (s)"]
    table = "| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n" + "\n".join(
        "| " + " | ".join(r) + " |" for r in rows)
    stamp = (f"{datetime.date.today()}, {platform.machine()} with {os.cpu_count()} cores, torch {torch.__version__}, "
             f"{args.requests} requests, Poisson {args.rate}/s, seed {args.seed}, max_num_seqs 16, budget 512")
    text = (f"`python bench/batching.py --requests {args.requests} --rate {args.rate} --write-docs` "
            f"({stamp}):\n\n{table}\n")
    print(text)
    if args.write_docs:
        write_section("batching", text)


if __name__ == "__main__":
    main()
