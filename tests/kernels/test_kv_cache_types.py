"""The KV cache's types (localllm/quant/kv_rows.py): f32, f16, bf16, q8_0 and q4_0, for keys and
values apart.

* The reference's bytes are ggml's: the same as gguf-py's ``quants.quantize`` (itself bit-exact
  with ggml-quants.c's reference quantizers), read back as gguf-py reads them.
* The native kernels write the same bytes as the reference (RoPE and the write in one call), and
  their attention over a split cache is, bit for bit, their attention over a float32 cache holding
  the values those bytes stand for: only the reads differ. Close to the torch reference too.
* A sequence's bits do not depend on the other sequences of its step.
* An engine on each type: its cache holds the types' bytes (llama.cpp's per token), its greedy
  answers on SmolLM2 stay close to the float16 cache's, and bad types are one clear error.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G
from gguf import quants

from localllm.config.engine import KV_CACHE_TYPES
from localllm.errors import InvalidRequestError
from localllm.kernels.attention import AttentionMetadata, paged_attention, write_kv
from localllm.kernels.cpu import native as cpu_native
from localllm.kernels.cpu.options import CpuOptions
from localllm.quant.kv_rows import (
    KvCacheTypes,
    SplitKvCache,
    dequantize_rows,
    hadamard,
    kv_row_type,
    quantize_rows,
)

HAVE_NATIVE = cpu_native.cpu_has_native()
native = cpu_native.load(CpuOptions.from_env()) if HAVE_NATIVE else None
needs_native = pytest.mark.skipif(not HAVE_NATIVE, reason="no native CPU kernels (AVX-512 VNNI or AVX2) on this CPU")

PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("f16", "q8_0"), ("bf16", "bf16"), ("q4_0", "f32")]
PAIR_IDS = [f"{k}-{v}" for k, v in PAIRS]


def _values(shape, gen) -> torch.Tensor:
    """Rows of mixed scales, a row of zeros and a block of exact halfway codes (the rounding's ties)."""
    x = torch.randn(*shape, generator=gen) * torch.rand(*shape[:-1], 1, generator=gen) * 8
    x.view(-1, shape[-1])[0] = 0
    x.view(-1, shape[-1])[1, :32] = torch.arange(32) * 0.5 - 8
    return x


@pytest.mark.parametrize("name, ggml", [("q8_0", G.Q8_0), ("q4_0", G.Q4_0)])
def test_quantized_rows_are_ggml_bytes(name, ggml):
    gen = torch.Generator().manual_seed(1)
    x = _values((300, 2, 128), gen)
    t = kv_row_type(name)
    raw = quantize_rows(x, t)
    assert raw.shape == (300, 2, 128 // 32 * KV_CACHE_TYPES[name][1]) and raw.dtype == torch.uint8
    want = quants.quantize(x.numpy().reshape(-1, 128), ggml)
    np.testing.assert_array_equal(raw.numpy().reshape(want.shape), want)
    back = dequantize_rows(raw, t, 128)
    np.testing.assert_array_equal(back.numpy().reshape(-1, 128), quants.dequantize(want, ggml))
    assert not back.view(-1, 128)[0].any()  # a row of zeros stays zeros (a zero scale, no NaN)


@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_float_rows_round_as_torch_does(name):
    gen = torch.Generator().manual_seed(2)
    x = _values((50, 3, 64), gen)
    t = kv_row_type(name)
    back = dequantize_rows(quantize_rows(x, t), t, 64)
    assert torch.equal(back, x.to(t.dtype).float())


def test_quantized_rows_are_stored_rotated_as_llama_cpp_stores_them():
    """The orthonormal Walsh-Hadamard transform (Sylvester's order, as llama.cpp's
    ``ggml_gen_hadamard``): its own inverse, dot products kept; keys over the largest power of two
    dividing the head size, values over 64; float types and head sizes off 64 not rotated."""
    n = 128
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(5, 2 * n, dtype=torch.float64)
    want = (x.view(5, 2, n) @ h.double().T / n**0.5).view(5, 2 * n)
    torch.testing.assert_close(hadamard(x.float(), n).double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hadamard(hadamard(x.float(), n), n).double(), x, rtol=1e-5, atol=1e-5)
    a, b = torch.randn(2, 3, 256)
    torch.testing.assert_close((hadamard(a, 64) * hadamard(b, 64)).sum(-1), (a * b).sum(-1), rtol=1e-4, atol=1e-4)
    cpu = torch.device("cpu")

    def split(k, v, hd):
        return SplitKvCache.allocate(1, 16, 1, hd, KvCacheTypes.of(k, v), cpu,
                                     lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))

    assert (split("q8_0", "q4_0", 128).k_rotation, split("q8_0", "q4_0", 128).v_rotation) == (128, 64)
    assert (split("q4_0", "q4_0", 192).k_rotation, split("q4_0", "f16", 192).v_rotation) == (64, 0)
    assert (split("q8_0", "q8_0", 96).k_rotation, split("f32", "q8_0", 64).k_rotation) == (0, 0)


def test_type_names_and_their_errors():
    assert kv_row_type("float16") is kv_row_type("f16")
    assert str(KvCacheTypes.of("q8_0", "q4_0")) == "q8_0/q4_0" and str(KvCacheTypes.of(torch.float16)) == "f16"
    assert KvCacheTypes.of("q8_0").dtype is None and KvCacheTypes.of("bf16").dtype == torch.bfloat16
    assert KvCacheTypes.of("q8_0").bytes_per_token(8, 64) == 8 * 2 * 68  # llama.cpp's: 34 bytes a 32 values
    with pytest.raises(ValueError, match="unknown KV cache type 'q5_0'"):
        kv_row_type("q5_0")
    with pytest.raises(InvalidRequestError, match="multiple of 32"):
        kv_row_type("q4_0").row_bytes(48)


def _step(lens: list[int], bs: int, num_blocks: int, gen: torch.Generator, prompt_rows: int = 1) -> AttentionMetadata:
    """Sequences of contexts ``lens``, each adding its last ``prompt_rows`` tokens this step (1:
    decodes), in shuffled, non-consecutive blocks."""
    need = [-(-n // bs) for n in lens]
    ids = torch.randperm(num_blocks, generator=gen)[: sum(need)]
    tables = torch.zeros(len(lens), max(need), dtype=torch.long)
    slots, starts, first = [], [0], 0
    for i, (n, b) in enumerate(zip(lens, need)):
        tables[i, :b] = ids[first:first + b]
        first += b
        rows = min(prompt_rows, n)
        slots += [tables[i, p // bs] * bs + p % bs for p in range(n - rows, n)]
        starts.append(starts[-1] + rows)
    return AttentionMetadata(slot_mapping=torch.stack(slots), block_tables=tables, context_lens=torch.tensor(lens),
                             query_start_loc=starts, context_lens_host=list(lens),
                             num_decodes=len(lens) if prompt_rows == 1 else 0, block_size=bs)


def _filled(types: KvCacheTypes, num_blocks: int, bs: int, nkv: int, hd: int, gen) -> SplitKvCache:
    cache = SplitKvCache.allocate(num_blocks, bs, nkv, hd, types, torch.device("cpu"),
                                  lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    slots = torch.arange(num_blocks * bs)
    write_kv(cache, _values((len(slots), nkv, hd), gen), _values((len(slots), nkv, hd), gen), slots)
    return cache


def _as_float32(cache: SplitKvCache) -> torch.Tensor:
    """The float32 cache ``[2, blocks, bs, nkv, hd]`` of the values ``cache``'s bytes stand for."""
    return torch.stack([dequantize_rows(cache.k, cache.types.k, cache.head_dim),
                        dequantize_rows(cache.v, cache.types.v, cache.head_dim)])


def test_reference_attention_reads_a_split_cache_as_its_values():
    gen = torch.Generator().manual_seed(3)
    cache = _filled(KvCacheTypes.of("q8_0", "q4_0"), 12, 16, 2, 64, gen)
    meta = _step([5, 70, 33], 16, 12, gen)
    q = torch.randn(3, 8, 64, generator=gen)
    turned = hadamard(q, cache.k_rotation)
    want = hadamard(paged_attention(turned, _as_float32(cache), meta, 0.125), cache.v_rotation)
    assert torch.equal(paged_attention(q, cache, meta, 0.125), want)


@needs_native
@pytest.mark.parametrize("k_type, v_type", PAIRS, ids=PAIR_IDS)
def test_native_writes_the_references_bytes(k_type, v_type):
    """RoPE and the KV write in one native call: the same cache bytes as the reference's write of
    the rotated keys, and the same rotated queries as with a float cache."""
    from localllm.kernels.cpu.ops import _native_cache

    gen = torch.Generator().manual_seed(4)
    nh, nkv, hd, bs, blocks, T = 4, 2, 64, 16, 6, 40
    types = KvCacheTypes.of(k_type, v_type)
    qkv = _values((T, (nh + 2 * nkv) * hd), gen)
    positions = torch.randint(0, 512, (T,), generator=gen)
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.arange(512).float()[:, None] * inv
    cos, sin = angles.cos(), angles.sin()
    cache = SplitKvCache.allocate(blocks, bs, nkv, hd, types, torch.device("cpu"),
                                  lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    view, codes = _native_cache(cache)
    q = native.rope_write_kv(qkv, positions, cos, sin, view, slots, nh, nkv, hd, True, True, **codes)
    f32 = torch.zeros(2, blocks, bs, nkv, hd)
    q32 = native.rope_write_kv(qkv, positions, cos, sin, f32, slots, nh, nkv, hd, True, True)
    assert torch.equal(q, q32)
    want = SplitKvCache.allocate(blocks, bs, nkv, hd, types, torch.device("cpu"),
                                 lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    flat = f32.view(2, -1, nkv, hd)
    write_kv(want, flat[0, slots], flat[1, slots], slots)
    assert torch.equal(cache.data, want.data)


ATTENTION = [(8, 2, 64, 16), (6, 1, 128, 16), (4, 4, 32, 8), (6, 2, 96, 32)]


@needs_native
@pytest.mark.parametrize("k_type, v_type", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("nh, nkv, hd, bs", ATTENTION, ids=[f"{a}h-{b}kv-{c}d-bs{d}" for a, b, c, d in ATTENTION])
def test_native_attention_over_a_split_cache(nh, nkv, hd, bs, k_type, v_type):
    """Bit for bit the native attention over the float32 values the bytes stand for; close to the
    reference; and each sequence's bits its own, alone or in a batch (long enough to split by KV
    heads alone)."""
    from localllm.kernels.cpu.ops import _native_cache

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(nh * hd + bs)
        lens = [1, 37, 900, 16, 70]
        blocks = sum(-(-n // bs) for n in lens) + 4
        cache = _filled(KvCacheTypes.of(k_type, v_type), blocks, bs, nkv, hd, gen)
        meta = _step(lens, bs, blocks, gen)
        q = torch.randn(len(lens), nh, hd, generator=gen) * 2
        scale = hd**-0.5
        view, codes = _native_cache(cache)
        out = native.paged_decode_attention(q, view, meta.block_tables, meta.context_lens, scale, **codes)
        values = _as_float32(cache)  # (as stored: a quantized side rotated, the queries and output turned alike)

        def over_values(**features):
            turned = hadamard(q, cache.k_rotation).contiguous()
            got = native.paged_decode_attention(turned, values, meta.block_tables, meta.context_lens, scale,
                                                **features)
            return hadamard(got, cache.v_rotation)

        assert torch.equal(out, over_values())
        torch.testing.assert_close(out, paged_attention(q, cache, meta, scale), rtol=1e-4, atol=1e-4)  # (values to 8)
        alone = native.paged_decode_attention(q[2:3].contiguous(), view, meta.block_tables[2:3],
                                              meta.context_lens[2:3], scale, **codes)
        assert torch.equal(alone[0], out[2])
        windowed = native.paged_decode_attention(q, view, meta.block_tables, meta.context_lens, scale, window=24,
                                                 **codes)
        assert torch.equal(windowed, over_values(window=24))
    finally:
        torch.set_num_threads(threads)


# --- engines -------------------------------------------------------------------------------------


TEXT = """\
The lighthouse stood at the end of a narrow spit of rock, and for more than a hundred years its
keepers had climbed the spiral stairs every evening to light the lamp. In winter the storms came in
from the west, and the waves were so high that spray reached the windows at the top of the tower.
The last keeper, a quiet man who kept bees in the garden behind the cottage, wrote in his log each
night: the hour the lamp was lit, the state of the sea, the ships that passed. When the light was
automated, the log books went to the county archive, where a historian found them decades later and
read, between the weather and the tonnage, the record of a life spent watching for other people.
def merge(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
"""
TYPE_PAIRS = (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"))


@pytest.fixture(scope="module")
def llms(smollm2_path):
    """SmolLM2 on each KV type (native kernels where the CPU has them), a 16 MiB cache each."""
    from localllm import LLM

    return {pair: LLM(model=str(smollm2_path), kv_cache_memory="16MiB", cache_type_k=pair[0], cache_type_v=pair[1])
            for pair in TYPE_PAIRS}


@pytest.fixture(scope="module")
def engines(llms):
    return {pair: llm.engine for pair, llm in llms.items()}


def test_an_engine_holds_its_types_bytes(engines):
    f16_engine = engines["f16", "f16"]
    c = f16_engine.model_config
    f16_bytes = KvCacheTypes.of("f16").bytes_per_token(c.num_kv_heads, c.head_dim)
    for (k, v), engine in engines.items():
        assert str(engine.kv_types) == (k if k == v else f"{k}/{v}")
        per_token = KvCacheTypes.of(k, v).bytes_per_token(c.num_kv_heads, c.head_dim)
        held = sum(x.nbytes if isinstance(x, SplitKvCache) else x.numel() * x.element_size()
                   for x in engine.runner.kv_caches)
        assert held == engine.num_blocks * engine.config.block_size * per_token * c.num_layers
        # the same 16 MiB hold more tokens the fewer bytes a token takes
        assert engine.num_blocks == pytest.approx(f16_engine.num_blocks * f16_bytes / per_token, abs=2)
        assert all(isinstance(x, SplitKvCache) == (k != "f16") for x in engine.runner.kv_caches)


@torch.inference_mode()
def test_quantized_caches_stay_close_to_float16(engines):
    """As llama.cpp users measure it (llama-perplexity's KL divergence and same top against the
    float16 cache): a 240-token text, every position's next-token distribution."""
    from localllm.engine.model_runner import prefill_batch

    ids = engines["f16", "f16"].tokenizer.encode(TEXT)[:240]
    assert len(ids) == 240  # (15 blocks of 16)

    def logprobs(engine):
        positions, meta, kv = prefill_batch([len(ids)], engine.model_config, engine.kv_types)
        hidden = engine.model(torch.tensor(ids), positions, meta, kv)
        return torch.log_softmax(engine.model.compute_logits(hidden, meta).float(), dim=-1)

    base = logprobs(engines["f16", "f16"])
    # (measured on SmolLM2, 2 threads, Xeon: KLD 0.0026, 0.064, 0.0089 natively; 0.0002, 0.052, 0.0056 on torch;
    # llama-perplexity -ctk/-ctv on a longer text: 0.0047 for q8_0, 0.052 for q4_0)
    bounds = {("q8_0", "q8_0"): (0.006, 0.95), ("q4_0", "q4_0"): (0.12, 0.8), ("q8_0", "q4_0"): (0.02, 0.93)}
    for pair, (max_kld, min_same_top) in bounds.items():
        got = logprobs(engines[pair])
        kld = (base.exp() * (base - got)).sum(-1).mean().item()
        same_top = (base.argmax(-1) == got.argmax(-1)).float().mean().item()
        print(pair, f"KLD {kld:.5f} same top {same_top:.3f}")
        assert kld <= max_kld and same_top >= min_same_top, (pair, kld, same_top)


def test_a_request_gets_the_same_tokens_alone_or_in_a_batch(llms):
    """Batch invariance on a quantized cache (the native route): a prompt's greedy tokens do not
    depend on the other prompts of its steps."""
    from localllm import SamplingParams

    llm = llms["q4_0", "q4_0"]
    if not llm.engine.backend.batch_invariant:
        pytest.skip("these kernels are not batch-invariant (no native kernels on this CPU)")
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Water boils at a temperature of"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params)
    assert llm.generate(prompts[1:2], params)[0].token_ids == together[1].token_ids


def test_bad_cache_types_are_one_clear_error(smollm2_path):
    from localllm import LLM

    with pytest.raises(InvalidRequestError, match="cache_type_k must be auto or one of f32, f16, bf16, q8_0, q4_0"):
        LLM(model=str(smollm2_path), cache_type_k="q5_1")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be"):
        LLM(model=str(smollm2_path), kv_cache_dtype="fp8")


def test_settings_and_flags_name_both_sides(monkeypatch, tmp_path):
    from localllm.config.settings import load_settings

    monkeypatch.setenv("LOCALLLM_CACHE_TYPE_K", "q8_0")
    settings = load_settings({"model": str(tmp_path / "m.gguf"), "cache_type_v": "q4_0"})
    config = settings.engine_config()
    assert config.kv_cache_types == ("q8_0", "q4_0")
    monkeypatch.delenv("LOCALLLM_CACHE_TYPE_K")
    assert load_settings({"model": "x", "kv_cache_dtype": "float16"}).engine_config().kv_cache_types == ("f16", "f16")


def test_every_pair_has_a_layout():
    for k, v in itertools.product(KV_CACHE_TYPES, repeat=2):
        types = KvCacheTypes.of(k, v)
        cache = SplitKvCache.allocate(3, 16, 2, 64, types, torch.device("cpu"),
                                      lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
        assert cache.k.shape == (3, 16, 2, types.k.row_bytes(64)) and cache.v.shape == (3, 16, 2, types.v.row_bytes(64))
        assert cache.nbytes == 3 * 16 * types.bytes_per_token(2, 64)
        cache.v.fill_(1)  # the sides do not overlap
        assert not cache.k.any()


def test_the_cli_takes_the_types_and_says_a_bad_one_in_one_line(smollm2_path):
    import subprocess
    import sys

    def run(*flags):
        return subprocess.run([sys.executable, "-m", "localllm.cli", "run", str(smollm2_path), "Say hi", "--local",
                               "-n", "4", *flags], capture_output=True, text=True, timeout=300, check=False)

    bad = run("--cache-type-k", "q5_1")
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == (
        "Error: cache_type_k must be auto or one of f32, f16, bf16, q8_0, q4_0, got 'q5_1'")
    good = run("-ctk", "q8_0", "-ctv", "q4_0")
    assert good.returncode == 0 and good.stdout.strip(), good.stderr[-2000:]
