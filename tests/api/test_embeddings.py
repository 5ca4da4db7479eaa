"""``/v1/embeddings``: the official ``openai`` client against a real ``localllm
serve`` on SmolLM2 — float and base64, ``dimensions``, a text's embedding alone equal to the same
text's inside a batch (≤ 1e-5; bitwise on the batch-invariant CPU path), 100 concurrent requests
folded into a few batches by the dynamic batching window (counted from /metrics), errors — and
the window's policy and pooling without a server."""

from __future__ import annotations

import asyncio
import base64
import re
from concurrent.futures import Future

import httpx
import numpy as np
import openai
import pytest
import torch
from api_server import serving

from localllm.engine.embeddings import BatchingWindow, EmbeddingBatcher, pool, pooling_from_metadata

MODEL = "smol"
TEXTS = ["hello world", "The cat sat on the mat.", "Paris is the capital of France, and a large city."]


@pytest.fixture(scope="module")
def server(smollm2_path):
    with serving(smollm2_path, "--served-model-name", MODEL, "--kv-cache-memory", "128MiB") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)])


@pytest.mark.slow
def test_float_embeddings_are_normalized_and_batch_invariant(client):
    batch = client.embeddings.create(model=MODEL, input=TEXTS)
    v = _vectors(batch)
    assert v.shape == (3, 576) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 0
    for i, text in enumerate(TEXTS):
        alone = _vectors(client.embeddings.create(model=MODEL, input=text))[0]
        assert np.abs(alone - v[i]).max() <= 1e-5
    # similar texts are closer than unrelated ones
    near = _vectors(client.embeddings.create(model=MODEL, input=["hello world!", "Quantum chromodynamics."]))
    assert v[0] @ near[0] > v[0] @ near[1]
    # token ids are accepted as input too
    ids = httpx.post(client.base_url.join("/tokenize").__str__(), json={"prompt": TEXTS[1]}).json()["tokens"]
    assert np.abs(_vectors(client.embeddings.create(model=MODEL, input=[ids]))[0] - v[1]).max() <= 1e-5


@pytest.mark.slow
def test_base64_and_dimensions(client):
    full = _vectors(client.embeddings.create(model=MODEL, input=TEXTS[0]))[0]
    raw = httpx.post(str(client.base_url) + "embeddings",
                     json={"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - full).max() <= 1e-7
    cut = _vectors(client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64))[0]
    assert cut.shape == (64,) and abs(np.linalg.norm(cut) - 1) < 1e-6
    assert np.allclose(cut, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "dimensions": 577}, "dimensions"),
    ({"input": "word " * 9000}, "input"),
    ({"input": "x", "model": "other"}, "model"),
])
def test_errors(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def _batch_histogram(server) -> tuple[float, float]:
    text = httpx.get(server.url + "/metrics").text
    count = float(re.search(r'localllm:embedding_batch_size_count\{[^}]*\} (\S+)', text).group(1))
    total = float(re.search(r'localllm:embedding_batch_size_sum\{[^}]*\} (\S+)', text).group(1))
    return count, total


@pytest.mark.slow
def test_concurrent_requests_are_batched(server):
    before = _batch_histogram(server)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
            return await asyncio.gather(*(c.embeddings.create(model=MODEL, input=f"text number {i}")
                                          for i in range(100)))

    results = asyncio.run(main())
    assert len(results) == 100 and all(len(r.data[0].embedding) == 576 for r in results)
    count, total = (a - b for a, b in zip(_batch_histogram(server), before))
    assert total == 100 and count < 50, (count, total)  # folded into batches, not 100 forwards
    print(f"100 requests in {count:.0f} batches")


def test_window_policy():
    b = EmbeddingBatcher(BatchingWindow(max_batch_size=4, max_batch_tokens=10, max_queue_delay=0.01,
                                        max_starvation=0.5))
    assert not b.ready(False)
    for n in (3, 3, 3):
        b.submit([1] * n)
    now = b._queue[0].arrival
    assert not b.ready(False, now)  # neither full nor waited long enough
    assert b.ready(False, now + 0.02)  # the delay ran out
    assert not b.ready(True, now + 0.02)  # generation goes first...
    assert b.ready(True, now + 0.6)  # ...but not forever
    sizes = []
    b.on_batch = sizes.append
    assert [len(p.token_ids) for p in b.take()] == [3, 3, 3] and sizes == [3]  # 9 tokens fit in 10
    b.submit([1] * 11)
    assert len(b.take()) == 1  # a sequence over the token budget still runs, alone
    f: Future = b.submit([1])
    b.fail_all(RuntimeError("stopped"))
    assert isinstance(f.exception(), RuntimeError) and len(b) == 0


def test_pooling():
    hidden = torch.arange(12, dtype=torch.float32).view(6, 2)
    assert pool(hidden, [2, 4], "last").tolist() == [[2, 3], [10, 11]]
    assert pool(hidden, [2, 4], "cls").tolist() == [[0, 1], [4, 5]]
    assert pool(hidden, [2, 4], "mean").tolist() == [[1, 2], [7, 8]]
    assert pooling_from_metadata({"qwen3.pooling_type": 3}, "qwen3") == "last"
    assert pooling_from_metadata({}, "llama") is None


@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_transformers_pooled_and_normalized(tmp_path, arch, pooling):
    """The vector of a sequence is transformers' last hidden state (after the final norm) of the
    same weights, pooled the same way and L2-normalized: a missing final norm, a wrong pooling row
    or a skipped normalization fails it. Float32 weights on the reference path: atol 1e-4 (the
    native CPU route, the default: 2e-3)."""
    from tiny_hf_models import write_gguf_from_hf, write_tiny_hf_model
    from transformers import AutoModel

    from localllm.config.engine import EngineConfig
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.embeddings import normalize

    hf_dir = write_tiny_hf_model(tmp_path / arch, arch, seed=3)
    gguf_path = write_gguf_from_hf(hf_dir, tmp_path / f"{arch}.gguf")
    sequences = [[5, 17, 42, 8, 99, 3], [7, 7, 120, 64]]
    hf = AutoModel.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for ids in sequences:
            hidden = hf(torch.tensor([ids])).last_hidden_state[0]
            want.append(hidden.mean(0) if pooling == "mean" else hidden[-1])
    want = torch.nn.functional.normalize(torch.stack(want), dim=-1)
    for kernels, atol in (("torch", 1e-4), ("auto", 2e-3)):
        engine = AsyncEngine.from_config(EngineConfig(model=str(gguf_path), kernels=kernels, pooling=pooling,
                                                      kv_cache_memory=1 << 22))
        try:
            async def embed_all():
                return await asyncio.gather(*(engine.embed(ids) for ids in sequences))

            got = normalize(torch.stack(asyncio.run(embed_all())))
        finally:
            engine.shutdown()
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, k=kernels: f"kernels={k}: {m}")
