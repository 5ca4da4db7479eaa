"""How a replicated server is laid out, from the settings: :class:`ReplicaPlan` (no Ray).

- **Replicas:** ``replicas`` to start with; autoscaling between ``min_replicas`` and ``max_replicas``
  when they differ (both default to ``replicas``).
- **Threads:** a replica's torch threads (``threads``, else this machine's cores over the most
  replicas), and the CPUs Ray reserves for it, so that replicas on one machine never share a core.
- **Queue:** a replica takes as many requests as one server would (``max_num_seqs`` running plus
  ``max_waiting`` queued), so priorities order them in its scheduler rather than in Ray's FIFO; Ray
  adds a replica when the average replica holds more than a full batch (``max_num_seqs``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from localllm.errors import InvalidRequestError

ROUTINGS = ("prefix", "queue")


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    replicas: int
    min_replicas: int
    max_replicas: int
    threads: int  # per replica
    max_ongoing_requests: int  # per replica: Ray's router sends no more
    target_ongoing_requests: int  # autoscaling's target per replica
    routing: str

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas != self.max_replicas

    def autoscaling_config(self) -> dict | None:
        if not self.autoscaling:
            return None
        return {
            "min_replicas": self.min_replicas,
            "initial_replicas": self.replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
        }

    @classmethod
    def from_settings(cls, settings, cores: int | None = None) -> ReplicaPlan:
        # --min-replicas or --max-replicas alone: start with that many
        replicas = next((n for n in (settings.replicas, settings.min_replicas, settings.max_replicas)
                         if n is not None), None)
        if replicas is None or replicas < 1:
            raise InvalidRequestError(f"replicas must be at least 1, got {replicas}")
        low = settings.min_replicas if settings.min_replicas is not None else min(replicas, settings.max_replicas or replicas)
        high = settings.max_replicas if settings.max_replicas is not None else max(replicas, low)
        if low < 1:
            raise InvalidRequestError(f"min_replicas must be at least 1, got {low}")
        if not low <= replicas <= high:
            raise InvalidRequestError(
                f"replicas ({replicas}) must lie between min_replicas ({low}) and max_replicas ({high})")
        if settings.routing not in ROUTINGS:
            raise InvalidRequestError(f"routing must be one of {', '.join(ROUTINGS)}, got {settings.routing!r}")
        cores = cores or os.cpu_count() or 1
        threads = settings.threads or max(1, cores // high)
        if threads < 1:
            raise InvalidRequestError(f"threads must be at least 1, got {threads}")
        waiting = settings.max_waiting if settings.max_waiting is not None else 0
        return cls(
            replicas=replicas,
            min_replicas=low,
            max_replicas=high,
            threads=threads,
            max_ongoing_requests=settings.max_num_seqs + waiting,
            target_ongoing_requests=settings.max_num_seqs,
            routing=settings.routing,
        )
