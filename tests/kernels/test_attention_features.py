"""Sliding-window attention, attention-logit soft-capping and GeGLU (``gelu_tanh_mul``), in every
kernel backend, against definitions written out here.

The reference (:func:`localllm.kernels.attention.paged_attention`) is compared with a naive dense
attention in float64 (a loop over sequences and query tokens, one mask per position):
``atol = 1e-5`` for float32. The CPU backend's ops (native kernels or not) must run the
reference for either feature; the Triton kernels run through the interpreter (a few small
cases: it runs every program one after another in Python), ``atol = 2e-5``.

Semantics (HF transformers' Gemma 2, llama.cpp): a query at position ``p`` sees the key at ``j``
iff ``j <= p`` and ``p - j < sliding_window``; scores ``s = scale * q.k`` become
``softcap * tanh(s / softcap)`` before the mask and the softmax. Attention sinks (transformers'
gpt-oss, llama.cpp's ``attn_sinks``): a learned logit per query head joins each softmax, its
probability dropped. gpt-oss's clamped SwiGLU (``swiglu_oai_mul``) is held to ggml's formula.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import torch

from localllm.kernels.attention import AttentionMetadata, paged_attention, paged_attention_rows_alone
from localllm.kernels.cpu.backend import CpuBackend
from localllm.kernels.cpu.ops import CpuOps, _per_token_rows
from localllm.kernels.cpu.options import CpuOptions
from localllm.kernels.torch_backend import REFERENCE

ATOL = 1e-5
TRITON_ATOL = 2e-5


def _batch(
    seqs, num_heads, num_kv_heads, head_dim, *, block_size=4, shuffled=True, seed=0, dtype=torch.float32
):
    """A cache of random K/V, block tables (shuffled physical blocks, or consecutive ids) and a
    flat query batch for ``seqs`` = [(num_query_tokens, context_len)], decodes first."""
    g = torch.Generator().manual_seed(seed)
    need = sum(-(-c // block_size) for _, c in seqs)
    num_blocks = need + 3
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist() if shuffled else list(range(num_blocks))
    max_blocks = max(-(-c // block_size) for _, c in seqs) + 1  # + 1: padded tables
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.long)
    slots, qsl, ctxs = [], [0], []
    for i, (n, c) in enumerate(seqs):
        ids = [order.pop(0) for _ in range(-(-c // block_size))]
        tables[i, : len(ids)] = torch.tensor(ids)
        slots += [ids[p // block_size] * block_size + p % block_size for p in range(c - n, c)]
        qsl.append(qsl[-1] + n)
        ctxs.append(c)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        context_lens=torch.tensor(ctxs),
        query_start_loc=qsl,
        context_lens_host=ctxs,
        num_decodes=sum(1 for n, _ in seqs if n == 1),
        block_size=block_size,
    )
    return q, kv, meta


def _naive(q, kv, meta, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """Dense causal attention in float64, sequence by sequence: each sequence's keys read token
    by token through its block table, a mask row per query position; ``sinks`` ``[num_heads]``:
    one more logit per head in each softmax, whose probability is dropped (transformers' gpt-oss)."""
    num_heads, kvh = q.shape[1], kv.shape[3]
    group = num_heads // kvh
    bs = meta.block_size
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, ctx in enumerate(meta.context_lens_host):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        key_pos = torch.arange(ctx)
        blocks = meta.block_tables[i, key_pos // bs]
        k = kv[0, blocks, key_pos % bs].double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = kv[1, blocks, key_pos % bs].double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(ctx - (end - start), ctx)[:, None]  # the new tokens come last
        s = torch.einsum("thd,jhd->htj", q[start:end].double(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        visible = key_pos[None, :] <= q_pos
        if window is not None:
            visible &= q_pos - key_pos[None, :] < window
        s = s.masked_fill(~visible[None], -math.inf)
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:
            sink = sinks.double()[:, None, None].expand(-1, s.shape[1], 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
        out[start:end] = torch.einsum("htj,jhd->thd", p, v)
    return out


def _err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


BATCHES = {
    "decode": [(1, 13), (1, 5), (1, 16), (1, 1)],
    "one-decode": [(1, 13)],
    "prefill-cached": [(5, 13)],
    "prompt": [(7, 7)],
    "mixed": [(1, 13), (1, 3), (6, 17), (7, 7)],
    "one-decode-mixed": [(1, 22), (9, 9)],
}
WINDOWS = [None, 1, 4, 13, 50]  # 13: equal to some contexts; 50: larger than all


@pytest.mark.parametrize("softcap", [None, 1.5], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa2", "mha"])
def test_reference_matches_dense(batch, window, softcap, heads):
    nh, nkv = heads
    for shuffled in (True, False):  # scattered blocks (gathered) and consecutive ones (views)
        q, kv, meta = _batch(BATCHES[batch], nh, nkv, 8, shuffled=shuffled, seed=len(batch))
        meta.step_cache = {}
        scale = 8**-0.5 * 2  # larger scores: the cap bites
        out = paged_attention(q, kv, meta, scale, sliding_window=window, logit_softcap=softcap)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert _err(out, _naive(q, kv, meta, scale, window, softcap)) <= ATOL, shuffled


def _sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(100 + seed)) * 1.5


@pytest.mark.parametrize("softcap", [None, 1.5], ids=["nocap", "cap"])
@pytest.mark.parametrize("window", [None, 4, 50], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("batch", list(BATCHES))
def test_reference_with_sinks_matches_dense(batch, window, softcap):
    q, kv, meta = _batch(BATCHES[batch], 4, 2, 8, seed=len(batch))
    meta.step_cache = {}
    sinks = _sinks(4)
    out = paged_attention(q, kv, meta, 0.7, sliding_window=window, logit_softcap=softcap, sinks=sinks)
    assert _err(out, _naive(q, kv, meta, 0.7, window, softcap, sinks)) <= ATOL
    # a sink takes its share: the result is not the plain one
    assert _err(out, _naive(q, kv, meta, 0.7, window, softcap)) > 1e-2


@pytest.mark.parametrize("window,softcap,sinks", [(None, None, True), (4, None, False), (None, 1.5, False),
                                                  (4, None, True), (13, 1.5, True)])
def test_rows_alone_match_dense_and_a_decode_at_their_position(window, softcap, sinks):
    """:func:`paged_attention_rows_alone` is the attention, and each row has the bits a lone
    decode at its position gets (whatever the rest of its step), chunk cuts included."""
    from localllm.kernels.attention import paged_attention_rows_alone

    features = {"sliding_window": window, "logit_softcap": softcap, "sinks": _sinks(4, 1) if sinks else None}
    q, kv, meta = _batch(BATCHES["mixed"], 4, 2, 8, seed=12)
    out = paged_attention_rows_alone(q, kv, meta, 0.6, **features)
    assert _err(out, _naive(q, kv, meta, 0.6, window, softcap, features["sinks"])) <= ATOL
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        for row in range(start, end):
            ctx = meta.context_lens_host[i] - (end - row) + 1
            alone = AttentionMetadata(slot_mapping=meta.slot_mapping[row:row + 1], block_tables=meta.block_tables[i:i + 1],
                                      context_lens=torch.tensor([ctx]), query_start_loc=[0, 1],
                                      context_lens_host=[ctx], num_decodes=1, block_size=meta.block_size)
            assert torch.equal(paged_attention_rows_alone(q[row:row + 1], kv, alone, 0.6, **features), out[row:row + 1])


def test_softcap_changes_the_result():
    """The cap is applied (a cap far above the scores changes nothing, a small one does)."""
    q, kv, meta = _batch(BATCHES["mixed"], 4, 2, 8)
    plain = paged_attention(q, kv, meta, 1.0)
    assert _err(paged_attention(q, kv, meta, 1.0, logit_softcap=1e4), plain) <= ATOL
    assert _err(paged_attention(q, kv, meta, 1.0, logit_softcap=0.5), plain) > 1e-2


def test_window_covering_the_context_equals_no_window():
    q, kv, meta = _batch(BATCHES["mixed"], 4, 2, 8)
    plain = paged_attention(q, kv, meta, 0.3)
    assert _err(paged_attention(q, kv, meta, 0.3, sliding_window=17), plain) <= ATOL


def test_defaults_are_bitwise_the_plain_path():
    for batch in ("decode", "one-decode", "mixed", "prompt"):
        q, kv, meta = _batch(BATCHES[batch], 4, 2, 8, seed=3)
        plain = paged_attention(q, kv, meta, 0.35)
        assert torch.equal(paged_attention(q, kv, meta, 0.35, sliding_window=None, logit_softcap=None), plain)
        assert torch.equal(REFERENCE.attention(q, kv, meta, 0.35), plain)
        out = REFERENCE.attention(q, kv, meta, 0.35, sliding_window=None, logit_softcap=None)
        assert torch.equal(out, plain)


def test_step_cache_keeps_windows_apart():
    """Layers of one step share ``step_cache``: masks of different windows must not collide."""
    q, kv, meta = _batch([(1, 13), (1, 9), (1, 16), (6, 17), (5, 5)], 4, 2, 8, seed=4)
    meta.step_cache = {}
    for window in (None, 3, 8, 3, None, 8):  # alternating layers of a Gemma-2-like model
        out = paged_attention(q, kv, meta, 0.4, sliding_window=window)
        assert _err(out, _naive(q, kv, meta, 0.4, window)) <= ATOL, window


def test_half_precision_inputs():
    q, kv, meta = _batch(BATCHES["mixed"], 4, 2, 8, dtype=torch.bfloat16, seed=5)
    out = paged_attention(q, kv, meta, 0.35, sliding_window=4, logit_softcap=2.0)
    assert out.dtype == torch.bfloat16
    assert _err(out, _naive(q, kv, meta, 0.35, 4, 2.0)) <= 2e-2


def test_softcap_prompt_in_row_chunks(monkeypatch):
    """A long soft-capped prompt chunk is computed a few query rows at a time."""
    from localllm.kernels import attention

    monkeypatch.setattr(attention, "_SOFTCAP_CHUNK", 4 * 20 * 3)  # 3 rows at a time
    q, kv, meta = _batch([(1, 9), (11, 20)], 4, 2, 8, seed=6)
    out = paged_attention(q, kv, meta, 0.4, sliding_window=6, logit_softcap=1.0)
    assert _err(out, _naive(q, kv, meta, 0.4, 6, 1.0)) <= ATOL


def test_bad_window():
    q, kv, meta = _batch(BATCHES["decode"], 2, 2, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, kv, meta, 0.3, sliding_window=0)


# ---------------------------------------------------------------------------------------------
# The CPU backend's ops


class _Spy:
    """Records the calls made on it; forwards them to ``module`` (or returns a marker)."""

    def __init__(self, module=None) -> None:
        self.module = module
        self.calls: list[tuple[str, dict]] = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, kwargs))
            if self.module is None:
                return ("native", name)
            return getattr(self.module, name)(*args, **kwargs)

        return call


@pytest.mark.parametrize("window,softcap", [(None, None), (4, None), (None, 1.5), (4, 1.5)])
def test_cpu_backend_attention_equals_the_reference(window, softcap):
    ops = CpuBackend(CpuOptions(), native=None)  # without the native kernels (as on this machine)
    for batch in ("decode", "mixed"):
        q, kv, meta = _batch(BATCHES[batch], 4, 2, 16, seed=7)
        ref = paged_attention(q, kv, meta, 0.25, sliding_window=window, logit_softcap=softcap)
        out = ops.attention(q, kv, meta, 0.25, sliding_window=window, logit_softcap=softcap)
        assert torch.equal(out, ref)
        assert _err(out, _naive(q, kv, meta, 0.25, window, softcap)) <= ATOL


@pytest.mark.parametrize("window,softcap,sinks", [(None, 1.5, None), (4, 1.5, None), (4, 1.5, 4)])
def test_cpu_native_decode_attention_is_not_used_with_soft_capping(window, softcap, sinks):
    """The native kernel has no soft-capping: on the batch-invariant route (no fast math) each row
    is attended alone in torch, with fast math the base backend's route answers."""
    features = {"sliding_window": window, "logit_softcap": softcap, "sinks": None if sinks is None else _sinks(sinks)}
    q, kv, meta = _batch(BATCHES["mixed"], 4, 2, 16, seed=8)  # float32, head dim 16: native's
    want = _naive(q, kv, meta, 0.25, window, softcap, features["sinks"])
    native, base = _Spy(), _Spy(REFERENCE)
    ops = CpuOps(base, native, CpuOptions())
    out = ops.attention(q, kv, meta, 0.25, **features)
    assert native.calls == [] and base.calls == []
    assert _err(out, want) <= ATOL
    fast = CpuOps(base, native, CpuOptions(fast_math=True))
    out = fast.attention(q, kv, meta, 0.25, **features)
    assert native.calls == [] and base.calls == [("attention", features)]
    assert torch.equal(out, paged_attention(q, kv, meta, 0.25, **features))
    # without them, the native kernel takes the decodes, as before
    q, kv, meta = _batch(BATCHES["decode"], 4, 2, 16, seed=8)
    assert ops.attention(q, kv, meta, 0.25) == ("native", "paged_decode_attention")
    assert ops.attention(q, kv, meta, 0.25, sliding_window=None, logit_softcap=None, sinks=None)[0] == "native"
    assert len(base.calls) == 1


@pytest.mark.parametrize("batch", ["decode", "mixed"])
@pytest.mark.parametrize("window,sinks", [(4, False), (None, True), (4, True), (1, False), (40, True)])
def test_cpu_native_attention_takes_windows_and_sinks(batch, window, sinks):
    """The native kernel's sliding window (only the last ``window`` keys, the blocks before them
    not read) and sinks (a logit per head in each softmax) against the plain definition, float32
    and float16 caches; each query row gets the bits it gets attended alone (batch invariance)."""
    from localllm.kernels.cpu import native as cpu_native

    kernels = cpu_native.load(CpuOptions())
    if kernels is None:
        pytest.skip("no native CPU kernels on this machine")
    features = {"sliding_window": window, "sinks": _sinks(8) if sinks else None}
    for dtype in (torch.float32, torch.float16):
        q, kv, meta = _batch(BATCHES[batch], 8, 2, 32, seed=9)
        kv = kv.to(dtype)
        ops = CpuOps(REFERENCE, kernels, CpuOptions())
        out = ops.attention(q, kv, meta, 0.25, **features)
        want = _naive(q, kv.float(), meta, 0.25, window, None, features["sinks"])
        assert _err(out, want) <= ATOL, dtype
        alone = paged_attention_rows_alone(q, kv.float(), meta, 0.25, **features)
        assert _err(out, alone) <= ATOL
        if batch == "mixed":  # every row as a lone decode at its position: the same bits
            tables, lens = _per_token_rows(meta)
            for row in range(q.shape[0]):
                one = kernels.paged_decode_attention(q[row:row + 1], kv, tables[row:row + 1], lens[row:row + 1], 0.25,
                                                     window=window or 0, sinks=features["sinks"])
                assert torch.equal(one[0], out[row]), (dtype, row)


def test_cpu_layer_plan_declines_windows_softcap_sinks_and_other_activations():
    """The native whole-layer call has none of the features, nor GeGLU or the clamped SwiGLU:
    such layers run op by op."""
    from types import SimpleNamespace

    from localllm.kernels.cpu.ops import layer_plan

    for attn_extra, mlp_extra in (
        ({"sliding_window": 4}, {}),
        ({"logit_softcap": 50.0}, {}),
        ({"sinks": torch.zeros(4)}, {}),
        ({}, {"activation": "gelu_tanh"}),
        ({}, {"activation": "swiglu_oai"}),
    ):
        attn = SimpleNamespace(**{"sliding_window": None, "logit_softcap": None, "sinks": None, **attn_extra})
        layer = SimpleNamespace(attn=attn, mlp=SimpleNamespace(**{"activation": "silu", **mlp_extra}))
        assert layer_plan(layer, CpuOptions()) is None


# ---------------------------------------------------------------------------------------------
# gelu_tanh_mul


def _geglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    g, u = g.double(), u.double()
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u


def test_gelu_tanh_mul_reference():
    g = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 3
    u = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    out = REFERENCE.gelu_tanh_mul(g, u)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.gelu(g, approximate="tanh") * u)
    assert _err(out, _geglu(g, u)) <= 1e-5
    gb, ub = g.bfloat16(), u.bfloat16()
    out = REFERENCE.gelu_tanh_mul(gb, ub)
    assert out.dtype == torch.bfloat16
    assert _err(out, _geglu(gb, ub)) <= 2 * 2**-7 * 16  # 2 bf16 ulps at |y| < 16
    gu = torch.randn(3, 64)  # halves of one fused gate/up tensor (what the MLP passes)
    g, u = gu.chunk(2, dim=-1)
    ref = REFERENCE.gelu_tanh_mul(g, u)
    assert torch.equal(CpuBackend(CpuOptions(), native=None).gelu_tanh_mul(g, u), ref)
    assert torch.equal(CpuOps(REFERENCE, _Spy(), CpuOptions()).gelu_tanh_mul(g, u), ref)


# ---------------------------------------------------------------------------------------------
# Triton (interpreted on a CPU)


@pytest.fixture(scope="module")
def tri():
    pytest.importorskip("triton", reason="triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("these run the Triton kernels interpreted (TRITON_INTERPRET=1)")
    from localllm.kernels.triton import attention as triton_attention
    from localllm.kernels.triton import ops as triton_ops

    return triton_attention, triton_ops


def _triton_args(meta):
    starts = meta.query_start_loc
    return {
        "block_tables": meta.block_tables,
        "context_lens": meta.context_lens,
        "query_start_loc": torch.tensor(starts),
        "max_query_len": max(b - a for a, b in itertools.pairwise(starts)),
        "max_context_len": max(meta.context_lens_host),
    }


# decodes with contexts longer than the window (key tiles skipped), a prefill chunk over cached
# context longer than a key tile, a whole prompt
TRITON_MIXED = [(1, 70), (1, 5), (1, 33), (20, 75), (9, 9)]


@pytest.mark.parametrize(
    "window,softcap,splits,sinks",
    [(24, None, 1, False), (None, 1.5, 1, False), (24, 1.5, 1, False), (5, 1.5, 3, False),
     (None, None, 1, True), (24, None, 1, True), (None, None, 3, True), (5, 1.5, 3, True)],
    ids=["window", "softcap", "both", "both-splits", "sinks", "sinks-window", "sinks-splits", "all-splits"],
)
def test_triton_attention(tri, window, softcap, splits, sinks):
    ta, _ = tri
    q, kv, meta = _batch(TRITON_MIXED, 4, 2, 16, block_size=16, seed=9)
    scale = 0.5
    head_sinks = _sinks(4, 2) if sinks else None
    ref = paged_attention(q, kv, meta, scale, sliding_window=window, logit_softcap=softcap, sinks=head_sinks)
    assert _err(ref, _naive(q, kv, meta, scale, window, softcap, head_sinks)) <= ATOL
    out = ta.paged_attention(
        q,
        kv,
        scale=scale,
        num_splits=splits,
        sliding_window=window,
        logit_softcap=softcap,
        sinks=head_sinks,
        **_triton_args(meta),
    )
    assert _err(out, ref) <= TRITON_ATOL


def test_triton_ops_attention_passes_the_features(tri):
    _, triton_ops = tri
    ops = triton_ops.TritonOps()
    q, kv, meta = _batch([(1, 40), (6, 21)], 4, 2, 16, block_size=16, seed=10)
    out = ops.attention(q, kv, meta, 0.5, sliding_window=7, logit_softcap=2.0)
    assert _err(out, paged_attention(q, kv, meta, 0.5, sliding_window=7, logit_softcap=2.0)) <= TRITON_ATOL
    sinks = _sinks(4, 3)
    out = ops.attention(q, kv, meta, 0.5, sliding_window=7, sinks=sinks)
    assert _err(out, paged_attention(q, kv, meta, 0.5, sliding_window=7, sinks=sinks)) <= TRITON_ATOL
    plain = ops.attention(q, kv, meta, 0.5)
    assert torch.equal(ops.attention(q, kv, meta, 0.5, sliding_window=None, logit_softcap=None, sinks=None), plain)
    assert _err(plain, paged_attention(q, kv, meta, 0.5)) <= TRITON_ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_gelu_tanh_mul(tri, dtype):
    _, triton_ops = tri
    g = (torch.randn(3, 1500, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    u = torch.randn(3, 1500, generator=torch.Generator().manual_seed(4)).to(dtype)
    tol = 2e-5 if dtype == torch.float32 else 2 * 2**-7 * 16
    ref = REFERENCE.gelu_tanh_mul(g, u)
    out = triton_ops.TritonOps().gelu_tanh_mul(g, u)
    assert out.dtype == dtype and out.shape == g.shape
    assert _err(out, ref) <= tol


# ---------------------------------------------------------------------------------------------
# swiglu_oai_mul (gpt-oss's clamped SwiGLU)


def _swiglu_oai(g: torch.Tensor, u: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """ggml's ``swiglu_oai`` in float64: ``x / (1 + exp(-alpha x)) * (y + 1)``, ``x = min(g, limit)``,
    ``y = clamp(u, -limit, limit)``."""
    x, y = g.double().clamp(max=limit), u.double().clamp(-limit, limit)
    return x / (1 + torch.exp(-alpha * x)) * (y + 1)


def _gate_up(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up halves of one fused tensor, spread wide enough that the clamps bite."""
    gu = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(seed)) * 6
    return gu.chunk(2, dim=-1)


def test_swiglu_oai_reference():
    g, u = _gate_up(5, 96, 1)
    assert (g > 7).any() and (u.abs() > 7).any()
    out = REFERENCE.swiglu_oai_mul(g, u, 1.702, 7.0)
    assert out.dtype == torch.float32 and out.shape == g.shape
    assert _err(out, _swiglu_oai(g, u)) <= 1e-5 * 8 * 7  # float32 rounding at |out| <= 8 * 7
    assert _err(out, torch.nn.functional.silu(g) * u) > 1  # not SwiGLU
    assert _err(REFERENCE.swiglu_oai_mul(g, u, 1.0, 3.0), _swiglu_oai(g, u, 1.0, 3.0)) <= 1e-5 * 4 * 3


def test_swiglu_oai_cpu_rows_do_not_depend_on_the_batch():
    """The CPU backend's native kernel where it loads (each row's bits the same alone and in a
    batch, fused gate/up or apart), else the reference."""
    from localllm.kernels.cpu import native

    ops = CpuBackend(CpuOptions())
    g, u = _gate_up(37, 64, 2)
    out = ops.swiglu_oai_mul(g, u, 1.702, 7.0)
    assert _err(out, _swiglu_oai(g, u)) <= 1e-5 * 8 * 7
    if native.load(CpuOptions()) is None:
        assert torch.equal(out, REFERENCE.swiglu_oai_mul(g, u, 1.702, 7.0))
        return
    for i in (0, 5, 36):
        assert torch.equal(ops.swiglu_oai_mul(g[i:i + 1], u[i:i + 1], 1.702, 7.0), out[i:i + 1]), i
    assert torch.equal(ops.swiglu_oai_mul(g.contiguous(), u.contiguous(), 1.702, 7.0), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_swiglu_oai_mul(tri, dtype):
    _, triton_ops = tri
    g, u = (t.to(dtype) for t in _gate_up(3, 700, 3))
    tol = 2e-5 * 8 * 7 if dtype == torch.float32 else 2 * 2**-7 * 64
    ref = REFERENCE.swiglu_oai_mul(g, u, 1.702, 7.0)
    out = triton_ops.TritonOps().swiglu_oai_mul(g, u, 1.702, 7.0)
    assert out.dtype == dtype and out.shape == g.shape
    assert _err(out, ref) <= tol
