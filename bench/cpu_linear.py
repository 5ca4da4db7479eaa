"""Quantized linears on CPU: the reference path against the fast path, per shape and end to end.

    python bench/cpu_linear.py [--threads N] [--reps 9] [--e2e-runs 3] [--skip-e2e] [--write-docs]

Part 1 times one linear of each SmolLM2-135M shape (Q4_1 weights, the tied Q8_0 LM head) at
batches of 1, 32 and 512 rows: the reference (dequantize to float32, then matmul), the native
kernel (AVX-512 VNNI or AVX2; two activation passes, the default, and one) and the int4 routes that
CPUs without it take (int4 kernel; dequantize to bfloat16 + GEMM). Each route cycles through
enough copies of each weight to exceed a 64 MiB working set, so weights come from memory as
they do in a full model rather than from the last-level cache. Figures are medians over --reps
calls, in milliseconds.

Part 2 runs bench/single_stream.py --e2e-runs times with LOCALLLM_CPU_FAST=0 and =1 and
reports the median decode and 512-token prefill tokens/s and the resident memory.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import write_section

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# (label, out_features, in_features, GGUF type name): the linears of one SmolLM2-135M layer and its head
SHAPES = [
    ("q_proj / o_proj", 576, 576, "Q4_1"),
    ("k_proj / v_proj", 192, 576, "Q4_1"),
    ("gate_proj / up_proj", 1536, 576, "Q4_1"),
    ("down_proj", 576, 1536, "Q4_1"),
    ("lm_head (tied embedding)", 49152, 576, "Q8_0"),
]
BATCHES = (1, 32, 512)
WORKING_SET = 64 << 20


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _shape_rows(label: str, n: int, k: int, type_name: str, reps: int) -> list[str]:
    import torch
    from gguf import GGMLQuantizationType

    from localllm.kernels.cpu import int4 as int4_route
    from localllm.kernels.cpu import native as cpu_native
    from localllm.kernels.cpu import weights
    from localllm.kernels.cpu.options import CpuOptions
    from localllm.quant import QuantLinear
    from localllm.quant.testing import random_quantized

    qtype = GGMLQuantizationType[type_name]
    raw = torch.from_numpy(random_quantized(qtype, n, k, seed=0))
    ref_layer = QuantLinear(raw, qtype, k, n)

    def copies_of(repack):
        first = repack(raw, qtype, n, k)
        count = min(1024, -(-WORKING_SET // first.nbytes))
        return [first] + [repack(raw.clone(), qtype, n, k) for _ in range(count - 1)]

    native = copies_of(weights.repack_native) if cpu_native.load(CpuOptions.from_env()) is not None else []
    int4 = copies_of(int4_route.repack_int4)
    layout = int4_route.packed_layout()
    turn = 0

    def weight(copies):
        nonlocal turn
        turn = (turn + 1) % len(copies)
        return copies[turn % len(copies)]

    def reference(x):
        return ref_layer.reference_forward(x)

    def native_mm(x, passes):
        w = weight(native)
        return cpu_native.qgemm(x, w.packed, w.bits, n, k, passes)

    def kernel(x):
        return weight(int4).mm_small(x.bfloat16()).float()

    def dequant_gemm(x):
        return weight(int4).mm_dequant(x.bfloat16(), layout).float()

    nan = float("nan")
    rows = []
    for m in BATCHES:
        if m > 32 and n > 8192:
            continue  # the head only ever sees the rows that sample
        x = torch.randn(m, k)
        ref = _median_ms(functools.partial(reference, x), max(3, reps // 3))
        t_n2 = _median_ms(functools.partial(native_mm, x, 2), reps) if native else nan
        t_n1 = _median_ms(functools.partial(native_mm, x, 1), reps) if native else nan
        t_kernel = _median_ms(functools.partial(kernel, x), reps)
        t_deq = _median_ms(functools.partial(dequant_gemm, x), reps) if layout else nan
        best_int4 = min(t_kernel, t_deq) if layout else t_kernel
        rows.append(f"| {label} | {n}x{k} {type_name} | {m} | {ref:.2f} | {t_n2:.3f} | {t_n1:.3f} | {t_kernel:.3f} | "
                    f"{t_deq:.3f} | {ref / t_n2:.0f}x | {best_int4 / t_n2:.1f}x |")
    return rows


def per_shape_table(reps: int) -> str:
    rows = [row for shape in SHAPES for row in _shape_rows(*shape, reps)]
    head = ("| linear | weight | batch | reference ms | native ms (default, 2 passes) | native ms (int8, 1 pass) "
            "| int4 kernel ms | dequant+bf16 GEMM ms | native vs reference | native vs best int4 route |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    return head + "\n".join(rows)


def _single_stream(model: str, fast: bool, tokens: int) -> dict[str, str]:
    env = dict(os.environ, LOCALLLM_CPU_FAST="1" if fast else "0")
    cmd = [sys.executable, str(ROOT / "bench" / "single_stream.py"), "--model", model, "--tokens", str(tokens)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"^\| (.+?) \| (.+?) \|$", out, flags=re.MULTILINE))


def _number(text: str) -> float:
    return float(re.match(r"[0-9.]+", text).group())


def end_to_end_table(model: str, runs: int) -> str:
    rows = []
    for fast, tokens in ((False, 16), (True, 128)):
        results = [_single_stream(model, fast, tokens) for _ in range(runs)]
        decode_key = next(k for k in results[0] if k.startswith("decode"))
        rss_key = next(k for k in results[0] if k.startswith("resident"))
        decode = statistics.median(_number(r[decode_key]) for r in results)
        prefill = statistics.median(_number(r["prefill, 512-token prompt"]) for r in results)
        rss = statistics.median(_number(r[rss_key]) for r in results)
        rows.append(f"| {'fast (default)' if fast else 'reference (LOCALLLM_CPU_FAST=0)'} | {decode:.1f} "
                    f"({tokens} tokens) | {prefill:.0f} | {rss:.0f} MiB ({rss * 2**20 / Path(model).stat().st_size:.2f}x"
                    f" the file) |")
    head = ("| path | decode tokens/s | prefill tokens/s (512-token prompt) | resident memory |\n"
            "|---|---|---|---|\n")
    return head + "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--e2e-runs", type=int, default=3)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    stamp = (f"{datetime.date.today()} on {platform.machine()} with {os.cpu_count()} cores, "
             f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
    text = f"`python bench/cpu_linear.py` ({stamp}); per linear, median of {args.reps} calls:\n\n"
    text += per_shape_table(args.reps) + "\n"
    if not args.skip_e2e:
        text += (f"\nEnd to end, `bench/single_stream.py` (float32 model; medians of {args.e2e_runs} runs; "
                 "the reference decodes 16 tokens, the fast path 128):\n\n")
        text += end_to_end_table(args.model, args.e2e_runs) + "\n"
    print(text)
    if args.write_docs:
        write_section("cpu_linear", text)


if __name__ == "__main__":
    main()
