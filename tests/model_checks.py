"""What the architecture tests check a model with: transformers' logits and greedy tokens, localllm's
own at every position of a paged forward, and an ``LLM`` at the route's tight precision.

``ATOL = 1e-4`` on float32 logits and log-probs; ``BLOCK``: the KV block size of the paged
forwards (prompts cross block boundaries)."""

from __future__ import annotations

import pytest
import torch

from localllm import LLM, SamplingParams
from localllm.kernels.attention import AttentionMetadata
from localllm.models.linear_attention import StateBuffers, state_buffer

ATOL = 1e-4
NUM_GREEDY = 16
BLOCK = 4


def load_reference(hf_dir, model_class=None):
    """transformers' model of the Hugging Face directory ``hf_dir``, float32, eager attention
    (``model_class``: a transformers class to load it with; default ``AutoModelForCausalLM``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = (model_class or AutoModelForCausalLM).from_pretrained(str(hf_dir), dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
    finally:
        hf_logging.set_verbosity(verbosity)
    model.generation_config.eos_token_id = None  # greedy runs the full length, as ignore_eos
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].double()


@torch.no_grad()
def reference_generate(model, ids: list[int], n: int = NUM_GREEDY) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, min_new_tokens=0)
    return out[0, len(ids):].tolist()


def make_llm(path, **kwargs) -> LLM:
    """On the CPU backend the layers take two activation passes (``int8x2``) and the LM head stays
    in its file's format (these models' F32): these tests check an architecture's arithmetic
    against transformers at the route's tight precision; the default's one pass (llama.cpp's
    precision) and 8-bit head are held to their own bounds in tests/kernels/test_cpu_fast.py."""
    kwargs.setdefault("kv_cache_memory", "8MiB")
    kwargs.setdefault("kernels", "torch")
    kwargs.setdefault("kv_cache_dtype", "float32")  # not float16, as "auto" picks on the native CPU route
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_CPU_ACTIVATIONS", "int8x2")  # read when the backend is selected, in LLM()
        mp.setenv("LOCALLLM_CPU_HEAD_8BIT", "0")
        return LLM(model=str(path), device="cpu", dtype="float32", **kwargs)


def native_llm(path, **kwargs) -> LLM:
    """``path`` on the default CPU route (float32 activations, 8 MiB of KV cache, ``BLOCK``-token
    blocks), for bit-for-bit batch invariance; skipped where that route is not batch-invariant
    (no native kernels for this CPU: torch's kernels choose their sums' order by the batch)."""
    kwargs.setdefault("kv_cache_memory", "8MiB")
    kwargs.setdefault("block_size", BLOCK)
    llm = LLM(model=str(path), device="cpu", dtype="float32", **kwargs)
    if not llm.engine.backend.batch_invariant:
        pytest.skip(f"no native CPU kernels here: the default route ({llm.engine.kernels}) is not batch-invariant")
    return llm


def greedy(n: int = NUM_GREEDY) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


@torch.inference_mode()
def paged_logits(llm: LLM, seqs: list[list[int]], block_size: int = BLOCK, chunk: int | None = None) -> list[torch.Tensor]:
    """localllm's float32 logits ``[len(seq), vocab]`` at every position of each of ``seqs``,
    from the engine's model run directly on a private paged KV cache of ``block_size``-token
    blocks, handed out in reverse order (so no sequence's blocks are contiguous). With ``chunk``,
    each prompt is prefilled in chunks of that many tokens (later chunks read earlier ones'
    K/V from the cache, and linear-attention layers carry each sequence's recurrent state, in
    slot ``i`` for sequence ``i``)."""
    model = llm.engine.model
    c = model.config
    lens = [len(s) for s in seqs]
    nblocks = [-(-n // block_size) for n in lens]
    total = sum(nblocks)
    states = StateBuffers(len(seqs))
    kv = [state_buffer(c, states.num_rows) if c.is_linear(layer) else
          torch.zeros(2, total, block_size, c.num_kv_heads, c.head_dim, dtype=torch.float32)
          for layer in range(c.num_layers)]
    order = list(range(total))[::-1]
    tables, first = [], 0
    for b in nblocks:
        tables.append(order[first:first + b])
        first += b
    block_tables = torch.zeros(len(seqs), max(nblocks), dtype=torch.long)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    step = chunk or max(lens)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for start in range(0, max(lens), step):
        rows = [i for i, n in enumerate(lens) if n > start]
        ids, pos, slots, qsl, ctx = [], [], [], [0], []
        for i in rows:
            end = min(lens[i], start + step)
            p = torch.arange(start, end)
            ids.extend(seqs[i][start:end])
            pos.append(p)
            slots.append(block_tables[i][p // block_size] * block_size + p % block_size)
            qsl.append(qsl[-1] + end - start)
            ctx.append(end)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            block_tables=block_tables[rows],
            context_lens=torch.tensor(ctx),
            query_start_loc=qsl,
            context_lens_host=ctx,
            num_decodes=0,
            block_size=block_size,
            step_cache={},
            state_slots=[states.step(i, fresh=start == 0) for i in rows],
        )
        hidden = model(torch.tensor(ids), torch.cat(pos), meta, kv)
        states.commit(meta.state_slots)
        logits = model.compute_logits(hidden).float()
        for j, i in enumerate(rows):
            outs[i].append(logits[qsl[j]:qsl[j + 1]])
    return [torch.cat(o) for o in outs]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = ATOL) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = (got.double() - want.double()).abs()
    per_pos = diff.amax(-1)
    assert per_pos.max().item() < atol, (
        f"{what}: logits differ by up to {per_pos.max().item():.3g} (tolerance {atol}); "
        f"per position {[round(x, 6) for x in per_pos.tolist()]}"
    )


