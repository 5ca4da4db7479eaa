""":class:`Tokenizer`: encodes prompts, renders chats and decodes tokens for one model."""

from __future__ import annotations

import json
import os
from pathlib import Path

from localllm.errors import InvalidRequestError, ModelLoadError, RequestFailedError
from localllm.tokenizer import templates
from localllm.tokenizer.convert import (
    clean_up_tokenization,
    derive_fast,
    load_fast_tokenizer,
    load_hf_tokenizer,
    rust_tokenizer,
)
from localllm.tokenizer.fim import FimTokens, format_infill

# Used when a GGUF file carries no chat template (ChatML, as Ollama and llama.cpp fall back to).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)



_GIL_FREE_ENCODE_CHARS = 1 << 14  # longer texts are encoded with the GIL released



class Tokenizer:
    """Encodes prompts, renders chats and decodes tokens for one model."""

    # Fill-in-the-middle ids from the GGUF metadata; None for models without them.
    fim_tokens: FimTokens | None = None

    def __init__(self, gguf_path: str | os.PathLike, metadata: dict) -> None:
        self.path = Path(gguf_path)
        self._hf = None
        self._backend, self._clean_up = load_fast_tokenizer(self.path)
        self.bos_token_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", self.bos_token_id is not None))
        # llama.cpp's vocab flags for pairs of texts (rerankers' prompts without a template)
        self.add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.add_sep_token = bool(metadata.get("tokenizer.ggml.add_sep_token", False))
        self.sep_token_id: int | None = metadata.get("tokenizer.ggml.seperator_token_id")
        # Generation stops at EOS and at the end-of-turn tokens the file declares.
        stop_ids = {metadata.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                              "tokenizer.ggml.eom_token_id")}
        self.fim_tokens = FimTokens.from_metadata(metadata)
        if self.fim_tokens is not None:
            # As llama.cpp: FIM_PAD, FIM_REP and FIM_SEP end a generation too.
            stop_ids |= {self.fim_tokens.pad, self.fim_tokens.rep, self.fim_tokens.sep}
        self.stop_token_ids: frozenset[int] = frozenset(i for i in stop_ids if i is not None)
        self.chat_template: str = metadata.get("tokenizer.chat_template") or DEFAULT_CHAT_TEMPLATE
        self._template = templates.make_jinja_env().from_string(self.chat_template)
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def hf(self):
        """The transformers tokenizer (loaded on first use; encode and decode do not need it)."""
        if self._hf is None:
            self._hf = load_hf_tokenizer(self.path)
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
        from tokenizers import Tokenizer as RustTokenizer

        backend, info = derive_fast(self._hf)
        self._backend, self._clean_up = rust_tokenizer(RustTokenizer.from_str(backend), info)
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
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        return self

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        """Vocabulary entries of token ids (``None`` for an unknown id), as transformers gives them."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < _GIL_FREE_ENCODE_CHARS:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        else:
            # The Rust tokenizer's encode holds the GIL throughout (seconds for megabytes: the engine's
            # step thread and the server's event loop would starve); encode_batch releases it.
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids, as transformers' ``decode`` gives it (with its space clean-up, if configured)."""
        if isinstance(ids, int):
            ids = [ids]
        elif not isinstance(ids, list):
            ids = [int(i) for i in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up else text

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

        variables = dict(
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )

        def render() -> str:
            parts, size = [], 0
            for chunk in self._template.generate(**variables):
                size += len(chunk)
                if size > templates.TEMPLATE_OUTPUT_LIMIT_CHARS:
                    raise RequestFailedError(
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
