"""Hugging Face checkpoints on disk: safetensors files (memory-mapped, checked at open), a model
directory's configs and shards (:class:`HFCheckpoint`), and GPTQ ``quantization_config``.

The weights may be plain float (F32/F16/BF16) or GPTQ-packed (see :mod:`localllm.quant.gptq`);
either way they stay as they are in the memory-mapped files.
:class:`~localllm.models.sources.HFSource` reads a model from them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path, PurePath

import numpy as np
import torch

from localllm.errors import ModelLoadError
from localllm.quant.gptq import CHECKPOINT_FORMATS, SUPPORTED_BITS
from localllm.quant.linear import tensor_from_numpy

# safetensors dtype -> (numpy dtype to view the bytes as, torch dtype of the tensor)
_ST_DTYPES = {
    "F64": (np.float64, torch.float64),
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.uint16, torch.bfloat16),
    "I64": (np.int64, torch.int64),
    "I32": (np.int32, torch.int32),
    "I16": (np.int16, torch.int16),
    "I8": (np.int8, torch.int8),
    "U8": (np.uint8, torch.uint8),
    "BOOL": (np.bool_, torch.bool),
}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# --- safetensors, memory-mapped ---------------------------------------------------------------

# The safetensors crate refuses headers over 100 MB (``MAX_HEADER_SIZE`` in its tensor.rs), so no
# file it writes has one; a larger length is corruption or a different format, and reading it
# would be an allocation the file chose.
MAX_HEADER_SIZE = 100_000_000
# Tensors become torch views, whose dims are int64; no checkpoint has more than a few dims, and
# 64 is numpy's limit (NPY_MAXDIMS), so a longer shape is corruption, not a tensor.
_MAX_RANK = 64
_MAX_DIM = 2**63 - 1


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads`` keeps the last of two equal keys; a header that names a tensor twice is corrupt."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not an offset


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed and checked at open, tensors as zero-copy views.

    The checks follow the safetensors crate (header size limit, UTF-8 JSON, known dtypes, offsets
    that match shape x dtype and stay inside the data) so that a corrupt or hostile file fails
    here with one line naming the file, never later with an IndexError deep in a model build.
    Gaps between tensors and trailing bytes are allowed (the crate refuses them; they are harmless).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self.file_size = self.path.stat().st_size
            with open(self.path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise ModelLoadError(f"{self.path}: not a safetensors file (shorter than its header)")
                header_len = int.from_bytes(head, "little")
                if header_len > MAX_HEADER_SIZE:
                    raise ModelLoadError(f"{self.path}: not a safetensors file or corrupt: header length "
                                         f"{header_len:,} is over the {MAX_HEADER_SIZE:,}-byte limit")
                if header_len > self.file_size - 8:
                    raise ModelLoadError(f"{self.path}: truncated or not a safetensors file (header length {header_len})")
                raw = fh.read(header_len)
        except OSError as exc:
            raise ModelLoadError(f"{self.path}: cannot read safetensors header ({exc})") from exc
        header = self._parse_header(raw)
        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ModelLoadError(f"{self.path}: safetensors __metadata__ is not a map of strings to strings")
        self.metadata = metadata
        self.data_start = 8 + header_len
        data_size = self.file_size - self.data_start
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self.entries[name] = self._check_entry(name, info, data_size)
        self._check_overlaps()
        self._map: np.ndarray | None = None

    def _parse_header(self, raw: bytes) -> dict:
        try:
            text = raw.decode("utf-8")  # json.loads(bytes) would also take UTF-16/32; the format is UTF-8
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: safetensors header is not UTF-8 "
                                 f"(bad byte at offset {8 + exc.start:,})") from None
        try:
            header = json.loads(text, object_pairs_hook=_unique_keys)
        except _DuplicateKey as exc:
            key = exc.args[0]
            raise ModelLoadError(f"{self.path}: safetensors header has the key {key!r:.100} twice") from None
        except (ValueError, RecursionError) as exc:  # RecursionError: a header of 100 MB of '['
            raise ModelLoadError(f"{self.path}: safetensors header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ModelLoadError(f"{self.path}: safetensors header is not a JSON object")
        return header

    def _check_entry(self, name: str, info: object, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
        """(dtype, shape, begin, end) of one header entry, or ModelLoadError saying what is wrong."""
        where = f"{self.path}: tensor {name!r:.100}"
        if not isinstance(info, dict):
            raise ModelLoadError(f"{where}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
            raise ModelLoadError(f"{where} has dtype {dtype!r:.40}, which localllm does not read")
        if isinstance(shape, list) and len(shape) > _MAX_RANK:
            raise ModelLoadError(f"{where}: shape has {len(shape):,} dimensions (at most {_MAX_RANK})")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape):
            raise ModelLoadError(f"{where}: shape {shape!r:.80} is not a list of non-negative int64 sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(_is_int(o) and 0 <= o <= _MAX_DIM for o in offsets)):
            raise ModelLoadError(f"{where}: data_offsets {offsets!r:.80} is not a list of two offsets "
                                 "(int64 >= 0)")
        begin, end = offsets
        if begin > end:
            raise ModelLoadError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
        shape = tuple(shape)
        nbytes = math.prod(shape) * np.dtype(_ST_DTYPES[dtype][0]).itemsize
        if end - begin != nbytes:
            size = f"{nbytes:,}" if nbytes <= _MAX_DIM else "over 2**63"  # 64 dims of 2**63: 1,200 digits
            raise ModelLoadError(f"{where} of shape {shape!s:.120} {dtype} needs {size} bytes, "
                                 f"its data_offsets span {end - begin:,}")
        if end > data_size:
            raise ModelLoadError(f"{self.path}: truncated file: tensor {name!r:.100} needs "
                                 f"{self.data_start + end:,} bytes, the file has {self.file_size:,}")
        return dtype, shape, begin, end

    def _check_overlaps(self) -> None:
        """Two tensors sharing bytes: the crate refuses it; a writer never produces it."""
        spans = sorted((begin, end, name) for name, (_, _, begin, end) in self.entries.items() if end > begin)
        for (_, prev_end, prev), (begin, _, name) in itertools.pairwise(spans):
            if begin < prev_end:
                raise ModelLoadError(f"{self.path}: tensors {prev!r:.100} and {name!r:.100} "
                                     "overlap in the file")

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        np_dtype, torch_dtype = _ST_DTYPES[dtype]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self.data_start + begin : self.data_start + end]
        if (self.data_start + begin) % np.dtype(np_dtype).itemsize:
            raw = np.array(raw)  # unaligned: a copy (rare; writers align tensors)
        t = tensor_from_numpy(raw.view(np_dtype))
        if torch_dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.reshape(shape)


# --- quantization_config ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GPTQSpec:
    """The parts of a ``quantization_config`` that decide how packed weights are read."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str
    lm_head: bool = False


def parse_quantization_config(qc: dict, where: str = "config.json") -> GPTQSpec:
    """Validate a ``quantization_config`` (or ``quantize_config.json``); raise ModelLoadError."""
    if not isinstance(qc, dict):
        raise ModelLoadError(f"{where}: quantization_config must be an object")
    method = str(qc.get("quant_method") or ("gptq" if "bits" in qc else "")).lower()
    if method != "gptq":
        raise ModelLoadError(f"{where}: quantization method {method or '(none)'!r} is not supported (supported: gptq)")
    try:
        bits = int(qc["bits"])
        group_size = int(qc.get("group_size", -1))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where}: GPTQ quantization_config needs integer 'bits' and 'group_size'") from exc
    if bits not in SUPPORTED_BITS:
        raise ModelLoadError(f"{where}: GPTQ with {bits} bits is not supported (supported: 2, 3, 4, 8)")
    if group_size != -1 and group_size <= 0:
        raise ModelLoadError(f"{where}: GPTQ group_size must be positive or -1, got {group_size}")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if qc.get("is_marlin_format"):
        fmt = "marlin"
    if fmt not in CHECKPOINT_FORMATS:
        raise ModelLoadError(
            f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (supported: {', '.join(CHECKPOINT_FORMATS)})"
        )
    return GPTQSpec(
        bits=bits,
        group_size=group_size,
        desc_act=bool(qc.get("desc_act", False)),
        sym=bool(qc.get("sym", True)),
        checkpoint_format=fmt,
        lm_head=bool(qc.get("lm_head", False)),
    )


# --- the checkpoint --------------------------------------------------------------------------


def _is_shard_name(name: object) -> bool:
    """A shard named in the index: a relative path that stays inside the model directory."""
    if not isinstance(name, str) or not name:
        return False
    p = PurePath(name)
    return not p.is_absolute() and ".." not in p.parts


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


class HFCheckpoint:
    """A Hugging Face model directory: configs, quantization and the tensors of all shards.

    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelLoadError(f"model directory not found: {self.path}")
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{self.path}: no config.json (not a Hugging Face model directory)")
        self.config = _read_json(config_path)
        qc = self.config.get("quantization_config")
        where = str(config_path)
        if qc is None and (self.path / "quantize_config.json").is_file():
            qc, where = _read_json(self.path / "quantize_config.json"), str(self.path / "quantize_config.json")
        self.quant: GPTQSpec | None = parse_quantization_config(qc, where) if qc is not None else None
        gen = self.path / "generation_config.json"
        self.generation_config = _read_json(gen) if gen.is_file() else {}

        self.weight_map: dict[str, str] = {}
        self.files: dict[str, SafetensorsFile] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelLoadError(f"{index}: no weight_map")
            for f in weight_map.values():
                if not _is_shard_name(f):
                    raise ModelLoadError(f"{index}: weight_map names {f!r:.100}, "
                                         "which is not a file in the model directory")
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise ModelLoadError(f"{self.path}: shard(s) named in {INDEX_FILE} are missing: {', '.join(missing)}")
            for file in sorted(set(weight_map.values())):
                self.files[file] = SafetensorsFile(self.path / file)
            for name, file in weight_map.items():
                if name not in self.files[file].entries:
                    raise ModelLoadError(f"{self.path / file}: tensor {name!r} (listed in {INDEX_FILE}) is missing")
                self.weight_map[name] = file
        else:
            shards = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shards:
                other = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pt"))
                hint = f" (found {', '.join(other)}: only safetensors is supported)" if other else ""
                raise ModelLoadError(f"{self.path}: no *.safetensors weights{hint}")
            for file in shards:
                st = SafetensorsFile(self.path / file)
                self.files[file] = st
                for name in st.entries:
                    self.weight_map.setdefault(name, file)
        self.file_size = sum(f.file_size for f in self.files.values())

    @property
    def names(self) -> set[str]:
        return set(self.weight_map)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        """A zero-copy view of tensor ``name``; KeyError if the checkpoint has none."""
        return self.files[self.weight_map[name]].get(name)


def is_hf_model_dir(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()
