"""Every Triton launch of the engine, compiled by the real compiler for a card that is not here.

Triton's compiler needs no GPU: ``triton.compile`` lowers a kernel to PTX and runs the wheel's own ``ptxas`` for
any ``sm_XX``. What it needs is the exact specialization a launch would compile (argument types, alignment,
constexprs, warps, stages). This module gets it from the launchers themselves: :func:`capture` runs them on
small CPU tensors with a stand-in Triton driver whose target is the card's, under
:func:`~localllm.kernels.triton.spec.targeting` (so every choice a launcher makes from the card's limits is
made for that card), and a ``jit_cache_hook`` that records each specialization and launches nothing.
Autotuned kernels fan out over every config their autotuner keeps. :func:`compile_launch` compiles one
and reports shared memory, registers, spills (``ptxas -v``), approximate division (``div.full``) and the
blocks per SM the card holds. :func:`engine_launches` lists the launches to check (each quant type,
fp16/bf16/fp32, head dims, windows, soft-cap, KV-cache dtypes, both routes, grouped experts); the tests
assert on them for sm_80/86/89/90; ``python -m localllm.kernels.triton.compile`` prints the table. Run it
in a process of its own, without ``TRITON_INTERPRET``: it replaces Triton's active driver.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime import autotuner
from triton.runtime.driver import driver

from localllm.kernels.triton import attention as ta
from localllm.kernels.triton import kv as tkv
from localllm.kernels.triton import moe as triton_moe
from localllm.kernels.triton import ops as triton_ops
from localllm.kernels.triton import quant as triton_quant
from localllm.kernels.triton.spec import KNOWN_TARGETS, GpuSpec, targeting

T = GGMLQuantizationType

# Kernels the tests compare bit for bit with a reference: no approximate ``div.full.f32`` (``tl.div_rn`` is exact).
EXACT_KERNELS = frozenset({"_write_kv_kernel", "_dequant_rows_kernel"})

# Register spills a launch may have, in bytes per thread: what ptxas spills of its own choice well below the
# register limit (4-8 B in a few GEMM tiles at 96-168 registers); a tile out of registers spills thousands.
MAX_SPILL_BYTES = 16


@dataclass(frozen=True, slots=True)
class Launch:
    """One specialization a launcher compiles: what ``triton.compile`` needs, and where it came from."""

    kernel: str
    label: str  # the first configuration that launches it
    fn: Any  # the JITFunction
    signature: dict
    constants: dict
    attrs: dict
    options: dict  # num_warps, num_stages, num_ctas, enable_fp_fusion
    labels: tuple[str, ...] = ()  # every configuration that launches it

    def key(self) -> tuple:
        return (self.kernel, repr(sorted(self.signature.items())), repr(sorted(self.constants.items())),
                repr(sorted(self.attrs.items())), repr(sorted(self.options.items())))

    def constexprs(self) -> dict[str, Any]:
        """The launch's constexpr arguments by name (tile sizes, types, switches)."""
        names = self.fn.arg_names
        return {names[k[0]]: v for k, v in self.constants.items() if len(k) == 1 and names[k[0]].isupper()}


@dataclass(slots=True)
class Report:
    """What the compiler says of one launch on one card."""

    kernel: str
    label: str
    target: str
    num_warps: int
    num_stages: int
    shared: int
    max_shared: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    div_full: bool
    ctas_per_sm: int
    seconds: float
    constexprs: dict[str, Any] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def check(self) -> list[str]:
        """Each way this launch would fail or degrade on the card (empty: fine)."""
        out = []
        if self.shared > self.max_shared:
            out.append(f"needs {self.shared} B of shared memory, the card allows {self.max_shared}")
        if self.ctas_per_sm < 1:
            out.append("no block fits on an SM")
        if self.spill_stores > MAX_SPILL_BYTES:
            out.append(f"spills {self.spill_stores} B per thread (at most {MAX_SPILL_BYTES})")
        if self.div_full and self.kernel in EXACT_KERNELS:
            out.append("divides with div.full (approximate) in a kernel that promises exact results")
        return out


# ---------------------------------------------------------------------------------------------
# Capturing launches


class _TargetDriver:
    """The parts of Triton's driver a launch touches before it compiles, for a card not here."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


def gpu_target(spec: GpuSpec) -> GPUTarget:
    return GPUTarget(spec.backend, spec.arch, spec.warp_size)


@contextlib.contextmanager
def capture(spec: GpuSpec) -> Iterator[Callable[[str], list[Launch]]]:
    """Within the block, Triton launches compile nothing and run nothing: each specialization is
    recorded instead, as compiled for ``spec``. Yields ``take(label)``, which returns the launches
    recorded since its last call, labelled."""
    recorded: list[tuple[Any, dict]] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        recorded.append((fn.jit_function, compile))
        return True  # "handled": nothing is compiled or launched

    def fan_out(self, *args, **kwargs):  # Autotuner.run: every kept config instead of the fastest
        self.nargs = dict(zip(self.arg_names, args))
        for config in self.prune_configs(kwargs):
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    def take(label: str) -> list[Launch]:
        out = [
            Launch(
                kernel=fn.__name__,
                label=label,
                fn=fn,
                signature=dict(c["signature"]),
                constants=dict(c["constants"]),
                attrs=dict(c["configs"][0]),
                options={k: c[k] for k in ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")},
            )
            for fn, c in recorded
        ]
        recorded.clear()
        return out

    previous_hook, previous_run = knobs.runtime.jit_cache_hook, autotuner.Autotuner.run
    previous_driver = dict(vars(driver))  # the active driver as it was (none is made without a GPU)
    driver.set_active(_TargetDriver(gpu_target(spec)))
    knobs.runtime.jit_cache_hook = hook
    autotuner.Autotuner.run = fan_out
    try:
        with targeting(spec):
            yield take
    finally:
        knobs.runtime.jit_cache_hook = previous_hook
        autotuner.Autotuner.run = previous_run
        vars(driver).update(previous_driver)


# ---------------------------------------------------------------------------------------------
# What the engine launches

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEAD_DIMS = (64, 128, 256)
# Shapes of a Llama-3-8B-like layer, at the sizes that matter for the kernels' choices.
HIDDEN, FFN = 4096, 14336


def _attention_calls(dtype: torch.dtype, head_dim: int, *, invariant: bool, kv: str, window: bool,
                     softcap: bool, splits: bool, sinks: bool = False) -> Iterator[tuple[str, Callable[[], Any]]]:
    """A prompt chunk and a decode step through :func:`~localllm.kernels.triton.attention.paged_attention` (and the
    KV writes, fused with RoPE and alone) on a cache of ``kv`` ("model", "int8", "fp8")."""
    nh, nkv, block, blocks = 32, 8, 16, 8
    quant = None if kv == "model" else tkv.KVQuant(torch.int8 if kv == "int8" else torch.float8_e4m3fn, "token")
    if quant is None:
        cache = torch.zeros(2, blocks, block, nkv, head_dim, dtype=dtype)
    else:
        cache = tkv.QuantizedKVCache.allocate(blocks, block, nkv, head_dim, quant)
    tables = torch.arange(blocks, dtype=torch.int32).reshape(1, blocks)
    features = {"sliding_window": 32 if window else None, "logit_softcap": 30.0 if softcap else None,
                "sinks": torch.zeros(nh) if sinks else None}
    for n_q, ctx in ((48, 100), (1, 100)):
        q = torch.zeros(n_q, nh, head_dim, dtype=dtype)
        ctx_lens = torch.tensor([ctx], dtype=torch.int32)
        qsl = torch.tensor([0, n_q], dtype=torch.int64)

        def attend(q=q, ctx_lens=ctx_lens, qsl=qsl, n_q=n_q, ctx=ctx):
            ta.paged_attention(q, cache, tables, ctx_lens, qsl, n_q, head_dim**-0.5, max_context_len=4096 if splits else ctx,
                               invariant=invariant, **features)

        yield ("prompt" if n_q > 1 else "decode"), attend

    def write():
        k = torch.zeros(4, nkv, head_dim, dtype=dtype)
        tkv.write_kv(cache, k, k, torch.arange(4))

    def rope_write():
        q = torch.zeros(4, nh, head_dim, dtype=dtype)
        k = torch.zeros(4, nkv, head_dim, dtype=dtype)
        cos = torch.ones(64, head_dim // 2)
        triton_ops.rope_write_kv(torch.arange(4), q, k, k, cos, cos, head_dim, True, cache, torch.arange(4))

    yield "kv write", write
    yield "rope + kv write", rope_write


def _matmul_calls(qtype: T, dtype: torch.dtype, *, invariant: bool) -> Iterator[tuple[str, Callable[[], Any]]]:
    """The linears of a layer and the LM head in ``qtype``: a decode step (1 and 16 rows) and a
    prompt (256 rows); with ``invariant`` every row count takes the one GEMM config."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    for n, k in ((HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN)):
        raw = torch.zeros(n, k // block * type_size, dtype=torch.uint8)
        for m in (1, 16, 256):
            x = torch.zeros(m, k, dtype=dtype)
            yield f"{n}x{k} m={m}", lambda x=x, raw=raw: triton_quant.quant_matmul(x, raw, qtype, invariant=invariant)
    emb = torch.zeros(64, HIDDEN // block * type_size, dtype=torch.uint8)
    yield "embedding rows", lambda: triton_quant.dequantize_rows(emb, qtype, HIDDEN, torch.arange(4), dtype)


# A mixture of experts (Qwen3-30B-A3B's: 128 experts of 768, 8 a token; gate/up take the batch-invariant
# split-K) and gpt-oss's (biases, clamped SwiGLU, 32 experts of 2880, 4 a token): (hidden, inter, experts, k).
MOE_SHAPES = {False: (2048, 768, 128, 8), True: (2880, 2880, 32, 4)}


def _moe_calls(qtype: T, dtype: torch.dtype, *, invariant: bool,
               gpt_oss: bool = False) -> Iterator[tuple[str, Callable[[], Any]]]:
    """A layer's experts in ``qtype`` through :func:`~localllm.kernels.triton.moe.moe_experts`: a
    decode step (1 token) and a prompt (256 tokens, many rows per expert)."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    hidden, inter, experts, top_k = MOE_SHAPES[gpt_oss]
    if hidden % block or inter % block:
        return

    def part(n: int, k: int) -> triton_moe.ExpertWeights:  # (never read, nothing launched: left unwritten)
        raw = torch.empty(experts, n, k // block * type_size, dtype=torch.uint8)
        return triton_moe.ExpertWeights(raw, qtype, k, n, torch.zeros(experts, n) if gpt_oss else None)

    plan = triton_moe.ExpertPlan(part(inter, hidden), part(inter, hidden), part(hidden, inter),
                                 "swiglu_oai" if gpt_oss else "silu", 1.702, 7.0)
    for m in (1, 256):
        x, chosen = torch.zeros(m, hidden, dtype=dtype), (torch.arange(m * top_k) % experts).view(m, top_k)
        yield f"m={m}", lambda x=x, chosen=chosen: triton_moe.moe_experts(
            x, torch.ones(chosen.shape), chosen, plan, invariant=invariant)


def _elementwise_calls(dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], Any]]]:
    x, w, g = torch.zeros(4, HIDDEN, dtype=dtype), torch.ones(HIDDEN, dtype=dtype), torch.zeros(4, FFN, dtype=dtype)
    yield "rms_norm", lambda: triton_ops.rms_norm(x, w, 1e-5)
    yield "add_rms_norm", lambda: triton_ops.add_rms_norm(x, x, w, 1e-5)
    yield "silu_and_mul", lambda: triton_ops.silu_and_mul(g, g)
    yield "gelu_tanh_and_mul", lambda: triton_ops.gelu_tanh_and_mul(g, g)
    yield "swiglu_oai_and_mul", lambda: triton_ops.swiglu_oai_and_mul(g, g, 1.702, 7.0)


QTYPES = tuple(sorted(triton_quant.SUPPORTED_QTYPES, key=int))
TABLE_QTYPES = triton_quant.TABLE_QTYPES  # (rare in files: fast-math matmuls and experts in bf16 alone)
# A dtype changes a matmul's dot operands, not its blocks' decoding: every type's fast-math matmuls and
# experts compile in this dtype, in the others each card's first type alone (each (config, dtype) still
# on every card); --full: every type in every dtype.
DECODING_DTYPE = "bf16"


def engine_launch_calls(fast_math_qtypes: tuple[T, ...] = QTYPES, all_switches: bool = False,
                        invariant_qtypes: tuple[T, ...] = QTYPES, every_dtype: bool = True,
                        turn: tuple[int, int] | None = None) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``(label, call)`` for every configuration the engine can launch, as small CPU calls: the
    resource axes (dtype, head dim, tile, KV-cache dtype, route, quant type) crossed in full, but the
    fast-math matmuls (each autotune config) and experts take ``fast_math_qtypes``, the invariant
    matmuls ``invariant_qtypes`` (beyond :data:`DECODING_DTYPE`, the first alone unless ``every_dtype``);
    the switches that add no tile (window, soft-cap, KV splits, sinks) with each dtype and head dim on
    both routes, each on one of ``turn = (card, cards)`` in turn (None: all); ``all_switches``: crossed."""
    routes = (("invariant", True), ("fast-math", False))
    for di, (dname, dtype) in enumerate(DTYPES.items()):
        decoding = [q for q in fast_math_qtypes if q not in TABLE_QTYPES or dname == DECODING_DTYPE]
        invariant_types = list(invariant_qtypes)
        if not every_dtype and dname != DECODING_DTYPE:
            decoding, invariant_types = decoding[:1], invariant_types[:1]
        for route, invariant in routes:
            for qtype in invariant_types if invariant else decoding:
                for label, call in _matmul_calls(qtype, dtype, invariant=invariant):
                    yield f"quant_matmul {qtype.name} {dname} {route} {label}", call
        for route, invariant in routes:
            # (spread over the cards: their dequantization is the matmuls', compiled on every card)
            for qtype in decoding:
                for label, call in _moe_calls(qtype, dtype, invariant=invariant):
                    yield f"moe_experts {qtype.name} {dname} {route} {label}", call
            # gpt-oss's experts as released (their biases and clamped SwiGLU: switches of the same tiles)
            for label, call in _moe_calls(T.MXFP4, dtype, invariant=invariant, gpt_oss=True):
                yield f"moe_experts gpt-oss MXFP4 {dname} {route} {label}", call
        for label, call in _elementwise_calls(dtype):
            yield f"{label} {dname}", call
        for hi, hd in enumerate(HEAD_DIMS):
            for route, invariant in routes:
                for kv in ("model",) if dname == "fp32" else ("model", "int8", "fp8"):
                    # (gpt-oss's layers: sinks alone, and beside a window)
                    extras = [(True, False, False, False), (False, True, False, False),
                              (True, True, not invariant, False), (False, False, False, True),
                              (True, False, not invariant, True)] if kv == "model" else []
                    switches = [(False, False, False, False)] + [
                        x for k, x in enumerate(extras) if turn is None or (k + di + hi) % turn[1] == turn[0]]
                    if all_switches:
                        switches = [(w, s, sp, sk) for w in (False, True) for s in (False, True)
                                    for sp in (False, True) for sk in (False, True)]
                    for window, softcap, splits, sinks in switches:
                        extra = "".join(f" {n}" for n, on in (("window", window), ("softcap", softcap),
                                                              ("splits", splits), ("sinks", sinks)) if on)
                        for label, call in _attention_calls(dtype, hd, invariant=invariant, kv=kv, window=window,
                                                            softcap=softcap, splits=splits, sinks=sinks):
                            yield f"attention {dname} hd{hd} {route} kv={kv}{extra} {label}", call


def type_share(spec: GpuSpec, offset: int = 0) -> tuple[T, ...]:
    """The quant types whose matmuls of one route compile for ``spec`` (not ``full``): a quarter of
    them for each known card, in turn (``offset``: two turns on for the batch-invariant route, so
    that each type's block decoding, the ``block_parts`` of both routes and the experts, compiles for
    two cards): every (autotune config, quant type) compiles for one card, every (config, dtype) for each."""
    if spec not in KNOWN_TARGETS:
        return QTYPES
    return QTYPES[(KNOWN_TARGETS.index(spec) + offset) % len(KNOWN_TARGETS)::len(KNOWN_TARGETS)]


def engine_launches(spec: GpuSpec, full: bool = False, only: str | None = None) -> list[Launch]:
    """The distinct launches of :func:`engine_launch_calls` on ``spec`` (with every label that launches
    each); ``full``: every type, dtype and switch combination; ``only``: the labels containing it."""
    seen: dict[tuple, Launch] = {}
    with capture(spec) as take:
        known = spec in KNOWN_TARGETS and not full
        for label, call in engine_launch_calls(type_share(spec) if known else QTYPES, all_switches=full,
                                               invariant_qtypes=type_share(spec, 2) if known else QTYPES,
                                               every_dtype=not known,
                                               turn=(KNOWN_TARGETS.index(spec), len(KNOWN_TARGETS)) if known else None):
            if only is not None and only not in label:
                continue
            call()
            for launch in take(label):
                first = seen.setdefault(launch.key(), launch)
                seen[launch.key()] = dataclasses.replace(first, labels=(*first.labels, label))
    return list(seen.values())


# ---------------------------------------------------------------------------------------------
# Compiling

_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_launch(launch: Launch, spec: GpuSpec) -> Report:
    """Compile ``launch`` for ``spec`` and read what the compiler reports."""
    return _compile(launch, spec)[0]


def _compile(launch: Launch, spec: GpuSpec) -> tuple[Report, str]:
    """:func:`compile_launch`'s report, and the PTX it compiled."""
    src = ASTSource(launch.fn, launch.signature, launch.constants, launch.attrs)
    log = io.StringIO()
    start = time.perf_counter()
    logs_ptxas = hasattr(knobs.nvidia, "dump_ptxas_log")  # Triton 3.5+; older ones: ptxas is asked again below
    previous = knobs.nvidia.dump_ptxas_log if logs_ptxas else None
    if logs_ptxas:
        knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=gpu_target(spec), options=dict(launch.options))
    finally:
        if logs_ptxas:
            knobs.nvidia.dump_ptxas_log = previous
    seconds = time.perf_counter() - start
    text = log.getvalue()
    regs = [int(r) for r in _PTXAS.findall(text)]
    spills = [tuple(map(int, s)) for s in _SPILL.findall(text)]
    if not regs:  # served from Triton's cache, where ptxas did not run: ask it again
        regs, spills = _ptxas_again(compiled.asm["ptx"], spec)
    stack, stores, loads = max(spills) if spills else (0, 0, 0)
    shared = int(compiled.metadata.shared)
    report = Report(
        kernel=launch.kernel,
        label=launch.label,
        target=f"sm_{spec.arch}",
        num_warps=launch.options["num_warps"],
        num_stages=launch.options["num_stages"],
        shared=shared,
        max_shared=spec.max_shared_per_block,
        registers=max(regs, default=0),
        spill_stores=stores,
        spill_loads=loads,
        stack=stack,
        div_full="div.full" in compiled.asm["ptx"],
        ctas_per_sm=spec.ctas_per_sm(num_warps=launch.options["num_warps"], regs_per_thread=max(regs, default=0),
                                     shared_bytes=shared),
        seconds=seconds,
        labels=list(launch.labels or (launch.label,)),
        constexprs={k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in launch.constexprs().items()},
    )
    report.problems = report.check()
    return report, compiled.asm["ptx"]


# sm_86 (RTX 30) and sm_89 (RTX 40) take Triton's same pipeline except where fp8 is concerned (sm_89
# converts it natively): a launch the two cards make alike, without fp8, gets sm_86's PTX retargeted
# to sm_89, and sm_89's ptxas reports its registers and spills (the card's limits are its own). The
# first SHARED_PTX_CHECKS such launches are compiled for sm_89 as well: their PTX must be sm_86's
# but for the target, and their registers the same, or the check stops (compile all: --no-shared-ptx).
PTX_TWINS = {89: 86}
SHARED_PTX_CHECKS = 6


def _has_fp8(launch: Launch) -> bool:
    return any("fp8" in str(t) for t in launch.signature.values()) or any(
        "fp8" in label for label in (launch.labels or (launch.label,)))


def _retargeted(ptx: str, donor: int, arch: int) -> str:
    return re.sub(rf"^\.target sm_{donor}\b", f".target sm_{arch}", ptx, count=1, flags=re.MULTILINE)


def report_from_ptx(launch: Launch, spec: GpuSpec, ptx: str, donor: Report) -> Report:
    """The report of ``launch`` on ``spec`` from another card's PTX (``donor``'s, already retargeted)
    assembled by ``spec``'s ptxas: its registers and spills; shared memory as the donor's pipeline
    laid it out."""
    start = time.perf_counter()
    regs, spills = _ptxas_again(ptx, spec)
    stack, stores, loads = max(spills) if spills else (0, 0, 0)
    report = dataclasses.replace(
        donor, target=f"sm_{spec.arch}", max_shared=spec.max_shared_per_block, registers=max(regs, default=0),
        spill_stores=stores, spill_loads=loads, stack=stack, div_full="div.full" in ptx,
        ctas_per_sm=spec.ctas_per_sm(num_warps=donor.num_warps, regs_per_thread=max(regs, default=0),
                                     shared_bytes=donor.shared),
        seconds=time.perf_counter() - start, labels=list(launch.labels or (launch.label,)), problems=[])
    report.problems = report.check()
    return report


def _ptxas_again(ptx: str, spec: GpuSpec) -> tuple[list[int], list[tuple[int, int, int]]]:
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(spec.arch).path
    except TypeError:  # Triton 3.4: one ptxas for every arch
        ptxas = get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        done = subprocess.run(
            [ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{spec.arch}a" if spec.arch == 90
             else f"--gpu-name=sm_{spec.arch}", path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True, text=True, check=True,
        )
    text = done.stdout + done.stderr
    return [int(r) for r in _PTXAS.findall(text)], [tuple(map(int, s)) for s in _SPILL.findall(text)]


_FORKED_JOBS: list[tuple] = []  # read by forked workers (JIT functions do not pickle)


def _compile_job(index: int) -> tuple[Report, str | None]:
    spec, launch, keep_ptx = _FORKED_JOBS[index]
    report, ptx = _compile(launch, spec)
    return report, ptx if keep_ptx else None


def _ptx_job(index: int) -> Report:
    launch, spec, ptx, donor = _FORKED_JOBS[index]
    return report_from_ptx(launch, spec, ptx, donor)


def _run_jobs(jobs: list[tuple], job, workers: int) -> list:
    if workers == 1:
        _FORKED_JOBS[:] = jobs
        try:
            return [job(i) for i in range(len(jobs))]
        finally:
            _FORKED_JOBS.clear()
    import multiprocessing

    _FORKED_JOBS[:] = jobs
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(job, range(len(jobs)), chunksize=4))
    finally:
        _FORKED_JOBS.clear()


def compile_engine_launches(specs: tuple[GpuSpec, ...] = KNOWN_TARGETS, *, full: bool = False,
                            workers: int | None = None, share_ptx: bool = True, only: str | None = None) -> list[Report]:
    """Every launch of the engine compiled for each of ``specs``, over ``workers`` forked processes;
    with ``share_ptx``, the launches :data:`PTX_TWINS` cards make alike from one PTX (checked);
    ``only``: the configurations whose label contains it."""
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    launches = {spec: engine_launches(spec, full, only) for spec in specs}
    by_arch = {spec.arch: spec for spec in specs}
    alike: dict[GpuSpec, list[Launch]] = {}  # per card, the launches its twin card makes alike (no fp8)
    kept: set[tuple[int, tuple]] = set()  # (arch, key) of the launches whose PTX is kept (shared or compared)
    for spec in specs:
        twin = by_arch.get(PTX_TWINS.get(spec.arch, -1))
        if not share_ptx or twin is None:
            continue
        twin_keys = {launch.key() for launch in launches[twin]}
        alike[spec] = [launch for launch in launches[spec] if launch.key() in twin_keys and not _has_fp8(launch)]
        kept |= {(twin.arch, launch.key()) for launch in alike[spec]}
        kept |= {(spec.arch, launch.key()) for launch in alike[spec][:SHARED_PTX_CHECKS]}
    skipped = {(spec.arch, launch.key()) for spec, launches_alike in alike.items()
               for launch in launches_alike[SHARED_PTX_CHECKS:]}
    jobs = [(spec, launch, (spec.arch, launch.key()) in kept) for spec in specs for launch in launches[spec]
            if (spec.arch, launch.key()) not in skipped]
    compiled = _run_jobs(jobs, _compile_job, workers)
    reports = [report for report, _ in compiled]
    done = {(spec.arch, launch.key()): (report, ptx) for (spec, launch, _), (report, ptx) in zip(jobs, compiled)}
    ptx_jobs, checks = [], []
    for spec, launches_alike in alike.items():
        twin = PTX_TWINS[spec.arch]
        for i, launch in enumerate(launches_alike):
            donor, ptx = done[(twin, launch.key())]
            job = (launch, spec, _retargeted(ptx, twin, spec.arch), donor)
            (checks if i < SHARED_PTX_CHECKS else ptx_jobs).append(job)
    for launch, spec, ptx, donor in checks:  # the first few, compiled for the card itself too
        own, own_ptx = done[(spec.arch, launch.key())]
        from_twin = report_from_ptx(launch, spec, ptx, donor)
        if ptx != own_ptx or (own.registers, own.spill_stores, own.shared) != (
                from_twin.registers, from_twin.spill_stores, from_twin.shared):
            raise RuntimeError(f"sm_{spec.arch}'s own compile of {launch.kernel} [{launch.label}] differs from "
                               f"sm_{PTX_TWINS[spec.arch]}'s PTX retargeted: compile every card (--no-shared-ptx)")
    return reports + _run_jobs(ptx_jobs, _ptx_job, workers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m localllm.kernels.triton.compile", description=__doc__.split("\n")[0])
    ap.add_argument("--target", action="append", choices=[f"sm_{s.arch}" for s in KNOWN_TARGETS],
                    help="cards to compile for (default: all)")
    ap.add_argument("--full", action="store_true",
                    help="every quant type's fast-math matmuls on every card in every dtype, every switch everywhere")
    ap.add_argument("--json", metavar="PATH", help="also write the reports (and the autotune configs) as JSON")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--problems-only", action="store_true")
    ap.add_argument("--only", metavar="TEXT", help="the configurations whose label contains TEXT (e.g. moe_experts)")
    ap.add_argument("--no-shared-ptx", action="store_true",
                    help="compile every launch for every card (not sm_86's PTX for the launches sm_89 makes alike)")
    args = ap.parse_args(argv)
    specs = tuple(s for s in KNOWN_TARGETS if not args.target or f"sm_{s.arch}" in args.target)
    reports = compile_engine_launches(specs, full=args.full, workers=args.workers, share_ptx=not args.no_shared_ptx,
                                      only=args.only)
    bad = 0
    print("| card | kernel | launch | warps | stages | shared B | regs | spill B | CTAs/SM | problems |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in reports:
        bad += bool(r.problems)
        if args.problems_only and not r.problems:
            continue
        print(f"| {r.target} | {r.kernel} | {r.label} | {r.num_warps} | {r.num_stages} | {r.shared} | {r.registers} "
              f"| {r.spill_stores} | {r.ctas_per_sm} | {'; '.join(r.problems)} |")
    if args.json:
        tuned = {"_qgemv_kernel": triton_quant._gemv_configs(True), "_qgemm_kernel": triton_quant._gemm_configs(True)}
        with open(args.json, "w") as fh:
            json.dump({"reports": [dataclasses.asdict(r) for r in reports],
                       "autotune": {k: [{"kwargs": c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                                        for c in v] for k, v in tuned.items()}}, fh)
    print(f"{len(reports)} launches compiled, {bad} with problems", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
