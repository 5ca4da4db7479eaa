"""The GPU path's host-side contracts, checked without a GPU.

Each test stands in for one finding of a read of the code: the embeddings batch on the model's
device, the pool asking the GPU for free memory and handing each engine the KV cache it planned,
the step thread's current CUDA device, the Triton version gate, the dot precision ROCm accepts,
and bfloat16/float16 as the default dtype on a GPU. What only the compiler can say (shared
memory, spills, approximate division) is in ``test_triton_compile.py``; the kernels' values in
``test_triton_kernels.py``.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.config.device import engine_device, resolve_device, resolve_dtype
from localllm.config.engine import EngineConfig
from localllm.errors import InvalidRequestError
from localllm.kernels import select
from localllm.kernels.triton.spec import H100, RTX_3090, GpuSpec, gpu_spec, targeting
from localllm.quant.gguf_dequant import FLOAT_QTYPES, SUPPORTED_QTYPES, dequantize

# ---------------------------------------------------------------- embeddings on the model's device


def _tiny_config() -> SimpleNamespace:
    """The fields of a model's config that a batch of whole sequences is shaped by."""
    return SimpleNamespace(vocab_size=64, hidden_size=16, num_layers=2, num_kv_heads=1, head_dim=8)


def test_prefill_batch_builds_every_tensor_on_the_device_it_is_given():
    from localllm.engine.model_runner import prefill_batch

    positions, meta, kv = prefill_batch([3, 5], _tiny_config(), torch.float16, device="meta")
    tensors = [positions, meta.slot_mapping, meta.block_tables, meta.context_lens, *kv]
    assert all(t.device.type == "meta" for t in tensors), [t.device for t in tensors]
    assert kv[0].dtype == torch.float16 and len(kv) == 2


def test_an_embeddings_batch_runs_on_the_models_device():
    """``run_batch`` hands the model ids, positions, metadata and caches on the device it is told
    (the engine's), and returns host vectors: before, it built them on the CPU whatever the model's
    device, so ``/v1/embeddings`` failed on CUDA."""
    from concurrent.futures import Future

    from localllm.engine.embeddings import _Pending, run_batch

    seen = {}

    class SpyModel:
        config = _tiny_config()

        def __call__(self, ids, positions, meta, kv):
            seen["devices"] = {t.device.type for t in (ids, positions, meta.slot_mapping, meta.block_tables,
                                                        meta.context_lens, *kv)}
            return torch.ones(ids.shape[0], self.config.hidden_size)

    batch = [_Pending([1, 2, 3], Future(), 0.0), _Pending([4, 5], Future(), 0.0)]
    run_batch(SpyModel(), batch, "mean", torch.float32, torch.device("meta"))
    assert seen["devices"] == {"meta"}
    vectors = [p.future.result(timeout=1) for p in batch]
    assert all(v.device.type == "cpu" and v.shape == (16,) for v in vectors)


# ---------------------------------------------------------------- the pool on a GPU


def test_the_pool_asks_the_gpu_it_loads_on_for_free_memory(monkeypatch):
    from localllm.serving.catalog import ModelCatalog
    from localllm.serving.pool import ModelPool

    asked = []

    def mem_get_info(device):
        asked.append(torch.device(device))
        return 3 << 30, 24 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    pool = ModelPool(ModelCatalog([], include_store=False), lambda source: None, device="cuda:1")
    assert pool._available() == 3 << 30
    assert asked == [torch.device("cuda:1")]


def test_on_a_gpu_each_pooled_engine_takes_the_kv_cache_its_plan_counted(monkeypatch, tmp_path):
    """Alone, an engine on CUDA sizes its KV cache from 90% of the free VRAM, so the second model
    of a pool never fits; the pool's engines get the KV bytes the planner counted instead (and a
    ``--kv-cache-memory`` given by the user wins everywhere)."""
    from tiny_models import write_tiny_model

    from localllm.api.launch import build_pool
    from localllm.config.settings import load_settings
    from localllm.engine.async_engine import AsyncEngine
    from localllm.serving.catalog import ModelSource

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", GGMLQuantizationType.Q8_0)  # Q8_0
    built = []
    monkeypatch.setattr(AsyncEngine, "from_config", classmethod(lambda cls, config, **kw: built.append(config)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 << 30, 24 << 30))
    source = ModelSource("tiny", path, "Q8_0", path.stat().st_size)

    pool, _ = build_pool(load_settings({}), device="cuda")
    pool._load_engine(source)
    plan = pool._plan_load(source)
    assert built[-1].kv_cache_memory == plan.kv_cache_bytes > 0
    assert built[-1].device == "cuda" and built[-1].dtype == "auto"  # the engine resolves it on the card

    pool, _ = build_pool(load_settings({"kv_cache_memory": "64MiB"}), device="cuda")
    pool._load_engine(source)
    assert built[-1].kv_cache_memory == 64 << 20

    pool, _ = build_pool(load_settings({}), device="cpu")
    pool._load_engine(source)
    assert built[-1].kv_cache_memory is None  # on the CPU the engine's own default, as before


# ---------------------------------------------------------------- the step thread's device


def test_the_engine_makes_its_gpu_the_current_device_of_the_thread_that_steps_it(monkeypatch):
    from localllm.engine.llm_engine import LLMEngine

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append((device, threading.get_ident())))
    engine = LLMEngine.__new__(LLMEngine)
    engine.device = torch.device("cuda:1")
    worker = threading.Thread(target=engine.bind_device)
    worker.start()
    worker.join()
    assert calls == [(torch.device("cuda:1"), worker.ident)]
    engine.device = torch.device("cpu")
    engine.bind_device()
    assert len(calls) == 1


def test_a_bare_cuda_device_is_kept_as_the_current_gpus_index(monkeypatch):
    """``--device cuda`` (what ``auto`` resolves to): ``torch.cuda.set_device`` refuses a device
    without an index, which stopped every GPU engine at its construction on an H200 (torch 2.11).
    The engine keeps the GPU current when it was built, by index, and binds that."""
    from torch.cuda._utils import _get_device_index

    from localllm.engine import llm_engine

    class Built(Exception):
        """Raised where the model would load: the engine got past binding its device."""

    bound = []

    def set_device(device):  # torch's own argument check (optional=False), then recorded
        bound.append(_get_device_index(device))

    def no_model(*args, **kwargs):
        raise Built  # the device is bound before the model loads: stop there

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(llm_engine, "load_model", no_model)
    with pytest.raises(Built):
        llm_engine.LLMEngine(EngineConfig(model="any.gguf", device="cuda", dtype="float32"))
    assert bound == [1]
    assert engine_device("cuda") == torch.device("cuda", 1)
    assert engine_device("cuda:2") == torch.device("cuda", 2)
    assert engine_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_QTYPES - FLOAT_QTYPES, key=int), ids=lambda q: q.name)
def test_the_reference_dequantizers_stay_on_their_inputs_device(qtype):
    """The torch reference path on a GPU (the fallback when a Triton kernel fails its self-test)
    dequantizes there: no helper tensor may sit on the CPU. The meta device stands in for the GPU
    (a CPU helper mixed with it raises as with CUDA)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = torch.empty(3, 2 * size, dtype=torch.uint8, device="meta")
    out = dequantize(raw, qtype)
    assert out.device.type == "meta" and out.shape == (3, 2 * block)


def test_the_async_engine_binds_the_device_on_its_step_thread(tmp_path):
    from tiny_models import write_tiny_model

    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.llm_engine import LLMEngine

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", GGMLQuantizationType.Q8_0)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=1 << 20))
    bound = threading.Event()
    threads = []

    def bind():
        threads.append(threading.get_ident())
        bound.set()

    engine.bind_device = bind
    runner = AsyncEngine(engine)
    try:
        assert bound.wait(10)
        assert threads and threads[0] != threading.get_ident()
    finally:
        runner.shutdown()


# ---------------------------------------------------------------- Triton's version, ROCm, dtypes


@pytest.mark.parametrize("version", ["3.3.1", "3.1.0+git1234", "2.3.1"])
def test_a_triton_older_than_the_floor_falls_back_to_torch_with_one_line(monkeypatch, caplog, version):
    pytest.importorskip("triton")
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setattr(select, "triton_available", lambda: True)
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    with caplog.at_level(logging.WARNING, logger=select.__name__):
        assert select.resolve_kernels("auto", "cuda") == "torch"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"Triton {version.split('+')[0]} is older than 3.4" in lines[0]
    with pytest.raises(InvalidRequestError, match="older than 3.4"):
        select.resolve_kernels("triton", "cuda")


def test_the_installed_triton_passes_the_gate():
    pytest.importorskip("triton")
    assert select.triton_too_old() is None
    assert select.triton_version() >= select.MIN_TRITON


def test_dot_precision_is_ieee_on_rocm_and_for_float32():
    pytest.importorskip("triton")
    from localllm.kernels.triton.quant import dot_precision

    mi300 = GpuSpec("MI300X", "hip", "gfx942", num_sms=304, max_shared_per_block=65536, warp_size=64)
    rx7900 = GpuSpec("RX 7900 XTX", "hip", "gfx1100", num_sms=96, max_shared_per_block=65536, warp_size=32)
    for spec in (mi300, rx7900):
        assert {dot_precision(d, spec) for d in (torch.float16, torch.bfloat16, torch.float32)} == {"ieee"}
    assert dot_precision(torch.float32, RTX_3090) == "ieee"  # float32 is the accuracy reference: no TF32
    assert dot_precision(torch.bfloat16, RTX_3090) == "tf32"  # ignored by tl.dot for 16-bit inputs


def test_auto_dtype_is_float32_on_a_cpu_and_16_bit_on_a_gpu(monkeypatch, tmp_path):
    from tiny_models import write_tiny_model

    from localllm.engine.llm_engine import LLMEngine

    assert EngineConfig(model="m.gguf").dtype == "auto"
    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", GGMLQuantizationType.Q8_0)
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=1 << 20))
    assert engine.config.dtype == "float32" and engine.dtype == torch.float32
    assert resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16" and resolve_device("auto") == "cuda"
    assert resolve_dtype("float32", "cuda:1") == "float32"  # on request
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # a Turing card
    assert resolve_dtype("auto", "cuda:0") == "float16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(InvalidRequestError, match="dtype must be"):
        EngineConfig(model="m.gguf", dtype="float64")


# ---------------------------------------------------------------- the card's limits


def test_gpu_spec_answers_for_a_target_card_only_inside_targeting():
    assert gpu_spec(torch.device("cpu")) is None
    with targeting(H100):
        assert gpu_spec(torch.device("cpu")) is H100
    assert gpu_spec(torch.device("cpu")) is None


def test_occupancy_arithmetic_matches_the_cuda_calculator():
    # 128 threads, 64 registers, no shared memory: registers allow 65536 / (64 * 128) = 8 blocks;
    # sm_86 allows 1536 / 128 = 12 by threads and 16 by blocks.
    assert RTX_3090.ctas_per_sm(num_warps=4, regs_per_thread=64, shared_bytes=0) == 8
    # 40 KiB of shared memory (+1 KiB reserved per block): 100 KiB / 41 KiB = 2 blocks.
    assert RTX_3090.ctas_per_sm(num_warps=4, regs_per_thread=32, shared_bytes=40 << 10) == 2
    # 255 registers round up to 256 per thread: one 8-warp block needs 65536, exactly one SM's.
    assert RTX_3090.ctas_per_sm(num_warps=8, regs_per_thread=255, shared_bytes=0) == 1
    assert RTX_3090.ctas_per_sm(num_warps=4, regs_per_thread=32, shared_bytes=101376) == 1  # all a block may take
    assert RTX_3090.ctas_per_sm(num_warps=4, regs_per_thread=32, shared_bytes=101377) == 0


def test_known_targets_are_the_consumer_and_datacentre_cards():
    assert {s.arch for s in (RTX_3090, H100)} == {86, 90}
    assert RTX_3090.max_shared_per_block == 101376 and H100.max_shared_per_block == 232448

