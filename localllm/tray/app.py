"""The pystray glue: an icon and menu mirroring :class:`~localllm.tray.model.TrayController`, and
the thread that polls the server every :data:`POLL_INTERVAL_S` seconds."""

from __future__ import annotations

import os
import sys
import threading
from types import ModuleType

from localllm.tray.icon import draw_icon
from localllm.tray.model import MenuEntry, ServerStatus, TrayController

POLL_INTERVAL_S = 2.0


class TrayUnavailable(RuntimeError):
    """No display or tray backend here (a server, SSH without X forwarding, pystray missing)."""


def load_pystray() -> ModuleType:
    """Import pystray, or raise :class:`TrayUnavailable` saying why in one line."""
    forced = os.environ.get("PYSTRAY_BACKEND")
    if (sys.platform.startswith("linux") and not forced
            and not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))):
        raise TrayUnavailable("no display (DISPLAY / WAYLAND_DISPLAY unset); "
                              "the tray needs a desktop session")
    try:
        import pystray
    except ImportError as exc:
        raise TrayUnavailable(f"pystray is not installed ({exc}); pip install 'localllm[tray]'") from None
    except Exception as exc:  # pystray picks its backend on import, and raises the last one's failure
        raise TrayUnavailable(f"no tray backend available: {type(exc).__name__}: {exc}") from None
    return pystray


class TrayApp:
    """A pystray ``Icon`` kept in step with the controller's status by a polling thread."""

    def __init__(self, controller: TrayController, pystray: ModuleType,
                 poll_interval_s: float = POLL_INTERVAL_S) -> None:
        self.controller = controller
        self.pystray = pystray
        self.poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        controller.on_quit = self.stop
        status = controller.status
        self.icon = pystray.Icon("localllm", draw_icon(status.state), status.summary,
                                 menu=pystray.Menu(self._items))
        self._shown_state = status.state
        self._print = controller.notify
        controller.notify = self.notify

    def notify(self, message: str) -> None:
        """Say ``message`` (a failed click, a started server) as a desktop notification where there is one."""
        self._print(message)
        if self.icon.visible and self.icon.HAS_NOTIFICATION:
            try:
                self.icon.notify(message, "localllm")
            except Exception:  # notifications are a nicety
                pass

    # ---------------------------------------------------------------- menu

    def _items(self) -> tuple:
        return tuple(self._item(entry) for entry in self.controller.menu())

    def _item(self, entry: MenuEntry):
        Menu, MenuItem = self.pystray.Menu, self.pystray.MenuItem
        if entry.is_separator:
            return Menu.SEPARATOR
        if entry.submenu:
            return MenuItem(entry.label, Menu(*(self._item(e) for e in entry.submenu)), enabled=entry.enabled)
        return MenuItem(entry.label, self._on_click(entry), enabled=entry.enabled)

    def _on_click(self, entry: MenuEntry):
        def on_click(icon, item) -> None:  # pystray counts the parameters: exactly (icon, item)
            self._click(entry)

        return on_click

    def _click(self, entry: MenuEntry) -> None:
        self.controller.invoke(entry)
        self.show(self.controller.status)

    # ---------------------------------------------------------------- status

    def poll_once(self) -> ServerStatus:
        status = self.controller.refresh()
        self.show(status)
        return status

    def show(self, status: ServerStatus) -> None:
        """Put ``status`` on the icon: image (when the state changed), tooltip, menu."""
        if status.state is not self._shown_state:
            self.icon.icon = draw_icon(status.state)
            self._shown_state = status.state
        self.icon.title = status.summary
        try:
            self.icon.update_menu()
        except NotImplementedError:  # the dummy backend has no native menu
            pass

    def _poll_loop(self) -> None:
        while True:
            try:
                self.poll_once()
            except Exception as exc:  # keep polling whatever one poll did
                self.controller.notify(f"poll failed: {exc}")
            if self._stop.wait(self.poll_interval_s):
                return

    def start_polling(self) -> None:
        self._poller = threading.Thread(target=self._poll_loop, name="tray-poll", daemon=True)
        self._poller.start()

    # ---------------------------------------------------------------- lifetime

    def run(self) -> None:
        """Show the icon and block until Quit."""
        self.start_polling()
        self.icon.run()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.icon.stop()
        except NotImplementedError:
            pass
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=5)
        self.controller.close()
