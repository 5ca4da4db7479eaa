"""Triton kernels against their pure-torch references.

On a CPU the kernels run through the Triton interpreter (``TRITON_INTERPRET=1``, set below
before Triton is imported); ``bench/gpu_check.sh`` runs this file compiled on a GPU with
``TRITON_INTERPRET=0 LOCALLLM_TEST_DEVICE=cuda``. Shapes are tiny: the interpreter runs every
program of a grid one after another in Python.

Tolerances (max-abs error unless said otherwise), float32 activations:
  dequantization: bit-exact; quantized matmuls: <= 2e-5 x max|ref|;
  attention, norms, RoPE, SiLU-mul: <= 2e-5 (RoPE/KV writes exact on CPU);
  int8 KV: exact writes, attention <= 2e-5 against the dequantized cache and <= 3e-2 against
  unquantized KV (random normal K/V); fp8 (e4m3) KV: <= 1.5e-1 against unquantized; a tiny
  model's logits with int8 / fp8 KV within 3e-2 / 1e-1 x max|logit| of a float32 cache.
bfloat16 activations: matmuls <= 2e-2 x max|ref|; norms and SiLU-mul within 2 bf16 ulps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'localllm[triton]')")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.kernels.attention import AttentionMetadata, paged_attention, write_kv
from localllm.kernels.torch_backend import REFERENCE
from localllm.kernels.triton import attention as ta
from localllm.kernels.triton import kv as tkv
from localllm.kernels.triton import ops as triton_ops
from localllm.kernels.triton import quant as triton_quant
from localllm.models.decoder import RotaryEmbedding
from localllm.quant.gguf_dequant import dequantize
from localllm.quant.linear import QuantLinear
from localllm.quant.testing import random_quantized

T = GGMLQuantizationType
INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = os.environ.get("LOCALLLM_TEST_DEVICE", "cpu" if INTERPRET else "cuda")
REPO = Path(__file__).resolve().parents[2]

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip(
        "TRITON_INTERPRET=0 asks for compiled kernels, but there is no CUDA device", allow_module_level=True
    )
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("on a CPU the Triton kernels run only with TRITON_INTERPRET=1", allow_module_level=True)

QTYPES = sorted(triton_quant.SUPPORTED_QTYPES, key=int)
K_QUANTS = {t for t in QTYPES if GGML_QUANT_SIZES[t][0] == 256}  # (super-blocks of 256: the K-quants, IQ4_XS)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def _weights(qtype, n, k, seed=0):
    return torch.from_numpy(random_quantized(qtype, n, k, seed=seed)).to(DEVICE)


def _max_err(a, b) -> float:
    """Compared on the CPU: the references run there, the kernels on ``DEVICE``."""
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


# ---------------------------------------------------------------------------------------------
# Quantized matmuls


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantize_rows_bit_exact(qtype):
    k = 256 if qtype in K_QUANTS else 96  # 96: three 32-blocks, not a power of two
    raw = _weights(qtype, 24, k, seed=int(qtype))
    ref = dequantize(raw.cpu(), qtype)
    assert torch.equal(triton_quant.dequantize_rows(raw, qtype, k).cpu(), ref)
    ids = torch.tensor([[3, 0], [23, 3]], device=DEVICE)
    assert torch.equal(triton_quant.dequantize_rows(raw, qtype, k, ids).cpu(), ref[ids.cpu().reshape(-1)])


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_quant_matmul_matches_reference(qtype, m):
    n, k = 64, 256
    raw = _weights(qtype, n, k, seed=int(qtype) + m)
    bias = _randn(n, seed=5) if m == 3 else None
    lin = QuantLinear(raw, qtype, k, n, bias)
    x = _randn(m, k, seed=m)
    ref = lin.reference_forward(x)
    out = triton_quant.quant_matmul(x, raw, qtype, bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert _max_err(out, ref) <= 2e-5 * ref.abs().max().item()


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], ids=lambda q: q.name)
def test_word_reading_types_refuse_misaligned_bytes(qtype):
    """Q4_K/Q5_K scales are read as 32-bit words: bytes that do not start 4-byte aligned get a
    clear error rather than a misaligned load on a GPU."""
    n, k = 8, 256
    raw = _weights(qtype, n, k)
    shifted = torch.zeros(n, raw.shape[1] + 1, dtype=torch.uint8, device=DEVICE)
    shifted[:, 1:] = raw
    with pytest.raises(ValueError, match="4-byte aligned"):
        triton_quant.quant_matmul(_randn(1, k), shifted[:, 1:], qtype)
    # one row: its stride steps nowhere, whatever it is (a transposed column has stride 1)
    column = torch.empty(raw.shape[1], 1, dtype=torch.uint8, device=DEVICE)
    column[:, 0] = raw[0]
    x = _randn(1, k)
    assert torch.equal(triton_quant.quant_matmul(x, column.t(), qtype), triton_quant.quant_matmul(x, raw[:1], qtype))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize(
    "shape,force,splits",
    [((1,), "gemv", (1, 2, 3)), ((2, 3), "gemv", (1, 3)), ((2, 9), "gemm", (None,))],
    ids=["gemv1", "gemv6", "gemm18"],
)
def test_quant_matmul_ragged_shapes_and_split_k(qtype, shape, force, splits):
    """N not a multiple of the tile, leading batch dims, K over several split-K ranges (the
    last one partial: 768 = 512 + 256)."""
    n, k = 40, 768
    raw = _weights(qtype, n, k, seed=7)
    x = _randn(*shape, k, seed=8)
    ref = QuantLinear(raw, qtype, k, n).reference_forward(x)
    for split in splits:
        out = triton_quant.quant_matmul(x, raw, qtype, split_k=split, force=force)
        assert out.shape == (*shape, n)
        assert _max_err(out, ref) <= 2e-5 * ref.abs().max().item(), split


@pytest.mark.parametrize("m", [1, 4, 20])
def test_quant_matmul_bfloat16(m):
    raw = _weights(T.Q4_K, 64, 256, seed=3)
    w = dequantize(raw.cpu(), T.Q4_K).to(DEVICE)
    x = _randn(m, 256, seed=4, dtype=torch.bfloat16)
    out = triton_quant.quant_matmul(x, raw, T.Q4_K)
    ref = x.float() @ w.T
    assert out.dtype == torch.bfloat16
    assert _max_err(out, ref) <= 2e-2 * ref.abs().max().item()


def test_invariant_split_k_is_fixed_by_the_shape():
    """Enough programs for a big GPU at decode, from N and K alone (never the batch or the card)."""
    split = triton_quant.invariant_split_k
    assert split(4096, 4096, 64) == 4  # 64 row tiles of an 8B model's q/o projection: x4
    assert split(4096, 14336, 64) == 4  # the down projection
    assert split(28672, 4096, 64) == 1  # fused gate/up: 448 tiles already
    assert split(128256, 4096, 64) == 1  # an LM head
    assert split(64, 2048, 64) == 2  # each split reduces at least 1024 of K
    assert split(64, 256, 64) == 1


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.BF16], ids=lambda q: q.name)
def test_quant_matmul_invariant_split_k_rows_do_not_depend_on_the_batch(qtype):
    """With K long enough for split-K the batch-invariant GEMM writes per-split partials and adds
    them in a fixed order (``_sum_splits_kernel``): the product, and the same bits for a row
    alone and in a batch (rows at the same tile place under the interpreter, see below)."""
    n, k = 64, 2048
    assert triton_quant.invariant_split_k(n, k, triton_quant._invariant_gemm_config()["BLOCK_N"]) == 2
    raw = _weights(qtype, n, k, seed=int(qtype) + 1)
    bias = _randn(n, seed=2)
    x = _randn(20, k, seed=5)
    batch = triton_quant.quant_matmul(x, raw, qtype, bias, invariant=True)
    ref = QuantLinear(raw, qtype, k, n).reference_forward(x) + bias
    assert _max_err(batch, ref) <= 2e-5 * ref.abs().max().item()
    tile = triton_quant._invariant_gemm_config()["BLOCK_M"]
    for i in (0, tile):
        alone = triton_quant.quant_matmul(x[i : i + 1], raw, qtype, bias, invariant=True)
        assert torch.equal(alone, batch[i : i + 1]), i


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_K, T.Q6_K, T.F16, T.BF16], ids=lambda q: q.name)
def test_quant_matmul_invariant_rows_do_not_depend_on_the_batch(qtype):
    """Batch-invariant matmuls: a row alone, in a batch of 37 (several row tiles, the last one
    partial) or in a slice of it gives the same bits; and it is the product (N not a multiple of
    the tile). Under the interpreter ``tl.dot`` is numpy's sgemm, whose result for a row depends
    on the row's place in its tile (measured: 168 of 256 (row, place) pairs differ), so there
    only rows at the same place are compared; compiled (``bench/gpu_check.sh``) every row is."""
    n, k = 70, 256
    raw = _weights(qtype, n, k, seed=int(qtype))
    x = _randn(37, k, seed=9)
    batch = triton_quant.quant_matmul(x, raw, qtype, invariant=True)
    ref = QuantLinear(raw, qtype, k, n).reference_forward(x)
    assert _max_err(batch, ref) <= 2e-5 * ref.abs().max().item()
    tile = triton_quant._invariant_gemm_config()["BLOCK_M"]
    for i in (0, tile, 2 * tile):  # first rows of their tiles: alone, each is the first of its tile too
        assert torch.equal(triton_quant.quant_matmul(x[i : i + 1], raw, qtype, invariant=True), batch[i : i + 1]), i
    assert torch.equal(triton_quant.quant_matmul(x[tile:], raw, qtype, invariant=True), batch[tile:])
    if not INTERPRET:
        for i in (5, 17, 36):
            assert torch.equal(triton_quant.quant_matmul(x[i : i + 1], raw, qtype, invariant=True), batch[i : i + 1])
        assert torch.equal(triton_quant.quant_matmul(x[5:22], raw, qtype, invariant=True), batch[5:22])


@pytest.mark.parametrize("window", [None, 9], ids=["full", "window9"])
def test_paged_attention_invariant_rows_do_not_depend_on_the_batch(window):
    """Batch-invariant attention: a prompt's rows equal, bitwise, the same tokens computed one
    at a time as decodes at their positions, and the prompt cut into chunks; beside other
    sequences or alone. Under the interpreter (numpy's sgemm for ``tl.dot``, see above) only the
    tokens that sit first in their tile in both are compared; compiled, every token is. With a
    sliding window the first key tile a row visits starts on a tile boundary (not at its window's
    first key), as a decode's does."""
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    seqs = [(1, 37), (1, 70), (20, 40)]  # two decodes, a 20-token chunk over 20 cached tokens
    q, k, v, kv, meta = _batch(seqs, num_heads, num_kv_heads, head_dim, seed=3)
    write_kv(kv, k, v, meta.slot_mapping)
    scale = head_dim**-0.5
    kv = kv.to(DEVICE)

    def run(rows, ctxs, table_rows, max_q):
        qsl = [0]
        for n in rows:
            qsl.append(qsl[-1] + n)
        return ta.paged_attention(
            q_sel.to(DEVICE),
            kv,
            meta.block_tables[table_rows].to(DEVICE),
            torch.tensor(ctxs, device=DEVICE),
            torch.tensor(qsl, device=DEVICE),
            max_q,
            scale,
            max_context_len=max(ctxs),
            invariant=True,
            sliding_window=window,
        )

    q_sel = q
    together = run([1, 1, 20], [37, 70, 40], [0, 1, 2], 20)
    ref = paged_attention(q, kv.cpu(), meta, scale, sliding_window=window)
    assert _max_err(together, ref) <= 2e-5
    prompt = together[2:22]
    group = num_heads // num_kv_heads
    tile = ta.attention_tile(None, group=group, head_dim=head_dim, dtype=q.dtype, decode=True)
    tokens_per_tile = tile.block_m // group
    for t in range(20):  # token t of the chunk alone, as a decode at position 20 + t
        if INTERPRET and t % tokens_per_tile:
            continue
        q_sel = q[2 + t : 3 + t]
        assert torch.equal(run([1], [21 + t], [2], 1), prompt[t : t + 1]), t
    cut = 12 if INTERPRET else 11  # a chunk boundary on a tile boundary under the interpreter
    assert not INTERPRET or cut % tokens_per_tile == 0
    q_sel = q[2 : 2 + cut]
    first = run([cut], [20 + cut], [2], cut)
    q_sel = q[2 + cut : 22]
    second = run([20 - cut], [40], [2], 20 - cut)
    assert torch.equal(torch.cat([first, second]), prompt)


def test_triton_route_requests_alone_and_together_get_the_same_logprobs(tmp_path):
    """On the Triton route (batch-invariant by default) a request's tokens and logprobs do not
    depend on the other requests in its steps or on where chunked prefill cut its prompt.
    Compiled only: under the interpreter a row's ``tl.dot`` result depends on its place in the
    tile (numpy's sgemm, see above), which a real batch moves."""
    if INTERPRET:
        pytest.skip("the interpreter's tl.dot is not row-invariant (numpy sgemm); runs in bench/gpu_check.sh")
    from tiny_models import write_tiny_model

    from localllm import LLM, SamplingParams

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", T.Q4_K, seed=21, num_heads=8, num_kv_heads=2)
    prompts = [[5 + (i * 7 + j) % 60 for i in range(n)] for j, n in enumerate((9, 23, 4, 15))]
    params = [SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.9, seed=7, logprobs=0, ignore_eos=True)]

    def result(out):
        c = out.outputs[0]
        return c.token_ids, [lp.logprob for lp in c.logprobs]

    def engine(budget):
        return LLM(model=path, device=DEVICE, dtype="float32", kernels="triton", kv_cache_memory="8MiB",
                   max_num_batched_tokens=budget, max_num_seqs=4)

    solo = engine(64)
    assert solo.engine.backend.options.batch_invariant
    alone = [result(solo.generate([p], params[i % 2])[0]) for i, p in enumerate(prompts)]
    del solo
    together = [result(o) for o in engine(10).generate(prompts, [params[i % 2] for i in range(len(prompts))])]
    for i, ((tok_a, lp_a), (tok_b, lp_b)) in enumerate(zip(alone, together)):
        assert tok_a == tok_b, f"request {i}: alone {tok_a} together {tok_b}"
        assert torch.equal(torch.tensor(lp_a), torch.tensor(lp_b)), f"request {i}: {lp_a} vs {lp_b}"


def test_triton_route_speculation_changes_no_token(tmp_path):
    """Speculative decoding on the Triton route (the GPU runner verifies drafts on the host
    sampler): a draft's row holds the bits a decode at its position would, so greedy and seeded
    requests give the same tokens and logprobs with speculation on and off. Compiled only, for the
    reason above."""
    if INTERPRET:
        pytest.skip("the interpreter's tl.dot is not row-invariant (numpy sgemm); runs in bench/gpu_check.sh")
    from tiny_models import write_tiny_model

    from localllm import LLM, SamplingParams

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", T.Q4_K, seed=22, num_heads=8, num_kv_heads=2)
    prompts = [[5 + i % 9 for i in range(40)], [7 + (i * 3) % 11 for i in range(30)]]  # repeats: drafts match
    params = [SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=3, logprobs=0, ignore_eos=True)]

    def results(mode):
        llm = LLM(model=path, device=DEVICE, dtype="float32", kernels="triton", kv_cache_memory="8MiB",
                  speculative=mode)
        outs = [llm.generate([p], q)[0].outputs[0] for p in prompts for q in params]
        return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in outs], llm.engine.speculator.stats

    on, stats = results("ngram")
    off, _ = results("off")
    assert stats.drafted_tokens > 0, stats
    for i, ((tok_a, lp_a), (tok_b, lp_b)) in enumerate(zip(on, off)):
        assert tok_a == tok_b, f"request {i}: speculative {tok_a} plain {tok_b}"
        assert torch.equal(torch.tensor(lp_a), torch.tensor(lp_b)), f"request {i}: {lp_a} vs {lp_b}"


def test_quant_matmul_rejects_bad_input():
    raw = _weights(T.Q4_0, 8, 64)
    with pytest.raises(ValueError, match="uint8"):
        triton_quant.quant_matmul(_randn(1, 96), raw, T.Q4_0)
    with pytest.raises(ValueError, match="no Triton kernel"):
        triton_quant.quant_matmul(_randn(1, 64), raw, T.F32)


# ---------------------------------------------------------------------------------------------
# Paged attention


def _batch(
    seqs, num_heads, num_kv_heads, head_dim, *, block_size=16, num_blocks=48, seed=0, dtype=torch.float32
):
    """A cache full of random K/V, ragged block tables (shuffled physical blocks) and a flat
    query batch for ``seqs`` = [(num_query_tokens, context_len)], decodes first."""
    g = _gen(seed)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-c // block_size) for _, c in seqs) + 1  # + 1: padded tables
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    slots, qsl, ctxs = [], [0], []
    for i, (n, c) in enumerate(seqs):
        ids = [free.pop() for _ in range(-(-c // block_size))]
        tables[i, : len(ids)] = torch.tensor(ids)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
        qsl.append(qsl[-1] + n)
        ctxs.append(c)
    t = qsl[-1]
    q = torch.randn(t, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        context_lens=torch.tensor(ctxs),
        query_start_loc=qsl,
        context_lens_host=ctxs,
        num_decodes=sum(1 for n, _ in seqs if n == 1),
        block_size=block_size,
    )
    return q, k, v, kv, meta


def _dev_meta(meta):
    return {
        "block_tables": meta.block_tables.to(DEVICE),
        "context_lens": meta.context_lens.to(DEVICE),
        "query_start_loc": torch.tensor(meta.query_start_loc, device=DEVICE),
        "max_query_len": max(b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])),
        "max_context_len": max(meta.context_lens_host),
    }


# decodes (partial and exactly full last blocks), a prefill chunk over cached context, a whole
# prompt, a chunk ending mid-block
MIXED = [(1, 37), (1, 5), (1, 32), (7, 40), (19, 19), (3, 70)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 4, 64), (8, 2, 80), (8, 1, 96), (16, 2, 128)],
    ids=["mha-d64", "gqa4-d80", "mqa8-d96", "gqa8-d128"],
)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_mixed_batch(num_heads, num_kv_heads, head_dim, num_splits):
    q, k, v, kv, meta = _batch(MIXED, num_heads, num_kv_heads, head_dim, seed=head_dim)
    write_kv(kv, k, v, meta.slot_mapping)
    scale = head_dim**-0.5
    ref = paged_attention(q, kv, meta, scale)
    out = ta.paged_attention(
        q.to(DEVICE), kv.to(DEVICE), scale=scale, num_splits=num_splits, **_dev_meta(meta)
    )
    assert _max_err(out, ref) <= 2e-5


def test_paged_attention_gqa_group_not_power_of_two_and_block_size_8():
    """SmolLM2's 9 query heads over 3 KV heads; a block size smaller than the key tile."""
    q, k, v, kv, meta = _batch([(1, 9), (1, 30), (12, 25)], 9, 3, 64, block_size=8, num_blocks=16, seed=1)
    write_kv(kv, k, v, meta.slot_mapping)
    ref = paged_attention(q, kv, meta, 0.125)
    out = ta.paged_attention(q.to(DEVICE), kv.to(DEVICE), scale=0.125, **_dev_meta(meta))
    assert _max_err(out, ref) <= 2e-5


def test_paged_attention_bfloat16():
    q, k, v, kv, meta = _batch([(1, 21), (6, 30)], 8, 2, 64, seed=2, dtype=torch.bfloat16)
    write_kv(kv, k, v, meta.slot_mapping)
    ref = paged_attention(q, kv, meta, 0.125)
    out = ta.paged_attention(q.to(DEVICE), kv.to(DEVICE), scale=0.125, **_dev_meta(meta))
    assert out.dtype == torch.bfloat16
    assert _max_err(out, ref) <= 2e-2


def test_write_kv_matches_reference_and_skips_padding():
    _, k, v, kv, meta = _batch(MIXED, 4, 2, 80, seed=3)
    ref = kv.clone()
    write_kv(ref, k, v, meta.slot_mapping)
    out = kv.to(DEVICE)
    slots = torch.cat([meta.slot_mapping, torch.tensor([-1])]).to(DEVICE)
    tkv.write_kv(out, torch.cat([k, k[:1]]).to(DEVICE), torch.cat([v, v[:1]]).to(DEVICE), slots)
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("granularity", ["token", "head"])
def test_quantized_kv(dtype, granularity):
    nh, nkv, hd = 8, 2, 64
    q, k, v, kv, meta = _batch([(1, 37), (1, 3), (6, 29)], nh, nkv, hd, num_blocks=10, seed=4)
    quant = tkv.KVQuant(dtype, granularity)
    num_blocks, bs = kv.shape[1], kv.shape[2]
    all_slots = torch.arange(num_blocks * bs)
    fill_k, fill_v = kv[0].reshape(-1, nkv, hd), kv[1].reshape(-1, nkv, hd)
    head_scales = None
    if granularity == "head":  # static scales from the data's range, as a calibration would give
        head_scales = (
            torch.stack(
                [torch.cat([fill_k, k]).abs().amax((0, 2)), torch.cat([fill_v, v]).abs().amax((0, 2))]
            )
            / quant.qmax
        )
    ref_cache = tkv.QuantizedKVCache.allocate(num_blocks, bs, nkv, hd, quant, head_scales=head_scales)
    cache = tkv.QuantizedKVCache.allocate(
        num_blocks, bs, nkv, hd, quant, device=DEVICE, head_scales=head_scales
    )
    for kk, vv, slots in ((fill_k, fill_v, all_slots), (k, v, meta.slot_mapping)):
        tkv.write_kv_quant_reference(ref_cache, kk, vv, slots)
        tkv.write_kv(cache, kk.to(DEVICE), vv.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(cache.data.cpu().view(torch.uint8), ref_cache.data.view(torch.uint8))
    assert torch.equal(cache.scales.cpu(), ref_cache.scales)

    out = ta.paged_attention(q.to(DEVICE), cache, scale=hd**-0.5, **_dev_meta(meta))
    assert _max_err(out, ta.attention_reference_quant(q, ref_cache, meta, hd**-0.5)) <= 2e-5
    write_kv(kv, k, v, meta.slot_mapping)
    exact = paged_attention(q, kv, meta, hd**-0.5)
    assert _max_err(out, exact) <= (3e-2 if dtype == torch.int8 else 1.5e-1)


def test_fp8_bit_conversion_matches_torch():
    """The kernels' own fp32 -> e4m3 rounding (used instead of the interpreter's cast) equals torch's."""
    exact = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    exact = exact[exact.isfinite()].sort().values
    x = torch.cat([exact, (exact[1:] + exact[:-1]) / 2, torch.randn(4096) * 20, torch.randn(1024) * 1e-2])
    x = torch.cat([x, torch.zeros(-x.numel() % 256)]).clamp(-448, 448)
    x = x.reshape(-1, 4, 64)  # tokens of 4 heads x 64; static scales of 1: elementwise rounding
    quant = tkv.KVQuant(torch.float8_e4m3fn, "head")
    n = x.shape[0]
    cache = tkv.QuantizedKVCache.allocate(n, 1, 4, 64, quant, device=DEVICE, head_scales=torch.ones(2, 4))
    tkv.write_kv(cache, x.to(DEVICE), x.to(DEVICE), torch.arange(n, device=DEVICE))
    assert torch.equal(
        cache.data[0].reshape(-1).cpu().view(torch.uint8),
        x.reshape(-1).to(torch.float8_e4m3fn).view(torch.uint8),
    )


# ---------------------------------------------------------------------------------------------
# Norms, SiLU-mul, RoPE + KV write


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rms_norm_and_fused_residual(dtype):
    x = _randn(5, 3, 96, seed=1, dtype=dtype)
    r = _randn(5, 3, 96, seed=2, dtype=dtype)
    w = _randn(96, seed=3) + 1
    tol = 2e-5 if dtype == torch.float32 else 2 * 2**-7 * 8  # 2 bf16 ulps at |y| < 8
    assert _max_err(triton_ops.rms_norm(x, w, 1e-6), REFERENCE.rms_norm(x, w, 1e-6)) <= tol
    y, h = triton_ops.add_rms_norm(x, r, w, 1e-6)
    y_ref, h_ref = REFERENCE.add_rms_norm(x, r, w, 1e-6)
    assert _max_err(y, y_ref) <= tol
    assert _max_err(h, h_ref) <= (0 if dtype == torch.float32 else 2 * 2**-7 * 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_and_mul(dtype):
    g = _randn(4, 1500, seed=1, dtype=dtype, scale=3)
    u = _randn(4, 1500, seed=2, dtype=dtype)
    tol = 2e-5 if dtype == torch.float32 else 2 * 2**-7 * 16
    assert _max_err(triton_ops.silu_and_mul(g, u), REFERENCE.silu_mul(g, u)) <= tol


class _RopeConfig:
    def __init__(self, head_dim, rot_dim, neox, theta=10000.0, scaling="none"):
        from localllm.models.config import RopeScaling

        self.rope_dim, self.rope_neox, self.rope_theta = rot_dim, neox, theta
        self.max_position_embeddings = 256
        self.rope_scaling = RopeScaling(kind=scaling, factor=2.0 if scaling == "linear" else 1.0)


@pytest.mark.parametrize(
    "neox,head_dim,rot_dim,freq_factors,scaling",
    [
        (False, 64, 64, False, "none"),
        (True, 128, 128, False, "none"),
        (False, 128, 128, True, "none"),
        (True, 80, 40, False, "linear"),
        (False, 96, 64, True, "none"),
    ],
    ids=["pairs", "neox", "pairs-llama3", "neox-partial-linear", "pairs-partial-llama3"],
)
def test_rope_write_kv_matches_reference(neox, head_dim, rot_dim, freq_factors, scaling):
    factors = torch.linspace(1.0, 8.0, rot_dim // 2) if freq_factors else None
    rope = RotaryEmbedding(
        _RopeConfig(head_dim, rot_dim, neox, 500000.0 if freq_factors else 10000.0, scaling), factors
    )
    q, k, v, kv, meta = _batch(MIXED, 8, 2, head_dim, seed=5)
    positions = torch.cat(
        [
            torch.arange(c - n, c)
            for n, c in zip(
                [b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])],
                meta.context_lens_host,
            )
        ]
    )
    ref_kv = kv.clone()
    q_ref = REFERENCE.rope_write_kv(rope, positions, q, k, v, ref_kv, meta.slot_mapping)
    rope.to(DEVICE)
    out_kv = kv.to(DEVICE)
    q_out = triton_ops.rope_write_kv(
        positions.to(DEVICE),
        q.to(DEVICE),
        k.to(DEVICE),
        v.to(DEVICE),
        rope.cos,
        rope.sin,
        rot_dim,
        neox,
        out_kv,
        meta.slot_mapping.to(DEVICE),
    )
    assert _max_err(q_out, q_ref) <= 2e-5
    assert _max_err(out_kv, ref_kv) <= 2e-5


def test_rope_write_kv_without_rope_writes_k_as_projected():
    """A layer without RoPE (SmolLM3's NoPE layers): the queries as they are, K/V written as
    projected, as the torch ops do."""
    q, k, v, kv, meta = _batch(MIXED, 8, 2, 64, seed=6)
    positions = torch.zeros(q.shape[0], dtype=torch.long)
    ref_kv = kv.clone()
    q_ref = REFERENCE.rope_write_kv(None, positions, q, k, v, ref_kv, meta.slot_mapping)
    out_kv = kv.to(DEVICE)
    q_out = triton_ops.TritonOps().rope_write_kv(None, positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE),
                                                 v.to(DEVICE), out_kv, meta.slot_mapping.to(DEVICE))
    assert q_out.is_contiguous() and torch.equal(q_out.cpu(), q_ref)
    assert torch.equal(out_kv.cpu(), ref_kv)


def test_rope_write_kv_quantized_cache():
    rope = RotaryEmbedding(_RopeConfig(64, 64, True), None)
    q, k, v, _, meta = _batch([(1, 10), (4, 20)], 4, 2, 64, num_blocks=8, seed=6)
    positions = torch.tensor([9, 16, 17, 18, 19])
    k_rot = rope(positions, k)
    quant = tkv.KVQuant(torch.int8, "token")
    ref = tkv.QuantizedKVCache.allocate(8, 16, 2, 64, quant)
    tkv.write_kv_quant_reference(ref, k_rot, v, meta.slot_mapping)
    cache = tkv.QuantizedKVCache.allocate(8, 16, 2, 64, quant, device=DEVICE)
    rope.to(DEVICE)
    triton_ops.rope_write_kv(
        positions.to(DEVICE),
        q.to(DEVICE),
        k.to(DEVICE),
        v.to(DEVICE),
        rope.cos,
        rope.sin,
        64,
        True,
        cache,
        meta.slot_mapping.to(DEVICE),
    )
    # equal up to a rounding flip where x / scale lands within float error of .5
    assert (cache.data.cpu().int() - ref.data.int()).abs().max() <= 1
    assert _max_err(cache.scales, ref.scales) <= 1e-6


# ---------------------------------------------------------------------------------------------
# Backend selection


def test_resolve_kernels(monkeypatch):
    from localllm.errors import InvalidRequestError
    from localllm.kernels.cpu.options import CpuOptions
    from localllm.kernels.select import resolve_kernels, select_backend
    from localllm.kernels.triton.backend import TritonBackend

    monkeypatch.delenv("LOCALLLM_KERNELS", raising=False)
    assert resolve_kernels("auto", "cpu", CpuOptions()) == "cpu"  # never Triton on a CPU by default
    assert resolve_kernels("auto", "cpu", CpuOptions(enabled=False)) == "torch"  # LOCALLLM_CPU_FAST=0
    assert resolve_kernels("torch", "cpu") == "torch"
    assert select_backend("torch", "cpu") is REFERENCE
    with pytest.raises(InvalidRequestError, match="CPU only"):
        resolve_kernels("cpu", "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels("triton", "cpu") == "triton"
    assert isinstance(select_backend("triton", "cpu"), TritonBackend)
    monkeypatch.setenv("LOCALLLM_KERNELS", "torch")
    assert resolve_kernels("triton", "cpu") == "torch"  # the environment wins
    monkeypatch.setenv("LOCALLLM_KERNELS", "fast")
    with pytest.raises(InvalidRequestError, match="LOCALLLM_KERNELS=fast"):
        resolve_kernels("auto", "cpu")
    monkeypatch.delenv("LOCALLLM_KERNELS")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InvalidRequestError, match="TRITON_INTERPRET=1"):
        resolve_kernels("triton", "cpu")
    if torch.cuda.is_available():
        assert resolve_kernels("auto", "cuda") == "triton"


# ---------------------------------------------------------------------------------------------
# End to end: a tiny model on Triton kernels gives the torch path's greedy tokens


@pytest.fixture()
def reference_cpu_path(monkeypatch):
    """The torch path as the float32 reference: no bfloat16 CPU fast path (``kernels="torch"``
    selects the reference backend; no CPU backend either way)."""
    monkeypatch.setenv("LOCALLLM_CPU_FAST", "0")


PROMPTS = ["hello world", "the cat sat on the", "in the beginning"]


def _greedy(path, kernels, *, pad_decodes=False, max_tokens=6, prompts=PROMPTS):
    from localllm import LLM, SamplingParams

    llm = LLM(
        model=path,
        device=DEVICE,
        dtype="float32",
        kernels=kernels,
        kv_cache_memory="8MiB",
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    runs = []
    if pad_decodes:
        from localllm.engine.gpu_runner import GpuModelRunner

        e = llm.engine
        e.runner = GpuModelRunner(
            e.model,
            e.num_blocks,
            e.config.block_size,
            e.device,
            max_num_seqs=4,
            max_model_len=e.max_model_len,
            use_graphs=False,
            pad_decodes=True,
            decode_splits=e.backend.decode_splits,
        )
        run = e.runner.graphs.run
        e.runner.graphs.run = lambda *a: runs.append(a[0].shape[0]) or run(*a)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], runs


@pytest.mark.parametrize(
    "arch,qtype,kw",
    [
        ("llama", T.Q4_K, {"num_heads": 8, "num_kv_heads": 2, "rope_freqs": True}),
        ("qwen2", T.Q5_0, {"num_heads": 4, "num_kv_heads": 1}),
        ("qwen3", T.Q6_K, {"num_heads": 2, "num_kv_heads": 2, "head_dim": 128}),
    ],
    ids=["llama-q4k-gqa4-llama3rope", "qwen2-q5_0-mqa-bias", "qwen3-q6k-qknorm-d128"],
)
def test_tiny_model_greedy_tokens_match_torch(tmp_path, reference_cpu_path, arch, qtype, kw):
    from tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny.gguf", arch, qtype, seed=11, **kw)
    torch_tokens, _ = _greedy(path, "torch")
    triton_tokens, _ = _greedy(path, "triton")
    assert triton_tokens == torch_tokens


@pytest.mark.parametrize("name", ["smollm3", "ministral3"])
def test_nope_layers_and_attention_temperature_match_torch(tmp_path, reference_cpu_path, name):
    """SmolLM3's layers without RoPE and Ministral 3's attention temperature (prompts past its
    first step of 16 positions) on Triton kernels: the torch path's greedy tokens."""
    from tiny_hf_models import write_tiny_hf_small_arch

    path = write_tiny_hf_small_arch(tmp_path / name, name, seed=3)
    long = [" ".join(["the cat sat on the mat"] * 4)]
    torch_tokens, _ = _greedy(str(path), "torch", prompts=long, max_tokens=4)
    triton_tokens, _ = _greedy(str(path), "triton", prompts=long, max_tokens=4)
    assert triton_tokens == torch_tokens


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_model_with_quantized_kv_cache(tmp_path, dtype):
    """The model on Triton ops runs on an int8/fp8 per-token KV cache (prefill chunk, then a
    decode reading it back); its logits stay close to those with a float32 cache."""
    from tiny_models import write_tiny_model

    from localllm.kernels.triton.backend import TritonBackend
    from localllm.models.assembler import load_model

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", T.Q8_0, seed=13, num_heads=4, num_kv_heads=2)
    model, _ = load_model(path)
    model.to(DEVICE)
    TritonBackend().install(model)
    c = model.config
    nb, bs = 4, 16
    quant = tkv.KVQuant(dtype, "token")
    plain = [torch.zeros(2, nb, bs, c.num_kv_heads, c.head_dim, device=DEVICE) for _ in range(c.num_layers)]
    qcache = [
        tkv.QuantizedKVCache.allocate(nb, bs, c.num_kv_heads, c.head_dim, quant, device=DEVICE)
        for _ in range(c.num_layers)
    ]
    table = torch.tensor([[2, 0]], device=DEVICE)
    logits = {}
    for name, caches in (("plain", plain), ("quant", qcache)):
        for start, n in ((0, 20), (20, 1)):  # a 20-token prompt, then one decode step
            pos = torch.arange(start, start + n, device=DEVICE)
            meta = AttentionMetadata(
                slot_mapping=table[0, pos // bs] * bs + pos % bs,
                block_tables=table,
                context_lens=torch.tensor([start + n], device=DEVICE),
                query_start_loc=[0, n],
                context_lens_host=[start + n],
                num_decodes=int(n == 1),
                block_size=bs,
            )
            ids = torch.arange(5, 5 + n, device=DEVICE)
            hidden = model(ids, pos, meta, caches)
        logits[name] = model.compute_logits(hidden[-1:])
    scale = logits["plain"].abs().max().item()
    assert _max_err(logits["quant"], logits["plain"]) <= (3e-2 if dtype == torch.int8 else 1e-1) * scale


def test_padded_decode_batches_match_torch(tmp_path, reference_cpu_path):
    """The CUDA-graph input path (decodes padded to the next captured batch size, padding rows
    writing no KV and attending to nothing), run eagerly: 3 decodes run as a batch of 4."""
    from tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", T.Q8_0, seed=12, num_heads=4, num_kv_heads=2)
    torch_tokens, _ = _greedy(path, "torch", max_tokens=4)
    triton_tokens, runs = _greedy(path, "triton", pad_decodes=True, max_tokens=4)
    assert triton_tokens == torch_tokens
    assert 3 in runs  # a 3-decode step went through the padded (to 4) path


# ---------------------------------------------------------------------------------------------
# GPU runner pieces that run on a CPU


def test_capture_sizes_and_padding():
    from localllm.engine.gpu_runner import capture_sizes, padded_batch_size

    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1000)[-1] == 256
    sizes = capture_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 17, 33, 64, 65)] == [1, 4, 8, 24, 48, 64, None]


def test_kv_sizing_from_free_memory():
    from localllm.config.engine import EngineConfig
    from localllm.engine.gpu_runner import (
        ModelDoesNotFitError,
        check_weights_fit,
        kv_budget_from_free_memory,
        kv_cache_blocks,
    )

    gib = 1 << 30
    per_block = 2 * 32 * 16 * 8 * 128 * 2  # 8B-shaped, bf16: 2 MiB per 16-token block
    # 20 GiB free: 10% margin and 1 GiB reserve leave 17 GiB = 8704 blocks
    assert kv_cache_blocks(20 * gib, per_block, 16, 8192, reserve_bytes=gib) == (18 * gib - gib) // per_block
    with pytest.raises(ModelDoesNotFitError, match="fewer than the 8192 needed"):
        kv_cache_blocks(1 * gib, per_block, 16, 8192, reserve_bytes=gib // 2)
    check_weights_fit(4 * gib, 8 * gib)
    with pytest.raises(ModelDoesNotFitError, match="weights take 9.00 GiB"):
        check_weights_fit(9 * gib, 8 * gib, "cuda:0")

    class _Model:
        config = type("C", (), {"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256})
        dtype = torch.bfloat16

    cfg = EngineConfig(model="x", max_num_batched_tokens=512, max_num_seqs=64)
    budget = kv_budget_from_free_memory(
        _Model(), torch.device("cuda"), per_block, cfg, 8192, free_bytes=40 * gib
    )
    assert budget % per_block == 0 and 30 * gib < budget < 36 * gib


def test_device_sampler():
    from localllm.engine.gpu_runner import sample_on_device

    g = _gen(0)
    logits = torch.randn(6, 50, generator=g)
    zeros = torch.zeros(6)
    args = {"top_k": torch.zeros(6, dtype=torch.long), "top_p": torch.ones(6), "min_p": zeros}
    assert torch.equal(sample_on_device(logits, zeros, **args), logits.argmax(-1))  # greedy
    ones = torch.ones(6)
    top1 = dict(args, top_k=torch.ones(6, dtype=torch.long))
    assert torch.equal(sample_on_device(logits, ones, generator=g, **top1), logits.argmax(-1))
    # frequencies follow softmax(logits / T) within top-p's nucleus
    row = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(4000, 1)
    temp = torch.full((4000,), 0.8)
    ids = sample_on_device(
        row, temp, torch.zeros(4000, dtype=torch.long), torch.ones(4000), torch.zeros(4000), generator=g
    )
    freq = torch.bincount(ids, minlength=5).float() / 4000
    assert _max_err(freq, torch.softmax(row[0] / 0.8, -1)) < 0.03
    ids = sample_on_device(
        row,
        temp,
        torch.zeros(4000, dtype=torch.long),
        torch.full((4000,), 0.5),
        torch.zeros(4000),
        generator=g,
    )
    assert set(ids.tolist()) == {0}  # p(0) = 0.68 already reaches top_p = 0.5


# ---------------------------------------------------------------------------------------------
# The GPU check script


def test_gpu_check_script_dry_run():
    script = REPO / "bench" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True).returncode == 0
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for section in ("## serve", "decode matmuls", "attention decode", "end-to-end decode"):
        assert section in proc.stdout, proc.stdout
    assert "SKIPPED" not in proc.stdout and "FAILED" not in proc.stdout, proc.stdout


def test_gpu_profile_script_dry_run():
    """``bench/gpu_profile.py`` (host launch cost beside kernel time, one step's kernels ranked)
    on tiny shapes through the interpreter: it runs, and prints both sections."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_profile.py"), "--dry-run"],
        env=dict(os.environ, TRITON_INTERPRET="1"), check=False, capture_output=True, text=True, timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "## matmuls at batch 1" in proc.stdout and "## one eager decode step" in proc.stdout, proc.stdout


def test_gpu_matmul_configs_script_dry_run():
    """``bench/gpu_matmul_configs.py`` on a tiny shape through the interpreter: each config's output
    against the default config's, no timing."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_matmul_configs.py"), "--dry-run"],
        env=dict(os.environ, TRITON_INTERPRET="1"), check=False, capture_output=True, text=True, timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2 and all(float(r.rstrip(" |").rsplit("| ", 1)[1]) < 1e-5 for r in rows), proc.stdout


def test_use_triton_swaps_and_restores(tmp_path):
    from tiny_models import write_tiny_model

    from localllm.kernels.triton.backend import TritonBackend, TritonEmbedding, TritonLinear
    from localllm.kernels.triton.ops import TritonOps
    from localllm.models.assembler import load_model

    model, _ = load_model(write_tiny_model(tmp_path / "tiny.gguf", "llama", T.Q4_0, layers=1))
    backend = TritonBackend()
    backend.install(backend.install(model))  # twice: no double wrapping
    attn = model.layers[0].attn
    assert isinstance(attn.q_proj, TritonLinear) and isinstance(attn.q_proj.base, QuantLinear)
    assert isinstance(model.embed, TritonEmbedding) and isinstance(model.lm_head, TritonLinear)
    assert isinstance(attn.ops, TritonOps) and isinstance(model.layers[0].mlp.ops, TritonOps)
    REFERENCE.install(model)
    assert type(model.layers[0].attn.q_proj) is QuantLinear and attn.ops is REFERENCE
    assert model.layers[0].input_norm.ops is REFERENCE


# ---------------------------------------------------------------------------------------------
# The kernel self-test at load


def _tiny_triton_llm(tmp_path):
    from tiny_models import write_tiny_model

    from localllm import LLM

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", T.Q4_K, seed=5, num_heads=4, num_kv_heads=2)
    return LLM(model=path, device=DEVICE, dtype="float32", kernels="triton", kv_cache_memory="8MiB")


def test_kernels_that_pass_their_self_test_serve(tmp_path):
    assert _tiny_triton_llm(tmp_path).engine.kernels == "triton"


@pytest.mark.parametrize("failure", ["out of shared memory", "nonsense values"])
def test_kernels_that_fail_their_self_test_fall_back_to_torch_with_one_line(tmp_path, monkeypatch, caplog, failure):
    """A kernel that cannot launch on the card (``OutOfResources``, a compile error) or that
    computes nonsense is found once, at load: the engine runs the pure-torch kernels and says so
    in one warning, instead of logging "capture failed" and failing every step."""
    import logging

    from triton.runtime.errors import OutOfResources

    from localllm import SamplingParams

    def no_room(*args, **kwargs):
        raise OutOfResources(115200, 101376, "shared memory")

    if failure == "out of shared memory":
        monkeypatch.setattr(triton_ops, "rms_norm", no_room)
    else:
        monkeypatch.setattr(triton_ops, "silu_and_mul", lambda gate, up: torch.full_like(gate, 3.0))
    with caplog.at_level(logging.WARNING, logger="localllm.engine.llm_engine"):
        llm = _tiny_triton_llm(tmp_path)
    assert llm.engine.kernels == "torch"
    lines = [r.getMessage() for r in caplog.records if "self-test" in r.getMessage()]
    assert len(lines) == 1
    assert ("OutOfResources" in lines[0]) if failure == "out of shared memory" else ("logits differ" in lines[0])
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
