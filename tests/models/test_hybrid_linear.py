"""Hybrid models of Gated DeltaNet and attention layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on tiny
random models, against transformers.

Each family is a Hugging Face directory written by transformers itself (four layers, linear
attention and full attention in turn; two key heads serving four value heads; see
``tests/tiny_hf_models.py``'s ``HYBRID_DEFAULTS``) and the GGUF file llama.cpp's own
``convert_hf_to_gguf.py`` makes of it (``tests/llamacpp_converter.py``): Qwen3-Next (its
Hugging Face ``in_proj_qkvz`` / ``in_proj_ba`` per key head, the GGUF's ``attn_qkv`` and
``attn_gate``; experts with a gated shared expert), Qwen3.5 (dense; the GGUF's value heads tiled
over the key heads), Qwen3.5-MoE. Logits at every position (one prefill, and chunked prefill,
which carries each sequence's recurrent state from chunk to chunk) match transformers on the
reference backend and the CPU backend (tolerance ``ATOL``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llamacpp_converter import convert
from model_checks import assert_close, load_reference, make_llm, paged_logits, reference_logits
from tiny_hf_models import HYBRID_DEFAULTS, write_tiny_hf_hybrid
from tiny_models import BOS_ID

from localllm import LLM

ARCHITECTURE = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}
CASES = [f"{model_type}-{fmt}" for model_type in HYBRID_DEFAULTS for fmt in ("hf", "gguf")]

_rng = np.random.default_rng(7)
PROMPT = [BOS_ID, *_rng.integers(0, 296, 19).tolist()]


@pytest.fixture(scope="module", autouse=True)
def _isolated_home_and_one_thread(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("localllm-home")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> dict[str, object]:
    """case -> path: ``{model_type}-hf`` and ``-gguf`` (F32)."""
    root = tmp_path_factory.mktemp("hybrid-models")
    paths: dict[str, object] = {}
    for seed, model_type in enumerate(HYBRID_DEFAULTS):
        hf_dir = write_tiny_hf_hybrid(root / model_type, model_type, seed=seed)
        paths[f"{model_type}-hf"] = hf_dir
        paths[f"{model_type}-gguf"] = convert(hf_dir, root / f"{model_type}.gguf", extra_args=("--no-mtp",))
    return paths


_REFERENCES: dict[str, torch.nn.Module] = {}
_LLMS: dict[tuple, LLM] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _LLMS.clear()
    _REFERENCES.clear()


def model_type_of(case: str) -> str:
    return case.rsplit("-", 1)[0]


def reference(model_paths, case: str):
    model_type = model_type_of(case)
    if model_type not in _REFERENCES:
        _REFERENCES[model_type] = load_reference(model_paths[f"{model_type}-hf"])
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
    hf = reference(model_paths, case).config
    assert config.architecture == ARCHITECTURE[model_type_of(case)]
    assert config.linear_layers == tuple(t == "linear_attention" for t in hf.layer_types)
    assert any(config.linear_layers) and not all(config.linear_layers)
    la = config.linear_attention
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim, la.conv_kernel) == (
        hf.linear_num_key_heads, hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim)
    # llama.cpp's converter tiles Qwen3.5's value heads over the key heads; Qwen3-Next's stay grouped
    assert la.value_heads_tiled == (case.endswith("-gguf") and case.startswith("qwen3_5"))
    assert config.rope_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    if config.moe is not None:
        assert config.moe.shared_intermediate_size == hf.shared_expert_intermediate_size and config.moe.shared_gate
    want = reference_logits(reference(model_paths, case), PROMPT)
    got, = paged_logits(llm, [PROMPT])
    assert_close(got, want, f"{case} ({kernels}), one prefill")
    got, = paged_logits(llm, [PROMPT], chunk=6)
    assert_close(got, want, f"{case} ({kernels}), chunked prefill")


def test_parameter_counts_match_transformers(model_paths):
    for model_type in HYBRID_DEFAULTS:
        config = shared_llm(model_paths, f"{model_type}-gguf", "torch").engine.model_config
        ref = reference(model_paths, f"{model_type}-hf")
        norms = sum(p.numel() for n, p in ref.named_parameters() if "norm" in n)
        total, active = config.parameter_counts()
        assert total == ref.num_parameters() - norms, model_type
        if config.moe is not None:
            expert = 3 * config.moe.expert_intermediate_size * config.hidden_size
            unused = config.num_layers * (config.moe.num_experts - config.moe.experts_per_token) * expert
            assert total - active == unused
