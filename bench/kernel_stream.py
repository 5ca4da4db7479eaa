"""How fast the native CPU kernels stream one weight matrix per GGUF type (outside CI).

Each type: a random 8192x2048 weight in the file's blocks, repacked as the native route holds it,
copied ``--copies`` times (beyond the CPU's last-level cache), then ``--rows`` activation rows
multiplied through the copies in turn. Types are measured in interleaved rounds (this machine's
figures move between runs); prints GB/s of held weight bytes per type, best and median, and the
operations per second of the best (2 x rows x 8192 x 2048 multiply-accumulates x activation
passes, int8; F16/BF16: float32 FMAs, one pass; with many ``--rows`` the kernels are
compute-bound: compare with ``bench/cpu_peak.py``).

    python bench/kernel_stream.py --types Q4_0,Q8_0,Q6_K --rows 1 --passes 2
"""

from __future__ import annotations

import argparse
import time

import torch
from gguf import GGMLQuantizationType

from localllm.kernels.cpu import native, weights
from localllm.kernels.cpu.options import CpuOptions
from localllm.platform.memory import huge_page_buffer
from localllm.quant.testing import random_quantized


def held_copies(types: list[str], n: int, k: int, copies: int,
                huge_pages: bool = True) -> dict[str, tuple[weights.NativeWeight, list[torch.Tensor]]]:
    """Per GGUF type name: a random n x k weight repacked as the native route holds it, and
    ``copies`` copies of its packed bytes (to read beyond the last-level cache), in transparent
    huge pages as a loaded model's are (``huge_pages=False``: ordinary pages)."""
    held = {}
    for name in types:
        qtype = GGMLQuantizationType[name]
        raw = weights.as_bytes(torch.from_numpy(random_quantized(qtype, n, k, seed=1)), qtype)
        weight = weights.repack_native(raw, qtype, n, k)
        packed = weight.packed
        held[name] = (weight, [huge_page_buffer(packed.numel()).copy_(packed) if huge_pages else packed.clone()
                               for _ in range(copies)])
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q5_0,Q5_1,Q6_K,Q5_K,Q3_K,Q2_K")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--passes", type=int, default=2, choices=(1, 2))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native.load(CpuOptions.from_env()) is None:
        raise SystemExit("the native CPU kernels did not load on this machine")
    kernels = native.module()
    n, k = 8192, 2048
    held = held_copies(args.types.split(","), n, k, args.copies)
    x = torch.randn(args.rows, k)
    rates: dict[str, list[float]] = {name: [] for name in held}
    for _ in range(args.rounds):
        for name, (weight, copies) in held.items():
            for packed in copies[:2]:
                kernels.qgemm(x, packed, weight.bits, n, k, args.passes)
            start = time.perf_counter()
            for _ in range(2):
                for packed in copies:
                    kernels.qgemm(x, packed, weight.bits, n, k, args.passes)
            rates[name].append(weight.nbytes * 2 * len(copies) / (time.perf_counter() - start) / 1e9)
    print(f"{args.rows} row(s), {args.passes} pass(es), {args.threads} threads, {args.copies} copies of {n}x{k}")
    print("| type | held MiB per copy | GB/s best | GB/s median | G ops/s best |")
    print("|---|---|---|---|---|")
    for name, values in rates.items():
        values.sort()
        weight = held[name][0]
        passes = 1 if name in ("F16", "BF16") else args.passes  # float rows: float32 FMAs, no passes
        ops = values[-1] * 1e9 / weight.nbytes * 2 * args.rows * n * k * passes
        print(f"| {name} | {weight.nbytes / 2**20:.1f} | {values[-1]:.1f} | {values[len(values) // 2]:.1f} "
              f"| {ops / 1e9:.0f} |")


if __name__ == "__main__":
    main()
