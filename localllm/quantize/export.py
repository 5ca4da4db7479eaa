"""Writing checkpoints in the AutoGPTQ / GPTQModel / transformers layout: safetensors (one file,
or shards with ``model.safetensors.index.json``), ``config.json``, ``generation_config.json`` and
the tokenizer files with the chat template (the source writes those it has)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from localllm.errors import InvalidRequestError
from localllm.models.safetensors import INDEX_FILE, SINGLE_FILE


def save_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_size: int | None = None) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or as shards of at most ``max_shard_size``
    bytes with ``model.safetensors.index.json``; returns the file names."""
    from safetensors.torch import save_file

    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    if not max_shard_size or total <= max_shard_size:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    files, weight_map = [], {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in names}, str(out_dir / file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return files + [INDEX_FILE]


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def check_out_dir(out_dir: Path, src: Path) -> None:
    if out_dir.resolve() == src.resolve():
        raise InvalidRequestError("the output directory must differ from the source", param="output")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidRequestError(f"output directory {out_dir} exists and is not empty", param="output")


def prepare_out_dir(out_dir: Path, src: Path) -> None:
    check_out_dir(out_dir, src)
    out_dir.mkdir(parents=True, exist_ok=True)


def write_model_files(source, out_dir: Path, tensors, config: dict, max_shard_size, tokenizer) -> list[str]:
    files = save_safetensors(tensors, out_dir, max_shard_size)
    write_json(out_dir / "config.json", config)
    gen = source.generation_config(tokenizer)
    if gen:
        write_json(out_dir / "generation_config.json", gen)
    source.save_tokenizer(out_dir, tokenizer)
    return files

