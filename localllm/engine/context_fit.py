"""What a chat does when its conversation outgrows the context window: the overflow policies, as LM
Studio names them.

* ``error``: the request is refused (``context_length_exceeded``), the OpenAI and Anthropic APIs'
  default: an API never cuts a conversation it was not asked to cut;
* ``truncate-middle``: the system messages, the first turn and as many of the latest turns as fit
  are kept; the turns between go (the terminal chat's, ``run``'s and the Ollama API's default);
* ``rolling-window``: the system messages and as many of the latest turns as fit are kept.

A turn starts at a user message and holds what answers it (assistant messages, tool results), so a
kept conversation still alternates as chat templates expect; the last turn (the new question) is
always kept. What is kept must leave ``reserve`` tokens for the reply; where even the system
messages and the last turn do not, the request is refused as under ``error``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localllm.errors import InvalidRequestError

OVERFLOW_POLICIES = ("error", "truncate-middle", "rolling-window")
CHAT_OVERFLOW = "truncate-middle"
"""The terminal chat's and ``run``'s policy (each says in the chat what it left out)."""


@dataclass(frozen=True, slots=True)
class FittedChat:
    """A conversation as it goes to the model: its messages, their prompt, and how many of the
    given messages were left out (0: all of them went)."""

    messages: list[dict]
    prompt_ids: list[int]
    dropped: int = 0

    def notice(self, limit: int) -> str | None:
        """One line saying what was left out, for the UI; ``None`` where nothing was."""
        if not self.dropped:
            return None
        s = "" if self.dropped == 1 else "s"
        return f"{self.dropped} earlier message{s} left out to fit the context of {limit} tokens"


def check_policy(policy: str) -> str:
    """``policy`` where it is one of :data:`OVERFLOW_POLICIES`, else a 400 naming them."""
    if policy not in OVERFLOW_POLICIES:
        raise InvalidRequestError(f"context_overflow must be one of {', '.join(OVERFLOW_POLICIES)}, not {policy!r}",
                                  param="context_overflow")
    return policy


def _turns(messages: Sequence[dict]) -> list[list[dict]]:
    """The non-system messages in turns, each starting at a user message (what precedes the first
    user message is a turn of its own)."""
    turns: list[list[dict]] = []
    for m in messages:
        if m.get("role") == "system":
            continue
        if not turns or m.get("role") == "user":
            turns.append([])
        turns[-1].append(m)
    return turns


def _too_long(n: int, limit: int, reserve: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"This model's maximum context length is {limit} tokens, but the conversation needs {n} tokens "
        f"and {reserve} for the reply. Shorten it or start a new one.",
        param="messages", code="context_length_exceeded")


def fit_chat(messages: list[dict], render: Callable[[list[dict]], list[int]], limit: int, reserve: int = 1,
             policy: str = "error") -> FittedChat:
    """``messages`` as ``policy`` fits them into ``limit`` tokens with ``reserve`` left for the reply
    (``render``: the chat template's prompt ids of some messages). System messages keep their places
    among the kept ones."""
    check_policy(policy)
    reserve = max(1, min(reserve, limit - 1))
    ids = render(messages)
    if len(ids) + reserve <= limit:
        return FittedChat(messages, ids)
    turns = _turns(messages)
    if policy == "error" or len(turns) < 2:
        raise _too_long(len(ids), limit, reserve)
    system_ids = [id(m) for m in messages if m.get("role") == "system"]

    def keep(chosen: list[list[dict]]) -> list[dict]:
        kept = {id(m) for turn in chosen for m in turn} | set(system_ids)
        return [m for m in messages if id(m) in kept]

    head = turns[:1] if policy == "truncate-middle" else []
    rest = turns[len(head):]
    for first in (head, []) if head else ([],):
        # the fewest latest turns dropped: a binary search over where the kept tail starts (a shorter
        # tail never renders longer)
        lo, hi, best = 0, len(rest) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            kept = keep(first + rest[mid:])
            kept_ids = render(kept)
            if len(kept_ids) + reserve <= limit:
                best, hi = (kept, kept_ids), mid - 1
            else:
                lo = mid + 1
        if best is not None:
            return FittedChat(best[0], best[1], len(messages) - len(best[0]))
    raise _too_long(len(render(keep(turns[-1:]))), limit, reserve)
