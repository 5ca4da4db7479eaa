"""Ollama's store routes on an in-process server, driven by the official ``ollama`` client: ``pull``
(its NDJSON progress, and the model in ``/api/tags`` after), ``copy`` and ``delete``, and their
errors in Ollama's shape. The Hub is tests/hubserver.py's, on 127.0.0.1."""

from __future__ import annotations

import asyncio

import httpx
import ollama
import pytest
from hubserver import sha256, tiny_gguf

from localllm.store import local

REPO = "test/tiny-GGUF"
NAME = f"hf.co/{REPO}:Q8_0"


@pytest.fixture
def app(fake_hub, tmp_path_factory):
    from tiny_models import write_tiny_model

    from localllm.api.launch import build_pool
    from localllm.api.server import build_app
    from localllm.config.settings import load_settings

    model = write_tiny_model(tmp_path_factory.mktemp("served") / "served.gguf")
    pool, _ = build_pool(load_settings({"model": str(model), "served_model_name": "served",
                                        "kv_cache_memory": "16MiB", "threads": 1}))
    try:
        yield build_app(pool, None)
    finally:
        pool.shutdown(0)


def _client(app) -> ollama.AsyncClient:
    return ollama.AsyncClient(host="http://localhost", transport=httpx.ASGITransport(app=app), timeout=60)


def _tags(client) -> set[str]:
    return {m.model for m in asyncio.run(client.list()).models}


def test_pull_streams_progress_then_the_model_is_listed_copied_and_deleted(app, fake_hub):
    data = tiny_gguf()
    fake_hub.add_file(REPO, "tiny.Q8_0.gguf", data)
    client = _client(app)

    async def pulled():
        return [p async for p in await client.pull(NAME, stream=True)]

    lines = asyncio.run(pulled())
    assert lines[0].status == "pulling manifest" and lines[-1].status == "success"
    files = [p for p in lines if p.digest]
    assert files and files[-1].completed == files[-1].total == len(data)
    assert local.is_pulled(NAME) and local.path_for(NAME).read_bytes() == data
    assert NAME in _tags(client)
    again = asyncio.run(client.pull(NAME))  # already pulled: verified, not fetched again
    assert again.status == "success"

    asyncio.run(client.copy(NAME, "mine"))
    assert {NAME, "mine"} <= _tags(client) and sha256(local.path_for("mine").read_bytes()) == sha256(data)
    with pytest.raises(ollama.ResponseError) as err:  # never overwritten
        asyncio.run(client.copy(NAME, "mine"))
    assert err.value.status_code == 400 and "already" in err.value.error

    asyncio.run(client.delete(NAME))
    assert NAME not in _tags(client) and "mine" in _tags(client)
    assert local.path_for("mine").read_bytes() == data  # the copy's files outlive the original
    with pytest.raises(ollama.ResponseError) as err:
        asyncio.run(client.delete(NAME))
    assert err.value.status_code == 404


def test_store_errors_have_ollamas_shape(app, fake_hub):
    client = _client(app)
    with pytest.raises(ollama.ResponseError) as err:
        asyncio.run(client.pull("hf.co/test/missing-GGUF:Q8_0", stream=False))
    assert err.value.status_code == 404

    async def streamed():
        return [p async for p in await client.pull("hf.co/test/missing-GGUF:Q8_0", stream=True)]

    with pytest.raises(ollama.ResponseError, match="no repo"):  # a stream's error is a line of its own
        asyncio.run(streamed())
    with pytest.raises(ollama.ResponseError) as err:
        asyncio.run(client.copy("not-pulled", "other"))
    assert err.value.status_code == 404
    r = asyncio.run(httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost").post(
        "/api/pull", json={}))
    assert r.status_code == 400 and set(r.json()) == {"error"}
