"""Pulling a model into the local store: :func:`pull` and :func:`ensure_model`.

:func:`pull` resolves a name, then, under the model's store lock, tries its sources in order
(:func:`localllm.store.fetch.fetch`) and writes the manifest only after every file is
verified; :func:`ensure_model` is what ``run``/``serve``/``chat`` call: a local path as is, a
pulled model with no network at all, anything else pulled on first use.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.store import local
from localllm.store.catalog import load_catalog
from localllm.store.fetch import fetch
from localllm.store.names import canonical_name, existing_path, is_url, resolve
from localllm.store.progress import Bars, Listener
from localllm.store.refs import DownloadError, one_line


def pull(name: str, progress: bool = True, verify: bool = True, listener: Listener | None = None) -> Path:
    """Download a model into the store (if needed) and return its path.

    A model already pulled and complete is returned with no network access at all, its files
    re-hashed first when ``verify`` (what ``localllm pull`` asks; loading a model does not): a
    file whose bytes are not the ones pulled (its size right, its content torn by a crash or
    changed since) is deleted and pulled again. Otherwise
    its sources are tried in order; every file is checked against its expected sha256 (from
    the catalog, the Hub's LFS metadata, or a ``#sha256=`` URL fragment; a Hub file kept in
    git, against its git blob id) before the manifest is written, and a mismatching file is
    deleted. A Hub file with no checksum from either is not downloaded. A local path is
    returned as is. ``listener`` is told each file's progress (see :class:`Bars`).
    Raises :class:`ModelNotFoundError`, :class:`InvalidRequestError` or :class:`DownloadError`.
    """
    key = canonical_name(name)
    if not is_url(key) and load_catalog().canonical(key) is None and (found := existing_path(key)):
        return found
    local.sweep()
    if local.is_pulled(key):
        if not verify:
            return local.path_for(key)
        with local.lock(key):
            complete, torn = local.torn_files(key)
            for path in torn:
                path.unlink(missing_ok=True)  # no longer complete: fetched again below
            if complete and not torn:
                return local.path_for(key)
    ref = resolve(name)
    if ref.is_local:
        assert ref.path is not None
        return ref.path
    with local.lock(ref.name):
        if local.is_pulled(ref.name):
            return local.path_for(ref.name)
        final = local.model_dir(ref.name)
        work = final / local.DOWNLOAD_DIR
        errors: list[LocalLLMError] = []
        with Bars(progress, listener) as bars:
            for src in ref.sources:
                try:
                    fetched = fetch(ref, src, work, final, bars)
                except LocalLLMError as e:
                    errors.append(e)
                    continue
                except Exception as e:  # network and hub errors of every kind: try the next source
                    errors.append(DownloadError(f"{src.describe()}: {one_line(e)}"))
                    continue
                local.write_manifest(
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
                return local.path_for(ref.name)
    if len(errors) == 1:
        raise errors[0]
    tried = "; ".join(f"{src.describe()}: {e.message}" for src, e in zip(ref.sources, errors, strict=True))
    raise DownloadError(f"could not pull {ref.name}: {tried}") from errors[-1]


def resolve_model_path(model: str | os.PathLike) -> str:
    """A local file's path as is; anything else is a catalog/hub name pulled into the store."""
    path = os.fspath(model)
    if os.path.isfile(path):
        return path
    return str(ensure_model(path))


def resolve_models(config):
    """An engine's configuration (``EngineConfig``) with its model, and its draft model if it has
    one, as local paths: a name is pulled into the store first."""
    draft = config.draft_model
    return dataclasses.replace(config, model=resolve_model_path(config.model),
                               draft_model=resolve_model_path(draft) if draft else None)


def ensure_model(name: str, progress: bool | None = None) -> Path:
    """Path to use for ``name``: a local file as is, else the pulled model (pulled on first use).

    ``progress=None`` shows download bars only when stderr is a terminal.
    """
    if progress is None:
        progress = sys.stderr.isatty()
    return pull(name, progress=progress, verify=False)  # (no hashing of gigabytes on every load)

