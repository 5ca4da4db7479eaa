"""The OpenAI-compatible HTTP API: ``build_app(pool)`` (or ``build_app(engine, served_model_name, api_key)``) in
:mod:`localllm.api.server`, how ``serve`` runs it in :mod:`localllm.api.launch` (the command: :mod:`localllm.cli.serve`)."""

__all__ = ["build_app"]


def __getattr__(name: str):
    # Lazy so that the CLI (which registers `serve` from here) does not import FastAPI on every run.
    if name == "build_app":
        from localllm.api.server import build_app

        return build_app
    raise AttributeError(name)
