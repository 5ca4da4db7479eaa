"""The batch-invariant matmul kernel's tile config, swept at batch 1 on Llama-3-8B shapes: how far
the config alone moves the kernel's own time (CUDA graph replays, no host), per weight type.

    python bench/gpu_matmul_configs.py [--dry-run]

Each config's output is checked against the default config's (relative error); the table lists
kernel us per call, GB/s and % of a measured copy, best first per shape and type. ``--dry-run``:
two configs on a tiny shape through the Triton interpreter (checks only, no timing).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check  # noqa: E402
from gpu_check import log  # noqa: E402
from gpu_profile import kernel_us_per_call  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=200, help="stop sweeping after this many seconds")
    started = gpu_check.start(ap)
    if started is None:
        return 2
    args, torch, device, copy_bw = started
    dry = args.dry_run
    from gguf import GGMLQuantizationType as T

    from localllm.kernels.triton import quant as triton_quant

    default = triton_quant._invariant_gemm_config
    if dry:
        cases = [(T.Q4_K, "tiny", 64, 256)]
        configs = [dict(BLOCK_N=64, BLOCK_K=256, num_warps=4), dict(BLOCK_N=32, BLOCK_K=128, num_warps=4)]
    else:
        cases = [(T.Q4_K, "down 4096x14336", 4096, 14336), (T.F16, "down 4096x14336", 4096, 14336),
                 (T.Q8_0, "down 4096x14336", 4096, 14336), (T.Q4_K, "q/o 4096x4096", 4096, 4096)]
        configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
                   for bn, bk, w, s in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3,))]
    dtype = torch.float32 if dry else torch.bfloat16
    start = time.time()
    for qtype, label, n, k in cases:
        if time.time() - start > args.budget_s:
            log(f"\n(budget of {args.budget_s:.0f} s spent: {qtype.name} {label} and what follows not swept)")
            break
        raw = gpu_check.random_weight(torch, qtype, n, k, device)
        x = torch.randn(1, k, device=device, dtype=dtype)
        moved = raw.numel() + 2 * x.numel() * x.element_size() + n * x.element_size()
        ref = triton_quant.quant_matmul(x, raw, qtype, invariant=True).float()
        rows = []
        for cfg in configs:
            if time.time() - start > args.budget_s:
                log(f"(budget of {args.budget_s:.0f} s spent: the sweep stops here)")
                break
            full = {**default(dtype), **cfg}
            triton_quant._invariant_gemm_config = lambda d=None, full=full: full
            try:
                out = triton_quant.quant_matmul(x, raw, qtype, invariant=True).float()
                err = ((out - ref).norm() / ref.norm()).item()
                us = None if dry else kernel_us_per_call(
                    torch, lambda: triton_quant.quant_matmul(x, raw, qtype, invariant=True))
            except Exception as exc:  # noqa: BLE001 - a config that cannot launch is a finding too
                rows.append((float("inf"), cfg, f"{type(exc).__name__}", None))
                continue
            finally:
                triton_quant._invariant_gemm_config = default
            rows.append((us if us is not None else 0.0, cfg, f"{err:.1e}",
                         triton_quant.invariant_split_k(n, k, full["BLOCK_N"])))
        log(f"\n## {qtype.name} {label}, batch 1 (default: {default(dtype)})")
        log("| BLOCK_N | BLOCK_K | warps | stages | split-K | kernel us | GB/s | % of copy "
            "| rel. err vs default |")
        log("|---|---|---|---|---|---|---|---|---|")
        for us, cfg, err, split in sorted(rows, key=lambda r: r[0]):
            gbps = "-" if dry or us == float("inf") else f"{moved / (us * 1e-6) / 1e9:.0f}"
            share = "-" if dry or us == float("inf") else f"{moved / (us * 1e-6) / copy_bw:.0%}"
            tile = f"{cfg['BLOCK_N']} | {cfg['BLOCK_K']} | {cfg['num_warps']} | {cfg.get('num_stages', '-')}"
            log(f"| {tile} | "
                f"{split} | {'-' if dry else f'{us:.1f}'} | {gbps} | {share} | {err} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
