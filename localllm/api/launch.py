"""How ``localllm serve`` runs one server: :func:`build_pool` (the models, from the settings),
:func:`run_server` (the API app on uvicorn) and :func:`start_in_background` (the same in the background).

The command itself, its flags and its choice between one server and replicas, is
:mod:`localllm.cli.serve`. Settings are the project's (:func:`localllm.config.settings.load_settings`,
one table of them in :mod:`localllm.config.settings`); :meth:`~localllm.config.settings.Settings.engine_config`
turns them into the engine's configuration. SIGINT/SIGTERM stop accepting, give in-flight requests
``--shutdown-timeout`` seconds, abort the rest and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import typer

from localllm.errors import InvalidRequestError, LocalLLMError

DEFAULT_SHUTDOWN_TIMEOUT = 10.0


def server_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ready_line(model_name: str | None, host: str, port: int, engine=None, num_models: int = 0) -> str:
    """What ``serve`` prints once it listens: the pinned model and its KV cache, or how many models
    of the store it offers (loaded on demand)."""
    if engine is None:
        return (f"localllm serving {num_models} models from the store at {server_url(host, port)} "
                "(each loads on its first request)")
    stats = engine.stats()
    return (
        f"localllm serving {model_name} at {server_url(host, port)} "
        f"(KV cache: {stats.num_blocks} blocks x {stats.block_size} tokens, context {engine.max_model_len})"
    )


def _make_server(config, pool, model_name: str | None, shutdown_timeout: float, web_ui: bool = False):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn that drains the engine on shutdown and exits 0 after a signal."""

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the captured signal after a graceful stop (exit status 143 for
            # SIGTERM); a drained server exits 0 instead.
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                pinned = pool.get(model_name) if model_name else None
                engine = pinned.engine if pinned is not None else None
                print(ready_line(model_name, host, port, engine, len(pool.catalog.sources())), flush=True)
                if web_ui:
                    print(f"chat in a browser at {server_url(host, port)}/", flush=True)

        async def shutdown(self, sockets=None) -> None:
            # The engines stop taking requests at once and abort what is left after the timeout,
            # which ends those responses; uvicorn meanwhile closes the listener and waits for them.
            drain = asyncio.ensure_future(asyncio.to_thread(pool.shutdown, shutdown_timeout))
            await super().shutdown(sockets)
            await drain

    return Server(config)


def start_in_background(settings, argv: list[str]) -> int:
    from localllm.serving.service import start_detached

    if not settings.port:
        raise InvalidRequestError("--detach needs a fixed --port")
    pinned = settings.sources.get("model", "default") != "default"
    name = (settings.served_model_name or settings.model) if pinned else "the store's models"
    # The effective key (flag > LOCALLLM_API_KEY > config.toml) as the child's LOCALLLM_API_KEY, which
    # outranks its config.toml just as the flag would; never on its command line.
    env = {"LOCALLLM_API_KEY": settings.api_key} if settings.api_key else None
    try:
        rec = start_detached(argv, settings.host, settings.port, name, env=env)
    except RuntimeError as exc:
        raise LocalLLMError(str(exc)) from None
    typer.echo(
        f"localllm serving {name} at {server_url(settings.host, settings.port)} in the background "
        f"(pid {rec.pid}, log {rec.log_file}); `localllm stop` stops it"
    )
    return 0


def build_pool(settings, device: str = "cpu", on_engine_death=None, *, pin: bool = False):
    """The server's :class:`~localllm.serving.pool.ModelPool` and its pinned model's name (None without one).

    ``serve MODEL`` (MODEL from a flag, ``LOCALLLM_MODEL`` or config.toml) loads MODEL now and pins it
    as the default model; every model in the store loads on its first request either way. ``pin``: pin
    the settings' model even when it is the default one (``chat`` always talks to a model)."""
    import dataclasses

    from localllm.config.device import resolve_dtype
    from localllm.config.engine import kv_cache_types, parse_bytes
    from localllm.engine.async_engine import AsyncEngine
    from localllm.serving.catalog import ModelCatalog, ModelSource
    from localllm.serving.planner import plan_load, read_model_facts
    from localllm.serving.pool import ModelPool, fix_heap_policy, parse_keep_alive
    from localllm.store import resolve_model_path

    fix_heap_policy()  # unloading a model hands its memory back; a prompt's transients reuse freed pages
    if settings.max_loaded_models < 1:
        raise InvalidRequestError(f"max_loaded_models must be at least 1, got {settings.max_loaded_models}")
    stall_timeout = float(settings.stall_timeout)
    kv_cache_memory = parse_bytes(settings.kv_cache_memory)

    def variant(source: ModelSource, name: str):
        """A stored variant's own value of a parameter that sets how its model loads (None: the server's)."""
        return source.defaults.parameters.get(name) if source.defaults is not None else None

    def context_of(source: ModelSource) -> int | None:
        # A stored variant's PARAMETER num_ctx is its context, as in Ollama (over the server's setting)
        num_ctx = variant(source, "num_ctx")
        return num_ctx if isinstance(num_ctx, int) and num_ctx > 0 else settings.max_model_len

    def kv_types_of(source: ModelSource) -> dict[str, str | None]:
        # and its PARAMETER cache_type_k / cache_type_v its KV cache types
        return {side: variant(source, side) or getattr(settings, side) for side in ("cache_type_k", "cache_type_v")}

    def plan(source: ModelSource):
        return plan_load(read_model_facts(source.path), name=source.name, kv_cache_memory=kv_cache_memory,
                         max_model_len=context_of(source),
                         kv_cache_types=kv_cache_types(settings.kv_cache_dtype, **kv_types_of(source)),
                         dtype=resolve_dtype(settings.dtype, device), device=device)

    def engine_config(source: ModelSource):
        overrides = {"max_model_len": context_of(source), **kv_types_of(source)}
        if device.startswith("cuda") and kv_cache_memory is None:
            # alone, an engine sizes its KV cache from 90% of the free VRAM, which leaves no room for
            # the next model; in the pool it takes what its plan counted (the context it serves)
            overrides["kv_cache_memory"] = plan(source).kv_cache_bytes
        if settings.draft_model and not source.pinned:
            # the draft model drafts for `serve MODEL`'s model; others (another vocabulary, likely) load without it
            overrides["draft_model"] = None
            if settings.speculative == "draft":
                overrides["speculative"] = "auto"
        return dataclasses.replace(settings, model=str(source.path)).engine_config(device, **overrides)

    def load_engine(source: ModelSource) -> AsyncEngine:
        return AsyncEngine.from_config(engine_config(source), stall_timeout=stall_timeout)

    pool = ModelPool(
        ModelCatalog(),
        load_engine,
        plan,
        keep_alive=parse_keep_alive(settings.keep_alive, "keep_alive"),
        max_loaded_models=settings.max_loaded_models,
        memory_budget=parse_bytes(settings.memory_budget) if settings.memory_budget else None,
        device=device,
    )
    if on_engine_death is not None:
        pool.on_load(lambda model: model.engine.on_death(on_engine_death))
    if not pin and settings.sources.get("model", "default") == "default":
        return pool, None
    name = settings.served_model_name or settings.model
    path = Path(resolve_model_path(settings.model))
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    source = ModelSource(name, path, None, size, pinned=True)
    engine = load_engine(source)
    source = dataclasses.replace(source, quant=engine.model_info().quant)
    try:
        memory_plan = plan(source)
    except Exception:  # noqa: BLE001 - a plan is for display here; the model is loaded already
        memory_plan = None
    pool.add_loaded(source, engine, memory_plan)
    pool.default_model = name
    return pool, name


def check_server_settings(settings) -> None:
    """What a server's settings must be before anything loads (an InvalidRequestError naming the setting);
    a warning line for a server that anyone on the network may use."""
    from localllm.api.guard import is_loopback
    from localllm.config.engine import parse_bytes

    if settings.stall_timeout < 1:
        raise InvalidRequestError(f"stall_timeout must be a positive number of seconds, got {settings.stall_timeout}")
    if parse_bytes(settings.max_request_bytes) < 1024:
        raise InvalidRequestError(f"max_request_bytes must be at least 1 KiB, got {settings.max_request_bytes}")
    if not is_loopback(settings.host) and not settings.api_key:
        typer.echo(
            f"Warning: serving on {settings.host} without an API key: anyone who can reach this address can use "
            "the model (set --api-key or LOCALLLM_API_KEY)",
            err=True,
        )


def server_app(settings, pool):
    """The API app over ``pool`` as ``settings`` configure it (the API key, the largest body, the Host names
    it answers, the most urgent priority a client may ask for, the web chat page): ``serve``'s and ``chat``'s."""
    from localllm.api.guard import allowed_host_names
    from localllm.api.server import build_app
    from localllm.config.engine import parse_bytes

    return build_app(
        pool, None, settings.api_key,
        max_request_bytes=parse_bytes(settings.max_request_bytes),
        allowed_hosts=allowed_host_names(settings.host, settings.allowed_host_list),
        max_client_priority=settings.max_client_priority,
        web_ui=settings.web_ui,
    )


def run_server(
    settings, device: str = "cpu", shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, verbose: bool = False
) -> int:
    """Load the engine, serve until a signal, drain; the exit status."""
    import uvicorn

    check_server_settings(settings)
    died: list[BaseException] = []
    stopping: list = []  # the server, once it exists

    def on_engine_death(cause: BaseException) -> None:
        # A server whose engine is gone answers nothing useful: exit non-zero, so that the
        # service manager (systemd's Restart=on-failure, launchd's KeepAlive) starts a new one.
        died.append(cause)
        for server in stopping:
            server.should_exit = True

    pool, model_name = build_pool(settings, device, on_engine_death)
    config = uvicorn.Config(
        server_app(settings, pool),
        host=settings.host,
        port=settings.port,
        lifespan="off",
        access_log=verbose,
        log_level="info" if verbose else "warning",
        timeout_graceful_shutdown=shutdown_timeout + 5,
    )
    server = _make_server(config, pool, model_name, shutdown_timeout, settings.web_ui)
    stopping.append(server)
    if died:
        server.should_exit = True
    try:
        server.run()
    finally:
        pool.shutdown(timeout=0)
    if died:
        typer.echo(f"Error: the engine stopped ({died[0]!r}); exiting so that the service restarts", err=True)
        return 1
    return 0 if server.started else 1
