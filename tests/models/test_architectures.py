"""gemma2, gemma3 and phi3 on tiny random models (tests/tiny_hf_models.py), against transformers.

Each variant is a Hugging Face directory written by transformers itself and the GGUF file that
``write_gguf_from_hf`` makes of it the way llama.cpp's convert_hf_to_gguf.py does (checked once
against the real converter: the same keys, values and tensors). What the variants exercise:

* gemma2: attention and final logit softcapping (50 / 30), alternating sliding-window (8) and
  global layers, sandwich norms, ``(1 + w)`` norms (random w), embeddings scaled by
  sqrt(hidden), GELU-tanh, tied head, head_dim 32 != hidden / heads = 16 (the query scale is
  ``query_pre_attn_scalar ** -0.5`` = ``head_dim ** -0.5``, all llama.cpp's GGUF can express).
* gemma3: Q/K norms, 7 layers with sliding-window pattern 6 (layer 5 global), local RoPE base
  1e4 on sliding layers, global base 1e6 with linear scaling x8 on the global layer only.
* ``*-qpas24`` (Hugging Face only): ``query_pre_attn_scalar`` 24, neither head_dim nor
  hidden / heads.
* phi3: fused ``qkv_proj`` / ``gate_up_proj``, untied head, LongRoPE (short/long factors, original
  context 32 of 128, attention factor sqrt(1 + ln 4 / ln 32)); ``phi3-partial-rotary``: RoPE on
  half of each head (partial_rotary_factor 0.5).

The prompts (24 tokens) are longer than the sliding window and cross KV blocks of 4 tokens.
LongRoPE: transformers picks short or long factors by the current sequence length (all positions
long once the sequence is longer than the original context, and in ``generate`` it switches in
mid-sequence, keeping the keys cached with short ones), localllm per position (short below the
original context, long from there on, as its RopeScaling documents). They agree while the whole
sequence fits in the original context, so phi3's prompts plus continuations stay within 32
tokens; ``test_phi3_long_positions`` checks localllm's per-position rule past that against
transformers' layers fed the per-position rotary table.

Tolerance: ``ATOL = 1e-4`` on float32 logits and log-probs, at every position, on the reference
backend (``kernels="torch"``) and on the CPU backend (``kernels="cpu"``; on machines without
AVX-512 VNNI its float32 weights take the plain GEMM route).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_checks import (
    ATOL,
    BLOCK,
    NUM_GREEDY,
    assert_close,
    greedy,
    load_reference,
    make_llm,
    native_llm,
    paged_logits,
    reference_generate,
    reference_logits,
)
from tiny_hf_models import PHI3_ORIGINAL_CONTEXT, SLIDING_WINDOW, write_gguf_from_hf, write_tiny_hf_model
from tiny_models import BOS_ID

from localllm import LLM

# arch, config overrides, formats
VARIANTS = {
    "gemma2": ("gemma2", {}, ("hf", "gguf")),
    "gemma3": ("gemma3", {}, ("hf", "gguf")),
    "phi3": ("phi3", {}, ("hf", "gguf")),
    "phi3-partial-rotary": ("phi3", {"partial_rotary_factor": 0.5}, ("hf", "gguf")),
    "gemma2-qpas24": ("gemma2", {"query_pre_attn_scalar": 24}, ("hf",)),
    "gemma3-qpas24": ("gemma3", {"query_pre_attn_scalar": 24}, ("hf",)),
}
CASES = [f"{name}-{fmt}" for name, (_, _, fmts) in VARIANTS.items() for fmt in fmts]

_rng = np.random.default_rng(11)
PROMPT = [BOS_ID, *_rng.integers(0, 296, 23).tolist()]  # 24 tokens: 3x the window, 6 blocks
# phi3: prompt + continuation within the original context (see the module docstring)
PHI3_PROMPT = PROMPT[: PHI3_ORIGINAL_CONTEXT - NUM_GREEDY]
BATCH_PROMPTS = [
    [BOS_ID],
    [BOS_ID, *_rng.integers(0, 296, 4).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 12).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 19).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 8).tolist()],
]
BATCH_PROMPTS.append(BATCH_PROMPTS[3][:12] + _rng.integers(0, 296, 4).tolist())  # a shared prefix
BATCH_MAX_TOKENS = [12, 3, 12, 12, 12, 10]  # every sequence within 32 tokens (phi3's short regime)
assert len(PROMPT) > 2 * SLIDING_WINDOW
assert all(len(p) + n <= PHI3_ORIGINAL_CONTEXT for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS))


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> dict[str, object]:
    """case -> path (HF directory or GGUF file), plus ``name -> HF directory`` under ("hf", name)."""
    root = tmp_path_factory.mktemp("arch-models")
    paths: dict[str, object] = {}
    for seed, (name, (arch, overrides, fmts)) in enumerate(VARIANTS.items()):
        hf_dir = write_tiny_hf_model(root / name, arch, seed=seed, **overrides)
        paths[("hf", name)] = hf_dir
        for fmt in fmts:
            paths[f"{name}-{fmt}"] = hf_dir if fmt == "hf" else write_gguf_from_hf(hf_dir, root / f"{name}.gguf")
    return paths


_REFERENCES: dict[str, torch.nn.Module] = {}


def reference_model(model_paths, name: str):
    """transformers' model of variant ``name``, float32, eager attention (softcapping)."""
    if name not in _REFERENCES:
        _REFERENCES[name] = load_reference(model_paths[("hf", name)])
    return _REFERENCES[name]


def variant(case: str) -> str:
    return case.rsplit("-", 1)[0]


def prompt_for(case: str) -> list[int]:
    return PHI3_PROMPT if VARIANTS[variant(case)][0] == "phi3" else PROMPT


_LLMS: dict[tuple, LLM] = {}


def shared_llm(model_paths, case: str, kernels: str = "torch") -> LLM:
    key = (case, kernels)
    if key not in _LLMS:
        _LLMS[key] = make_llm(model_paths[case], kernels=kernels)
    return _LLMS[key]


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _LLMS.clear()
    _REFERENCES.clear()


# --- logits and greedy decoding against transformers -----------------------------------------


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, kernels, model_paths):
    llm = shared_llm(model_paths, case, kernels)
    assert llm.engine.model_config.architecture == VARIANTS[variant(case)][0]
    assert llm.engine.kernels.startswith(kernels)  # "cpu" or "cpu-native"
    ref = reference_model(model_paths, variant(case))
    ids = prompt_for(case)
    want = reference_logits(ref, ids)
    got, = paged_logits(llm, [ids])
    assert_close(got, want, f"{case} ({kernels}), one prefill")
    # chunked prefill: 5-token chunks (not a multiple of the block), the window across chunks
    got, = paged_logits(llm, [ids], chunk=5)
    assert_close(got, want, f"{case} ({kernels}), chunked prefill")


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", CASES)
def test_greedy_matches_transformers(case, kernels, model_paths):
    llm = shared_llm(model_paths, case, kernels)
    ref = reference_model(model_paths, variant(case))
    ids = prompt_for(case)
    want = reference_generate(ref, ids)
    out = llm.generate([ids], greedy())[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == want, f"{case} ({kernels}): greedy tokens differ from transformers' generate"
    # each chosen token's log-prob, against the full sequence's logits in transformers
    full = torch.log_softmax(reference_logits(ref, ids + want), -1)
    want_lp = [full[len(ids) - 1 + k, t].item() for k, t in enumerate(want)]
    got_lp = [lp.logprob for lp in out.outputs[0].logprobs]
    np.testing.assert_allclose(got_lp, want_lp, rtol=0, atol=ATOL)


# --- batching with sliding windows in a paged cache --------------------------------------------


BATCH_CASES = [c for c in CASES if c.endswith("-gguf")]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        # 4-token blocks, chunked prefill (8 tokens a step), at most 3 running at once
        {"block_size": BLOCK, "max_num_batched_tokens": 8, "max_num_seqs": 3},
        # and too few blocks for all at once: decodes needing a block preempt others
        {"block_size": BLOCK, "max_num_batched_tokens": 8, "max_model_len": 32, "kv_cache_memory": None},
    ],
    ids=["chunked", "preempted"],
)
@pytest.mark.parametrize("case", BATCH_CASES)
def test_batch_equals_alone(case, engine_kwargs, model_paths):
    ref = reference_model(model_paths, variant(case))
    kwargs = dict(engine_kwargs)
    if "kv_cache_memory" in kwargs:  # 14 blocks: ~56 tokens, for 6 sequences of up to 32
        c = shared_llm(model_paths, case).engine.model.config
        kwargs["kv_cache_memory"] = 14 * c.num_layers * 2 * BLOCK * c.num_kv_heads * c.head_dim * 4
    llm = make_llm(model_paths[case], enable_prefix_caching=False, **kwargs)
    alone = [llm.generate([p], greedy(n))[0] for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)]
    together = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.prompt_token_ids == BATCH_PROMPTS[i]
        assert len(b.token_ids) == BATCH_MAX_TOKENS[i] and b.finish_reason == "length"
        assert b.token_ids == a.token_ids, f"prompt {i} ({len(BATCH_PROMPTS[i])} tokens)"
        np.testing.assert_allclose([lp.logprob for lp in b.outputs[0].logprobs],
                                   [lp.logprob for lp in a.outputs[0].logprobs], rtol=0, atol=ATOL)
        assert a.token_ids == reference_generate(ref, BATCH_PROMPTS[i], BATCH_MAX_TOKENS[i]), f"prompt {i}"
    if "kv_cache_memory" in kwargs:
        assert llm.engine.stats().num_preemptions > 0
    # all prompts in one paged prefill (4-token blocks, 3-token chunks) vs transformers
    for i, got in enumerate(paged_logits(llm, BATCH_PROMPTS, chunk=3)):
        assert_close(got, reference_logits(ref, BATCH_PROMPTS[i]), f"{case} batch prompt {i}")


def test_prefix_cache_hits_give_the_same_outputs(model_paths):
    """The second run of the same prompts reads their full blocks from the prefix cache; with
    sliding windows those blocks are still the ones the window needs."""
    llm = make_llm(model_paths["gemma3-gguf"], block_size=BLOCK)
    first = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    hits = llm.engine.stats().prefix_cache_hits
    again = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    assert llm.engine.stats().prefix_cache_hits > hits
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


# --- phi3: LongRoPE past the original context --------------------------------------------------


def _per_position_rotary(ref, positions: torch.Tensor):
    """(cos, sin) ``[1, n, rotary_dim]`` of LongRoPE with short factors below the original
    context and long ones from there on (localllm's rule), in transformers' layout."""
    cfg = ref.config
    rope = cfg.rope_parameters
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    short = inv / torch.tensor(rope["short_factor"], dtype=torch.float64)
    long = inv / torch.tensor(rope["long_factor"], dtype=torch.float64)
    orig = rope["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / orig
    attn = (1 + np.log(scale) / np.log(orig)) ** 0.5 if scale > 1 else 1.0
    pos = positions.double()
    freqs = pos[:, None] * torch.where((pos >= orig)[:, None], long[None], short[None])
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * attn).float()[None], (emb.sin() * attn).float()[None]


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("phi3")])
def test_phi3_long_positions(case, model_paths):
    ref = reference_model(model_paths, variant(case))
    ids = [BOS_ID, *np.random.default_rng(5).integers(0, 296, 47).tolist()]  # 48 > 32 tokens
    rotary = ref.model.rotary_emb
    original_forward = rotary.forward
    rotary.forward = lambda x, position_ids, **kw: _per_position_rotary(ref, position_ids[0])
    try:
        want = reference_logits(ref, ids)
    finally:
        rotary.forward = original_forward
    # transformers' own rule differs past the original context (all positions long)...
    assert (reference_logits(ref, ids) - want).abs().max().item() > 1e-2
    # ...and agrees below it
    n = PHI3_ORIGINAL_CONTEXT
    assert_close(reference_logits(ref, ids[:n]), want[:n], "per-position table below the original context")
    llm = shared_llm(model_paths, case)
    got, = paged_logits(llm, [ids], chunk=7)
    assert_close(got, want, f"{case}, positions past the original context")


# --- tokenizer and chat template of the Hugging Face directories --------------------------------


def test_hf_tokenizer_and_chat_template(model_paths):
    from transformers import AutoTokenizer

    llm = shared_llm(model_paths, "gemma2-hf")
    hf = AutoTokenizer.from_pretrained(str(model_paths[("hf", "gemma2")]))
    text = "hello world, the cat is on the mat"
    assert llm.tokenizer.encode(text) == hf.encode(text)
    assert llm.tokenizer.encode(text)[0] == BOS_ID
    conv = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the cat"},
            {"role": "user", "content": "is on the mat?"}]
    expected = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert llm.tokenizer.apply_chat_template(conv) == list(expected)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("-gguf")])
def test_gguf_tokenizer_matches_hf_tokenizer(case, model_paths):
    """The GGUF's tokenizer (the tiny byte-level BPE, ``tokenizer.ggml.model = gpt2``, as the
    converter writes it from a tokenizer.json without tokenizer.model) encodes as the HF
    directory's tokenizer.json does, whatever the architecture."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_paths[("hf", variant(case))]))
    llm = shared_llm(model_paths, case)
    text = "hello world, the cat is on the mat"
    assert llm.tokenizer.encode(text) == hf.encode(text)
    conv = [{"role": "user", "content": "hello world"}]
    expected = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert llm.tokenizer.apply_chat_template(conv) == list(expected)


# --- the GGUF writer itself ----------------------------------------------------------------------


def test_gguf_writer_layout(model_paths):
    """What llama.cpp's converter writes (compared once against convert_hf_to_gguf.py itself)."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    def read(path):
        r = GGUFReader(str(path))
        return ({k: f.contents() for k, f in r.fields.items()},
                {t.name: np.array(t.data).reshape(tuple(reversed([int(x) for x in t.shape]))) for t in r.tensors})

    meta, tensors = read(model_paths["gemma3-gguf"])
    hf = load_file(str(model_paths[("hf", "gemma3")] / "model.safetensors"))
    assert meta["gemma3.attention.sliding_window"] == SLIDING_WINDOW
    assert meta["gemma3.rope.freq_base"] == 1e6 and meta["gemma3.rope.freq_base_swa"] == 1e4
    assert meta["gemma3.rope.scaling.type"] == "linear" and meta["gemma3.rope.scaling.factor"] == 8.0
    assert meta["gemma3.attention.key_length"] == 32
    np.testing.assert_array_equal(tensors["blk.0.attn_q_norm.weight"],
                                  hf["model.layers.0.self_attn.q_norm.weight"].numpy() + 1)
    np.testing.assert_array_equal(tensors["blk.6.post_ffw_norm.weight"],
                                  hf["model.layers.6.post_feedforward_layernorm.weight"].numpy() + 1)
    assert "output.weight" not in tensors

    meta, tensors = read(model_paths["gemma2-gguf"])
    assert (meta["gemma2.attn_logit_softcapping"], meta["gemma2.final_logit_softcapping"]) == (50.0, 30.0)

    meta, tensors = read(model_paths["phi3-partial-rotary-gguf"])
    hf = load_file(str(model_paths[("hf", "phi3-partial-rotary")] / "model.safetensors"))
    assert meta["phi3.rope.dimension_count"] == 8
    assert meta["phi3.rope.scaling.original_context_length"] == PHI3_ORIGINAL_CONTEXT
    assert abs(meta["phi3.rope.scaling.attn_factor"] - (1 + np.log(4) / np.log(32)) ** 0.5) < 1e-6
    assert tensors["rope_factors_long.weight"].shape == (4,)
    np.testing.assert_array_equal(tensors["blk.1.attn_qkv.weight"], hf["model.layers.1.self_attn.qkv_proj.weight"].numpy())
    np.testing.assert_array_equal(tensors["blk.1.ffn_up.weight"], hf["model.layers.1.mlp.gate_up_proj.weight"].numpy())
    np.testing.assert_array_equal(tensors["output.weight"], hf["lm_head.weight"].numpy())


# --- Qwen3's per-head Q/K norms on the native CPU layer ------------------------------------------


def test_qwen3_decodes_in_one_native_call_and_batch_equals_alone_bit_for_bit(tmp_path):
    """A Qwen3 file in Q8_0 (llama.cpp's converter): every layer has a native one-call plan (its
    per-head Q/K norms inside it). Each sequence's tokens and log-probs are the same bits alone,
    its prompt in one step (over 64 rows: op by op), and beside others with 8-token chunks (each
    chunk in one call), so the two routes agree (the one-call layer against the torch ops:
    tests/kernels/test_cpu_native.py)."""
    from llamacpp_converter import convert

    from localllm.kernels.cpu.ops import FUSED_LAYER_MAX_ROWS, CpuOps, layer_plan
    from localllm.kernels.cpu.options import CpuOptions

    hf_dir = write_tiny_hf_model(tmp_path / "qwen3", "qwen3", seed=3)
    path = convert(hf_dir, tmp_path / "qwen3.q8_0.gguf", outtype="q8_0")
    prompts = [*BATCH_PROMPTS[:4], [BOS_ID, *_rng.integers(0, 296, FUSED_LAYER_MAX_ROWS + 15).tolist()]]
    max_tokens = [*BATCH_MAX_TOKENS[:4], 12]

    llm = native_llm(path, max_num_batched_tokens=256, enable_prefix_caching=False)
    assert all(isinstance(layer.ops, CpuOps) and layer_plan(layer, CpuOptions()) is not None
               for layer in llm.engine.model.layers)
    alone = [llm.generate([p], greedy(n))[0] for p, n in zip(prompts, max_tokens)]
    together = native_llm(path, max_num_batched_tokens=8, enable_prefix_caching=False).generate(
        prompts, [greedy(n) for n in max_tokens])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.token_ids == a.token_ids, f"prompt {i}"
        assert [lp.logprob for lp in b.outputs[0].logprobs] == [lp.logprob for lp in a.outputs[0].logprobs], i
