"""The Responses API's memory: finished responses by id (``previous_response_id``,
``GET/DELETE /v1/responses/{id}``), bounded, least recently used out first."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from localllm.errors import ResponseNotFoundError

DEFAULT_STORE_ENTRIES = 1024
"""Responses a :class:`ResponseStore` keeps by default (the least recently used go first)."""
DEFAULT_STORE_BYTES = 64 << 20
"""And their size in all (their JSON), by default."""


class ResponseStore:
    """Finished responses by id, with the conversation each ends (the chat messages of its input
    history and of its output, ``instructions`` left out), for ``previous_response_id`` and
    ``GET /v1/responses/{id}``. In memory, least recently used first out beyond ``max_entries``
    responses or ``max_bytes`` of their JSON; thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_STORE_ENTRIES, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[str, list[dict], int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list[dict]) -> None:
        body = json.dumps(response)
        size = len(body) + len(json.dumps(conversation))
        with self._lock:
            old = self._entries.pop(response["id"], None)
            if old is not None:
                self.nbytes -= old[2]
            if size > self.max_bytes:
                return  # larger than the whole store: not kept (a later reference is a 404)
            self._entries[response["id"]] = (body, conversation, size)
            self.nbytes += size
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self.nbytes -= dropped

    def _get(self, response_id: str, param: str | None = None) -> tuple[str, list[dict], int]:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                raise ResponseNotFoundError(
                    f"No response found with id '{response_id}' (never stored, stored with store=false, "
                    "or dropped from this server's memory)", param=param)
            self._entries.move_to_end(response_id)
            return entry

    def response(self, response_id: str) -> dict:
        return json.loads(self._get(response_id)[0])

    def conversation(self, response_id: str) -> list[dict]:
        """The chat messages that ``previous_response_id = response_id`` continues."""
        return [dict(m) for m in self._get(response_id, "previous_response_id")[1]]

    def delete(self, response_id: str) -> None:
        self._get(response_id)
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self.nbytes -= entry[2]
