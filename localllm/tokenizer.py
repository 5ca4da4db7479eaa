"""Tokenizer, chat template and incremental detokenization for a GGUF model.

The tokenizer is converted from GGUF metadata by ``transformers`` once and cached under
``LOCALLLM_HOME/cache/tokenizers`` (the model's own folder may be read-only). Chat templates
are rendered in a sandboxed Jinja environment.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from datetime import datetime
from pathlib import Path

from localllm.errors import InvalidRequestError, ModelLoadError
from localllm.paths import cache_dir

log = logging.getLogger(__name__)

# Used when a GGUF file carries no chat template (ChatML, as Ollama and llama.cpp fall back to).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v1"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _load_hf_tokenizer(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    cached = cache_dir("tokenizers") / _cache_key(path)
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # noqa: BLE001 - a broken cache is rebuilt, not fatal
            log.warning("tokenizer cache at %s unreadable (%s); rebuilding", cached, exc)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot build the tokenizer from GGUF metadata ({exc})") from exc
    finally:
        hf_logging.set_verbosity(verbosity)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached) if not cached.exists() else None
    except OSError as exc:
        log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return tok


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _make_jinja_env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """Encodes prompts, renders chats and decodes tokens for one model."""

    def __init__(self, gguf_path: str | os.PathLike, metadata: dict) -> None:
        self.path = Path(gguf_path)
        self.hf = _load_hf_tokenizer(self.path)
        self.bos_token_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        self.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", self.bos_token_id is not None))
        # Generation stops at EOS and at the end-of-turn tokens the file declares.
        stop_ids = {metadata.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                              "tokenizer.ggml.eom_token_id")}
        self.stop_token_ids: frozenset[int] = frozenset(i for i in stop_ids if i is not None)
        self.chat_template: str = metadata.get("tokenizer.chat_template") or DEFAULT_CHAT_TEMPLATE
        self._template = _make_jinja_env().from_string(self.chat_template)
        self.vocab_size = len(self.hf)

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
            self.hf = AutoTokenizer.from_pretrained(str(self.path))
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot load the tokenizer ({exc})") from exc
        finally:
            hf_logging.set_verbosity(verbosity)
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
        stop_ids = {*gen_eos, self.hf.eos_token_id, self.eos_token_id}
        self.stop_token_ids = frozenset(i for i in stop_ids if i is not None)
        template = self.hf.chat_template
        if isinstance(template, dict):
            template = template.get("default") or next(iter(template.values()), None)
        self.chat_template = template or DEFAULT_CHAT_TEMPLATE
        self._template = _make_jinja_env().from_string(self.chat_template)
        self.vocab_size = len(self.hf)
        return self

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.hf.convert_ids_to_tokens(int(token_id)) or ""

    @property
    def bos_token(self) -> str:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._token_text(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

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

        try:
            return self._template.render(
                messages=normalized,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template error: {exc}", param="messages") from exc

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=True)


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
        decode = self.tokenizer.hf.decode
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
        decode = self.tokenizer.hf.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        self.read_offset = len(self.ids)
        delta = full[len(prefix) :]
        self.text += delta
        return delta
