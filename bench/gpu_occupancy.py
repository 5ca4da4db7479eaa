"""Occupancy of the default (batch-invariant) Triton kernels on the cards this project is for, from
the real compiler's output, no GPU needed.

    python bench/gpu_occupancy.py [--write-docs]

For one decode step of a Llama-3-8B-shaped model (bf16 activations, Q4_K weights, Q6_K head, head
dim 128, 32 query / 8 KV heads) at batch 1, each launch is compiled for sm_80 (A100), sm_86
(RTX 3090), sm_89 (RTX 4090) and sm_90 (H100) by :mod:`localllm.kernels.triton.compile`, and the
table gives its shared memory, registers per thread, the blocks (CTAs) an SM holds at once (the
occupancy calculator's minimum over threads, registers and shared memory) and the programs its
grid has at batch 1 against the card's SMs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def launches(spec):
    """``[(label, programs at batch 1, Launch)]`` for one decode step of the 8B shape on ``spec``."""
    import torch
    import triton
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    from localllm.kernels.triton import attention as ta
    from localllm.kernels.triton import compile as tc
    from localllm.kernels.triton import ops as triton_ops
    from localllm.kernels.triton import quant as triton_quant

    out = []
    bf16 = torch.bfloat16
    block_n = triton_quant._invariant_gemm_config()["BLOCK_N"]
    with tc.capture(spec) as take:
        for label, qtype, n, k in (("q/o proj 4096x4096 Q4_K", T.Q4_K, 4096, 4096),
                                   ("k/v proj 1024x4096 Q4_K", T.Q4_K, 1024, 4096),
                                   ("gate/up 28672x4096 Q4_K", T.Q4_K, 28672, 4096),
                                   ("down 4096x14336 Q4_K", T.Q4_K, 4096, 14336),
                                   ("LM head 128256x4096 Q6_K", T.Q6_K, 128256, 4096)):
            block, size = GGML_QUANT_SIZES[qtype]
            raw = torch.zeros(n, k // block * size, dtype=torch.uint8)
            triton_quant.quant_matmul(torch.zeros(1, k, dtype=bf16), raw, qtype, invariant=True)
            split = triton_quant.invariant_split_k(n, k, block_n)
            gemm, *rest = take(label)
            out.append((f"{label} (split-K {split})", triton.cdiv(n, block_n) * split, gemm))
            for extra in rest:  # the split-K sum
                out.append((f"{label}: sum of {split} splits", triton.cdiv(n, 1024), extra))
        cache = torch.zeros(2, 256, 16, 8, 128, dtype=bf16)
        tables = torch.arange(256, dtype=torch.int32).view(1, 256)
        q = torch.zeros(1, 32, 128, dtype=bf16)
        ta.paged_attention(q, cache, tables, torch.tensor([4096], dtype=torch.int32), torch.tensor([0, 1]), 1,
                           0.088, max_context_len=4096, invariant=True)
        (attn,) = take("attention decode")
        out.append(("attention decode, 4k context (no KV splits)", 8, attn))
        triton_ops.rope_write_kv(torch.zeros(1, dtype=torch.long), q, torch.zeros(1, 8, 128, dtype=bf16),
                                 torch.zeros(1, 8, 128, dtype=bf16), torch.ones(64, 64), torch.ones(64, 64), 128,
                                 True, cache, torch.zeros(1, dtype=torch.long))
        (rope,) = take("rope + KV write")
        out.append(("RoPE + KV write", 1, rope))
        x = torch.zeros(1, 4096, dtype=bf16)
        triton_ops.add_rms_norm(x, x, torch.ones(4096, dtype=bf16), 1e-5)
        (norm,) = take("add + RMSNorm")
        out.append(("add + RMSNorm", 1, norm))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    import torch
    import triton

    from localllm.kernels.triton.compile import compile_launch
    from localllm.kernels.triton.spec import KNOWN_TARGETS

    rows = ["| card (SMs) | launch | warps | shared B | regs | CTAs/SM | programs at batch 1 | share of the SMs' slots |",
            "|---|---|---|---|---|---|---|---|"]
    for spec in KNOWN_TARGETS:
        for label, programs, launch in launches(spec):
            r = compile_launch(launch, spec)
            slots = spec.num_sms * max(r.ctas_per_sm, 1)
            rows.append(f"| {spec.name} ({spec.num_sms}) | {label} | {r.num_warps} | {r.shared} | {r.registers} | "
                        f"{r.ctas_per_sm} | {programs} | {min(programs / slots, 1):.0%} |")
    table = "\n".join(rows)
    head = (f"`python bench/gpu_occupancy.py --write-docs` ({time.strftime('%Y-%m-%d')}, triton {triton.__version__}, "
            f"torch {torch.__version__}; the real compiler, no GPU):")
    print(head)
    print(table)
    if args.write_docs:
        from _report import write_section

        write_section("gpu_occupancy", head + "\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
