"""The memory planner (localllm.serving.planner): facts from a file's header, the plan's arithmetic, a
context that does not fit said out loud, `show --plan`, and the estimate against a real load."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from localllm.serving.planner import (
    KV_BLOCK_SIZE,
    RUNTIME_OVERHEAD_BYTES,
    WEIGHTS_OVERHEAD_FRACTION,
    plan_load,
    read_model_facts,
)

MIB = 2**20


@pytest.fixture
def tiny(tmp_path):
    from tiny_models import write_tiny_model

    return write_tiny_model(tmp_path / "tiny.gguf", hidden=256, num_heads=4, num_kv_heads=2, layers=2,
                            context_length=256)


def test_facts_come_from_the_header(tiny):
    facts = read_model_facts(tiny)
    assert facts.architecture == "llama" and facts.context_length == 256
    assert (facts.num_layers, facts.num_kv_heads, facts.head_dim) == (2, 2, 64)
    assert 0 < facts.tensor_bytes <= facts.file_bytes == tiny.stat().st_size


def test_plan_arithmetic(tiny):
    facts = read_model_facts(tiny)
    plan = plan_load(facts, name="tiny", kv_cache_memory=MIB, free_bytes=100 * MIB)
    per_token = 2 * 2 * 2 * 64 * 2  # K and V, layers, kv heads, head dim, float16 (auto on the CPU)
    assert plan.kv_cache_tokens == (MIB // (per_token * KV_BLOCK_SIZE)) * KV_BLOCK_SIZE
    assert plan.kv_cache_bytes == plan.kv_cache_tokens * per_token
    assert plan.weights_bytes == facts.tensor_bytes
    assert plan.overhead_bytes == RUNTIME_OVERHEAD_BYTES + int(WEIGHTS_OVERHEAD_FRACTION * facts.tensor_bytes)
    assert plan.total_bytes == plan.weights_bytes + plan.kv_cache_bytes + plan.overhead_bytes
    assert plan.context_length == 256 and plan.fits and plan.problem is None
    assert not plan_load(facts, kv_cache_memory=MIB, free_bytes=MIB).fits
    summary = plan.summary()
    assert "\n" not in summary and summary.startswith("tiny needs") and "100 MiB is free on cpu" in summary
    float32 = plan_load(facts, kv_cache_memory=MIB, kv_cache_types=("f32", "f32"), free_bytes=0)
    assert float32.kv_cache_tokens * 2 == pytest.approx(plan.kv_cache_tokens, abs=KV_BLOCK_SIZE)
    # llama.cpp's bytes per token of each type: q8_0 34 and q4_0 18 bytes per 32 values, against f16's 64
    per_token = {t: facts.kv_bytes_per_token(t) for t in ("f16", "q8_0", "q4_0")}
    assert per_token["q8_0"] * 64 == per_token["f16"] * 34 and per_token["q4_0"] * 64 == per_token["f16"] * 18
    assert facts.kv_bytes_per_token("q8_0", "q4_0") * 2 == per_token["q8_0"] + per_token["q4_0"]
    q8 = plan_load(facts, kv_cache_memory=MIB, kv_cache_types=("q8_0", "q8_0"), free_bytes=0)
    assert q8.kv_cache_tokens == pytest.approx(plan.kv_cache_tokens * 64 / 34, abs=KV_BLOCK_SIZE)


def test_a_context_that_does_not_fit_is_said_not_cut(tiny):
    facts = read_model_facts(tiny)
    tight = plan_load(facts, kv_cache_memory=64 * 1024, max_model_len=256, free_bytes=1 << 40)
    assert not tight.fits and "less than --max-model-len 256" in tight.problem and "raise --kv-cache-memory" in tight.problem
    longer = plan_load(facts, kv_cache_memory=MIB, max_model_len=1000, free_bytes=1 << 40)
    assert longer.fits and longer.context_length == 256 and "serves 256" in longer.note


def test_the_default_context_is_the_models_as_far_as_memory_allows(tmp_path):
    """No --max-model-len: the model's whole context. Its KV cache beyond the default 1 GiB takes at
    most half of what is free once the weights are in; where that holds less, the context is lowered
    to what it holds (the engine says so), never below the default cache."""
    from tiny_models import write_tiny_model

    from localllm.config.engine import DEFAULT_KV_CACHE_MEMORY
    from localllm.config.kv_cache import KV_SHARE_OF_FREE

    small = read_model_facts(write_tiny_model(tmp_path / "small.gguf", hidden=256, num_heads=4, num_kv_heads=2,
                                              layers=2, context_length=131072))
    assert plan_load(small, free_bytes=1 << 40).context_length == 131072  # (128 MiB of KV: within 1 GiB)
    long = read_model_facts(write_tiny_model(tmp_path / "long.gguf", hidden=512, num_heads=8, num_kv_heads=8,
                                             layers=4, context_length=262144))
    per_token = 2 * 4 * 8 * 64 * 2  # 8 KiB: 2 GiB for the whole context
    roomy = plan_load(long, free_bytes=1 << 40)
    assert roomy.context_length == 262144 and roomy.kv_cache_bytes == 262144 * per_token
    base = long.tensor_bytes + RUNTIME_OVERHEAD_BYTES + int(WEIGHTS_OVERHEAD_FRACTION * long.tensor_bytes)
    tight = plan_load(long, free_bytes=base + KV_SHARE_OF_FREE * (3 << 29))  # half of what is left: 1.5 GiB
    assert tight.kv_cache_bytes == 3 << 29 and tight.context_length == (3 << 29) // per_token and tight.fits
    bare = plan_load(long, free_bytes=base)  # nothing left: the default cache, still
    assert bare.kv_cache_bytes == DEFAULT_KV_CACHE_MEMORY and not bare.fits
    assert plan_load(long, max_model_len=4096, free_bytes=1 << 40).context_length == 4096


def test_show_plan_cli(tiny):
    from localllm.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["show", str(tiny), "--plan", "--kv-cache-memory", "1MiB"])
    assert res.exit_code == 0, res.output
    for label in ("weights", "KV cache", "overhead", "total", "free (cpu)", "fits"):
        assert label in res.output
    res = runner.invoke(app, ["show", str(tiny), "--plan", "--kv-cache-memory", "64KiB", "--max-model-len", "256"])
    assert res.exit_code == 1 and "less than --max-model-len 256" in res.output


_MEASURE = r"""
import asyncio, gc, pathlib, sys
import torch  # noqa: F401 - imported before the baseline, as a server has it
import localllm.engine.llm_engine  # noqa: F401
from localllm.api.launch import build_pool
from localllm.serving.catalog import ModelSource
from localllm.config.settings import load_settings

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

pool, _ = build_pool(load_settings({"kv_cache_memory": sys.argv[2], "max_model_len": int(sys.argv[3])}))
pool.catalog.register(ModelSource("m", pathlib.Path(sys.argv[1]), None, 0))

async def load():
    async with pool.acquire("m") as model:
        model.engine.engine.runner.write_kv_caches()  # resident whole, as a full cache is
        return rss()

gc.collect()
before = rss()
print(asyncio.run(load()) - before)
pool.shutdown(0)
"""


def measure_load_growth(path, home, kv: str, max_model_len: int = 512) -> int:
    """Bytes a fresh process's RSS grows by when the server's model pool loads ``path`` and its KV
    cache is written whole (also used by bench/planner_check.py). The plan counts the whole cache;
    the CPU backend's becomes resident as it is first written (huge pages, see ``Backend.kv_cache``),
    so a load alone would leave it out."""
    res = subprocess.run([sys.executable, "-c", _MEASURE, str(path), kv, str(max_model_len)], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "LOCALLLM_HOME": str(home)}, check=False)
    assert res.returncode == 0, res.stderr
    return int(res.stdout.split()[-1])


@pytest.fixture(scope="module")
def warm_home(smollm2_path, tmp_path_factory):
    """A home whose tokenizer cache holds SmolLM2's: the first load of a model ever also builds that
    cache (importing its converter: ~100 MiB, once per process, not per model), which a plan of the
    model's own memory does not count."""
    home = tmp_path_factory.mktemp("home")
    measure_load_growth(smollm2_path, home, "16MiB")
    return home


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kv_mib", [16, 64])
def test_estimate_within_10_percent_of_measured_rss_growth(smollm2_path, warm_home, kv_mib):
    """A fresh process loads SmolLM2 through the pool, as `serve` does (the CPU backend's default route)."""
    measured = measure_load_growth(smollm2_path, warm_home, f"{kv_mib}MiB")
    plan = plan_load(read_model_facts(smollm2_path), kv_cache_memory=kv_mib * MIB, max_model_len=512)
    assert abs(plan.total_bytes - measured) <= 0.10 * measured, (
        f"planned {plan.total_bytes / MIB:.0f} MiB, measured {measured / MIB:.0f} MiB")
