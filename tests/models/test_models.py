"""Model loading and numerics on tiny random GGUF models (tests/tiny_models.py), plus the real file.

References:
- transformers (``AutoModelForCausalLM.from_pretrained(gguf_file=...)``, float32): it dequantizes
  with gguf-py's numpy code and un-permutes llama's Q/K, so it shares no code with localllm.
- ``dense_reference_logits`` below, in float64: plain causal attention over the whole sequence, no
  paging, weights dequantized by gguf-py. It is used where transformers cannot read the file right
  (llama-3 ``rope_freqs``, which transformers' GGUF loader ignores) and is itself checked against
  transformers on the other variants.

Tolerance: logits and log-probs agree within ``ATOL = 1e-4`` (absolute; logits are O(1)-O(10)).
Measured differences are ~5e-7 for float weights and <5e-6 for block types, while a RoPE layout
bug (halves vs adjacent pairs) shows up as >3e-2.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf import quants as gguf_quants
from hf_reference import transformers_reference
from tiny_models import BOS_ID, write_tiny_model

from localllm import LLM, SamplingParams
from localllm.errors import LocalLLMError, ModelLoadError
from localllm.models.assembler import build_model, load_model
from localllm.models.gguf_file import read_gguf
from localllm.models.sources import GGUFSource
from localllm.quant.linear import QuantEmbedding, QuantLinear
from localllm.scheduler.output import ScheduledRequest, SchedulerOutput
from localllm.scheduler.request import Request

T = GGMLQuantizationType
ATOL = 1e-4
NUM_GREEDY = 8
PROMPT = "hello world, the cat is on the mat"
# Token ids (all < 300, the tiny vocabulary), for tests that skip the tokenizer.
PROMPT_IDS = [BOS_ID, 257, 291, 295, 44, 268, 274, 270, 32, 272, 32, 261, 268, 280, 270, 5, 77, 120, 33, 290]


@pytest.fixture(scope="module", autouse=True)
def _isolated_home_and_one_thread(tmp_path_factory):
    """Tokenizer caches go to a temporary LOCALLLM_HOME. One torch thread: the models are tiny,
    and OpenMP parallel regions on a busy 2-core machine cost ~10 ms each."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("localllm-home")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    mp.undo()


# --- references ------------------------------------------------------------------------------


def dense_reference_logits(path: str | os.PathLike, ids: list[int]) -> torch.Tensor:
    """Float64 logits ``[len(ids), vocab]`` of a llama/qwen2/qwen3 GGUF, from the plain math."""
    reader = GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = meta["general.architecture"]

    def m(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    W = {}
    for t in reader.tensors:
        values = gguf_quants.dequantize(t.data, t.tensor_type)
        W[t.name] = torch.from_numpy(np.array(values, dtype=np.float64))
    hidden, nh = m("embedding_length"), m("attention.head_count")
    nkv = m("attention.head_count_kv", nh)
    hd = m("attention.key_length", hidden // nh)
    eps = m("attention.layer_norm_rms_epsilon")
    n = len(ids)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def unpermute(w, heads):
        # llama.cpp stores llama's Q/K rows so that RoPE pairs are adjacent; back to halves.
        return w.reshape(heads, hd // 2, 2, -1).transpose(1, 2).reshape(w.shape)

    inv_freq = 1.0 / m("rope.freq_base", 10000.0) ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    if "rope_freqs.weight" in W:
        inv_freq = inv_freq / W["rope_freqs.weight"]
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]

    def rope(x):  # rotate halves
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(n, n, dtype=torch.bool).tril()
    h = W["token_embd.weight"][torch.tensor(ids)]
    for i in range(m("block_count")):
        p = f"blk.{i}."
        x = rms(h, W[p + "attn_norm.weight"])
        wq, wk = W[p + "attn_q.weight"], W[p + "attn_k.weight"]
        if arch == "llama":
            wq, wk = unpermute(wq, nh), unpermute(wk, nkv)
        q, k, v = x @ wq.T, x @ wk.T, x @ W[p + "attn_v.weight"].T
        if p + "attn_q.bias" in W:
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q, k, v = q.view(n, nh, hd), k.view(n, nkv, hd), v.view(n, nkv, hd)
        if p + "attn_q_norm.weight" in W:
            q, k = rms(q, W[p + "attn_q_norm.weight"]), rms(k, W[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        # query head j uses KV head j // (nh // nkv)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, nh * hd)
        h = h + o @ W[p + "attn_output.weight"].T
        x = rms(h, W[p + "ffn_norm.weight"])
        gate, up = x @ W[p + "ffn_gate.weight"].T, x @ W[p + "ffn_up.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ W[p + "ffn_down.weight"].T
    h = rms(h, W["output_norm.weight"])
    return h @ W.get("output.weight", W["token_embd.weight"]).T


def dense_reference(path: Path):
    return lambda ids: dense_reference_logits(path, ids)


def reference_greedy(reference, prompt_ids: list[int], num_tokens: int = NUM_GREEDY):
    """Greedy continuation (full recompute each step) and each chosen token's log-prob."""
    seq, logprobs = list(prompt_ids), []
    for _ in range(num_tokens):
        lp = torch.log_softmax(reference(seq)[-1], -1)
        token = int(lp.argmax())
        seq.append(token)
        logprobs.append(float(lp[token]))
    return seq[len(prompt_ids) :], logprobs


# --- localllm helpers ------------------------------------------------------------------------


def make_llm(path: Path, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "8MiB")
    return LLM(model=str(path), device="cpu", dtype="float32", **kwargs)


def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """localllm's float32 logits at the last position of ``ids`` (one prefill in fresh blocks)."""
    kv = llm.engine.scheduler.kv
    req = Request("logits-probe", list(ids), SamplingParams(max_tokens=1, temperature=0.0))
    block_ids = kv.allocate_slots(req, len(ids))
    assert block_ids is not None
    try:
        out = SchedulerOutput([ScheduledRequest(req, list(ids), 0, block_ids, True)], [], len(ids))
        logits, _ = llm.engine.runner.compute_logits(out)
    finally:
        kv.free(req)
    assert logits.dtype == torch.float32
    return logits[0]


def greedy(max_tokens: int = NUM_GREEDY) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


def assert_matches_reference(llm: LLM, reference, prompt_ids: list[int]) -> None:
    expected = reference(prompt_ids)[-1]
    got = prefill_logits(llm, prompt_ids).double()
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff < ATOL, f"last-position logits differ by {diff:.3g} (tolerance {ATOL})"

    ref_tokens, ref_logprobs = reference_greedy(reference, prompt_ids)
    out = llm.generate([prompt_ids], greedy())[0]
    assert out.prompt_token_ids == prompt_ids
    assert out.token_ids == ref_tokens
    assert out.finish_reason == "length"
    got_logprobs = [lp.logprob for lp in out.outputs[0].logprobs]
    np.testing.assert_allclose(got_logprobs, ref_logprobs, rtol=0, atol=ATOL)
    assert out.text == llm.tokenizer.decode(out.token_ids)


# --- architecture variants ------------------------------------------------------------------

VARIANTS = {
    "llama-tied": {"arch": "llama"},
    "llama-untied-gqa4": {"arch": "llama", "tie_embeddings": False, "num_heads": 8, "num_kv_heads": 2},
    "llama-rope-freqs": {"arch": "llama", "rope_freqs": True},
    "qwen2-qkv-bias": {"arch": "qwen2"},
    # head_dim 96 != hidden / heads = 64, so q_size (384) != hidden (256)
    "qwen3-qk-norm": {"arch": "qwen3", "head_dim": 96},
}


@pytest.fixture(scope="module")
def variant_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    return {
        name: write_tiny_model(root / f"{name}.gguf", seed=seed, **kw)
        for seed, (name, kw) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def variant_llms(variant_paths) -> dict[str, LLM]:
    return {name: make_llm(path) for name, path in variant_paths.items()}


def _variant_reference(name: str, path: Path):
    if name == "llama-rope-freqs":
        # transformers' GGUF loader drops `rope_freqs.weight` (llama 3 RoPE scaling), so it would
        # compute plain RoPE: compare with the dense reference instead.
        return dense_reference(path)
    if name == "qwen3-qk-norm":
        # transformers' GGUF loader does not read qwen3.attention.key_length; pass head_dim.
        return transformers_reference(path, head_dim=VARIANTS[name]["head_dim"])
    return transformers_reference(path)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_reference(name, variant_paths, variant_llms):
    llm, path = variant_llms[name], variant_paths[name]
    config = llm.engine.model_config
    kw = VARIANTS[name]
    assert config.architecture == kw["arch"]
    assert config.tie_word_embeddings == kw.get("tie_embeddings", True)
    assert config.qkv_bias == (kw["arch"] == "qwen2")
    assert config.qk_norm == (kw["arch"] == "qwen3")
    assert config.rope_scaling.kind == ("freq_factors" if kw.get("rope_freqs") else "none")
    assert (config.num_heads, config.num_kv_heads) == (kw.get("num_heads", 4), kw.get("num_kv_heads", 2))
    assert config.head_dim == kw.get("head_dim", 256 // config.num_heads)

    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    assert prompt_ids[0] == BOS_ID and len(prompt_ids) > 8
    assert prompt_ids == hf_tok.encode(PROMPT)
    assert_matches_reference(llm, _variant_reference(name, path), prompt_ids)


@pytest.mark.parametrize("name", ["llama-tied", "llama-untied-gqa4", "qwen2-qkv-bias"])
def test_dense_reference_agrees_with_transformers(name, variant_paths):
    # The dense reference stands in for transformers on rope_freqs; check it where both work.
    path = variant_paths[name]
    expected = transformers_reference(path)(PROMPT_IDS)
    got = dense_reference_logits(path, PROMPT_IDS)
    assert (got - expected).abs().max().item() < ATOL


def test_chat_template_matches_transformers(variant_paths, variant_llms):
    from transformers import AutoTokenizer

    path = variant_paths["llama-tied"]
    llm = variant_llms["llama-tied"]
    conv = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the cat"},
            {"role": "user", "content": "is on the mat?"}]
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    expected = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    ids = llm.tokenizer.apply_chat_template(conv)
    assert ids == list(expected)
    assert ids.count(BOS_ID) == 1
    assert llm.tokenizer.decode(llm.tokenizer.encode(PROMPT)) == PROMPT


# --- tensor types -----------------------------------------------------------------------------

QTYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
          T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", QTYPES, ids=[t.name for t in QTYPES])
def test_tensor_type_matches_transformers(qtype, tmp_path):
    # Every 2-D weight (embedding and untied output head included) in `qtype`.
    path = write_tiny_model(tmp_path / f"{qtype.name}.gguf", "llama", qtype, tie_embeddings=False, seed=3)
    llm = make_llm(path)
    for name in ("token_embd.weight", "output.weight", "blk.1.ffn_down.weight"):
        assert read_gguf(path).tensors[name].qtype == qtype
    assert llm.engine.model.layers[1].mlp.down_proj.qtype == qtype
    assert_matches_reference(llm, transformers_reference(path), PROMPT_IDS)


# A "dynamic" quant: a type per tensor, the lattice and ternary types (on the reference route)
# beside natively run ones. TQ1_0 and TQ2_0 are gguf-py's quantization of normal weights; the other
# types, which gguf-py cannot quantize, random valid blocks.
MIXED_TYPES = {
    "token_embd.weight": T.IQ1_M, "output.weight": T.IQ2_S,
    "blk.0.attn_q.weight": T.IQ2_XXS, "blk.0.attn_k.weight": T.IQ2_XS, "blk.0.attn_v.weight": T.IQ2_S,
    "blk.0.attn_output.weight": T.IQ3_XXS, "blk.0.ffn_gate.weight": T.IQ1_S, "blk.0.ffn_up.weight": T.IQ1_M,
    "blk.0.ffn_down.weight": T.TQ1_0,
    "blk.1.attn_q.weight": T.TQ2_0, "blk.1.attn_k.weight": T.IQ3_S, "blk.1.attn_v.weight": T.BF16,
    "blk.1.attn_output.weight": T.Q6_K, "blk.1.ffn_gate.weight": T.IQ4_XS, "blk.1.ffn_up.weight": T.IQ2_XXS,
    "blk.1.ffn_down.weight": T.IQ3_S,
}


def test_mixed_type_model_matches_its_dequantized_reference(tmp_path):
    from localllm.serving.planner import read_model_facts

    path = write_tiny_model(tmp_path / "mixed.gguf", "llama", T.Q8_0, tie_embeddings=False, seed=5,
                            tensor_types=MIXED_TYPES, gguf_quantized=frozenset({T.TQ1_0, T.TQ2_0}))
    tensors = read_gguf(path).tensors
    assert {name: tensors[name].qtype for name in MIXED_TYPES} == MIXED_TYPES
    # the planner counts each tensor at its file bytes (what the reference route holds)
    sizes = {t.name: t.n_bytes for t in GGUFReader(str(path)).tensors}
    assert read_model_facts(path).tensor_bytes == sum(sizes.values())
    llm = make_llm(path)
    assert llm.engine.model.layers[0].mlp.down_proj.qtype == T.TQ1_0
    assert_matches_reference(llm, dense_reference(path), PROMPT_IDS)


# --- batching -------------------------------------------------------------------------------

# Different lengths; the last two share their first 24 tokens (a prefix-cache hit of one block).
_rng = np.random.default_rng(7)
BATCH_PROMPTS = [
    [BOS_ID],
    [BOS_ID, *_rng.integers(0, 296, 4).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 17).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 40).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 9).tolist()],
]
BATCH_PROMPTS.append(BATCH_PROMPTS[3][:24] + _rng.integers(0, 296, 6).tolist())
BATCH_MAX_TOKENS = [16, 3, 12, 16, 16, 5]


@pytest.fixture(scope="module")
def alone_outputs(variant_paths):
    llm = make_llm(variant_paths["llama-untied-gqa4"], enable_prefix_caching=False)
    return [llm.generate([p], greedy(n))[0] for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {},
        # chunked prefill (the 41-token prompt takes three steps) and at most 3 running at once
        {"max_num_batched_tokens": 16, "max_num_seqs": 3},
        # 18 blocks of 4 tokens (2 layers x K,V x 4 x 2 heads x 32 x 4 bytes each) for ~180
        # tokens in all: running requests get preempted when their decodes need a new block
        {"max_model_len": 64, "block_size": 4, "kv_cache_memory": 18 * (2 * 2 * 4 * 2 * 32 * 4)},
    ],
    ids=["together", "chunked", "preempted"],
)
def test_batch_equals_alone(engine_kwargs, variant_paths, alone_outputs):
    llm = make_llm(variant_paths["llama-untied-gqa4"], **engine_kwargs)
    outs = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    if not engine_kwargs:
        # Again on the same engine: now the prompts' full blocks come from the prefix cache.
        hits = llm.engine.stats().prefix_cache_hits
        outs += llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
        assert llm.engine.stats().prefix_cache_hits > hits
    num = len(BATCH_PROMPTS)
    for i, out in enumerate(outs):
        prompt, alone, n = BATCH_PROMPTS[i % num], alone_outputs[i % num], BATCH_MAX_TOKENS[i % num]
        assert out.prompt_token_ids == prompt
        assert len(out.token_ids) == n and out.finish_reason == "length"
        assert out.token_ids == alone.token_ids
        assert out.text == alone.text
        np.testing.assert_allclose(
            [lp.logprob for lp in out.outputs[0].logprobs],
            [lp.logprob for lp in alone.outputs[0].logprobs],
            rtol=0, atol=ATOL,
        )
    if "max_model_len" in engine_kwargs:
        assert llm.engine.stats().num_preemptions > 0


# --- bad files --------------------------------------------------------------------------------


def _truncate(path: Path, size: int) -> Path:
    data = path.read_bytes()
    out = path.with_name(f"{path.stem}-cut{size}.gguf")
    out.write_bytes(data[:size])
    return out


def _bad_file(kind: str, root: Path) -> tuple[Path, list[str]]:
    """A broken file and the phrases its ModelLoadError message must contain."""
    good = root / "good.gguf"
    if not good.exists():
        write_tiny_model(good, "llama")
    if kind == "truncated-tensors":
        return _truncate(good, good.stat().st_size // 2), ["truncated"]
    if kind == "truncated-metadata":
        return _truncate(good, 3000), ["truncated or corrupt"]
    if kind == "unsupported-architecture":
        path = write_tiny_model(root / "mamba.gguf", "llama", overrides={"general.architecture": "mamba"})
        return path, ["architecture 'mamba' is not supported", "llama"]
    if kind == "unsupported-tensor-type":
        path = write_tiny_model(root / "q8k.gguf", "llama", tensor_types={"blk.0.ffn_up.weight": T.Q8_K})
        return path, ["blk.0.ffn_up.weight", "Q8_K", "not support"]
    if kind == "missing-tensor":
        path = write_tiny_model(root / "missing.gguf", "llama", skip_tensors=("blk.1.ffn_down.weight",))
        return path, ["missing tensors", "blk.1.ffn_down.weight"]
    if kind == "wrong-shape":
        path = write_tiny_model(root / "shape.gguf", "llama", overrides={"llama.feed_forward_length": 384})
        return path, ["blk.0.ffn_gate.weight", "shape", "(384, 256)"]
    if kind == "not-gguf":
        path = root / "notes.gguf"
        path.write_text("this is not a model\n" * 10)
        return path, ["not a GGUF file"]
    if kind == "empty":
        path = root / "empty.gguf"
        path.write_bytes(b"")
        return path, ["not a GGUF file"]
    raise AssertionError(kind)


BAD_KINDS = ["truncated-tensors", "truncated-metadata", "unsupported-architecture", "unsupported-tensor-type",
             "missing-tensor", "wrong-shape", "not-gguf", "empty"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_file_raises_model_load_error(kind, tmp_path):
    path, phrases = _bad_file(kind, tmp_path)
    with pytest.raises(ModelLoadError) as info:
        make_llm(path)
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, message
    assert info.value.error_type == "model_load_error"


def test_missing_file(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(missing)
    # The public API resolves names through the hub first; a missing path is still a typed error
    # naming the path (today InvalidRequestError from localllm.store, not ModelLoadError).
    with pytest.raises(LocalLLMError) as info:
        make_llm(missing)
    assert str(missing) in str(info.value)


# --- memory -----------------------------------------------------------------------------------


def _anonymous_rss_bytes() -> int:
    """Resident anonymous memory (``RssAnon``): what a copy of the weights would add. File pages
    of the mapping are left out: how many of them a fault maps depends on how the page cache
    holds the file (a freshly written file sits in large folios, one fault maps many pages)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_real_model_weights_stay_memory_mapped(smollm2_path):
    gf = read_gguf(smollm2_path)
    gc.collect()
    before = _anonymous_rss_bytes()
    model = build_model(GGUFSource(gf), torch.float32)
    gc.collect()
    growth = _anonymous_rss_bytes() - before
    # Copying the packed weights would add the file size, dequantizing them ~6x that; norms,
    # biases and the RoPE table are what may be allocated.
    assert growth < 0.25 * gf.file_size, f"building the model grew anonymous RSS by {growth / 2**20:.1f} MiB"

    by_address = {t.data.ctypes.data: t for t in gf.tensors.values()}
    packed = [(n, m) for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert len(packed) == 1 + 7 * model.config.num_layers + 1  # embedding, 7 per layer, the head
    for name, module in packed:
        t = by_address.get(module.raw.data_ptr())
        assert t is not None, f"{name}: weights were copied out of the file"
        assert module.raw.untyped_storage().nbytes() >= t.data.nbytes
        assert np.shares_memory(module.raw.numpy(), t.data)
        base = t.data
        while base is not None and not isinstance(base, np.memmap):
            base = base.base
        assert isinstance(base, np.memmap), f"{name}: tensor data is not a view of the file's memmap"
    if model.config.tie_word_embeddings:
        assert model.lm_head.raw.data_ptr() == model.embed.raw.data_ptr()
