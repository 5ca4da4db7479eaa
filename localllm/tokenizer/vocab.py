"""A GGUF file's vocabulary, read and applied as llama.cpp applies it (``llama-vocab.cpp``).

The metadata defines the tokenizer: ``tokenizer.ggml.model`` its type (``gpt2``: byte-level BPE,
``llama``: SentencePiece BPE, ``bert``: WordPiece, ``t5``: Unigram, ``gemma4``: SentencePiece-style
BPE), ``tokenizer.ggml.pre`` the pre-tokenizer (:mod:`~localllm.tokenizer.pretokenizers`), the
tokens, their types, scores and merges the rest. :class:`Vocab` reads them as llama.cpp does;
:mod:`~localllm.tokenizer.pipeline` builds from it what encodes plain text (the merges, the regex
splits, the byte-level encoding), and the rest is done here and in :mod:`~localllm.tokenizer.encoder`,
as llama.cpp does it:

* special tokens are cut out of the text before anything else: user-defined ones always, control
  ones when ``parse_special`` (llama-tokenize's default), longest first, with their strip flags;
* SPM text gets a leading space at its start and after each special token, spaces become ``▁``;
* decoding joins each token's bytes (its *piece*), drops the first token's leading space where a
  space prefix was added, and cleans spaces before punctuation where the vocabulary says so.

Encoding follows llama.cpp's token-type rules (control-looking tokens made control, end-of-
generation tokens found by their text) so that the same text gives the same ids. Special-token
matching is leftmost-longest, which is llama.cpp's longest-first wherever special tokens do not
overlap one another.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from localllm.errors import ModelLoadError
from localllm.tokenizer.pretokenizers import DEFAULT, PRE_TOKENIZERS, PreTokenizer


class Attr:
    """llama.cpp's token attributes (``llama_token_attr``), bit flags (plain ints: a vocabulary
    holds hundreds of thousands)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9
    # parsed in text and rendered only with special tokens on
    SPECIAL = CONTROL | UNKNOWN
    # cut out of the text before tokenizing (user-defined ones always, the others when parsed)
    CUT_OUT = CONTROL | USER_DEFINED | UNKNOWN


# tokenizer.ggml.token_type -> attribute (gguf's TokenType: 1 normal ... 6 byte)
_TYPE_ATTR = {1: Attr.NORMAL, 2: Attr.UNKNOWN, 3: Attr.CONTROL, 4: Attr.USER_DEFINED, 5: Attr.UNUSED,
              6: Attr.BYTE}

# Which special ids a type has by default, before the metadata: (bos, eos, unk, sep, pad, mask).
_DEFAULT_IDS = {
    "spm": (1, 2, 0, None, None, None),
    "wpm": (101, None, 100, 102, 0, 103),
    "bpe": (11, 11, None, None, None, None),
    "ugm": (None, 1, 2, None, 0, None),
}
_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id", "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id", "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id", "mask": "tokenizer.ggml.mask_token_id",
    "fim_pre": "tokenizer.ggml.fim_pre_token_id", "fim_suf": "tokenizer.ggml.fim_suf_token_id",
    "fim_mid": "tokenizer.ggml.fim_mid_token_id", "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id", "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}
_DEPRECATED_FIM_KEYS = {"fim_pre": "tokenizer.ggml.prefix_token_id", "fim_suf": "tokenizer.ggml.suffix_token_id",
                        "fim_mid": "tokenizer.ggml.middle_token_id"}

# Tokens llama.cpp recognizes by their text when the metadata names none (each made control).
_TEXT_IDS = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
# gpt-oss's harmony tokens are rendered in outputs: llama.cpp makes them user-defined.
_ALWAYS_RENDERED = frozenset(("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
# str.translate table: byte-level characters to the latin-1 character of their byte
_BYTE_LEVEL_TO_LATIN1 = {ord(c): b for c, b in _UNICODE_TO_BYTE.items()}
_HEX_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True, slots=True)
class SpecialIds:
    bos: int | None = None
    eos: int | None = None
    eot: int | None = None
    eom: int | None = None
    unk: int | None = None
    sep: int | None = None
    pad: int | None = None
    mask: int | None = None
    fim_pre: int | None = None
    fim_suf: int | None = None
    fim_mid: int | None = None
    fim_pad: int | None = None
    fim_rep: int | None = None
    fim_sep: int | None = None


@dataclass(slots=True)
class Vocab:
    """A GGUF vocabulary with llama.cpp's reading of its flags (see the module's docstring)."""

    kind: str  # "bpe", "spm", "wpm" or "ugm"
    pre_name: str
    pre: PreTokenizer
    tokens: list[str]
    attrs: list[int]
    # As the metadata holds them (a long array stays in the file): read when a pipeline is built.
    scores: Sequence[float]
    merges: Sequence[str]
    ids: SpecialIds
    add_bos: bool
    add_eos: bool
    add_sep: bool
    add_space_prefix: bool
    remove_extra_whitespaces: bool
    escape_whitespaces: bool
    clean_spaces: bool
    eog_ids: frozenset[int]
    precompiled_charsmap: bytes = b""
    normalizer_lowercase: bool = True
    normalizer_strip_accents: bool = True
    pieces: list[bytes] = field(default_factory=list)

    @classmethod
    def from_metadata(cls, metadata: dict, source: str = "the file") -> Vocab:
        model = metadata.get("tokenizer.ggml.model")
        if model in (None, "no_vocab", "none"):
            raise ModelLoadError(f"{source} has no vocabulary (tokenizer.ggml.model is {model!r})")
        kind = {"gpt2": "bpe", "gemma4": "bpe", "llama": "spm", "bert": "wpm", "t5": "ugm"}.get(model)
        if kind is None:
            raise ModelLoadError(f"{source}: tokenizer type {model!r} is not supported "
                                 "(supported: gpt2, llama, bert, t5, gemma4)")
        tokens = as_list(_string_array(metadata, "tokenizer.ggml.tokens", source))
        n = len(tokens)
        if n == 0:
            raise ModelLoadError(f"{source}: the vocabulary is empty")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

        pre_name = "default"
        pre = DEFAULT
        if kind == "bpe":
            pre_name = "gemma4" if model == "gemma4" else (metadata.get("tokenizer.ggml.pre") or "default")
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                close = difflib.get_close_matches(pre_name, PRE_TOKENIZERS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ModelLoadError(f"{source}: unknown pre-tokenizer {pre_name!r} (tokenizer.ggml.pre), "
                                     f"which llama.cpp refuses too{hint}")
        merges = _string_array(metadata, "tokenizer.ggml.merges", source) if kind == "bpe" else []
        if kind == "bpe" and "tokenizer.ggml.merges" not in metadata:
            raise ModelLoadError(f"{source}: a BPE vocabulary without merges (tokenizer.ggml.merges)")

        types = metadata.get("tokenizer.ggml.token_type")
        if types is not None and len(types) < n:
            raise ModelLoadError(f"{source}: {len(types)} token types for {n} tokens")
        attrs = [_TYPE_ATTR.get(t, Attr.UNDEFINED) for t in as_list(types)] if types is not None else [Attr.NORMAL] * n
        attrs = attrs[:n]
        scores_raw = metadata.get("tokenizer.ggml.scores")
        if scores_raw is not None and len(scores_raw) < n:
            raise ModelLoadError(f"{source}: {len(scores_raw)} token scores for {n} tokens")
        scores = scores_raw if scores_raw is not None else [0.0] * n

        # The type's defaults, then the pre-tokenizer's, then the metadata (as llama-vocab.cpp).
        add_space_prefix = kind == "spm"
        clean_spaces = {"bpe": pre.clean_spaces, "spm": False, "wpm": True, "ugm": False}[kind]
        add_bos = {"bpe": bool(pre.add_bos), "spm": True, "wpm": True, "ugm": False}[kind]
        add_eos = kind == "ugm"
        add_sep = kind == "wpm" or pre.add_sep
        escape_whitespaces = pre.escape_whitespaces if kind == "bpe" else True
        add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        remove_extra_whitespaces = bool(metadata.get("tokenizer.ggml.remove_extra_whitespaces", False))

        defaults = dict(zip(("bos", "eos", "unk", "sep", "pad", "mask"), _DEFAULT_IDS[kind]))
        if model == "gemma4":
            defaults = {}
        if kind == "bpe" and not pre.has_bos:
            defaults["bos"] = None
        found: dict[str, int | None] = {}
        for name, key in _ID_KEYS.items():
            value = defaults.get(name)
            if value is not None and value >= n:
                value = None
            meta = metadata.get(key, metadata.get(_DEPRECATED_FIM_KEYS.get(name, ""), None))
            if meta is not None and 0 <= int(meta) < n:
                value = int(meta)
            found[name] = value
        for key, current in (("tokenizer.ggml.add_bos_token", add_bos), ("tokenizer.ggml.add_eos_token", add_eos),
                             ("tokenizer.ggml.add_sep_token", add_sep)):
            value = bool(metadata.get(key, current))
            if key.endswith("bos_token"):
                add_bos = value
            elif key.endswith("eos_token"):
                add_eos = value
            else:
                add_sep = value
        if pre.bos_always:
            add_bos = True

        token_ids = {t: i for i, t in enumerate(tokens)}  # a repeated text names its last id, as llama.cpp
        for name, texts in _TEXT_IDS.items():
            if found[name] is None:
                for text in texts:
                    i = token_ids.get(text)
                    if i is not None:
                        found[name] = i
                        attrs[i] |= Attr.CONTROL
                        break
        for t, i in token_ids.items():
            if attrs[i] & Attr.CONTROL and "unused" in t:
                attrs[i] |= Attr.UNUSED
        eog = {found[k] for k in ("fim_pad", "fim_rep", "fim_sep")} - {None}
        for t, i in token_ids.items():
            if t in _EOG_TEXTS:
                eog.add(i)
                attrs[i] |= Attr.CONTROL
        for t in _ALWAYS_RENDERED:
            if t in token_ids:
                attrs[token_ids[t]] = Attr.USER_DEFINED
        eog |= {found[k] for k in ("eos", "eot", "eom")} - {None}
        texts = {tokens[i]: i for i in eog}
        if "<|end|>" in texts and ("<|return|>" in texts and "<|call|>" in texts
                                   or "<|calls|>" in texts and "<|flush|>" in texts):
            # harmony's <|end|> closes a message, not the generation
            eog.discard(texts["<|end|>"])
            attrs[texts["<|end|>"]] = Attr.USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            attrs[texts["</s>"]] = Attr.NORMAL
        _set_strip_flags(metadata, tokens, token_ids, attrs)

        charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
        lowercase = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
        vocab = cls(
            kind=kind, pre_name=pre_name, pre=pre, tokens=tokens, attrs=attrs, scores=scores, merges=merges,
            ids=SpecialIds(**found), add_bos=add_bos, add_eos=add_eos, add_sep=add_sep,
            add_space_prefix=add_space_prefix, remove_extra_whitespaces=remove_extra_whitespaces,
            escape_whitespaces=escape_whitespaces, clean_spaces=clean_spaces, eog_ids=frozenset(eog),
            precompiled_charsmap=bytes(bytearray(int(b) & 0xFF for b in charsmap)) if charsmap is not None else b"",
            normalizer_lowercase=lowercase,
            normalizer_strip_accents=bool(metadata.get("tokenizer.ggml.normalizer.strip_accents", lowercase)),
        )
        vocab.pieces = [vocab._piece(i) for i in range(n)]
        return vocab

    # -- pieces (llama.cpp's token_to_piece with special tokens rendered) ----------------------------

    def _piece(self, i: int) -> bytes:
        text, attr = self.tokens[i], self.attrs[i]
        if attr & (Attr.SPECIAL | Attr.USER_DEFINED):
            return text.encode()
        if attr & Attr.NORMAL:
            if self.kind in ("spm", "wpm", "ugm") or self.escape_whitespaces:
                return text.replace("\u2581", " ").encode()
            try:
                return text.translate(_BYTE_LEVEL_TO_LATIN1).encode("latin-1")
            except UnicodeEncodeError:
                pass
            out = bytearray()
            for ch in text:
                b = _UNICODE_TO_BYTE.get(ch)
                if b is None:  # not a byte-level character: llama.cpp writes this marker
                    out += f"[UNK_BYTE_0x{ch.encode().hex()}{text}]".encode()
                else:
                    out.append(b)
            return bytes(out)
        if attr & Attr.BYTE and self.kind != "wpm":
            m = _HEX_BYTE.fullmatch(text)
            return bytes([int(m.group(1), 16)]) if m else b""
        return b""

    def with_special_tokens(self, ids: list[int], bos: bool = True) -> list[int]:
        """``ids`` with what llama.cpp's ``add_special`` adds: BOS and EOS where the vocabulary adds
        them (WordPiece: CLS before, SEP after); ``bos=False`` leaves the BOS out."""
        first, last = [], []
        if self.kind == "wpm":
            first, last = [self.ids.bos], [self.ids.sep]
        else:
            if self.add_bos:
                first = [self.ids.bos]
            if self.add_eos:
                last = [self.ids.eos]
        first = [i for i in first if i is not None] if bos else []
        return [*first, *ids, *(i for i in last if i is not None)]

    def is_special(self, i: int) -> bool:
        """Whether ``i`` is a control or unknown token (not rendered when special tokens are skipped)."""
        return bool(self.attrs[i] & Attr.SPECIAL)

    def detokenize(self, ids: Sequence[int], *, render_special: bool = True, remove_special: bool = False) -> str:
        """llama.cpp's ``llama_detokenize``: the pieces joined, the first one's space prefix
        removed, spaces cleaned where the vocabulary says; invalid UTF-8 replaced."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids and ids[0] == self.ids.bos:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.ids.eos:
            ids = ids[:-1]
        pieces, attrs, n = self.pieces, self.attrs, len(self.pieces)
        out = []
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is out of range (vocabulary of {n})")
            if not render_special and attrs[i] & Attr.SPECIAL:
                piece = b""
            else:
                piece = pieces[i]
            if remove_space:
                piece = piece[1:] if piece.startswith(b" ") else piece
                remove_space = False
            out.append(piece)
        data = b"".join(out)
        if self.clean_spaces:
            data = _clean_spaces(data)
        return data.decode("utf-8", "replace")

    def special_texts(self, parse_special: bool) -> list[tuple[str, int, int]]:
        """(text, id, attr) of the tokens cut out of the text before tokenizing, longest first."""
        out = []
        for i, (t, a) in enumerate(zip(self.tokens, self.attrs)):
            if a & Attr.CUT_OUT and (parse_special or not a & Attr.SPECIAL):
                out.append((t, i, a))
        out.sort(key=lambda x: -len(x[0].encode()))
        return out


def _string_array(metadata: dict, key: str, source: str) -> Sequence[str]:
    value = metadata.get(key)
    if value is None:
        return []
    if isinstance(value, str) or not all(isinstance(v, str) for v in value[:16]):
        raise ModelLoadError(f"{source}: {key} is not an array of strings")
    return value


def as_list(value) -> list:
    """A metadata array as a list (long ones are lazy ``GGUFArray``s)."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _set_strip_flags(metadata: dict, tokens: list[str], token_ids: dict[str, int], attrs: list[int]) -> None:
    """llama.cpp's per-model strip flags (set by model, tokenizer or architecture name)."""
    name = str(metadata.get("general.name", "")).lower()
    pre = str(metadata.get("tokenizer.ggml.pre", ""))
    arch = str(metadata.get("general.architecture", ""))
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")):
        if "<mask>" in token_ids:
            attrs[token_ids["<mask>"]] |= Attr.LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for i, a in enumerate(attrs):
            if a & Attr.CUT_OUT:
                attrs[i] |= Attr.RSTRIP
        for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if t in token_ids:
                i = token_ids[t]
                attrs[i] = attrs[i] | Attr.RSTRIP if on else attrs[i] & ~Attr.RSTRIP
    elif "modern-bert" in name and "[MASK]" in token_ids:
        attrs[token_ids["[MASK]"]] |= Attr.LSTRIP


def _clean_spaces(data: bytes) -> bytes:
    """llama.cpp's three clean-up passes: no space before ``?!.,``; a lone ``'`` between spaces
    joined to both sides; no space before ``'s``, ``'m``, ``'re`` and ``'ve``."""
    if b" " not in data:
        return data
    data = re.sub(rb" (?=[?!.,])", b"", data)
    if b" ' " in data:
        data = _join_lone_quotes(data)
    return re.sub(rb" (?='(?:[sm]|re|ve))", b"", data)


def _join_lone_quotes(data: bytes) -> bytes:
    # llama.cpp's second pass as written: the space before the quote is dropped, the one after
    # it skipped (and no longer counts as a space for the next character).
    buf = bytearray(data)
    out = bytearray(buf[:1])
    i, n = 1, len(buf)
    while i < n:
        x = buf[i]
        if x == 0x27 and i + 1 < n and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            out.pop()
            i += 1
            buf[i] = 0
        out.append(x)
        i += 1
    return bytes(out)
