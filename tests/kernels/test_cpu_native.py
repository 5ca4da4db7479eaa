"""The native CPU kernels (localllm/kernels/cpu/csrc/cpu_kernels.cpp via localllm/kernels/cpu/native.py)
and their wiring into the models (localllm/kernels/cpu/ops.py, backend.py) against the torch references.

* ``qgemm``: equal to ``cpu_native.reference_qgemm`` (its definition, in float64) to float32
  rounding (``QGEMM_RTOL`` of the output's scale), and close to the exact float matmul: each
  output within the Cauchy-Schwarz bound of its activation error, and in all within
  ``ONE_PASS_RTOL`` / ``TWO_PASS_RTOL`` of the output's scale (about 2x the worst seen over 30
  seeds per shape: 1.1e-2 and 6.9e-5; typical 5.6e-3 and 2.5e-5).
* Activation codes: bitwise equal to ``cpu_native.quantize_activations``.
* The elementwise and attention ops: float32 agreement with the reference backend's ops / ``paged_attention``
  (``OP_TOL``).
* A whole native decoder layer against the op-by-op torch route on tiny random GGUF models.

Tests of the compiled kernels run on either native instruction set (AVX-512 VNNI, or AVX2 with
FMA and F16C: the build reports which, ``test_native_build_uses_the_isa_the_cpu_has``) and are
skipped where the CPU has neither; ``test_native_builds_where_the_cpu_has_an_isa_for_it`` runs
everywhere, so a broken build fails rather than hiding behind the skips. On an AVX-512 CPU,
``test_the_avx2_build_passes_these_tests_on_an_avx512_cpu`` runs this file and the per-type tests
again on the AVX2 build (``LOCALLLM_CPU_ISA=avx2``), so both routes are tested wherever CI runs. The compile (about
30 s) happens once per ``LOCALLLM_KERNEL_CACHE`` (by default under the test run's ``LOCALLLM_HOME``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from localllm.kernels.attention import AttentionMetadata, paged_attention
from localllm.kernels.backend import set_ops
from localllm.kernels.cpu import native as cpu_native
from localllm.kernels.cpu import weights
from localllm.kernels.cpu.backend import CpuBackend
from localllm.kernels.cpu.matmul import CpuEmbedding, activation_passes, embedding_rows
from localllm.kernels.cpu.ops import CpuOps, _fused_source, layer_plan
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.cpu.weights import NativeWeight
from localllm.kernels.select import select_backend
from localllm.kernels.torch_backend import REFERENCE
from localllm.models.config import ModelConfig, RopeScaling
from localllm.models.decoder import RotaryEmbedding
from localllm.platform.memory import HUGE_PAGE_BYTES

HAVE_NATIVE = cpu_native.cpu_has_native()
native = cpu_native.load(CpuOptions.from_env())  # LOCALLLM_CPU_ISA=avx2: the AVX2 build (see the end)
needs_native = pytest.mark.skipif(
    not HAVE_NATIVE, reason="no native CPU kernels (AVX-512 VNNI or AVX2) on this CPU"
)

QGEMM_RTOL = 1e-5
ONE_PASS_RTOL = 2e-2
TWO_PASS_RTOL = 2e-4
OP_TOL = 1e-5
# A whole layer against the same layer on the torch ops, both with two activation passes: where the
# torch and native elementwise ops differ by an ulp, one int8 activation code may round the other
# way. At one pass that step is 1/127 of its group's largest value, and it moved a layer's output by
# up to 4.9e-3 (a GPTQ layout on the AVX-512 EPYC); at two passes the second pass takes most of it
# back (at most 6.2e-5 on that machine's build, 1.6e-4 on the AVX2 build). A wrong weight, order or
# offset is ~1e-1.
LAYER_RTOL = 1e-3


def _ops(base, module) -> CpuOps:
    """The CPU backend's ops over the native ``module`` (or a spy), falling back to ``base``."""
    return CpuOps(base, module, CpuOptions())


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _weights(n: int, k: int, bits: int, seed: int):
    """Random codes uint8 ``[n, k]`` and float16-valued ``d``/``z`` ``[n, k/32]`` (8 bits: ``z = -128 d``)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    z = -128 * d if bits == 8 else (torch.randn(n, k // 32, generator=gen) * 0.1).half().float()
    return codes, d, z


def _packed(codes, bits, d, z):
    return cpu_native.pack(codes, bits, d, None if bits == 8 else z)


def _dequantized(codes, d, z) -> torch.Tensor:
    """The float64 weight ``w = d * u + z`` per 32-group."""
    n, k = codes.shape
    w = codes.double().view(n, k // 32, 32) * d.double()[..., None] + z.double()[..., None]
    return w.view(n, k)


# --- the build ---------------------------------------------------------------------------------


def test_native_builds_where_the_cpu_has_an_isa_for_it():
    """Not skipped anywhere: on an AVX-512 VNNI or AVX2 CPU the extension must compile and load."""
    if cpu_native.cpu_has_native():
        assert cpu_native.load(CpuOptions()) is not None, (
            f"{cpu_native.cpu_isa()} CPU but the native kernels did not build")
        assert cpu_native.load(CpuOptions()).supported()
    else:
        assert cpu_native.load(CpuOptions()) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="flock is POSIX")
def test_a_build_killed_midway_does_not_make_the_next_one_wait_forever(tmp_path):
    """torch's build lock is a plain file: a build killed midway leaves it, and torch then waits on
    it forever. The flock around the build is released with its holder, so the next build removes
    the stale file; while a build holds the flock, another waits for it."""
    import threading

    (tmp_path / "lock").touch()  # what a killed build leaves
    with cpu_native.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        (tmp_path / "lock").touch()  # torch's lock, taken inside ours
        entered = threading.Event()

        def second_build():
            with cpu_native.build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=second_build)
        waiter.start()
        waiter.join(0.3)
        assert not entered.is_set(), "a second build must wait while one holds the lock"
    waiter.join(5)
    assert entered.is_set() and not (tmp_path / "lock").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/cpuinfo")
def test_native_build_uses_the_isa_the_cpu_has():
    """The instruction set is the best one /proc/cpuinfo lists: AVX-512 VNNI, else AVX2 (with FMA
    and F16C), else none (and then no module); the build reports the same one."""
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if {"avx512f", "avx512bw", "avx512_vnni", "f16c"} <= flags:
        expected = "avx512vnni"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    else:
        expected = None
    assert cpu_native.cpu_isa() == expected
    requested = CpuOptions.from_env().isa
    if requested is not None and expected is not None:  # the AVX2 build on an AVX-512 CPU
        assert expected == "avx512vnni" or requested == "avx2", requested
        expected = requested
    if expected is None:
        assert native is None
    else:
        assert native is not None and native.supported()
        assert native.isa() == expected


def test_weight_prefetch_is_chosen_per_cpu_and_builds_apart(monkeypatch, tmp_path):
    """The one-row kernels' weight prefetch: the setting's byte count where given, else 8 KiB on an
    Intel CPU and the per-format table elsewhere; each distance is a build of its own (a compile-time
    constant), and a bad value names the variable."""
    monkeypatch.setattr(cpu_native, "_cpuinfo", lambda field: "GenuineIntel" if field == "vendor_id" else "")
    assert cpu_native.weight_prefetch(CpuOptions()) == cpu_native.INTEL_WEIGHT_PREFETCH
    assert cpu_native.weight_prefetch(CpuOptions(weight_prefetch=0)) == 0
    monkeypatch.setattr(cpu_native, "_cpuinfo", lambda field: "AuthenticAMD" if field == "vendor_id" else "")
    assert cpu_native.weight_prefetch(CpuOptions()) is None
    assert cpu_native.weight_prefetch(CpuOptions(weight_prefetch=4096)) == 4096
    assert not any("WEIGHT_AHEAD" in f for f in cpu_native.compiler_flags("avx2"))
    for vendor, family, kquants in [("AuthenticAMD", "25", None), ("AuthenticAMD", "26", 8192),
                                    ("GenuineIntel", "6", None), ("AuthenticAMD", "", None)]:
        info = {"vendor_id": vendor, "cpu family": family}
        monkeypatch.setattr(cpu_native, "_cpuinfo", lambda field, info=info: info.get(field, ""))
        assert cpu_native.kquant_prefetch(CpuOptions()) == kquants, (vendor, family)
        assert cpu_native.kquant_prefetch(CpuOptions(weight_prefetch=0)) is None  # one distance for all
    assert "-DLOCALLLM_KQUANT_AHEAD=8192" in cpu_native.compiler_flags("avx512vnni", None, 8192)
    assert "-DLOCALLLM_WEIGHT_AHEAD=4096" in cpu_native.compiler_flags("avx2", 4096)
    options = CpuOptions(kernel_cache=tmp_path)
    dirs = {cpu_native._build_dir(options, cpu_native.compiler_flags("avx2", p)) for p in (None, 0, 8192)}
    assert len(dirs) == 3
    monkeypatch.setenv("LOCALLLM_CPU_WEIGHT_PREFETCH", "16384")
    assert CpuOptions.from_env().weight_prefetch == 16384
    monkeypatch.setenv("LOCALLLM_CPU_WEIGHT_PREFETCH", "lots")
    with pytest.raises(ValueError, match="LOCALLLM_CPU_WEIGHT_PREFETCH"):
        CpuOptions.from_env()


def _functions_with(code: str, instruction: str) -> dict[str, bool]:
    """Per function of ``objdump -d -C`` output ``code``: whether its body holds ``instruction``."""
    holds, name = {}, None
    for line in code.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:  # (a function's cold part, split off by GCC, counts as the function)
            name = re.sub(r" \[clone \.cold[^\]]*\]$", "", head.group(1))
            holds.setdefault(name, False)
        elif name is not None and re.search(rf"\s{instruction}\s", line):
            holds[name] = True
    return holds


@pytest.mark.skipif(native is None,
                    reason="no native kernels to read: the CPU has neither AVX-512 VNNI nor AVX2")
@pytest.mark.skipif(shutil.which("objdump") is None,
                    reason="objdump (binutils) is not installed: it is what reads the build's machine code")
def test_the_kernels_prefetches_survive_the_compiler():
    """GCC takes a function that only prefetches for one without effects and drops a call of it
    that it has not inlined yet as dead code: so the decode attention's prefetches, wrapped in
    lambdas, were never in the build, and nothing failed. The build's machine code must hold them:
    ``prefetcht1`` (each KV head's part of a block ahead, into L2) in every decode attention
    instance, and in Q6_K's one-row kernels ``prefetcht0`` (their next window of activations, into
    L1), or ``prefetcht1`` (the weight ahead, into L2) in a build that sets a weight prefetch
    distance (an Intel CPU's, or a Zen 5's AVX-512 build for its K-quants)."""
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", native.__file__],
                          capture_output=True, text=True, check=True).stdout
    attention = {f: h for f, h in _functions_with(code, "prefetcht1").items() if "attend_sequence<" in f}
    options = CpuOptions.from_env()
    weight_ahead = cpu_native.weight_prefetch(options) or (native.isa() == "avx512vnni" and
                                                          cpu_native.kquant_prefetch(options))
    one_row_q6k = {f: h for f, h in _functions_with(code, "prefetcht1" if weight_ahead else "prefetcht0").items()
                   if re.search(r"tile_kernel<66, \(anonymous namespace\)::V\d+, 1, ", f)}
    assert attention, "no decode attention function under this name (renamed?)"
    assert one_row_q6k, "no Q6_K one-row kernel under this name (renamed?)"
    assert all(attention.values()), [f for f, h in attention.items() if not h]
    assert all(one_row_q6k.values()), [f for f, h in one_row_q6k.items() if not h]


@pytest.mark.parametrize("value", ["0", "off"])
def test_env_switch_turns_native_off(value, python_with_env):
    code = "from localllm.kernels.cpu import native; print(native.load() is None)"
    out = python_with_env(code, "LOCALLLM_CPU_NATIVE", value)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


# --- qgemm -------------------------------------------------------------------------------------


QGEMM_SHAPES = [(48, 64, 1), (160, 320, 5), (96, 1536, 33)]


@needs_native
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k, m", QGEMM_SHAPES, ids=[f"{n}x{k}-m{m}" for n, k, m in QGEMM_SHAPES])
def test_qgemm_matches_its_definition(n, k, m, bits, passes):
    codes, d, z = _weights(n, k, bits, seed=n + k + m + bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    out = cpu_native.qgemm(x, _packed(codes, bits, d, z), bits, n, k, passes)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    ref = cpu_native.reference_qgemm(x, codes, d, z, passes)
    err = _rel_err(out, ref)
    assert err <= QGEMM_RTOL, f"vs reference_qgemm: {err:.2e}"
    w = _dequantized(codes, d, z)
    exact = x.double() @ w.T
    err = _rel_err(out, exact)
    assert err < (ONE_PASS_RTOL if passes == 1 else TWO_PASS_RTOL), f"vs the float matmul: {err:.2e}"
    # per output: |(x_hat - x) . w_n| <= ||x_hat - x|| ||w_n||, x_hat the activations the kernel uses
    x_hat = cpu_native.dequantize_activations(*cpu_native.quantize_activations(x, passes)).double()
    bound = (x_hat - x.double()).norm(dim=1)[:, None] * w.norm(dim=1)[None, :] + QGEMM_RTOL * ref.abs().max()
    assert ((out.double() - exact).abs() <= bound).all()


@needs_native
@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("bits", [4, 8])
def test_qgemm_integer_sums_are_exact_at_the_extremes(bits, passes):
    """Weight codes and activation codes at their extremes (0 or 2**bits - 1, +-127) with aligned
    signs: the largest group sums the kernel meets. 8-bit pairs u * x reach 2 * 255 * 127, beyond
    int16 (the AVX2 route must not saturate); 4-bit group sums per 16-bit lane reach 16 * 15 * 127.
    All scales are 1 (and z a float16 integer): every output is an exact integer, equal to the
    definition's."""
    n, k, m = 32, 96, 5  # 5 rows: one block of 4 and a single row
    top = (1 << bits) - 1
    gen = torch.Generator().manual_seed(bits)
    pattern = torch.randint(0, 2, (k,), generator=gen) * 2 - 1
    pattern[:32] = 1  # one group all positive
    x = torch.stack([pattern * (-1) ** i for i in range(m)]).float() * 127  # codes +-127, scale 1
    codes = torch.where(pattern > 0, top, 0).to(torch.uint8).repeat(n, 1)
    codes[1::2] = top - codes[1::2]  # every other row: signs against the pattern
    codes[2] = top  # and one row all at the top code
    d = torch.ones(n, k // 32)
    z = -128 * d if bits == 8 else torch.full((n, k // 32), -8.0)
    out = cpu_native.qgemm(x, _packed(codes, bits, d, z), bits, n, k, passes)
    ref = cpu_native.reference_qgemm(x, codes, d, z, passes)
    assert torch.equal(out.double(), ref), (out.double() - ref).abs().max()
    w = _dequantized(codes, d, z)
    assert torch.equal(out.double(), x.double() @ w.T)  # the activations are exact here


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_qgemm_rows_are_batch_invariant(bits):
    """Each row of a batch is computed alone: bitwise the same result as a batch of one, on any
    number of threads (m = 15: AVX2 takes seven pairs of rows and one single row, AVX-512 one
    block of 8 rows, one of 4 and 3 single rows)."""
    n, k, m = 64, 256, 15
    codes, d, z = _weights(n, k, bits, seed=bits)
    packed = _packed(codes, bits, d, z)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    for passes in (1, 2):
        batch = cpu_native.qgemm(x, packed, bits, n, k, passes)
        for i in range(m):
            assert torch.equal(
                batch[i : i + 1], cpu_native.qgemm(x[i : i + 1].clone(), packed, bits, n, k, passes)
            ), i
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(batch, cpu_native.qgemm(x, packed, bits, n, k, passes))
        finally:
            torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("passes", [1, 2])
def test_native_activation_codes_equal_the_reference(passes):
    gen = torch.Generator().manual_seed(passes)
    x = torch.randn(6, 128, generator=gen)
    x[1] = 0  # all zeros: scale 0, codes 0
    x[2, :32] = 1e30  # one huge group ...
    x[2, 32:64] = torch.randn(32, generator=gen) * 1e-30  # ... one tiny ...
    x[2, 64:96] = torch.randn(32, generator=gen) * 1e20
    x[2, 70] = 1e-20  # ... and a tiny value beside huge ones
    x[3, ::2] = -x[3, ::2].abs() * 1e4
    x[4, :32] = 0.5  # ties: exactly representable halves after scaling
    x[4, 5] = -1.0
    x[5] *= 1e-3
    xq, xs, xsum = native.quantize_activations(x, passes)
    ref_q, ref_s = cpu_native.quantize_activations(x, passes)
    assert xq.dtype == torch.int8 and xq.shape == (passes, 6, 128)
    assert xs.dtype == torch.float32 and xs.shape == (passes, 6, 4)
    assert torch.equal(xq, ref_q)
    assert torch.equal(xs, ref_s)
    assert torch.equal(xsum, xq.view(passes, 6, 4, 32).int().sum(-1, dtype=torch.int32))
    assert torch.equal(xq[:, 1], torch.zeros_like(xq[:, 1])) and torch.equal(
        xs[:, 1], torch.zeros_like(xs[:, 1])
    )
    assert torch.isfinite(xs).all()


def test_pack_rejects_bad_shapes_and_bits():
    codes, d, z = _weights(32, 64, 4, seed=0)
    with pytest.raises(ValueError):
        cpu_native.pack(codes[:24], 4, d[:24], z[:24])  # n not a multiple of 16
    with pytest.raises(ValueError):
        cpu_native.pack(codes[:, :48], 4, d[:, :1], z[:, :1])  # k not a multiple of 32
    with pytest.raises(ValueError):
        cpu_native.pack(codes, 5, d, z)
    with pytest.raises(ValueError):
        cpu_native.pack(codes, 8, d, -128 * d)  # 8 bits: z is implicit
    assert cpu_native.pack(codes, 4, d, z).numel() == cpu_native.packed_bytes(32, 64, 4)
    assert cpu_native.pack(codes, 8, d, None).numel() == cpu_native.packed_bytes(32, 64, 8)


@needs_native
def test_qgemm_rejects_mismatched_inputs():
    n, k = 32, 64
    codes, d, z = _weights(n, k, 4, seed=1)
    packed = _packed(codes, 4, d, z)
    x = torch.randn(2, k)
    with pytest.raises(RuntimeError, match="packed size"):
        native.qgemm(x, packed[:-1], 4, n, k, 1)
    with pytest.raises(RuntimeError, match="packed size"):
        native.qgemm(x, packed, 8, n, k, 1)  # 4-bit tiles read as 8-bit ones
    with pytest.raises(RuntimeError):
        native.qgemm(torch.randn(2, k + 32), packed, 4, n, k, 1)
    with pytest.raises(RuntimeError):
        native.qgemm(x.double(), packed, 4, n, k, 1)
    with pytest.raises(RuntimeError):
        native.qgemm(x, packed, 4, n, k, 3)


# --- the layer ops -----------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("shape", [(5, 256), (2, 3, 128), (1, 16)])
def test_rms_norm_and_add_rms_norm(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen) * 4
    res = torch.randn(shape, generator=gen)
    w = torch.randn(shape[-1], generator=gen)
    eps = 1e-6
    ref = torch.nn.functional.rms_norm(x, (shape[-1],), w, eps)
    torch.testing.assert_close(native.rms_norm(x, w, eps), ref, rtol=OP_TOL, atol=OP_TOL)
    normed, h = native.add_rms_norm(x, res, w, eps)
    assert torch.equal(h, res + x)
    torch.testing.assert_close(
        normed, torch.nn.functional.rms_norm(res + x, (shape[-1],), w, eps), rtol=OP_TOL, atol=OP_TOL
    )
    # zeros: only eps keeps the norm finite
    z = torch.zeros(shape)
    assert torch.equal(native.rms_norm(z, w, eps), torch.zeros(shape))


def _config(neox: bool, nh=4, nkv=2, hd=64, max_pos=128, rope_dim=None) -> ModelConfig:
    return ModelConfig(
        architecture="qwen2" if neox else "llama",
        vocab_size=32,
        hidden_size=nh * hd,
        intermediate_size=4 * nh * hd,
        num_layers=1,
        num_heads=nh,
        num_kv_heads=nkv,
        head_dim=hd,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_dim=rope_dim or hd,
        rope_neox=neox,
        rope_scaling=RopeScaling(),
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        qkv_bias=False,
        qk_norm=False,
    )


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["f32-cache", "f16-cache"])
@pytest.mark.parametrize("neox", [False, True], ids=["pairs", "neox"])
def test_rope_write_kv_matches_torch_ops(neox, kv_dtype):
    nh, nkv, hd, bs, blocks, t = 4, 2, 64, 16, 6, 5
    rope = RotaryEmbedding(_config(neox, nh, nkv, hd), None)
    gen = torch.Generator().manual_seed(int(neox))
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen)
    q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    q, k, v = q.view(t, nh, hd), k.view(t, nkv, hd), v.view(t, nkv, hd)
    positions = torch.tensor([0, 127, 3, 64, 17])
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    kv_ref = torch.randn(2, blocks, bs, nkv, hd, generator=gen).to(kv_dtype)
    kv_nat = kv_ref.clone()
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    before = kv_ref.view(2, blocks * bs, nkv, hd)[:, untouched].clone()

    q_ref = REFERENCE.rope_write_kv(rope, positions, q, k, v, kv_ref, slots)
    q_nat = native.rope_write_kv(qkv, positions, rope.cos, rope.sin, kv_nat, slots, nh, nkv, hd, neox)
    torch.testing.assert_close(q_nat, q_ref, rtol=OP_TOL, atol=OP_TOL)
    flat_ref, flat_nat = kv_ref.view(2, -1, nkv, hd), kv_nat.view(2, -1, nkv, hd)
    tol = OP_TOL if kv_dtype == torch.float32 else 1e-3  # float16: at most an ulp apart after rounding
    torch.testing.assert_close(flat_nat[0, slots], flat_ref[0, slots], rtol=tol, atol=tol)
    assert torch.equal(flat_nat[1, slots], v.to(kv_dtype))  # values are copied (rounded as .to()), not rotated
    assert torch.equal(flat_nat[:, untouched], before)
    assert not torch.equal(flat_nat[0, slots], k.to(kv_dtype))  # k was rotated (positions are not all 0)

    # and through CpuOps, which finds qkv from the split views
    kv_ops = kv_ref.clone().normal_()
    kv_ops_ref = kv_ops.clone()
    ops = _ops(REFERENCE, _Spy(native))
    q_ops = ops.rope_write_kv(rope, positions, q, k, v, kv_ops, slots)
    assert ops.native.calls == ["rope_write_kv"]
    torch.testing.assert_close(
        q_ops, REFERENCE.rope_write_kv(rope, positions, q, k, v, kv_ops_ref, slots), rtol=OP_TOL, atol=OP_TOL
    )
    torch.testing.assert_close(kv_ops, kv_ops_ref, rtol=tol, atol=tol)


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["f32-cache", "f16-cache"])
def test_rope_write_kv_without_rope_writes_k_as_projected(kv_dtype):
    """A layer without RoPE (SmolLM3's NoPE layers): the same call with ``rotate`` false returns
    q as it is and writes k and v as they are (rounded as ``.to()``), never reading the tables;
    CpuOps takes ``rope`` None to it, the torch ops' result bit for bit."""
    nh, nkv, hd, bs, blocks, t = 4, 2, 64, 16, 6, 5
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen)
    q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    q, k, v = q.view(t, nh, hd), k.view(t, nkv, hd), v.view(t, nkv, hd)
    positions = torch.tensor([0, 5000, 3, 64, 17])  # (no table bounds them)
    slots = torch.randperm(blocks * bs, generator=gen)[:t]
    kv = torch.randn(2, blocks, bs, nkv, hd, generator=gen).to(kv_dtype)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    before = kv.view(2, blocks * bs, nkv, hd)[:, untouched].clone()
    no_table = torch.empty(0, 0)
    q_nat = native.rope_write_kv(qkv, positions, no_table, no_table, kv, slots, nh, nkv, hd, True, False)
    assert torch.equal(q_nat, q)
    flat = kv.view(2, -1, nkv, hd)
    assert torch.equal(flat[0, slots], k.to(kv_dtype)) and torch.equal(flat[1, slots], v.to(kv_dtype))
    assert torch.equal(flat[:, untouched], before)
    with pytest.raises(RuntimeError, match="bad tables"):  # rotating needs its tables
        native.rope_write_kv(qkv, positions, no_table, no_table, kv, slots, nh, nkv, hd, True, True)

    kv_ops, kv_ref = kv.clone().normal_(), kv.clone()
    kv_ref.copy_(kv_ops)
    ops = _ops(REFERENCE, _Spy(native))
    q_ops = ops.rope_write_kv(None, positions, q, k, v, kv_ops, slots)
    assert ops.native.calls == ["rope_write_kv"]
    assert torch.equal(q_ops, REFERENCE.rope_write_kv(None, positions, q, k, v, kv_ref, slots))
    assert torch.equal(kv_ops, kv_ref)


def _decode_meta(lens: list[int], bs: int, num_blocks: int, gen: torch.Generator) -> AttentionMetadata:
    """A decode-only step for sequences of context lengths ``lens`` whose blocks are a shuffled,
    non-consecutive draw from the cache (block tables padded with 0)."""
    need = [-(-n // bs) for n in lens]
    ids = torch.randperm(num_blocks, generator=gen)[: sum(need)]
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    slots, first = [], 0
    for i, (n, b) in enumerate(zip(lens, need)):
        tables[i, :b] = ids[first : first + b]
        first += b
        p = n - 1
        slots.append(tables[i, p // bs] * bs + p % bs)
    return AttentionMetadata(
        slot_mapping=torch.stack(slots),
        block_tables=tables,
        context_lens=torch.tensor(lens),
        query_start_loc=list(range(len(lens) + 1)),
        context_lens_host=list(lens),
        num_decodes=len(lens),
        block_size=bs,
    )


ATTENTION_SHAPES = [(8, 2, 64, 16), (4, 4, 32, 16), (6, 1, 128, 16), (9, 3, 64, 8), (5, 1, 48, 32), (12, 2, 64, 24)]


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["f32-cache", "f16-cache"])
@pytest.mark.parametrize("nh, nkv, hd, bs", ATTENTION_SHAPES, ids=[f"{a}h-{b}kv-{c}d-bs{d}" for a, b, c, d in ATTENTION_SHAPES])
def test_paged_decode_attention_matches_paged_attention(nh, nkv, hd, bs, kv_dtype):
    """Head sizes with their own unrolled kernel (32, 64, 128) and the generic one (48); block
    sizes below (8), at (16) and above (32) the 16-token score window, and not a multiple of it (24)."""
    num_blocks = -(-300 // bs) + 8
    gen = torch.Generator().manual_seed(nh * hd + bs)
    lens = [1, 37, 16, 70, 5, 129]
    meta = _decode_meta(lens, bs, num_blocks, gen)
    kv = torch.randn(2, num_blocks, bs, nkv, hd, generator=gen).to(kv_dtype)
    q = torch.randn(len(lens), nh, hd, generator=gen) * 2
    scale = hd**-0.5
    ref = paged_attention(q, kv, meta, scale)
    out = native.paged_decode_attention(q, kv, meta.block_tables, meta.context_lens, scale)
    torch.testing.assert_close(out, ref, rtol=OP_TOL, atol=OP_TOL)
    # a context of 1: the output is that token's value
    first = meta.block_tables[0, 0] * bs
    torch.testing.assert_close(
        out[0], kv[1].view(-1, nkv, hd)[first].float().repeat_interleave(nh // nkv, 0), rtol=OP_TOL, atol=OP_TOL
    )
    # only the sequences' own blocks are read: garbage elsewhere changes nothing
    used = torch.zeros(num_blocks, dtype=torch.bool)
    for i, n in enumerate(lens):
        used[meta.block_tables[i, : -(-n // bs)]] = True
    kv2 = kv.clone()
    kv2[:, ~used] = float("nan")
    for i, n in enumerate(lens):  # and the unused tail of each last block
        last, fill = meta.block_tables[i, (n - 1) // bs], (n - 1) % bs + 1
        kv2[:, last, fill:] = float("nan")
    assert torch.equal(
        native.paged_decode_attention(q, kv2, meta.block_tables, meta.context_lens, scale), out
    )


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["f32-cache", "f16-cache"])
@pytest.mark.parametrize("nh, nkv, hd, bs", ATTENTION_SHAPES, ids=[f"{a}h-{b}kv-{c}d-bs{d}" for a, b, c, d in ATTENTION_SHAPES])
def test_one_long_sequence_splits_its_attention_by_kv_heads(nh, nkv, hd, bs, kv_dtype):
    """One sequence (fewer than the threads) with a long context: its KV heads are attended on
    different threads. Each head's arithmetic is its own: the same bits as the same sequence in a
    batch of as many sequences as threads (no split), and close to the reference."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(nh * hd + bs + 1)
        lens = [900, 3]  # K and V of the 900 tokens: 58-461 KiB, above the split's 64 KiB for all but one shape
        num_blocks = sum(-(-n // bs) for n in lens) + 4
        meta = _decode_meta(lens, bs, num_blocks, gen)
        kv = torch.randn(2, num_blocks, bs, nkv, hd, generator=gen).to(kv_dtype)
        q = torch.randn(len(lens), nh, hd, generator=gen) * 2
        scale = hd**-0.5
        batched = native.paged_decode_attention(q, kv, meta.block_tables, meta.context_lens, scale)
        alone = native.paged_decode_attention(q[:1].contiguous(), kv, meta.block_tables[:1], meta.context_lens[:1], scale)
        assert torch.equal(alone[0], batched[0])
        torch.testing.assert_close(batched, paged_attention(q, kv, meta, scale), rtol=OP_TOL, atol=OP_TOL)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=["f32-cache", "f16-cache"])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("nh, nkv, hd, bs", ATTENTION_SHAPES[:3], ids=[f"{a}h-{b}kv-{c}d-bs{d}" for a, b, c, d in ATTENTION_SHAPES[:3]])
def test_a_prompts_rows_read_each_tile_once_and_attend_as_alone(nh, nkv, hd, bs, window, kv_dtype):
    """A prompt's tokens as rows of one call (one block table, contexts one apart) go through the
    kernel together, each K/V tile read once for several rows: each row's bits are still those of
    the row alone; rows of another table, or not one position apart, are not taken together."""
    gen = torch.Generator().manual_seed(nh + hd + bs + window)
    blocks = 40
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:20] for _ in range(2)])
    kv = torch.randn(2, blocks, bs, nkv, hd, generator=gen).to(kv_dtype)
    # 19 rows of sequence 0 (positions 181..199), 5 of sequence 1, then 3 of sequence 0 not one apart
    rows = [(0, 182 + i) for i in range(19)] + [(1, 60 + i) for i in range(5)] + [(0, 50), (0, 52), (0, 53)]
    row_tables = torch.stack([tables[s] for s, _ in rows])
    lens = torch.tensor([n for _, n in rows])
    q = torch.randn(len(rows), nh, hd, generator=gen)
    scale = hd**-0.5
    together = native.paged_decode_attention(q, kv, row_tables, lens, scale, window=window)
    for i in range(len(rows)):
        alone = native.paged_decode_attention(q[i : i + 1].contiguous(), kv, row_tables[i : i + 1], lens[i : i + 1],
                                              scale, window=window)
        assert torch.equal(together[i], alone[0]), i


@needs_native
def test_native_attention_with_decodes_and_a_prompt_chunk():
    """CpuOps.attention on a mixed step: decodes natively, the prompt chunk on the torch path."""
    nh, nkv, hd, bs, num_blocks = 4, 2, 64, 16, 16
    gen = torch.Generator().manual_seed(5)
    dec = _decode_meta([9, 33], bs, num_blocks, gen)
    table = torch.zeros(3, dec.block_tables.shape[1] + 1, dtype=torch.long)
    table[:2, : dec.block_tables.shape[1]] = dec.block_tables
    free = [b for b in range(num_blocks) if b not in set(dec.block_tables.flatten().tolist())]
    table[2, :2] = torch.tensor(free[-2:])  # a prompt of 20 tokens, 12 of them new
    prompt_slots = torch.tensor([table[2, p // bs] * bs + p % bs for p in range(8, 20)])
    meta = AttentionMetadata(
        slot_mapping=torch.cat([dec.slot_mapping, prompt_slots]),
        block_tables=table,
        context_lens=torch.tensor([9, 33, 20]),
        query_start_loc=[0, 1, 2, 14],
        context_lens_host=[9, 33, 20],
        num_decodes=2,
        block_size=bs,
    )
    kv = torch.randn(2, num_blocks, bs, nkv, hd, generator=gen)
    q = torch.randn(14, nh, hd, generator=gen)
    ops = _ops(REFERENCE, _Spy(native))
    out = ops.attention(q, kv, meta, hd**-0.5)
    assert ops.native.calls == ["paged_decode_attention"]
    torch.testing.assert_close(out, paged_attention(q, kv, meta, hd**-0.5), rtol=OP_TOL, atol=OP_TOL)


@needs_native
def test_silu_mul_matches_torch():
    gen = torch.Generator().manual_seed(8)
    inter = 48
    gate_up = torch.randn(3, 2 * inter, generator=gen) * 5
    special = torch.tensor(
        [
            -100.0,
            100.0,
            -87.5,
            88.5,
            -1000.0,
            1000.0,
            0.0,
            -0.0,
            1e-30,
            -20.0,
            20.0,
            1.0,
            -1.0,
            30.0,
            -30.0,
            3e4,
        ]
    )
    gate_up[0, :16] = special
    gate_up[1, inter : inter + 16] = special  # in up, too
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = native.silu_mul(gate_up)
    torch.testing.assert_close(out, ref, rtol=OP_TOL, atol=OP_TOL)
    assert torch.isfinite(out).all()
    ops = _ops(REFERENCE, _Spy(native))
    torch.testing.assert_close(ops.silu_mul(gate, up), ref, rtol=OP_TOL, atol=OP_TOL)
    assert ops.native.calls == ["silu_mul"]
    # gate and up apart (two tensors, not views of one): joined, the same native arithmetic row by row
    apart = ops.silu_mul(gate.clone(), up.clone())
    assert torch.equal(apart, out) and ops.native.calls == ["silu_mul", "silu_mul"]


# --- CpuOps' routing (runs without the kernels: a fake native module) --------------------------


class _Spy:
    """Records which native functions were called; forwards to ``module`` (or returns a marker)."""

    def __init__(self, module=None) -> None:
        self.module = module
        self.calls: list[str] = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            if self.module is None:
                return ("native", name)
            return getattr(self.module, name)(*args, **kwargs)

        return call


def _op_calls(ops: CpuOps, dtype: torch.dtype) -> None:
    nh, nkv, hd, bs = 4, 2, 32, 16
    rope = RotaryEmbedding(_config(False, nh, nkv, hd), None)
    qkv = torch.randn(2, (nh + 2 * nkv) * hd).to(dtype)
    q, k, v = qkv.split((nh * hd, nkv * hd, nkv * hd), dim=-1)
    q, k, v = q.view(2, nh, hd), k.view(2, nkv, hd), v.view(2, nkv, hd)
    kv = torch.zeros(2, 4, bs, nkv, hd, dtype=dtype)
    meta = _decode_meta([3, 20], bs, 4, torch.Generator().manual_seed(0))
    x = torch.randn(2, 64).to(dtype)
    w = torch.ones(64, dtype=dtype)
    ops.rms_norm(x, w, 1e-6)
    ops.add_rms_norm(x, x.clone(), w, 1e-6)
    ops.rope_write_kv(rope, torch.tensor([2, 19]), q, k, v, kv, meta.slot_mapping)
    ops.attention(torch.randn(2, nh, hd).to(dtype), kv, meta, hd**-0.5)
    gate, up = torch.randn(2, 64).to(dtype).chunk(2, dim=-1)
    ops.silu_mul(gate, up)


ALL_OPS = ["rms_norm", "add_rms_norm", "rope_write_kv", "paged_decode_attention", "silu_mul"]
BASE_OPS = ["rms_norm", "add_rms_norm", "rope_write_kv", "attention", "silu_mul"]


def test_native_ops_take_float32_when_enabled():
    ops = _ops(_Spy(REFERENCE), _Spy())
    _op_calls(ops, torch.float32)
    assert ops.native.calls == ALL_OPS
    assert ops.base.calls == []


@pytest.mark.parametrize("case", ["switched-off", "bfloat16"])
def test_native_ops_fall_back_to_the_base_ops(case):
    native_spy = _Spy()
    if case == "switched-off":
        # LOCALLLM_CPU_FAST=0: no CPU backend at all, the reference runs
        assert select_backend("auto", "cpu", CpuOptions(enabled=False)) is REFERENCE
        # LOCALLLM_CPU_NATIVE=0 (or neither AVX-512 VNNI nor AVX2): the CPU backend's ops without native kernels
        assert CpuBackend(CpuOptions(native=False)).native is None
        ops = _ops(_Spy(REFERENCE), None)
    else:
        ops = _ops(_Spy(REFERENCE), native_spy)
    _op_calls(ops, torch.float32 if case == "switched-off" else torch.bfloat16)
    assert native_spy.calls == []
    assert ops.base.calls == BASE_OPS
    dtype = torch.float32 if case == "switched-off" else torch.bfloat16
    meta = _decode_meta([1], 16, 1, torch.Generator())
    assert (
        ops.decoder_layer(
            None, None, torch.zeros(1, 64, dtype=dtype), torch.zeros(2, 1, 16, 1, 32, dtype=dtype), meta
        )
        is None
    )
    assert native_spy.calls == []


def test_native_ops_fall_back_for_shapes_they_do_not_take():
    ops = _ops(_Spy(REFERENCE), _Spy())
    x = torch.randn(2, 40)  # hidden size not a multiple of 16
    ops.rms_norm(x, torch.ones(40), 1e-6)
    ops.add_rms_norm(x, x[:1].expand(2, 40).contiguous(), torch.ones(40), 1e-6)
    gate, up = torch.randn(2, 24), torch.randn(2, 24)  # width not a multiple of 16
    ops.silu_mul(gate, up)
    rope = RotaryEmbedding(_config(True, 2, 1, 32, rope_dim=16), None)  # partial rotary: torch only
    qkv = torch.randn(1, 4 * 32)
    q, k, v = qkv.split((64, 32, 32), dim=-1)
    kv = torch.zeros(2, 1, 16, 1, 32)
    meta = _decode_meta([1], 16, 1, torch.Generator())
    ops.rope_write_kv(
        rope, torch.tensor([0]), q.view(1, 2, 32), k.view(1, 1, 32), v.view(1, 1, 32), kv, meta.slot_mapping
    )
    prefill = AttentionMetadata(
        slot_mapping=torch.arange(3),
        block_tables=torch.zeros(1, 1, dtype=torch.long),
        context_lens=torch.tensor([3]),
        query_start_loc=[0, 3],
        context_lens_host=[3],
        num_decodes=0,
        block_size=16,
    )
    # prompt attention takes the decode kernel per token by default (batch invariance), torch's
    # attention under fast math
    CpuOps(ops.base, ops.native, CpuOptions(fast_math=True)).attention(torch.randn(3, 2, 32), kv, prefill, 0.1)
    assert ops.native.calls == []
    assert ops.base.calls == ["rms_norm", "add_rms_norm", "silu_mul", "rope_write_kv", "attention"]
    ops.attention(torch.randn(3, 2, 32), kv, prefill, 0.1)
    assert ops.native.calls == ["paged_decode_attention"]


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_fused_source_finds_the_fused_tensor(rows, inference):
    with torch.inference_mode(inference):
        qkv = torch.randn(rows, 8 * 32)
        q, k, v = qkv.split((128, 64, 64), dim=-1)
        q, k, v = q.view(rows, 4, 32), k.view(rows, 2, 32), v.view(rows, 2, 32)
        fused = _fused_source(q, k, v)
        assert fused is not None and fused.shape == (rows, 256)
        assert fused.data_ptr() == qkv.data_ptr() and torch.equal(fused, qkv)
        gate_up = torch.randn(rows, 96)
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(_fused_source(gate, up), gate_up)
        # an offset view inside a bigger buffer
        big = torch.randn(rows + 1, 96)[1:]
        assert torch.equal(_fused_source(*big.chunk(2, dim=-1)), big)

        other = torch.randn(rows, 8 * 32)
        _, k2, v2 = other.split((128, 64, 64), dim=-1)
        assert _fused_source(q, k2.view(rows, 2, 32), v2.view(rows, 2, 32)) is None  # different tensors
        assert _fused_source(k, q, v) is None  # out of order
        assert _fused_source(q, v) is None  # a gap
        assert _fused_source(gate, torch.randn(rows, 48)) is None
        if rows > 1:
            assert _fused_source(q, k) is None  # rows further apart than the pieces' widths
            assert _fused_source(qkv.t().contiguous().t()[:, :128]) is None  # column-major


# --- a whole decoder layer on tiny random models -----------------------------------------------


def _tiny(tmp_path, arch, qtype, hidden=128, intermediate=256, tensor_types=None):
    """A tiny random GGUF model (2 layers, 4 heads, 2 KV heads): ``(path, model)``; ``tensor_types``
    sets the types of single tensors."""
    from tiny_models import write_tiny_model

    from localllm.models.assembler import load_model

    path = write_tiny_model(
        tmp_path / f"{arch}-{qtype.name}{'-mixed' if tensor_types else ''}.gguf",
        arch=arch,
        qtype=qtype,
        hidden=hidden,
        intermediate=intermediate,
        num_heads=4,
        num_kv_heads=2,
        layers=2,
        tensor_types=tensor_types,
    )
    return path, load_model(path)[0]


def _set_ops(model, native_on: bool) -> None:
    """``model`` on the CPU backend (installed once: its linears on the native matmul either way),
    its ops on the native kernels (``native_on``) or the torch reference's ops."""
    backend = model.__dict__.get("_test_backend")
    if backend is None:  # two activation passes: see LAYER_RTOL
        backend = model.__dict__["_test_backend"] = CpuBackend(replace(CpuOptions(), activation_passes=2))
        assert backend.native is not None
        backend.install(model)
    set_ops(model, backend if native_on else REFERENCE)


def _spy_layers(model) -> list[_Spy]:
    """Each decoder layer of ``model`` on its own CPU ops whose native calls are recorded."""
    spies = []
    for layer in model.layers:
        assert isinstance(layer.ops, CpuOps)
        spies.append(_Spy(layer.ops.native))
        layer.ops = CpuOps(layer.ops.base, spies[-1], layer.ops.options)
    return spies


def _steps(model, lens: list[int], bs: int, gen: torch.Generator):
    """Caches filled by a prefill of ``lens`` tokens per sequence, then the inputs of one decode
    step for all of them: ``(kv_caches, ids, positions, meta)``. Blocks are shuffled."""
    c = model.config
    num_blocks = sum(-(-(n + 1) // bs) for n in lens) + 3
    meta = _decode_meta([n + 1 for n in lens], bs, num_blocks, gen)
    kv = [torch.zeros(2, num_blocks, bs, c.num_kv_heads, c.head_dim) for _ in range(c.num_layers)]
    tables = meta.block_tables
    slots = torch.cat(
        [tables[i, torch.arange(n) // bs] * bs + torch.arange(n) % bs for i, n in enumerate(lens)]
    )
    prefill = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables,
        context_lens=torch.tensor(lens),
        query_start_loc=np.cumsum([0] + lens).tolist(),
        context_lens_host=list(lens),
        num_decodes=0,
        block_size=bs,
    )
    ids = torch.randint(0, c.vocab_size, (sum(lens),), generator=gen)
    model(ids, torch.cat([torch.arange(n) for n in lens]), prefill, kv)
    return kv, torch.randint(0, c.vocab_size, (len(lens),), generator=gen), torch.tensor(lens), meta


CASES = [("llama", T.Q4_0), ("llama", T.Q8_0), ("qwen2", T.Q4_1), ("llama", T.Q4_K), ("llama", T.Q6_K),
         ("llama", T.Q5_0), ("qwen2", T.Q5_1), ("llama", T.Q5_K), ("llama", T.Q3_K), ("llama", T.Q2_K),
         ("llama", T.F16), ("llama", T.BF16), ("qwen3", T.Q8_0), ("qwen3", T.Q4_K)]
K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


@needs_native
@pytest.mark.parametrize("arch, qtype", CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_native_decoder_layer_matches_the_torch_ops(arch, qtype, tmp_path):
    """A decode step with every layer in one native call against the same step op by op on the
    torch ops (the linears on the same native matmul): hidden states, logits and K/V caches."""
    sizes = (256, 512) if qtype in K_QUANTS else (128, 256)  # K-quants: 256-element super-blocks
    _, model = _tiny(tmp_path, arch, qtype, *sizes)
    _check_native_layers(model)


@needs_native
def test_native_decoder_layer_with_q_k_v_of_different_types(tmp_path):
    """Q4_K_M's layout: some layers' v (and down) projections in Q6_K beside Q4_K: q, k and v
    cannot share one repacked weight, the layer still runs in one native call with three."""
    mixed = {"blk.0.attn_v.weight": T.Q6_K, "blk.0.ffn_down.weight": T.Q6_K}
    _, model = _tiny(tmp_path, "llama", T.Q4_K, 256, 512, tensor_types=mixed)
    _check_native_layers(model)
    assert [len(layer_plan(layer, CpuOptions()).qkv) for layer in model.layers] == [3, 1]
    # the layer's weights were moved into one allocation of their own, each on a cache line, once,
    # the first on a 2 MiB boundary (huge pages: CpuOptions.huge_pages, on by default)
    plan = layer_plan(model.layers[0], CpuOptions())
    parts = [w.packed for w in (*plan.qkv, plan.o, *plan.gate_up, plan.down)]
    storage = parts[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in parts)
    starts = [p.data_ptr() - parts[0].data_ptr() for p in parts]
    assert starts[0] == 0 and all(s % 64 == 0 for s in starts) and parts[0].data_ptr() % HUGE_PAGE_BYTES == 0
    assert all(b >= a + p.numel() for a, b, p in zip(starts, starts[1:], parts))
    again = layer_plan(model.layers[0], CpuOptions())
    assert [w.packed.data_ptr() for w in (*again.qkv, again.o, *again.gate_up, again.down)] == [
        p.data_ptr() for p in parts]


def _check_native_layers(model) -> None:
    gen = torch.Generator().manual_seed(0)
    kv, ids, positions, meta = _steps(model, [1, 19, 7], 16, gen)

    _set_ops(model, native_on=False)
    kv_ref = [c.clone() for c in kv]
    kv_one_call = [c.clone() for c in kv]
    hidden_ref = model(ids, positions, meta, kv_ref)

    _set_ops(model, native_on=True)
    for layer in model.layers:
        assert layer_plan(layer, CpuOptions()) is not None, "every layer of this model has a native route"
    counters = _spy_layers(model)  # (each layer on ops of its own: one native call per layer)
    hidden = model(ids, positions, meta, kv)
    assert [c.calls for c in counters] == [["decoder_layer"]] * len(counters)
    # the model's layers on one ops (as installed): every layer in one native call, the same bits
    backend = model.__dict__["_test_backend"]
    spy = _Spy(backend.native)
    set_ops(model, CpuOps(backend.base, spy, backend.options))
    kv_again = [c.clone() for c in kv_one_call]  # (the caches before the step: the step again, on other caches)
    hidden_one_call = model(ids, positions, meta, kv_one_call)
    # (the final norm in the same call: the same bits as the norm's own native call after the layers;
    # the layers bound to the caches and the norm first, once)
    assert spy.calls == ["HeldLayers", "decoder_layers"], spy.calls
    assert torch.equal(hidden_one_call, hidden)
    assert all(torch.equal(a, b) for a, b in zip(kv_one_call, kv))
    # other caches: bound again, K/V written into them (and not into the first ones)
    before = [c.clone() for c in kv_one_call]
    spy.calls.clear()
    assert torch.equal(model(ids, positions, meta, kv_again), hidden)
    assert spy.calls == ["HeldLayers", "decoder_layers"], spy.calls
    assert all(torch.equal(a, b) for a, b in zip(kv_again, kv))
    assert all(torch.equal(a, b) for a, b in zip(kv_one_call, before))
    # the same caches again: no binding
    spy.calls.clear()
    model(ids, positions, meta, kv_again)
    assert spy.calls == ["decoder_layers"], spy.calls
    err = _rel_err(hidden, hidden_ref)
    assert err <= LAYER_RTOL, f"hidden states: {err:.2e}"
    for layer_kv, layer_ref in zip(kv, kv_ref):
        assert _rel_err(layer_kv, layer_ref) <= LAYER_RTOL
    logits, logits_ref = model.compute_logits(hidden), model.compute_logits(hidden_ref)
    assert _rel_err(logits, logits_ref) <= LAYER_RTOL * 10
    _set_ops(model, native_on=False)


@needs_native
def test_the_one_call_layers_scratch_is_reused_and_per_thread(tmp_path):
    """The native layers take their buffers from a scratch region of the calling thread, kept from
    step to step: a step after a smaller one (the region grown), after a larger one (reused), and two
    steps at once on two threads (two regions) give the bits of each layer in a call of its own."""
    import threading

    mixed = {"blk.0.attn_v.weight": T.Q6_K, "blk.1.ffn_down.weight": T.Q6_K}  # q/k/v as parts in layer 0
    _, model = _tiny(tmp_path, "llama", T.Q4_K, 256, 512, tensor_types=mixed)
    _set_ops(model, native_on=True)
    backend = model.__dict__["_test_backend"]
    gen = torch.Generator().manual_seed(3)
    steps = {rows: _steps(model, [5 + 3 * i for i in range(rows)], 16, gen) for rows in (1, 4, 2)}

    def run(rows, one_call: bool):
        kv, ids, positions, meta = steps[rows]
        kv = [c.clone() for c in kv]
        if not one_call:  # each layer on ops of its own: a native call per layer
            _spy_layers(model)
        else:
            set_ops(model, CpuOps(backend.base, backend.native, backend.options))
        return model(ids, positions, meta, kv), kv

    per_layer = {rows: run(rows, one_call=False) for rows in steps}
    for rows in (1, 4, 2, 4):  # grown, grown, reused larger, reused
        hidden, kv = run(rows, one_call=True)
        assert torch.equal(hidden, per_layer[rows][0]), rows
        assert all(torch.equal(a, b) for a, b in zip(kv, per_layer[rows][1]))

    # two threads at once, each its own steps, straight on the native call (the model's forward keeps
    # per-step state of its own)
    held = [layer_plan(layer, CpuOptions()).held for layer in model.layers]
    rope = layer_plan(model.layers[0], CpuOptions()).rope
    native = backend.native

    def layers_call(rows):
        kv, ids, positions, meta = steps[rows]
        kv = [c.clone() for c in kv]
        h = model.embed(ids).float()
        bound = native.HeldLayers(held, rope.cos, rope.sin, rope.neox, kv)
        out = native.decoder_layers(h, bound, positions, meta.slot_mapping, meta.block_tables, meta.context_lens)
        return out, kv

    alone = {rows: layers_call(rows) for rows in (4, 2)}
    results = {}

    def on_a_thread(rows):
        results[rows] = [layers_call(rows) for _ in range(5)]

    threads = [threading.Thread(target=on_a_thread, args=(rows,)) for rows in (4, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rows in (4, 2):
        assert len(results[rows]) == 5
        for out, kv in results[rows]:
            assert torch.equal(out, alone[rows][0]), rows
            assert all(torch.equal(a, b) for a, b in zip(kv, alone[rows][1]))
    _set_ops(model, native_on=False)


@needs_native
def test_layers_without_a_native_route_run_op_by_op(tmp_path):
    """F32 weights have no plan: decoder_layer declines, the ops still run."""
    for arch, qtype in (("llama", T.F32),):
        _, model = _tiny(tmp_path, arch, qtype)
        _set_ops(model, native_on=True)
        assert layer_plan(model.layers[0], CpuOptions()) is None
        gen = torch.Generator().manual_seed(1)
        kv, ids, positions, meta = _steps(model, [4, 17], 16, gen)
        kv_ref = [c.clone() for c in kv]
        _set_ops(model, native_on=False)
        hidden_ref = model(ids, positions, meta, kv_ref)
        _set_ops(model, native_on=True)
        layer = model.layers[0]
        assert layer.ops.decoder_layer(layer, positions, torch.zeros(2, 128), kv[0], meta) is None
        attn = model.layers[0].attn
        spy = _Spy(attn.ops.native)
        attn.ops = CpuOps(attn.ops.base, spy, attn.ops.options)
        hidden = model(ids, positions, meta, kv)
        assert "paged_decode_attention" in spy.calls  # op by op, natively
        assert _rel_err(hidden, hidden_ref) <= LAYER_RTOL


@needs_native
def test_greedy_generation_with_and_without_the_native_layer(tmp_path, monkeypatch):
    from localllm import LLM, SamplingParams

    path, _ = _tiny(tmp_path, "llama", T.Q4_0)
    prompts = [[5, 70, 100, 33], list(range(40, 61))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    # one token per step (no speculative drafts), so that the decode steps can be counted
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory="8MiB", speculative="off")
    assert llm.engine.kernels == "cpu-native"
    spies = _spy_layers(llm.engine.model)
    native_tokens = [o.token_ids for o in llm.generate(prompts, params)]
    # each decode step (7 per prompt, batched) ran each layer in one native call
    assert all(s.calls.count("decoder_layer") >= 7 for s in spies), [
        s.calls.count("decoder_layer") for s in spies
    ]

    monkeypatch.setattr(CpuOps, "decoder_layer", lambda *args, **kwargs: None)
    for s in spies:
        s.calls.clear()
    op_tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert all("decoder_layer" not in s.calls for s in spies)
    assert native_tokens == op_tokens
    assert all(len(t) == 8 for t in native_tokens)


@needs_native
def test_the_kv_cache_is_held_in_huge_pages(tmp_path):
    """On the native kernels each layer's KV cache is a zeroed tensor starting on a 2 MiB boundary
    (advised for transparent huge pages, as the weights are); with huge pages off, torch's."""
    from localllm import LLM, SamplingParams

    shape = (2, 40, 16, 2, 64)
    kv = CpuBackend(CpuOptions()).kv_cache(shape, torch.float16, torch.device("cpu"))
    assert kv.shape == shape and kv.dtype == torch.float16 and kv.is_contiguous() and not kv.any()
    assert kv.data_ptr() % HUGE_PAGE_BYTES == 0
    plain = CpuBackend(replace(CpuOptions(), huge_pages=False)).kv_cache(shape, torch.float32, torch.device("cpu"))
    assert plain.shape == shape and plain.dtype == torch.float32 and not plain.any()

    path, _ = _tiny(tmp_path, "llama", T.Q4_0)
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory="8MiB", speculative="off")
    caches = llm.engine.runner.kv_caches
    assert all(c.data_ptr() % HUGE_PAGE_BYTES == 0 and c.dtype == torch.float16 for c in caches)
    out = llm.generate([[5, 70, 100, 33]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and any(c.any() for c in caches)


@needs_native
@pytest.mark.parametrize("qtype", [T.Q4_K, T.IQ4_XS, T.MXFP4], ids=["Q4_K", "IQ4_XS", "MXFP4"])
def test_greedy_generation_runs_every_layer_in_one_call(qtype, tmp_path, monkeypatch):
    """As installed (the model's layers on one ops), a decode step runs all layers in one native
    call; the tokens equal those of the steps layer by layer and op by op."""
    from localllm import LLM, SamplingParams

    path, _ = _tiny(tmp_path, "llama", qtype, 256, 512)
    prompts = [[5, 70, 100, 33], list(range(40, 61))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory="8MiB", speculative="off")
    backend = llm.engine.backend
    spy = backend.native = _Spy(backend.native)
    one_call = [o.token_ids for o in llm.generate(prompts, params)]
    assert spy.calls.count("decoder_layers") >= 7 and "decoder_layer" not in spy.calls

    spy.calls.clear()
    monkeypatch.setattr(CpuOps, "decoder_layers", lambda *args, **kwargs: None)
    by_layer = [o.token_ids for o in llm.generate(prompts, params)]
    assert "decoder_layers" not in spy.calls and spy.calls.count("decoder_layer") >= 7 * len(llm.engine.model.layers)
    monkeypatch.setattr(CpuOps, "decoder_layer", lambda *args, **kwargs: None)
    op_by_op = [o.token_ids for o in llm.generate(prompts, params)]
    assert one_call == by_layer == op_by_op
    assert all(len(t) == 8 for t in one_call)


# --- rows of a packed weight, LM-head candidates, activation modes -----------------------------

ROW_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K, T.MXFP4, T.IQ4_NL,
             T.IQ4_XS, T.F16, T.BF16]


@needs_native
@pytest.mark.parametrize("qtype", ROW_TYPES, ids=[t.name for t in ROW_TYPES])
def test_dequant_rows_give_the_files_weights(qtype):
    from localllm.quant.gguf_dequant import dequantize
    from localllm.quant.testing import random_quantized

    n, k = 64 + 7, 512  # the last tile padded
    raw = weights.as_bytes(torch.from_numpy(random_quantized(qtype, n, k, seed=5)), qtype)
    weight = weights.repack_native(raw, qtype, n, k)
    ids = torch.tensor([0, 17, 63, 17, 40, 70])
    rows = weight.rows(ids)
    ref = dequantize(raw.index_select(0, ids), qtype)
    assert weight.exact and torch.equal(rows, ref)  # the file's codes and scales, the same float32 arithmetic
    with pytest.raises(RuntimeError, match="out of range"):
        weight.rows(torch.tensor([n]))


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_qgemm_takes_rows_not_a_multiple_of_16(bits):
    """n = 40: packed as 48 rows (zero rows at the end); the output has 40 columns, those of the
    padded weight's."""
    n, k = 40, 128
    codes, d, z = _weights(48, k, bits, seed=4)
    codes[n:], d[n:], z[n:] = 0, 0, 0
    packed = _packed(codes, bits, d, z)
    x = torch.randn(5, k)
    y = native.qgemm(x, packed, bits, n, k, 2)
    assert y.shape == (5, n) and y.is_contiguous()
    assert torch.equal(y, native.qgemm(x, packed, bits, 48, k, 2)[:, :n])
    with pytest.raises(RuntimeError, match="packed size"):
        native.qgemm(x, packed, bits, 32, k, 2)


@needs_native
def test_token_embeddings_come_from_the_repacked_head_once_built():
    from localllm.quant import QuantEmbedding
    from localllm.quant.testing import random_quantized

    emb = CpuEmbedding(QuantEmbedding(random_quantized(T.Q8_0, 256, 128, seed=3), T.Q8_0, 256, 128), CpuOptions())
    ids = torch.tensor([[3, 200], [7, 3]])
    before = emb(ids)  # no repacked weight yet: the file's rows
    assert embedding_rows(emb, ids.reshape(-1)) is None
    emb.logits(torch.randn(2, 128))  # the tied head repacks the weight
    rows = embedding_rows(emb, ids.reshape(-1))
    assert rows is not None and torch.equal(rows.view(2, 2, 128), before)
    assert torch.equal(emb(ids), before)


@needs_native
def test_near_max_selects_what_the_torch_expression_selects():
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(5, 1000, generator=gen) * 4
    out[1, 10] = out[1, 900] = 50.0  # a tie at the top
    out[3] = -2.0  # a flat row: every column is within the margin
    abs_margin = torch.tensor([0.5, 0.0, 2.0, 0.1, 1.0])
    rows, cols = native.near_max(out, abs_margin, 0.01)
    top = out.amax(1, keepdim=True)
    want = (out >= top - (abs_margin[:, None] + 0.01 * top.abs())).nonzero(as_tuple=True)
    assert torch.equal(rows, want[0]) and torch.equal(cols, want[1])
    assert (rows == 3).sum() == 1000 and {10, 900} <= set(cols[rows == 1].tolist())



@needs_native
@pytest.mark.parametrize("qtype", [T.Q6_K, T.Q8_0, T.Q4_K], ids=["Q6_K", "Q8_0", "Q4_K"])
def test_refine_near_max_recomputes_what_near_max_selects_from_the_files_rows(qtype):
    """The head's native refinement: the entries near_max selects (where more than 8: the largest
    8) become the float64 dot products with the file's rows, rounded to float32; the others stay."""
    from localllm.quant.gguf_dequant import as_bytes, dequantize
    from localllm.quant.testing import random_quantized

    n, k = 96, 256
    raw = torch.from_numpy(random_quantized(qtype, n, k, seed=5))
    w = weights.prepare(raw, qtype, n, k, CpuOptions())
    assert isinstance(w, NativeWeight) and w.exact
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, k, generator=gen)
    out = w.matmul(x, 1)
    out[2] = out[2].max()  # a flat row: every column within the margin
    margin = torch.tensor([0.5, 0.0, 0.1, 3.0])
    rows, cols = native.near_max(out, margin, 1e-3)
    exact = x.double() @ dequantize(as_bytes(raw, qtype), qtype).double().t()
    want = out.clone()
    for r in range(4):
        picked = cols[rows == r]
        if len(picked) > 8:  # the largest 8 (ties: the lower columns)
            picked = torch.tensor(sorted(picked.tolist(), key=lambda c: (-out[r, c].item(), c))[:8])
        want[r, picked] = exact[r, picked].float()
    got = out.clone()
    count = native.refine_near_max(got, x, w.packed, w.bits, n, k, margin, 1e-3, 8)
    assert count == sum(min(8, int((rows == r).sum())) for r in range(4))
    assert torch.equal(got, want)
    # and the margin's bound: the kernel's own codes' error, as the formula in NativeWeight.error_bound
    for passes in (1, 2):
        xq, xs, _ = native.quantize_activations(x, passes)
        err = (x - cpu_native.dequantize_activations(xq, xs)).norm(dim=1)
        coded = (xq.double() * xs.double().repeat_interleave(32, dim=2)).abs().sum(dim=(0, 2))
        roundings = (passes * k // 32 + 4) * 2.0**-24
        want = ((err * 3.0 + x.norm(dim=1) * 0.25 + coded * 3.0 * roundings) * 1.001).float()
        torch.testing.assert_close(native.qgemm_error_bounds(x, passes, 3.0, 0.25), want, rtol=1e-5, atol=0)

@pytest.mark.parametrize("value, passes", [(None, None), ("auto", None), ("int8", 1), ("int8x2", 2), ("fp16", "error")])
def test_activation_mode_from_the_environment(value, passes, python_with_env):
    code = "from localllm.kernels.cpu.options import CpuOptions; print(CpuOptions.from_env().activation_passes)"
    out = python_with_env(code, "LOCALLLM_CPU_ACTIVATIONS", value)
    if passes == "error":
        assert out.returncode != 0 and "LOCALLLM_CPU_ACTIVATIONS='fp16'" in out.stderr
    else:
        assert out.returncode == 0 and out.stdout.strip() == str(passes)


def test_auto_mode_takes_one_pass_and_fast_math_does_not_change_it():
    assert activation_passes(CpuOptions(activation_passes=None)) == 1
    assert activation_passes(CpuOptions(activation_passes=None, fast_math=True)) == 1
    assert activation_passes(CpuOptions(activation_passes=2)) == 2


@needs_native
def test_layers_and_the_lm_head_take_one_pass_in_every_step(tmp_path, monkeypatch):
    """By default every layer's matmuls and the LM head take one activation pass, in prompts and in
    decode steps of any size (batch invariance), the head's top logits then recomputed exactly;
    ``int8x2`` gives the head two as well."""
    from localllm import LLM, SamplingParams

    monkeypatch.delenv("LOCALLLM_CPU_ACTIVATIONS", raising=False)  # auto
    path, _ = _tiny(tmp_path, "llama", T.Q4_0)
    llm = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory="8MiB")
    assert llm.engine.backend.options.activation_passes is None
    model = llm.engine.model
    vocab = model.config.vocab_size
    seen = []  # (what, rows, passes)
    qgemm = cpu_native.qgemm

    def spy(x, packed, bits, n, k, passes=1, order=None):
        seen.append(("head" if n == vocab else "layer", x.shape[0], passes))
        return qgemm(x, packed, bits, n, k, passes, order)

    class LayerSpy:
        def __init__(self, module):
            self.module = module

        def __getattr__(self, name):
            return getattr(self.module, name)

        def decoder_layer(self, h, held, *args):
            seen.append(("layer", h.shape[0], held.passes))
            return self.module.decoder_layer(h, held, *args)

        def decoder_layers(self, h, held, *args):
            seen.extend(("layer", h.shape[0], layer.passes) for layer in held.layers)
            return self.module.decoder_layers(h, held, *args)

        def refined_logits(self, x, w, bits, n, k, passes, *args):  # (the head, with its top logits refined)
            seen.append(("head" if n == vocab else "layer", x.shape[0], passes))
            return self.module.refined_logits(x, w, bits, n, k, passes, *args)

    monkeypatch.setattr(cpu_native, "qgemm", spy)
    head_spy = LayerSpy(cpu_native.module())
    monkeypatch.setattr(cpu_native, "module", lambda: head_spy)
    backend = llm.engine.backend
    backend.native = LayerSpy(backend.native)
    prompts = [list(range(5 + i, 25 + i)) for i in range(12)]  # a 240-token prefill, then 12-row decodes
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    layers = {(rows, p) for what, rows, p in seen if what == "layer"}
    heads = {p for what, _, p in seen if what == "head"}
    assert {p for _, p in layers} == {1} and any(rows > 12 for rows, _ in layers) and (12, 1) in layers
    assert heads == {1}
    seen.clear()
    model.lm_head.options = replace(model.lm_head.options, activation_passes=2)  # as LOCALLLM_CPU_ACTIVATIONS=int8x2
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert {p for what, _, p in seen if what == "head"} == {2}


def _resident_kib_of_mapping(address: int) -> int | None:
    """Rss (KiB) of this process's mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_gguf_header_pages_are_dropped_but_the_metadata_stays(smollm2_path):
    import gguf

    from localllm.models.gguf_file import read_gguf

    gg = read_gguf(smollm2_path)  # parsing reads the header (metadata, vocabulary) through the mapping
    first = min(gg.tensors.values(), key=lambda t: t.data.ctypes.data)
    resident = _resident_kib_of_mapping(first.data.ctypes.data)  # before anything reads the header again
    header_kib = min(t.data_offset for t in gguf.GGUFReader(smollm2_path).tensors) // 1024
    assert resident < header_kib / 3, (resident, header_kib)  # the header's pages are gone
    assert len(gg.metadata["tokenizer.ggml.tokens"]) == 49152  # and the metadata reads (faulting pages back)
    assert gg.metadata["tokenizer.ggml.tokens"][0] == "<|endoftext|>"
    assert first.data.reshape(-1).view(np.uint8)[:16].size == 16  # and the mapping still reads


@needs_native
def test_weights_are_repacked_at_load_and_lookups_read_the_tied_head(smollm2_path):
    from localllm import LLM
    from localllm.quant.gguf_dequant import dequantize

    llm = LLM(model=smollm2_path, device="cpu", dtype="float32", kv_cache_memory="16MiB")
    model = llm.engine.model
    assert llm.engine.kernels == "cpu-native"
    # before any request: every layer has its native plan, the tied head its repacked weight
    assert all(llm.engine.backend.plan(layer) for layer in model.layers)
    assert isinstance(model.lm_head.state, NativeWeight)
    ids = torch.tensor([[1, 5], [40000, 1]])
    rows = embedding_rows(model.embed, ids.reshape(-1))  # from the head's repacked rows
    ref = dequantize(model.embed.raw.index_select(0, ids.reshape(-1)), model.embed.qtype)
    assert rows is not None and torch.equal(rows, ref)
    assert torch.equal(model.embed(ids).reshape(-1, ref.shape[1]), ref)


@needs_native
def test_kv_cache_is_float16_on_the_native_path_unless_asked(tmp_path):
    """``kv_cache_dtype="auto"``: float16 on the native kernels (twice the tokens for the same
    memory), float32 on request; a bad name is a clear error."""
    from localllm import LLM
    from localllm.errors import InvalidRequestError

    path, _ = _tiny(tmp_path, "llama", T.Q4_0)
    auto = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory="8MiB")
    f32 = LLM(model=path, device="cpu", dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype="float32")
    assert auto.engine.kernels == f32.engine.kernels == "cpu-native"
    assert {c.dtype for c in auto.engine.runner.kv_caches} == {torch.float16}
    assert {c.dtype for c in f32.engine.runner.kv_caches} == {torch.float32}
    assert auto.engine.num_blocks == 2 * f32.engine.num_blocks
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        LLM(model=path, device="cpu", kv_cache_dtype="fp8")


# --- the AVX2 route on an AVX-512 CPU --------------------------------------------------------------


@pytest.mark.timeout(1200)
@pytest.mark.skipif(cpu_native.cpu_isa() != "avx512vnni",
                    reason="not an AVX-512 CPU: an AVX2 CPU runs this whole file on its AVX2 build already, "
                    "and other CPUs have no native kernels")
@pytest.mark.skipif(CpuOptions.from_env().isa is not None,
                    reason="LOCALLLM_CPU_ISA is set: this run already tests the build it names "
                    "(it is avx2 in the run this test starts)")
def test_the_avx2_build_passes_these_tests_on_an_avx512_cpu():
    """The AVX2 kernels (their own multi-row tiles and format loops) would otherwise go untested
    on AVX-512 machines: build them with ``LOCALLLM_CPU_ISA=avx2`` and run this file, the per-type
    route tests and the KV cache types' kernels (not their engines) against their references in a
    fresh process."""
    import os
    from pathlib import Path

    here = Path(__file__).resolve().parent
    env = {**os.environ, "LOCALLLM_CPU_ISA": "avx2"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
         str(here / "test_cpu_native.py"), str(here / "test_cpu_types.py"), str(here / "test_kv_cache_types.py"),
         "-k", "not memory_ratio and not engine and not close_to and not alone_or_in_a_batch"],
        env=env, capture_output=True, text=True, check=False, cwd=here.parents[1],
    )
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail


@needs_native
def test_stream_read_reads_every_byte_once():
    """The benchmarks' bandwidth probe reads the whole buffer: its result is the xor of every
    64-bit word (a skipped line, or a line read twice, changes it)."""
    x = torch.randint(0, 256, (64 * 20011,), dtype=torch.uint8)
    want = int(np.bitwise_xor.reduce(x.numpy().view(np.uint64)).view(np.int64))
    assert cpu_native.module().stream_read(x) == want
    with pytest.raises(RuntimeError, match="whole 64-byte lines"):
        cpu_native.module().stream_read(x[:100])


# --- the sampler's greedy pass ------------------------------------------------------------------


def _logit_rows(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Random logit rows with what the sampler meets: ties at the maximum, -inf (masked tokens),
    a row of nothing but -inf, +inf, NaN, and a NaN beside a +inf."""
    x = torch.randn(rows, vocab, generator=gen) * 4
    x = torch.round(x * 2) / 2  # coarse values: ties, at the maximum too
    for r in range(rows):
        kind = r % 7
        where = torch.randint(0, vocab, (3,), generator=gen)
        if kind == 1:
            x[r, where] = float("-inf")
        elif kind == 2:
            x[r] = float("-inf")
        elif kind == 3:
            x[r, where[0]] = float("inf")
        elif kind == 4:
            x[r, where[1]] = float("nan")
        elif kind == 5:
            x[r, where[0]], x[r, where[2]] = float("inf"), float("nan")
        elif kind == 6:
            x[r, where] = x[r].max() + 1  # three places of the largest value
    return x


@needs_native
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 49155])
def test_greedy_rows_match_the_samplers_torch_ops(vocab):
    """The native greedy pass against the sampler's torch ops: the first largest entry of each row
    that can be sampled, and which rows cannot (NaN, +inf, only -inf), at vocabularies that are and
    are not whole vectors of both builds."""
    from localllm.engine import sampler

    cpu_native.load()
    gen = torch.Generator().manual_seed(vocab)
    logits = _logit_rows(gen, 21, vocab)
    ids, finite = cpu_native.greedy_rows(logits)
    expect_finite = sampler.finite_rows(logits).tolist()
    assert finite == expect_finite
    expect_ids = logits.argmax(dim=-1).tolist()
    for r in range(logits.shape[0]):
        if not torch.isnan(logits[r]).any():
            assert ids[r] == expect_ids[r], (r, ids[r], expect_ids[r])
            assert logits[r, ids[r]] == logits[r].max() and not (logits[r, : ids[r]] == logits[r].max()).any()
    if vocab >= 8 * sampler.ARGMAX_BLOCK:
        assert not all(finite) and any(finite)
    # the sampler takes it on the CPU, and the torch ops elsewhere: the same picks and refusals
    native_pick = sampler.greedy_and_bad_rows(logits)
    module = cpu_native._MODULE
    try:
        cpu_native._MODULE = None
        assert cpu_native.greedy_rows(logits) is None
        torch_pick = sampler.greedy_and_bad_rows(logits)
    finally:
        cpu_native._MODULE = module
    sampled = [r for r, ok in enumerate(expect_finite) if ok]
    assert native_pick[1] == torch_pick[1] == [r for r, ok in enumerate(expect_finite) if not ok]
    assert [native_pick[0][r] for r in sampled] == [torch_pick[0][r] for r in sampled]
    # not a contiguous float32 matrix: the torch ops
    assert cpu_native.greedy_rows(logits[:, ::2] if vocab > 1 else logits.double()) is None
