"""Replicas of ``localllm serve`` on Ray Serve, behind one endpoint (``serve MODEL --replicas N``).

- :mod:`localllm.cluster.plan`: how many replicas, how many threads each, when to scale (no Ray);
- :mod:`localllm.cluster.affinity`: a request's prompt prefix and which replica saw it (no Ray);
- :mod:`localllm.cluster.metrics`: every replica's ``/metrics`` in one, labelled ``replica`` (no Ray);
- :mod:`localllm.cluster.router`: the engine deployment's Ray Serve request router;
- :mod:`localllm.cluster.deployment`: the deployments (ingress, engine replicas, metrics board);
- :mod:`localllm.cluster.launch`: start Ray, run the application, stop it on a signal.

Ray (``pip install 'localllm[cluster]'``) is imported only by the last three.
"""

from __future__ import annotations

import importlib.util

from localllm.errors import InvalidRequestError

CLUSTER_EXTRA = "localllm[cluster]"


def require_ray() -> None:
    """Raise a readable error unless Ray Serve is installed."""
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise InvalidRequestError(f"--replicas runs on Ray Serve, which is not installed: pip install "
                                  f"'{CLUSTER_EXTRA}'")
