"""``localllm serve``: the command, its flags, and the choice between one server
(:func:`localllm.api.launch.run_server`, or :func:`~localllm.api.launch.start_in_background` in the background) and
replicas on Ray Serve (:func:`localllm.cluster.launch.run_cluster`, with ``--replicas``).

Flags are the settings of :mod:`localllm.config.settings` (one per setting, named as in the table):
``LOCALLLM_HOME/config.toml`` (or ``--config FILE``), then ``LOCALLLM_*`` variables, then flags.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from localllm.api.launch import DEFAULT_SHUTDOWN_TIMEOUT, run_server, serve_argv, start_in_background
from localllm.cluster import require_ray
from localllm.config.settings import load_settings
from localllm.engine.device import resolve_device
from localllm.errors import InvalidRequestError, LocalLLMError


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
    replicas: Optional[int] = typer.Option(
        None, "--replicas", help="Run N engines as Ray Serve replicas behind one endpoint, prompts routed to where "
        "their prefix is cached (pip install 'localllm[cluster]'; docs/scale-out.md)."
    ),
    min_replicas: Optional[int] = typer.Option(
        None, "--min-replicas", help="With --replicas: autoscale on queue length down to this many."
    ),
    max_replicas: Optional[int] = typer.Option(
        None, "--max-replicas", help="With --replicas: autoscale on queue length up to this many."
    ),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", help="With --replicas: the Ray cluster to join (default: start a local Ray)."
    ),
    routing: Optional[str] = typer.Option(
        None, "--routing", help="With --replicas: prefix (to where the prompt's prefix is cached, else the "
        "shortest queue; default) or queue (the shorter queue of two)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log engine events and every request."),
) -> None:
    """Serve the store's models over an OpenAI-compatible HTTP API (/v1/chat/completions, ...), each loaded on
    its first request; with MODEL, that one is loaded now and is the default."""
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
        replicas=replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        ray_address=ray_address,
        routing=routing,
    )
    try:
        if config is not None and not config.is_file():
            raise InvalidRequestError(f"the config file {config} does not exist")
        settings = load_settings(flags, path=config)
        if settings.replicas is not None or settings.min_replicas is not None or settings.max_replicas is not None:
            if detach:
                raise InvalidRequestError("--replicas runs in the foreground (Ray keeps its own processes); "
                                          "drop --detach")
            require_ray()
            from localllm.cluster.launch import run_cluster  # imports Ray: an optional extra

            status = run_cluster(settings, resolve_device(device), verbose)
        elif detach:
            extra = {"config": config, "device": device, "shutdown_timeout": shutdown_timeout}
            status = start_in_background(settings, serve_argv({**flags, **extra}, verbose))
        else:
            status = run_server(settings, resolve_device(device), shutdown_timeout, verbose)
    except LocalLLMError as exc:
        typer.echo(f"Error: {' '.join(exc.message.split())}", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(status)


def register(app: typer.Typer) -> None:
    """Add ``serve`` to ``app``."""
    app.command("serve")(serve)
