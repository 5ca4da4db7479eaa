"""Drafts from earlier answers: what followed the same few tokens in a recent request's output.

SuffixDecoding's observation: agents and editors ask for the same kinds of answers again and again
(the same tool-call scaffolding, the same file rewritten), so an answer's next tokens are often in
an earlier answer even when they are not in this request's prompt. The cache keeps the outputs of
recently finished requests, up to ``max_tokens`` tokens in all (the oldest dropped first), indexed
as :class:`~localllm.speculation.ngram.NgramIndex` indexes one sequence.
"""

from __future__ import annotations

import itertools
from array import array
from collections import OrderedDict

from localllm.speculation.ngram import DEFAULT_MAX_N, DEFAULT_MIN_N

DEFAULT_CACHE_TOKENS = 1 << 16  # about 20 MiB of index at most


class SuffixCache:
    """Recent outputs, and for each n-gram (``min_n`` to ``max_n`` tokens) where it last ended."""

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS, min_n: int = DEFAULT_MIN_N,
                 max_n: int = DEFAULT_MAX_N) -> None:
        if max_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"bad suffix cache bounds: {max_tokens} tokens, n in [{min_n}, {max_n}]")
        self.max_tokens = max_tokens
        self.min_n, self.max_n = min_n, max_n
        self._sequences: OrderedDict[int, array] = OrderedDict()  # oldest first
        self._ids = itertools.count()
        self._last_end: list[dict[tuple[int, ...], tuple[int, int]]] = [{} for _ in range(max_n + 1)]
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._sequences)

    def add(self, tokens: list[int]) -> None:
        """Remember one finished output (one too long for the cache keeps its last ``max_tokens``)."""
        tokens = tokens[-self.max_tokens:]
        if len(tokens) <= self.min_n:
            return
        seq_id = next(self._ids)
        self._sequences[seq_id] = array("l", tokens)
        self.num_tokens += len(tokens)
        for end in range(self.min_n, len(tokens)):  # an n-gram that ends the output has nothing after it
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._last_end[n][tuple(tokens[end - n:end])] = (seq_id, end)
        while self.num_tokens > self.max_tokens:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Forget the oldest output and the index entries that still point into it (so that the
        index stays bounded by the tokens kept)."""
        old_id, old = self._sequences.popitem(last=False)
        self.num_tokens -= len(old)
        tokens = old.tolist()
        for end in range(self.min_n, len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                table = self._last_end[n]
                key = tuple(tokens[end - n:end])
                if table.get(key, (None,))[0] == old_id:
                    del table[key]

    def num_entries(self) -> int:
        return sum(len(t) for t in self._last_end)

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed ``context``'s longest suffix in a remembered output
        (the latest one that still holds it)."""
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            table = self._last_end[n]
            key = tuple(context[len(context) - n:])
            hit = table.get(key)
            if hit is None:
                continue
            return self._sequences[hit[0]][hit[1]:hit[1] + k].tolist()
        return []
