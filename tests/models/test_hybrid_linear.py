"""Hybrid models of Gated DeltaNet and attention layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) on tiny
random models, against transformers.

Each family is a Hugging Face directory written by transformers itself (four layers, linear
attention and full attention in turn; two key heads serving four value heads; see
``tests/tiny_hf_models.py``'s ``HYBRID_DEFAULTS``) and the GGUF file llama.cpp's own
``convert_hf_to_gguf.py`` makes of it (``tests/llamacpp_converter.py``): Qwen3-Next (its
Hugging Face ``in_proj_qkvz`` / ``in_proj_ba`` per key head, the GGUF's ``attn_qkv`` and
``attn_gate``; experts with a gated shared expert), Qwen3.5 (dense; the GGUF's value heads tiled
over the key heads), Qwen3.5-MoE. Logits at every position (one prefill, and chunked prefill,
which carries each sequence's recurrent state from chunk to chunk) and greedy tokens match
transformers on the reference backend and the CPU backend (tolerance ``ATOL``). On the default
(batch-invariant) CPU route a sequence's tokens have the same bits whichever sequences share its
steps and wherever chunked prefill cuts its prompt; preemption (too few KV blocks: the
recurrent state is dropped and recomputed with them) changes no token. Prefix caching restores a
checkpoint of the recurrent state at the end of the cached prefix, and speculative decoding keeps
the state of the last accepted token: neither changes a bit of any answer, whatever the chunks,
the checkpoints evicted or the drafts rejected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llamacpp_converter import convert
from model_checks import (
    ATOL,
    BLOCK,
    assert_close,
    greedy,
    load_reference,
    make_llm,
    native_llm,
    paged_logits,
    reference_generate,
    reference_logits,
)
from tiny_hf_models import HYBRID_DEFAULTS, write_tiny_hf_hybrid
from tiny_models import BOS_ID

from localllm import LLM
from localllm.config import kv_cache
from localllm.engine.model_runner import kv_bytes_per_block
from localllm.models.linear_attention import GatedDeltaNet, state_bytes, state_bytes_per_slot
from localllm.sampling_params import SamplingParams
from localllm.scheduler.request import Request

ARCHITECTURE = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}
CASES = [f"{model_type}-{fmt}" for model_type in HYBRID_DEFAULTS for fmt in ("hf", "gguf")]
FILES = [f"{model_type}-{kind}" for model_type in HYBRID_DEFAULTS for kind in ("gguf", "q8_0")]

_rng = np.random.default_rng(7)
PROMPT = [BOS_ID, *_rng.integers(0, 296, 19).tolist()]
BATCH_PROMPTS = [
    [BOS_ID, *_rng.integers(0, 296, 6).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 13).tolist()],
    [BOS_ID],
    [BOS_ID, *_rng.integers(0, 296, 9).tolist()],
    [BOS_ID, *_rng.integers(0, 296, 17).tolist()],
]
BATCH_MAX_TOKENS = [10, 6, 10, 8, 12]
# prompts sharing a prefix of three blocks and more (BLOCK tokens each), cut after it in several places
STEM = [BOS_ID, *_rng.integers(0, 296, 13).tolist()]
SHARED_PROMPTS = [STEM + _rng.integers(0, 296, n).tolist() for n in (3, 0, 6, 1, 9)]
SHARED_MAX_TOKENS = [8, 6, 10, 7, 5]


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
    """case -> path: ``{model_type}-hf``, ``-gguf`` (F32) and ``-q8_0``."""
    root = tmp_path_factory.mktemp("hybrid-models")
    paths: dict[str, object] = {}
    for seed, model_type in enumerate(HYBRID_DEFAULTS):
        hf_dir = write_tiny_hf_hybrid(root / model_type, model_type, seed=seed)
        paths[f"{model_type}-hf"] = hf_dir
        paths[f"{model_type}-gguf"] = convert(hf_dir, root / f"{model_type}.gguf", extra_args=("--no-mtp",))
        paths[f"{model_type}-q8_0"] = convert(hf_dir, root / f"{model_type}.q8_0.gguf", outtype="q8_0",
                                              extra_args=("--no-mtp",))
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


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("-gguf")])
def test_greedy_matches_transformers(case, kernels, model_paths):
    """The engine's prefill and decode steps (the recurrent state from step to step) give
    transformers' greedy tokens, and their log-probabilities."""
    llm = shared_llm(model_paths, case, kernels)
    ref = reference(model_paths, case)
    want = reference_generate(ref, PROMPT)
    out = llm.generate([PROMPT], greedy())[0]
    assert out.token_ids == want, f"{case} ({kernels}): greedy tokens differ from transformers' generate"
    full = torch.log_softmax(reference_logits(ref, PROMPT + want), -1)
    want_lp = [full[len(PROMPT) - 1 + k, t].item() for k, t in enumerate(want)]
    np.testing.assert_allclose([lp.logprob for lp in out.outputs[0].logprobs], want_lp, rtol=0, atol=ATOL)


def _outputs(results) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, [lp.logprob for lp in r.outputs[0].logprobs]) for r in results]


@pytest.mark.parametrize("case", FILES)
def test_batch_equals_alone_bit_for_bit(case, model_paths):
    """Chunked prefill (8 tokens a step) beside other sequences' chunks and decodes: each
    sequence's tokens and log-probs are exactly those it gets alone, though its steps, and where
    its prompt is cut, differ."""
    llm = native_llm(model_paths[case], max_num_batched_tokens=8)
    alone = [llm.generate([p], greedy(n))[0] for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)]
    together = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    assert _outputs(together) == _outputs(alone)
    # whole prompts in one step each: other cuts of the same prompts, the same bits
    whole = LLM(model=str(model_paths[case]), device="cpu", dtype="float32", kv_cache_memory="8MiB",
                block_size=BLOCK, max_num_batched_tokens=512)
    assert _outputs(whole.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])) == _outputs(alone)


@pytest.mark.parametrize("model_type", list(HYBRID_DEFAULTS))
def test_preemption_recomputes_the_same_tokens(model_type, model_paths):
    """Too few KV blocks for every sequence at once: decodes that need a block preempt others,
    whose KV and recurrent state are dropped and recomputed from their tokens. Every sequence
    still gets transformers' greedy tokens, and those it gets alone."""
    case = f"{model_type}-gguf"
    model = shared_llm(model_paths, case, "cpu").engine.model
    per_block, per_slot = kv_bytes_per_block(model, BLOCK, torch.float32), state_bytes_per_slot(model.config)
    # a KV cache of 10 blocks (40 tokens, for 5 sequences of up to 30) and state slots for 3 requests
    llm = make_llm(model_paths[case], kernels="cpu", block_size=BLOCK, max_num_batched_tokens=8, max_model_len=32,
                   max_num_seqs=3, kv_cache_memory=10 * per_block + 3 * per_slot)
    assert llm.engine.num_blocks == 10 and llm.engine.num_state_slots == 3
    alone = [llm.generate([p], greedy(n))[0] for p, n in zip(BATCH_PROMPTS, BATCH_MAX_TOKENS)]
    preemptions = llm.engine.stats().num_preemptions
    together = llm.generate(BATCH_PROMPTS, [greedy(n) for n in BATCH_MAX_TOKENS])
    assert llm.engine.stats().num_preemptions > preemptions
    ref = reference(model_paths, case)
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.token_ids == a.token_ids, f"prompt {i}"
        np.testing.assert_allclose([lp.logprob for lp in b.outputs[0].logprobs],
                                   [lp.logprob for lp in a.outputs[0].logprobs], rtol=0, atol=ATOL)
        assert a.token_ids == reference_generate(ref, BATCH_PROMPTS[i], BATCH_MAX_TOKENS[i]), f"prompt {i}"
    assert llm.engine.scheduler.state_slots.num_free == 3  # every slot back once the requests are done


def _one_at_a_time(llm: LLM, prompts, max_tokens) -> list[tuple[list[int], list[float]]]:
    return _outputs([llm.generate([p], greedy(n))[0] for p, n in zip(prompts, max_tokens)])


def _budget(model, max_model_len: int, slots: int, checkpoints: int) -> int:
    """A KV budget that the engine splits into ``slots`` state slots and ``checkpoints`` state
    checkpoints (with ``kv_cache.CHECKPOINT_SHARE`` set to 1), leaving the KV cache a little more
    than one context."""
    per_block, per_state = kv_bytes_per_block(model, BLOCK, torch.float32), state_bytes(model.config)
    blocks = -(-max_model_len // BLOCK) + 2
    return slots * 2 * per_state + blocks * per_block + checkpoints * per_state


def test_prefix_caching_and_speculation_follow_their_settings(model_paths):
    """Prefix caching is on by default (with checkpoints of the recurrent state beside the cached
    blocks) and off with ``enable_prefix_caching=False``; ``speculative="auto"`` drafts on the
    batch-invariant route, as for any model."""
    path = model_paths["qwen3_5_text-gguf"]
    on = native_llm(path).engine
    assert on.scheduler.config.enable_prefix_caching and on.num_state_checkpoints > 0
    assert on.scheduler.checkpoints.num_checkpoints == on.num_state_checkpoints
    assert on.speculator.policy.mode == "ngram"
    off = native_llm(path, enable_prefix_caching=False, speculative="off").engine
    assert off.num_state_checkpoints == 0 and off.scheduler.checkpoints is None
    assert off.speculator.policy.mode == "off"


@pytest.mark.parametrize("model_type", list(HYBRID_DEFAULTS))
def test_prefix_hits_equal_no_cache_bit_for_bit(model_type, model_paths):
    """Prompts sharing a prefix of several blocks, one at a time (each hits what the ones before
    cached), then all together: with chunked prefill (7 tokens a step, cutting blocks) and whole
    prompts, each gets the tokens and log-probs it gets without a prefix cache, bit for bit; the
    hits were taken, from checkpoints of the recurrent state."""
    path = model_paths[f"{model_type}-gguf"]
    want = _one_at_a_time(native_llm(path, enable_prefix_caching=False, speculative="off"),
                          SHARED_PROMPTS, SHARED_MAX_TOKENS)
    for step_tokens in (7, 512):
        llm = native_llm(path, max_num_batched_tokens=step_tokens, speculative="off")
        assert _one_at_a_time(llm, SHARED_PROMPTS, SHARED_MAX_TOKENS) == want, step_tokens
        hits = llm.engine.stats().prefix_cache_hits
        assert hits >= 3 * BLOCK * (len(SHARED_PROMPTS) - 1), (step_tokens, hits)
        together = _outputs(llm.generate(SHARED_PROMPTS, [greedy(n) for n in SHARED_MAX_TOKENS]))
        assert together == want, step_tokens
        assert llm.engine.stats().prefix_cache_hits > hits


def test_a_hit_falls_back_to_an_earlier_checkpoint_or_none(model_paths):
    """A cached prefix whose last checkpoints were evicted is taken only up to the last block that
    still has one (or not at all), the rest recomputed from it, and the answer is the same bits."""
    path = model_paths["qwen3_next-gguf"]
    want = _one_at_a_time(native_llm(path, enable_prefix_caching=False, speculative="off"),
                          SHARED_PROMPTS, SHARED_MAX_TOKENS)
    llm = native_llm(path, max_num_batched_tokens=7, speculative="off")
    engine = llm.engine
    scheduler = engine.scheduler
    assert _one_at_a_time(llm, SHARED_PROMPTS[:1], SHARED_MAX_TOKENS[:1]) == want[:1]
    stem_blocks = scheduler.kv.cached_prefix(Request("lookup", STEM, SamplingParams()), len(STEM) // BLOCK)
    assert len(stem_blocks) == 3 and all(scheduler.checkpoints.lookup(b) is not None for b in stem_blocks)
    for i, dropped in ((1, stem_blocks[2:]), (2, stem_blocks)):  # the last block's, then all of them
        for block_id in dropped:
            scheduler.checkpoints.drop(block_id)
        hits = engine.stats().prefix_cache_hits
        got = _one_at_a_time(llm, SHARED_PROMPTS[i:i + 1], SHARED_MAX_TOKENS[i:i + 1])
        assert got == want[i:i + 1]
        assert engine.stats().prefix_cache_hits - hits == (2 * BLOCK if i == 1 else 0)
        # the recomputed blocks' checkpoints are kept for the blocks already cached
        assert all(scheduler.checkpoints.lookup(b) is not None for b in stem_blocks)


def test_hits_under_memory_pressure_equal_no_cache(model_paths, monkeypatch):
    """Two checkpoints and a KV cache of little more than one context: checkpoints and blocks are
    evicted as prompts of three prefixes come and go, some hits are taken, every answer the same."""
    path = model_paths["qwen3_5_moe_text-gguf"]
    monkeypatch.setattr(kv_cache, "CHECKPOINT_SHARE", 1)
    model = shared_llm(model_paths, "qwen3_5_moe_text-gguf", "cpu").engine.model
    rng = np.random.default_rng(11)
    stems = [STEM, [BOS_ID, *rng.integers(0, 296, 10).tolist()], [BOS_ID, *rng.integers(0, 296, 15).tolist()]]
    prompts = [stems[i % 3] + rng.integers(0, 296, int(rng.integers(0, 5))).tolist() for i in (0, 1, 0, 2, 1, 0, 2, 2)]
    max_tokens = [int(n) for n in rng.integers(2, 8, len(prompts))]
    kw = {"max_model_len": 32, "max_num_seqs": 2, "max_num_batched_tokens": 6, "speculative": "off",
          "kv_cache_dtype": "float32"}
    want = _one_at_a_time(native_llm(path, enable_prefix_caching=False, **kw), prompts, max_tokens)
    llm = native_llm(path, kv_cache_memory=_budget(model, 32, 2, 2), **kw)
    assert llm.engine.num_state_checkpoints == 2 and llm.engine.num_blocks <= 12
    assert _one_at_a_time(llm, prompts, max_tokens) == want
    assert _outputs(llm.generate(prompts, [greedy(n) for n in max_tokens])) == want
    assert llm.engine.stats().prefix_cache_hits > 0


def _speculation_prompts(llm: LLM, prompt: list[int]) -> tuple[list[list[int]], list[int]]:
    """``prompt`` and prompts that go on with its greedy answer (so that drafts copied from the
    answer are right), or with one of its tokens changed; and a wrong answer: the answer with its
    ninth token changed (drafts copied from it are right up to that token, wrong at it)."""
    answer = llm.generate([prompt], greedy(12))[0].token_ids
    changed = answer[:6] + [(answer[6] + 1) % 296] + answer[7:12]
    wrong = answer[:8] + [(answer[8] + 1) % 296] + answer[9:]
    return [prompt, prompt + answer[:6], prompt + answer[:3], prompt + changed], wrong


def _one_at_a_time_drafting_from(llm: LLM, wrong: list[int], prompts, max_tokens):
    """Each prompt alone, the suffix cache's latest answer ``wrong`` before each (its answers,
    remembered too, would otherwise be the drafts' source)."""
    got = []
    for p, n in zip(prompts, max_tokens):
        llm.engine.speculator.suffix_cache.add(wrong)
        got += _one_at_a_time(llm, [p], [n])
    return got


@pytest.mark.parametrize("model_type", list(HYBRID_DEFAULTS))
def test_speculation_changes_no_bit_and_gives_transformers_tokens(model_type, model_paths):
    """Drafts copied from the request's tokens and earlier answers (``speculative="suffix"``: n-gram
    lookup, then the suffix cache), some accepted and some rejected, in whole-prompt and chunked
    steps: every answer is the one without speculation, bit for bit, and transformers' greedy
    tokens (a rejected draft's tokens never stay in a recurrent state)."""
    case = f"{model_type}-gguf"
    off = make_llm(model_paths[case], kernels="cpu", block_size=BLOCK, speculative="off", enable_prefix_caching=False)
    prompts, wrong = _speculation_prompts(off, PROMPT)
    want = _one_at_a_time(off, prompts, [16] * len(prompts))
    ref = reference(model_paths, case)
    for i, (p, (tokens, _)) in enumerate(zip(prompts, want)):
        assert tokens == reference_generate(ref, p, 16), f"prompt {i}"
    for step_tokens in (512, 6):
        on = make_llm(model_paths[case], kernels="cpu", block_size=BLOCK, speculative="suffix",
                      max_num_batched_tokens=step_tokens)
        stats = on.engine.speculator.stats
        assert _one_at_a_time_drafting_from(on, wrong, prompts, [16] * len(prompts)) == want, step_tokens
        assert stats.drafted_tokens - stats.accepted_tokens >= 2 and stats.accepted_tokens >= 10, stats


@pytest.mark.parametrize("model_type", list(HYBRID_DEFAULTS))
def test_preemption_prefix_hits_and_speculation_together(model_type, model_paths, monkeypatch):
    """A small KV cache (preemptions), a few state checkpoints (prefix hits, evictions) and drafts
    (accepted and rejected) in the same steps: each answer is the one the request gets alone
    without cache or speculation, bit for bit, and transformers' tokens."""
    case = f"{model_type}-gguf"
    monkeypatch.setattr(kv_cache, "CHECKPOINT_SHARE", 1)
    kw = {"kernels": "cpu", "block_size": BLOCK, "max_num_batched_tokens": 8, "max_model_len": 32, "max_num_seqs": 3}
    plain = make_llm(model_paths[case], enable_prefix_caching=False, speculative="off", **kw)
    prompts, wrong = _speculation_prompts(plain, STEM)
    prompts += SHARED_PROMPTS[:3]
    max_tokens = [min(10, 32 - len(p)) for p in prompts]
    want = _one_at_a_time(plain, prompts, max_tokens)
    ref = reference(model_paths, case)
    for i, (p, n, (tokens, _)) in enumerate(zip(prompts, max_tokens, want)):
        assert tokens == reference_generate(ref, p, n), f"prompt {i}"
    llm = make_llm(model_paths[case], speculative="suffix", kv_cache_memory=_budget(plain.engine.model, 32, 3, 4),
                   **kw)
    engine = llm.engine
    assert engine.num_state_checkpoints == 4 and engine.num_state_slots == 3
    llm.generate([prompts[0]], greedy(12))  # its blocks for the prefix cache
    engine.speculator.suffix_cache.add(wrong)
    got = _outputs(llm.generate(prompts, [greedy(n) for n in max_tokens]))
    assert got == want
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_drafted_tokens > stats.spec_accepted_tokens > 0
    assert engine.scheduler.state_slots.num_free == 3


def test_a_failed_step_run_again_reads_the_states_it_read(model_paths, monkeypatch):
    """A step that fails after some linear-attention layers have advanced their states is run
    again: the second attempt reads the states the first one read (it wrote the other buffer),
    so the tokens are those of a run without the fault."""
    want = _outputs(make_llm(model_paths["qwen3_next-gguf"], kernels="cpu", block_size=BLOCK, max_num_batched_tokens=8)
                    .generate(BATCH_PROMPTS[:3], [greedy(n) for n in BATCH_MAX_TOKENS[:3]]))
    llm = make_llm(model_paths["qwen3_next-gguf"], kernels="cpu", block_size=BLOCK, max_num_batched_tokens=8)
    engine = llm.engine
    last = engine.model.layers[-1].mlp  # (the last layer's: linear-attention layers run before it)
    assert isinstance(engine.model.layers[0].attn, GatedDeltaNet)
    calls = {"n": 0}
    original = last.forward

    def flaky(x, meta=None):
        calls["n"] += 1
        if calls["n"] in (5, 12):  # a step of prompt chunks, a step of decodes
            raise RuntimeError("injected fault")
        return original(x, meta)

    monkeypatch.setattr(last, "forward", flaky)
    got = _outputs(llm.generate(BATCH_PROMPTS[:3], [greedy(n) for n in BATCH_MAX_TOKENS[:3]]))
    assert engine.stats().num_step_failures == 2
    assert got == want


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


def test_the_memory_plan_counts_the_kv_cache_of_attention_layers_only(model_paths):
    """`show --plan` and the pool's planner read a hybrid file's header: its linear-attention
    layers keep no KV cache, so a token's KV bytes are those the engine's blocks hold."""
    from localllm.serving.planner import read_model_facts

    for model_type in HYBRID_DEFAULTS:
        for fmt in ("gguf", "hf"):
            llm = shared_llm(model_paths, f"{model_type}-gguf", "torch")
            config = llm.engine.model_config
            facts = read_model_facts(model_paths[f"{model_type}-{fmt}"])
            assert facts.attention_layers == config.num_layers - config.num_linear_layers < config.num_layers
            per_block = kv_bytes_per_block(llm.engine.model, BLOCK, torch.float16)
            assert facts.kv_bytes_per_token("f16") * BLOCK == per_block, (model_type, fmt)
