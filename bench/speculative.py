"""Speculative decoding: localllm with and without n-gram drafts, beside llama-server's own.

    python bench/speculative.py [--model PATH] [--threads N] [--tokens 256] [--rounds 2]
                                [--spec-types ngram-simple,ngram-map-k,...] [--write-docs]
                                [--draft-model PATH | --draft-layers N]

Workloads, one stream at a time, greedy, ``--tokens`` tokens at most, through each server's
streaming ``/v1/chat/completions``:

* **editing**: prompts that ask for code or text back with small changes (what editors and agents
  send; most of the answer is in the prompt);
* **free writing**: prompts with little to copy;
* **32 clients**: 32 concurrent streamed completions (short distinct prompts, 64 tokens each,
  ``ignore_eos``), aggregate output tokens/s (localllm only, against speculation off).

localllm runs with ``--speculative off``, ``ngram`` (drafts from the request's own prompt and output)
(the default where the kernels are batch-invariant) and ``suffix`` (also from recent answers; the
prompts are distinct, so it gains only where answers repeat each other); with ``--draft-model`` (or
``--draft-layers N``: a copy of the model's first N layers), also ``draft`` beside llama-server's
``--spec-type draft-simple --model-draft`` on the same file. Per server configuration:
the decode rate (completion tokens after the first, over the time from the
first to the last chunk, summed over the prompts), the drafts' acceptance and the tokens per
verification step where the server reports them (localllm's ``/metrics``, llama-server's
``timings``). Servers run one after another in alternating rounds; the best round counts. The
peer is the llama.cpp that ``bench/peer_llamacpp.py`` builds. Nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section
from peer_llamacpp import (
    DEFAULT_MODEL,
    PEER_VERSION,
    Served,
    build_peer,
    cpu_name,
    free_port,
    load,
    sse_events,
)

CODE = '''import json
from pathlib import Path


class Inventory:
    """Items in a warehouse, saved as JSON."""

    def __init__(self, path):
        self.path = Path(path)
        self.items = {}

    def load(self):
        if self.path.exists():
            self.items = json.loads(self.path.read_text())

    def save(self):
        self.path.write_text(json.dumps(self.items, indent=2))

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError(f"not enough {name}")
        self.items[name] -= count
'''
TEXT = ("The library opens at nine in the morning and closes at six in the evening. Visitors may borrow up to "
        "five books at a time for three weeks. Books can be renewed once, online or at the front desk, unless "
        "another reader has reserved them. Late returns cost ten cents a day. The reading room on the second "
        "floor is quiet; group study rooms on the first floor can be booked for two hours.")
EDITING = [
    f"Rename the method `remove` to `take` in this code. Reply with the whole code.\n\n```python\n{CODE}```",
    f"Add a docstring to the method `add` in this code. Reply with the whole code.\n\n```python\n{CODE}```",
    f"Repeat this text, replacing 'library' with 'museum':\n\n{TEXT}",
    f"Correct any mistakes in this text and reply with the whole text:\n\n{TEXT.replace('morning', 'mornign')}",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Write a poem about the first snow of winter.",
    "Describe a walk through a busy market in a city you imagine.",
]


async def one_stream(url: str, prompt: str, tokens: int) -> dict:
    """One greedy streamed chat completion: completion tokens, first-to-last chunk time, llama-server's timings."""
    import httpx

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    usage, timings = None, None
    async with httpx.AsyncClient(timeout=900) as http, http.stream(
            "POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for data in sse_events(r):
            if data.get("usage"):
                usage = data["usage"]["completion_tokens"]
            timings = data.get("timings") or timings
            if data.get("choices") and (data["choices"][0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    return {"tokens": usage or 0, "seconds": (last - first) if first and last else 0.0, "timings": timings}


def metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("localllm:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def workload(url: str, prompts: list[str], tokens: int, localllm: bool) -> dict:
    before = metrics(url) if localllm else {}
    asyncio.run(one_stream(url, "Say hello.", 8))  # warm-up
    runs = [asyncio.run(one_stream(url, p, tokens)) for p in prompts]
    decoded = sum(max(r["tokens"] - 1, 0) for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    result = {"tok_s": decoded / seconds if seconds else 0.0, "tokens": sum(r["tokens"] for r in runs)}
    if localllm:
        after = metrics(url)
        drafted = after.get("localllm:spec_decode_num_draft_tokens_total", 0) - before.get(
            "localllm:spec_decode_num_draft_tokens_total", 0)
        accepted = after.get("localllm:spec_decode_num_accepted_tokens_total", 0) - before.get(
            "localllm:spec_decode_num_accepted_tokens_total", 0)
        result["acceptance"] = accepted / drafted if drafted else None
        generated = after.get("localllm:generation_tokens_total", 0) - before.get("localllm:generation_tokens_total", 0)
        result["per_step"] = generated / (generated - accepted) if generated > accepted else None
    else:
        drafted = sum((r["timings"] or {}).get("draft_n", 0) for r in runs)
        accepted = sum((r["timings"] or {}).get("draft_n_accepted", 0) for r in runs)
        result["acceptance"] = accepted / drafted if drafted else None
        total = result["tokens"]
        result["per_step"] = total / (total - accepted) if drafted and total > accepted else None
    return result


def localllm_server(model: str, threads: int, mode: str, clients: int = 1, draft: str | None = None) -> Served:
    port = free_port()
    env = dict(os.environ, LOCALLLM_THREADS=str(threads))
    return Served([sys.executable, "-m", "localllm.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
                   "--speculative", mode, "--max-num-seqs", str(max(clients, 4)), "--kv-cache-memory", "256MiB",
                   *(["--draft-model", draft] if mode == "draft" else [])],
                  port, env)


def llama_server(binary: Path, model: str, threads: int, spec_type: str, draft: str | None = None) -> Served:
    port = free_port()
    cmd = [str(binary), "-m", model, "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", "4096",
           "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    if spec_type != "none":
        cmd += ["--spec-type", spec_type]
    if spec_type.startswith("draft"):
        cmd += ["--model-draft", draft, "-td", str(threads)]
    return Served(cmd, port)


def draft_model(args, model: str) -> str | None:
    """``--draft-model``, or a copy of the model's first ``--draft-layers`` layers (the only smaller
    model with SmolLM2's vocabulary that can be made offline), or None."""
    if args.draft_model:
        return str(Path(args.draft_model).resolve())
    if not args.draft_layers:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny_models import write_first_layers

    out = Path(args.work_dir) / f"{Path(model).stem}.first{args.draft_layers}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        write_first_layers(model, out, args.draft_layers)
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--spec-types", default="ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache",
                    help="llama-server --spec-type values to try (none is always run)")
    ap.add_argument("--draft-model", help="a smaller model with the same vocabulary: adds localllm --speculative "
                    "draft and llama-server --spec-type draft-simple")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="without --draft-model: draft with a copy of the model's first N layers (0: no draft rows)")
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "localllm-speculative"))
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--peer-version", default=PEER_VERSION)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    model = str(Path(args.model).resolve())
    bins = None if args.skip_peer else build_peer(args.peer_version)

    draft = draft_model(args, model)
    configs = [("localllm", "off"), ("localllm", "ngram"), ("localllm", "suffix")]
    configs += [("localllm", "draft")] if draft else []
    if bins:
        configs += [("llama-server", t) for t in ["none", *args.spec_types.split(",")]]
        configs += [("llama-server", "draft-simple")] if draft else []
    results: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for rnd in range(args.rounds):
        for server, mode in configs:
            try:
                srv = (localllm_server(model, args.threads, mode, draft=draft) if server == "localllm"
                       else llama_server(bins["llama-server"], model, args.threads, mode, draft))
            except RuntimeError as exc:
                print(f"{server} {mode}: did not start ({str(exc).splitlines()[0]})", flush=True)
                continue
            try:
                for name, prompts in (("editing", EDITING), ("free writing", FREE)):
                    r = workload(srv.url, prompts, args.tokens, server == "localllm")
                    results.setdefault((server, mode), {}).setdefault(name, []).append(r)
                    print(f"round {rnd + 1}: {server} {mode} {name}: {r['tok_s']:.1f} tok/s, acceptance "
                          f"{r['acceptance']}, tokens/step {r['per_step']}", flush=True)
            finally:
                srv.stop()
        for mode in ("off", "suffix"):
            srv = localllm_server(model, args.threads, mode, args.clients)
            try:
                r = asyncio.run(load(srv.url, args.clients, 64))
            finally:
                srv.stop()
            results.setdefault(("localllm", mode), {}).setdefault(f"{args.clients} clients", []).append(r)
            print(f"round {rnd + 1}: localllm {mode} {args.clients} clients: {r['tok_s']:.1f} tok/s", flush=True)

    def best(key, workload_name):
        runs = results.get(key, {}).get(workload_name, [])
        return max(runs, key=lambda r: r["tok_s"]) if runs else None

    def fmt(v, spec="{:.0%}"):
        return "-" if v is None else spec.format(v)

    rows = []
    for workload_name in ("editing", "free writing", f"{args.clients} clients"):
        off = best(("localllm", "off"), workload_name)
        peers = {m: best(("llama-server", m), workload_name) for s, m in configs if s == "llama-server"}
        peers = {m: r for m, r in peers.items() if r}
        best_peer = max(peers.items(), key=lambda kv: kv[1]["tok_s"]) if peers else None
        for server, mode in configs:
            r = best((server, mode), workload_name)
            if r is None:
                continue
            vs_off = f"{r['tok_s'] / off['tok_s']:.2f}x" if off and server == "localllm" else ""
            vs_peer = f"{r['tok_s'] / best_peer[1]['tok_s']:.2f}x" if best_peer and server == "localllm" else ""
            rows.append((workload_name, f"{server} {mode}", f"{r['tok_s']:.1f}", fmt(r.get("acceptance")),
                         fmt(r.get("per_step"), "{:.2f}"), vs_off, vs_peer))
    import torch

    stamp = (f"{datetime.date.today()}, {cpu_name()} ({platform.machine()}, {os.cpu_count()} cores), {args.threads} "
             f"threads each, torch {torch.__version__}, llama.cpp from llama-cpp-python {args.peer_version}; "
             f"{Path(model).name}; greedy, up to {args.tokens} tokens; best of {args.rounds} alternating rounds"
             + (f"; draft model {Path(draft).name}" if draft else ""))
    header = ("| workload | server | decode tok/s | drafts accepted | tokens per step | vs localllm off | "
              "vs best llama-server |\n|---|---|---|---|---|---|---|\n")
    table = header + "\n".join("| " + " | ".join(r) + " |" for r in rows)
    text = (f"`python bench/speculative.py --threads {args.threads} --tokens {args.tokens} --rounds {args.rounds}"
            f"{f' --draft-layers {args.draft_layers}' if args.draft_layers and not args.draft_model else ''}"
            f"{' --draft-model ' + Path(args.draft_model).name if args.draft_model else ''}"
            f"{' --skip-peer' if args.skip_peer else ''}{' --write-docs' if args.write_docs else ''}` ({stamp}):\n\n{table}\n")
    print(text)
    if args.write_docs:
        write_section("speculative", text)


if __name__ == "__main__":
    main()
