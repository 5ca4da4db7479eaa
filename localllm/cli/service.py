"""The commands about a server running in the background: ``ps``, ``stop`` and the ``service``
group (``install``/``uninstall``/``status`` of the login service, see :mod:`localllm.serving.service`)."""

from __future__ import annotations

import os

import typer

from localllm.cli.common import DEFAULT_MODEL, cli_errors, parameters_text


def _server_base() -> tuple[str, str | None, object]:
    """The running server's base URL (the detached one's record, else the settings'), its API key
    and the record (None when not detached)."""
    from localllm.config.settings import load_settings
    from localllm.serving.service import read_record

    settings = load_settings()
    rec = read_record()
    base = f"http://{rec.host}:{rec.port}" if rec else settings.base_url
    return base, settings.api_key, rec


def _expires(expires_at: str | None) -> str:
    """``expires_at`` (ISO 8601) as Ollama's ps shows it: "Forever", "in 4 minutes", ..."""
    import datetime

    if expires_at is None:
        return "Forever"
    try:
        when = datetime.datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at
    seconds = (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    if seconds < 1:
        return "now"
    for unit, size in (("hour", 3600), ("minute", 60), ("second", 1)):
        if seconds >= size:
            n = int(seconds // size)
            return f"in {n} {unit}{'s' if n != 1 else ''}"
    return "now"


def _drafts(model: dict) -> str:
    """Speculative decoding's column: drafted tokens and the share accepted (``-`` before any)."""
    drafted, acceptance = model.get("spec_drafted_tokens") or 0, model.get("spec_acceptance")
    if not drafted or acceptance is None:
        return "-"
    return f"{drafted:,} ({acceptance:.0%} accepted)"


def ps() -> None:
    """Show the models a running localllm server has loaded: memory, context, requests, expiry."""
    from localllm.client.http import loaded_models

    base, api_key, _rec = _server_base()
    with cli_errors():
        models = loaded_models(base, api_key)
    if models is None:
        typer.echo(f"No localllm server is running at {base}.")
        raise typer.Exit(0)
    if not models:
        typer.echo(f"No models are loaded in the server at {base}; each loads on its first request.")
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in ("NAME", "QUANT", "PARAMS", "MEMORY", "CONTEXT", "RUNNING", "WAITING", "DRAFTS", "EXPIRES"):
        table.add_column(col)
    for m in models:
        table.add_row(m["name"], m.get("quant") or "-", parameters_text(m.get("parameters"), m.get("active_parameters")),
                      f"{m.get('size_bytes', 0) / 2**20:,.0f} MiB",
                      str(m.get("context_length", "-")), str(m.get("running", 0)), str(m.get("waiting", 0)),
                      _drafts(m), _expires(m.get("expires_at")))
    Console(width=200).print(table)


def stop(
    model: str | None = typer.Argument(
        None, help="Unload this model from the running server; without it, stop the detached server."
    ),
) -> None:
    """Unload MODEL from the running server, or stop the server started with `localllm serve --detach`."""
    if model is not None:
        from localllm.client.http import unload_model

        base, api_key, _rec = _server_base()
        with cli_errors():
            result = unload_model(base, model, api_key)
        if result is None:
            typer.echo(f"No localllm server is running at {base}.")
            raise typer.Exit(1)
        if result.get("pending"):
            typer.echo(f"{model} unloads once its running requests finish.")
        elif result.get("unloaded"):
            typer.echo(f"Unloaded {model}.")
        else:
            typer.echo(f"{model} was not loaded.")
        return
    from localllm.serving.service import StaleRecordError, stop_detached

    try:
        rec = stop_detached()
    except StaleRecordError as exc:  # the recorded PID now belongs to another process: leave it be
        typer.echo(f"No detached localllm server is running: {exc}.")
        return
    if rec is None:
        typer.echo("No detached localllm server is running.")
    else:
        typer.echo(f"Stopped the localllm server (pid {rec.pid}, port {rec.port}).")


def make_service_app() -> typer.Typer:
    """The ``service`` command group: ``install``, ``uninstall``, ``status``."""
    service_app = typer.Typer(help="Install the API as a login service (systemd user unit / launchd agent).",
                              no_args_is_help=True)
    service_app.command("install")(service_install)
    service_app.command("uninstall")(service_uninstall)
    service_app.command("status")(service_status)
    return service_app


def service_install(
    model: str = typer.Argument(DEFAULT_MODEL),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(11435, "--port"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the unit and commands; change nothing."),
    tray: bool = typer.Option(
        False, "--tray", help="Also start the tray icon (`localllm tray`) at login (XDG autostart / launchd)."
    ),
) -> None:
    """Write the service file and enable it so the API is up after login."""
    from localllm.config.settings import config_path
    from localllm.serving.service import service_plan, tray_autostart_plan

    plans = [service_plan(model, host, port)] + ([tray_autostart_plan()] if tray else [])
    if os.environ.get("LOCALLLM_API_KEY"):  # the service gets neither this environment nor a key flag
        typer.echo(f"Note: the service does not see LOCALLLM_API_KEY; put api_key in {config_path()} "
                   "(mode 0600) to require a key there.", err=True)
    for plan in plans:
        _install(plan, dry_run)


def _install(plan, dry_run: bool) -> None:
    """Write one ``ServicePlan``'s file (0600, atomically) and run its commands."""
    from localllm.serving.service import run_commands, write_private

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


def service_uninstall() -> None:
    """Disable the login service and remove its file."""
    from localllm.serving.service import run_commands, uninstall_plan

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


def service_status() -> None:
    """Whether the login service is installed, and whether a server answers."""
    from localllm.client.http import server_models
    from localllm.config.settings import load_settings
    from localllm.serving.service import service_plan

    plan = service_plan("-", "-", 0)
    installed = plan.path is not None and plan.path.exists()
    settings = load_settings()
    up = server_models(settings.base_url, settings.api_key) is not None
    typer.echo(f"service file: {plan.path if plan.path else '(unsupported platform)'} "
               f"({'installed' if installed else 'not installed'})")
    typer.echo(f"server at {settings.base_url}: {'up' if up else 'down'}")
