"""The Triton path on one GPU: a real server first, then the kernels and the engine, each on the
batch-invariant default beside fast-math.

    python bench/gpu_check.py [--model PATH.gguf] [--synthetic] [--deadline EPOCH_S] [--dry-run]

Sections, in order (``bench/gpu_check.sh`` runs the GPU tests between the first and the second):

* ``serve``: ``localllm serve`` on the GPU answers a chat completion, a streamed one and an
  embeddings request over HTTP (``--model``, else SmolLM2 from ``../shared/models``, else a
  tiny random GGUF written here);
* ``decode matmuls``: the dequant-fused matmul at batch 1 and 16 on 8B-shaped (Llama-3-8B)
  matrices, the batch-invariant GEMM (shape-fixed split-K) beside fast-math's GEMV (one fixed
  config: no autotuning inside the time budget), achieved memory bandwidth as % of the device's
  peak (a table of spec sheets, else memory clock x bus width) and of a measured copy;
* ``attention decode``: paged attention of 32 query / 8 KV heads of 128 at batch 1 and 32 over a
  4k context, the invariant tile (no KV splits) beside fast-math's flash-decoding splits;
* ``end-to-end decode``: tokens/s at batch 1 and 32 through the engine, default beside
  ``fast_math=True`` (or a synthetic 8B-shaped Q4_K model through CUDA graphs).

``--dry-run`` runs every section on tiny shapes on the CPU (the Triton interpreter; the serve
check on the CPU kernels), timing with a wall clock and no percentages: a smoke test of this
script that the test suite runs. A section past ``--deadline`` is skipped, and a skipped section
fails the run (exit 1) just as a failed one does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_MODEL = REPO.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# Peak DRAM bandwidth, GB/s (1e9 B/s) from vendor spec sheets; first matching substring wins.
PEAK_GBPS = [
    ("H200", 4800),
    ("GH200", 4000),
    ("H100 NVL", 3900),
    ("H100 PCIe", 2000),
    ("H100", 3350),
    ("H800", 3350),
    ("B200", 8000),
    ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935),
    ("A100", 1555),
    ("A800", 2039),
    ("L40S", 864),
    ("L40", 864),
    ("L4", 300),
    ("A10G", 600),
    ("A10", 600),
    ("A6000", 768),
    ("RTX 6000 Ada", 960),
    ("4090", 1008),
    ("4080", 717),
    ("3090", 936),
    ("3080", 760),
    ("V100", 900),
    ("T4", 320),
    ("MI300X", 5300),
    ("MI250", 3277),
    ("MI210", 1638),
]


def log(*a) -> None:
    print(*a, flush=True)


class Clock:
    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def allows(self, section: str, need_s: float) -> bool:
        if self.left() < need_s:
            log(
                f"\n## {section}\nSKIPPED: {self.left():.0f} s left before the deadline, "
                f"about {need_s:.0f} s needed (a skipped section fails the run)"
            )
            return False
        return True


# ---------------------------------------------------------------------------------------------
# Device facts


def peak_bandwidth(torch) -> tuple[float | None, str]:
    """(bytes/s, source) of the device's spec-sheet peak, or None."""
    props = torch.cuda.get_device_properties(0)
    for key, gbps in PEAK_GBPS:
        if key.lower() in props.name.lower():
            return gbps * 1e9, f"spec sheet ({key})"
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "memory clock x bus width"
    return None, "unknown"


def copy_bandwidth(torch, bench) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), the practical ceiling."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * (1 << 30) / (ms * 1e-3)


def make_bench(torch, dry: bool):
    if dry:

        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

        return bench
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=25, rep=100)  # ms, L2 flushed between runs


def pct(bytes_moved: float, ms: float, peak: float | None) -> str:
    if peak is None:
        return "n/a"
    return f"{100 * bytes_moved / (ms * 1e-3) / peak:.0f}%"


# ---------------------------------------------------------------------------------------------
# Sections


def random_blocks(torch, qtype, rows: int, cols: int, device):
    """Random GGUF blocks ``uint8 [rows, bytes_per_row]`` made on ``device``, with every fp16
    scale field set to a small finite value (as ``localllm.quant.testing.random_quantized``)."""
    from gguf import GGML_QUANT_SIZES

    from localllm.quant.testing import _FP16_FIELDS, WEIGHT_SCALE

    block, size = GGML_QUANT_SIZES[qtype]
    nb = cols // block
    raw = torch.randint(0, 256, (rows, nb, size), dtype=torch.uint8, device=device)
    for offset, mult in _FP16_FIELDS[qtype]:
        scale = (torch.randn(rows, nb, device=device) * (WEIGHT_SCALE / mult)).half()
        raw[:, :, offset : offset + 2] = scale.view(torch.uint8).view(rows, nb, 2)
    return raw.view(rows, nb * size)


def random_weight(torch, qtype, rows: int, cols: int, device):
    """Random weight bytes ``uint8 [rows, bytes_per_row]`` of any type the matmuls take: F16/BF16
    values as their bytes, block types as :func:`random_blocks`."""
    from gguf import GGMLQuantizationType as T

    if qtype in (T.F16, T.BF16):
        values = torch.randn(rows, cols, device=device)
        return values.to(torch.float16 if qtype == T.F16 else torch.bfloat16).view(torch.uint8)
    return random_blocks(torch, qtype, rows, cols, device)


def start(ap: argparse.ArgumentParser):
    """Parse a GPU script's arguments (``ap`` with ``--dry-run`` added: tiny shapes on the CPU,
    the Triton interpreter switched on before anything imports Triton) and ready the device, said
    in one line: ``(args, torch, device, measured copy bandwidth or None)``, or ``None`` when a real
    run finds no CUDA device."""
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU via the Triton interpreter")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.manual_seed(0)
    if args.dry_run:
        return args, torch, torch.device("cpu"), None
    if not torch.cuda.is_available():
        log("no CUDA device: run with --dry-run for the CPU smoke test")
        return None
    copy_bw = copy_bandwidth(torch, make_bench(torch, False))
    log(f"device: {torch.cuda.get_device_name(0)}; measured copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    return args, torch, torch.device("cuda"), copy_bw


def gemv_section(torch, bench, device, dry: bool, peak, copy_bw) -> None:
    from gguf import GGMLQuantizationType as T

    from localllm.kernels.triton import quant as triton_quant
    from localllm.kernels.triton.quant import choose_split_k, invariant_split_k, quant_matmul

    triton_quant.configure(autotune=False)  # fast-math in one fixed config: no autotuning in the budget
    log(
        "\n## decode matmuls (dequant-fused, "
        + ("float32, CPU interpreter, tiny shapes)" if dry else "bf16 activations)")
        + ": batch-invariant default | fast-math"
    )
    if dry:
        shapes = [("tiny", 64, 256)]
        cases = [(T.Q4_K, s, b) for s in shapes for b in (1, 16)]
    else:
        shapes = [
            ("q/o 4096x4096", 4096, 4096),
            ("k/v 1024x4096", 1024, 4096),
            ("gate/up 14336x4096", 14336, 4096),
            ("down 4096x14336", 4096, 14336),
        ]
        cases = [(T.Q4_K, s, b) for s in shapes for b in (1, 16)]
        gate = shapes[0]
        cases += [(q, gate, 1) for q in (T.Q4_0, T.Q8_0, T.Q6_K, T.Q5_K, T.Q2_K, T.F16, T.BF16)]
    dtype = torch.float32 if dry else torch.bfloat16
    log("| type | matrix | batch | split-K default / fast | default us | GB/s | % of peak | fast-math us | GB/s "
        "| % of peak | % of copy (default) |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for qtype, (label, n, k), batch in cases:
        raw = random_weight(torch, qtype, n, k, device)
        x = torch.randn(batch, k, device=device, dtype=dtype)
        moved = raw.numel() + 2 * x.numel() * x.element_size() + batch * n * x.element_size()
        times = []
        for invariant in (True, False):
            quant_matmul(x, raw, qtype, invariant=invariant)  # compile outside the timing
            times.append(bench(lambda x=x, raw=raw, qtype=qtype, inv=invariant: quant_matmul(x, raw, qtype, invariant=inv)))
        splits = f"{invariant_split_k(n, k, triton_quant._invariant_gemm_config()['BLOCK_N'])} / {choose_split_k(n, k, x.device)}"
        cols = " | ".join(f"{ms * 1e3:.1f} | {moved / (ms * 1e-3) / 1e9:.0f} | {pct(moved, ms, peak)}" for ms in times)
        log(f"| {qtype.name} | {label} | {batch} | {splits} | {cols} | {pct(moved, times[0], copy_bw)} |")
        raw = x = None  # free before the next case


def attention_section(torch, bench, device, dry: bool, peak, copy_bw) -> None:
    from localllm.kernels.triton import attention as ta
    from localllm.kernels.triton import kv as tkv

    if dry:
        heads, kv_heads, head_dim, ctx, batches, bs = 4, 2, 64, 64, (1, 4), 16
        dtype = torch.float32
    else:
        heads, kv_heads, head_dim, ctx, batches, bs = 32, 8, 128, 4096, (1, 32), 16
        dtype = torch.bfloat16
    log(
        f"\n## attention decode ({heads} q / {kv_heads} kv heads x {head_dim}, context {ctx}, block {bs}"
        + (", CPU interpreter" if dry else "")
        + "): batch-invariant default (no KV splits) | fast-math (flash-decoding splits)"
    )
    log("| KV | batch | splits (fast-math) | default us | GB/s | % of peak | fast-math us | GB/s | % of peak |")
    log("|---|---|---|---|---|---|---|---|---|")
    variants = [(None, b) for b in batches] + (
        [] if dry else [(tkv.KVQuant(torch.int8, "token"), batches[-1])]
    )
    for quant, batch in variants:
        blocks_per_seq = -(-ctx // bs)
        num_blocks = batch * blocks_per_seq
        if quant is None:
            cache = torch.randn(2, num_blocks, bs, kv_heads, head_dim, device=device).to(dtype)
            kv_bytes = cache.numel() * cache.element_size()
        else:
            cache = tkv.QuantizedKVCache.allocate(num_blocks, bs, kv_heads, head_dim, quant, device=device)
            cache.data.copy_(torch.randint(-127, 128, cache.data.shape, device=device, dtype=torch.int8))
            cache.scales.uniform_(0.005, 0.02)
            kv_bytes = cache.data.numel() + cache.scales.numel() * 4
        perm = torch.randperm(num_blocks, device=device)  # scattered blocks, as a busy cache has
        tables = perm.view(batch, blocks_per_seq)
        ctx_lens = torch.full((batch,), ctx, dtype=torch.long, device=device)
        qsl = torch.arange(batch + 1, device=device)
        q = torch.randn(batch, heads, head_dim, device=device).to(dtype)
        splits = ta.choose_num_splits(batch, kv_heads, 1, ctx, q.device)
        moved = kv_bytes + 2 * q.numel() * q.element_size()
        times = []
        for invariant in (True, False):

            def run(q=q, cache=cache, tables=tables, ctx_lens=ctx_lens, qsl=qsl, invariant=invariant):
                return ta.paged_attention(q, cache, tables, ctx_lens, qsl, 1, head_dim**-0.5, max_context_len=ctx,
                                          invariant=invariant)

            run()
            times.append(bench(run))
        name = "bf16" if quant is None and not dry else ("f32" if quant is None else "int8/token")
        cols = " | ".join(f"{ms * 1e3:.1f} | {moved / (ms * 1e-3) / 1e9:.0f} | {pct(moved, ms, peak)}" for ms in times)
        log(f"| {name} | {batch} | {splits} | {cols} |")
        cache = None


def engine_e2e(torch, model_path: str, dtype: str, steps: int) -> None:
    from localllm import LLM, SamplingParams

    log(f"\n## end-to-end decode ({Path(model_path).name}, {dtype}, kernels=triton): default | fast-math")
    log("| route | load + capture s | batch | tokens | seconds | tokens/s (aggregate) | per stream |")
    log("|---|---|---|---|---|---|---|")
    for fast_math in (False, True):
        t0 = time.perf_counter()
        llm = LLM(model=model_path, device="cuda", dtype=dtype, kernels="triton", max_num_seqs=32,
                  max_model_len=2048, fast_math=fast_math)
        if llm.engine.kernels != "triton":
            raise RuntimeError(f"the engine fell back to the {llm.engine.kernels} kernels (see the log above)")
        load = time.perf_counter() - t0
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        llm.generate(["Warm up the prefill path."] * 2, SamplingParams(max_tokens=4, temperature=0.0))
        for batch in (1, 32):
            prompts = [f"Write a story about the number {i}." for i in range(batch)]
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            route = "fast-math" if fast_math else "default"
            log(f"| {route} | {load:.1f} | {batch} | {n} | {dt:.2f} | {n / dt:.1f} | {n / dt / batch:.1f} |")
        del llm
        torch.cuda.empty_cache()


def serve_section(model: str, dry: bool) -> None:
    """``localllm serve MODEL`` on the GPU (the CPU in a dry run): a chat completion, a streamed
    one and an embeddings request over HTTP, each checked."""
    import httpx

    sys.path.insert(0, str(REPO / "tests"))
    from api_server import serving

    device = "cpu" if dry else "cuda"
    log(f"\n## serve ({Path(model).name} on {device})")
    t0 = time.perf_counter()
    with serving(model, "--device", device, "--served-model-name", "gpu-check") as server:
        log(f"ready in {time.perf_counter() - t0:.1f} s at {server.url}")
        with httpx.Client(base_url=server.url, timeout=120) as client:
            chat = {"model": "gpu-check", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                    "temperature": 0}
            r = client.post("/v1/chat/completions", json=chat)
            r.raise_for_status()
            body = r.json()
            assert body["usage"]["completion_tokens"] > 0, body
            log(f"chat: {body['usage']['completion_tokens']} tokens, {body['choices'][0]['finish_reason']}")
            with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
                stream.raise_for_status()
                events = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert events and events[-1] == "data: [DONE]", events[-3:]
            log(f"streamed chat: {len(events)} events")
            r = client.post("/v1/embeddings", json={"model": "gpu-check", "input": ["one", "two words"]})
            r.raise_for_status()
            vectors = [d["embedding"] for d in r.json()["data"]]
            assert len(vectors) == 2 and all(abs(sum(v * v for v in vec) - 1) < 1e-3 for vec in vectors), vectors
            log(f"embeddings: 2 x {len(vectors[0])}, unit length")
            health = client.get("/health")
            assert health.status_code == 200, health.text
            (loaded,) = client.get("/api/ps").json()["models"]
            log(f"running on {loaded['device']}, {loaded['kernels']} kernels, {loaded['dtype']}")
            if not dry:  # a GPU server that fell back to the torch kernels did not pass this check
                assert loaded["kernels"] == "triton", loaded
        status = server.terminate()
        assert status == 0, f"the server exited with {status}:\n{server.output()[-2000:]}"


def tiny_model(path: Path) -> Path:
    """A small random llama GGUF (its own tiny tokenizer) for the serve check when no model is here."""
    sys.path.insert(0, str(REPO / "tests"))
    from gguf import GGMLQuantizationType as T
    from tiny_models import write_tiny_model

    return write_tiny_model(path, "llama", T.Q4_K, seed=1)


def synthetic_model(torch, device, dry: bool):
    """A Llama-3-8B-shaped model (tiny when ``dry``) of random Q4_K weights and a Q6_K head on the
    Triton kernels: ``(model, cfg, dtype, first context length, batches)``."""
    from gguf import GGMLQuantizationType as T

    from localllm.kernels.triton.backend import TritonBackend
    from localllm.models.config import ModelConfig, RopeScaling
    from localllm.models.decoder import MLP, Attention, DecoderLayer, DecoderModel, RMSNorm, RotaryEmbedding
    from localllm.quant.linear import QuantEmbedding, QuantLinear

    if dry:
        dims = dict(
            vocab_size=512,
            hidden_size=256,
            intermediate_size=512,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
        )
        dtype, ctx0, batches = torch.float32, 20, (1, 2)
    else:  # Llama-3-8B
        dims = dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
        )
        dtype, ctx0, batches = torch.bfloat16, 512, (1, 32)
    cfg = ModelConfig(
        architecture="llama",
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_dim=dims["head_dim"],
        rope_neox=False,
        rope_scaling=RopeScaling(),
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        name="synthetic",
        **dims,
    )
    h, i = cfg.hidden_size, cfg.intermediate_size
    q4 = T.Q4_K

    def lin(n, k, qtype=q4):
        return QuantLinear(random_blocks(torch, qtype, n, k, device), qtype, k, n)

    def norm():
        return RMSNorm(torch.ones(h, device=device), cfg.rms_norm_eps)

    rope = RotaryEmbedding(cfg, None).to(device)
    layers = [
        DecoderLayer(
            norm(),
            Attention(
                cfg,
                lin(cfg.q_size, h),
                lin(cfg.kv_size, h),
                lin(cfg.kv_size, h),
                lin(h, cfg.q_size),
                None,
                None,
                rope,
            ),
            norm(),
            MLP(lin(i, h), lin(i, h), lin(h, i)),
        )
        for _ in range(cfg.num_layers)
    ]
    embed = QuantEmbedding(random_blocks(torch, q4, cfg.vocab_size, h, device), q4, cfg.vocab_size, h)
    model = DecoderModel(cfg, embed, layers, norm(), lin(cfg.vocab_size, h, T.Q6_K), dtype).eval()
    TritonBackend().install(model)
    return model, cfg, dtype, ctx0, batches


def synthetic_e2e(torch, device, dry: bool, steps: int) -> None:
    from localllm.engine.gpu_runner import DecodeGraphs
    from localllm.kernels.triton.backend import TritonBackend

    t0 = time.perf_counter()
    model, cfg, dtype, ctx0, batches = synthetic_model(torch, device, dry)
    d = cfg.head_dim
    log(
        f"\n## end-to-end decode (synthetic {'tiny' if dry else '8B-shaped'} model, "
        "random Q4_K weights, Q6_K "
        f"head, {str(dtype).removeprefix('torch.')}, "
        + ("CPU interpreter, no graphs)" if dry else "CUDA graphs)")
    )
    log(f"built in {time.perf_counter() - t0:.1f} s")
    log("| batch | steps | seconds | tokens/s (aggregate) | ms/step |")
    log("|---|---|---|---|---|")
    bs = 16
    for batch in batches:
        per_seq = -(-(ctx0 + steps + 4) // bs)
        kv = [
            torch.zeros(2, batch * per_seq, bs, cfg.num_kv_heads, d, dtype=dtype, device=device)
            for _ in range(cfg.num_layers)
        ]
        tables = torch.arange(batch * per_seq, device=device).view(batch, per_seq)
        graphs = DecodeGraphs(model, kv, [batch], per_seq, bs, device, capture=not dry,
                              decode_splits=TritonBackend().decode_splits)
        ids = torch.zeros(batch, dtype=torch.long, device=device)

        def step(pos: int, ids, batch=batch, tables=tables, graphs=graphs):
            positions = torch.full((batch,), pos, dtype=torch.long, device=device)
            slots = tables[:, pos // bs] * bs + pos % bs
            ctx = torch.full((batch,), pos + 1, dtype=torch.long, device=device)
            return graphs.run(ids, positions, slots, ctx, tables).argmax(-1)

        for w in range(2):
            ids = step(ctx0 + w, ids)
        if not dry:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for s in range(steps):
            ids = step(ctx0 + 2 + s, ids)
        if not dry:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        log(f"| {batch} | {steps} | {dt:.2f} | {batch * steps / dt:.1f} | {dt / steps * 1e3:.2f} |")
        kv = graphs = None


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model",
        default=None,
        help="a GGUF file for the end-to-end section (default: SmolLM2 "
        "from ../shared/models when present, else a synthetic 8B-shaped model)",
    )
    ap.add_argument("--synthetic", action="store_true", help="also run the synthetic 8B model")
    ap.add_argument("--deadline", type=float, default=None,
                    help="epoch seconds; sections that would run past it are skipped (and fail the run)")
    ap.add_argument("--only", action="append", default=[], help="run only this section (by its first word)")
    ap.add_argument("--skip", action="append", default=[], help="leave this section out (by its first word)")
    started = start(ap)
    if started is None:
        return 2
    args, torch, device, copy_bw = started
    dry = args.dry_run
    clock = Clock(args.deadline)
    bench = make_bench(torch, dry)
    peak = None
    if not dry:
        import triton

        peak, source = peak_bandwidth(torch)
        log(f"torch {torch.__version__}, triton {triton.__version__}; peak DRAM bandwidth: "
            + (f"{peak / 1e9:.0f} GB/s ({source})" if peak else "unknown"))
    else:
        log("dry run: CPU, Triton interpreter, tiny shapes; timings are the interpreter's, no percentages")

    status = 0
    model = args.model or (str(DEFAULT_MODEL) if DEFAULT_MODEL.is_file() else None)
    if model and not Path(model).is_file():
        log(f"model {model} not found")
        return 2
    serve_model = model or str(tiny_model(Path(tempfile.mkdtemp(prefix="gpu-check-")) / "tiny.gguf"))
    sections = [
        ("serve", 150, lambda: serve_section(serve_model, dry)),
        ("decode matmuls", 60, lambda: gemv_section(torch, bench, device, dry, peak, copy_bw)),
        ("attention decode", 20, lambda: attention_section(torch, bench, device, dry, peak, copy_bw)),
    ]
    if dry:
        sections.append(("end-to-end decode", 30, lambda: synthetic_e2e(torch, device, True, steps=2)))
    else:
        if model:
            sections.append(("end-to-end decode", 120, lambda: engine_e2e(torch, model, "bfloat16", steps=128)))
        if not model or args.synthetic:
            sections.append(("end-to-end decode (synthetic)", 90, lambda: synthetic_e2e(torch, device, False, 64)))
    sections = [(n, need, fn) for n, need, fn in sections
                if (not args.only or n.split()[0] in args.only) and n.split()[0] not in args.skip]
    for name, need, fn in sections:
        if not clock.allows(name, need):
            status = 1
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and go on: one broken section must not hide the others
            import traceback

            traceback.print_exc()
            log(f"{name}: FAILED ({type(exc).__name__}: {exc})")
            status = 1
        log(f"({name}: {time.perf_counter() - t:.1f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())
