"""Prompt lookup: the tokens that followed the last earlier occurrence of the sequence's suffix."""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_MIN_N = 2  # a one-token match guesses too often in free text
DEFAULT_MAX_N = 4


class NgramIndex:
    """A token sequence, indexed as it grows, that answers "what followed the longest suffix
    (``min_n`` to ``max_n`` tokens) the last time it occurred earlier?".

    For each ``n`` it keeps where every n-gram last ended, so appending a token costs
    ``max_n - min_n + 1`` dictionary updates and a proposal costs as many lookups, whatever the
    length (a 4k-token prompt is indexed once, in a few milliseconds)."""

    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        # for the current suffix of each length: where its previous occurrence ended (or -1)
        self._previous_end = [-1] * (max_n + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(self.tokens[end - n:end])
                table = self._last_end[n]
                self._previous_end[n] = table.get(gram, -1)
                table[gram] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix's previous occurrence (none when no
        suffix of ``min_n`` tokens or more occurred before)."""
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(self.tokens)), self.min_n - 1, -1):
            start = self._previous_end[n]
            if start >= 0:
                return self.tokens[start:start + k]
        return []
