"""Replicas on one machine: one server against ``--replicas 2``, prefix affinity against queue routing.

    python bench/scale_out.py [--model PATH] [--clients 16] [--conversations 8] [--turns 4]
                              [--replica-kv-cache MiB] [--write-docs]

Three servers of the same model, one after another, each on all of this machine's cores:

- ``serve MODEL`` (one engine, every core);
- ``serve MODEL --replicas 2`` (two engines of half the cores each, routed by prompt prefix);
- ``serve MODEL --replicas 2 --routing queue`` (the same, routed by queue length only).

Two workloads on each:

- **independent streams**: ``--clients`` concurrent completions of distinct short prompts, 64 tokens
  each (``ignore_eos``): output tokens per second;
- **conversations**: ``--conversations`` chats in parallel, each ``--turns`` turns one after another,
  every turn's prompt its conversation's long system prompt (~600 tokens) and its history, 16 tokens
  out: the prefix cache's hit rate (the replicas' own ``prefix_cache_hits`` over ``queries``, summed),
  the mean latency of a turn after the first, and the wall time.

``--replica-kv-cache MiB`` gives each replica that much KV cache and the single server twice as much
(the same memory in all): a fleet whose conversations outgrow one replica's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section
from peer_llamacpp import cpu_name
from serving import DEFAULT_MODEL, WORDS, Server


def counters(url: str) -> dict[str, float]:
    """Prefix-cache and token counters summed over every model and replica."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name in ("localllm:prefix_cache_hits_total", "localllm:prefix_cache_queries_total",
                          "localllm:generation_tokens_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def settled_counters(url: str, before: dict[str, float], expect_tokens: float) -> dict[str, float]:
    """The counters once every replica has posted the tokens of the workload (a replica posts each second)."""
    deadline = time.monotonic() + 15
    while True:
        now = counters(url)
        done = now.get("localllm:generation_tokens_total", 0) - before.get("localllm:generation_tokens_total", 0)
        if done >= expect_tokens or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.5)


async def independent_streams(url: str, clients: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def one(i: int) -> int:
            r = await http.post("/v1/completions", json={"prompt": f"Story {i}: {WORDS[i % len(WORDS)]}",
                                                          "max_tokens": 64, "ignore_eos": True, "temperature": 0})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        await one(-1)  # warm
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(clients))))
        return tokens / (time.perf_counter() - start)


def system_prompt(i: int) -> str:
    return f"You are assistant {i}. Remember: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(500))


async def conversations(url: str, count: int, turns: int) -> dict[str, float]:
    before = counters(url)
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async def chat(i: int) -> None:
            history = [{"role": "system", "content": system_prompt(i)}]
            for t in range(turns):
                history.append({"role": "user", "content": f"Question {t}: what about {WORDS[(i + t) % len(WORDS)]}?"})
                start = time.perf_counter()
                r = await http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 16,
                                                                   "ignore_eos": True, "temperature": 0})
                r.raise_for_status()
                if t:
                    latencies.append(time.perf_counter() - start)
                history.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

        start = time.perf_counter()
        await asyncio.gather(*(chat(i) for i in range(count)))
        wall = time.perf_counter() - start
    after = await settled_counters(url, before, count * turns * 16)
    queries = after["localllm:prefix_cache_queries_total"] - before.get("localllm:prefix_cache_queries_total", 0)
    hits = after["localllm:prefix_cache_hits_total"] - before.get("localllm:prefix_cache_hits_total", 0)
    return {"hit_rate": hits / queries if queries else 0.0, "latency": sum(latencies) / len(latencies), "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--replica-kv-cache", type=int, default=None, help="MiB of KV cache per replica")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    kv = args.replica_kv_cache
    one_kv = ["--kv-cache-memory", f"{2 * kv}MiB"] if kv else []
    replica_kv = ["--kv-cache-memory", f"{kv}MiB"] if kv else []
    setups = [
        (f"one server, {cores} threads", ["--threads", str(cores), *one_kv]),
        (f"2 replicas x {max(1, cores // 2)} threads, prefix routing", ["--replicas", "2", *replica_kv]),
        (f"2 replicas x {max(1, cores // 2)} threads, queue routing",
         ["--replicas", "2", "--routing", "queue", *replica_kv]),
    ]
    rows = []
    for name, flags in setups:
        server = Server(args.model, *flags)
        try:
            streams = asyncio.run(independent_streams(server.url, args.clients))
            chats = asyncio.run(conversations(server.url, args.conversations, args.turns))
        finally:
            server.stop()
        rows.append((name, streams, chats))
        print(f"{name}: {streams:.1f} tok/s; conversations: hit rate {chats['hit_rate']:.1%}, "
              f"turn latency {chats['latency']:.2f} s, wall {chats['wall']:.1f} s", flush=True)
    header = (f"`python bench/scale_out.py {' '.join(sys.argv[1:])}` ({datetime.date.today()}, {cpu_name()}, "
              f"{cores} cores; {Path(args.model).name}): {args.clients} independent streams x 64 tokens; "
              f"{args.conversations} conversations x {args.turns} turns (~600-token system prompts, 16 tokens a "
              f"turn){f'; KV cache {kv} MiB per replica, {2 * kv} MiB for one server' if kv else ''}\n\n")
    table = ["| setup | streams tok/s | prefix-cache hit rate | turn latency (after the first) | conversations wall |",
             "|---|---|---|---|---|"]
    for name, streams, chats in rows:
        table.append(f"| {name} | {streams:.1f} | {chats['hit_rate']:.1%} | {chats['latency']:.2f} s | "
                     f"{chats['wall']:.1f} s |")
    markdown = header + "\n".join(table)
    print(markdown)
    if args.write_docs:
        write_section("scale_out", markdown)


if __name__ == "__main__":
    main()
