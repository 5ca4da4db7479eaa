"""The background server and the login services: secrets stay off command lines and out of
world-readable files, `stop` signals only a real localllm server, and the service managers restart
a server that fails (but not one that was stopped)."""

from __future__ import annotations

import configparser
import json
import os
import plistlib
import stat
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
from typer.testing import CliRunner

from localllm.api.launch import start_in_background
from localllm.cli import app
from localllm.cli.flags import flags_argv
from localllm.config.settings import load_settings
from localllm.serving import service

runner = CliRunner()
SECRET = "sk-do-not-show-me"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path))  # launchd's ~/Library/LaunchAgents on macOS
    monkeypatch.delenv("LOCALLLM_API_KEY", raising=False)
    return tmp_path / "home"


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _write_record(pid: int) -> None:
    service.pid_file().write_text(json.dumps(
        {"pid": pid, "host": "127.0.0.1", "port": 1, "model": "m", "log_file": str(service.log_file())}))


def test_detach_passes_the_api_key_in_the_environment(home, monkeypatch):
    """`ps` shows every process's command line to every user: the key must travel in the environment."""
    spawned = {}

    def fake_popen(argv, **kwargs):
        spawned.update(argv=argv, env=kwargs.get("env"))
        return SimpleNamespace(pid=os.getpid(), poll=lambda: None, returncode=None)

    monkeypatch.setattr(service.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(httpx, "get", lambda url, timeout: SimpleNamespace(status_code=200))
    flags = {"model": "smollm2:135m", "port": 18999, "api_key": SECRET, "max_num_seqs": 4}
    argv = flags_argv(flags, verbose=False)
    assert "--api-key" not in argv and not any(SECRET in a for a in argv)
    assert argv == ["smollm2:135m", "--port", "18999", "--max-num-seqs", "4"]

    assert start_in_background(load_settings(flags), argv) == 0
    assert not any(SECRET in a for a in spawned["argv"])
    assert spawned["env"]["LOCALLLM_API_KEY"] == SECRET
    assert spawned["env"]["LOCALLLM_HOME"] == str(home)  # the rest of the environment is kept
    # the record is written owner-only from creation
    assert _mode(service.pid_file()) == 0o600
    assert json.loads(service.pid_file().read_text())["port"] == 18999


def test_detach_without_a_key_adds_nothing(home, monkeypatch):
    spawned = {}

    def fake_popen(argv, **kwargs):
        spawned.update(env=kwargs.get("env"))
        return SimpleNamespace(pid=os.getpid(), poll=lambda: None, returncode=None)

    monkeypatch.setattr(service.subprocess, "Popen", fake_popen)
    monkeypatch.setattr(httpx, "get", lambda url, timeout: SimpleNamespace(status_code=200))
    start_in_background(load_settings({"port": 18999}), [])
    assert spawned["env"] is None  # inherits the environment unchanged


def test_stop_leaves_an_unrelated_process_alone(home):
    """After a crash or a reboot the recorded PID may belong to anything: `stop` must not kill it."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        _write_record(sleeper.pid)
        with pytest.raises(service.StaleRecordError, match=f"pid {sleeper.pid} is not a localllm server"):
            service.stop_detached(timeout=2)
        assert sleeper.poll() is None
        assert not service.pid_file().exists()  # the stale record is gone

        _write_record(sleeper.pid)
        res = runner.invoke(app, ["stop"])
        assert res.exit_code == 0 and "not a localllm server" in res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
        assert sleeper.poll() is None and not service.pid_file().exists()

        _write_record(sleeper.pid)  # nor does a stale record count as a running server (ps, --detach)
        assert service.read_record() is None and not service.pid_file().exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stop_stops_a_localllm_server(home):
    """A process whose command line is `... localllm ... serve ...` is ours: it gets SIGTERM."""
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "localllm", "serve"])
    try:
        deadline = time.monotonic() + 10  # /proc/PID/cmdline is empty until the child has exec'd
        while not service.is_localllm_server(server.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert service.is_localllm_server(server.pid)
        _write_record(server.pid)
        assert service.read_record().pid == server.pid
        rec = service.stop_detached(timeout=10)
        assert rec is not None and rec.pid == server.pid
        server.wait(timeout=10)
        assert not service.pid_file().exists()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_write_private_is_owner_only_even_with_umask_0(tmp_path):
    """0600 from the first byte (os.open/mkstemp), not chmod after: no window where others can read."""
    path = tmp_path / "server.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    old = os.umask(0)
    try:
        service.write_private(path, "new")
    finally:
        os.umask(old)
    assert path.read_text() == "new" and _mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["server.json"]  # no temporary file left


def test_service_install_writes_an_owner_only_file(home, monkeypatch):
    plan = service.service_plan("smollm2:135m", "127.0.0.1", 11435)
    if plan.path is None:  # before anything is installed
        pytest.skip(f"no service manager on {sys.platform}")
    monkeypatch.setattr(service, "run_commands", lambda commands: [])
    res = runner.invoke(app, ["service", "install"])
    assert res.exit_code == 0 and f"Wrote {plan.path}" in res.output, res.output
    assert _mode(plan.path) == 0o600


def _unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(text)
    return parser


def test_systemd_unit_restarts_a_failed_server(home):
    """The server exits non-zero when its engine dies: systemd restarts it, gives up only on a crash
    loop (StartLimit* belong in [Unit]), and leaves a clean stop alone (on-failure, not always)."""
    unit = _unit(service.systemd_unit("smollm2:135m", "127.0.0.1", 11435))
    assert unit["Service"]["Restart"] == "on-failure"
    assert int(unit["Service"]["RestartSec"]) >= 1
    assert unit["Unit"]["StartLimitIntervalSec"] == "60" and unit["Unit"]["StartLimitBurst"] == "5"
    assert "StartLimitIntervalSec" not in unit["Service"]
    assert unit["Service"]["ExecStart"].endswith("serve smollm2:135m --host 127.0.0.1 --port 11435")


def test_launchd_plist_restarts_only_after_a_failure(tmp_path, monkeypatch):
    """KeepAlive=true would restart after `launchctl stop` too; SuccessfulExit=false restarts only a
    non-zero exit, Crashed a death by signal. Paths are XML-escaped."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "a&b <c>"))
    plist = plistlib.loads(service.launchd_plist("smollm2:135m", "127.0.0.1", 11435).encode())
    assert plist["KeepAlive"] == {"SuccessfulExit": False, "Crashed": True}
    assert plist["RunAtLoad"] is True and plist["ThrottleInterval"] >= 1
    assert plist["EnvironmentVariables"]["LOCALLLM_HOME"] == str(tmp_path / "a&b <c>")
    assert plist["ProgramArguments"][-6:] == ["serve", "smollm2:135m", "--host", "127.0.0.1",
                                              "--port", "11435"]


def test_service_files_never_hold_the_api_key(home, monkeypatch):
    """A configured key stays in config.toml (or the environment); the service reads it itself."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'api_key = "{SECRET}"\n')
    monkeypatch.setenv("LOCALLLM_API_KEY", SECRET)
    assert SECRET not in service.systemd_unit("smollm2:135m", "127.0.0.1", 11435)
    assert SECRET not in service.launchd_plist("smollm2:135m", "127.0.0.1", 11435)
    assert not any(SECRET in a for a in service.serve_command("smollm2:135m", "127.0.0.1", 11435))
    res = runner.invoke(app, ["service", "install", "--dry-run"])
    assert res.exit_code == 0 and SECRET not in res.output
    assert "does not see LOCALLLM_API_KEY" in res.output
