"""localllm beside llama.cpp on the same GGUF, machine and thread count, measured in one run.

    python bench/peer_llamacpp.py [--model PATH] [--threads N] [--clients 32] [--rounds 2] [--write-docs]

The peer is the real llama.cpp: the ``llama-cpp-python`` source distribution on PyPI vendors it,
and this script builds its ``llama-bench`` and ``llama-server`` CMake targets (CPU only, about
10-20 minutes on 2 cores) into a cache outside the repository (``~/.cache/localllm-peer`` or
``$LOCALLLM_PEER_DIR``), reused on later runs. Nothing here is a dependency of localllm or of CI.

Measured, alternating the two programs for ``--rounds`` rounds (best of the rounds each):

* single stream: llama-bench's ``pp512`` and ``tg128`` against localllm's prefill of a fresh
  512-token prompt and 128 decode steps after a one-token prompt (same definitions);
* resident memory: localllm's RSS growth for loading and running the model (KV cache excluded)
  against the GGUF file size; llama-server's whole RSS for reference;
* ``--clients`` concurrent streaming clients (short distinct prompts, 128 tokens each,
  ``ignore_eos``) through each program's OpenAI-compatible ``/v1/completions``: aggregate output
  tokens/s, with llama-server at every ``-np`` of ``--np`` and its best one kept.

Prints a table of the figures and their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PEER_PACKAGE = "llama-cpp-python"
PEER_VERSION = "0.3.36"
TARGETS = ("llama-bench", "llama-server", "llama-quantize", "llama-perplexity", "llama-tokenize")


# ---------------------------------------------------------------------------------------------
# Building the peer


def peer_dir() -> Path:
    return Path(os.environ.get("LOCALLLM_PEER_DIR", Path.home() / ".cache" / "localllm-peer"))


def fetch_sdist(version: str, dest: Path) -> Path:
    """Download ``llama-cpp-python==version``'s sdist from PyPI (sha256-checked), once."""
    from urllib.parse import urljoin

    import httpx

    meta = httpx.get(f"https://pypi.org/pypi/{PEER_PACKAGE}/json", follow_redirects=True, timeout=60)
    meta.raise_for_status()
    files = meta.json()["releases"].get(version) or []
    sdists = [f for f in files if f["packagetype"] == "sdist"]
    if not sdists:
        raise SystemExit(f"{PEER_PACKAGE} {version} has no source distribution on PyPI")
    info = sdists[0]
    path = dest / info["filename"]
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == info["digests"]["sha256"]:
        return path
    url = urljoin(str(meta.url), info["url"])
    print(f"downloading {url}", flush=True)
    digest = hashlib.sha256()
    part = path.with_suffix(".part")
    with httpx.stream("GET", url, follow_redirects=True, timeout=300) as r, open(part, "wb") as out:
        r.raise_for_status()
        for chunk in r.iter_bytes(1 << 20):
            out.write(chunk)
            digest.update(chunk)
    if digest.hexdigest() != info["digests"]["sha256"]:
        part.unlink()
        raise SystemExit(f"sha256 mismatch for {info['filename']}")
    part.rename(path)
    return path


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_peer(version: str) -> dict[str, Path]:
    """Paths of the built ``llama-bench`` and ``llama-server`` (building them if needed)."""
    root = peer_dir()
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    bins = {t: src / "build" / "bin" / t for t in TARGETS}
    if all(p.is_file() for p in bins.values()):
        return bins
    root.mkdir(parents=True, exist_ok=True)
    if not (src / "CMakeLists.txt").is_file():
        sdist = fetch_sdist(version, root)
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    # -march=native turns on AMX where the CPU lists it, but a VM whose kernel does not grant the
    # tiles' state (arch_prctl) traps on the first tile instruction: llama-bench died with SIGILL
    # on an Intel Xeon guest that lists amx_tile. Build without AMX there (localllm has none either).
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if "amx_tile" in _cpu_flags() else ""
    t0 = time.perf_counter()
    print(f"building llama.cpp ({', '.join(TARGETS)}) in {src / 'build'} ...", flush=True)
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(src / "build"), *generator, "-DCMAKE_BUILD_TYPE=Release",
         "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
         f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"],
        check=True, stdout=subprocess.DEVNULL,
    )
    subprocess.run(["cmake", "--build", str(src / "build"), "--target", *TARGETS, "-j", str(os.cpu_count() or 1)],
                   check=True, stdout=subprocess.DEVNULL)
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    return bins


def write_imatrix(model: Path, out: Path, seed: int | None = 0) -> Path:
    """An importance matrix for every matrix weight of ``model`` but the token embedding (which is
    looked up, not multiplied), as ``llama-imatrix`` writes one (a GGUF file of ``<tensor>.in_sum2``
    and ``<tensor>.counts``): per input column a mean squared activation in [0.5, 2) drawn with
    ``seed``, or 1 everywhere (``seed=None``: every column alike, no calibration), over 64 calls.
    ``llama-quantize`` makes IQ2_XXS, IQ2_XS, IQ1_S and IQ1_M files only with one."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter, Keys

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(out), "llama")
    writer.add_type("imatrix")
    writer.add_array(Keys.IMatrix.DATASETS, ["random" if seed is not None else "uniform"])
    writer.add_uint32(Keys.IMatrix.CHUNK_COUNT, 1)
    writer.add_uint32(Keys.IMatrix.CHUNK_SIZE, 64)
    for t in GGUFReader(str(model)).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            cols = int(t.shape[0])
            energy = rng.uniform(0.5, 2.0, (1, cols)) if seed is not None else np.ones((1, cols))
            writer.add_tensor(f"{t.name}.in_sum2", (64 * energy).astype(np.float32))
            writer.add_tensor(f"{t.name}.counts", np.full((1, 1), 64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# ---------------------------------------------------------------------------------------------
# Single stream


def llama_bench(binary: Path, model: str, threads: int, reps: int, n_prompt: int = 512, n_gen: int = 128,
                depth: int = 0, kv_type: str | None = None) -> dict[str, float]:
    """llama-bench's mean tokens/s, as ``{"pp<n_prompt>": ..., "tg<n_gen>": ...}`` (either test skipped
    when its size is 0), with ``depth`` tokens already in the context when ``depth`` > 0 (``-d``);
    ``kv_type``: the KV cache's type for keys and values (``-ctk``/``-ctv``, flash attention on)."""
    cmd = [str(binary), "-m", model, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps),
           "-o", "json"]
    if depth:
        cmd += ["-d", str(depth)]
    if kv_type:
        cmd += ["-ctk", kv_type, "-ctv", kv_type, "-fa", "1"]
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    result = {}
    for r in rows:
        if n_prompt and r["n_prompt"] == n_prompt and r["n_gen"] == 0:
            result[f"pp{n_prompt}"] = float(r["avg_ts"])
        elif n_gen and r["n_gen"] == n_gen and r["n_prompt"] == 0:
            result[f"tg{n_gen}"] = float(r["avg_ts"])
    return result


LOCALLLM_SINGLE = r"""
import ctypes, json, os, sys, time
import torch
import transformers  # noqa: F401 - loaded before the baseline so RSS growth is the model's
from localllm import LLM, SamplingParams

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

model, reps = sys.argv[1], int(sys.argv[2])
rss0 = rss()
llm = LLM(model=model, kv_cache_memory="256MiB", enable_prefix_caching=False,
          speculative=os.environ["LOCALLLM_SPECULATIVE"])
kv = llm.engine.runner.write_kv_caches()  # resident whole, then subtracted
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
llm.generate([list(range(1000, 1512))], greedy(2))  # warm-up: first use repacks the weights
try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
except OSError:
    pass
rss_model = rss() - rss0 - kv
held = llm.engine.backend.held_bytes(llm.engine.model)
pp, tg = [], []
for r in range(reps):
    prompt = list(range(2000 + 600 * r, 2512 + 600 * r))  # fresh tokens: no prefix cache to hit
    t0 = time.perf_counter()
    llm.generate([prompt], greedy(1))
    pp.append(512 / (time.perf_counter() - t0))
    times = []
    for out in llm.stream([1 + r], greedy(129)):
        times.append(time.perf_counter())
    tg.append(128 / (times[-1] - times[0]))
print(json.dumps({"pp512": max(pp), "tg128": max(tg), "rss_model": rss_model, "held": held, "threads": torch.get_num_threads()}))
"""


def localllm_env(threads: int) -> dict[str, str]:
    """The environment of a measured localllm (server or child): its threads, and no speculative decoding.
    llama-server drafts nothing unless asked; localllm's default (ngram drafts on the batch-invariant CPU
    route) would measure how repetitive the model's text is, not the kernels (SmolLM2's greedy text: 1.65x)."""
    return dict(os.environ, LOCALLLM_THREADS=str(threads), LOCALLLM_SPECULATIVE="off")


def localllm_single(model: str, threads: int, reps: int) -> dict[str, float]:
    env = localllm_env(threads)
    out = subprocess.run([sys.executable, "-c", LOCALLLM_SINGLE, model, str(reps)], check=True,
                         capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Servers under load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server not ready in {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")


class Served:
    """A server process on a free loopback port; ``rss`` reads its resident memory."""

    def __init__(self, cmd: list[str], port: int, env: dict | None = None) -> None:
        self.log = Path(tempfile.mkstemp(prefix="peer-bench-", suffix=".log")[1])
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        wait_ready(self.url, self.proc, self.log)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.unlink(missing_ok=True)


TOPICS = ("a lighthouse", "the moon", "a small robot", "winter", "a river", "old maps", "bread", "a violin",
          "the ocean", "a train", "bees", "a city at night", "mountains", "a garden", "clocks", "a library")


async def sse_events(response):
    """The JSON events of a streamed OpenAI-style response (``data: [DONE]`` ends it)."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def load(url: str, clients: int, tokens: int) -> dict[str, float]:
    """``clients`` concurrent streamed completions of ``tokens`` tokens; aggregate output tokens/s."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> tuple[int, float]:
            body = {"model": model, "prompt": f"Request {i}. Write a story about {TOPICS[i % len(TOPICS)]}.",
                    "max_tokens": tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            start, first, chunks, usage = time.perf_counter(), None, 0, None
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for data in sse_events(r):
                    if data.get("usage"):
                        usage = data["usage"]["completion_tokens"]
                    if data.get("choices") and data["choices"][0].get("text"):
                        chunks += 1
                        first = first or time.perf_counter()
            return (usage if usage is not None else chunks), (first or time.perf_counter()) - start

        await one(10_000)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(clients)))
        elapsed = time.perf_counter() - t0
    total = sum(n for n, _ in results)
    return {"tok_s": total / elapsed, "tokens": total, "ttft_p50": statistics.median(t for _, t in results)}


def run_llama_server(binary: Path, model: str, threads: int, np_: int, clients: int, tokens: int):
    port = free_port()
    srv = Served([str(binary), "-m", model, "-t", str(threads), "-tb", str(threads), "-np", str(np_),
                  "-c", str(np_ * 512), "--host", "127.0.0.1", "--port", str(port), "--no-webui"], port)
    try:
        result = asyncio.run(load(srv.url, clients, tokens))
        result["rss"] = srv.rss()
        return result
    finally:
        srv.stop()


def run_localllm_server(model: str, threads: int, clients: int, tokens: int):
    port = free_port()
    env = localllm_env(threads)
    srv = Served([sys.executable, "-m", "localllm.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
                  "--max-num-seqs", str(max(clients, 1)), "--kv-cache-memory", "256MiB"], port, env)
    try:
        result = asyncio.run(load(srv.url, clients, tokens))
        result["rss"] = srv.rss()
        return result
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------


def cpu_name() -> str:
    """The CPU's model name and the instruction set localllm's native kernels are built for on it."""
    from localllm.kernels.cpu import native
    from localllm.kernels.cpu.options import CpuOptions

    name = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {native.build_isa(CpuOptions.from_env()) or 'no native'} kernels"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--np", default="1,4,8,16,32", help="llama-server -np values to try under the load")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="repetitions inside one single-stream measurement")
    ap.add_argument("--peer-version", default=PEER_VERSION)
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    model = str(Path(args.model).resolve())
    bins = build_peer(args.peer_version)

    single = {"llama.cpp": [], "localllm": []}
    serve = {"llama.cpp": [], "localllm": []}
    np_results: dict[int, list[float]] = {}
    for rnd in range(args.rounds):
        single["llama.cpp"].append(llama_bench(bins["llama-bench"], model, args.threads, args.reps))
        print(f"round {rnd + 1}: llama-bench {single['llama.cpp'][-1]}", flush=True)
        single["localllm"].append(localllm_single(model, args.threads, args.reps))
        print(f"round {rnd + 1}: localllm {single['localllm'][-1]}", flush=True)
        if args.skip_server:
            continue
        nps = [int(v) for v in args.np.split(",")] if rnd == 0 else [max(np_results, key=lambda k: max(np_results[k]))]
        for np_ in nps:
            r = run_llama_server(bins["llama-server"], model, args.threads, np_, args.clients, args.tokens)
            np_results.setdefault(np_, []).append(r["tok_s"])
            serve["llama.cpp"].append({**r, "np": np_})
            print(f"round {rnd + 1}: llama-server -np {np_}: {r['tok_s']:.1f} tok/s", flush=True)
        r = run_localllm_server(model, args.threads, args.clients, args.tokens)
        serve["localllm"].append(r)
        print(f"round {rnd + 1}: localllm serve: {r['tok_s']:.1f} tok/s", flush=True)

    best = lambda runs, key: max(r[key] for r in runs)
    file_size = Path(model).stat().st_size
    rows = []
    ll_tg, lc_tg = best(single["localllm"], "tg128"), best(single["llama.cpp"], "tg128")
    ll_pp, lc_pp = best(single["localllm"], "pp512"), best(single["llama.cpp"], "pp512")
    rows.append(("decode, single stream (tg128), tokens/s", f"{lc_tg:.1f}", f"{ll_tg:.1f}", f"{ll_tg / lc_tg:.2f}x"))
    rows.append(("prefill, 512-token prompt (pp512), tokens/s", f"{lc_pp:.1f}", f"{ll_pp:.1f}", f"{ll_pp / lc_pp:.2f}x"))
    if not args.skip_server:
        lc_best = max(serve["llama.cpp"], key=lambda r: r["tok_s"])
        ll_best = max(serve["localllm"], key=lambda r: r["tok_s"])
        rows.append((f"{args.clients} streaming clients x {args.tokens} tokens, output tokens/s (llama-server best -np {lc_best['np']})",
                     f"{lc_best['tok_s']:.1f}", f"{ll_best['tok_s']:.1f}", f"{ll_best['tok_s'] / lc_best['tok_s']:.2f}x"))
        rows.append(("TTFT p50 under that load, s", f"{lc_best['ttft_p50']:.2f}", f"{ll_best['ttft_p50']:.2f}", ""))
        rows.append(("server process RSS after the load, MiB", f"{lc_best['rss'] / 2**20:.0f}", f"{ll_best['rss'] / 2**20:.0f}", ""))
    rss_model = min(r["rss_model"] for r in single["localllm"])
    rows.append(("localllm model memory (RSS growth for load + run, KV excluded) / GGUF file", "",
                 f"{rss_model / 2**20:.0f} MiB / {file_size / 2**20:.0f} MiB", f"{rss_model / file_size:.2f}x"))
    held = single["localllm"][-1]["held"]
    rows.append(("of which repacked weights (their file pages are dropped)", "", f"{held / 2**20:.0f} MiB",
                 f"{held / file_size:.2f}x"))
    sweep = ", ".join(f"-np {k}: {max(v):.0f}" for k, v in sorted(np_results.items()))

    import torch

    stamp = (f"{datetime.date.today()}, {cpu_name()} ({platform.machine()}, {os.cpu_count()} cores), "
             f"{args.threads} threads each, torch {torch.__version__}, llama.cpp from {PEER_PACKAGE} {args.peer_version}; "
             f"{Path(model).name}; best of {args.rounds} alternating rounds")
    header = "| measure | llama.cpp | localllm | ratio |\n|---|---|---|---|\n"
    table = header + "\n".join("| " + " | ".join(r) + " |" for r in rows)
    text = f"`python bench/peer_llamacpp.py --threads {args.threads} --clients {args.clients} --rounds {args.rounds} " \
           f"--reps {args.reps}{' --skip-server' if args.skip_server else ''} --write-docs` ({stamp}):\n\n{table}\n"
    if sweep:
        text += f"\nllama-server output tokens/s by `-np` under the same load: {sweep}.\n"
    print(text)
    if args.write_docs:
        write_section("peer_llamacpp", text)


if __name__ == "__main__":
    main()
