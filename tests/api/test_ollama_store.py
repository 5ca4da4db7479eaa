"""Ollama's store routes on an in-process server, driven by the official ``ollama`` client: ``pull``
(its NDJSON progress, and the model in ``/api/tags`` after), ``copy``, ``delete`` and ``create`` (a
variant whose chats start from its system prompt, examples and parameters), and their errors in
Ollama's shape; ``localllm create -f Modelfile``. The Hub is tests/hubserver.py's, on 127.0.0.1."""

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


def test_create_makes_a_variant_whose_chats_start_from_its_defaults(app, tmp_path):
    from tiny_models import write_tiny_model

    base = write_tiny_model(tmp_path / "base.gguf", seed=3)
    client = _client(app)
    greedy = {"temperature": 0.0}
    system = "You answer in one word."
    asyncio.run(client.create("tiny-variant", from_=str(base), system=system,
                              parameters={"num_predict": 3, "temperature": 0.0},
                              messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]))
    assert "tiny-variant" in _tags(client)
    asyncio.run(client.create("tiny-plain", from_=str(base)))  # the same weights, no defaults
    question = [{"role": "user", "content": "Name a color."}]
    made = asyncio.run(client.chat("tiny-variant", messages=question))
    assert made.eval_count == 3  # its num_predict
    explicit = asyncio.run(client.chat("tiny-plain", options={**greedy, "num_predict": 3}, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, *question]))
    assert made.message.content == explicit.message.content
    assert made.prompt_eval_count == explicit.prompt_eval_count  # its system prompt and examples, once each
    own_system = asyncio.run(client.chat("tiny-variant", messages=[{"role": "system", "content": "x"}, *question]))
    assert own_system.prompt_eval_count < made.prompt_eval_count  # a request's system prompt replaces it
    longer = asyncio.run(client.chat("tiny-variant", messages=question, options={"num_predict": 5}))
    assert longer.eval_count == 5  # a request's own value wins
    shown = asyncio.run(client.show("tiny-variant"))
    assert "num_predict 3" in shown.parameters
    assert 'SYSTEM """You answer in one word."""' in shown.modelfile
    with pytest.raises(ollama.ResponseError) as err:
        asyncio.run(client.create("other", from_=str(base), template="{{ .Prompt }}"))
    assert err.value.status_code == 400 and "template" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        asyncio.run(client.create("other", from_="not-pulled"))
    assert err.value.status_code == 404


def test_a_variants_num_ctx_and_kv_cache_types_are_how_it_loads(app, tmp_path):
    """PARAMETER num_ctx loads the variant with that context, as Ollama does, and cache_type_k/_v with those
    KV cache types; its base keeps its own. A type llama.cpp does not name is a 400."""
    from tiny_models import write_tiny_model

    base = write_tiny_model(tmp_path / "base.gguf", seed=4)
    client = _client(app)
    asyncio.run(client.create("tiny-short", from_=str(base), parameters={"num_ctx": 96}))
    asyncio.run(client.create("tiny-long", from_=str(base)))
    asyncio.run(client.create("tiny-q8", from_=str(base), parameters={"cache_type_k": "q8_0", "cache_type_v": "q8_0"}))
    for name in ("tiny-short", "tiny-long"):
        asyncio.run(client.chat(name, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1}))
    contexts = {m.model: m.context_length for m in asyncio.run(client.ps()).models}
    assert contexts["tiny-short"] == 96 and contexts["tiny-long"] > 96
    asyncio.run(client.chat("tiny-q8", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1}))
    async def loaded() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
            return (await http.get("/api/ps")).json()

    kv = {m["name"]: m["kv_cache_type"] for m in asyncio.run(loaded())["models"]}
    assert kv["tiny-q8"] == "q8_0" and kv["tiny-long"] == "f16"  # its PARAMETER cache_type_k/_v
    assert "PARAMETER cache_type_k q8_0" in asyncio.run(client.show("tiny-q8")).modelfile
    with pytest.raises(ollama.ResponseError) as err:
        asyncio.run(client.create("tiny-bad", from_=str(base), parameters={"cache_type_k": "q3_0"}))
    assert err.value.status_code == 400 and "cache_type_k" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:  # the variant's context bounds its prompts
        asyncio.run(client.chat("tiny-short", messages=[{"role": "user", "content": "hi " * 200}]))
    assert err.value.status_code == 400


def test_localllm_create_from_a_modelfile(tmp_path, env):
    from tiny_models import write_tiny_model
    from typer.testing import CliRunner

    from localllm.cli import app

    write_tiny_model(tmp_path / "base.gguf", seed=3)
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text('# a variant\nFROM ./base.gguf\nPARAMETER temperature 0.3\nPARAMETER stop "<|end|>"\n'
                         'SYSTEM """Be brief.\nVery."""\nMESSAGE user hi\n')
    done = CliRunner().invoke(app, ["create", "brief", "-f", str(modelfile)])
    assert done.exit_code == 0, done.output
    found = local.defaults_of("brief")
    assert found is not None and found[1].system == "Be brief.\nVery."
    assert found[1].parameters == {"temperature": 0.3, "stop": ["<|end|>"]} and found[1].messages == (("user", "hi"),)
    modelfile.write_text("FROM ./base.gguf\nADAPTER ./lora.gguf\n")
    bad = CliRunner().invoke(app, ["create", "other", "-f", str(modelfile)])
    assert bad.exit_code == 2 and "ADAPTER" in bad.output and "line 2" in bad.output
