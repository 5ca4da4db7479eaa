"""Ollama's API on a real ``localllm serve`` (SmolLM2), driven by the official ``ollama`` client:
chat and generate (raw too; with a suffix: tests/api/test_fim.py), streamed and not, options, format, embeddings, tags, show, ps and version, and
Ollama's error shape."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest
from api_server import ServerProcess, batch_invariant_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

GREEDY = {"temperature": 0.0, "num_predict": 8}


@pytest.fixture(scope="module")
def server(smollm2_path):
    proc = ServerProcess(smollm2_path, "--kv-cache-memory", "256MiB", "--served-model-name", "smol",
                         env=batch_invariant_env())
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def test_chat_whole_and_streamed_give_the_same_greedy_answer(client):
    messages = [{"role": "user", "content": "Name a color."}]
    whole = client.chat(model="smol", messages=messages, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 8 and whole.prompt_eval_count > 5
    assert whole.total_duration >= whole.eval_duration > 0
    parts = list(client.chat(model="smol", messages=messages, options=GREEDY, stream=True))
    assert parts[-1].done and all(not p.done for p in parts[:-1]) and parts[-1].eval_count == 8
    assert "".join(p.message.content for p in parts) == whole.message.content != ""


def test_generate_through_the_template_and_raw(client):
    templated = client.generate(model="smol", prompt="Name a color.", options=GREEDY)
    chat = client.chat(model="smol", messages=[{"role": "user", "content": "Name a color."}], options=GREEDY)
    assert templated.response == chat.message.content and templated.done
    streamed = list(client.generate(model="smol", prompt="The capital of France is", raw=True, options=GREEDY,
                                    stream=True))
    whole = client.generate(model="smol", prompt="The capital of France is", raw=True, options=GREEDY)
    assert "".join(p.response for p in streamed) == whole.response and streamed[-1].eval_count == 8
    loaded = client.generate(model="smol", prompt="")  # loads the model, generates nothing
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_options_and_format(client):
    stop = client.generate(model="smol", prompt="Count: 1, 2, 3,", raw=True,
                           options={"temperature": 0.0, "num_predict": 16, "stop": [","]})
    assert "," not in stop.response and stop.done_reason == "stop"
    seeded = [client.generate(model="smol", prompt="Say something.", options={"temperature": 1.0, "seed": 7,
                                                                               "num_predict": 6, "top_k": 20})
              for _ in range(2)]
    assert seeded[0].response == seeded[1].response
    answer = client.chat(model="smol", messages=[{"role": "user", "content": "A JSON object with a name."}],
                         format="json", options={"temperature": 0.0, "num_predict": 40})
    if answer.done_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    typed = client.chat(model="smol", messages=[{"role": "user", "content": "Is the sky blue?"}], format=schema,
                        options={"temperature": 0.0, "num_predict": 40})
    assert typed.done_reason == "stop" and isinstance(json.loads(typed.message.content)["ok"], bool)


def test_embeddings_tags_show_ps_and_version(client, server):
    embedded = client.embed(model="smol", input=["hello", "world"])
    assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == 576
    assert embedded.embeddings[0] != embedded.embeddings[1]
    legacy = client.embeddings(model="smol", prompt="hello")
    assert legacy.embedding == pytest.approx(embedded.embeddings[0], abs=1e-6)
    tags = client.list()
    smol = [m for m in tags.models if m.model == "smol"]
    assert len(smol) == 1 and smol[0].size > 0 and smol[0].details.format == "gguf"
    shown = client.show("smol")
    assert shown.details.family == "llama" and "{%" in shown.template
    assert {"completion", "embedding"} <= set(shown.capabilities)  # (a chat model: not an embedder alone)
    assert shown.modelinfo["llama.context_length"] == 8192
    running = client.ps()
    assert [m.name for m in running.models] == ["smol"]
    assert httpx.get(f"{server.url}/api/version").json()["version"]


def test_errors_have_ollamas_shape(client, server):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404
    r = httpx.post(f"{server.url}/api/chat", json={"model": "smol", "messages": "not a list"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(f"{server.url}/api/chat", json={"model": "smol", "stream": False, "unknown_field": 1,
                                                    "messages": [{"role": "user", "content": "hi"}],
                                                    "options": {"num_predict": 2, "num_ctx": 4096}})
    assert r.status_code == 200 and r.json()["done"]  # unknown fields and server options are ignored
