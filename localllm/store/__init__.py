"""Models on this machine: the catalog, model names, downloads and the local store.

The modules, each importing only from those above it (no cycles, no engine)::

    refs      ModelRef / ModelFile / sources, DownloadError / ChecksumError, file-name checks
    catalog   models.toml: families, tags, aliases -> ModelRef           (refs)
    names     a model name's form, store key and ModelRef                (refs, catalog)
    local     the store on disk: manifests, paths, list, rm, locks       (refs, names)
    progress  rich download bars                                         (-)
    fetch     one source into a directory: Hub, URL (resumable), wheel   (refs, local, progress)
    download  pull / ensure_model: sources in order, then the manifest   (all of the above)
    info      model_info / gguf_metadata for ``localllm show``           (refs, catalog, names, local)

This package re-exports what the rest of localllm uses; it never imports localllm's engine,
API or TUI. The submodules import each other directly, never this facade.
"""

from __future__ import annotations

from localllm.store.catalog import Catalog, default_model, load_catalog
from localllm.store.download import ensure_model, pull, resolve_model_path, resolve_models
from localllm.store.info import gguf_metadata, model_info
from localllm.store.local import StoredModel, home, is_pulled, list_models, models_dir, path_for, remove
from localllm.store.names import canonical_name, pick_gguf, resolve
from localllm.store.refs import ChecksumError, DownloadError
from localllm.store.refs import HubSource, ModelFile, ModelRef, Source, UrlSource, WheelSource

__all__ = [
    "Catalog",
    "ChecksumError",
    "DownloadError",
    "HubSource",
    "ModelFile",
    "ModelRef",
    "Source",
    "StoredModel",
    "UrlSource",
    "WheelSource",
    "canonical_name",
    "default_model",
    "ensure_model",
    "resolve_model_path",
    "resolve_models",
    "gguf_metadata",
    "home",
    "is_pulled",
    "list_models",
    "load_catalog",
    "model_info",
    "models_dir",
    "path_for",
    "pick_gguf",
    "pull",
    "remove",
    "resolve",
]
