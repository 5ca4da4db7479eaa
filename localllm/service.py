"""Run the API in the background: a detached process with a PID file, or a login service
(systemd user unit on Linux, launchd agent on macOS)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from localllm.paths import home_dir

UNIT_NAME = "localllm.service"
LAUNCHD_LABEL = "dev.localllm.server"


@dataclass(slots=True)
class ServerRecord:
    pid: int
    host: str
    port: int
    model: str
    log_file: str


def pid_file() -> Path:
    return home_dir() / "server.json"


def log_file() -> Path:
    path = home_dir() / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path / "server.log"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_record() -> ServerRecord | None:
    """The detached server's record, or None (a stale record of a dead process is removed)."""
    path = pid_file()
    try:
        rec = ServerRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if not _alive(rec.pid):
        path.unlink(missing_ok=True)
        return None
    return rec


def start_detached(argv: list[str], host: str, port: int, model: str, wait_s: float = 120.0) -> ServerRecord:
    """Start ``localllm serve ARGV`` in a new session; wait until /health answers."""
    import httpx

    existing = read_record()
    if existing is not None:
        raise RuntimeError(f"a localllm server is already running (pid {existing.pid}, port {existing.port}); "
                           "stop it with `localllm stop`")
    log = log_file()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "localllm.cli", "serve", *argv],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    rec = ServerRecord(proc.pid, host, port, model, str(log))
    tmp = pid_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(rec)))
    os.replace(tmp, pid_file())
    deadline = time.monotonic() + wait_s
    url = f"http://{host}:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pid_file().unlink(missing_ok=True)
            raise RuntimeError(f"the server exited with code {proc.returncode}; see {log}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return rec
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server did not become ready within {wait_s:.0f} s; see {log}")


def stop_detached(timeout: float = 30.0) -> ServerRecord | None:
    """SIGTERM the detached server and wait for it; None if none was running."""
    rec = read_record()
    if rec is None:
        return None
    os.kill(rec.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(rec.pid):
        try:  # reap it if it is our child (tests); otherwise just poll
            os.waitpid(rec.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    if _alive(rec.pid):
        os.kill(rec.pid, signal.SIGKILL)
    pid_file().unlink(missing_ok=True)
    return rec


# ------------------------------------------------------------------ login services


def serve_command(model: str, host: str, port: int) -> list[str]:
    exe = shutil.which("localllm") or f"{sys.executable} -m localllm.cli"
    return [*shlex.split(exe), "serve", model, "--host", host, "--port", str(port)]


def systemd_unit(model: str, host: str, port: int) -> str:
    cmd = " ".join(shlex.quote(c) for c in serve_command(model, host, port))
    env = f"Environment=LOCALLLM_HOME={shlex.quote(str(home_dir()))}\n"
    return (
        "[Unit]\n"
        "Description=localllm OpenAI-compatible LLM server\n"
        "After=network.target\n\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={cmd}\n"
        f"{env}"
        "Restart=on-failure\n"
        "RestartSec=5\n"
        "KillSignal=SIGTERM\n"
        "TimeoutStopSec=30\n\n"
        "[Install]\n"
        "WantedBy=default.target\n"
    )


def launchd_plist(model: str, host: str, port: int) -> str:
    args = "".join(f"    <string>{a}</string>\n" for a in serve_command(model, host, port))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n'
        '<plist version="1.0">\n<dict>\n'
        f"  <key>Label</key><string>{LAUNCHD_LABEL}</string>\n"
        f"  <key>ProgramArguments</key>\n  <array>\n{args}  </array>\n"
        "  <key>EnvironmentVariables</key>\n  <dict>\n"
        f"    <key>LOCALLLM_HOME</key><string>{home_dir()}</string>\n  </dict>\n"
        "  <key>RunAtLoad</key><true/>\n  <key>KeepAlive</key><true/>\n"
        f"  <key>StandardOutPath</key><string>{log_file()}</string>\n"
        f"  <key>StandardErrorPath</key><string>{log_file()}</string>\n"
        "</dict>\n</plist>\n"
    )


@dataclass(slots=True)
class ServicePlan:
    """What ``service install`` writes and runs on this system."""

    path: Path | None
    content: str
    commands: list[list[str]]
    note: str = ""


def service_plan(model: str, host: str, port: int, platform: str | None = None) -> ServicePlan:
    platform = platform or sys.platform
    if platform.startswith("linux"):
        base = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config"))
        return ServicePlan(
            base / "systemd" / "user" / UNIT_NAME,
            systemd_unit(model, host, port),
            [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", UNIT_NAME]],
        )
    if platform == "darwin":
        path = Path.home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        return ServicePlan(path, launchd_plist(model, host, port), [["launchctl", "load", "-w", str(path)]])
    return ServicePlan(None, " ".join(serve_command(model, host, port)), [],
                       note=f"no service manager support on {platform}; run this command at login:")


def uninstall_plan(platform: str | None = None) -> ServicePlan:
    platform = platform or sys.platform
    plan = service_plan("-", "-", 0, platform)
    if platform.startswith("linux"):
        plan.commands = [["systemctl", "--user", "disable", "--now", UNIT_NAME],
                         ["systemctl", "--user", "daemon-reload"]]
    elif platform == "darwin":
        plan.commands = [["launchctl", "unload", "-w", str(plan.path)]]
    return plan


def run_commands(commands: list[list[str]]) -> list[str]:
    """Run service-manager commands that exist here; return what could not run (and why)."""
    problems = []
    for cmd in commands:
        if shutil.which(cmd[0]) is None:
            problems.append(f"{cmd[0]} not found; run later: {' '.join(cmd)}")
            continue
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            problems.append(f"`{' '.join(cmd)}` failed: {(res.stderr or res.stdout).strip()}")
    return problems
