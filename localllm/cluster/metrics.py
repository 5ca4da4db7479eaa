"""``/metrics`` of a replicated server: every replica's metrics in one exposition, a ``replica`` label on each.

Each engine replica posts its own ``/metrics`` text to one :class:`MetricsBoard` (a small Ray actor)
every :data:`PUSH_INTERVAL_S` seconds; the ingress's ``/metrics`` reads the board and merges the texts
with :func:`merge_replica_metrics`. A replica that stopped posting (it died; Ray starts another under
a new id) drops out after :data:`STALE_AFTER_S`. Nothing here imports Ray: the board is a plain class
that :mod:`localllm.cluster.deployment` runs as an actor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

PUSH_INTERVAL_S = 1.0
STALE_AFTER_S = 10.0


class MetricsBoard:
    """The latest metrics text of each live replica."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._texts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def texts(self) -> dict[str, str]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._texts.items() if now - t > self.stale_after_s]:
            del self._texts[replica]
        return {replica: text for replica, (_, text) in sorted(self._texts.items())}


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_replica_metrics(texts: dict[str, str]) -> bytes:
    """One Prometheus text exposition of every replica's (``replica`` -> its ``/metrics`` text), each
    sample labelled ``replica``; families of one name merge (their type and help from the first)."""
    merged: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                into = merged[family.name] = Metric(family.name, family.documentation, family.type)
            for s in family.samples:
                into.samples.append(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp,
                                           s.exemplar))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
