""":class:`IncrementalDetokenizer`: output token ids into text deltas that are always valid UTF-8."""

from __future__ import annotations

from localllm.tokenizer.core import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas that are always valid UTF-8.

    Decodes a short window (a few tokens of context plus the new ones) each step, and holds
    back text that ends in U+FFFD, i.e. a multi-byte character split across tokens.
    """

    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "skip_special_tokens", "text")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-4:])
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""

    def step(self, new_ids: list[int]) -> str:
        """Append token ids; return the newly complete text (may be empty)."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of a request), replacement characters included."""
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        self.read_offset = len(self.ids)
        delta = full[len(prefix) :]
        self.text += delta
        return delta
