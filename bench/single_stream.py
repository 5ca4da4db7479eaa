"""Single-stream speed and resident memory of a GGUF model on this machine.

    python bench/single_stream.py [--model PATH] [--dtype float32] [--tokens 128] [--write-docs]

Prints a table: load time, resident memory (RSS) against the file size, prefill tokens/s for a
512-token prompt and decode tokens/s for --tokens tokens after a short prompt.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    import torch
    import transformers  # noqa: F401 - imported before the baseline so RSS growth is the model's
    from transformers import AutoTokenizer  # noqa: F401

    from localllm import LLM, SamplingParams

    rss0 = rss_bytes()
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory="256MiB")
    load_s = time.perf_counter() - t0
    kv_bytes = llm.engine.runner.write_kv_caches()  # resident whole, then subtracted
    # Touch every weight page once so RSS counts the mapped file as a steady-state server would.
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    try:  # return freed temporaries to the OS so RSS shows what the model holds
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    rss_model = rss_bytes() - rss0 - kv_bytes
    weight_bytes = sum(b.numel() * b.element_size() for b in llm.engine.model.buffers()) + sum(
        p.numel() * p.element_size() for p in llm.engine.model.parameters())
    repacked_bytes = llm.engine.backend.held_bytes(llm.engine.model)
    file_size = Path(args.model).stat().st_size

    prompt = list(range(1000, 1512))
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    prefill_tps = len(prompt) / (time.perf_counter() - t0)

    short = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story about a robot."}])
    llm.generate([short], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    t_first = None
    t0 = time.perf_counter()
    n = 0
    for out in llm.stream(short, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)):
        n += len(out.new_token_ids)
        if t_first is None:
            t_first = time.perf_counter()
    decode_tps = (n - 1) / (time.perf_counter() - t_first)

    rows = [
        ("model", Path(args.model).name),
        ("dtype", args.dtype),
        ("path", f"fast CPU path ({llm.engine.kernels} kernels)" if llm.engine.kernels != "torch"
         else "float32 reference (LOCALLLM_CPU_FAST=0)"),
        ("threads", str(torch.get_num_threads())),
        ("load time", f"{load_s:.1f} s"),
        ("GGUF file size", f"{file_size / 2**20:.1f} MiB"),
        ("resident memory of the loaded model (RSS growth, KV cache excluded)",
         f"{rss_model / 2**20:.1f} MiB ({rss_model / file_size:.2f}x the file)"),
        ("GGUF weights mapped (packed, mmap-shared, plus norms and RoPE tables)", f"{weight_bytes / 2**20:.1f} MiB"),
        ("weights repacked by the fast CPU path (their file pages are dropped)", f"{repacked_bytes / 2**20:.1f} MiB"),
        ("prefill, 512-token prompt", f"{prefill_tps:.1f} tokens/s"),
        (f"decode, single stream, {args.tokens} tokens", f"{decode_tps:.2f} tokens/s"),
    ]
    stamp = f"{datetime.date.today()} on {platform.machine()} with {os.cpu_count()} cores, torch {torch.__version__}"
    table = "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    env = f"LOCALLLM_THREADS={os.environ['LOCALLLM_THREADS']} " if os.environ.get("LOCALLLM_THREADS") else ""
    text = f"`{env}python bench/single_stream.py --write-docs` ({stamp}):\n\n{table}\n"
    print(text)
    if args.write_docs:
        write_section("single_stream", text)


if __name__ == "__main__":
    main()
