"""Where a GPU decode step's time goes: the launch cost on the host beside the kernels' own time,
and the kernels of one synthetic 8B-shaped decode step ranked by GPU time.

    python bench/gpu_profile.py [--types Q4_K,Q6_K,Q8_0,F16] [--dry-run]

* ``matmuls``: ``quant_matmul`` at batch 1 on Llama-3-8B-shaped matrices of ``--types`` (Q4_K
  unless told), on the default batch-invariant route and on fast-math: the host's time per call
  (Python wrapper and Triton's launch, no synchronisation), the kernels' time per call from a
  CUDA graph of 20 calls replayed
  (no host in it), and that time as achieved bandwidth against a measured device copy.
  ``bench/gpu_check.py``'s ``do_bench`` figure is the larger of the two, roughly, when the host
  is slower than the kernel.
* ``decode step``: ``torch.profiler`` over 3 eager decode steps (batch 1, no graphs, so that each
  kernel shows by name) of ``bench/gpu_check.py``'s synthetic model: the kernels ranked by GPU
  time per step.

``--dry-run``: the same on the CPU through the Triton interpreter, tiny shapes, no graphs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check  # noqa: E402  (bench/gpu_check.py: the random blocks, the synthetic model)
from gpu_check import log  # noqa: E402


def host_us_per_call(torch, fn, calls: int) -> float:
    """Wall time per call with no synchronisation inside: what the host spends to launch it."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return dt / calls * 1e6


def kernel_us_per_call(torch, fn, calls: int = 20, replays: int = 10) -> float:
    """GPU time per call: ``calls`` calls captured in one CUDA graph, replayed and timed with
    events (no host launch cost inside the timing)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def matmuls(torch, device, dry: bool, copy_bw: float | None, qtypes: list[str]) -> None:
    from gguf import GGMLQuantizationType as T

    from localllm.kernels.triton import quant as triton_quant
    from localllm.kernels.triton.quant import quant_matmul

    triton_quant.configure(autotune=False)
    shapes = [("tiny", 64, 256)] if dry else [
        ("q/o 4096x4096", 4096, 4096), ("k/v 1024x4096", 1024, 4096),
        ("gate/up 14336x4096", 14336, 4096), ("down 4096x14336", 4096, 14336),
    ]
    dtype = torch.float32 if dry else torch.bfloat16
    log(f"\n## matmuls at batch 1 ({', '.join(qtypes)}): host launch cost beside the kernels' own time")
    log("| type | matrix | route | host us/call | kernel us/call (graph) | kernel GB/s | % of copy |")
    log("|---|---|---|---|---|---|---|")
    for name in qtypes:
        qtype = T[name]
        for label, n, k in shapes:
            raw = gpu_check.random_weight(torch, qtype, n, k, device)
            x = torch.randn(1, k, device=device, dtype=dtype)
            moved = raw.numel() + 2 * x.numel() * x.element_size() + n * x.element_size()
            for route, invariant in (("default", True), ("fast-math", False)):
                def fn(x=x, raw=raw, qtype=qtype, invariant=invariant):
                    return quant_matmul(x, raw, qtype, invariant=invariant)

                host = host_us_per_call(torch, fn, 3 if dry else 200)
                if dry:
                    log(f"| {name} | {label} | {route} | {host:.1f} | - | - | - |")
                    continue
                kernel = kernel_us_per_call(torch, fn)
                gbps = moved / (kernel * 1e-6) / 1e9
                share = f"{moved / (kernel * 1e-6) / copy_bw:.0%}" if copy_bw else "-"
                log(f"| {name} | {label} | {route} | {host:.1f} | {kernel:.1f} | {gbps:.0f} | {share} |")


def decode_step(torch, device, dry: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from localllm.engine.gpu_runner import DecodeGraphs
    from localllm.kernels.triton.backend import TritonBackend

    model, cfg, dtype, ctx0, _ = gpu_check.synthetic_model(torch, device, dry)
    bs, steps = 16, 3
    per_seq = -(-(ctx0 + steps + 8) // bs)
    kv = [torch.zeros(2, per_seq, bs, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
          for _ in range(cfg.num_layers)]
    tables = torch.arange(per_seq, device=device).view(1, per_seq)
    graphs = DecodeGraphs(model, kv, [1], per_seq, bs, device, capture=False,
                          decode_splits=TritonBackend().decode_splits)
    ids = torch.zeros(1, dtype=torch.long, device=device)

    def step(pos: int, ids):
        positions = torch.full((1,), pos, dtype=torch.long, device=device)
        slots = tables[:, pos // bs] * bs + pos % bs
        ctx = torch.full((1,), pos + 1, dtype=torch.long, device=device)
        return graphs.run(ids, positions, slots, ctx, tables).argmax(-1)

    for w in range(2):
        ids = step(ctx0 + w, ids)
    activities = [ProfilerActivity.CPU] + ([] if dry else [ProfilerActivity.CUDA])
    if not dry:
        torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=activities) as prof:
        for s in range(steps):
            ids = step(ctx0 + 2 + s, ids)
        if not dry:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps * 1e3
    log(f"\n## one eager decode step, batch 1 ({cfg.num_layers} layers; "
        f"{wall:.1f} ms wall per step, profiler on)")
    if dry:
        log(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8))
        return
    events = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in events)
    kernels = sum(e.count for e in events) // steps
    log(f"GPU time per step: {total / steps / 1e3:.2f} ms over {kernels} kernels")
    log("| kernel | calls/step | GPU us/step | share | us/call |")
    log("|---|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:15]:
        log(f"| {e.key[:70]} | {e.count // steps} | {e.device_time_total / steps:.0f} | "
            f"{e.device_time_total / total:.0%} | {e.device_time_total / e.count:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K",
                    help="comma-separated GGUF types for the matmuls (e.g. Q4_K,Q6_K,Q8_0,F16)")
    started = gpu_check.start(ap)
    if started is None:
        return 2
    args, torch, device, copy_bw = started
    matmuls(torch, device, args.dry_run, copy_bw, args.types.split(","))
    decode_step(torch, device, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
