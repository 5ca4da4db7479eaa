"""The ``localllm`` command line."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import typer

from localllm.errors import LocalLLMError

DEFAULT_MODEL = "smollm2:135m"

app = typer.Typer(
    name="localllm",
    help="Run LLMs locally: pull, run, serve (OpenAI-compatible API) and chat.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


from localllm.cli_store import register as _register_store_commands  # noqa: E402

_register_store_commands(app)


def fail(message: str, code: int = 1) -> None:
    """Print one readable error line and exit."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _load_llm(model: str, dtype: str, max_model_len: Optional[int], kv_cache_memory: Optional[str]):
    from localllm import LLM

    kwargs = {}
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_memory:
        kwargs["kv_cache_memory"] = kv_cache_memory
    return LLM(model=model, dtype=dtype, **kwargs)


def _stream_reply(llm, messages, params) -> str:
    text = []
    for out in llm.stream(messages, params):
        if out.new_text:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            text.append(out.new_text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


REPL_HELP = """Commands:
  /bye            exit
  /clear          forget the conversation
  /system TEXT    set the system prompt
  /help           this help
  \"\"\"             start or end a multi-line message"""


def _repl(llm, params, system: Optional[str]) -> None:
    messages: list[dict] = []
    if system:
        messages.append({"role": "system", "content": system})
    typer.echo("Type a message, /help for commands, /bye to exit.", err=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            typer.echo("", err=True)
            continue
        if line.strip().startswith('"""'):
            parts = [line.strip()[3:]]
            while True:
                try:
                    nxt = input("... ")
                except EOFError:
                    break
                if nxt.rstrip().endswith('"""'):
                    parts.append(nxt.rstrip()[:-3])
                    break
                parts.append(nxt)
            line = "\n".join(parts).strip("\n")
        stripped = line.strip()
        if not stripped:
            continue
        if stripped in ("/bye", "/exit", "/quit"):
            break
        if stripped == "/help":
            typer.echo(REPL_HELP)
            continue
        if stripped == "/clear":
            messages = [m for m in messages if m["role"] == "system"]
            typer.echo("Cleared the conversation.", err=True)
            continue
        if stripped.startswith("/system"):
            text = stripped[len("/system"):].strip()
            messages = [m for m in messages if m["role"] != "system"]
            if text:
                messages.insert(0, {"role": "system", "content": text})
            typer.echo("Set the system prompt." if text else "Cleared the system prompt.", err=True)
            continue
        if stripped.startswith("/"):
            typer.echo(f"Unknown command {stripped.split()[0]}; /help lists them.", err=True)
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream_reply(llm, messages, params)
        except KeyboardInterrupt:
            typer.echo("\n(stopped)", err=True)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


@app.command()
def run(
    model: str = typer.Argument(DEFAULT_MODEL, help="Catalog name (smollm2:135m), hub name, or path to a .gguf file."),
    prompt: Optional[str] = typer.Argument(None, help="One-shot prompt; without it (and no piped stdin) a chat REPL starts."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most tokens to generate per reply."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 (reference) or bfloat16."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="e.g. 512MiB, 2GiB."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Chat with a model in the terminal, or answer one PROMPT and exit."""
    _setup_logging(verbose)
    from localllm import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        if prompt is None and not sys.stdin.isatty():
            prompt = sys.stdin.read().strip() or None
        llm = _load_llm(model, dtype, max_model_len, kv_cache_memory)
        if prompt is not None:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            _stream_reply(llm, messages, params)
        else:
            _repl(llm, params, system)
    except LocalLLMError as exc:
        fail(exc.message)
    except KeyboardInterrupt:
        raise typer.Exit(130)


@app.command()
def version() -> None:
    """Print localllm's version."""
    from localllm import __version__

    typer.echo(f"localllm {__version__}")


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
