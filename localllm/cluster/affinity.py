"""Prompt-prefix affinity, without Ray: what a request's prompt starts with, and which replica saw it.

A replica's prefix cache holds the KV blocks of the prompts it served; a conversation's next turn
repeats its previous turn's prompt and adds to it, so it runs fastest where that prompt ran. The
ingress turns a request body into its prompt's text (:func:`prompt_text`: the messages, system
prompt, tools or prompt each API sends, in the order a chat template renders them) and that text
into an :class:`AffinityKey` (chained hashes of its successive blocks of characters, so that two
prompts share the first N hashes exactly when they share the first N blocks). :class:`PrefixIndex`
remembers which replica each hash was last routed to and answers which candidate holds the longest
prefix of a new key.

Characters stand in for tokens here: the ingress does not tokenize (the replicas do), and a shared
prefix of characters is a shared prefix of tokens up to the last block boundary.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

BLOCK_BYTES = 256
"""UTF-8 bytes per hashed block (characters, for English): about 64 tokens, four KV blocks of 16."""
MAX_BLOCKS = 256
"""Blocks hashed per prompt (64 KiB): longer prompts share no more than this for routing."""
DEFAULT_MAX_ENTRIES = 200_000
"""Hashes the index keeps (least recently routed out first): about 50 MB of prompts' prefixes."""

_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[0-9a-f]{32})"')


@dataclass(frozen=True, slots=True)
class AffinityKey:
    """Chained hashes of a prompt's blocks (``hashes[i]`` covers blocks 0..i); empty: nothing to route by."""

    hashes: tuple[bytes, ...] = ()

    @classmethod
    def of_text(cls, text: str) -> AffinityKey:
        hashes = []
        previous = b""
        data = text.encode("utf-8", "surrogatepass")
        block = BLOCK_BYTES
        for start in range(0, min(len(data), block * MAX_BLOCKS), block):
            previous = hashlib.blake2b(previous + data[start:start + block], digest_size=12).digest()
            hashes.append(previous)
        return cls(tuple(hashes))


def _text_of(content: Any) -> str:
    """The text of a message's content: a string, or parts with ``text`` (OpenAI's and Anthropic's)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_of(part) for part in content)
    if isinstance(content, dict):
        if isinstance(content.get("text"), str):
            return content["text"]
        if "content" in content:
            return _text_of(content["content"])
        if "input" in content or "arguments" in content:  # tool calls: their arguments are in the prompt
            return json.dumps(content.get("input", content.get("arguments")), sort_keys=True)
    return ""


def _messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return _text_of(messages)
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"<{m.get('role', m.get('type', ''))}>{_text_of(m.get('content'))}")
            for call in m.get("tool_calls") or ():
                parts.append(_text_of(call.get("function") if isinstance(call, dict) else None))
        else:
            parts.append(_text_of(m))
    return "".join(parts)


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The start of the prompt a request to ``path`` (``/v1/chat/completions``, ...) renders to, as
    text: what two requests must share for one to reuse the other's cached prefix. Empty for a route
    without a prompt."""
    path = "/" + path.strip("/")
    tools = json.dumps(body["tools"], sort_keys=True) if body.get("tools") else ""
    if path in ("/v1/chat/completions",):
        return tools + _messages_text(body.get("messages"))
    if path in ("/v1/messages", "/v1/messages/count_tokens"):
        return _text_of(body.get("system")) + tools + _messages_text(body.get("messages"))
    if path == "/v1/responses":
        return _text_of(body.get("instructions")) + tools + _messages_text(body.get("input"))
    if path in ("/v1/completions", "/infill"):
        prompt = body.get("prompt", body.get("input_prefix", ""))
        if isinstance(prompt, list):  # a batch of prompts or token ids: route by the first
            prompt = prompt[0] if prompt and isinstance(prompt[0], (str, list)) else prompt
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    return ""


def response_id_in(chunk: bytes) -> str | None:
    """The id of a stored Responses API answer in the first bytes of its body (JSON or events), if any."""
    match = _RESPONSE_ID.search(chunk)
    return match.group(1).decode() if match else None


class PrefixIndex:
    """Which replica each prefix hash was last routed to, least recently used out first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._held: Counter[str] = Counter()  # replica -> hashes it owns

    def __len__(self) -> int:
        return len(self._owner)

    def held_by(self, replica: str) -> int:
        """How many prefix blocks ``replica`` was last routed: new prompts go to the one with fewest."""
        return self._held[replica]

    def best(self, key: AffinityKey, candidates: Iterable[str]) -> tuple[str | None, int]:
        """The candidate that was routed the longest prefix of ``key``, and that prefix's length in
        blocks ((None, 0) when none was)."""
        allowed = set(candidates)
        for depth in range(len(key.hashes), 0, -1):
            owner = self._owner.get(key.hashes[depth - 1])
            if owner is not None and owner in allowed:
                return owner, depth
        return None, 0

    def record(self, key: AffinityKey, replica: str) -> None:
        """``key``'s prompt was routed to ``replica``: every prefix of it is there now."""
        for h in key.hashes:
            previous = self._owner.get(h)
            if previous is not None:
                self._held[previous] -= 1
            self._owner[h] = replica
            self._owner.move_to_end(h)
            self._held[replica] += 1
        while len(self._owner) > self.max_entries:
            _, owner = self._owner.popitem(last=False)
            self._held[owner] -= 1

    def forget(self, replica: str) -> None:
        """``replica`` is gone (and its cache with it)."""
        for h in [h for h, owner in self._owner.items() if owner == replica]:
            del self._owner[h]
        self._held.pop(replica, None)
