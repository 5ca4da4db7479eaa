"""The ``localllm`` Typer app: every command, registered here in one visible list.

Each command lives with what it drives; this module only puts them on the app, in the order
``localllm --help`` lists them. No command registers itself by being imported.
"""

from __future__ import annotations

import typer

from localllm.cli import evaluate, info, run, service, tokens
from localllm.cli import store as store_commands
from localllm.cli.chat import register as register_chat
from localllm.cli.quantize import register as register_quantize
from localllm.cli.serve import register as register_serve
from localllm.cli.tray import register as register_tray


def make_app() -> typer.Typer:
    """A fresh ``localllm`` app with every command on it."""
    app = typer.Typer(
        name="localllm",
        help="Run LLMs locally: pull, run, serve (OpenAI-compatible API) and chat.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    store_commands.register(app)  # pull, list (alias ls), show, rm    localllm/cli/store.py
    register_serve(app)  # serve                                       localllm/cli/serve.py
    register_chat(app)  # chat                                         localllm/cli/chat.py
    register_tray(app)  # tray                                         localllm/cli/tray.py
    register_quantize(app)  # quantize                                 localllm/cli/quantize.py
    app.command()(run.run)  # run                                      localllm/cli/run.py
    app.command()(info.config)  # config                               localllm/cli/info.py
    app.command()(service.ps)  # ps                                    localllm/cli/service.py
    app.command()(service.stop)  # stop                                localllm/cli/service.py
    app.add_typer(service.make_service_app(), name="service")  # service install/uninstall/status
    app.command()(run.bench)  # bench                                  localllm/cli/run.py
    app.command()(evaluate.perplexity)  # perplexity                   localllm/cli/evaluate.py
    app.command()(tokens.tokenize)  # tokenize                         localllm/cli/tokens.py
    app.command()(info.version)  # version                             localllm/cli/info.py
    return app


app = make_app()


def main() -> None:  # pragma: no cover - console entry point
    app()
