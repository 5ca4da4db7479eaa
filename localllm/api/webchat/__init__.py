"""The web chat page at ``/`` and its files under ``/ui/``: static files shipped in the package
(``static/``), with no build step. The page talks to the server's own ``/v1/chat/completions``.

- Model output is rendered as Markdown by the vendored ``marked``, then sanitized by ``DOMPurify``
  before it reaches the page; code is highlighted by ``highlight.js`` (``static/vendor/``, each with
  its licence, pinned in ``manifest.json``).
- A content security policy lets only the package's own scripts run and the page reach only this
  server: even markup that got past the sanitizer could neither run script nor load a remote image.
- The page and its files are public (they hold no data); with ``--api-key`` the page asks for the key.
- The page carries a token made when the app is built, so that its requests may ask for the
  interactive priority, as the chat TUI's do (:func:`localllm.api.guard.priority_bound`).
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response

from localllm import __version__
from localllm.api.guard import CHAT_PAGE_HEADER, new_chat_page_token
from localllm.config.engine import INTERACTIVE_PRIORITY

_MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}

# Only the page's own origin: scripts and styles from /ui/, requests to this server, images the user
# attaches (data: and blob: URLs). No inline script, no plugin, no framing by another site.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _static():
    return resources.files(__package__) / "static"


@cache
def asset_names() -> frozenset[str]:
    """The files under ``/ui/``: the page's script and style, and the vendored libraries (no licence
    or manifest: they are read in the package, not served)."""
    static = _static()
    names = {f.name for f in static.iterdir() if f.name.endswith(tuple(_MEDIA_TYPES))}
    names |= {f"vendor/{f['file']}" for f in vendored()}
    return frozenset(names)


@cache
def vendored() -> list[dict]:
    """``static/vendor/manifest.json``: each vendored file's npm package, version, licence and sha256."""
    return json.loads((_static() / "vendor" / "manifest.json").read_text(encoding="utf-8"))["files"]


def add_web_chat(app: FastAPI) -> None:
    """Serve the chat page at ``/`` and its files at ``/ui/NAME`` on ``app``."""
    token = new_chat_page_token(app)
    page = (_static() / "index.html").read_text(encoding="utf-8")
    for key, value in {
        "version": __version__,
        "chat_page_header": CHAT_PAGE_HEADER,
        "chat_page_token": token,
        "interactive_priority": str(INTERACTIVE_PRIORITY),
    }.items():
        page = page.replace("{{" + key + "}}", value)

    @app.get("/", include_in_schema=False)
    def chat_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    @app.get("/ui/{name:path}", include_in_schema=False)
    def chat_page_file(name: str) -> Response:
        if name not in asset_names():
            raise HTTPException(404, f"no file {name!r} in the chat page")
        body = (_static() / name).read_bytes()
        media_type = _MEDIA_TYPES[name[name.rindex(".") :]]
        return Response(body, media_type=media_type, headers=_HEADERS)
