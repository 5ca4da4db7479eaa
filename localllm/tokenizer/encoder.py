""":class:`Encoder`: text to token ids for a GGUF vocabulary, as llama.cpp's ``llama_tokenize``.

The text is cut at special tokens first (:meth:`Encoder.partition`); each plain fragment is
prepared as the vocabulary's type asks (the SPM space prefix, ``▁`` for spaces, UGM's character
map and spaces, WordPiece's words) and encoded by the tiktoken encoding or the Rust tokenizer
:mod:`~localllm.tokenizer.vocab` builds. Long fragments are encoded in parallel chunks, cut where
every pre-tokenizer ends a word whatever surrounds the cut (:data:`_CUT`).
"""

from __future__ import annotations

import os
import re
import unicodedata
from collections.abc import Iterator

import numpy as np

from localllm.tokenizer.pipeline import backend, tiktoken_encoding
from localllm.tokenizer.vocab import Attr, Vocab

# C's isspace, which llama.cpp's strip flags use
_C_SPACE = " \t\n\v\f\r"
# Fragments longer than this are cut into chunks encoded in parallel, where cuts are safe.
PARALLEL_CHUNK_CHARS = 1 << 16
# Texts longer than this are encoded with the GIL released (the Rust tokenizer's encode holds it
# throughout, and the engine's step thread and the server's event loop would starve).
_GIL_FREE_CHARS = 1 << 14
# Where a text may be cut into chunks: after a newline that follows a visible ASCII character and
# before an ASCII letter. Every byte-level pre-tokenizer in the table ends a word there whatever
# comes before or after: none joins a newline to a letter, and the newline is a word of its own
# or ends the punctuation before it either way (a newline after whitespace would not be: "\s+(?!\S)"
# leaves the last of a run of spaces for the next word, which a cut would change).
_CUT = re.compile(r"(?<=[!-~]\n)(?=[A-Za-z])")


def _trie_regex(texts: list[str]) -> str:
    """A regex matching any of ``texts``, the longest one at a position: the texts as a trie, so
    that a match costs its length, not the number of texts."""
    trie: dict = {}
    for t in texts:
        node = trie
        for ch in t:
            node = node.setdefault(ch, {})
        node[""] = True

    def emit(node: dict) -> str:
        end = "" in node
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch != ""]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if end else body

    return emit(trie)


class _Specials:
    """The special tokens cut out of a text, for one ``parse_special`` setting."""

    def __init__(self, vocab: Vocab, parse_special: bool) -> None:
        entries = vocab.special_texts(parse_special)
        self.ids = {text: i for text, i, _ in reversed(entries)}  # a repeated text: its first id
        self.attrs = {text: attr for text, _, attr in entries}
        self.pattern = re.compile(_trie_regex(list(self.ids))) if self.ids else None
        self.has_strip = any(a & (Attr.LSTRIP | Attr.RSTRIP) for a in self.attrs.values())
        self.has_newline_letter = any(re.search(r"\n[A-Za-z]", t) for t in self.ids)


class Encoder:
    """Encodes text with a :class:`Vocab`'s tiktoken encoding where it has an exact one, its Rust
    ``tokenizers`` pipeline otherwise, as llama.cpp does."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._tiktoken = tiktoken_encoding(vocab)
        self.backend = backend(vocab) if self._tiktoken is None else None
        self._specials = {True: _Specials(vocab, True), False: _Specials(vocab, False)}
        self._charsmap = CharsMap(vocab.precompiled_charsmap) if vocab.precompiled_charsmap else None
        self._wordpiece = WordPieceTable(vocab.normalizer_lowercase, vocab.normalizer_strip_accents)
        self._newline_ids = ({t: i for i, t in enumerate(vocab.tokens) if t and not t.strip("\n")}
                             if vocab.pre.newline_words_whole else {})
        # Parallel chunks: byte-level BPE only (an SPM text is one word, WordPiece and Unigram texts
        # are short), and only where no special token could span a cut.
        self._chunkable = vocab.kind == "bpe" and vocab.pre.byte_encode and not any(
            s.has_strip or s.has_newline_letter for s in self._specials.values())

    # -- special tokens ------------------------------------------------------------------------------

    def partition(self, text: str, parse_special: bool) -> Iterator[str | int]:
        """``text`` as plain fragments (str) and special token ids (int), in order."""
        sp = self._specials[parse_special]
        if sp.pattern is None:
            if text:
                yield text
            return
        start = 0
        after_rstrip = False  # the token before strips the whitespace after it
        for m in sp.pattern.finditer(text):
            token = m.group()
            if not token:
                continue
            attr = sp.attrs[token]
            left = text[start:m.start()]
            if attr & Attr.LSTRIP:
                left = left.rstrip(_C_SPACE)
            if after_rstrip:
                left = left.lstrip(_C_SPACE)
            if left:
                yield left
            yield sp.ids[token]
            start = m.end()
            after_rstrip = bool(attr & Attr.RSTRIP)
        rest = text[start:]
        if after_rstrip:
            rest = rest.lstrip(_C_SPACE)
        if rest:
            yield rest

    # -- encoding ------------------------------------------------------------------------------------

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` without BOS/EOS (llama.cpp's ``add_special=false``)."""
        vocab = self.vocab
        out: list[int] = []
        fragments: list[str] = []
        layout: list[int | None] = []  # None: the next prepared fragment's ids go here
        prev_special = True
        for part in self.partition(text, parse_special):
            if isinstance(part, int):
                layout.append(part)
                prev_special = True
                continue
            if vocab.kind == "spm":
                part = ((" " if vocab.add_space_prefix and prev_special else "") + part).replace(" ", "\u2581")
            elif vocab.kind == "bpe" and vocab.escape_whitespaces:
                part = part.replace(" ", "\u2581")
            elif vocab.kind == "ugm":
                part = self._ugm_normalize(part)
            elif vocab.kind == "wpm":
                part = part.translate(self._wordpiece)
            prev_special = False
            for piece in self._pieces(part):
                if isinstance(piece, int):
                    layout.append(piece)
                else:
                    fragments.append(piece)
                    layout.append(None)
        encoded = iter(self._encode_fragments(fragments))
        for item in layout:
            if item is None:
                out.extend(next(encoded))
            else:
                out.append(item)
        return out

    def _pieces(self, fragment: str) -> Iterator[str | int]:
        """A prepared fragment as the pieces the Rust tokenizer encodes, with ids found directly."""
        if not fragment:
            return
        if self.vocab.pre.newline_words_whole:
            # Gemma 4: a run of newlines is its own word, one token when the vocabulary has it.
            for piece in re.split(r"(\n+)", fragment):
                if not piece:
                    continue
                i = self._newline_ids.get(piece)
                yield piece if i is None else i
            return
        if self._chunkable and len(fragment) > PARALLEL_CHUNK_CHARS:
            yield from _chunks(fragment)
            return
        yield fragment

    def _encode_fragments(self, fragments: list[str]) -> list[list[int]]:
        if not fragments:
            return []
        if self._tiktoken is not None:  # releases the GIL; several fragments go to a thread pool
            if len(fragments) == 1:
                return [self._tiktoken.encode_ordinary(fragments[0])]
            return self._tiktoken.encode_ordinary_batch(fragments, num_threads=os.cpu_count() or 1)
        if len(fragments) == 1 and len(fragments[0]) < _GIL_FREE_CHARS:
            return [self.backend.encode(fragments[0], add_special_tokens=False).ids]
        # encode_batch releases the GIL and spreads the fragments over the Rust thread pool
        return [e.ids for e in self.backend.encode_batch_fast(fragments, add_special_tokens=False)]

    def _ugm_normalize(self, text: str) -> str:
        """llama.cpp's UGM normalization: the character map, then spaces as ``▁``, one prepended
        (or appended) where the vocabulary adds a space prefix, runs merged where it removes extra
        whitespace."""
        vocab = self.vocab
        if self._charsmap is not None:
            text = self._charsmap.normalize(text)
        if vocab.remove_extra_whitespaces:
            return "".join("\u2581" + word for word in text.split(" ") if word)
        if vocab.add_space_prefix and text.strip(" "):
            first = len(text) - len(text.lstrip(" "))
            text = text[:first] + " " + text[first:]
        return text.replace(" ", "\u2581")


class CharsMap:
    """SentencePiece's precompiled normalization map (a T5-style vocabulary's
    ``tokenizer.ggml.precompiled_charsmap``), applied as llama.cpp applies it: at each character
    the longest byte sequence the map knows is replaced, other characters are kept.

    The blob is a uint32 size, a XOR-compressed compact double array (the trie of sequences) of
    that many bytes, then the NUL-terminated replacements its leaves point to. The trie is walked
    only where a regex of its one-byte sequences and two-byte prefixes finds a start (over the
    bytes as latin-1 text): in most text, a few places.
    """

    def __init__(self, blob: bytes) -> None:
        if len(blob) < 4:
            raise ValueError("precompiled_charsmap too small")
        size = int.from_bytes(blob[:4], "little")
        if size + 4 >= len(blob) or size % 4:
            raise ValueError("precompiled_charsmap: bad trie size")
        self._nodes = np.frombuffer(blob, "<u4", size // 4, 4).tolist()
        self._replacements = blob[4 + size:]
        singles, by_seconds = [], {}
        # one-byte sequences that begin no longer one (newline -> space): replaced without a walk
        self._single: dict[str, bytes] = {}
        for c, state, leaf in self._edges(self._base(0)):
            seconds = frozenset(c2 for c2, _, _ in self._edges(state))
            if leaf:
                singles.append(c)
                if not seconds:
                    self._single[chr(c)] = self._replacement(self._nodes[state] & ((1 << 31) - 1))
            elif seconds:
                by_seconds.setdefault(seconds, []).append(c)

        def chars(values) -> str:
            return "[" + "".join(re.escape(chr(v)) for v in sorted(values)) + "]"

        # first bytes with the same second bytes share one branch (a few branches, not one per byte)
        starts = [chars(singles)] if singles else []
        starts += [chars(firsts) + "(?=" + chars(seconds) + ")" for seconds, firsts in by_seconds.items()]
        self._starts = re.compile("|".join(starts), re.DOTALL) if starts else None

    def _base(self, i: int) -> int:
        node = self._nodes[i]
        return (node >> 10) << ((node & (1 << 9)) >> 6)

    def _step(self, state: int, c: int) -> tuple[int, bool] | None:
        """(next state, whether a sequence ends here) after byte ``c``, or None."""
        child = state ^ c
        if child >= len(self._nodes) or self._nodes[child] & ((1 << 31) | 0xFF) != c:
            return None
        return child ^ self._base(child), bool((self._nodes[child] >> 8) & 1)

    def _edges(self, state: int):
        for c in range(1, 256):
            step = self._step(state, c)
            if step is not None:
                yield c, *step

    def _longest(self, data: bytes, start: int) -> tuple[int, bytes]:
        """(length, replacement) of the longest mapped sequence at ``start`` (0 when none)."""
        state = self._base(0)
        length, value = 0, 0
        for pos in range(start, len(data)):
            step = self._step(state, data[pos]) if data[pos] else None
            if step is None:
                break
            state, leaf = step
            if leaf:
                length, value = pos - start + 1, self._nodes[state] & ((1 << 31) - 1)
        return (length, self._replacement(value)) if length else (0, b"")

    def _replacement(self, at: int) -> bytes:
        end = self._replacements.find(b"\0", at)
        if at >= len(self._replacements) or end < 0:
            raise ValueError("precompiled_charsmap: unterminated replacement")
        return self._replacements[at:end]

    def normalize(self, text: str) -> str:
        if self._starts is None:
            return text
        data = text.encode()
        latin = data.decode("latin-1")
        out, pos = [], 0
        single = self._single
        for m in self._starts.finditer(latin):  # one character each: starts may be a byte apart
            at = m.start()
            if at < pos:  # inside a sequence just replaced
                continue
            replacement = single.get(m.group())
            if replacement is not None:
                length = 1
            else:
                length, replacement = self._longest(data, at)
            if length:
                out += (data[pos:at], replacement)
                pos = at + length
        out.append(data[pos:])
        return b"".join(out).decode("utf-8", "replace")


def _chunks(text: str) -> Iterator[str]:
    """``text`` cut where :data:`_CUT` allows into pieces of about :data:`PARALLEL_CHUNK_CHARS`
    characters."""
    start, n = 0, len(text)
    while n - start > PARALLEL_CHUNK_CHARS:
        m = _CUT.search(text, start + PARALLEL_CHUNK_CHARS)
        if m is None:
            break
        yield text[start:m.start()]
        start = m.start()
    yield text[start:]


def _is_chinese(cpt: int) -> bool:
    return (0x4E00 <= cpt <= 0x9FFF or 0x3400 <= cpt <= 0x4DBF or 0x20000 <= cpt <= 0x2A6DF
            or 0x2A700 <= cpt <= 0x2B73F or 0x2B740 <= cpt <= 0x2B81F or 0x2B920 <= cpt <= 0x2CEAF
            or 0xF900 <= cpt <= 0xFAFF or 0x2F800 <= cpt <= 0x2FA1F)


_WHITESPACE = frozenset("\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
                        "\u200a\u2028\u2029\u202f\u205f\u3000")


class WordPieceTable(dict):
    """llama.cpp's WordPiece pre-processing as one ``str.translate`` table, filled as characters
    are met: whitespace becomes a space; control characters, NUL and U+FFFD go; accents are
    stripped (each character its decomposition's first, marks dropped) and letters lowercased as
    the vocabulary says; punctuation, ASCII symbols and CJK ideographs get spaces around them (a
    word each). The text's words are then what a whitespace split gives."""

    def __init__(self, lowercase: bool, strip_accents: bool) -> None:
        super().__init__()
        self.lowercase, self.strip_accents = lowercase, strip_accents

    def __missing__(self, cpt: int) -> str:
        ch = chr(cpt)
        if self.strip_accents:
            ch = unicodedata.normalize("NFD", ch)[0]
        cat = unicodedata.category(ch)
        c = ord(ch)
        if ch in _WHITESPACE:
            out = " "
        elif c == 0 or c == 0xFFFD or cat in ("Cc", "Cf", "Co", "Cs") or (self.strip_accents and cat[0] == "M"):
            out = ""
        else:
            out = _lower(ch) if self.lowercase else ch
            if cat[0] == "P" or (c < 0x7F and cat[0] == "S") or _is_chinese(c):
                out = f" {out} "
        self[cpt] = out
        return out


def _lower(ch: str) -> str:
    low = ch.lower()
    return low if len(low) == 1 else low[0]  # the simple mapping (U+0130 -> i)
