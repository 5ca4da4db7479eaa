"""Defences of the HTTP server against hostile browsers and greedy clients, as two ASGI layers
(:class:`HostCheck` outermost, :class:`BodyCheck` inside the API-key check, :class:`ApiKeyMiddleware`).

- **Host check** (DNS rebinding): a web page can make a browser send requests to
  ``127.0.0.1:PORT`` under a name the attacker controls. A server bound to loopback therefore
  answers only requests whose ``Host`` names loopback (``localhost``, ``127.0.0.1``, ``[::1]``)
  or one of ``allowed_hosts``; ``*`` turns the check off. A server bound elsewhere checks only
  when ``allowed_hosts`` is given.
- **JSON only**: a POST must say ``Content-Type: application/json``. The content types a
  cross-site form or ``fetch`` can send without a CORS preflight (``text/plain``, forms, none)
  are refused with 415, so no page can drive the API from a visitor's browser.
- **Body size**: a request body over ``max_request_bytes`` is refused with 413, whether it
  declares its length or streams it in chunks, before any of it is parsed.
- **Cross-site requests**: a page on another site can still make a browser send a GET (an image,
  a ``fetch`` in no-cors mode) and some GETs load a model (``/tokenizer_info?model=``). A request a
  browser marks ``Sec-Fetch-Site: cross-site`` (but a top-level navigation to a page), or whose
  ``Origin`` is not the server's own (scheme aside: its host and port are the ``Host`` header's), is
  refused with 403, whatever its method. Clients other than browsers send neither header.
- **The chat page's priority**: the server's own web chat page carries a token made when the app is
  built (:data:`CHAT_PAGE_HEADER`); requests that send it may ask for the interactive priority, as
  the chat TUI's do, whatever ``max_client_priority`` says (:func:`priority_bound`).
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from collections.abc import Iterable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localllm.api.errors import AuthenticationError, error_response
from localllm.config.engine import INTERACTIVE_PRIORITY
from localllm.errors import (
    HostNotAllowedError,
    InvalidRequestError,
    LocalLLMError,
    RequestTooLargeError,
    UnsupportedMediaTypeError,
)

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_host_names(bound_host: str, allowed_hosts: Iterable[str] | None) -> frozenset[str] | None:
    """The Host names to accept (lower case, no port), or None for any."""
    extra = {h.strip().lower().strip("[]") for h in (allowed_hosts or []) if h.strip()}
    if "*" in extra:
        return None
    if is_loopback(bound_host):
        return frozenset(LOOPBACK_NAMES | {bound_host.lower().strip("[]")} | extra)
    return frozenset(extra) if extra else None


def _host_name(header: str) -> str:
    """``Host`` without its port: ``[::1]:8080`` -> ``::1``, ``localhost:80`` -> ``localhost``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class HostCheck:
    """Refuses requests whose ``Host`` is not in ``allowed_hosts`` (None: any) with 403."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: frozenset[str] | None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed_hosts is not None:
            headers = dict(scope["headers"])
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed_hosts:
                error = HostNotAllowedError(
                    f"Host {host!r} is not allowed: this server answers "
                    f"{', '.join(sorted(self.allowed_hosts))} (add names with --allowed-hosts)",
                    code="host_not_allowed",
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CrossSiteCheck:
    """Refuses requests a browser sends for another site's page with 403 (see the module's docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            problem = cross_site_problem(scope["method"], headers)
            if problem is not None:
                await error_response(HostNotAllowedError(problem, code="cross_site_request"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def cross_site_problem(method: str, headers: dict[bytes, bytes]) -> str | None:
    """Why a request is another site's (None: it is not)."""
    site = headers.get(b"sec-fetch-site", b"").decode("latin-1").lower()
    navigation = method == "GET" and headers.get(b"sec-fetch-mode", b"").decode("latin-1").lower() == "navigate"
    if site == "cross-site" and not navigation:
        return "a request from another site's page is refused"
    origin = headers.get(b"origin")
    if origin is not None:
        value = origin.decode("latin-1").strip().lower()
        own = headers.get(b"host", b"").decode("latin-1").strip().lower()
        if value.split("://", 1)[-1].rstrip("/") != own:
            return f"a request from the origin {value!r} is refused: this server answers pages of its own origin"
    return None


class BodyCheck:
    """Refuses POST bodies that are not JSON (415) or larger than ``max_request_bytes`` (413).

    A body without a declared length is read here, up to the limit, before the app sees it.
    """

    def __init__(self, app: ASGIApp, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        error = self.check_headers(headers)
        if error is None and b"content-length" not in headers:
            receive, error = await self._buffered(receive)
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def check_headers(self, headers: dict[bytes, bytes]) -> LocalLLMError | None:
        """The error for a body that is not JSON or declares more than the limit (None: go on)."""
        if not _is_json(headers.get(b"content-type", b"").decode("latin-1")):
            return UnsupportedMediaTypeError(
                "the request body must be JSON, sent with 'Content-Type: application/json'",
                code="unsupported_media_type",
            )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return InvalidRequestError("invalid Content-Length header")
            if declared > self.max_request_bytes:
                return self.too_large(declared)
        return None

    def too_large(self, size: int | None) -> RequestTooLargeError:
        got = f" ({size} bytes)" if size is not None else ""
        return RequestTooLargeError(
            f"the request body is larger than {self.max_request_bytes} bytes{got}; raise --max-request-bytes",
            code="request_too_large",
        )

    async def _buffered(self, receive: Receive) -> tuple[Receive, LocalLLMError | None]:
        """Read a chunked body (at most the limit); a receive that replays it, then passes on to the
        client's own (a streaming response listens there for the client going away)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return _replay([message], receive), None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_request_bytes:
                return receive, self.too_large(None)
            if not message.get("more_body", False):
                body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return _replay([body], receive), None


def _replay(messages: list[Message], then: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await then()

    return replay


# Paths anyone may read without the API key: the liveness probe, the chat page and its files (they hold no
# data and ask for the key themselves). /metrics is not one: its series name the models and their traffic,
# and Prometheus sends the key as a bearer token (``authorization.credentials``).
PUBLIC_PATHS = frozenset({"/health", "/"})
PUBLIC_PREFIXES = ("/ui/",)

CHAT_PAGE_HEADER = "x-localllm-chat-page"


def new_chat_page_token(app) -> str:
    """A new token for ``app``'s chat page, kept on the app for :func:`priority_bound`."""
    app.state.chat_page_token = token = secrets.token_urlsafe(24)
    return token


def priority_bound(request: Request, max_client_priority: int) -> int:
    """The most urgent priority ``request`` may ask for: ``max_client_priority``, or the interactive
    priority for the server's own chat page (its token in :data:`CHAT_PAGE_HEADER`)."""
    token = getattr(request.app.state, "chat_page_token", None)
    sent = request.headers.get(CHAT_PAGE_HEADER)
    if token and sent and hmac.compare_digest(sent.encode(), token.encode()):
        return min(max_client_priority, INTERACTIVE_PRIORITY)
    return max_client_priority


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (Anthropic's clients) on every
    path but :data:`PUBLIC_PATHS`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in PUBLIC_PATHS and not path.startswith(PUBLIC_PREFIXES):
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            x_api_key = headers.get(b"x-api-key")  # Anthropic's clients send the key here
            if not (
                (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key))
                or (x_api_key is not None and hmac.compare_digest(x_api_key.strip(), self.api_key))
            ):
                exc = AuthenticationError(
                    "missing or wrong API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY'"
                )
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
