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

from localllm.api.cli import register as _register_serve_command  # noqa: E402

_register_serve_command(app)

from localllm.tui.cli import register as _register_chat_command  # noqa: E402

_register_chat_command(app)

from localllm.quant.gptq_cli import register as _register_quantize_command  # noqa: E402

_register_quantize_command(app)


def fail(message: str, code: int = 1) -> None:
    """Print one readable error line and exit."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _load_llm(model: str, dtype: str, max_model_len: Optional[int], kv_cache_memory: Optional[str],
              threads: Optional[int] = None):
    from localllm import LLM

    kwargs = {"threads": threads} if threads else {}
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_memory:
        kwargs["kv_cache_memory"] = kv_cache_memory
    return LLM(model=model, dtype=dtype, **kwargs)


class _RemoteLLM:
    """Streams chats from a running localllm server instead of an in-process engine."""

    def __init__(self, base_url: str, model: str, api_key: Optional[str]) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key

    def stream_text(self, messages, params):
        from localllm.client import stream_chat

        body = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p}
        if params.seed is not None:
            body["seed"] = params.seed
        yield from stream_chat(self.base_url, self.model, messages, body, self.api_key)


def _remote_for(model: str) -> Optional[_RemoteLLM]:
    from localllm.client import server_models
    from localllm.settings import load_settings

    settings = load_settings()
    served = server_models(settings.base_url, settings.api_key)
    if not served:
        return None
    wanted = {model, os.path.basename(model)}
    try:
        from localllm.hub import canonical_name

        wanted.add(canonical_name(model))
    except LocalLLMError:
        pass
    for name in served:
        if name in wanted:
            return _RemoteLLM(settings.base_url, name, settings.api_key)
    return None


def _stream_reply(llm, messages, params) -> str:
    text = []
    if isinstance(llm, _RemoteLLM):
        pieces = llm.stream_text(messages, params)
    else:
        pieces = (out.new_text for out in llm.stream(messages, params))
    for piece in pieces:
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
            text.append(piece)
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
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16 activations and KV cache."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len"),
    kv_cache_memory: Optional[str] = typer.Option(None, "--kv-cache-memory", help="e.g. 512MiB, 2GiB."),
    local: bool = typer.Option(False, "--local", help="Always load the model in-process, even if a server is up."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads (default: LOCALLLM_THREADS, else every core)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Chat with a model in the terminal, or answer one PROMPT and exit.

    Like Ollama, a localllm server running on the configured address that serves MODEL answers
    instead (no second copy of the model is loaded); otherwise the engine starts in-process."""
    _setup_logging(verbose)
    from localllm import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        if prompt is None and not sys.stdin.isatty():
            prompt = sys.stdin.read().strip() or None
        remote = None if local else _remote_for(model)
        if remote is not None:
            llm = remote
        else:
            llm = _load_llm(model, dtype, max_model_len, kv_cache_memory, threads)
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
def config() -> None:
    """Print the effective settings and where each comes from (config.toml < LOCALLLM_* env < flags)."""
    from localllm.settings import config_path, load_settings

    try:
        settings = load_settings()
    except LocalLLMError as exc:
        fail(exc.message)
    typer.echo(f"# {config_path()}")
    for key, source in settings.sources.items():
        value = getattr(settings, key)
        if key == "api_key" and value:
            value = "***"
        typer.echo(f"{key} = {value!r}  ({source})")


@app.command()
def ps() -> None:
    """Show what a running localllm server has loaded and how busy it is."""
    from localllm.client import server_status
    from localllm.service import read_record
    from localllm.settings import load_settings

    settings = load_settings()
    rec = read_record()
    base = f"http://{rec.host}:{rec.port}" if rec else settings.base_url
    status = server_status(base, settings.api_key)
    if status is None:
        typer.echo(f"No localllm server is running at {base}.")
        raise typer.Exit(0)
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("MODEL", "ADDRESS", "RUNNING", "WAITING", "KV CACHE", "PID"):
        table.add_column(col)
    for name in status["models"]:
        table.add_row(name, base, f"{status.get('num_requests_running', 0):.0f}",
                      f"{status.get('num_requests_waiting', 0):.0f}",
                      f"{100 * status.get('kv_cache_usage_perc', 0.0):.1f}%", str(rec.pid) if rec else "-")
    Console().print(table)


@app.command()
def stop() -> None:
    """Stop the server started with `localllm serve --detach`."""
    from localllm.service import StaleRecordError, stop_detached

    try:
        rec = stop_detached()
    except StaleRecordError as exc:  # the recorded PID now belongs to another process: leave it be
        typer.echo(f"No detached localllm server is running: {exc}.")
        return
    if rec is None:
        typer.echo("No detached localllm server is running.")
    else:
        typer.echo(f"Stopped the localllm server (pid {rec.pid}, port {rec.port}).")


service_app = typer.Typer(help="Install the API as a login service (systemd user unit / launchd agent).",
                          no_args_is_help=True)
app.add_typer(service_app, name="service")


@service_app.command("install")
def service_install(
    model: str = typer.Argument(DEFAULT_MODEL),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(11435, "--port"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the unit and commands; change nothing."),
) -> None:
    """Write the service file and enable it so the API is up after login."""
    from localllm.service import run_commands, service_plan, write_private
    from localllm.settings import config_path

    plan = service_plan(model, host, port)
    if os.environ.get("LOCALLLM_API_KEY"):  # the service gets neither this environment nor a key flag
        typer.echo(f"Note: the service does not see LOCALLLM_API_KEY; put api_key in {config_path()} "
                   "(mode 0600) to require a key there.", err=True)
    if plan.path is None:
        typer.echo(plan.note)
        typer.echo(plan.content)
        return
    if dry_run:
        typer.echo(f"# would write {plan.path}\n{plan.content}")
        for cmd in plan.commands:
            typer.echo("# would run: " + " ".join(cmd))
        return
    plan.path.parent.mkdir(parents=True, exist_ok=True)
    write_private(plan.path, plan.content)  # 0600, atomically
    typer.echo(f"Wrote {plan.path}")
    for problem in run_commands(plan.commands):
        typer.echo(f"Warning: {problem}", err=True)


@service_app.command("uninstall")
def service_uninstall() -> None:
    """Disable the login service and remove its file."""
    from localllm.service import run_commands, uninstall_plan

    plan = uninstall_plan()
    if plan.path is None:
        typer.echo(plan.note.replace("run this command at login:", "nothing to uninstall."))
        return
    for problem in run_commands(plan.commands):
        typer.echo(f"Warning: {problem}", err=True)
    if plan.path.exists():
        plan.path.unlink()
        typer.echo(f"Removed {plan.path}")
    else:
        typer.echo("The localllm service is not installed.")


@service_app.command("status")
def service_status() -> None:
    """Whether the login service is installed, and whether a server answers."""
    from localllm.client import server_models
    from localllm.service import service_plan
    from localllm.settings import load_settings

    plan = service_plan("-", "-", 0)
    installed = plan.path is not None and plan.path.exists()
    settings = load_settings()
    up = server_models(settings.base_url, settings.api_key) is not None
    typer.echo(f"service file: {plan.path if plan.path else '(unsupported platform)'} "
               f"({'installed' if installed else 'not installed'})")
    typer.echo(f"server at {settings.base_url}: {'up' if up else 'down'}")


@app.command()
def bench(
    model: str = typer.Argument(DEFAULT_MODEL, help="Catalog name or path to a .gguf file."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Prompt length for the prefill measurement."),
    tokens: int = typer.Option(128, "--tokens", help="Tokens to decode for the decode measurement."),
    dtype: str = typer.Option("float32", "--dtype"),
) -> None:
    """Measure prefill and single-stream decode tokens/s of MODEL on this machine."""
    import time

    from localllm import SamplingParams

    try:
        llm = _load_llm(model, dtype, None, "256MiB")
        vocab = llm.engine.model_config.vocab_size
        prompt = [(1000 + i) % vocab for i in range(prompt_tokens)]
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        prefill = prompt_tokens / (time.perf_counter() - t0)
        first = None
        n = 0
        for out in llm.stream([1, 2, 3], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)):
            n += len(out.new_token_ids)
            first = first or time.perf_counter()
        decode = (n - 1) / max(time.perf_counter() - first, 1e-9)
    except LocalLLMError as exc:
        fail(exc.message)
    typer.echo(f"prefill ({prompt_tokens} tokens): {prefill:.1f} tokens/s")
    typer.echo(f"decode  ({tokens} tokens, 1 stream): {decode:.2f} tokens/s")


@app.command()
def version() -> None:
    """Print localllm's version."""
    from localllm import __version__

    typer.echo(f"localllm {__version__}")


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
