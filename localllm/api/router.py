"""Each request's ``model`` resolved through the :class:`~localllm.serving.pool.ModelPool`: :class:`ModelRouter`
holds a lease on the model until the response has ended (a stream: its last event), so that a model is
never unloaded under a request, keeps one :class:`~localllm.api.openai.serving.OpenAIServing` per loaded model,
and has the server-wide routes' logic (models, ``/api/ps``, ``/api/unload``, health)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi.responses import Response

from localllm.api.errors import error_response
from localllm.api.metrics import Metrics
from localllm.api.openai.model_protocol import ModelCard, ModelList, UnloadRequest
from localllm.api.openai.serving import OpenAIServing
from localllm.api.streaming import EventStream
from localllm.engine.async_engine import AsyncEngine
from localllm.errors import EngineDeadError, ModelNotFoundError
from localllm.serving.catalog import ModelCatalog, ModelSource
from localllm.serving.pool import KEEP_ALIVE_UNSET, LoadedModel, ModelPool


class ModelRouter:
    """Each request's ``model`` through the :class:`~localllm.serving.pool.ModelPool` (loading it on first
    use), one :class:`OpenAIServing` per loaded model, and the server-wide routes' logic
    (``/v1/models``, ``/api/ps``, ``/api/unload``, ``/health``, ``/metrics``)."""

    def __init__(self, pool: ModelPool, max_client_priority: int = 0) -> None:
        self.pool = pool
        self.max_client_priority = max_client_priority  # the most urgent priority a request may ask for
        self.metrics = Metrics(self.engines)
        self.created = int(time.time())
        self._servings: dict[str, OpenAIServing] = {}
        # Each loaded model's serving (and its metrics' series) from the moment it loads.
        for model in pool.loaded():
            self.serving(model)
        pool.on_load(self.serving)
        pool.on_unload(lambda model: self._servings.pop(model.name, None))

    def engines(self) -> list[tuple[str, AsyncEngine]]:
        return [(m.name, m.engine) for m in self.pool.loaded() if m.engine is not None]

    def serving(self, model: LoadedModel) -> OpenAIServing:
        serving = self._servings.get(model.name)
        if serving is None or serving.engine is not model.engine:
            serving = OpenAIServing(model.engine, model.name, self.metrics.for_model(model.name, model.engine),
                                    check_names=False, max_client_priority=self.max_client_priority,
                                    defaults=model.source.defaults)
            self._servings[model.name] = serving
        return serving

    async def run(self, body, work: Callable[[OpenAIServing], Awaitable[Response]]) -> Response:
        """``work`` on the serving of ``body.model``, under a lease on that model that lasts until
        the response has ended (for a stream: until its last event)."""
        keep_alive = body.keep_alive if getattr(body, "keep_alive", None) is not None else KEEP_ALIVE_UNSET
        lease = await self.pool.lease(getattr(body, "model", None), keep_alive)
        try:
            response = await work(self.serving(lease.model))
        except BaseException:
            lease.release()
            raise
        if isinstance(response, EventStream):
            response.on_close(lease.release)
        else:
            lease.release()
        return response

    # ---------------------------------------------------------------- server-wide routes

    def _card(self, source: ModelSource) -> ModelCard:
        model = self.pool.get(source.name)
        engine = model.engine if model is not None else None
        header_context = self.pool.catalog.context_length(source)
        if engine is not None:
            context = int(engine.max_model_len)
        else:
            context = header_context
        created = self.created
        created_at = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat()
        return ModelCard(
            id=source.name,
            created=created,
            root=source.name,  # (never the file's path: the listing is open to every client)
            max_model_len=context or 0,
            display_name=source.name,
            created_at=created_at.replace("+00:00", "Z"),
            loaded=engine is not None,
            quant=source.quant if source.quant is not None else (engine.model_info().quant if engine else None),
            size_bytes=source.size_bytes,
            context_length=context,
        )

    def models(self) -> ModelList:
        cards = [self._card(source) for source in self.pool.catalog.sources()]
        return ModelList(data=cards, first_id=cards[0].id if cards else None, last_id=cards[-1].id if cards else None)

    def ps(self) -> dict:
        out = []
        now = time.time()
        for model in self.pool.loaded():
            engine = model.engine
            if engine is None:
                continue
            stats = engine.stats()
            expires_in = self.pool.expires_in(model)
            expires_at = None
            if expires_in is not None:
                expires_at = datetime.datetime.fromtimestamp(now + expires_in, datetime.timezone.utc)
                expires_at = expires_at.isoformat().replace("+00:00", "Z")
            info = engine.model_info()
            quant = model.source.quant or info.quant
            out.append({
                "name": model.name,
                "model": model.name,  # (Ollama's fields: model, size, size_vram, digest, details)
                "size": model.memory_bytes,
                "size_vram": model.memory_bytes if info.device.startswith("cuda") else 0,
                "digest": "",
                "details": {"format": "gguf", "family": info.architecture, "families": [info.architecture],
                            "parameter_size": "", "quantization_level": quant or ""},
                "quant": quant,
                "device": info.device,  # where it runs, on which kernels, in which dtype
                "kernels": info.kernels,
                "dtype": info.dtype,
                "size_bytes": model.memory_bytes,
                "parameters": info.parameters,
                "active_parameters": info.active_parameters,
                "context_length": int(engine.max_model_len),
                "kv_cache_type": info.kv_cache_dtype,  # keys/values, as llama.cpp names them (f16, q8_0/q4_0)
                "running": int(stats.num_running),
                "waiting": int(stats.num_waiting),
                # speculative decoding: drafted tokens, and the share the model agreed with (null: none yet)
                "spec_drafted_tokens": int(stats.spec_drafted_tokens),
                "spec_acceptance": stats.spec_acceptance_rate,
                "expires_at": expires_at,
            })
        return {"models": out}

    async def unload(self, body: UnloadRequest) -> dict:
        result = await self.pool.unload(body.model)
        out: dict = {"model": body.model, "unloaded": result.unloaded}
        if result.pending:
            out["pending"] = True
        return out

    def health(self) -> Response:
        for _name, engine in self.engines():
            state = engine.health()
            if not state.ok:
                return error_response(EngineDeadError(state.reason or "the engine is not healthy",
                                                      code="engine_stalled" if state.stalled else "engine_dead"))
        return Response(status_code=200)


def pool_for_engine(engine: AsyncEngine, served_model_name: str) -> ModelPool:
    """A pool holding just ``engine`` (owned by the caller: never unloaded) under ``served_model_name``."""
    info = engine.model_info()
    path = Path(info.path)
    size = path.stat().st_size if path.is_file() else 0
    source = ModelSource(served_model_name, path, info.quant, size, pinned=True)
    pool = ModelPool(ModelCatalog([source], include_store=False), _no_loading)
    pool.add_loaded(source, engine, owned=False)
    pool.default_model = served_model_name
    return pool


def _no_loading(source: ModelSource):
    raise ModelNotFoundError(f"The model `{source.name}` is not loaded.", param="model", code="model_not_found")
