"""Ollama's embedding routes stop waiting, and cancel their queued inputs, once the client has left
(as /v1/embeddings does): a client that leaves never keeps the engine embedding for nobody."""

from __future__ import annotations

import asyncio

from localllm.api.ollama.protocol import OllamaEmbeddingsRequest, OllamaEmbedRequest
from localllm.api.ollama.serving import OllamaServing
from localllm.api.openai.model_serving import CLIENT_GONE


class _GoneClient:
    async def is_disconnected(self) -> bool:
        return True


class _NeverDone:
    """A serving whose embeddings never finish; records whether they were cancelled."""

    served_model_name = "m"

    def __init__(self) -> None:
        self.cancelled = 0

    async def embed_items(self, items, dimensions=None):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def test_embed_and_embeddings_answer_499_and_cancel_when_the_client_leaves():
    serving = _NeverDone()
    ollama = OllamaServing(serving, _GoneClient())

    async def both():
        first = await asyncio.wait_for(ollama.embed(OllamaEmbedRequest(model="m", input=["a", "b"])), 5)
        second = await asyncio.wait_for(ollama.embeddings(OllamaEmbeddingsRequest(model="m", prompt="a")), 5)
        return first, second

    first, second = asyncio.run(both())
    assert first.status_code == second.status_code == CLIENT_GONE
    assert serving.cancelled == 2
