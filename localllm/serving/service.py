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
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from localllm.config.paths import home_dir

UNIT_NAME = "localllm.serving.service"
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


def write_private(path: Path, text: str) -> None:
    """Write ``path`` atomically, readable by its owner only (0600 from creation, never chmod after):
    the server record, service files and the like may sit next to (or hold) secrets."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class StaleRecordError(RuntimeError):
    """``server.json`` names a live process that is not a localllm server (its PID was reused)."""


def _process_info(pid: int) -> tuple[int | None, list[str]] | None:
    """The owner's uid and the command line of process ``pid``; None if they cannot be read."""
    if Path("/proc/self/cmdline").is_file():  # Linux
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            return os.stat(f"/proc/{pid}").st_uid, [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        except OSError:
            return None
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            proc = psutil.Process(pid)
            uid = proc.uids().real if hasattr(proc, "uids") else None
            return uid, proc.cmdline()
        except psutil.Error:
            return None
    try:  # macOS and other POSIX systems without psutil
        out = subprocess.run(["ps", "-o", "uid=", "-o", "command=", "-p", str(pid)],
                             check=False, capture_output=True, text=True, timeout=10).stdout.split()
        return int(out[0]), out[1:]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def is_localllm_server(pid: int) -> bool:
    """Whether ``pid`` is a ``localllm serve`` process of this user. PIDs are reused after a crash or a
    reboot, so a PID from ``server.json`` is checked with this before it is signalled."""
    info = _process_info(pid)
    if info is None:
        return False
    uid, args = info
    if uid is not None and hasattr(os, "getuid") and uid != os.getuid():
        return False
    first = next((i for i, a in enumerate(args) if "localllm" in a), None)
    return first is not None and "serve" in args[first + 1:]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _load_record() -> ServerRecord | None:
    try:
        return ServerRecord(**json.loads(pid_file().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def read_record() -> ServerRecord | None:
    """The detached server's record, or None (a stale record, of a dead process or of a PID that is
    no longer a localllm server, is removed)."""
    rec = _load_record()
    if rec is None:
        return None
    if not _alive(rec.pid) or not is_localllm_server(rec.pid):
        pid_file().unlink(missing_ok=True)
        return None
    return rec


def start_detached(argv: list[str], host: str, port: int, model: str, wait_s: float = 120.0,
                   env: Mapping[str, str] | None = None) -> ServerRecord:
    """Start ``localllm serve ARGV`` in a new session; wait until /health answers.

    ``env`` is added to the child's environment: secrets (the API key) go there, never into ARGV,
    which ``ps`` shows to every user of the machine."""
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
            env={**os.environ, **env} if env else None,
        )
    rec = ServerRecord(proc.pid, host, port, model, str(log))
    write_private(pid_file(), json.dumps(dataclasses.asdict(rec)))
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


def _signal(pid: int, pidfd: int | None, sig: int) -> bool:
    """Send ``sig`` (0: only probe) through the pidfd where there is one; False if the process is gone."""
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_detached(timeout: float = 30.0) -> ServerRecord | None:
    """SIGTERM the detached server and wait for it; None if none was running.

    Raises StaleRecordError (after removing the record, signalling nothing) when the recorded PID is
    alive but not a localllm server. On Linux the process is held by a pidfd from before that check,
    so a PID reused later, while waiting, is never signalled either."""
    rec = _load_record()
    if rec is None:
        return None
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(rec.pid)
        except ProcessLookupError:
            pid_file().unlink(missing_ok=True)
            return None
        except OSError:  # kernel without pidfds
            pidfd = None
    try:
        if not _alive(rec.pid):
            pid_file().unlink(missing_ok=True)
            return None
        if not is_localllm_server(rec.pid):
            pid_file().unlink(missing_ok=True)
            raise StaleRecordError(f"pid {rec.pid} is not a localllm server "
                                   f"(stale {pid_file().name}, removed); nothing was stopped")
        _signal(rec.pid, pidfd, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        reaped = False
        while not reaped and time.monotonic() < deadline and _signal(rec.pid, pidfd, 0):
            try:  # reap it if it is our child (tests); otherwise just poll
                reaped = os.waitpid(rec.pid, os.WNOHANG)[0] == rec.pid
            except ChildProcessError:
                pass
            time.sleep(0.1)
        if not reaped and _signal(rec.pid, pidfd, 0):
            _signal(rec.pid, pidfd, signal.SIGKILL)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    pid_file().unlink(missing_ok=True)
    return rec


# ------------------------------------------------------------------ login services


def serve_command(model: str, host: str, port: int) -> list[str]:
    """The service's command line. No API key on it (``ps`` shows it to everyone, and the unit file
    would hold it): a configured key stays in config.toml, which the server reads itself."""
    exe = shutil.which("localllm")
    return [*([exe] if exe else [sys.executable, "-m", "localllm.cli"]), "serve", model,
            "--host", host, "--port", str(port)]


def systemd_unit(model: str, host: str, port: int) -> str:
    """A user unit that restarts the server when it fails (it exits non-zero within seconds when its
    engine dies) but not after a clean stop; it gives up only on a crash loop (5 starts in 60 s)."""
    cmd = " ".join(shlex.quote(c) for c in serve_command(model, host, port))
    env = f"Environment=LOCALLLM_HOME={shlex.quote(str(home_dir()))}\n"
    return (
        "[Unit]\n"
        "Description=localllm OpenAI-compatible LLM server\n"
        "After=network.target\n"
        "StartLimitIntervalSec=60\n"
        "StartLimitBurst=5\n\n"
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
    """A launch agent that starts at login and is restarted only after a failure (``KeepAlive`` with
    ``SuccessfulExit`` false: a non-zero exit; ``Crashed``: death by SIGSEGV and the like), so a clean
    stop stays stopped; launchd spaces restarts by ``ThrottleInterval`` seconds."""
    args = "".join(f"    <string>{escape(a)}</string>\n" for a in serve_command(model, host, port))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n'
        '<plist version="1.0">\n<dict>\n'
        f"  <key>Label</key><string>{LAUNCHD_LABEL}</string>\n"
        f"  <key>ProgramArguments</key>\n  <array>\n{args}  </array>\n"
        "  <key>EnvironmentVariables</key>\n  <dict>\n"
        f"    <key>LOCALLLM_HOME</key><string>{escape(str(home_dir()))}</string>\n  </dict>\n"
        "  <key>RunAtLoad</key><true/>\n"
        "  <key>KeepAlive</key>\n  <dict>\n    <key>SuccessfulExit</key><false/>\n"
        "    <key>Crashed</key><true/>\n  </dict>\n"
        "  <key>ThrottleInterval</key><integer>10</integer>\n"
        f"  <key>StandardOutPath</key><string>{escape(str(log_file()))}</string>\n"
        f"  <key>StandardErrorPath</key><string>{escape(str(log_file()))}</string>\n"
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


# ------------------------------------------------------------------ tray autostart

TRAY_DESKTOP_FILE = "localllm-tray.desktop"
TRAY_LAUNCHD_LABEL = "dev.localllm.tray"


def tray_command() -> list[str]:
    """``localllm tray`` with this installation's executable."""
    exe = shutil.which("localllm")
    return [*([exe] if exe else [sys.executable, "-m", "localllm.cli"]), "tray"]


def _desktop_exec_arg(arg: str) -> str:
    """One argument of a .desktop ``Exec`` key (the Desktop Entry spec's quoting; ``%`` doubled)."""
    arg = arg.replace("%", "%%")
    if not any(c in arg for c in ' \t\n"\'\\><~|&;$*?#()`'):
        return arg
    quoted = '"' + "".join("\\" + c if c in '"`$\\' else c for c in arg) + '"'
    return quoted.replace("\\", "\\\\")  # the string type's own escaping comes on top of the quoting


def tray_desktop_entry() -> str:
    """An XDG autostart entry that starts the tray at login, with the same LOCALLLM_HOME."""
    argv = ["env", f"LOCALLLM_HOME={home_dir()}", *tray_command()]
    return (
        "[Desktop Entry]\n"
        "Type=Application\n"
        "Name=localllm tray\n"
        "Comment=Tray icon for the local LLM server\n"
        f"Exec={' '.join(_desktop_exec_arg(a) for a in argv)}\n"
        "Terminal=false\n"
        "X-GNOME-Autostart-enabled=true\n"
    )


def tray_launchd_plist() -> str:
    """A launch agent that starts the tray at login in the GUI session; not restarted after Quit."""
    args = "".join(f"    <string>{escape(a)}</string>\n" for a in tray_command())
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">\n'
        '<plist version="1.0">\n<dict>\n'
        f"  <key>Label</key><string>{TRAY_LAUNCHD_LABEL}</string>\n"
        f"  <key>ProgramArguments</key>\n  <array>\n{args}  </array>\n"
        "  <key>EnvironmentVariables</key>\n  <dict>\n"
        f"    <key>LOCALLLM_HOME</key><string>{escape(str(home_dir()))}</string>\n  </dict>\n"
        "  <key>RunAtLoad</key><true/>\n"
        "  <key>KeepAlive</key><false/>\n"
        "  <key>LimitLoadToSessionType</key><string>Aqua</string>\n"
        "</dict>\n</plist>\n"
    )


def tray_autostart_plan(platform: str | None = None) -> ServicePlan:
    """What ``service install --tray`` writes so the tray starts at login."""
    platform = platform or sys.platform
    if platform.startswith("linux"):
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        return ServicePlan(base / "autostart" / TRAY_DESKTOP_FILE, tray_desktop_entry(), [])
    if platform == "darwin":
        path = Path.home() / "Library" / "LaunchAgents" / f"{TRAY_LAUNCHD_LABEL}.plist"
        return ServicePlan(path, tray_launchd_plist(), [["launchctl", "load", "-w", str(path)]])
    return ServicePlan(None, " ".join(tray_command()), [],
                       note=f"no login autostart support on {platform}; run this command at login:")


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
