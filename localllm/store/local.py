"""The local model store: pulled weights and their manifests, under ``LOCALLLM_HOME``.

Layout::

    $LOCALLLM_HOME/                      (default: platformdirs.user_cache_dir("localllm"))
      models/<safe-name>/manifest.json   name, source, files (size + sha256), format, pulled_at
      models/<safe-name>/<file>          the weights (one .gguf, or a gptq checkpoint's files)
      models/<safe-name>/.download/      partial downloads; never read as a model
      models/.locks/<safe-name>.lock     the lock pull and rm take (outside the directory rm moves)
      models/.<safe-name>.deleting-<pid> a model rm is deleting; never listed, swept by the next
                                         store operation if rm was interrupted

Invariants: a model is pulled iff its ``manifest.json`` exists and every file it lists is on
disk with the listed size (the sha256 was checked before the manifest was written; an explicit
pull and :func:`verify` check it again). Every write goes through a temp file, fsynced, then
``os.replace`` and an fsync of the directory, so a crash leaves either the old state or the new
one, never half a file under its final name. ``<safe-name>`` is derived from the model's
canonical name and can never contain a path separator or ``..``. The home is created private
(0700): its config may hold an API key.

Names are canonicalised with :func:`localllm.store.names.canonical_name` (no network), so
``smollm2``, ``smollm2:135m`` and ``smollm2:135m-q4_1`` are one stored model.
Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from localllm.config.paths import home_dir
from localllm.errors import InvalidRequestError, ModelNotFoundError
from localllm.store.modelfile import ModelDefaults
from localllm.store.names import canonical_name
from localllm.store.refs import MANIFEST, check_file_name

DOWNLOAD_DIR = ".download"
LOCKS_DIR = ".locks"
DELETING = ".deleting-"
MANIFEST_SCHEMA = 1

_SAFE = re.compile(r"[a-z0-9][a-z0-9._-]{0,120}")


@dataclass(frozen=True, slots=True)
class StoredModel:
    """One pulled model, as ``localllm list`` shows it."""

    name: str
    path: Path  # the GGUF file, or the checkpoint directory for multi-file formats
    size: int  # bytes, all files together
    quant: str | None
    modified: datetime  # when it was pulled (UTC)
    format: str
    manifest: dict[str, Any]


def home() -> Path:
    """The store's root: :func:`localllm.config.paths.home_dir` (``$LOCALLLM_HOME`` or the platform's user
    cache dir), not created here."""
    return home_dir(create=False)


def models_dir() -> Path:
    return home() / "models"


def safe_name(name: str) -> str:
    """Directory name for a canonical model name: readable, collision-free, never a path."""
    simple = name.replace(":", "--")
    if ":" not in simple and "--" not in name and ".." not in simple and _SAFE.fullmatch(simple):
        return simple
    slug = re.sub(r"[^a-z0-9._]+", "-", name.lower()).replace("..", ".").strip("-.")[:80] or "model"
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:10]
    return f"{slug}-{digest}"


def model_dir(name: str) -> Path:
    """Directory of a model in the store (it may not exist yet)."""
    return models_dir() / safe_name(canonical_name(name))


def download_dir(name: str) -> Path:
    return model_dir(name) / DOWNLOAD_DIR


def _make_models_dir() -> Path:
    home_dir(create=True)  # (private: created here first, not as a parent of the models dir)
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    return root


# -- atomic writes -------------------------------------------------------------------------


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_replace(src: Path, dest: Path) -> None:
    """Move a finished file to its final name so that after a crash it is there whole or not at
    all: its data reaches the disk before the rename, and the rename before we go on (the
    manifest written next must never name a file the disk lost)."""
    with open(src, "rb") as f:
        os.fsync(f.fileno())
    os.replace(src, dest)
    fsync_dir(dest.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode("utf-8"))


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


# -- manifests -----------------------------------------------------------------------------


def read_manifest(name: str) -> dict[str, Any] | None:
    """The manifest of a pulled model, or None (absent or unreadable)."""
    return _read_manifest_at(model_dir(name))


def _read_manifest_at(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / MANIFEST).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list) or "name" not in data:
        return None
    return data


def write_manifest(
    name: str,
    *,
    source: dict[str, Any],
    files: list[dict[str, Any]],
    format: str,
    quant: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Record a completed pull. ``files`` entries: ``{"name", "size", "sha256"}``, already verified."""
    key = canonical_name(name)
    for entry in files:
        check_file_name(entry["name"])
    manifest: dict[str, Any] = {
        "schema": MANIFEST_SCHEMA,
        "name": key,
        "format": format,
        "quant": quant,
        "source": source,
        "files": files,
        "pulled_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if extra:
        manifest.update({k: v for k, v in extra.items() if k not in manifest})
    atomic_write_json(model_dir(key) / MANIFEST, manifest)
    return manifest


def _complete(directory: Path, manifest: dict[str, Any]) -> bool:
    """Every listed file is present with its recorded size."""
    try:
        for entry in manifest["files"]:
            f = directory / check_file_name(entry["name"])
            if not f.is_file() or f.stat().st_size != int(entry["size"]):
                return False
    except (KeyError, TypeError, ValueError, InvalidRequestError, OSError):
        return False
    return bool(manifest["files"])


def _primary_path(directory: Path, manifest: dict[str, Any]) -> Path:
    if manifest.get("format", "gguf") == "gguf" and len(manifest["files"]) == 1:
        return directory / manifest["files"][0]["name"]
    return directory


# -- public queries ------------------------------------------------------------------------


def is_pulled(name: str) -> bool:
    """True if the model is in the store, complete (no network, no hashing)."""
    try:
        directory = model_dir(name)
    except InvalidRequestError:
        return False
    manifest = _read_manifest_at(directory)
    return manifest is not None and _complete(directory, manifest)


def path_for(name: str) -> Path:
    """Path of a pulled model: its GGUF file, or its directory for multi-file formats."""
    directory = model_dir(name)
    manifest = _read_manifest_at(directory)
    if manifest is None or not _complete(directory, manifest):
        raise ModelNotFoundError(_not_pulled_message(name), param="model", code="model_not_found")
    return _primary_path(directory, manifest)


def verify(name: str) -> bool:
    """Re-hash every file of a pulled model against its manifest (slow for big models)."""
    return not torn_files(name)[1]


def torn_files(name: str) -> tuple[bool, list[Path]]:
    """``(complete, files)``: whether the model is pulled with every file at its size, and those
    of its files whose sha256 is not the manifest's (each re-hashed: slow for big models)."""
    directory = model_dir(name)
    manifest = _read_manifest_at(directory)
    if manifest is None or not _complete(directory, manifest):
        return False, []
    torn = [
        directory / entry["name"] for entry in manifest["files"]
        if entry.get("sha256") not in (None, sha256_file(directory / entry["name"]))
    ]
    return True, torn


def sweep() -> None:
    """Finish deleting what an interrupted ``rm`` left (``.<name>.deleting-<pid>`` directories)."""
    root = models_dir()
    if root.is_dir():
        for leftover in root.glob(f".*{DELETING}*"):
            shutil.rmtree(leftover, ignore_errors=True)


def _iter_manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    root = models_dir()
    if not root.is_dir():
        return
    for directory in sorted(root.iterdir()):
        # Dot names are the store's own (locks, models being deleted), never a model.
        if directory.is_dir() and not directory.name.startswith("."):
            manifest = _read_manifest_at(directory)
            if manifest is not None:
                yield directory, manifest


def list_models() -> list[StoredModel]:
    """Every complete model in the store, most recently pulled first."""
    sweep()
    models = []
    for directory, manifest in _iter_manifests():
        if not _complete(directory, manifest):
            continue
        try:
            modified = datetime.fromisoformat(manifest["pulled_at"])
        except (KeyError, TypeError, ValueError):
            modified = datetime.fromtimestamp((directory / MANIFEST).stat().st_mtime, timezone.utc)
        if modified.tzinfo is None:
            modified = modified.replace(tzinfo=timezone.utc)
        models.append(
            StoredModel(
                name=str(manifest["name"]),
                path=_primary_path(directory, manifest),
                size=sum(int(entry["size"]) for entry in manifest["files"]),
                quant=manifest.get("quant"),
                modified=modified,
                format=str(manifest.get("format", "gguf")),
                manifest=manifest,
            )
        )
    models.sort(key=lambda m: m.modified, reverse=True)
    return models


def remove(name: str) -> str:
    """Delete a model (and any partial download of it) from the store; returns its canonical name.

    Under the model's lock, so that it never deletes files a pull is writing."""
    key = canonical_name(name)
    directory = models_dir() / safe_name(key)
    sweep()
    if not directory.exists():
        raise ModelNotFoundError(_not_pulled_message(name), param="model", code="model_not_found")
    with lock(key):
        if not directory.exists():  # another rm was first
            raise ModelNotFoundError(_not_pulled_message(name), param="model", code="model_not_found")
        # Rename first so that a concurrent reader never sees a half-deleted model.
        trash = directory.with_name(f".{directory.name}{DELETING}{os.getpid()}")
        os.replace(directory, trash)
        fsync_dir(directory.parent)
    shutil.rmtree(trash, ignore_errors=True)
    return key


def _link(src: Path, to: Path) -> None:
    """``to`` as a hard link to ``src`` (a copy where the file system cannot link)."""
    to.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, to)
    except OSError:
        shutil.copy2(src, to)
        fsync_dir(to.parent)


def copy(source: str, destination: str) -> str:
    """A pulled model under a second name (Ollama's ``copy``): its files hard-linked, or copied where
    the file system cannot link, and its manifest (and defaults) under the new name. Returns the new
    canonical name. A name already in the store is refused, never overwritten."""
    return _store_variant(source, destination, None)


def create(name: str, base: str, defaults: ModelDefaults) -> str:
    """A variant of ``base`` (a pulled model, or a GGUF file's path) named ``name`` with its own
    ``defaults`` (Ollama's ``create``): ``base``'s files hard-linked as :func:`copy` does (a file path's
    file linked, or copied, into the store). Returns the new canonical name."""
    path = Path(base).expanduser()
    if not is_pulled(canonical_name(base)) and path.is_file():
        dst = canonical_name(name)
        with lock(dst):
            if model_dir(dst).exists():
                raise InvalidRequestError(f"{dst} is already in the store; remove it first", param="model")
            _link(path, model_dir(dst) / path.name)
            entry = {"name": path.name, "size": path.stat().st_size, "sha256": sha256_file(path)}
            write_manifest(dst, source={"type": "file", "path": path.name}, files=[entry], format="gguf",
                           extra={"defaults": defaults.to_json(), "base": path.name})
        return dst
    return _store_variant(base, name, defaults)


def _store_variant(source: str, destination: str, defaults: ModelDefaults | None) -> str:
    src, dst = canonical_name(source), canonical_name(destination)
    manifest = read_manifest(src)
    if manifest is None or not is_pulled(src):
        raise ModelNotFoundError(_not_pulled_message(source), param="source" if defaults is None else "from",
                                 code="model_not_found")
    sweep()
    with lock(dst):
        if model_dir(dst).exists():
            raise InvalidRequestError(f"{dst} is already in the store; remove it first",
                                      param="destination" if defaults is None else "model")
        for entry in manifest["files"]:
            _link(model_dir(src) / entry["name"], model_dir(dst) / entry["name"])
        extra = {k: v for k, v in manifest.items() if k in ("license", "context_length", "defaults", "base")}
        if defaults is not None:
            extra.update(defaults=defaults.to_json(), base=src)
        write_manifest(dst, source=manifest["source"], files=manifest["files"], format=manifest["format"],
                       quant=manifest.get("quant"), extra=extra)
    return dst


def defaults_of(name: str) -> tuple[str, ModelDefaults] | None:
    """``(base, defaults)`` of a variant made by :func:`create` (or a copy of one); None for others."""
    manifest = read_manifest(name)
    if manifest is None or not isinstance(manifest.get("defaults"), dict):
        return None
    return str(manifest.get("base", "")), ModelDefaults.from_json(manifest["defaults"])


def _not_pulled_message(name: str) -> str:
    import difflib

    pulled = [str(m["name"]) for _, m in _iter_manifests()]
    close = difflib.get_close_matches(name, pulled, n=3, cutoff=0.5)
    hint = f"; pulled models with similar names: {', '.join(close)}" if close else ""
    return f"model {name!r} is not pulled (run `localllm pull {name}`){hint}"


@contextlib.contextmanager
def lock(name: str) -> Iterator[None]:
    """Best-effort inter-process lock around pulling or removing one model (POSIX flock; no-op
    elsewhere). Its file lives outside the model's directory, which ``rm`` moves away: a pull
    waiting on it must hold the same file as the next one."""
    locks = _make_models_dir() / LOCKS_DIR
    locks.mkdir(exist_ok=True)
    path = locks / f"{safe_name(canonical_name(name))}.lock"
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
