"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) on tiny random models, against transformers.

Each family is a Hugging Face directory written by transformers itself (every layer a mixture of
experts, see ``tests/tiny_hf_models.py``'s ``MOE_DEFAULTS``) and the GGUF file llama.cpp's own
``convert_hf_to_gguf.py`` makes of it (``tests/llamacpp_converter.py``): Qwen3-MoE (8 experts,
top-3, renormalized, Q/K norms per head), Mixtral (a ``llama`` GGUF carrying 4 experts, top-2,
llama.cpp's permuted Q/K rows), OLMoE (8 experts, top-2, not renormalized, Q/K norms over all
heads). Logits at every position and greedy tokens match transformers on the reference backend
and the CPU backend (tolerance ``ATOL``); on the default (batch-invariant) CPU route a token's
output has the same bits whichever tokens share its step and its experts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llamacpp_converter import convert
from model_checks import (
    ATOL,
    assert_close,
    greedy,
    load_reference,
    make_llm,
    native_llm,
    paged_logits,
    reference_generate,
    reference_logits,
)
from tiny_hf_models import MOE_DEFAULTS, write_tiny_hf_moe
from tiny_models import BOS_ID

from localllm import LLM
from localllm.errors import ModelLoadError
from localllm.models.decoder import SparseMoE

ARCHITECTURE = {"qwen3_moe": "qwen3moe", "mixtral": "llama", "olmoe": "olmoe"}
CASES = [f"{model_type}-{fmt}" for model_type in MOE_DEFAULTS for fmt in ("hf", "gguf")]

_rng = np.random.default_rng(5)
PROMPT = [BOS_ID, *_rng.integers(0, 296, 19).tolist()]
BATCH_PROMPTS = [
    [BOS_ID, *_rng.integers(0, 296, 6).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 13).tolist()],
    [BOS_ID],
    [BOS_ID, *_rng.integers(0, 296, 9).tolist()],
]
BATCH_MAX_TOKENS = [10, 6, 10, 8]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> dict[str, object]:
    """case -> path, and ``("hf", model_type)`` -> the Hugging Face directory."""
    root = tmp_path_factory.mktemp("moe-models")
    paths: dict[str, object] = {}
    for seed, model_type in enumerate(MOE_DEFAULTS):
        hf_dir = write_tiny_hf_moe(root / model_type, model_type, seed=seed)
        paths[("hf", model_type)] = paths[f"{model_type}-hf"] = hf_dir
        paths[f"{model_type}-gguf"] = convert(hf_dir, root / f"{model_type}.gguf")
        paths[f"{model_type}-q8_0"] = convert(hf_dir, root / f"{model_type}.q8_0.gguf", outtype="q8_0")
    return paths


_REFERENCES: dict[str, torch.nn.Module] = {}
_LLMS: dict[tuple, LLM] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _LLMS.clear()
    _REFERENCES.clear()


def reference(model_paths, case: str):
    model_type = case.rsplit("-", 1)[0]
    if model_type not in _REFERENCES:
        _REFERENCES[model_type] = load_reference(model_paths[("hf", model_type)])
    return _REFERENCES[model_type]


def shared_llm(model_paths, case: str, kernels: str) -> LLM:
    if (case, kernels) not in _LLMS:
        _LLMS[case, kernels] = make_llm(model_paths[case], kernels=kernels)
    return _LLMS[case, kernels]


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, kernels, model_paths):
    llm = shared_llm(model_paths, case, kernels)
    config = llm.engine.model_config
    assert config.architecture == ARCHITECTURE[case.rsplit("-", 1)[0]]
    hf = reference(model_paths, case).config
    assert config.moe.num_experts == getattr(hf, "num_local_experts", None) or hf.num_experts
    assert config.moe.experts_per_token == hf.num_experts_per_tok
    want = reference_logits(reference(model_paths, case), PROMPT)
    got, = paged_logits(llm, [PROMPT])
    assert_close(got, want, f"{case} ({kernels}), one prefill")
    got, = paged_logits(llm, [PROMPT], chunk=5)
    assert_close(got, want, f"{case} ({kernels}), chunked prefill")


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("-gguf")])
def test_greedy_matches_transformers(case, kernels, model_paths):
    llm = shared_llm(model_paths, case, kernels)
    ref = reference(model_paths, case)
    want = reference_generate(ref, PROMPT)
    out = llm.generate([PROMPT], greedy())[0]
    assert out.token_ids == want, f"{case} ({kernels}): greedy tokens differ from transformers' generate"
    full = torch.log_softmax(reference_logits(ref, PROMPT + want), -1)
    want_lp = [full[len(PROMPT) - 1 + k, t].item() for k, t in enumerate(want)]
    np.testing.assert_allclose([lp.logprob for lp in out.outputs[0].logprobs], want_lp, rtol=0, atol=ATOL)


FILES = [f"{model_type}-{kind}" for model_type in MOE_DEFAULTS for kind in ("gguf", "q8_0")]


@pytest.mark.parametrize("case", FILES)
def test_batch_equals_alone_bit_for_bit(case, model_paths):
    """Chunked prefill (8 tokens a step) beside decodes: each sequence's tokens and log-probs are
    exactly those it gets alone, though its step (and each expert's tokens) differ."""
    llm = native_llm(model_paths[case], max_num_batched_tokens=8, enable_prefix_caching=False)
    alone = [llm.generate([p], greedy(n))[0] for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)]
    together = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.token_ids == a.token_ids, f"prompt {i}"
        assert [lp.logprob for lp in b.outputs[0].logprobs] == [lp.logprob for lp in a.outputs[0].logprobs], i


@pytest.mark.parametrize("case", FILES)
def test_grouped_experts_equal_each_token_alone(case, model_paths, monkeypatch):
    """A layer's experts over a batch of tokens (grouped by expert) give each token the bits it
    gets alone, and match a per-token float64 computation of the same routing. Quantized experts
    take the one native call per layer, whose bits are those of running the experts one by one.
    (Two activation passes: the route's float32-reference precision.)"""
    monkeypatch.setenv("LOCALLLM_CPU_ACTIVATIONS", "int8x2")
    llm = native_llm(model_paths[case])
    moe = next(layer.mlp for layer in llm.engine.model.layers if isinstance(layer.mlp, SparseMoE))
    x = torch.randn(9, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(3))
    together = moe(x)
    for t in range(x.shape[0]):
        assert torch.equal(moe(x[t:t + 1])[0], together[t]), f"token {t}"
    one_call = moe.ops.expert_plan(moe) is not None
    assert one_call == case.endswith("-q8_0")  # (F32 experts run one by one: torch's float32 route)
    if one_call:
        monkeypatch.setattr(moe.ops, "moe_experts", lambda *args: None)
        assert torch.equal(moe(x), together)
    weights, chosen = moe.route(x)
    for t in range(x.shape[0]):
        want = torch.zeros(x.shape[1], dtype=torch.float64)
        for w, e in zip(weights[t].tolist(), chosen[t].tolist()):
            expert = moe.experts[e]
            gate = expert.gate_proj.reference_forward(x[t:t + 1]).double()
            up = expert.up_proj.reference_forward(x[t:t + 1]).double()
            act = torch.nn.functional.silu(gate) * up
            want += w * expert.down_proj.reference_forward(act.float()).double()[0]
        torch.testing.assert_close(together[t].double(), want, atol=1e-3 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("model_type", [t for t in MOE_DEFAULTS if t != "olmoe"])  # (OLMoE: Q/K norms over all heads)
def test_layers_of_experts_decode_in_one_native_call_with_the_op_by_op_bits(model_type, tmp_path):
    """Quantized Qwen3-MoE and Mixtral layers (router, routing and experts included; heads of 32,
    as the native attention takes) have a native one-call plan. A prompt over 64 rows computed op
    by op alone and in 8-token chunks in one call each beside others gives each sequence the same
    tokens and log-probs, bit for bit; the native routing chooses torch's experts with its weights."""
    from localllm.kernels.cpu.ops import FUSED_LAYER_MAX_ROWS, layer_plan
    from localllm.kernels.cpu.options import CpuOptions

    heads = {"head_dim": 32} if model_type == "qwen3_moe" else {"hidden_size": 128}
    hf_dir = write_tiny_hf_moe(tmp_path / model_type, model_type, seed=7, **heads)
    path = convert(hf_dir, tmp_path / f"{model_type}.q8_0.gguf", outtype="q8_0")
    rng = np.random.default_rng(9)
    prompts = [*BATCH_PROMPTS[:3], [BOS_ID, *rng.integers(0, 296, FUSED_LAYER_MAX_ROWS + 15).tolist()]]
    max_tokens = [*BATCH_MAX_TOKENS[:3], 10]
    alone_llm = native_llm(path, max_num_batched_tokens=256, enable_prefix_caching=False)
    layers = alone_llm.engine.model.layers
    assert all(layer_plan(layer, CpuOptions()) is not None for layer in layers)
    alone = [alone_llm.generate([p], greedy(n))[0] for p, n in zip(prompts, max_tokens)]
    together = native_llm(path, max_num_batched_tokens=8, enable_prefix_caching=False).generate(
        prompts, [greedy(n) for n in max_tokens])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.token_ids == a.token_ids, f"prompt {i}"
        assert [lp.logprob for lp in b.outputs[0].logprobs] == [lp.logprob for lp in a.outputs[0].logprobs], i
    moe = layers[0].mlp
    x = torch.randn(7, moe.router.in_features, generator=torch.Generator().manual_seed(4))
    native = moe.ops.moe_route(moe, x)
    assert native is not None
    logits = moe.router.base.reference_forward(x).double()
    top, chosen = torch.topk(torch.softmax(logits, -1), moe.top_k, dim=-1)
    want = top / top.sum(-1, keepdim=True) if moe.norm_topk_prob else top
    assert torch.equal(native[1], chosen)
    torch.testing.assert_close(native[0].double(), want, atol=1e-6, rtol=0)


def test_parameter_counts_match_transformers(model_paths):
    for model_type in MOE_DEFAULTS:
        llm = shared_llm(model_paths, f"{model_type}-gguf", "torch")
        total, active = llm.engine.model_config.parameter_counts()
        ref = reference(model_paths, f"{model_type}-hf")
        norms = sum(p.numel() for n, p in ref.named_parameters() if "norm" in n)
        assert total == ref.num_parameters() - norms, model_type
        moe = llm.engine.model_config.moe
        expert = 3 * moe.expert_intermediate_size * llm.engine.model_config.hidden_size
        assert total - active == llm.engine.model_config.num_layers * (moe.num_experts - moe.experts_per_token) * expert


def _rewritten(src_path, out, metadata: dict | None = None, tensors: dict | None = None):
    """A copy of GGUF file ``src_path`` at ``out`` with the key/values ``metadata`` (an int: uint32)
    and the float32 tensors ``tensors`` set."""
    import gguf

    from localllm.models.gguf_file import read_gguf

    src = read_gguf(src_path)
    writer = gguf.GGUFWriter(str(out), src.metadata["general.architecture"])
    values = {k: v for k, v in src.metadata.items() if k != "general.architecture" and not k.startswith("GGUF.")}
    values.update(metadata or {})
    for key, value in values.items():
        if isinstance(value, (list, tuple)) or hasattr(value, "__len__") and not isinstance(value, str):
            writer.add_array(key, list(value))
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, str(value))
    for name, t in src.tensors.items():
        writer.add_tensor(name, np.asarray(t.data), raw_dtype=t.qtype)
    for name, values in (tensors or {}).items():
        writer.add_tensor(name, np.asarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_bad_expert_count_names_itself(model_paths, tmp_path):
    out = _rewritten(model_paths["qwen3_moe-gguf"], tmp_path / "bad.gguf", {"qwen3moe.expert_used_count": 9})  # of 8
    with pytest.raises(ModelLoadError, match=r"expert_used_count 9"):
        LLM(model=str(out), device="cpu", kernels="torch", kv_cache_memory="8MiB")


# ---------------------------------------------------------------------------------------------
# Sigmoid gating (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID, transformers' scoring_func)


def _sigmoid_reference(logits, k, bias=None, norm=True, scale=1.0):
    """llama.cpp's ``build_moe_ffn`` for sigmoid gating, in float64: the scores, the top ``k`` by
    score + ``bias``, their unbiased scores, renormalized (sum clamped at float16's least normal)
    and scaled."""
    scores = torch.sigmoid(logits.double())
    selection = scores if bias is None else scores + bias.double()
    chosen = torch.argsort(selection, dim=-1, descending=True, stable=True)[:, :k]
    weights = scores.gather(-1, chosen)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
    return weights * scale, chosen


def _sigmoid_moe(num_experts=8, k=3, bias=None, norm=True, scale=1.0, hidden=32, seed=0) -> SparseMoE:
    from localllm.models.config import MoeConfig
    from localllm.models.decoder import MLP
    from localllm.quant.linear import QuantLinear

    gen = torch.Generator().manual_seed(seed)
    router = QuantLinear(torch.randn(num_experts, hidden, generator=gen), 0, hidden, num_experts)  # F32

    def linear(n, m):
        return QuantLinear(torch.randn(n, m, generator=gen) * 0.1, 0, m, n)

    experts = [MLP(linear(16, hidden), linear(16, hidden), linear(hidden, 16)) for _ in range(num_experts)]
    config = MoeConfig(num_experts, k, 16, norm, gating="sigmoid", weights_scale=scale)
    return SparseMoE(router, experts, config, selection_bias=bias)


@pytest.mark.parametrize("norm,scale", [(True, 1.0), (True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sigmoid_route_matches_a_hand_written_reference(norm, scale, with_bias):
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(8, generator=gen) * 0.5 if with_bias else None
    moe = _sigmoid_moe(bias=bias, norm=norm, scale=scale)
    x = torch.randn(11, 32, generator=gen)
    weights, chosen = moe.route(x)
    want_w, want_c = _sigmoid_reference(moe.router(x), 3, bias, norm, scale)
    assert torch.equal(chosen, want_c)
    torch.testing.assert_close(weights.double(), want_w, atol=1e-6, rtol=1e-6)
    y = moe(x)  # the experts one by one with those weights
    want = torch.zeros(11, 32, dtype=torch.float64)
    for t in range(11):
        for w, e in zip(want_w[t].tolist(), want_c[t].tolist()):
            want[t] += w * moe.experts[e](x[t:t + 1]).double()[0]
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)


def test_the_selection_bias_moves_the_choice_not_the_weights():
    """llama.cpp's ``exp_probs_b``: an expert whose score is the lowest is chosen once its bias
    lifts it above the others, and weighs its own sigmoid score; a bias the same for every expert
    changes nothing."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 32, generator=gen)
    plain = _sigmoid_moe()
    scores = torch.sigmoid(plain.router(x))
    w0, c0 = plain.route(x)
    same = _sigmoid_moe(bias=torch.full((8,), 0.75))
    w1, c1 = same.route(x)
    assert torch.equal(c1, c0) and torch.equal(w1, w0)
    last = scores.argmin(dim=-1)  # each token's least expert
    for t in range(6):
        bias = torch.zeros(8)
        bias[last[t]] = 2.0  # above any sigmoid's lead
        moe = _sigmoid_moe(bias=bias)
        weights, chosen = moe.route(x[t:t + 1])
        assert chosen[0, 0] == last[t]
        kept = scores[t, chosen[0]]
        torch.testing.assert_close(weights[0], kept / kept.sum())
        assert set(chosen[0, 1:].tolist()) <= set(c0[t].tolist())  # the others: the best unbiased ones


def test_sigmoid_gating_reads_from_gguf_and_hf_configs(model_paths, tmp_path):
    import json

    from localllm.models.registry import config_from_hf

    hf_dir = model_paths[("hf", "qwen3_moe")]
    cfg = json.loads((hf_dir / "config.json").read_text())
    names = {"model.layers.0.mlp.experts.0.gate_proj.weight"}
    assert config_from_hf(cfg, names)[0].moe.gating == "softmax"
    assert config_from_hf({**cfg, "scoring_func": "sigmoid"}, names)[0].moe.gating == "sigmoid"
    with pytest.raises(ModelLoadError, match=r"scoring function 'sqrt_softplus' is not supported"):
        config_from_hf({**cfg, "scoring_func": "sqrt_softplus"}, names)
    bad = _rewritten(model_paths["qwen3_moe-gguf"], tmp_path / "bad.gguf", {"qwen3moe.expert_gating_func": 4})
    with pytest.raises(ModelLoadError, match=r"expert gating function 4 is not supported \(1: softmax, 2: sigmoid"):
        LLM(model=str(bad), device="cpu", kernels="torch", kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def sigmoid_gguf(model_paths, tmp_path_factory):
    """The Q8_0 Qwen3-MoE file with sigmoid gating and an expert selection bias per layer
    (``blk.N.exp_probs_b.bias``), as llama.cpp's converter writes a DeepSeek-V3-style router."""
    from localllm.models.gguf_file import read_gguf

    src = model_paths["qwen3_moe-q8_0"]
    meta = read_gguf(src).metadata
    layers, experts = meta["qwen3moe.block_count"], meta["qwen3moe.expert_count"]
    rng = np.random.default_rng(7)
    biases = {f"blk.{i}.exp_probs_b.bias": rng.normal(0, 0.3, experts) for i in range(layers)}
    path = tmp_path_factory.mktemp("sigmoid") / "sigmoid.gguf"
    return _rewritten(src, path, {"qwen3moe.expert_gating_func": 2}, biases), biases


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_sigmoid_gated_file_routes_as_llama_cpp(sigmoid_gguf, kernels, monkeypatch):
    """A file's sigmoid gating and selection biases reach every layer; each layer routes as the
    hand-written reference, and its experts (the CPU backend: one native call) have the bits of
    the experts run one by one; on a batch-invariant route a token's bits do not depend on its batch.
    Greedy tokens match the reference backend's."""
    path, biases = sigmoid_gguf
    llm = make_llm(path, kernels=kernels)
    assert llm.engine.model_config.moe.gating == "sigmoid"
    layers = [layer.mlp for layer in llm.engine.model.layers]
    x = torch.randn(9, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(3))
    for i, moe in enumerate(layers):
        assert moe.gating == "sigmoid"
        bias = torch.tensor(biases[f"blk.{i}.exp_probs_b.bias"], dtype=torch.float32)
        assert torch.equal(moe.selection_bias, bias)
        weights, chosen = moe.route(x)
        want_w, want_c = _sigmoid_reference(moe.ops.linear(moe.router, x).float(), moe.top_k, bias,
                                            moe.norm_topk_prob, moe.weights_scale)
        assert torch.equal(chosen, want_c)
        torch.testing.assert_close(weights.double(), want_w, atol=1e-6, rtol=1e-6)
    moe = layers[0]
    together = moe(x)
    if llm.engine.backend.batch_invariant:  # (the reference backend's torch matmuls are not)
        for t in range(x.shape[0]):
            assert torch.equal(moe(x[t:t + 1])[0], together[t]), f"token {t}"
    if kernels == "cpu" and moe.ops.expert_plan(moe) is not None:
        monkeypatch.setattr(moe.ops, "moe_experts", lambda *args: None)
        assert torch.equal(moe(x), together)
    want = llm.generate([PROMPT], greedy(4))[0].token_ids
    reference_llm = shared_sigmoid_reference(path)
    assert reference_llm.generate([PROMPT], greedy(4))[0].token_ids == want


_SIGMOID_REFERENCE: dict = {}


def shared_sigmoid_reference(path) -> LLM:
    if path not in _SIGMOID_REFERENCE:
        _SIGMOID_REFERENCE.clear()
        _SIGMOID_REFERENCE[path] = make_llm(path, kernels="torch")
    return _SIGMOID_REFERENCE[path]


def test_show_counts_total_and_active_parameters(model_paths):
    """``localllm show`` of a mixture of experts: every weight, and those a token reads (its
    experts_per_token of each layer's experts), as the loaded model counts them."""
    from typer.testing import CliRunner

    from localllm.cli.commands import app
    from localllm.store.info import gguf_metadata

    for model_type in MOE_DEFAULTS:
        path = model_paths[f"{model_type}-gguf"]
        meta = gguf_metadata(path)
        config = shared_llm(model_paths, f"{model_type}-gguf", "torch").engine.model_config
        total, active = config.parameter_counts()
        assert meta["parameters"] - meta["active_parameters"] == total - active > 0, model_type
        shown = CliRunner().invoke(app, ["show", str(path)])
        assert shown.exit_code == 0, shown.output
        assert " active)" in shown.stdout, shown.stdout


def test_the_memory_plan_counts_every_expert(model_paths):
    """A mixture's file is planned at every expert's bytes (all are held, whichever a token reads):
    where they do not fit, the plan says so with the figures (the pool's 507), before any load."""
    from gguf import GGUFReader

    from localllm.serving.planner import plan_load, read_model_facts

    path = model_paths["qwen3_moe-q8_0"]
    facts = read_model_facts(path)
    experts = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors if "_exps" in t.name)
    assert experts > facts.tensor_bytes / 2
    assert facts.tensor_bytes == sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    plan = plan_load(facts, kv_cache_memory=1 << 20, free_bytes=facts.tensor_bytes // 2)
    assert not plan.fits and plan.weights_bytes == facts.tensor_bytes
    assert "needs" in plan.summary() and "is free" in plan.summary()
