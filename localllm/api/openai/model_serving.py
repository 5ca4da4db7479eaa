"""The routes about one loaded model other than its generation, independent of routing
(:class:`ModelServing`): tokenize, detokenize and the tokenizer's facts, ``/v1/embeddings`` and
``/v1/rerank``; and the check every route makes of the ``model`` a request names.
:class:`~localllm.api.openai.serving.OpenAIServing` adds the generation routes.

An embeddings or rerank request whose client goes away is cancelled (its handler polls
``request.is_disconnected()`` while it waits), and so are its queued inputs: the engine computes
nothing for a client that left.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import Awaitable
from typing import TypeVar

import torch
from fastapi import Request
from fastapi.responses import Response

from localllm.api.background import in_background
from localllm.api.openai.model_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    RerankRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from localllm.engine.async_engine import AsyncEngine
from localllm.engine.embeddings import RANK, normalize
from localllm.errors import InvalidRequestError, ModelNotFoundError

DISCONNECT_POLL_SECONDS = 0.25
CLIENT_GONE = 499  # nginx's status for a request its client closed; nobody reads it

T = TypeVar("T")


class ClientGone(Exception):
    """The client of a request went away before its answer was ready."""


async def while_connected(request: Request | None, work: Awaitable[T]) -> T:
    """``work``'s result; cancelled, and :class:`ClientGone` raised, once ``request``'s client has gone
    (checked every :data:`DISCONNECT_POLL_SECONDS`). ``request`` None: ``work`` alone."""
    if request is None:
        return await work
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone
    finally:
        task.cancel()


def json_response(body) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")


class ModelServing:
    """One loaded model's routes that generate nothing, and the model check."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, *, check_names: bool = True) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.tokenizer = engine.tokenizer
        self.model_info = engine.model_info()
        self.vocab_size = self.model_info.vocab_size
        self.check_names = check_names
        self.created = int(time.time())

    def check_model(self, model: str | None) -> None:
        if self.check_names and model and model != self.served_model_name:
            raise ModelNotFoundError(
                f"The model `{model}` does not exist; this server serves `{self.served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequestError("messages must contain at least one message", param="messages")
            text = self.tokenizer.render_chat(
                [m.to_template() for m in req.messages], req.add_generation_prompt
            )
        else:
            text = req.prompt
        ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens, parse_special=req.parse_special)
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.engine.max_model_len,
            tokens=ids,
            token_strs=self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
        )

    def tokenizer_info(self, _=None) -> TokenizerInfo:
        tok = self.tokenizer
        return TokenizerInfo(
            eos_token=tok.eos_token or None, bos_token=tok.bos_token or None, pad_token=None,
            chat_template=tok.chat_template, model_max_length=self.engine.max_model_len,
            add_bos_token=tok.add_bos_token,
        )

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="tokens"
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))


    def rerank_prompt(self, query: str, document: str) -> list[int]:
        """A (query, document) pair's tokens as llama-server makes them: the model's rerank template
        with ``{query}`` and ``{document}`` filled in (special tokens parsed), else the tokenizer's
        flags decide: BOS where it adds one, the query, EOS (or SEP without one) where it adds EOS,
        SEP where it adds one, the document, EOS where it adds EOS."""
        tok = self.tokenizer
        template = self.engine.rerank_template
        if template is not None:
            return tok.encode(template.replace("{query}", query).replace("{document}", document),
                              add_special_tokens=False)
        sep = tok.sep_token_id
        end = tok.eos_token_id if tok.eos_token_id is not None else sep
        eos = [end] if tok.add_eos_token and end is not None else []
        seps = [sep] if tok.add_sep_token and sep is not None else []
        bos = [tok.bos_token_id] if tok.add_bos_token and tok.bos_token_id is not None else []
        return (bos + tok.encode(query, add_special_tokens=False) + eos + seps
                + tok.encode(document, add_special_tokens=False) + eos)

    async def rerank(self, req: RerankRequest, request: Request | None = None) -> Response:
        """``/v1/rerank``: each document's relevance to the query, from a reranker's classifier (see
        :mod:`localllm.engine.embeddings`, pooling ``rank``), best first, ``top_n`` of them."""
        self.check_model(req.model)
        if self.engine.pooling != RANK:
            raise InvalidRequestError(
                f"the model `{self.served_model_name}` is not a reranker (its pooling is {self.engine.pooling!r}; a "
                "reranker's GGUF has pooling type rank and a cls.output head, as llama.cpp's converter writes "
                "Qwen3-Reranker)", param="model")
        texts = req.items()
        limit = self.engine.max_model_len

        def tokenize() -> list[list[int]]:
            out = []
            for i, text in enumerate(texts):
                ids = self.rerank_prompt(req.query, text)
                if not ids:
                    raise InvalidRequestError(f"the query with document {i} makes an empty prompt",
                                              param="texts" if req.tei else "documents")
                if len(ids) > limit:
                    raise InvalidRequestError(f"the query with document {i} has {len(ids)} tokens, more than this "
                                              f"model's context of {limit}", code="context_length_exceeded",
                                              param="texts" if req.tei else "documents")
                out.append(ids)
            return out

        token_ids = await in_background(tokenize)
        try:
            scores = await while_connected(request, self.engine.embed_many(token_ids))
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        ranked = sorted(range(len(texts)), key=lambda i: -float(scores[i][0]))[: req.top_n or len(texts)]
        if req.tei:
            body = [{"index": i, "score": float(scores[i][0]), **({"text": texts[i]} if req.return_text else {})}
                    for i in ranked]
            return Response(json.dumps(body), media_type="application/json")
        n = sum(len(t) for t in token_ids)
        results = [{"index": i, "relevance_score": float(scores[i][0]),
                    **({"document": {"text": texts[i]}} if req.return_documents else {})} for i in ranked]
        body = {"id": f"rerank-{uuid.uuid4().hex}", "model": self.served_model_name, "object": "list",
                "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results}
        return Response(json.dumps(body), media_type="application/json")

    async def embeddings(self, req: EmbeddingRequest, request: Request | None = None) -> Response:
        """``/v1/embeddings``: each input through the engine's batching window (see
        :mod:`localllm.engine.embeddings`), pooled, normalized, optionally cut to ``dimensions``."""
        self.check_model(req.model)
        try:
            normed, n = await while_connected(request, self.embed_items(req.inputs(), req.dimensions))
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        data = []
        for i, v in enumerate(normed):
            if req.encoding_format == "base64":
                value: list[float] | str = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
            else:
                value = v.tolist()
            data.append(EmbeddingData(index=i, embedding=value))
        return json_response(EmbeddingResponse(data=data, model=self.served_model_name,
                                               usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n)))

    async def embed_items(self, items: list, dimensions: int | None = None) -> tuple[torch.Tensor, int]:
        """Each text or token id list of ``items`` through the engine's batching window, pooled and
        normalized (cut to ``dimensions``): ``(vectors [len(items), D], prompt tokens in all)``; the
        embedding routes' one path (OpenAI's and Ollama's)."""
        if self.engine.pooling == RANK:
            raise InvalidRequestError(f"the model `{self.served_model_name}` is a reranker: use /v1/rerank",
                                      param="model")
        limit = self.engine.max_model_len
        encode = self.engine.encode_prompt

        def tokenize() -> list[list[int]]:
            out = []
            for i, item in enumerate(items):
                ids = encode(item)
                if len(ids) > limit:
                    raise InvalidRequestError(f"input {i} has {len(ids)} tokens, more than this model's context "
                                              f"of {limit}", param="input", code="context_length_exceeded")
                out.append(ids)
            return out

        token_ids = await in_background(tokenize)
        vectors = await self.engine.embed_many(token_ids)
        return normalize(torch.stack(vectors), dimensions), sum(len(t) for t in token_ids)
