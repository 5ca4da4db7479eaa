"""Best-effort desktop helpers: the clipboard, a terminal window, opening a file.

Each is a plain function with a small type (:data:`Clipboard`, :data:`Launcher`, :data:`Opener`), so
the tray takes them as parameters and tests hand in their own.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable

Clipboard = Callable[[str], None]  # put text on the clipboard
Launcher = Callable[[list[str]], None]  # run argv in a new terminal window
Opener = Callable[[str], None]  # open a file with the desktop's default application

# (program, arguments before the text on stdin) in the order tried
CLIPBOARD_TOOLS: tuple[tuple[str, ...], ...] = (
    ("wl-copy",),
    ("xclip", "-selection", "clipboard"),
    ("xsel", "--clipboard", "--input"),
    ("pbcopy",),
    ("clip.exe",),
)

# terminal emulators and how each is told to run a command
TERMINALS: tuple[tuple[str, ...], ...] = (
    ("x-terminal-emulator", "-e"),
    ("gnome-terminal", "--"),
    ("konsole", "-e"),
    ("xterm", "-e"),
)


def copy_text(text: str) -> None:
    """Copy ``text`` with the first clipboard tool found; print it when there is none."""
    for tool in CLIPBOARD_TOOLS:
        if shutil.which(tool[0]) is None:
            continue
        try:
            subprocess.run(list(tool), input=text, text=True, check=True, timeout=5,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return
        except (OSError, subprocess.SubprocessError):
            continue
    print(text)


def terminal_command(argv: list[str], platform: str | None = None) -> list[str] | None:
    """The command line that opens a terminal window running ``argv``; None if no terminal is known."""
    platform = platform or sys.platform
    if platform == "darwin":
        import shlex

        script = " ".join(shlex.quote(a) for a in argv)
        return ["osascript", "-e", f'tell application "Terminal" to do script "{script}"',
                "-e", 'tell application "Terminal" to activate']
    for term in TERMINALS:
        if shutil.which(term[0]) is not None:
            return [*term, *argv]
    return None


def launch_in_terminal(argv: list[str]) -> None:
    """Run ``argv`` in a new terminal window (detached from the tray)."""
    cmd = terminal_command(argv)
    if cmd is None:
        raise RuntimeError("no terminal emulator found (x-terminal-emulator, gnome-terminal, konsole, "
                           f"xterm); run: {' '.join(argv)}")
    subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def open_url(url: str) -> None:
    """Open ``url`` in the desktop's web browser."""
    import webbrowser

    if not webbrowser.open(url):
        raise RuntimeError(f"no web browser found; open {url}")


def open_path(path: str) -> None:
    """Open ``path`` with ``xdg-open`` (Linux) or ``open`` (macOS)."""
    tool = "open" if sys.platform == "darwin" else "xdg-open"
    if shutil.which(tool) is None:
        raise RuntimeError(f"{tool} not found; the file is {path}")
    subprocess.Popen([tool, path], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
