"""Open a GGUF file (memory-mapped) and check it before any tensor is used.

The header is walked with ``struct`` over one read-only memory map of the whole file, so
parsing leaves a few hundred Python objects behind rather than one per vocabulary entry:
long metadata arrays (the vocabulary, merges, scores) stay in the file as :class:`GGUFArray`
and tensor data are views of the same map. Layout (little-endian): magic ``GGUF``, version
(2 or 3), tensor count and key/value count (uint64 each), the key/values, the tensor infos,
padding to ``general.alignment`` (default 32), then the tensor data.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType, LlamaFileType
from gguf.quants import quant_shape_to_byte_shape

from localllm.errors import ModelLoadError

LAZY_ARRAY_LEN = 1024  # metadata arrays longer than this stay in the file (GGUFArray)
_MAX_ARRAY_DEPTH = 16
GGML_MAX_DIMS = 4  # ggml.h; gguf.cpp refuses a tensor info with more dims
_MAX_DIM = 2**63 - 1  # ggml keeps dims as int64; a larger uint64 is a negative dim there
# general.alignment: writers use 32 (the default) or a few KiB at most. Alignment is for SIMD
# loads and page-aligned mappings, and no page is larger than a 2 MiB huge page, so a larger
# value buys nothing and is taken for corruption (it would also push the data start past
# the end of any file with a small header).
MAX_ALIGNMENT = 2**21
# The fewest bytes a key/value (key length, value type, a one-byte value) and a tensor info
# (name length, n_dims, type, offset) take: a header that claims more of them than its bytes
# can hold is refused before the walk, not after millions of Python objects.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, key/value count

# scalar value type -> (struct reader, numpy dtype); the file is little-endian
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    int(vt): (struct.Struct("<" + fmt), np.dtype("<" + dt))
    for vt, fmt, dt in (
        (GGUFValueType.UINT8, "B", "u1"), (GGUFValueType.INT8, "b", "i1"),
        (GGUFValueType.UINT16, "H", "u2"), (GGUFValueType.INT16, "h", "i2"),
        (GGUFValueType.UINT32, "I", "u4"), (GGUFValueType.INT32, "i", "i4"),
        (GGUFValueType.UINT64, "Q", "u8"), (GGUFValueType.INT64, "q", "i8"),
        (GGUFValueType.FLOAT32, "f", "f4"), (GGUFValueType.FLOAT64, "d", "f8"),
        (GGUFValueType.BOOL, "?", "?"),
    )
}
_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)

# tensor types GGUFReader exposes with their own dtype; every other type is raw bytes (uint8)
_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"), GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"), GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}


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

    @property
    def file_type(self) -> str | None:
        """The file's type as llama.cpp names it (``general.file_type``: ``Q4_K_M``, ``F16``, ...);
        the number where gguf-py knows no name for it, ``None`` where the file says none."""
        value = self.metadata.get("general.file_type")
        if value is None:
            return None
        try:
            return LlamaFileType(int(value)).name.removeprefix("MOSTLY_")
        except (TypeError, ValueError):
            return str(value)


class GGUFArray(Sequence):
    """A long GGUF metadata array, read from the mapped file on access (read-only).

    Numbers are a numpy view of the file; strings are decoded item by item from an offsets
    array (``offsets[i]`` is the offset of string i's length prefix, ``offsets[-1]`` the end).
    Indexing gives Python values like ``GGUFReader``'s ``contents()``; a slice gives a list.
    """

    __slots__ = ("_buf", "_offsets", "_values")

    def __init__(self, values: np.ndarray | None = None, *, buf: memoryview | None = None,
                 offsets: np.ndarray | None = None) -> None:
        self._values, self._buf, self._offsets = values, buf, offsets

    def __len__(self) -> int:
        return len(self._values) if self._values is not None else len(self._offsets) - 1

    def _string(self, i: int) -> str:
        return str(self._buf[int(self._offsets[i]) + 8:int(self._offsets[i + 1])], "utf-8", "replace")

    def __getitem__(self, key):
        if isinstance(key, slice):
            if self._values is not None:
                return self._values[key].tolist()
            return [self._string(i) for i in range(*key.indices(len(self)))]
        i = key.__index__()
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("GGUFArray index out of range")
        return self._values[i].item() if self._values is not None else self._string(i)

    def __iter__(self) -> Iterator:
        if self._values is not None:
            for start in range(0, len(self._values), 4096):
                yield from self._values[start:start + 4096].tolist()
        else:
            for i in range(len(self)):
                yield self._string(i)

    def tolist(self) -> list:
        if self._values is not None:
            return self._values.tolist()
        buf, offsets = self._buf, self._offsets.tolist()
        return [str(buf[a + 8:b], "utf-8", "replace") for a, b in itertools.pairwise(offsets)]

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes, bytearray)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        head = ", ".join(repr(v) for v in self[:3])
        return f"GGUFArray(len={len(self)}, [{head}, ...])"


class _Header:
    """One pass over the header bytes; ``pos`` is the read offset into the file."""

    def __init__(self, mm: np.memmap, path: Path) -> None:
        self.mm, self.buf, self.size, self.path, self.pos = mm, memoryview(mm), len(mm), path, 0

    def need(self, nbytes: int) -> None:
        if self.pos + nbytes > self.size:
            raise ModelLoadError(f"{self.path}: GGUF header truncated or corrupt: it needs bytes up to "
                                 f"{self.pos + nbytes:,} but the file has {self.size:,}")

    def scalar(self, reader: struct.Struct):
        self.need(reader.size)
        value = reader.unpack_from(self.buf, self.pos)[0]
        self.pos += reader.size
        return value

    def raw_string(self) -> memoryview:
        n = self.scalar(_U64)
        self.need(n)
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def name(self, what: str) -> str:
        raw = self.raw_string()
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{self.path}: a {what} name is not UTF-8 ({bytes(raw[:40])!r})") from exc

    def value(self, vtype: int, depth: int = 0):
        if vtype == _STRING:
            return str(self.raw_string(), "utf-8", "replace")
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return self.scalar(scalar[0])
        if vtype != _ARRAY:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype} at offset {self.pos - 4:,}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise ModelLoadError(f"{self.path}: GGUF arrays nested deeper than {_MAX_ARRAY_DEPTH}")
        itype, n = self.scalar(_U32), self.scalar(_U64)
        if itype == _STRING:
            self.need(8 * n)  # every string has at least its length
            return self.lazy_strings(n) if n > LAZY_ARRAY_LEN else [self.value(_STRING) for _ in range(n)]
        scalar = _SCALARS.get(itype)
        if scalar is not None:
            dtype = scalar[1]
            self.need(dtype.itemsize * n)
            values = np.frombuffer(self.mm, dtype=dtype, count=n, offset=self.pos)
            self.pos += values.nbytes
            return GGUFArray(values) if n > LAZY_ARRAY_LEN else values.tolist()
        if itype == _ARRAY:
            self.need(12 * n)  # every array has at least its type and length
            return [self.value(_ARRAY, depth + 1) for _ in range(n)]
        raise ModelLoadError(f"{self.path}: unknown GGUF array item type {itype} at offset {self.pos - 12:,}")

    def lazy_strings(self, n: int) -> GGUFArray:
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        offsets = np.empty(n + 1, dtype=np.int64)
        try:
            for i in range(n):
                offsets[i] = pos
                pos += 8 + unpack(buf, pos)[0]
        except (struct.error, OverflowError):  # a length prefix past the end, or a length past any file
            pos = -1
        if not 0 <= pos <= self.size:
            raise ModelLoadError(f"{self.path}: GGUF header truncated or corrupt: the string array at offset "
                                 f"{self.pos:,} runs past the end of the file ({self.size:,} bytes)")
        offsets[n] = self.pos = pos
        return GGUFArray(buf=buf, offsets=offsets)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read metadata and tensor views of a GGUF file without copying tensor data.

    Raises ModelLoadError with a readable message for a missing, truncated or corrupt file.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (magic {magic!r})")
        mm = np.memmap(path, mode="r")
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot open GGUF file ({exc})") from exc
    try:
        return _parse(path, mm)
    except ModelLoadError:
        raise
    except (struct.error, ValueError, OverflowError, IndexError, MemoryError) as exc:
        raise ModelLoadError(f"{path}: cannot read GGUF file, it is truncated or corrupt ({exc})") from exc


def _parse(path: Path, mm: np.memmap) -> GGUFFile:
    h = _Header(mm, path)
    h.need(_HEADER.size)
    _, version, n_tensors, n_kv = _HEADER.unpack_from(h.buf, 0)
    h.pos = _HEADER.size
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version:
            raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")

    room = h.size - h.pos
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > room:
        raise ModelLoadError(f"{path}: GGUF header corrupt: it claims {n_kv:,} metadata key/values and "
                             f"{n_tensors:,} tensors, more than the {room:,} bytes after it can hold")

    metadata: dict = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key = h.name("metadata key")
        vtype = h.scalar(_U32)
        if key in metadata:
            raise ModelLoadError(f"{path}: duplicate GGUF metadata key {key!r}")
        metadata[key] = h.value(vtype)
        if key == "general.alignment":
            alignment = metadata[key]
            if (vtype != GGUFValueType.UINT32 or alignment == 0 or alignment & (alignment - 1)
                    or alignment > MAX_ALIGNMENT):
                raise ModelLoadError(f"{path}: invalid general.alignment {alignment!r:.40} "
                                     f"(must be a uint32 power of two, at most {MAX_ALIGNMENT:,})")

    infos = []
    for _ in range(n_tensors):
        name = h.name("tensor")
        n_dims = h.scalar(_U32)
        if n_dims > GGML_MAX_DIMS:
            raise ModelLoadError(f"{path}: tensor {name!r:.100} has {n_dims:,} dimensions "
                                 f"(GGUF allows at most {GGML_MAX_DIMS})")
        h.need(8 * n_dims)
        dims = struct.unpack_from(f"<{n_dims}Q", h.buf, h.pos)
        h.pos += 8 * n_dims
        if any(d > _MAX_DIM for d in dims):
            raise ModelLoadError(f"{path}: tensor {name!r:.100} has a dimension over 2**63 "
                                 f"(negative in ggml): {list(dims)}")
        infos.append((name, dims, h.scalar(_U32), h.scalar(_U64)))
    data_start = -(-h.pos // alignment) * alignment

    tensors: dict[str, GGUFTensor] = {}
    for name, dims, raw_type, offset in infos:
        if name in tensors:
            raise ModelLoadError(f"{path}: duplicate tensor name {name!r}")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name!r} has unknown type {raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(reversed(dims))  # GGUF lists the fastest dim first
        # Python ints: no overflow; an element count too large for int64 needs more bytes than
        # any file has, so the size check below refuses it (gguf.cpp checks for overflow instead).
        nbytes = math.prod(dims) * type_size // block
        start = data_start + offset
        if start + nbytes > h.size:
            raise ModelLoadError(f"{path}: truncated file: tensor {name!r} needs bytes up to "
                                 f"{start + nbytes:,} but the file has {h.size:,}")
        dtype = _TENSOR_DTYPES.get(qtype)
        try:
            view_shape = shape if dtype is not None else quant_shape_to_byte_shape(shape, qtype)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: tensor {name!r}: {exc}") from None
        data = mm[start:start + nbytes]
        if dtype is not None:
            data = data.view(dtype)
        tensors[name] = GGUFTensor(name=name, qtype=qtype, shape=shape, data=data.reshape(view_shape))

    first = min((data_start + offset for *_, offset in infos), default=0)
    _release_header_pages(mm, min(first, h.size))
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, file_size=h.size)


def _release_header_pages(mm: np.memmap, end: int) -> None:
    """The header (metadata, vocabulary: ~6 MiB for a 49k-token model) has been walked by now;
    drop its mapped pages from the resident set (they fault back in if a long array is read)."""
    from localllm.platform.memory import release_file_range

    if end > 0:
        release_file_range(mm.ctypes.data, end)
