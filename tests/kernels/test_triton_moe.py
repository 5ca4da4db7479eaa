"""The grouped mixture-of-experts kernels (``localllm.kernels.triton.moe``) against the experts run
one by one: the float64 reference of the dequantized weights (tolerance), and the Triton route's
own expert-by-expert matmuls (bitwise: the grouped kernels reduce and round as it does).

Under the Triton interpreter (``TRITON_INTERPRET=1``, on a CPU) ``tl.dot`` is numpy's sgemm,
whose result for a row depends on its place in the tile; a token alone is compared bitwise with
the same token leading a batch (the first row of each of its experts' tiles in both), and on a
GPU (``TRITON_INTERPRET=0 LOCALLLM_TEST_DEVICE=cuda``) with every place.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'localllm[triton]')")

from gguf import GGMLQuantizationType

from localllm.kernels.backend import restore_reference
from localllm.kernels.triton import moe as triton_moe
from localllm.kernels.triton import ops as triton_ops
from localllm.kernels.triton import quant as triton_quant
from localllm.kernels.triton.backend import TritonBackend, TritonOptions
from localllm.models.config import MoeConfig
from localllm.models.decoder import MLP, SparseMoE
from localllm.quant.gguf_dequant import dequantize
from localllm.quant.linear import QuantLinear
from localllm.quant.testing import random_quantized

T = GGMLQuantizationType
INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
DEVICE = os.environ.get("LOCALLLM_TEST_DEVICE", "cpu" if INTERPRET else "cuda")

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 asks for compiled kernels, but there is no CUDA device", allow_module_level=True)
if DEVICE == "cpu" and not INTERPRET:
    pytest.skip("on a CPU the Triton kernels run only with TRITON_INTERPRET=1", allow_module_level=True)

QTYPES = [T.Q4_K, T.Q8_0, T.Q6_K, T.F16, T.MXFP4]  # (MXFP4: gpt-oss's experts)
HIDDEN, INTER, EXPERTS, TOP_K = 256, 256, 6, 2


def _experts(qtype, num_experts=EXPERTS, hidden=HIDDEN, inter=INTER, seed=0) -> list[torch.Tensor]:
    """gate, up and down of every expert as ``[E, N, row]`` tensors (a GGUF file's 3-D tensors)."""
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    return [torch.from_numpy(random_quantized(qtype, num_experts * n, k, seed=seed + i)).view(num_experts, n, -1)
            .to(DEVICE) for i, (n, k) in enumerate(shapes)]


def _plan(qtype, raws, biases=(None, None, None), activation="silu", alpha=0.0, limit=0.0) -> triton_moe.ExpertPlan:
    g, u, d = raws
    hidden, inter = d.shape[1], g.shape[1]
    return triton_moe.ExpertPlan(
        triton_moe.ExpertWeights(g, qtype, hidden, inter, biases[0]),
        triton_moe.ExpertWeights(u, qtype, hidden, inter, biases[1]),
        triton_moe.ExpertWeights(d, qtype, inter, hidden, biases[2]),
        activation, alpha, limit)


def _routing(num_tokens, num_experts=EXPERTS, top_k=TOP_K, seed=0, experts=None):
    """Each token's ``top_k`` distinct experts (among ``experts``) and weights by descending weight."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else range(num_experts))
    chosen = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen).sort(dim=-1, descending=True).values
    return weights.to(DEVICE), chosen.to(DEVICE)


def _one_by_one(x, weights, chosen, plan: triton_moe.ExpertPlan, combined: bool = True) -> torch.Tensor:
    """The Triton route's experts one by one (``SparseMoE.routed`` without a grouped call): the
    batch-invariant matmul per linear, the activation kernel, torch's weighted sum in rank order
    (``combined``; else each slot's expert output)."""
    num_tokens, top_k = chosen.shape
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    outs = x.new_empty(num_tokens * top_k, x.shape[-1])
    for e in flat.unique().tolist():
        slots = order[flat[order] == e]
        xe = x[slots // top_k]

        def linear(part: triton_moe.ExpertWeights, a, e=e):
            bias = None if part.bias is None else part.bias[e]
            return triton_quant.quant_matmul(a, part.raw[e], part.qtype, bias, invariant=True)

        gate, up = linear(plan.gate, xe), linear(plan.up, xe)
        if plan.activation == "silu":
            act = triton_ops.silu_and_mul(gate, up)
        else:
            act = triton_ops.swiglu_oai_and_mul(gate, up, plan.alpha, plan.limit)
        outs[slots] = linear(plan.down, act)
    if not combined:
        return outs
    outs = outs.view(num_tokens, top_k, -1)
    w = weights.to(x.dtype)
    y = outs[:, 0] * w[:, :1]
    for r in range(1, top_k):
        y = y + outs[:, r] * w[:, r:r + 1]
    return y


def _float64(x, weights, chosen, plan: triton_moe.ExpertPlan) -> torch.Tensor:
    """Each token through its experts in float64 from the dequantized weights."""

    def weight(part: triton_moe.ExpertWeights, e):
        raw = part.raw[e].cpu()
        if raw.dtype != torch.uint8:
            raw = raw.view(torch.uint8)
        return dequantize(raw, part.qtype).reshape(part.out_features, part.in_features).double()

    def linear(part, e, a):
        out = a @ weight(part, e).T
        return out if part.bias is None else out + part.bias[e].cpu().double()

    xs = x.cpu().double()
    y = torch.zeros_like(xs)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), chosen[t].tolist()):
            gate, up = linear(plan.gate, e, xs[t]), linear(plan.up, e, xs[t])
            if plan.activation == "silu":
                act = torch.nn.functional.silu(gate) * up
            else:
                g = gate.clamp(max=plan.limit)
                act = g * torch.sigmoid(plan.alpha * g) * (up.clamp(-plan.limit, plan.limit) + 1)
            y[t] += w * linear(plan.down, e, act)
    return y


def _check(x, weights, chosen, plan, rel=2e-5):
    got = triton_moe.moe_experts(x, weights, chosen, plan)
    want = _float64(x, weights, chosen, plan)
    assert (got.cpu().double() - want).abs().max().item() <= rel * want.abs().max().item()
    assert torch.equal(got, _one_by_one(x, weights, chosen, plan))
    return got


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_grouped_experts_match_the_experts_one_by_one(qtype):
    plan = _plan(qtype, _experts(qtype))
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, chosen = _routing(9, seed=2)
    _check(x, weights, chosen, plan)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_a_token_alone_has_the_bits_it_has_in_a_batch(qtype):
    plan = _plan(qtype, _experts(qtype))
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    weights, chosen = _routing(13, seed=4)
    batch = triton_moe.moe_experts(x, weights, chosen, plan)
    # (under the interpreter a token keeps its place in its experts' tiles: it leads the batch)
    tokens = range(13) if not INTERPRET else [0]
    for t in tokens:
        assert torch.equal(triton_moe.moe_experts(x[t:t + 1], weights[t:t + 1], chosen[t:t + 1], plan)[0], batch[t])
    for n in (2, 5, 13):
        assert torch.equal(triton_moe.moe_experts(x[:n], weights[:n], chosen[:n], plan)[0], batch[0])


def test_experts_without_tokens_and_one_token():
    """Experts 1 and 4 get no token (their blocks stay out of the step); one token alone; no token."""
    plan = _plan(T.Q8_0, _experts(T.Q8_0))
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    weights, chosen = _routing(7, seed=6, experts=[0, 2, 3, 5])
    _check(x, weights, chosen, plan)
    _check(x[:1], weights[:1], chosen[:1], plan)
    assert triton_moe.moe_experts(x[:0], weights[:0], chosen[:0], plan).shape == (0, HIDDEN)


def test_rows_sorted_by_expert_in_padded_blocks():
    chosen = torch.tensor([[3, 0], [0, 1], [3, 1], [0, 3]])
    row_slot, block_expert = triton_moe.sorted_rows(chosen, 5, 4)
    # 8 slots: 2 whole blocks of 4, and a part block for each of at most 5 experts
    assert block_expert.tolist() == [0, 1, 3] + [-1] * 4
    assert row_slot.view(-1, 4).tolist() == [[1, 2, 6, -1], [3, 5, -1, -1], [0, 4, 7, -1]] + [[-1] * 4] * 4


def test_split_k_inside_the_programs():
    """A hidden size long enough for the batch-invariant matmul's split-K: the grouped kernel adds
    the same partial sums in the same order."""
    hidden, inter = 2048, 256
    assert triton_quant.invariant_split_k(inter, hidden, 64) == 2
    plan = _plan(T.Q4_K, _experts(T.Q4_K, num_experts=3, hidden=hidden, inter=inter))
    x = torch.randn(4, hidden, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    weights, chosen = _routing(4, num_experts=3, seed=8)
    _check(x, weights, chosen, plan)


def test_gpt_oss_experts_with_biases_and_clamped_swiglu():
    raws = _experts(T.Q8_0, seed=9)
    gen = torch.Generator().manual_seed(10)
    biases = [torch.randn(EXPERTS, n, generator=gen).to(DEVICE) for n in (INTER, INTER, HIDDEN)]
    plan = _plan(T.Q8_0, raws, biases, "swiglu_oai", alpha=1.702, limit=1.5)  # a limit that clamps
    x = torch.randn(6, HIDDEN, generator=gen).to(DEVICE) * 4
    weights, chosen = _routing(6, seed=11)
    _check(x, weights, chosen, plan)


def test_bfloat16_activations_round_as_the_experts_one_by_one():
    """bfloat16: the experts' outputs have the bits of the experts one by one; so has the weighted
    sum on a GPU (the interpreter rounds float32 to bfloat16 its own way, torch's sum to nearest
    even: within a few bfloat16 ulps there)."""
    plan = _plan(T.Q4_K, _experts(T.Q4_K, seed=12))
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16).to(DEVICE)
    weights, chosen = _routing(5, seed=14)
    assert torch.equal(triton_moe.expert_outputs(x, chosen, plan), _one_by_one(x, weights, chosen, plan, False))
    got = triton_moe.moe_experts(x, weights, chosen, plan)
    assert got.dtype == torch.bfloat16
    one_by_one = _one_by_one(x, weights, chosen, plan)
    if INTERPRET:
        assert (got.float() - one_by_one.float()).abs().max().item() <= 4 * 2**-7 * one_by_one.float().abs().max().item()
    else:
        assert torch.equal(got, one_by_one)
    want = _float64(x, weights, chosen, plan)  # (bfloat16 roundings after each matmul, the activation, the sum)
    assert (got.cpu().double() - want).abs().max().item() <= (6e-2 if INTERPRET else 2e-2) * want.abs().max().item()


def test_equally_strided_views_are_one_tensor_and_others_are_not():
    whole = torch.zeros(4, 8, 34, dtype=torch.uint8)
    views = [whole[e] for e in range(4)]
    stacked = triton_moe.stacked_rows(views)
    assert stacked is not None and stacked.data_ptr() == whole.data_ptr() and stacked.stride() == whole.stride()
    assert triton_moe.stacked_rows([whole[0], whole[2], whole[1], whole[3]]) is None
    assert triton_moe.stacked_rows([t.clone() for t in views]) is None


# ---------------------------------------------------------------------------------------------
# Through the backend: a SparseMoE's layer


def _sparse_moe(qtype, raws, apart: bool = False, activation="silu") -> SparseMoE:
    """A layer over ``raws`` as the assembler builds it: each expert's linears row views of the 3-D
    tensors (``apart``: separate tensors, as experts moved to a GPU one by one are)."""
    g, u, d = raws
    hidden, inter = d.shape[1], g.shape[1]

    def view(t, e):
        return t[e].clone() if apart else t[e]

    experts = [MLP(QuantLinear(view(g, e), qtype, hidden, inter), QuantLinear(view(u, e), qtype, hidden, inter),
                   QuantLinear(view(d, e), qtype, inter, hidden), activation) for e in range(EXPERTS)]
    gen = torch.Generator().manual_seed(20)
    router = QuantLinear(torch.randn(EXPERTS, hidden, generator=gen).to(DEVICE), T.F32, hidden, EXPERTS)
    return SparseMoE(router, experts, MoeConfig(EXPERTS, TOP_K, inter, norm_topk_prob=True))


@pytest.mark.parametrize("apart", [False, True], ids=["views", "apart"])
def test_backend_runs_a_layer_grouped_with_the_bits_of_one_by_one(apart, monkeypatch):
    raws = _experts(T.Q8_0, seed=21)
    moe = _sparse_moe(T.Q8_0, raws, apart=apart)
    backend = TritonBackend(TritonOptions(cuda_graphs=False, autotune=False))
    backend.install(moe)
    plan = backend.expert_plan(moe)
    assert plan is not None
    storage = plan.gate.raw.untyped_storage().data_ptr()
    assert all(e.gate_proj.base.raw.untyped_storage().data_ptr() == storage for e in moe.experts)
    assert torch.equal(plan.down.raw.cpu(), raws[2].cpu())  # the same bytes, in one tensor where they were apart
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    grouped = moe(x)
    monkeypatch.setattr(backend, "moe_experts", lambda *args: None)
    assert torch.equal(grouped, moe(x))
    restore_reference(moe)
    torch.testing.assert_close(moe(x), grouped, atol=1e-4, rtol=1e-4)


def test_types_without_a_kernel_run_one_by_one():
    """Every GGUF block type has a grouped kernel; F32 experts (used in place by cuBLAS) have none."""
    assert not triton_moe.supports(T.F32) and all(triton_moe.supports(t) for t in (T.IQ2_XXS, T.IQ1_M, T.TQ1_0))
    gen = torch.Generator().manual_seed(22)
    raws = [torch.randn(EXPERTS, n, k, generator=gen).to(DEVICE)
            for n, k in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))]
    moe = _sparse_moe(T.F32, raws)
    backend = TritonBackend(TritonOptions(cuda_graphs=False, autotune=False))
    backend.install(moe)
    assert backend.expert_plan(moe) is None
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(23)).to(DEVICE)
    weights, chosen = moe.route(x)
    assert backend.moe_experts(moe, x, weights, chosen) is None
