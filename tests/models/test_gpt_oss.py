"""gpt-oss on a tiny random ``GptOssForCausalLM`` (``tests/tiny_gpt_oss.py``), against transformers.

Three files of one architecture: the Hugging Face directory transformers writes, the GGUF file
llama.cpp's own ``convert_hf_to_gguf.py`` makes of it (float32 experts, split into gate and up
from transformers' interleaved ``gate_up_proj``), and the GGUF file the converter makes of the
same model with its experts in MXFP4 (OpenAI's checkpoint layout, repacked by the converter into
GGUF MXFP4 blocks), held to transformers run on those MXFP4 weights as transformers dequantizes
them. The model alternates sliding-window (8) and full layers, has a sink logit per head,
biases on Q/K/V, the output, the router and every expert, a router that keeps the top-2 logits
and takes a softmax over them, the clamped SwiGLU (alpha 1.702, limit 7) and YaRN over a
16-token original context; prompts are longer than the window and the original context.

Logits at every position (one prefill and chunked) and greedy tokens with their log-probs match
transformers (eager attention) on the reference backend and the CPU backend (``ATOL``; the MXFP4
experts' native kernels on int8 activations: ``MXFP4_CPU_ATOL``), logits on the Triton kernels too
(interpreted here); on the default (batch-invariant) CPU route a sequence's tokens and log-probs
have the same bits alone and beside others, and a layer's MXFP4 experts in the one native call
have the bits of the experts run one by one.
"""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton: its kernels run interpreted

import numpy as np
import torch
from gguf import GGMLQuantizationType
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
from tiny_gpt_oss import ORIGINAL_CONTEXT, SLIDING_WINDOW, write_tiny_gpt_oss, write_tiny_gpt_oss_mxfp4
from tiny_models import BOS_ID

from localllm import LLM
from localllm.errors import ModelLoadError
from localllm.kernels.cpu.weights import NativeWeight
from localllm.models.decoder import SparseMoE
from localllm.quant.gguf_dequant import dequantize
from localllm.quant.traits import TRAITS

T = GGMLQuantizationType
CASES = ["hf", "gguf", "mxfp4"]

# The MXFP4 experts on the CPU route multiply int8 activation codes (two passes: about 2^-14 of each
# 32-group's largest value) into gate/up outputs made large on purpose (past the clamp, |x| ~ 5):
# logits within 7e-4 of transformers' (log-probs 3e-4), against the float routes' ATOL.
MXFP4_CPU_ATOL = 2e-3


def _atol(case: str, kernels: str) -> float:
    return MXFP4_CPU_ATOL if (case, kernels) == ("mxfp4", "cpu") else ATOL


_rng = np.random.default_rng(11)
PROMPT = [BOS_ID, *_rng.integers(0, 296, 24).tolist()]  # past the window and the original context
BATCH_PROMPTS = [
    [BOS_ID, *_rng.integers(0, 296, 6).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 13).tolist()],
    [BOS_ID],
    [BOS_ID, *_rng.integers(0, 296, 10).tolist()],
]
BATCH_MAX_TOKENS = [12, 6, 12, 8]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, object]:
    """case -> the file localllm loads; ``("ref", case)`` -> the directory transformers runs."""
    root = tmp_path_factory.mktemp("gpt-oss")
    hf = write_tiny_gpt_oss(root / "hf", seed=3)
    mxfp4_dir, dequantized = write_tiny_gpt_oss_mxfp4(root / "hf-mxfp4", root / "hf-dequantized", seed=4)
    return {
        "hf": hf, "gguf": convert(hf, root / "gpt-oss.gguf"),
        "mxfp4": convert(mxfp4_dir, root / "gpt-oss-mxfp4.gguf"), "mxfp4-hf": mxfp4_dir,
        ("ref", "hf"): hf, ("ref", "gguf"): hf, ("ref", "mxfp4"): dequantized,
    }


_REFERENCES: dict[object, torch.nn.Module] = {}
_LLMS: dict[tuple, LLM] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _LLMS.clear()
    _REFERENCES.clear()


def reference(paths, case: str):
    where = paths[("ref", case)]
    if where not in _REFERENCES:
        _REFERENCES[where] = load_reference(where)
    return _REFERENCES[where]


def shared_llm(paths, case: str, kernels: str) -> LLM:
    if (case, kernels) not in _LLMS:
        _LLMS[case, kernels] = make_llm(paths[case], kernels=kernels)
    return _LLMS[case, kernels]


@pytest.mark.parametrize("case", CASES)
def test_config_has_every_gpt_oss_feature(case, paths):
    config = shared_llm(paths, case, "torch").engine.model_config
    hf = reference(paths, case).config
    assert config.architecture == "gpt-oss"
    assert config.sliding_window == SLIDING_WINDOW
    assert config.sliding_layers == tuple(t == "sliding_attention" for t in hf.layer_types) == (True, False) * 2
    assert config.attention_sinks and config.qkv_bias
    assert (config.activation, config.swiglu_alpha, config.swiglu_limit) == ("swiglu_oai", 1.702, 7.0)
    moe = config.moe
    assert (moe.num_experts, moe.experts_per_token, moe.gating, moe.norm_topk_prob) == (4, 2, "softmax_weight", False)
    rope = config.rope_scaling
    assert (rope.kind, rope.factor, rope.original_max_positions) == ("yarn", 8.0, ORIGINAL_CONTEXT)
    # transformers keeps YaRN's ramp ends as they are (truncate: false); llama.cpp rounds them
    assert rope.truncate == (case != "hf")


def test_the_layers_hold_transformers_weights(paths):
    """The sinks, the norm before the experts (``post_attention_layernorm``) and the experts'
    gate/up (even/odd columns of ``gate_up_proj``) with their biases, from either file."""
    ref = reference(paths, "gguf").model
    for case in ("hf", "gguf"):
        model = shared_llm(paths, case, "torch").engine.model
        for layer, theirs in zip(model.layers, ref.layers):
            assert torch.equal(layer.attn.sinks.data, theirs.self_attn.sinks.data)
            assert torch.equal(layer.post_norm.weight.data, theirs.post_attention_layernorm.weight.data)
            experts = theirs.mlp.experts
            for e, expert in enumerate(layer.mlp.experts):
                x = torch.randn(3, 64, generator=torch.Generator().manual_seed(e))
                gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
                torch.testing.assert_close(expert.gate_proj(x), gate_up[:, ::2], rtol=0, atol=1e-5)
                torch.testing.assert_close(expert.up_proj(x), gate_up[:, 1::2], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, kernels, paths):
    llm = shared_llm(paths, case, kernels)
    want = reference_logits(reference(paths, case), PROMPT)
    got, = paged_logits(llm, [PROMPT])
    assert_close(got, want, f"{case} ({kernels}), one prefill", _atol(case, kernels))
    got, = paged_logits(llm, [PROMPT], chunk=5)
    assert_close(got, want, f"{case} ({kernels}), chunked prefill", _atol(case, kernels))


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_matches_transformers(case, kernels, paths):
    llm = shared_llm(paths, case, kernels)
    ref = reference(paths, case)
    want = reference_generate(ref, PROMPT)
    out = llm.generate([PROMPT], greedy())[0]
    assert out.token_ids == want, f"{case} ({kernels}): greedy tokens differ from transformers' generate"
    full = torch.log_softmax(reference_logits(ref, PROMPT + want), -1)
    want_lp = [full[len(PROMPT) - 1 + k, t].item() for k, t in enumerate(want)]
    np.testing.assert_allclose([lp.logprob for lp in out.outputs[0].logprobs], want_lp, rtol=0,
                               atol=_atol(case, kernels))


@pytest.mark.parametrize("case", ["gguf", "mxfp4"])
def test_logits_match_transformers_on_triton(case, paths):
    """The Triton kernels (interpreted on a CPU): sinks and windows in the paged attention, the
    clamped SwiGLU's kernel, MXFP4 experts on the reference's dequantization (no Triton kernel)."""
    pytest.importorskip("triton", reason="triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels interpreted (TRITON_INTERPRET=1)")
    llm = make_llm(paths[case], kernels="triton")
    want = reference_logits(reference(paths, case), PROMPT)
    got, = paged_logits(llm, [PROMPT], chunk=9)
    assert_close(got, want, f"{case} (triton), chunked prefill")


def _without(model, what: str):
    """Undo one gpt-oss feature in ``model`` (in place): sinks, windows, the clamp or the router's
    softmax over the kept experts (a softmax over all of them instead)."""
    for layer in model.layers:
        if what == "sinks":
            layer.attn._extras.pop("sinks")
        elif what == "window":
            layer.attn._extras.pop("sliding_window", None)
        elif what == "clamp":
            for expert in layer.mlp.experts:
                expert.limit = float("inf")
        else:
            layer.mlp.gating = "softmax"


@pytest.mark.parametrize("feature", ["sinks", "window", "clamp", "router"])
def test_each_feature_moves_the_logits(feature, paths):
    """The tiny model exercises every feature the comparisons above hold: without it, localllm's
    logits are far from transformers'."""
    llm = make_llm(paths["gguf"], kernels="torch")
    want = reference_logits(reference(paths, "gguf"), PROMPT)
    _without(llm.engine.model, feature)
    got, = paged_logits(llm, [PROMPT])
    assert (got.double() - want).abs().max().item() > 100 * ATOL, feature


def test_mxfp4_experts_are_transformers_dequantized_weights(paths):
    """The converter's MXFP4 blocks, dequantized here, are the weights transformers' MXFP4
    integration gives (bit for bit: powers of two times E2M1 values)."""
    model = shared_llm(paths, "mxfp4", "torch").engine.model
    ref = reference(paths, "mxfp4").model
    for layer, theirs in zip(model.layers, ref.layers):
        experts = theirs.mlp.experts
        for e, expert in enumerate(layer.mlp.experts):
            for linear, want in ((expert.gate_proj, experts.gate_up_proj[e][:, ::2].T),
                                 (expert.up_proj, experts.gate_up_proj[e][:, 1::2].T),
                                 (expert.down_proj, experts.down_proj[e].T)):
                assert linear.qtype == T.MXFP4
                assert torch.equal(dequantize(linear.raw, T.MXFP4), want)


@pytest.mark.parametrize("case", ["gguf", "mxfp4"])
def test_batch_equals_alone_bit_for_bit(case, paths):
    """Chunked prefill (8 tokens a step) beside decodes: each sequence's tokens and log-probs are
    exactly those it gets alone, though its steps (their rows, each expert's tokens, the prompt's
    cuts) differ."""
    llm = native_llm(paths[case], max_num_batched_tokens=8, enable_prefix_caching=False)
    alone = [llm.generate([p], greedy(n))[0] for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)]
    together = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.token_ids == a.token_ids, f"prompt {i}"
        assert [lp.logprob for lp in b.outputs[0].logprobs] == [lp.logprob for lp in a.outputs[0].logprobs], i


def test_cpu_route_takes_what_it_has_natively(paths):
    """On the CPU backend no layer runs the native whole-layer call (sinks, windows), and the MXFP4
    experts (clamped SwiGLU, biases on gate, up and down) are held in their native format at the
    file's bytes, each layer's experts run by the one native experts call."""
    llm = native_llm(paths["mxfp4"])
    ops = llm.engine.model.ops
    for layer in llm.engine.model.layers:
        assert not layer.llama_layout
        assert isinstance(layer.mlp, SparseMoE)
        plan = ops.expert_plan(layer.mlp)
        assert plan is not None and plan.activation == "swiglu_oai" and (plan.alpha, plan.limit) == (1.702, 7.0)
        assert plan.gate_up_bias is not None and plan.down_bias is not None
        assert plan.gate_up_bits == plan.down_bits == TRAITS[T.MXFP4].cpu_format
        for expert in layer.mlp.experts:
            down = expert.down_proj.prepared()
            assert isinstance(down, NativeWeight) and down.nbytes == expert.down_proj.base.raw.numel()


def test_native_experts_call_equals_the_experts_one_by_one(paths, monkeypatch):
    """A layer's MXFP4 experts in the one native call (tokens grouped by expert, the biases and the
    clamped SwiGLU inside it) give every token the bits it gets alone and the bits of the layer's
    experts run one by one (each a native MXFP4 matmul, its bias added, the native clamped SwiGLU);
    one and two activation passes."""
    for passes in ("int8", "int8x2"):
        monkeypatch.setenv("LOCALLLM_CPU_ACTIVATIONS", passes)
        llm = native_llm(paths["mxfp4"])
        model = llm.engine.model
        x = torch.randn(11, llm.engine.model_config.hidden_size, generator=torch.Generator().manual_seed(5))
        native_call = model.ops.moe_experts
        for layer in model.layers:
            moe, calls = layer.mlp, []

            def spy(*args, calls=calls, native_call=native_call):
                calls.append(args)
                return native_call(*args)

            monkeypatch.setattr(model.ops, "moe_experts", spy)
            together = moe(x)
            assert calls, "the experts did not take the native call"
            for t in (0, 4, 10):
                assert torch.equal(moe(x[t:t + 1])[0], together[t]), f"token {t}"
            monkeypatch.setattr(model.ops, "moe_experts", lambda *args: None)
            assert torch.equal(moe(x), together), passes


def test_a_hugging_face_mxfp4_checkpoint_is_refused_by_name(paths):
    with pytest.raises(ModelLoadError, match="mxfp4"):
        LLM(model=str(paths["mxfp4-hf"]), device="cpu", kernels="torch", kv_cache_memory="8MiB")


def test_gguf_sliding_window_pattern_as_llama_cpp_reads_it(paths):
    """``gpt-oss.attention.sliding_window_pattern``: absent, every other layer from layer 0; a
    period whose last layer is global; a flag per layer."""
    from localllm.models.gguf_file import read_gguf
    from localllm.models.registry import config_from_gguf

    gf = read_gguf(paths["gguf"])
    meta, names = dict(gf.metadata), set(gf.tensors)
    assert config_from_gguf(meta, names).sliding_layers == (True, False, True, False)
    meta["gpt-oss.attention.sliding_window_pattern"] = 4
    assert config_from_gguf(meta, names).sliding_layers == (True, True, True, False)
    meta["gpt-oss.attention.sliding_window_pattern"] = [False, True, True, False]
    assert config_from_gguf(meta, names).sliding_layers == (False, True, True, False)
    meta["gpt-oss.attention.sliding_window_pattern"] = [True]
    with pytest.raises(ModelLoadError, match="one flag per layer"):
        config_from_gguf(meta, names, "x.gguf")


def test_show_names_the_architecture(paths):
    from typer.testing import CliRunner

    from localllm.cli import app

    result = CliRunner().invoke(app, ["show", str(paths["mxfp4"]), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["gguf"]["architecture"] == "gpt-oss"
    result = CliRunner().invoke(app, ["show", str(paths["mxfp4"])])
    assert result.exit_code == 0 and "gpt-oss" in result.stdout and "MXFP4" in result.stdout
