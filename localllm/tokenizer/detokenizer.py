""":class:`IncrementalDetokenizer`: output token ids into text deltas that are always valid UTF-8."""

from __future__ import annotations

import codecs

from localllm.tokenizer.core import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas that are always valid UTF-8.

    With a GGUF vocabulary the text is each token's bytes in turn, as llama-server streams it,
    through an incremental UTF-8 decoder that holds back a character split across tokens. A
    Hugging Face directory's tokenizer decodes a short window instead (a few tokens of context
    plus the new ones) each step, and holds back text that ends in U+FFFD.
    """

    __slots__ = (
        "_pieces",
        "_utf8",
        "ids",
        "prefix_offset",
        "read_offset",
        "skip_special_tokens",
        "text",
        "tokenizer",
    )

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pieces = tokenizer.byte_pieces(skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._pieces is not None else None
        context = list(prompt_ids[-4:])
        self.ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""

    def step(self, new_ids: list[int]) -> str:
        """Append token ids; return the newly complete text (may be empty)."""
        self.ids.extend(new_ids)
        if self._pieces is not None:
            pieces = self._pieces
            delta = self._utf8.decode(b"".join(pieces[i] for i in new_ids))
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
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
        if self._utf8 is not None:
            delta = self._utf8.decode(b"", final=True)
            self.text += delta
            return delta
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        self.read_offset = len(self.ids)
        delta = full[len(prefix) :]
        self.text += delta
        return delta
