"""GPTQ linears on the CPU backend's native route (localllm/kernels/cpu/gptq.py) against their
float32 reference (``GPTQLinear.reference_forward``): which checkpoints take the route, how close
it is (within the route's Cauchy-Schwarz bound: activation codes and float16 zero offsets),
fused q/k/v equal to one by one, rows independent of their batch, and a model's whole decoder
layer in one native call where there is no act-order permutation. The real checkpoints' greedy
tokens against the reference are in tests/quant/test_gptq.py (its quantized SmolLM2 fixture)."""

from __future__ import annotations

import pytest
import torch
from gptq_spec import random_gptq

from localllm.kernels.cpu import native as cpu_native
from localllm.kernels.cpu.gptq import CpuGPTQLinear, fused_linear
from localllm.kernels.cpu.options import CpuOptions
from localllm.quant.gptq.layout import (
    GPTQLinear,
    GPTQWeight,
    fold_down_order,
    group_order,
    renumber_inputs,
    renumber_outputs,
)

pytestmark = pytest.mark.skipif(not cpu_native.cpu_has_native(), reason="no native CPU kernels on this CPU")
OPTIONS = CpuOptions(release_file_pages=False)
K, N = 576, 208  # N: 13 tiles of 16 rows


def _linear(bits, group_size, act_order, sym, fmt="gptq", n=N, k=K, seed=0):
    tensors, ref = random_gptq(bits, group_size, act_order, sym, k, n, fmt=fmt, seed=seed)
    weight = GPTQWeight(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], bits,
                        group_size, k, n, fmt)
    return GPTQLinear(weight), ref


CASES = [(b, g, a, s, "gptq") for b in (2, 3, 4, 8) for g, a in ((128, True), (128, False), (32, True), (-1, False))
         for s in (True, False)] + [(b, 128, True, s, "gptq_v2") for b in (4, 8) for s in (True, False)]


@pytest.mark.parametrize("passes", [1, 2], ids=["int8", "int8x2"])
@pytest.mark.parametrize("bits, group_size, act_order, sym, fmt", CASES)
def test_native_route_matches_the_reference(bits, group_size, act_order, sym, fmt, passes):
    """Within the route's rigorous bound at one activation pass (the default) and two."""
    base, ref = _linear(bits, group_size, act_order, sym, fmt, seed=bits * 7 + group_size % 5)
    fast = CpuGPTQLinear(base, CpuOptions(release_file_pages=False, activation_passes=passes))
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(bits))
    state = fast.prepared()
    if bits == 8 and not sym:  # codes q - zero + 128 leave [0, 255] for random asymmetric zeros
        assert state is None
        assert torch.equal(fast(x), base.reference_forward(x))
        return
    assert state is not None and (state.perm is not None) == act_order
    assert state.weight.bits == (8 if bits == 8 else 4)
    if bits == 8 or sym:  # zero offsets -s * zero are float16-exact (zero a power of two) or absent
        assert state.weight.exact
    else:
        assert state.weight.max_scale_error < 2e-3
    got, want = fast(x), base.reference_forward(x)
    assert torch.allclose(want, x @ ref.t(), rtol=1e-4, atol=1e-4)
    bound = state.weight.error_bound(state.gather(x), passes)
    assert ((got - want).abs().amax(1) <= bound + 1e-5).all()
    assert ((got - want).abs().max() / want.abs().max()) < (2e-3 if passes == 2 else 2e-2)


def test_group_sizes_that_split_32_inputs_stay_on_the_reference():
    base, _ = _linear(4, 16, False, True, k=128)
    assert CpuGPTQLinear(base, OPTIONS).prepared() is None
    base, _ = _linear(4, -1, False, True, k=48)
    assert CpuGPTQLinear(base, OPTIONS).prepared() is None


def test_act_order_permutation_sorts_inputs_by_group():
    base, _ = _linear(4, 128, True, False)
    perm = group_order(base)
    g = base.group_of[perm]
    assert bool((g[1:] >= g[:-1]).all()) and sorted(perm.tolist()) == list(range(K))
    plain, _ = _linear(4, 128, False, False)
    assert group_order(plain) is None


@pytest.mark.parametrize("act_order", [True, False])
def test_fused_projections_equal_the_linears_one_by_one(act_order):
    # q/k/v of one layer share their input, hence (quantized from one Hessian) their act-order
    parts = [_linear(4, 128, act_order, False, n=n, seed=i)[0] for i, n in enumerate((192, 64, 64))]
    if act_order:
        for p in parts[1:]:
            p.g_idx, p.group_of = parts[0].g_idx, parts[0].group_of
    modules = [CpuGPTQLinear(p, OPTIONS) for p in parts]
    x = torch.randn(3, K)
    fused = fused_linear(modules, x, None, OPTIONS)
    assert fused is not None and modules[0].fused[0].weight.n == 320
    assert torch.equal(fused, torch.cat([m(x) for m in modules], dim=1))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_renumbering_is_exact_and_folding_down_keeps_the_mlp(bits):
    """renumber_outputs / renumber_inputs permute the dequantized weight exactly (3-bit zero points and
    codes repacked across words included); fold_down_order moves down's act-order into gate's and
    up's outputs: the MLP computes the same function and down's inputs come in group order."""
    gate, _ = _linear(bits, 128, True, False, n=256, k=192, seed=1)
    up, _ = _linear(bits, 128, True, False, n=256, k=192, seed=2)
    down, _ = _linear(bits, 32, True, False, n=192, k=256, seed=3)
    gate.bias = torch.randn(256)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(renumber_outputs(gate, order).dequantize(), gate.dequantize()[order])
    assert torch.equal(renumber_outputs(gate, order).bias, gate.bias[order])
    assert torch.equal(renumber_inputs(down, order).dequantize(), down.dequantize()[:, order])

    folded = fold_down_order(gate, up, down)
    assert group_order(down) is not None and group_order(folded[2]) is None
    assert group_order(folded[0]) is not None  # gate keeps its own input order
    x = torch.randn(5, 192, dtype=torch.float64)  # float64: only the summation order differs

    def mlp(g, u, d):
        return d.reference_forward(torch.nn.functional.silu(g.reference_forward(x)) * u.reference_forward(x))

    torch.testing.assert_close(mlp(*folded), mlp(gate, up, down), rtol=1e-10, atol=1e-10)
    assert fold_down_order(folded[0], folded[1], folded[2])[2] is folded[2]  # nothing left to fold
    plain, _ = _linear(bits, 128, False, False, n=192, k=256)
    assert fold_down_order(gate, up, plain)[0] is gate  # down without act-order: as given


def test_different_input_orders_are_not_fused():
    parts = [_linear(4, 128, True, False, seed=i)[0] for i in range(2)]
    modules = [CpuGPTQLinear(p, OPTIONS) for p in parts]
    assert fused_linear(modules, torch.randn(2, K), None, OPTIONS) is None


def test_rows_do_not_depend_on_their_batch():
    base, _ = _linear(4, 128, True, False)
    fast = CpuGPTQLinear(base, OPTIONS)
    x = torch.randn(40, K)
    batch = fast(x)
    for m in (1, 3, 17):
        assert torch.equal(fast(x[:m]), batch[:m])


# --- whole checkpoints in the layouts GPTQ uploads come in ------------------------------------

LAYOUTS = [("float16", True, True), ("bfloat16", True, True), ("float32", True, False), ("float16", False, True)]


def _gptq_checkpoint(tmp_path, embed_dtype: str, tied: bool, act_order: bool, bits: int = 4, group_size: int = 128):
    """A tiny llama as a GPTQ checkpoint written from the format's definition (``random_gptq``, not
    this package's quantizer): every projection its own random act-order (q, k and v, gate and up
    included, so none of them can share one repacked weight or one input gather), the embedding (and
    the untied head) in ``embed_dtype``."""
    import json

    from safetensors.torch import load_file, save_file
    from tiny_models import write_tiny_model

    from localllm.quantize.pipeline import export_hf

    gguf_path = write_tiny_model(tmp_path / "tiny.gguf", arch="llama", hidden=256, intermediate=512, layers=2,
                                 tie_embeddings=tied)
    out = tmp_path / f"gptq-{embed_dtype}-{'tied' if tied else 'untied'}"
    export_hf(gguf_path, out, dtype=getattr(torch, embed_dtype))
    tensors = load_file(out / "model.safetensors")
    for i, name in enumerate(sorted(n for n in tensors if n.endswith("_proj.weight"))):
        n, k = tensors[name].shape
        packed, _ = random_gptq(bits, group_size, act_order, False, k, n, seed=100 + i)
        del tensors[name]
        tensors.update({name.removesuffix("weight") + part: t for part, t in packed.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                  "desc_act": act_order, "sym": False}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("embed_dtype, tied, act_order", LAYOUTS,
                         ids=[f"{d}-{'tied' if t else 'untied'}-{'act' if a else 'plain'}" for d, t, a in LAYOUTS])
def test_checkpoints_in_any_layout_take_the_whole_fast_route(tmp_path, monkeypatch, embed_dtype, tied, act_order):
    """Every layer in one native call (q/k/v and gate/up apart where their input orders differ,
    each gathered as its weight wants) equal to the same step op by op, and the head (tied or
    not, any float dtype) on the native matmul, in the engine's decode steps."""
    from test_cpu_native import _check_native_layers

    from localllm import LLM, SamplingParams
    from localllm.kernels.cpu.ops import CpuOps
    from localllm.kernels.cpu.weights import NativeWeight
    from localllm.models.assembler import load_model

    monkeypatch.delenv("LOCALLLM_CPU_ACTIVATIONS", raising=False)
    path = _gptq_checkpoint(tmp_path, embed_dtype, tied, act_order)
    llm = LLM(model=str(path), device="cpu", dtype="float32", kv_cache_memory="8MiB")
    model, backend = llm.engine.model, llm.engine.backend
    plans = [backend.plan(layer) for layer in model.layers]
    assert all(plans), "every layer has its native plan"
    if act_order:  # every input gathered as its weight wants, but down's: its order is folded into gate/up's
        assert all(len(p.qkv) == 3 and len(p.gate_up) == 2 for p in plans)
        assert all(all(o is not None for o in p.perms[:-1]) and p.perms[-1] is None for p in plans)
    assert isinstance(model.lm_head.prepared(), NativeWeight)
    calls = []
    decoder_layers = CpuOps.decoder_layers

    def counted(self, layers, positions, h, kv_caches, meta, *norm):
        out = decoder_layers(self, layers, positions, h, kv_caches, meta, *norm)
        calls.append((meta.num_decodes == meta.num_seqs, out is not None))  # (decode-only step, one native call)
        return out

    monkeypatch.setattr(CpuOps, "decoder_layers", counted)
    llm.generate([[3, 17, 42, 9, 88], [5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    # decode steps, and (batch-invariant mode) steps of at most FUSED_LAYER_MAX_ROWS rows: every layer of
    # each of these in one native call
    assert (True, True) in calls and all(native for _, native in calls)
    _check_native_layers(load_model(path)[0])  # a decode step: hidden states, K/V, logits against op by op
