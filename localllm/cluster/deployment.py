"""The Ray Serve application behind ``localllm serve MODEL --replicas N``: three deployments.

- :class:`EngineReplica` (N of them, or autoscaled): one whole localllm server in each, the same
  :func:`~localllm.api.launch.build_pool` and :func:`~localllm.api.launch.server_app` as ``serve``
  without replicas, called in-process over ASGI for each request the ingress hands it. Every route,
  check, error shape, stream and metric is that server's.
- :class:`Ingress` (one, no CPU of its own): Ray's HTTP proxy hands it every request; it reads the
  body for the prompt's prefix (:mod:`localllm.cluster.affinity`) and passes the request to an engine
  replica through a deployment handle, whose router (:mod:`localllm.cluster.router`) picks the
  replica. It streams the replica's answer back; a client that goes away cancels the request on the
  replica, which aborts it in the engine. ``/metrics`` is every replica's, labelled ``replica``.
- :class:`MetricsBoardDeployment`: where the replicas post their ``/metrics`` (:mod:`localllm.cluster.metrics`).

A request that could not reach its replica (the replica died before answering) is sent once more,
to another; one that was running on a replica that died ends as that replica left it.
"""


import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from localllm.api.anthropic.serving import AnthropicErrorShape
from localllm.api.errors import error_response
from localllm.api.guard import BodyCheck
from localllm.api.launch import build_pool, server_app
from localllm.cluster.affinity import AffinityKey, prompt_text, response_id_in
from localllm.cluster.metrics import PUSH_INTERVAL_S, MetricsBoard, merge_replica_metrics
from localllm.cluster.plan import ReplicaPlan
from localllm.cluster.router import PrefixAffinityRouter
from localllm.config.engine import parse_bytes

logger = logging.getLogger(__name__)

APP_NAME = "localllm"
SEND_ATTEMPTS = 2
RESPONSE_OWNERS = 65_536  # Responses API ids whose replica the ingress remembers (its store is in that replica)
_REPLICA_HEADER = b"x-localllm-replica"


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    server: tuple[str, int] | None


@dataclass(frozen=True, slots=True)
class ResponseStart:
    """The first item a replica yields for a request: status and headers; the body's chunks follow."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class MetricsBoardDeployment(MetricsBoard):
    """:class:`~localllm.cluster.metrics.MetricsBoard` as a deployment (one replica)."""


class EngineReplica:
    """One localllm server (its pool, engine and API app) inside a Ray Serve replica."""

    def __init__(self, settings, device: str, board: DeploymentHandle) -> None:
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.pool, _ = build_pool(settings, device)
        self.app = server_app(settings, self.pool)
        self._board = board
        self._stop = threading.Event()
        threading.Thread(target=self._post_metrics, name="localllm-metrics", daemon=True).start()

    def _post_metrics(self) -> None:
        while not self._stop.wait(PUSH_INTERVAL_S):
            try:
                self._board.post.remote(self.replica, self.app.state.router.metrics.render().decode())
            except Exception:  # the board restarts; the next post reaches it
                logger.debug("posting metrics failed", exc_info=True)

    def __del__(self) -> None:
        self._stop.set()
        self.pool.shutdown(timeout=0)

    async def handle(self, request: ForwardedRequest, affinity: AffinityKey | None = None,
                     pinned_replica: str | None = None) -> AsyncIterator[ResponseStart | bytes]:
        """Run ``request`` through this replica's app: a :class:`ResponseStart`, then the body's chunks.
        (``affinity`` and ``pinned_replica`` are the router's.) Cancelled (its client went away), the
        app sees a disconnect and its engine requests are aborted."""
        messages: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_read = False

        async def receive() -> dict:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            messages.put_nowait(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                messages.put_nowait(None)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
            "method": request.method, "path": request.path, "raw_path": request.path.encode(),
            "query_string": request.query_string, "root_path": "", "headers": request.headers,
            "client": request.client, "server": request.server,
        }
        task = asyncio.create_task(run())
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (_REPLICA_HEADER, self.replica.encode())]
                    yield ResponseStart(message["status"], headers, self.replica)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
        finally:
            disconnected.set()
            if not task.done():
                task.cancel()


class _ResponseOwners:
    """Which replica stored each Responses API answer (least recently used out first)."""

    def __init__(self, capacity: int = RESPONSE_OWNERS) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def add(self, response_id: str, replica: str) -> None:
        self._owners[response_id] = replica
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def get(self, response_id: str | None) -> str | None:
        return self._owners.get(response_id) if response_id else None


def _json_object(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}  # the replica answers it with the 4xx a server gives
    return value if isinstance(value, dict) else {}


ingress_app = FastAPI(title="localllm", docs_url=None, redoc_url=None, openapi_url=None)
ingress_app.add_middleware(AnthropicErrorShape)  # the ingress's own errors on /v1/messages*, as a server's


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
@serve.ingress(ingress_app)
class Ingress:
    """Every request of the endpoint, handed to an engine replica (see the module's docstring)."""

    def __init__(self, engines: DeploymentHandle, board: DeploymentHandle, max_request_bytes: int) -> None:
        self.engines = engines.options(stream=True)
        self.board = board
        self.owners = _ResponseOwners()
        self.body_check = BodyCheck(None, max_request_bytes=max_request_bytes)  # its checks, before reading

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await self.board.texts.remote()
        return Response(merge_replica_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS"])
    async def forward(self, path: str, request: Request) -> Response:
        body = b""
        if request.method in ("POST", "PUT", "PATCH"):  # read no more than a replica would take
            error = self.body_check.check_headers(dict(request.scope["headers"]))
            if error is not None:
                return error_response(error)
            chunks = bytearray()
            async for chunk in request.stream():
                chunks += chunk
                if len(chunks) > self.body_check.max_request_bytes:
                    return error_response(self.body_check.too_large(None))
            body = bytes(chunks)
        forwarded = ForwardedRequest(
            request.method, request.url.path, request.scope.get("query_string", b""),
            list(request.scope.get("headers", [])), body, request.scope.get("client"), request.scope.get("server"),
        )
        payload = _json_object(body) if request.method == "POST" else {}
        affinity = AffinityKey.of_text(prompt_text(request.url.path, payload))
        pinned = self._pinned_replica(request.url.path, request.method, payload)
        last_error: BaseException | None = None
        for _ in range(SEND_ATTEMPTS):
            stream = self.engines.handle.remote(forwarded, affinity=affinity, pinned_replica=pinned)
            try:
                start = await stream.__anext__()
                break
            except RayActorError as exc:  # the replica died before it answered: another one takes it
                stream.cancel()
                last_error = exc
        else:
            return JSONResponse({"error": {"message": f"no replica could take the request ({last_error})",
                                           "type": "service_unavailable", "param": None, "code": 503}},
                                status_code=503)
        remember = request.method == "POST" and request.url.path.rstrip("/") == "/v1/responses"
        response = StreamingResponse(self._relay(stream, start.replica if remember else None),
                                     status_code=start.status)
        response.raw_headers = [(k, v) for k, v in start.headers]
        return response

    def _pinned_replica(self, path: str, method: str, payload: dict) -> str | None:
        path = path.rstrip("/")
        if path.startswith("/v1/responses/") and method in ("GET", "DELETE"):
            return self.owners.get(path.removeprefix("/v1/responses/").split("/")[0])
        if path == "/v1/responses":
            previous = payload.get("previous_response_id")
            return self.owners.get(previous if isinstance(previous, str) else None)
        return None

    async def _relay(self, stream, responses_replica: str | None) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                if responses_replica is not None:
                    found = response_id_in(chunk)
                    if found is not None:
                        self.owners.add(found, responses_replica)
                        responses_replica = None
                yield chunk
        finally:
            stream.cancel()  # a no-op once the stream has ended; else the client left: abort on the replica


def build_application(settings, device: str, plan: ReplicaPlan):
    """The Ray Serve application for ``settings`` laid out as ``plan``."""
    board = MetricsBoardDeployment.bind()
    options: dict = {
        "max_ongoing_requests": plan.max_ongoing_requests,
        # a GPU each on GPU machines (Ray sets each replica's CUDA_VISIBLE_DEVICES to its own)
        "ray_actor_options": {"num_cpus": plan.threads, **({"num_gpus": 1} if device.startswith("cuda") else {})},
        "graceful_shutdown_timeout_s": 30.0,
    }
    if plan.autoscaling:
        options["autoscaling_config"] = plan.autoscaling_config()
    else:
        options["num_replicas"] = plan.replicas
    if plan.routing == "prefix":
        options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter)
    engines = serve.deployment(EngineReplica).options(**options).bind(
        replace(settings, threads=plan.threads), "cuda" if device.startswith("cuda") else device, board)
    return Ingress.bind(engines, board, parse_bytes(settings.max_request_bytes))
