""":class:`Tokenizer`: encodes prompts, renders chats and decodes tokens for one model."""

from __future__ import annotations

import json
import os
from pathlib import Path

from localllm.errors import InvalidRequestError, ModelLoadError, RequestFailedError
from localllm.tokenizer import templates
from localllm.tokenizer.encoder import Encoder
from localllm.tokenizer.fim import FimTokens, format_infill
from localllm.tokenizer.hf_tokenizer import HFCodec
from localllm.tokenizer.pipeline import transformers_json
from localllm.tokenizer.vocab import Vocab

# Used when a GGUF file carries no chat template (ChatML, as Ollama and llama.cpp fall back to).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class GGUFCodec:
    """A GGUF vocabulary's encoding and decoding, as llama.cpp's (:mod:`~localllm.tokenizer.vocab`)."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.encoder = Encoder(vocab)
        self.size = len(vocab.tokens)
        self._pieces_without_special: list[bytes] | None = None

    def encode(self, text: str, parse_special: bool) -> list[int]:
        return self.encoder.encode(text, parse_special)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.vocab.detokenize(ids, render_special=not skip_special_tokens)

    def token(self, i: int) -> str | None:
        return self.vocab.tokens[i] if 0 <= i < self.size else None

    def pieces(self, skip_special_tokens: bool) -> list[bytes]:
        """Each token's bytes (llama.cpp's pieces), control tokens empty when skipped."""
        if not skip_special_tokens:
            return self.vocab.pieces
        if self._pieces_without_special is None:
            vocab = self.vocab
            self._pieces_without_special = [b"" if vocab.is_special(i) else p for i, p in enumerate(vocab.pieces)]
        return self._pieces_without_special


class Tokenizer:
    """Encodes prompts, renders chats and decodes tokens for one model."""

    # Fill-in-the-middle ids from the GGUF metadata; None for models without them.
    fim_tokens: FimTokens | None = None

    def __init__(self, gguf_path: str | os.PathLike, metadata: dict) -> None:
        self.path = Path(gguf_path)
        self._hf = None
        vocab = Vocab.from_metadata(metadata, source=str(self.path))
        self._codec = GGUFCodec(vocab)
        ids = vocab.ids
        self.bos_token_id: int | None = ids.bos
        self.eos_token_id: int | None = ids.eos
        self.add_bos_token = vocab.add_bos and ids.bos is not None
        # llama.cpp's vocab flags for pairs of texts (rerankers' prompts without a template)
        self.add_eos_token = vocab.add_eos
        self.add_sep_token = vocab.add_sep
        self.sep_token_id: int | None = ids.sep
        if ids.fim_pre is not None and ids.fim_suf is not None and ids.fim_mid is not None:
            self.fim_tokens = FimTokens(ids.fim_pre, ids.fim_suf, ids.fim_mid, ids.fim_pad, ids.fim_rep, ids.fim_sep)
        # Generation stops at llama.cpp's end-of-generation tokens: EOS, EOT, EOM, FIM_PAD/REP/SEP
        # and the tokens it knows by their text (<|im_end|>, <end_of_turn>, ...).
        self.stop_token_ids: frozenset[int] = vocab.eog_ids
        self.chat_template: str = metadata.get("tokenizer.chat_template") or DEFAULT_CHAT_TEMPLATE
        self._template = templates.make_jinja_env().from_string(self.chat_template)
        self.vocab_size = self._codec.size

    @property
    def vocab(self) -> Vocab | None:
        """The GGUF vocabulary (None for a Hugging Face directory's tokenizer)."""
        return self._codec.vocab if isinstance(self._codec, GGUFCodec) else None

    @property
    def hf(self):
        """A transformers tokenizer with this one's vocabulary (built on first use; encode and
        decode do not need it): for exports and for libraries that take a transformers tokenizer."""
        if self._hf is None:
            self._hf = _transformers_tokenizer(self._codec.vocab)
        return self._hf

    @classmethod
    def from_checkpoint(cls, checkpoint) -> Tokenizer:
        """The tokenizer of a loaded checkpoint (``models.Checkpoint``): a GGUF file's vocabulary,
        or a Hugging Face directory's tokenizer files."""
        if checkpoint.format == "hf":
            return cls.from_hf_dir(checkpoint.path)
        return cls(checkpoint.path, checkpoint.metadata)

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """The tokenizer of a Hugging Face model directory (``tokenizer.json``/``tokenizer_config.json``).

        Chat template: the tokenizer's own (``tokenizer_config.json``, ``chat_template.jinja``).
        BOS/EOS: ``generation_config.json`` first, then the tokenizer's special tokens; every EOS
        id of ``generation_config.json`` stops generation.
        """
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        self = cls.__new__(cls)
        self.path = Path(directory)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            self._hf = AutoTokenizer.from_pretrained(str(self.path))
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot load the tokenizer ({exc})") from exc
        finally:
            hf_logging.set_verbosity(verbosity)
        self._codec = HFCodec(self._hf)
        gen: dict = {}
        gen_path = self.path / "generation_config.json"
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"{gen_path}: cannot read JSON ({exc})") from exc
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        bos = gen.get("bos_token_id")
        self.bos_token_id = bos if isinstance(bos, int) else self.hf.bos_token_id
        self.eos_token_id = gen_eos[0] if gen_eos else self.hf.eos_token_id
        # BOS is added when the tokenizer's own post-processor adds it.
        probe = self.hf.encode("a", add_special_tokens=True)
        self.add_bos_token = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self.add_eos_token = self.add_sep_token = False  # (llama.cpp's pair flags: GGUF vocabs only)
        self.sep_token_id = self.hf.sep_token_id
        stop_ids = {*gen_eos, self.hf.eos_token_id, self.eos_token_id}
        self.stop_token_ids = frozenset(i for i in stop_ids if i is not None)
        template = self.hf.chat_template
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        self.chat_template = template or DEFAULT_CHAT_TEMPLATE
        self._template = templates.make_jinja_env().from_string(self.chat_template)
        self.vocab_size = self._codec.size
        return self

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        """Vocabulary entries of token ids (``None`` for an unknown id), as transformers gives them."""
        if isinstance(ids, int):
            return self._codec.token(ids)
        return [self._codec.token(int(i)) for i in ids]

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.convert_ids_to_tokens(int(token_id)) or ""

    @property
    def bos_token(self) -> str:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._token_text(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``parse_special``: control tokens written in the text (``<|im_end|>``) are those tokens, as in
        llama-server's prompts and llama-tokenize's default; otherwise only user-defined tokens
        are, as with llama-tokenize's ``--no-parse-special`` and in llama-perplexity.
        ``add_special_tokens``: what llama.cpp adds, BOS and EOS where the model adds them, except a
        second BOS after one the text already starts with (a chat template's own).
        """
        ids = self._codec.encode(text, parse_special)
        if not add_special_tokens:
            return ids
        bos = self.bos_token_id
        starts_with_bos = bos is not None and ids[:1] == [bos]
        vocab = self.vocab
        if vocab is not None:
            return vocab.with_special_tokens(ids, bos=not starts_with_bos)
        if self.add_bos_token and bos is not None and not starts_with_bos:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids: llama.cpp's detokenization for a GGUF vocabulary, transformers'
        ``decode`` for a Hugging Face directory's tokenizer."""
        if isinstance(ids, int):
            ids = [ids]
        elif not isinstance(ids, list):
            ids = [int(i) for i in ids]
        return self._codec.decode(ids, skip_special_tokens)

    def byte_pieces(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each token's bytes, for streaming text as llama-server does (None where the tokenizer
        has no such table: a Hugging Face directory's decodes whole sequences)."""
        return self._codec.pieces(skip_special_tokens) if isinstance(self._codec, GGUFCodec) else None

    def encode_infill(
        self,
        prefix: str | list[int],
        suffix: str | list[int],
        prompt: str = "",
        extra: list[tuple[str, str]] = (),
    ) -> list[int]:
        """The fill-in-the-middle prompt for ``prefix``/``suffix`` (texts or token ids); see
        :func:`format_infill`. Raises ValueError when the model has no FIM tokens."""
        fim = self.fim_tokens
        if fim is None:
            raise ValueError("this model has no fill-in-the-middle tokens")

        def encode(text: str | list[int]) -> list[int]:
            return list(text) if isinstance(text, list) else self.encode(text, add_special_tokens=False)

        bos = self.bos_token_id if self.add_bos_token else None
        return format_infill(fim, encode, encode(prefix), encode(suffix), encode(prompt) if prompt else [],
                             extra, bos)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The chat template applied to ``messages`` (``content`` may be a list of text parts)."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        normalized = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidRequestError(f"messages[{i}] must be an object with a 'role'", param="messages")
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(
                    p.get("text", "") if isinstance(p, dict) else str(p) for p in content
                )
            normalized.append({**m, "content": content if content is not None else ""})
        from jinja2.exceptions import TemplateError

        own = {"messages": normalized, "add_generation_prompt": add_generation_prompt,
               "bos_token": self.bos_token, "eos_token": self.eos_token}
        if clash := sorted(own.keys() & kwargs.keys()):
            raise InvalidRequestError(f"template variable {clash[0]!r} is set by the server and cannot be "
                                      "passed in", param="chat_template_kwargs")
        variables = {**own, **kwargs}

        def render() -> str:
            parts, size = [], 0
            for chunk in self._template.generate(**variables):
                size += len(chunk)
                if size > templates.TEMPLATE_OUTPUT_LIMIT_CHARS:
                    raise TemplateError(
                        f"the model's chat template produced more than {templates.TEMPLATE_OUTPUT_LIMIT_CHARS} characters"
                    )
                parts.append(chunk)
            return "".join(parts)

        try:
            return templates.call_with_deadline(render, templates.TEMPLATE_TIME_LIMIT_S)
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template error: {exc}", param="messages") from exc
        except (RecursionError, MemoryError, OverflowError) as exc:
            raise RequestFailedError(f"the model's chat template failed: {exc!r}") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=True)


def _transformers_tokenizer(vocab: Vocab):
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    def text(i: int | None) -> str | None:
        return vocab.tokens[i] if i is not None else None

    ids = vocab.ids
    named = {"bos_token": text(ids.bos), "eos_token": text(ids.eos), "unk_token": text(ids.unk),
             "pad_token": text(ids.pad), "sep_token": text(ids.sep), "mask_token": text(ids.mask)}
    return PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(transformers_json(vocab)),
                                   clean_up_tokenization_spaces=vocab.clean_spaces,
                                   **{k: v for k, v in named.items() if v is not None})
