"""A Hugging Face model directory's tokenizer (``tokenizer.json``): encoded and decoded by the Rust
``tokenizers.Tokenizer`` exactly as transformers' fast tokenizer would, without transformers'
Python on the hot path (:class:`HFCodec`)."""

from __future__ import annotations


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``, which its decode applies when configured to."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


def _decode_cleans_up(hf) -> bool:
    """Whether ``hf.decode`` applies ``clean_up_tokenization`` to the Rust decoder's text.

    Asked of the tokenizer rather than re-derived from its config: transformers 5 ignores
    ``clean_up_tokenization_spaces`` for BPE models, earlier versions do not.
    """
    if not getattr(hf, "clean_up_tokenization_spaces", False):
        return False
    from transformers.utils import logging as hf_logging

    seen: list[str] = []
    hf.clean_up_tokenization = lambda text: seen.append(text) or text
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf.decode([0])
    finally:
        del hf.clean_up_tokenization
        hf_logging.set_verbosity(verbosity)
    return bool(seen)


def derive_fast(hf) -> tuple[str, dict]:
    """(serialized Rust tokenizer, info) of a transformers fast tokenizer, before any call changed it."""
    backend = hf.backend_tokenizer.to_str()
    info = {
        "clean_up_tokenization_spaces": _decode_cleans_up(hf),
        "split_special_tokens": bool(getattr(hf, "split_special_tokens", False)),
    }
    return backend, info


def rust_tokenizer(tok, info: dict):
    """(``tok`` set up as transformers' encode/decode use it: no truncation or padding, whether
    decode cleans up spaces)."""
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = bool(info["split_special_tokens"])
    return tok, bool(info["clean_up_tokenization_spaces"])


class HFCodec:
    """A transformers fast tokenizer's encoding and decoding through its Rust tokenizer."""

    vocab = None

    def __init__(self, hf) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        serialized, info = derive_fast(hf)
        self._serialized, self._info = serialized, info
        self._backend, self._clean_up = rust_tokenizer(RustTokenizer.from_str(serialized), info)
        self._plain_backend = None  # special tokens read as text (built on first use)
        self.size = self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, parse_special: bool) -> list[int]:
        backend = self._backend
        if not parse_special:
            if self._plain_backend is None:
                from tokenizers import Tokenizer as RustTokenizer

                plain, _ = rust_tokenizer(RustTokenizer.from_str(self._serialized), self._info)
                plain.encode_special_tokens = True
                self._plain_backend = plain
            backend = self._plain_backend
        if len(text) < _GIL_FREE_ENCODE_CHARS:
            return backend.encode(text, add_special_tokens=False).ids
        # The Rust tokenizer's encode holds the GIL throughout (seconds for megabytes: the engine's
        # step thread and the server's event loop would starve); encode_batch releases it.
        return backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up else text

    def token(self, i: int) -> str | None:
        return self._backend.id_to_token(i)


_GIL_FREE_ENCODE_CHARS = 1 << 14  # longer texts are encoded with the GIL released
