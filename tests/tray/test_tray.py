"""`localllm tray` (localllm/tray): the pure state/menu model, the pystray glue on pystray's dummy
backend, against a real `localllm serve` of SmolLM2 and a small fake server; autostart files."""

from __future__ import annotations

import json
import os
import plistlib
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from api_server import serving

pytestmark = pytest.mark.timeout(180)

MODEL = "smol"


@pytest.fixture()
def pystray(monkeypatch):
    monkeypatch.setenv("PYSTRAY_BACKEND", "dummy")
    pytest.importorskip("PIL")
    from localllm.tray.app import load_pystray

    return load_pystray()


def make_tray(base_url, pystray, **kwargs):
    from localllm.tray.app import TrayApp
    from localllm.tray.model import TrayController

    controller = TrayController(base_url, notify=lambda message: None, **kwargs)
    return TrayApp(controller, pystray, poll_interval_s=0.1)


def labels(app) -> list[str]:
    """The pystray menu's labels as the desktop would show them (submenus indented)."""

    def walk(menu, depth):
        for item in menu.items:
            if item is app.pystray.Menu.SEPARATOR:
                continue
            yield "  " * depth + item.text
            if item.submenu:
                yield from walk(item.submenu, depth + 1)

    return list(walk(app.icon.menu, 0))


def click(app, *path: str) -> None:
    """Activate the pystray item reached through labels starting with ``path`` (as a click would)."""
    items = app.icon.menu.items
    for i, prefix in enumerate(path):
        item = next(it for it in items if it.text.startswith(prefix))
        if i < len(path) - 1:
            items = item.submenu.items
    assert item.enabled, f"{item.text} is disabled"
    item(app.icon)


def until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------- a fake server (the HTTP contract)


class FakeServer:
    """/health, /metrics, /v1/models, /api/ps, /api/unload as `localllm serve` answers them."""

    def __init__(self) -> None:
        self.models = {"smol": "Q4_1", "qwen": "Q8_0"}
        self.running = 0
        self.healthy = True
        self.unloaded: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body, content_type="application/json"):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    status = "ok" if fake.healthy else "engine_stalled"
                    self._send(200 if fake.healthy else 503, {"status": status})
                elif self.path == "/metrics":
                    running = [fake.running] + [0] * (len(fake.models) - 1)
                    lines = [f'localllm:num_requests_running{{model_name="{m}"}} {n}'
                             for m, n in zip(fake.models, running)]
                    lines += [f'localllm:num_requests_waiting{{model_name="{m}"}} 0' for m in fake.models]
                    self._send(200, "\n".join(lines) + "\n", "text/plain")
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": m, "object": "model", "owned_by": "localllm", "max_model_len": 2048,
                         "loaded": True, "quant": q, "size_bytes": 1000, "context_length": 2048}
                        for m, q in fake.models.items()]})
                elif self.path == "/api/ps":
                    self._send(200, {"models": [
                        {"name": m, "quant": q, "size_bytes": 1000, "context_length": 2048,
                         "running": fake.running if i == 0 else 0, "waiting": 0, "expires_at": None}
                        for i, (m, q) in enumerate(fake.models.items())]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/api/unload":
                    name = body["model"]
                    found = fake.models.pop(name, None) is not None
                    fake.unloaded.append(name)
                    self._send(200, {"model": name, "unloaded": found})
                else:
                    self._send(404, {"error": {"message": "not found"}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def fake():
    server = FakeServer()
    yield server
    server.close()


# ---------------------------------------------------------------- the pure model


def test_menu_follows_the_status():
    from localllm.tray.model import Action, LoadedModel, ServerStatus, TrayState, build_menu, find_entry

    down = ServerStatus("http://127.0.0.1:11435", error="unreachable (ConnectError)")
    assert down.state is TrayState.ERROR
    menu = build_menu(down)
    assert menu[0].label == "localllm: unreachable (ConnectError)" and not menu[0].enabled
    assert find_entry(menu, "Copy address").label == "Copy address: http://127.0.0.1:11435/v1"
    assert find_entry(menu, "Server not running") is not None
    assert find_entry(menu, "Start server").enabled and not find_entry(menu, "Stop server").enabled
    assert not find_entry(menu, "Open chat").enabled

    busy = ServerStatus("http://h:1", True, True, num_running=2, num_waiting=1,
                        models=(LoadedModel("smol", "Q4_1", num_running=2), LoadedModel("bert")))
    assert busy.state is TrayState.BUSY and busy.summary == "localllm: busy (2 running, 1 waiting)"
    menu = build_menu(busy)
    smol = find_entry(menu, "smol (Q4_1)")
    assert smol.label == "smol (Q4_1) · 2 running"
    assert smol.submenu[0].action is Action.UNLOAD and smol.submenu[0].arg == "smol"
    assert find_entry(menu, "bert").submenu[0].arg == "bert"
    assert not find_entry(menu, "Start server").enabled and find_entry(menu, "Stop server").enabled
    assert [e.label for e in menu][-1] == "Quit"

    idle = ServerStatus("http://h:1", True, True)
    assert idle.state is TrayState.IDLE and find_entry(build_menu(idle), "No model loaded") is not None
    assert ServerStatus("http://h:1", True, False, error="unhealthy: 503").state is TrayState.ERROR


def test_icons_differ_by_state():
    pytest.importorskip("PIL")
    from localllm.tray.icon import draw_icon
    from localllm.tray.model import TrayState

    images = {s: draw_icon(s) for s in TrayState}
    assert all(im.size == (64, 64) and im.mode == "RGBA" for im in images.values())
    assert len({im.tobytes() for im in images.values()}) == 3
    assert draw_icon(TrayState.IDLE, 22).size == (22, 22)


# ---------------------------------------------------------------- against the fake server


def test_unload_open_chat_and_copy_with_the_fake_server(fake, pystray):
    launched: list[list[str]] = []
    copied: list[str] = []
    opened: list[str] = []
    browsed: list[str] = []
    app = make_tray(fake.url, pystray, launcher=launched.append, clipboard=copied.append,
                    opener=opened.append, browser=browsed.append)
    try:
        app.poll_once()
        shown = labels(app)
        assert shown[:2] == ["localllm: idle", f"Copy address: {fake.url}/v1"]
        assert "smol (Q4_1)" in shown and "qwen (Q8_0)" in shown and "  Unload" in shown

        click(app, "qwen", "Unload")
        assert fake.unloaded == ["qwen"]
        assert "qwen (Q8_0)" not in labels(app)  # refreshed after the unload

        click(app, "Copy address")
        assert copied == [f"{fake.url}/v1"]
        click(app, "Open chat")
        assert browsed == [f"{fake.url}/"] and not launched
        click(app, "Chat in a terminal")
        assert len(launched) == 1 and launched[0][-3:] == ["chat", "--attach", f"{fake.url}/v1"]
        click(app, "Open logs")
        assert opened and opened[0].endswith(os.path.join("logs", "server.log"))

        assert find_entry_label(app, "Start server") is False and find_entry_label(app, "Stop server") is True

        fake.running = 1
        app.poll_once()
        assert app.controller.status.state.value == "busy" and labels(app)[0].startswith("localllm: busy")
        fake.healthy = False
        app.poll_once()
        assert labels(app)[0] == "localllm: unhealthy: engine_stalled"
    finally:
        app.stop()


def find_entry_label(app, prefix: str) -> bool:
    """Whether the pystray item starting with ``prefix`` is enabled."""
    return next(it for it in app.icon.menu.items if it.text.startswith(prefix)).enabled


class FakeControl:
    """Stands in for `localllm serve --detach` / `localllm stop`."""

    def __init__(self, fake: FakeServer) -> None:
        self.fake = fake
        self.calls: list[str] = []

    def start(self) -> str:
        self.calls.append("start")
        self.fake.healthy = True
        return "started"

    def stop(self) -> str:
        self.calls.append("stop")
        self.fake.healthy = False
        return "stopped"

    @staticmethod
    def log_path() -> str:
        return "/tmp/server.log"


def test_start_and_stop_run_off_the_menu_thread(fake, pystray):
    control = FakeControl(fake)
    notes: list[str] = []
    app = make_tray(fake.url, pystray, server=control)
    app._print = notes.append
    try:
        app.poll_once()
        click(app, "Stop server")
        app.controller.last_job.join(10)
        assert control.calls == ["stop"] and "stopped" in notes
        assert app.controller.status.state.value == "error"
        fake.httpd.shutdown()  # now really unreachable: Start is offered
        fake.httpd.server_close()
        app.poll_once()
        assert find_entry_label(app, "Start server") and not find_entry_label(app, "Stop server")
        click(app, "Start server")
        app.controller.last_job.join(10)
        assert control.calls == ["stop", "start"] and "started" in notes
    finally:
        app.stop()


def test_quit_stops_the_polling_thread(fake, pystray):
    app = make_tray(fake.url, pystray)
    app.start_polling()
    until(lambda: app.controller.status.reachable, 10, "a first poll")
    click(app, "Quit")
    assert app._stop.is_set() and not app._poller.is_alive()


# ---------------------------------------------------------------- against a real `localllm serve`


def test_tray_against_a_real_server(smollm2_path, pystray):
    """The menu lists the address and the model; the icon is busy while a streamed request runs, idle
    after, and an error once the server is gone; Unload goes through /api/unload where served."""
    from localllm.tray.icon import draw_icon
    from localllm.tray.model import TrayState

    launched: list[list[str]] = []
    copied: list[str] = []
    with serving(smollm2_path, "--served-model-name", MODEL, "--kv-cache-memory", "128MiB") as proc:
        browsed: list[str] = []
        app = make_tray(proc.url, pystray, launcher=launched.append, clipboard=copied.append, browser=browsed.append)
        try:
            assert app.poll_once().state is TrayState.IDLE
            shown = labels(app)
            assert f"Copy address: {proc.url}/v1" in shown
            assert any(label.startswith(MODEL) for label in shown), shown
            assert app.icon.icon.tobytes() == draw_icon(TrayState.IDLE).tobytes()

            click(app, "Copy address")
            click(app, "Open chat")
            assert copied == [f"{proc.url}/v1"]
            assert browsed == [f"{proc.url}/"]
            assert httpx.get(browsed[0], timeout=30).text.startswith("<!doctype html>")  # the chat page
            click(app, "Chat in a terminal")
            assert launched[0][-3:] == ["chat", "--attach", f"{proc.url}/v1"]

            states: list[TrayState] = []
            app.start_polling()
            body = {"model": MODEL, "stream": True, "max_tokens": 400, "temperature": 0,
                    "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}]}
            with httpx.stream("POST", f"{proc.url}/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    states.append(app.controller.status.state)
                    if TrayState.BUSY in states:
                        break  # closing the stream aborts the request
            assert TrayState.BUSY in states
            until(lambda: app.controller.status.state is TrayState.IDLE, 30, "idle after the request")
            assert app.icon.icon.tobytes() == draw_icon(TrayState.IDLE).tobytes()

            ps = httpx.get(f"{proc.url}/api/ps", timeout=5)
            assert ps.status_code == 200 and [m["name"] for m in ps.json()["models"]] == [MODEL]
            click(app, MODEL, "Unload")  # at once, or (pending) once the aborted request has finished

            def loaded_names() -> list[str]:
                return [m["name"] for m in httpx.get(f"{proc.url}/api/ps", timeout=5).json()["models"]]

            until(lambda: MODEL not in loaded_names(), 30, "the model to leave /api/ps")
            until(lambda: not any(label.startswith(MODEL) for label in labels(app)), 10, "the menu")
            assert "No model loaded" in labels(app)
        except BaseException:
            print(proc.output()[-3000:])
            app.stop()
            raise
    until(lambda: app.controller.status.state is TrayState.ERROR, 10, "error once the server is down")
    assert app.icon.icon.tobytes() == draw_icon(TrayState.ERROR).tobytes()
    assert labels(app)[0].startswith("localllm: unreachable")
    app.stop()


# ---------------------------------------------------------------- the command and autostart


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="only X11/Wayland desktops can lack a display; macOS and Windows always have one")
def test_tray_without_a_display_says_so_and_exits_1(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "PYSTRAY_BACKEND")}
    env["LOCALLLM_HOME"] = str(tmp_path)
    res = subprocess.run([sys.executable, "-m", "localllm.cli", "tray"], env=env, capture_output=True,
                         check=False,
                         text=True, timeout=60)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = (res.stdout + res.stderr).strip().splitlines()
    assert len(lines) == 1 and "no display" in lines[0], lines


def _install_tray(tmp_path, monkeypatch, platform: str) -> tuple[str, list[list[str]]]:
    from typer.testing import CliRunner

    from localllm.cli import app
    from localllm.serving import service

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home dir"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(service.sys, "platform", platform)
    ran: list[list[str]] = []
    monkeypatch.setattr(service, "run_commands", lambda commands: ran.extend(commands) or [])
    res = CliRunner().invoke(app, ["service", "install", "--tray"])
    assert res.exit_code == 0, res.output
    return res.output, ran


def test_service_install_tray_writes_an_xdg_autostart_entry(tmp_path, monkeypatch):
    import configparser

    output, ran = _install_tray(tmp_path, monkeypatch, "linux")
    entry_path = tmp_path / "xdg" / "autostart" / "localllm-tray.desktop"
    assert f"Wrote {entry_path}" in output
    assert (tmp_path / "xdg" / "systemd" / "user" / "localllm.serving.service").is_file()  # the server too
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str
    parser.read_string(entry_path.read_text())
    entry = parser["Desktop Entry"]
    assert entry["Type"] == "Application" and entry["Terminal"] == "false"
    assert entry["Exec"].startswith(f'env "LOCALLLM_HOME={tmp_path / "home dir"}" ')
    assert entry["Exec"].endswith(" tray")
    assert ["systemctl", "--user", "enable", "--now", "localllm.serving.service"] in ran


def test_service_install_tray_writes_a_launchd_agent(tmp_path, monkeypatch):
    output, ran = _install_tray(tmp_path, monkeypatch, "darwin")
    path = tmp_path / "Library" / "LaunchAgents" / "dev.localllm.tray.plist"
    assert f"Wrote {path}" in output
    plist = plistlib.loads(path.read_bytes())
    assert plist["Label"] == "dev.localllm.tray" and plist["ProgramArguments"][-1] == "tray"
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] is False
    assert plist["EnvironmentVariables"]["LOCALLLM_HOME"] == str(tmp_path / "home dir")
    assert ["launchctl", "load", "-w", str(path)] in ran


def test_desktop_helpers_pick_what_is_installed(monkeypatch, capsys):
    from localllm.tray import desktop

    monkeypatch.setattr(desktop.shutil, "which", lambda name: None)
    desktop.copy_text("http://127.0.0.1:11435/v1")  # no clipboard tool: printed
    assert capsys.readouterr().out == "http://127.0.0.1:11435/v1\n"
    assert desktop.terminal_command(["localllm", "chat"], platform="linux") is None
    with pytest.raises(RuntimeError, match="no terminal emulator"):
        desktop.launch_in_terminal(["localllm", "chat"])
    monkeypatch.setattr(desktop.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "xterm" else None)
    xterm = desktop.terminal_command(["localllm", "chat"], platform="linux")
    assert xterm == ["xterm", "-e", "localllm", "chat"]
    mac = desktop.terminal_command(["/a b/localllm", "chat"], platform="darwin")
    assert mac[0] == "osascript" and "'/a b/localllm' chat" in mac[2]


def test_docs_picture_renders(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    from localllm.tray.render import main

    main([str(tmp_path / "tray.png")])
    img = Image.open(tmp_path / "tray.png")
    assert img.size[0] > 300 and img.size[1] > 300
