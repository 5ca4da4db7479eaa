"""The engine deployment's request router: Ray Serve's request-router API with prompt-prefix affinity.

Ray Serve runs one router per deployment handle (in the ingress replica); it calls
:meth:`PrefixAffinityRouter.choose_replicas` for each request with the request's arguments, and
tries the ranks it returns in order, each replica in a rank by its queue length, a replica whose
queue is full (``max_ongoing_requests``) skipped. Ranks:

1. a pinned replica (the one that stored a Responses API answer a request continues), alone;
2. else the replica that was routed the longest prefix of the request's prompt
   (:class:`~localllm.cluster.affinity.PrefixIndex`), unless its queue is longer than the shortest
   one's by more than ``imbalance`` requests (then affinity would cost more than the prefill it saves);
3. every replica: the shortest queue; of equal ones, the replica that holds the fewest prefixes
   (so that new conversations spread over the replicas).

The chosen replica is recorded against the prompt's key once Ray hands the request to it.
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from localllm.cluster.affinity import DEFAULT_MAX_ENTRIES, AffinityKey, PrefixIndex

DEFAULT_IMBALANCE = 4
"""Requests by which the prefix's replica's queue may exceed the shortest before affinity gives way."""


def _key(pending_request: PendingRequest | None) -> AffinityKey:
    key = pending_request.kwargs.get("affinity") if pending_request is not None else None
    return key if isinstance(key, AffinityKey) else AffinityKey()


def _pinned(pending_request: PendingRequest | None) -> str | None:
    return pending_request.kwargs.get("pinned_replica") if pending_request is not None else None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Prompt-prefix affinity over the shortest queue (see the module's docstring)."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, max_entries: int = DEFAULT_MAX_ENTRIES,
                         **kwargs) -> None:
        self.imbalance = imbalance
        self.index = PrefixIndex(max_entries)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # Every rank is offered at once: when none takes the request, back off before the next try.
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranks: list[list[RunningReplica]] = []
        pinned = _pinned(pending_request)
        if pinned in by_id:
            ranks.append([by_id[pinned]])
        owner, _ = self.index.best(_key(pending_request), by_id)
        if owner is not None and owner != pinned and self._balanced_enough(by_id[owner], candidate_replicas):
            ranks.append([by_id[owner]])
        # Ray takes the shortest queue of a rank, the first of equal ones: the one that holds least first.
        ranks.append(sorted(candidate_replicas, key=lambda r: self.index.held_by(r.replica_id.unique_id)))
        return ranks

    def _balanced_enough(self, preferred: RunningReplica, candidates: list[RunningReplica]) -> bool:
        """Whether ``preferred``'s queue (as last reported) is within ``imbalance`` of the shortest."""
        cache = self.replica_queue_len_cache
        mine = cache.get(preferred.replica_id)
        lengths = [q for q in (cache.get(r.replica_id) for r in candidates) if q is not None]
        if mine is None or not lengths:
            return True  # unknown: the replica itself refuses a request beyond its max_ongoing_requests
        return mine - min(lengths) <= self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = _key(pending_request)
        if key.hashes:
            self.index.record(key, replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)
