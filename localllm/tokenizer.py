"""Tokenizer, chat template and incremental detokenization for a GGUF model.

The tokenizer is converted from GGUF metadata by ``transformers`` once and cached under
``LOCALLLM_HOME/cache/tokenizers`` (the model's own folder may be read-only). Encoding and
decoding then use the Rust ``tokenizers.Tokenizer`` alone, exactly as transformers' fast tokenizer
would (its tokenization modules cost ~10 MiB of resident memory); the transformers tokenizer is
still there as ``Tokenizer.hf``, built on first use. Chat templates are rendered in a sandboxed
Jinja environment.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from localllm.config.paths import cache_dir
from localllm.errors import InvalidRequestError, ModelLoadError, RequestFailedError

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


# Next to transformers' files in a cache folder: the Rust tokenizer exactly as transformers loads that
# folder (a model class may rebuild parts of tokenizer.json, e.g. Qwen2Tokenizer adds an NFC
# normalizer), and what decode needs besides it. Written last, the info file marks both complete.
_BACKEND_FILE = "localllm-backend.json"
_INFO_FILE = "localllm-tokenizer.json"
_INFO_FORMAT = 1


def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return ""


def _clean_up_tokenization(text: str) -> str:
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


def _derive_fast(hf) -> tuple[str, dict]:
    """(serialized Rust tokenizer, info) of a transformers fast tokenizer, before any call changed it."""
    backend = hf.backend_tokenizer.to_str()
    info = {
        "format": _INFO_FORMAT,
        "transformers": _transformers_version(),
        "clean_up_tokenization_spaces": _decode_cleans_up(hf),
        "split_special_tokens": bool(getattr(hf, "split_special_tokens", False)),
    }
    return backend, info


def _write_fast(directory: Path, backend: str, info: dict) -> None:
    for name, text in ((_BACKEND_FILE, backend), (_INFO_FILE, json.dumps(info))):
        tmp = directory / f".{name}.tmp{os.getpid()}"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, directory / name)


def _fast_current(directory: Path) -> dict | None:
    """The info file of ``directory`` when it was written in this format by the installed transformers."""
    path = directory / _INFO_FILE
    if not path.is_file():
        return None
    info = json.loads(path.read_text(encoding="utf-8"))
    if info.get("format") != _INFO_FORMAT or info.get("transformers") != _transformers_version():
        return None
    return info


def _rust_tokenizer(tok, info: dict):
    """(``tok`` set up as transformers' encode/decode use it: no truncation or padding, whether
    decode cleans up spaces)."""
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = bool(info["split_special_tokens"])
    return tok, bool(info["clean_up_tokenization_spaces"])


def _install(tmp: Path, cached: Path) -> None:
    """Move a finished cache folder into place, replacing a broken one."""
    old = None
    if cached.exists():
        old = cached.with_name(cached.name + f".old{os.getpid()}")
        os.replace(cached, old)
    try:
        os.replace(tmp, cached)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


_RELOAD_PROBE = "Hello world, héllo  123\n\tend. <b>x</b> 日本"


def _hf_tokenizer(path: Path):
    """(transformers tokenizer, whether it came from the cache): cached, or converted from the GGUF
    metadata and cached (with the files the fast path reads)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    cached = cache_dir("tokenizers") / _cache_key(path)
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached)), True
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
        # What every later start gets: transformers loading the saved folder.
        reloaded = AutoTokenizer.from_pretrained(str(tmp))
        if reloaded.encode(_RELOAD_PROBE) != tok.encode(_RELOAD_PROBE):
            # The class rebuilt its own pipeline from the vocabulary (transformers 5's GemmaTokenizer
            # over a byte-level BPE vocabulary, as llama.cpp writes Gemma 3's): keep the converted
            # tokenizer.json as it is instead.
            config_path = tmp / "tokenizer_config.json"
            config = json.loads(config_path.read_text(encoding="utf-8"))
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            reloaded = AutoTokenizer.from_pretrained(str(tmp))
        tok = reloaded
        _write_fast(tmp, *_derive_fast(tok))
        _install(tmp, cached)
    except Exception as exc:  # noqa: BLE001 - the cache only saves time
        log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok, False


def _load_hf_tokenizer(path: Path):
    return _hf_tokenizer(path)[0]


def _load_fast_tokenizer(path: Path):
    """(Rust ``tokenizers.Tokenizer``, whether decode cleans up spaces) for a GGUF file.

    From a warm cache this reads the Rust tokenizer alone, without transformers' tokenization
    modules (~10 MiB resident). Otherwise transformers builds (or re-reads) the cache as before and
    the fast files are derived from its tokenizer.
    """
    from tokenizers import Tokenizer as RustTokenizer

    cached = cache_dir("tokenizers") / _cache_key(path)
    if (cached / "tokenizer.json").is_file():
        try:
            info = _fast_current(cached)
            if info is not None:
                return _rust_tokenizer(RustTokenizer.from_file(str(cached / _BACKEND_FILE)), info)
        except Exception as exc:  # noqa: BLE001 - derived again below
            log.warning("tokenizer cache at %s unreadable (%s); deriving it again", cached, exc)
    hf, from_cache = _hf_tokenizer(path)
    backend, info = _derive_fast(hf)
    if from_cache:  # a cache from before the fast files, by another transformers, or with broken ones
        try:
            _write_fast(cached, backend, info)
        except OSError as exc:
            log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return _rust_tokenizer(RustTokenizer.from_str(backend), info)


def _template_limit(message: str):
    from jinja2.exceptions import TemplateError

    return TemplateError(message)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


# A chat template comes with the model file, so it may be hostile or broken: rendering one stops
# at these limits (the sandbox already forbids attribute tricks and caps range() at 100k).
TEMPLATE_TIME_LIMIT_S = 5.0
TEMPLATE_OUTPUT_LIMIT_CHARS = 64 << 20
_MAX_POW_BITS = 1 << 16


class _TemplateDeadline(BaseException):
    """Raised inside a rendering thread whose time is up (a BaseException: templates can't catch it)."""


def _call_with_deadline(fn, seconds: float):
    """``fn()`` in this thread, interrupted by :class:`_TemplateDeadline` after ``seconds``.

    Jinja templates compile to Python bytecode, so an asynchronous exception stops any loop in
    them; the big C-level operations a template could start (``*`` and ``**``) are bounded by
    the environment instead.
    """
    tid = threading.get_ident()
    lock = threading.Lock()
    done = False

    def fire() -> None:
        with lock:
            if not done:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_TemplateDeadline))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        try:
            return fn()
        finally:
            with lock:
                done = True
            timer.cancel()
    except _TemplateDeadline:
        raise RequestFailedError(
            f"the model's chat template ran longer than {seconds:g} s and was stopped"
        ) from None


def _make_jinja_env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox, with ``*`` and ``**`` unable to build huge strings, lists or numbers."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if (isinstance(seq, (str, list, tuple)) and isinstance(times, int)
                            and len(seq) * times > TEMPLATE_OUTPUT_LIMIT_CHARS):
                        raise _template_limit("a repetition in the chat template is too large")
            elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
                  and right > 0 and max(abs(left).bit_length(), 1) * right > _MAX_POW_BITS):
                raise _template_limit("a power in the chat template is too large")
            return super().call_binop(context, operator, left, right)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_GIL_FREE_ENCODE_CHARS = 1 << 14  # longer texts are encoded with the GIL released


@dataclass(frozen=True, slots=True)
class FimTokens:
    """A model's fill-in-the-middle token ids (GGUF ``tokenizer.ggml.fim_*_token_id``; older files
    spell the first three ``prefix_token_id``/``suffix_token_id``/``middle_token_id``)."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None  # repository name (repo-level FIM)
    sep: int | None = None  # file separator

    @classmethod
    def from_metadata(cls, metadata: dict) -> FimTokens | None:
        """The FIM ids the metadata declares, or None unless it has all of pre, suf and mid."""

        def get(*names: str) -> int | None:
            for name in names:
                value = metadata.get(f"tokenizer.ggml.{name}_token_id")
                if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                    return value
            return None

        pre, suf, mid = get("fim_pre", "prefix"), get("fim_suf", "suffix"), get("fim_mid", "middle")
        if pre is None or suf is None or mid is None:
            return None
        return cls(pre, suf, mid, get("fim_pad"), get("fim_rep"), get("fim_sep"))


# The chunk separator llama-server puts between extra-context chunks when the model has no FIM_SEP.
_FIM_CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


def format_infill(
    fim: FimTokens,
    encode,
    prefix_ids: list[int],
    suffix_ids: list[int],
    prompt_ids: list[int] = (),
    extra: list[tuple[str, str]] = (),
    bos_id: int | None = None,
) -> list[int]:
    """llama-server's ``format_prompt_infill`` (PSM order), without its truncation to a batch:

    ``[extra context] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID``

    ``encode(text)`` tokenizes without special tokens; ``extra`` holds ``(filename, text)`` chunks of
    repo-level context, laid out as ``FIM_REP myproject\n (FIM_SEP filename\n text)* FIM_SEP
    filename\n`` when the model has those tokens (else the chunks joined by a plain separator).
    ``bos_id`` is the BOS to lead with, None when the model adds none.
    """
    extra_ids: list[int] = []
    if fim.rep is not None:
        extra_ids += [fim.rep, *encode("myproject\n")]
    for filename, text in extra:
        if fim.sep is not None:
            extra_ids += [fim.sep, *encode(filename + "\n")]
        else:
            extra_ids += encode(_FIM_CHUNK_SEPARATOR)
        extra_ids += encode(text)
    if fim.sep is not None:
        extra_ids += [fim.sep, *encode("filename\n")]
    head = [bos_id] if bos_id is not None else []
    return [*extra_ids, *head, fim.pre, *prefix_ids, *prompt_ids, fim.suf, *suffix_ids, fim.mid]


class Tokenizer:
    """Encodes prompts, renders chats and decodes tokens for one model."""

    # Fill-in-the-middle ids from the GGUF metadata; None for models without them.
    fim_tokens: FimTokens | None = None

    def __init__(self, gguf_path: str | os.PathLike, metadata: dict) -> None:
        self.path = Path(gguf_path)
        self._hf = None
        self._backend, self._clean_up = _load_fast_tokenizer(self.path)
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
        self._template = _make_jinja_env().from_string(self.chat_template)
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def hf(self):
        """The transformers tokenizer (loaded on first use; encode and decode do not need it)."""
        if self._hf is None:
            self._hf = _load_hf_tokenizer(self.path)
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

        backend, info = _derive_fast(self._hf)
        self._backend, self._clean_up = _rust_tokenizer(RustTokenizer.from_str(backend), info)
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
        self._template = _make_jinja_env().from_string(self.chat_template)
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
        return _clean_up_tokenization(text) if self._clean_up else text

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
                if size > TEMPLATE_OUTPUT_LIMIT_CHARS:
                    raise RequestFailedError(
                        f"the model's chat template produced more than {TEMPLATE_OUTPUT_LIMIT_CHARS} characters"
                    )
                parts.append(chunk)
            return "".join(parts)

        try:
            return _call_with_deadline(render, TEMPLATE_TIME_LIMIT_S)
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template error: {exc}", param="messages") from exc
        except (RecursionError, MemoryError, OverflowError) as exc:
            raise RequestFailedError(f"the model's chat template failed: {exc!r}") from None

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
