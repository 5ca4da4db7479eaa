"""The tray's state and menu, built from what the server's HTTP API says; no GUI here.

:func:`fetch_status` reads one :class:`ServerStatus`; :func:`build_menu` turns it into
:class:`MenuEntry` values (label, action name, argument); :class:`TrayController` runs an entry's
action (copy the address, unload a model, open a chat, start / stop the server, open the log).
The pystray glue (:mod:`localllm.tray.app`) only mirrors these entries.
"""

from __future__ import annotations

import enum
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from localllm.client.http import auth_headers, metric_values
from localllm.tray.desktop import Clipboard, Launcher, Opener, copy_text, launch_in_terminal, open_path, open_url


class TrayState(enum.Enum):
    IDLE = "idle"  # the server answers, nothing running
    BUSY = "busy"  # at least one request running (per /metrics)
    ERROR = "error"  # unreachable, or /health not ok


@dataclass(slots=True, frozen=True)
class LoadedModel:
    name: str
    quant: str | None = None
    size_bytes: int = 0
    num_running: int = 0
    num_waiting: int = 0

    @property
    def label(self) -> str:
        return f"{self.name} ({self.quant})" if self.quant else self.name


@dataclass(slots=True, frozen=True)
class ServerStatus:
    """What the server said on one poll."""

    base_url: str  # http://host:port (no /v1)
    reachable: bool = False
    healthy: bool = False
    num_running: int = 0
    num_waiting: int = 0
    models: tuple[LoadedModel, ...] = ()
    error: str | None = None  # why the state is ERROR, in a few words

    @property
    def state(self) -> TrayState:
        if not (self.reachable and self.healthy):
            return TrayState.ERROR
        return TrayState.BUSY if self.num_running > 0 else TrayState.IDLE

    @property
    def api_address(self) -> str:
        """What OpenAI clients are given: the ``/v1`` base URL."""
        return f"{self.base_url}/v1"

    @property
    def summary(self) -> str:
        """One line for the icon's tooltip and the menu's first row."""
        state = self.state
        if state is TrayState.ERROR:
            return f"localllm: {self.error or 'error'}"
        if state is TrayState.BUSY:
            waiting = f", {self.num_waiting} waiting" if self.num_waiting else ""
            return f"localllm: busy ({self.num_running} running{waiting})"
        return "localllm: idle"


def parse_gauges(text: str) -> tuple[int, int]:
    """Running and waiting requests, summed over models, from Prometheus text."""
    values = metric_values(text)
    return int(values.get("num_requests_running", 0)), int(values.get("num_requests_waiting", 0))


def _loaded_models(client: httpx.Client, base_url: str) -> tuple[LoadedModel, ...]:
    """The models in memory: ``/api/ps``, else the ``loaded`` entries of ``/v1/models`` (an older
    server without ``/api/ps`` serves exactly the models it lists)."""
    r = client.get(f"{base_url}/api/ps")
    if r.status_code == 200:
        return tuple(
            LoadedModel(
                name=str(m["name"]),
                quant=m.get("quant"),
                size_bytes=int(m.get("size_bytes") or 0),
                num_running=int(m.get("running") or 0),
                num_waiting=int(m.get("waiting") or 0),
            )
            for m in r.json().get("models", [])
        )
    r = client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    return tuple(
        LoadedModel(name=str(m["id"]), quant=m.get("quant"), size_bytes=int(m.get("size_bytes") or 0))
        for m in r.json().get("data", [])
        if m.get("loaded", True)
    )


def fetch_status(client: httpx.Client, base_url: str) -> ServerStatus:
    """One poll of the server at ``base_url``; never raises for a server that is down or odd."""
    try:
        health = client.get(f"{base_url}/health")
    except httpx.HTTPError as exc:
        return ServerStatus(base_url, error=f"unreachable ({type(exc).__name__})")
    if health.status_code != 200:
        try:
            reason = health.json().get("status") or health.json().get("error", {}).get("message")
        except (ValueError, AttributeError):
            reason = None
        return ServerStatus(base_url, reachable=True, error=f"unhealthy: {reason or health.status_code}")
    try:
        running, waiting = 0, 0
        metrics = client.get(f"{base_url}/metrics")
        if metrics.status_code == 200:
            running, waiting = parse_gauges(metrics.text)
        models = _loaded_models(client, base_url)
    except httpx.TransportError as exc:  # gone between the calls (a server stopping mid-poll)
        return ServerStatus(base_url, error=f"unreachable ({type(exc).__name__})")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return ServerStatus(base_url, reachable=True, error=f"bad answer ({type(exc).__name__})")
    return ServerStatus(base_url, True, True, running, waiting, models)


# ---------------------------------------------------------------- the menu


class Action(enum.Enum):
    COPY_ADDRESS = "copy_address"
    UNLOAD = "unload"
    OPEN_CHAT = "open_chat"
    OPEN_TERMINAL_CHAT = "open_terminal_chat"
    START_SERVER = "start_server"
    STOP_SERVER = "stop_server"
    OPEN_LOGS = "open_logs"
    QUIT = "quit"


@dataclass(slots=True, frozen=True)
class MenuEntry:
    """One row of the menu: a label, what clicking it does (None: a caption), a submenu."""

    label: str
    action: Action | None = None
    arg: str | None = None  # the model name, for UNLOAD
    enabled: bool = True
    submenu: tuple[MenuEntry, ...] = ()

    @property
    def is_separator(self) -> bool:
        return self.label == SEPARATOR.label


SEPARATOR = MenuEntry("-")


def build_menu(status: ServerStatus) -> tuple[MenuEntry, ...]:
    """The menu for ``status``, top to bottom."""
    up = status.state is not TrayState.ERROR
    entries: list[MenuEntry] = [
        MenuEntry(status.summary, enabled=False),
        MenuEntry(f"Copy address: {status.api_address}", Action.COPY_ADDRESS),
        SEPARATOR,
    ]
    if not status.reachable:
        entries.append(MenuEntry("Server not running", enabled=False))
    elif not status.models:
        entries.append(MenuEntry("No model loaded", enabled=False))
    for model in status.models:
        busy = f" · {model.num_running} running" if model.num_running else ""
        entries.append(
            MenuEntry(model.label + busy, submenu=(MenuEntry("Unload", Action.UNLOAD, arg=model.name),))
        )
    entries += [
        SEPARATOR,
        MenuEntry("Open chat", Action.OPEN_CHAT, enabled=up),
        MenuEntry("Chat in a terminal", Action.OPEN_TERMINAL_CHAT, enabled=up),
        MenuEntry("Start server", Action.START_SERVER, enabled=not status.reachable),
        MenuEntry("Stop server", Action.STOP_SERVER, enabled=status.reachable),
        MenuEntry("Open logs", Action.OPEN_LOGS),
        SEPARATOR,
        MenuEntry("Quit", Action.QUIT),
    ]
    return tuple(entries)


def find_entry(entries: Sequence[MenuEntry], label_start: str) -> MenuEntry | None:
    """The first entry (submenus included, depth first) whose label starts with ``label_start``."""
    for entry in entries:
        if entry.label.startswith(label_start):
            return entry
        found = find_entry(entry.submenu, label_start)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------- actions


def chat_command(api_address: str) -> list[str]:
    """``localllm chat --attach URL``, with this Python's ``localllm``."""
    import shutil

    exe = shutil.which("localllm")
    return [*([exe] if exe else [sys.executable, "-m", "localllm.cli"]), "chat", "--attach", api_address]


@dataclass(slots=True)
class ServerControl:
    """How the tray starts and stops a detached server (``localllm serve --detach`` / ``localllm stop``)."""

    host: str = "127.0.0.1"
    port: int = 11435
    model: str | None = None  # None: the server's configured default
    api_key: str | None = None

    def start(self) -> str:
        from localllm.serving.service import start_detached

        argv = ([self.model] if self.model else []) + ["--host", self.host, "--port", str(self.port)]
        env = {"LOCALLLM_API_KEY": self.api_key} if self.api_key else None
        rec = start_detached(argv, self.host, self.port, self.model or "default", env=env)
        return f"started the server (pid {rec.pid})"

    def stop(self) -> str:
        from localllm.serving.service import StaleRecordError, stop_detached

        try:
            rec = stop_detached()
        except StaleRecordError as exc:
            return f"nothing stopped: {exc}"
        return "no detached server to stop" if rec is None else f"stopped the server (pid {rec.pid})"

    @staticmethod
    def log_path() -> str:
        from localllm.serving.service import log_file

        return str(log_file())


@dataclass
class TrayController:
    """Holds the latest status and runs menu actions. Everything desktop-facing is injectable."""

    base_url: str
    api_key: str | None = None
    server: ServerControl = field(default_factory=ServerControl)
    launcher: Launcher = launch_in_terminal
    clipboard: Clipboard = copy_text
    opener: Opener = open_path
    browser: Opener = open_url
    on_quit: Callable[[], None] = lambda: None
    notify: Callable[[str], None] = lambda message: print(message, file=sys.stderr)
    timeout_s: float = 2.0
    status: ServerStatus = field(init=False)
    last_job: threading.Thread | None = field(init=False, default=None)  # the last start / stop
    _client: httpx.Client = field(init=False, repr=False)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")
        self._client = httpx.Client(headers=auth_headers(self.api_key), timeout=self.timeout_s)
        self.status = ServerStatus(self.base_url, error="not polled yet")

    def refresh(self) -> ServerStatus:
        status = fetch_status(self._client, self.base_url)
        with self._lock:
            self.status = status
        return status

    def menu(self) -> tuple[MenuEntry, ...]:
        return build_menu(self.status)

    def invoke(self, entry: MenuEntry) -> None:
        """Run ``entry``'s action; failures are reported through ``notify``, never raised."""
        if entry.action is None or not entry.enabled:
            return
        try:
            self._run(entry)
        except Exception as exc:  # noqa: BLE001 (a tray must survive any one click)
            self.notify(f"{entry.label}: {exc}")

    def _run(self, entry: MenuEntry) -> None:
        action = entry.action
        if action is Action.COPY_ADDRESS:
            self.clipboard(self.status.api_address)
        elif action is Action.UNLOAD:
            self.unload(entry.arg or "")
        elif action is Action.OPEN_CHAT:  # the server's web chat page
            self.browser(f"{self.base_url}/")
        elif action is Action.OPEN_TERMINAL_CHAT:
            self.launcher(chat_command(self.status.api_address))
        elif action is Action.START_SERVER:  # waits for /health (up to minutes): not on the GUI thread
            self._in_background(self.server.start, "could not start the server")
        elif action is Action.STOP_SERVER:  # waits for the server to exit (up to 30 s)
            self._in_background(self.server.stop, "could not stop the server")
        elif action is Action.OPEN_LOGS:
            self.opener(self.server.log_path())
        elif action is Action.QUIT:
            self.on_quit()

    def _in_background(self, job: Callable[[], str], failure: str) -> threading.Thread:
        """Run ``job`` (its result is notified) on a thread, then poll at once."""

        def run() -> None:
            try:
                self.notify(job())
            except Exception as exc:  # noqa: BLE001 (on a thread of its own: a failure is told, never raised)
                self.notify(f"{failure}: {exc}")
            self.refresh()

        thread = threading.Thread(target=run, name="tray-job", daemon=True)
        thread.start()
        self.last_job = thread
        return thread

    def unload(self, model: str) -> bool:
        r = self._client.post(f"{self.base_url}/api/unload", json={"model": model})
        if r.status_code != 200:
            raise RuntimeError(f"unload answered HTTP {r.status_code}: {r.text[:200]}")
        answer = r.json()
        if answer.get("pending"):
            self.notify(f"{model} unloads once its running requests finish")
        elif not answer.get("unloaded"):
            self.notify(f"{model} was not loaded")
        self.refresh()
        return bool(answer.get("unloaded"))

    def close(self) -> None:
        self._client.close()

