"""What is known about a model without the network: ``localllm show``'s data.

:func:`model_info` merges the catalog entry, the store's manifest and the GGUF header of a
pulled or local file; :func:`gguf_metadata` reads that header (architecture, sizes, quant
types, chat template...).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from localllm.errors import ModelNotFoundError
from localllm.store import local
from localllm.store.catalog import load_catalog
from localllm.store.names import canonical_name, existing_path, is_url, unknown_name_message
from localllm.store.refs import HubSource


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Architecture, parameter count, context, quant types, chat template... of a GGUF file."""

    from localllm.models.gguf_file import read_gguf

    gf = read_gguf(path)  # the header only (its errors name the file); tensor data stays in the file
    get = gf.metadata.get

    arch = get("general.architecture")
    file_type_name = gf.file_type
    tokens = get("tokenizer.ggml.tokens")
    tensors = gf.tensors.values()
    parameters = int(sum(math.prod(t.shape) for t in tensors))
    # a mixture of experts: a token reads expert_used_count of each layer's expert_count experts
    experts = int(get(f"{arch}.expert_count", 0) or 0) if arch else 0
    used = int(get(f"{arch}.expert_used_count", 0) or 0) if arch else 0
    active = parameters
    if experts and 0 < used <= experts:
        expert_weights = sum(math.prod(t.shape) for t in tensors if "_exps." in t.name)
        active = parameters - expert_weights * (experts - used) // experts
    return {
        "architecture": arch,
        "name": get("general.name"),
        "size_label": get("general.size_label"),
        "parameters": parameters,
        "active_parameters": active,
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
    found = None if (is_url(key) or catalog.canonical(key)) else existing_path(key)
    if found is not None:
        info.update(kind="local", path=str(found), format="gguf" if found.is_file() else "gptq")
        info["size"] = found.stat().st_size if found.is_file() else None
        path = found
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
        manifest = local.read_manifest(key)
        if manifest is not None and local.is_pulled(key):
            path = local.path_for(key)
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
                + ("" if "/" in key else "; " + unknown_name_message(name, catalog)),
                param="model",
                code="model_not_found",
            )
        else:
            info["pulled"] = False
    if path is not None and path.is_file() and path.suffix.lower() == ".gguf":
        info["gguf"] = gguf_metadata(path)
    return info
