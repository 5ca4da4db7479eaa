"""The OpenAI-compatible HTTP API over a :class:`~localllm.serving.pool.ModelPool` (or one AsyncEngine).

``build_app(pool)`` serves every model the pool offers, each loaded on its first request;
``build_app(engine, served_model_name, api_key)`` serves one engine the caller owns. The app neither
starts nor stops engines itself (``localllm serve``, the pool and the TUI own that). Routes:
``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or SSE),
``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (vLLM's), llama-server's ``POST /infill`` (fill-in-the-middle),
``POST /v1/embeddings``, ``POST /v1/rerank`` (also ``/rerank``, ``/v1/reranking``,
``/reranking``: llama-server's paths), ``GET /api/ps`` and ``POST /api/unload`` (loaded models), ``GET /health``,
``GET /metrics``; OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``: :mod:`localllm.api.responses.serving`); Anthropic's ``POST /v1/messages`` and ``POST
/v1/messages/count_tokens`` from :mod:`localllm.api.anthropic.serving`. Errors go through
:mod:`localllm.api.errors`.

:class:`~localllm.api.router.ModelRouter` resolves each request's ``model`` through the pool (see
:mod:`localllm.api.router`); :class:`~localllm.api.openai.serving.OpenAIServing` is one loaded model's
handlers; :mod:`localllm.api.guard` checks hosts, bodies and the API key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from localllm import __version__
from localllm.api.anthropic import serving as anthropic
from localllm.api.background import in_background
from localllm.api.errors import install_error_handlers
from localllm.api.guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    ApiKeyMiddleware,
    BodyCheck,
    CrossSiteCheck,
    HostCheck,
)
from localllm.api.ollama.serving import add_ollama_routes
from localllm.api.openai.model_protocol import (
    DetokenizeRequest,
    EmbeddingRequest,
    ModelList,
    RerankRequest,
    TokenizeRequest,
    UnloadRequest,
)
from localllm.api.openai.model_serving import json_response
from localllm.api.openai.protocol import ChatCompletionRequest, CompletionRequest, InfillRequest
from localllm.api.responses.protocol import ResponsesRequest
from localllm.api.responses.serving import ResponsesServing
from localllm.api.responses.store import ResponseStore
from localllm.api.router import ModelRouter, pool_for_engine
from localllm.api.webchat import add_web_chat
from localllm.engine.async_engine import AsyncEngine
from localllm.serving.pool import ModelPool


def build_app(
    engine: AsyncEngine | ModelPool,
    served_model_name: str | None = None,
    api_key: str | None = None,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_hosts: frozenset[str] | None = None,
    response_store: ResponseStore | None = None,
    max_client_priority: int = 0,
    web_ui: bool = True,
) -> FastAPI:
    """The API app over a :class:`~localllm.serving.pool.ModelPool` (every model it offers, loaded on
    demand), or over one ``engine`` served as ``served_model_name`` (the caller's: the app neither
    starts nor stops it); with ``api_key``, every path but /health and the chat page needs it.

    ``allowed_hosts`` (see :func:`localllm.api.guard.allowed_host_names`) are the Host names it
    answers, None for any; bodies over ``max_request_bytes`` get 413, POSTs that are not JSON 415.
    ``response_store`` keeps ``/v1/responses``' answers (a default-sized one when None).
    ``max_client_priority``: the most urgent ``priority`` a request may ask for (lower runs first); one
    below it is raised to it, so that no client can jump every queue. ``web_ui``: the chat page at ``/``
    (:mod:`localllm.api.webchat`).
    """
    if isinstance(engine, ModelPool):
        pool = engine
    else:
        if served_model_name is None:
            raise TypeError("build_app(engine, served_model_name): the name clients send is required")
        pool = pool_for_engine(engine, served_model_name)
    app = FastAPI(title="localllm", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    # The last added runs first: Host check, cross-site check, the API key, then the body's type and size.
    app.add_middleware(BodyCheck, max_request_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(CrossSiteCheck)
    app.add_middleware(HostCheck, allowed_hosts=allowed_hosts)
    # Outermost: errors of every layer on /v1/messages* leave in Anthropic's shape.
    app.add_middleware(anthropic.AnthropicErrorShape)
    router = ModelRouter(pool, max_client_priority)
    app.state.router = router
    app.state.pool = pool
    responses = app.state.responses = response_store if response_store is not None else ResponseStore()
    anthropic.add_anthropic_routes(app, router)
    add_ollama_routes(app, router)
    if web_ui:
        add_web_chat(app)

    @app.get("/v1/models")
    def list_models() -> ModelList:  # reads file headers: on the thread pool
        return router.models()

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await router.run(body, lambda serving: serving.chat(body, request))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await router.run(body, lambda serving: serving.completion(body, request))

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        if body.previous_response_id:  # an unknown id is a 404 before any model is loaded for it
            responses.conversation(body.previous_response_id)
        return await router.run(body, lambda serving: ResponsesServing(serving, responses).create(body, request))

    @app.get("/v1/responses/{response_id}")
    def get_response(response_id: str) -> dict:
        return responses.response(response_id)

    @app.delete("/v1/responses/{response_id}")
    def delete_response(response_id: str) -> dict:
        responses.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/infill")
    async def infill(body: InfillRequest, request: Request) -> Response:
        return await router.run(body, lambda serving: serving.infill(body, request))

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await router.run(body, lambda serving: serving.embeddings(body, request))

    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await router.run(body, lambda serving: serving.rerank(body, request))

    for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking"):  # llama-server's four paths
        app.post(path)(rerank)

    # Tokenizing a long text must not stall the event loop (and every stream on it): a worker thread.
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await router.run(body, lambda serving: _in_thread(serving.tokenize, body))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return await router.run(body, lambda serving: _in_thread(serving.detokenize, body))

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> Response:  # vLLM's: lm-eval's remote tokenizer reads it
        return await router.run(_ModelQuery(model=model), lambda serving: _in_thread(serving.tokenizer_info, None))

    @app.get("/api/ps")
    def list_loaded() -> dict:
        return router.ps()

    @app.post("/api/unload")
    async def unload(body: UnloadRequest) -> dict:
        return await router.unload(body)

    @app.get("/health")
    def health() -> Response:
        return router.health()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _ModelQuery(NamedTuple):
    """A GET route's ``?model=`` (None: the default model), where the router reads a body's."""

    model: str | None


async def _in_thread(fn: Callable, body) -> Response:
    return json_response(await in_background(fn, body))
