"""``localllm serve MODEL --replicas N``: start (or join) Ray, run the application, stop it on a signal.

Without ``ray_address`` a local Ray starts with the server and stops with it; with one, the replicas
join that cluster (``ray start --head`` on one machine, ``ray start --address`` on the others) and the
application is deleted from it when the server stops. The HTTP endpoint is Ray Serve's proxy, on
``host:port``.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

import ray
from ray import serve

from localllm.cluster.deployment import APP_NAME, build_application
from localllm.cluster.plan import ReplicaPlan
from localllm.errors import InvalidRequestError

LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2  # requests and chunks are small; Ray's default takes 30% of RAM


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ready_line(settings, plan: ReplicaPlan, port: int) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    scaling = (f"autoscaled {plan.min_replicas}-{plan.max_replicas}" if plan.autoscaling else "")
    return (f"localllm serving {settings.served_model_name or settings.model} on {plan.replicas} replica{'' if plan.replicas == 1 else 's'} "
            f"({scaling + ', ' if scaling else ''}{plan.threads} threads each, routing: {plan.routing}) "
            f"at http://{host}:{port} (Ray Serve)")


def run_cluster(settings, device: str = "cpu", verbose: bool = False) -> int:
    """Serve ``settings`` on replicas until SIGINT/SIGTERM; the exit status."""
    if settings.sources.get("model", "default") == "default":
        raise InvalidRequestError("--replicas serves one model: name it (localllm serve MODEL --replicas N)")
    plan = ReplicaPlan.from_settings(settings)
    port = settings.port or _free_port(settings.host)
    env = {k: v for k, v in os.environ.items() if k.startswith("LOCALLLM_")}
    init: dict = {"runtime_env": {"env_vars": env}, "log_to_driver": verbose, "include_dashboard": False}
    if settings.ray_address:
        init["address"] = settings.ray_address
    else:
        init["address"] = "local"  # a Ray of its own, even where `ray start` runs one (ours to shut down)
        init["object_store_memory"] = LOCAL_OBJECT_STORE_BYTES
    ray.init(**init)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": settings.host, "port": port})
        serve.run(build_application(settings, device, plan), name=APP_NAME, route_prefix="/")
        print(ready_line(settings, plan, port), flush=True)
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if settings.ray_address:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
        ray.shutdown()
    return 0
