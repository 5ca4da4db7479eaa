"""The OpenAI-compatible HTTP API: ``build_app(pool)`` (or ``build_app(engine, served_model_name, api_key)``) in
:mod:`localllm.api.server`, the ``serve`` command in :mod:`localllm.api.cli`."""

__all__ = ["build_app"]


def __getattr__(name: str):
    # Lazy so that the CLI (which registers `serve` from here) does not import FastAPI on every run.
    if name == "build_app":
        from localllm.api.server import build_app

        return build_app
    raise AttributeError(name)
