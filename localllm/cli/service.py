"""The commands about a server running in the background: ``ps``, ``stop`` and the ``service``
group (``install``/``uninstall``/``status`` of the login service, see :mod:`localllm.service`)."""

from __future__ import annotations

import os

import typer

from localllm.cli.common import DEFAULT_MODEL


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
