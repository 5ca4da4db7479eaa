"""The model's tokenizer, converted from its GGUF metadata by ``transformers`` once and cached under
``LOCALLLM_HOME/cache/tokenizers`` (the model's own folder may be read-only): the Rust tokenizer
exactly as transformers would load it, and what decoding needs besides it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from localllm.config.paths import cache_dir
from localllm.errors import ModelLoadError

log = logging.getLogger(__name__)


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


def rust_tokenizer(tok, info: dict):
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
        _write_fast(tmp, *derive_fast(tok))
        _install(tmp, cached)
    except Exception as exc:  # noqa: BLE001 - the cache only saves time
        log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok, False


def load_hf_tokenizer(path: Path):
    return _hf_tokenizer(path)[0]


def load_fast_tokenizer(path: Path):
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
                return rust_tokenizer(RustTokenizer.from_file(str(cached / _BACKEND_FILE)), info)
        except Exception as exc:  # noqa: BLE001 - derived again below
            log.warning("tokenizer cache at %s unreadable (%s); deriving it again", cached, exc)
    hf, from_cache = _hf_tokenizer(path)
    backend, info = derive_fast(hf)
    if from_cache:  # a cache from before the fast files, by another transformers, or with broken ones
        try:
            _write_fast(cached, backend, info)
        except OSError as exc:
            log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return rust_tokenizer(RustTokenizer.from_str(backend), info)
