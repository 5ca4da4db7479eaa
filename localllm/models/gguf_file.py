"""Open a GGUF file (memory-mapped) and check it before any tensor is used."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localllm.errors import ModelLoadError


@dataclass(slots=True)
class GGUFTensor:
    name: str
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: (rows, cols) for matrices
    data: np.ndarray  # memory-mapped view; uint8 [rows, bytes] for quantized types


@dataclass(slots=True)
class GGUFFile:
    path: Path
    metadata: dict
    tensors: dict[str, GGUFTensor]
    file_size: int


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - odd fields are ignored rather than failing the load
        return None


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read metadata and tensor views of a GGUF file without copying tensor data.

    Raises ModelLoadError with a readable message for a missing, truncated or corrupt file.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    file_size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r})")
        reader = gguf.GGUFReader(str(path), "r")
    except ModelLoadError:
        raise
    except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on broken files
        raise ModelLoadError(f"{path}: cannot read GGUF file, it is truncated or corrupt ({exc})") from exc

    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        metadata[key] = _field_value(field)

    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > file_size or t.data.nbytes != int(t.n_bytes):
            raise ModelLoadError(
                f"{path}: truncated file: tensor {t.name!r} needs bytes up to {end:,} but the file has {file_size:,}"
            )
        dims = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists the fastest dim first
        tensors[t.name] = GGUFTensor(name=t.name, qtype=t.tensor_type, shape=dims, data=t.data)
    _release_header_pages(reader)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, file_size=file_size)


def _release_header_pages(reader) -> None:
    """The header (metadata, vocabulary: ~6 MiB for a 49k-token model) is parsed into Python
    objects by now; drop its mapped pages from the resident set (they fault back in if read)."""
    from localllm.quant.cpu_fast import release_file_range

    end = min((int(t.data_offset) for t in reader.tensors), default=0)
    if end > 0:
        release_file_range(reader.data.ctypes.data, end)
