"""``localllm serve``: one AsyncEngine behind the OpenAI-compatible API, on uvicorn.

``register(app)`` adds the command to the main typer app. Settings are the project's
(:func:`localllm.config.settings.load_settings`, one table of them in :mod:`localllm.config.settings`):
``LOCALLLM_HOME/config.toml`` (or ``--config FILE``), then ``LOCALLLM_*`` variables, then flags (one
per setting, named as in the table); :meth:`~localllm.config.settings.Settings.engine_config` turns them into
the engine's configuration. SIGINT/SIGTERM stop accepting, give in-flight
requests ``--shutdown-timeout`` seconds, abort the rest and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Optional

import typer

from localllm.engine.device import resolve_device
from localllm.errors import InvalidRequestError, LocalLLMError

DEFAULT_SHUTDOWN_TIMEOUT = 10.0


def ready_line(model_name: str | None, host: str, port: int, engine=None, num_models: int = 0) -> str:
    """What ``serve`` prints once it listens: the pinned model and its KV cache, or how many models
    of the store it offers (loaded on demand)."""
    url_host = f"[{host}]" if ":" in host else host
    if engine is None:
        return (f"localllm serving {num_models} models from the store at http://{url_host}:{port} "
                "(each loads on its first request)")
    stats = engine.stats()
    return (
        f"localllm serving {model_name} at http://{url_host}:{port} "
        f"(KV cache: {stats.num_blocks} blocks x {stats.block_size} tokens, context {engine.max_model_len})"
    )


def _make_server(config, pool, model_name: str | None, shutdown_timeout: float):
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

        async def shutdown(self, sockets=None) -> None:
            # The engines stop taking requests at once and abort what is left after the timeout,
            # which ends those responses; uvicorn meanwhile closes the listener and waits for them.
            drain = asyncio.ensure_future(asyncio.to_thread(pool.shutdown, shutdown_timeout))
            await super().shutdown(sockets)
            await drain

    return Server(config)


def _serve_argv(options: dict, verbose: bool) -> list[str]:
    """``serve`` arguments that reproduce ``options`` (the flags given, None = not given) — except the
    API key: ``ps`` shows a command line to every user, so :func:`_detach` passes it in the environment."""
    argv = [options["model"]] if options.get("model") else []
    for key, value in options.items():
        if key == "api_key":
            continue
        if key == "enable_prefix_caching":
            argv += ["--no-prefix-caching"] if value is False else []
        elif key == "fast_math":
            argv += ["--fast-math"] if value else []
        elif key != "model" and value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv + ["--verbose"] * verbose


def _detach(settings, argv: list[str]) -> int:
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
        f"localllm serving {name} at http://{settings.host}:{settings.port} in the background "
        f"(pid {rec.pid}, log {rec.log_file}); `localllm stop` stops it"
    )
    return 0


def build_pool(settings, device: str = "cpu", on_engine_death=None):
    """The server's :class:`~localllm.serving.pool.ModelPool` and its pinned model's name (None without one).

    ``serve MODEL`` (MODEL from a flag, ``LOCALLLM_MODEL`` or config.toml) loads MODEL now and pins it
    as the default model; every model in the store loads on its first request either way."""
    import dataclasses

    from localllm.config.engine import parse_bytes
    from localllm.engine.async_engine import AsyncEngine
    from localllm.engine.device import resolve_dtype
    from localllm.serving.planner import plan_load, read_model_facts
    from localllm.serving.catalog import ModelCatalog, ModelSource
    from localllm.serving.pool import ModelPool, fix_mmap_threshold, parse_keep_alive
    from localllm.store import resolve_model_path

    fix_mmap_threshold()  # so that unloading a model hands all of its memory back
    if settings.max_loaded_models < 1:
        raise InvalidRequestError(f"max_loaded_models must be at least 1, got {settings.max_loaded_models}")
    stall_timeout = float(settings.stall_timeout)
    kv_cache_memory = parse_bytes(settings.kv_cache_memory)

    def plan(source: ModelSource):
        return plan_load(read_model_facts(source.path), name=source.name, kv_cache_memory=kv_cache_memory,
                         max_model_len=settings.max_model_len, kv_cache_dtype=settings.kv_cache_dtype,
                         dtype=resolve_dtype(settings.dtype, device), device=device)

    def engine_config(source: ModelSource):
        overrides = {}
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
    if settings.sources.get("model", "default") == "default":
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


def run_server(
    settings, device: str = "cpu", shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, verbose: bool = False
) -> int:
    """Load the engine, serve until a signal, drain; the exit status."""
    import uvicorn

    from localllm.api.guard import allowed_host_names, is_loopback
    from localllm.api.server import build_app
    from localllm.config.engine import parse_bytes

    if settings.stall_timeout < 1:
        raise InvalidRequestError(f"stall_timeout must be a positive number of seconds, got {settings.stall_timeout}")
    max_request_bytes = parse_bytes(settings.max_request_bytes)
    if max_request_bytes < 1024:
        raise InvalidRequestError(f"max_request_bytes must be at least 1 KiB, got {settings.max_request_bytes}")
    if not is_loopback(settings.host) and not settings.api_key:
        typer.echo(
            f"Warning: serving on {settings.host} without an API key: anyone who can reach this address can use "
            "the model (set --api-key or LOCALLLM_API_KEY)",
            err=True,
        )
    died: list[BaseException] = []
    stopping: list = []  # the server, once it exists

    def on_engine_death(cause: BaseException) -> None:
        # A server whose engine is gone answers nothing useful: exit non-zero, so that the
        # service manager (systemd's Restart=on-failure, launchd's KeepAlive) starts a new one.
        died.append(cause)
        for server in stopping:
            server.should_exit = True

    pool, model_name = build_pool(settings, device, on_engine_death)
    app = build_app(
        pool, None, settings.api_key,
        max_request_bytes=max_request_bytes,
        allowed_hosts=allowed_host_names(settings.host, settings.allowed_host_list),
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        lifespan="off",
        access_log=verbose,
        log_level="info" if verbose else "warning",
        timeout_graceful_shutdown=shutdown_timeout + 5,
    )
    server = _make_server(config, pool, model_name, shutdown_timeout)
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


def serve(
    model: Optional[str] = typer.Argument(None, help="Catalog name, hub name or path to a .gguf file."),
    host: Optional[str] = typer.Option(
        None, "--host", help="Address to bind (default 127.0.0.1: this machine only)."
    ),
    port: Optional[int] = typer.Option(None, "--port", help="Port; 0 picks a free one."),
    config: Optional[Path] = typer.Option(
        None,
        "--config",
        help="Settings file instead of LOCALLLM_HOME/config.toml (keys: the flag names with underscores).",
    ),
    served_model_name: Optional[str] = typer.Option(
        None, "--served-model-name", help="The model name clients send (default: MODEL as given)."
    ),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="Require 'Authorization: Bearer KEY' (also LOCALLLM_API_KEY)."
    ),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="auto (float32 on a CPU, bfloat16 or float16 on a GPU), float32, bfloat16 or float16."
    ),
    device: str = typer.Option(
        "auto", "--device", help="auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N."
    ),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context window in tokens."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, "--max-num-batched-tokens", help="Token budget of one engine step."
    ),
    max_num_seqs: Optional[int] = typer.Option(
        None, "--max-num-seqs", help="Most requests in the running batch."
    ),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="e.g. 512MiB, 2GiB."),
    kv_cache_dtype: Optional[str] = typer.Option(
        None, "--kv-cache-dtype", help="auto (float16 on the native CPU path, else the model's dtype), float32, "
        "bfloat16 or float16."
    ),
    max_waiting: Optional[int] = typer.Option(
        None, "--max-waiting", help="Most queued requests; more get HTTP 429."
    ),
    no_prefix_caching: bool = typer.Option(
        False, "--no-prefix-caching", help="Do not reuse the KV blocks of shared prompt prefixes."
    ),
    batching: Optional[str] = typer.Option(None, "--batching", help="continuous or static."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="CPU threads (default: every core)."),
    pooling: Optional[str] = typer.Option(
        None, "--pooling", help="How /v1/embeddings pools a text: mean, last or cls (default: the model's metadata, "
        "else mean)."
    ),
    fast_math: bool = typer.Option(
        False, "--fast-math", help="Faster large decode batches; a request's tokens may then change with the "
        "other requests in its steps (default: batch-invariant)."
    ),
    speculative: Optional[str] = typer.Option(
        None, "--speculative", help="Speculative decoding: auto (draft with --draft-model, else ngram, where the "
        "kernels are batch-invariant: no token changes), ngram (drafts from the prompt and output), suffix (and from "
        "recent answers), draft or off (also LOCALLLM_SPECULATIVE)."
    ),
    draft_max: Optional[int] = typer.Option(
        None, "--draft-max", help="Most tokens drafted for one request in one step (8)."
    ),
    draft_model: Optional[str] = typer.Option(
        None, "--draft-model", help="A smaller model with MODEL's vocabulary that drafts tokens for it (catalog "
        "name, hub name or path)."
    ),
    shutdown_timeout: float = typer.Option(
        DEFAULT_SHUTDOWN_TIMEOUT,
        "--shutdown-timeout",
        help="Seconds in-flight requests get on SIGINT/SIGTERM.",
    ),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="Run in the background; `localllm stop` stops it."
    ),
    max_request_bytes: Optional[str] = typer.Option(
        None, "--max-request-bytes", help="Largest request body (default 8MiB); larger ones get HTTP 413."
    ),
    allowed_hosts: Optional[str] = typer.Option(
        None, "--allowed-hosts",
        help="Extra Host header names to answer, comma-separated (a loopback server answers only loopback "
        "names by default, against DNS rebinding); '*' answers any.",
    ),
    stall_timeout: Optional[int] = typer.Option(
        None, "--stall-timeout", help="Seconds one engine step may take before /health reports a stall (120)."
    ),
    keep_alive: Optional[str] = typer.Option(
        None, "--keep-alive", help="How long a model stays loaded after its last request: seconds or 30s, 5m, "
        "1h (5m); -1 keeps it loaded, 0 unloads it after each request."
    ),
    max_loaded_models: Optional[int] = typer.Option(
        None, "--max-loaded-models", help="Most models loaded at once (3); one more unloads the least recently "
        "used idle one."
    ),
    memory_budget: Optional[str] = typer.Option(
        None, "--memory-budget", help="Memory the loaded models may use together, e.g. 8GiB (default: the free "
        "memory when a model loads)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log engine events and every request."),
) -> None:
    """Serve the store's models over an OpenAI-compatible HTTP API (/v1/chat/completions, ...), each loaded on
    its first request; with MODEL, that one is loaded now and is the default."""
    from localllm.config.settings import load_settings

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    flags = dict(
        model=model,
        host=host,
        port=port,
        served_model_name=served_model_name,
        api_key=api_key,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kv_cache_memory=kv_cache_memory,
        kv_cache_dtype=kv_cache_dtype,
        max_waiting=max_waiting,
        batching=batching,
        threads=threads,
        enable_prefix_caching=False if no_prefix_caching else None,
        fast_math=True if fast_math else None,
        pooling=pooling,
        speculative=speculative,
        draft_max=draft_max,
        draft_model=draft_model,
        max_request_bytes=max_request_bytes,
        allowed_hosts=allowed_hosts,
        stall_timeout=stall_timeout,
        keep_alive=keep_alive,
        max_loaded_models=max_loaded_models,
        memory_budget=memory_budget,
    )
    try:
        if config is not None and not config.is_file():
            raise InvalidRequestError(f"the config file {config} does not exist")
        settings = load_settings(flags, path=config)
        if detach:
            extra = {"config": config, "device": device, "shutdown_timeout": shutdown_timeout}
            status = _detach(settings, _serve_argv({**flags, **extra}, verbose))
        else:
            status = run_server(settings, resolve_device(device), shutdown_timeout, verbose)
    except LocalLLMError as exc:
        typer.echo(f"Error: {' '.join(exc.message.split())}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(status)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to ``app``."""
    app.command("serve")(serve)


if __name__ == "__main__":  # pragma: no cover - `python -m localllm.api.cli ARGS` runs `serve ARGS`
    typer.run(serve)
