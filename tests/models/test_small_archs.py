"""SmolLM3 (NoPE layers) and Mistral 3 (llama 4's attention temperature) on tiny random models,
against transformers.

Each model is a Hugging Face directory written by transformers itself (``tests/tiny_hf_models.py``'s
``SMALL_ARCHS``) and the GGUF file llama.cpp's own ``convert_hf_to_gguf.py`` makes of it
(``tests/llamacpp_converter.py``): SmolLM3 with no RoPE on every fourth layer (the GGUF records
nothing: llama.cpp fixes that rule) and with a Hugging Face ``no_rope_layers`` list of its own;
Ministral 3 (YaRN, and queries scaled by ``1 + 0.1 ln(1 + floor(p / 16))``) as a causal LM and
inside ``Mistral3ForConditionalGeneration``, and that wrapper over a Mistral text model (Mistral
Small 3.x, no temperature). Logits at every position (one prefill, and chunked) and greedy
tokens match transformers on the reference backend and the CPU backend (tolerance ``ATOL``); on
the default CPU route (8-bit files, whole layers in one native call) a sequence's output has the
same bits whichever sequences share its steps, and the same bits as the layers run op by op.
"""

from __future__ import annotations

import json
import math

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
from tiny_hf_models import SMALL_ARCHS, write_tiny_hf_small_arch
from tiny_models import BOS_ID

from localllm import LLM
from localllm.errors import ModelLoadError
from localllm.kernels.cpu.ops import CpuOps
from localllm.models.gguf_file import read_gguf
from localllm.models.registry import config_from_gguf, config_from_hf, hf_text_tensor_name

ARCHITECTURE = {"smollm3": "smollm3", "smollm3-nope-list": "smollm3", "ministral3": "mistral3",
                "mistral3": "mistral3", "mistral3-mistral": "mistral3"}
# llama.cpp's GGUF cannot say which layers have no RoPE (its rule: every fourth): a list of
# other layers is Hugging Face only
HF_ONLY = {"smollm3-nope-list"}
CASES = [f"{name}-{fmt}" for name in SMALL_ARCHS for fmt in ("hf", "gguf") if fmt == "hf" or name not in HF_ONLY]
# the default CPU route's files: a NoPE layer and the attention temperature in the one native layer call
NATIVE = ["smollm3-q8_0", "ministral3-q8_0"]

_rng = np.random.default_rng(11)
# 36 tokens: positions in three steps of Ministral 3's attention temperature (0-15, 16-31, 32-)
PROMPT = [BOS_ID, *_rng.integers(0, 296, 35).tolist()]
BATCH_PROMPTS = [
    [BOS_ID, *_rng.integers(0, 296, 14).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 21).tolist()],
    [BOS_ID],
    [BOS_ID, *_rng.integers(0, 296, 9).tolist()],
]
BATCH_MAX_TOKENS = [24, 16, 20, 12]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> dict[str, object]:
    """case (``NAME-hf``, ``NAME-gguf``, ``NAME-q8_0``) -> path."""
    root = tmp_path_factory.mktemp("small-arch-models")
    paths: dict[str, object] = {}
    for seed, name in enumerate(SMALL_ARCHS):
        hf_dir = write_tiny_hf_small_arch(root / name, name, seed=seed)
        paths[f"{name}-hf"] = hf_dir
        paths[f"{name}-gguf"] = convert(hf_dir, root / f"{name}.gguf")
        if f"{name}-q8_0" in NATIVE:
            paths[f"{name}-q8_0"] = convert(hf_dir, root / f"{name}.q8_0.gguf", outtype="q8_0")
    return paths


_REFERENCES: dict[str, torch.nn.Module] = {}
_GENERATED: dict[str, list[int]] = {}
_LLMS: dict[tuple, LLM] = {}


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _LLMS.clear()
    _REFERENCES.clear()
    _GENERATED.clear()


def _name(case: str) -> str:
    return case.rsplit("-", 1)[0]


def reference(model_paths, case: str):
    """transformers' model of ``case``'s Hugging Face directory, by its own class (transformers
    has no causal-LM auto class for ``Mistral3ForConditionalGeneration``)."""
    import transformers

    name = _name(case)
    if name not in _REFERENCES:
        _REFERENCES[name] = load_reference(model_paths[f"{name}-hf"], getattr(transformers, SMALL_ARCHS[name][0]))
    return _REFERENCES[name]


def shared_llm(model_paths, case: str, kernels: str) -> LLM:
    if (case, kernels) not in _LLMS:
        _LLMS[case, kernels] = make_llm(model_paths[case], kernels=kernels)
    return _LLMS[case, kernels]


def _hf_text_config(ref):
    return ref.config.get_text_config()


@pytest.mark.parametrize("case", CASES)
def test_config_reads_nope_layers_and_temperature(case, model_paths):
    """The NoPE layers and the attention temperature as transformers' config has them (a GGUF
    file's NoPE layers: llama.cpp's every fourth layer, the only ones it can hold)."""
    config = shared_llm(model_paths, case, "torch").engine.model_config
    text = _hf_text_config(reference(model_paths, case))
    assert config.architecture == ARCHITECTURE[_name(case)]
    nope = [not flag for flag in getattr(text, "no_rope_layers", [1] * text.num_hidden_layers)]
    assert [not config.layer_rotates(i) for i in range(config.num_layers)] == nope
    rope = text.rope_parameters
    beta = rope.get("llama_4_scaling_beta") if text.model_type == "ministral3" else None
    if beta:
        assert config.attn_temperature_scale == pytest.approx(beta, rel=1e-7)
        assert config.attn_temperature_length == rope["original_max_position_embeddings"]
    else:
        assert config.attn_temperature_scale is None
    assert config.head_dim == (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    ref = reference(model_paths, case)
    tied = ref.lm_head.weight.data_ptr() == ref.get_input_embeddings().weight.data_ptr()
    assert config.tie_word_embeddings == tied


def test_a_smollm3_gguf_has_llama_cpps_nope_layers(model_paths):
    """SmolLM3's GGUF records no NoPE layers: whatever the Hugging Face config said, llama.cpp
    (and so localllm) leaves RoPE out of every fourth layer."""
    gf = read_gguf(model_paths["smollm3-nope-list-gguf"])
    config = config_from_gguf(gf.metadata, set(gf.tensors), "x.gguf")
    assert [config.layer_rotates(i) for i in range(4)] == [True, True, True, False]
    layers = shared_llm(model_paths, "smollm3-gguf", "torch").engine.model.layers
    assert [layer.attn.rope is None for layer in layers] == [(i + 1) % 4 == 0 for i in range(len(layers))]


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, kernels, model_paths):
    llm = shared_llm(model_paths, case, kernels)
    want = reference_logits(reference(model_paths, case), PROMPT)
    got, = paged_logits(llm, [PROMPT])
    assert_close(got, want, f"{case} ({kernels}), one prefill")
    got, = paged_logits(llm, [PROMPT], chunk=5)
    assert_close(got, want, f"{case} ({kernels}), chunked prefill")


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_matches_transformers(case, kernels, model_paths):
    llm = shared_llm(model_paths, case, kernels)
    ref = reference(model_paths, case)
    name = _name(case)
    if name not in _GENERATED:
        _GENERATED[name] = reference_generate(ref, PROMPT)
    want = _GENERATED[name]
    out = llm.generate([PROMPT], greedy())[0]
    assert out.token_ids == want, f"{case} ({kernels}): greedy tokens differ from transformers' generate"
    full = torch.log_softmax(reference_logits(ref, PROMPT + want), -1)
    want_lp = [full[len(PROMPT) - 1 + k, t].item() for k, t in enumerate(want)]
    np.testing.assert_allclose([lp.logprob for lp in out.outputs[0].logprobs], want_lp, rtol=0, atol=ATOL)


@pytest.mark.parametrize("case", NATIVE)
def test_batch_equals_alone_bit_for_bit(case, model_paths):
    """Chunked prefill (8 tokens a step) beside decodes: each sequence's tokens and log-probs are
    exactly those it gets alone, though its steps differ."""
    llm = native_llm(model_paths[case], max_num_batched_tokens=8, enable_prefix_caching=False)
    alone = [llm.generate([p], greedy(n))[0] for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)]
    together = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.token_ids == a.token_ids, f"prompt {i}"
        assert [lp.logprob for lp in b.outputs[0].logprobs] == [lp.logprob for lp in a.outputs[0].logprobs], i


class _Spy:
    """The native module, its calls recorded by name."""

    def __init__(self, module) -> None:
        self.module = module
        self.calls: list[str] = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append(name)
            return getattr(self.module, name)(*args, **kwargs)

        return call


@pytest.mark.parametrize("case", NATIVE)
def test_native_layers_equal_the_ops_one_by_one(case, model_paths, monkeypatch):
    """The default CPU route runs every step's layers (the prefill's too) in one native call,
    NoPE layers and the attention temperature included: the same tokens and log-probs, bit for
    bit, as those steps op by op."""
    llm = native_llm(model_paths[case], speculative="off", enable_prefix_caching=False)
    layers = llm.engine.model.layers
    if case.startswith("smollm3"):
        assert any(layer.attn.rope is None for layer in layers)
    else:
        assert all(layer.attn.temperature is not None for layer in layers)
    backend = llm.engine.backend
    spy = backend.native = _Spy(backend.native)
    prompts = [PROMPT, BATCH_PROMPTS[1]]
    params = [greedy(12), greedy(20)]
    native = llm.generate(prompts, params)
    assert spy.calls.count("decoder_layers") >= 20, spy.calls  # the prefill and 19 decode steps

    monkeypatch.setattr(CpuOps, "decoder_layers", lambda *args, **kwargs: None)
    monkeypatch.setattr(CpuOps, "decoder_layer", lambda *args, **kwargs: None)
    spy.calls.clear()
    by_ops = llm.generate(prompts, params)
    assert "rope_write_kv" in spy.calls and not {"decoder_layers", "decoder_layer"} & set(spy.calls), spy.calls
    for i, (a, b) in enumerate(zip(native, by_ops)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        assert [lp.logprob for lp in a.outputs[0].logprobs] == [lp.logprob for lp in b.outputs[0].logprobs], i


# --- what localllm refuses, by name --------------------------------------------------------------


def _hf_config(model_paths, name: str) -> tuple[dict, set[str]]:
    from safetensors import safe_open

    path = model_paths[f"{name}-hf"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(map(hf_text_tensor_name, f.keys()))
    return json.loads((path / "config.json").read_text()), names


def test_a_wrapped_text_model_of_another_type_names_itself(model_paths):
    cfg, names = _hf_config(model_paths, "mistral3")
    cfg["text_config"] = {**cfg["text_config"], "model_type": "llama"}
    with pytest.raises(ModelLoadError, match=r"text_config model_type 'llama' is not supported.*'mistral3'"):
        config_from_hf(cfg, names)
    del cfg["text_config"]
    with pytest.raises(ModelLoadError, match=r"'mistral3' needs a text_config"):
        config_from_hf(cfg, names)


def test_a_wrapped_text_model_without_a_type_is_mistral(model_paths):
    """As ``Mistral3Config``: a ``text_config`` with no ``model_type`` is a Mistral text model
    (no attention temperature); the wrapper's ``tie_word_embeddings`` is the one read."""
    cfg, names = _hf_config(model_paths, "mistral3-mistral")
    del cfg["text_config"]["model_type"]
    config, _ = config_from_hf(cfg, names)
    assert config.architecture == "mistral3" and config.attn_temperature_scale is None
    assert config.tie_word_embeddings
    cfg["tie_word_embeddings"] = False
    assert not config_from_hf(cfg, names)[0].tie_word_embeddings


def test_ministral3_without_its_temperature_settings_is_refused(model_paths):
    cfg, names = _hf_config(model_paths, "ministral3")
    del cfg["rope_parameters"]["llama_4_scaling_beta"]
    with pytest.raises(ModelLoadError, match=r"llama_4_scaling_beta"):
        config_from_hf(cfg, names)


def test_bad_nope_settings_are_refused(model_paths):
    cfg, names = _hf_config(model_paths, "smollm3")
    with pytest.raises(ModelLoadError, match=r"no_rope_layers"):
        config_from_hf({**cfg, "no_rope_layers": [1, 1, 0]}, names)
    del cfg["no_rope_layers"]
    with pytest.raises(ModelLoadError, match=r"no_rope_layer_interval"):
        config_from_hf({**cfg, "no_rope_layer_interval": 0}, names)
    config, _ = config_from_hf({**cfg, "no_rope_layer_interval": 3}, names)  # SmolLM3Config's own rule
    assert [config.layer_rotates(i) for i in range(8)] == [(i + 1) % 3 != 0 for i in range(8)]


def test_a_temperature_without_its_step_length_is_refused(model_paths):
    """llama.cpp refuses an attention temperature whose steps would span no position."""
    gf = read_gguf(model_paths["ministral3-gguf"])
    meta = {**gf.metadata, "mistral3.rope.scaling.original_context_length": 0}
    with pytest.raises(ModelLoadError, match=r"x\.gguf: .*original_context_length"):
        config_from_gguf(meta, set(gf.tensors), "x.gguf")
    # the file's own: the original context of its YaRN scaling
    config = config_from_gguf(gf.metadata, set(gf.tensors), "x.gguf")
    assert config.attn_temperature_length == gf.metadata["mistral3.rope.scaling.original_context_length"]
    factors = shared_llm(model_paths, "ministral3-gguf", "torch").engine.model.layers[0].attn.temperature.table
    step = config.attn_temperature_length
    for p in (0, step - 1, step, 2 * step + 1):
        want = 1 + config.attn_temperature_scale * math.log(1 + p // step)
        assert factors[p].item() == pytest.approx(want, rel=1e-7)
