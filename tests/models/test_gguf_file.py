"""The lean GGUF header reader (localllm.models.gguf_file) against gguf.GGUFReader.

Every metadata value and tensor view must match the gguf package's reader; broken files
(truncated anywhere, bad magic/version/alignment, duplicate names) must raise ModelLoadError
and nothing else; the real model's parse must leave (almost) nothing resident behind.
"""

from __future__ import annotations

import ctypes
import gc
import struct
import sys
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from localllm.errors import ModelLoadError
from localllm.models.gguf_file import LAZY_ARRAY_LEN, GGUFArray, read_gguf

# --- helpers --------------------------------------------------------------------------------------


def _plain(value):
    """Lazy arrays as lists, recursively."""
    if isinstance(value, GGUFArray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _flat(value):
    """GGUFReader's contents() flattens nested arrays; do the same to ours."""
    if isinstance(value, list) and any(isinstance(v, list) for v in value):
        return [x for v in value for x in (_flat(v) if isinstance(v, list) else [v])]
    return value


def _memmap_of(arr: np.ndarray) -> np.memmap:
    base = arr
    while base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap), "tensor data is not a view of the file's memmap"
    while isinstance(base.base, np.memmap):  # slices of a memmap are memmaps too
        base = base.base
    return base


def assert_matches_reader(path):
    gf = read_gguf(path)
    ref = gguf.GGUFReader(path)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(gf.metadata) == list(ref_meta)
    for key, value in gf.metadata.items():
        got = _plain(value)
        assert _flat(got) == ref_meta[key], key
        assert type(got) is type(ref_meta[key]), key
        if isinstance(got, list) and got and not isinstance(got[0], list):
            assert [type(v) for v in got] == [type(v) for v in ref_meta[key]], key
    assert gf.file_size == path.stat().st_size

    assert list(gf.tensors) == [t.name for t in ref.tensors]
    maps = set()
    for rt in ref.tensors:
        t = gf.tensors[rt.name]
        assert t.name == rt.name
        assert t.qtype == rt.tensor_type and isinstance(t.qtype, QT)
        assert t.shape == tuple(int(d) for d in reversed(rt.shape.tolist()))
        assert t.data.dtype == rt.data.dtype and t.data.shape == rt.data.shape
        assert t.data.tobytes() == rt.data.tobytes()
        assert not t.data.flags.writeable
        mm = _memmap_of(t.data)
        maps.add(id(mm))
        assert t.data.ctypes.data - mm.ctypes.data == rt.data_offset  # a view of the file, not a copy
    assert len(maps) <= 1  # one mapping of the whole file
    return gf, ref


# A GGUF file written byte by byte (for what GGUFWriter refuses to write).

def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _array(itype: int, items: list[bytes]) -> bytes:
    return struct.pack("<IQ", itype, len(items)) + b"".join(items)


def _tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


def _raw_gguf(kvs: list[bytes], infos: list[bytes] = (), data: bytes = b"", *, version: int = 3,
              alignment: int = 32, magic: bytes = b"GGUF") -> bytes:
    head = magic + struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % alignment) + data


@pytest.fixture
def rich_gguf(tmp_path):
    """Every value type, empty/long/nested arrays, alignment 64, tensors of many types and ranks."""
    path = tmp_path / "rich.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint8("v.u8", 200)
    w.add_int8("v.i8", -100)
    w.add_uint16("v.u16", 60000)
    w.add_int16("v.i16", -30000)
    w.add_uint32("v.u32", 4_000_000_000)
    w.add_int32("v.i32", -2_000_000_000)
    w.add_uint64("v.u64", 2**64 - 1)
    w.add_int64("v.i64", -(2**63))
    w.add_float32("v.f32", 0.1)
    w.add_float64("v.f64", 1e300)
    w.add_bool("v.true", True)
    w.add_bool("v.false", False)
    w.add_string("v.str", "héllo wörld ✓ 日本")
    w.add_key_value("v.empty", "", VT.STRING)  # add_string skips empty strings
    for vt, vals in ((VT.UINT8, [0, 255]), (VT.INT8, [-128, 127]), (VT.UINT16, [1, 65535]),
                     (VT.INT16, [-5, 5]), (VT.UINT32, [7, 2**32 - 1]), (VT.INT32, [-7, 8]),
                     (VT.UINT64, [2**64 - 1]), (VT.INT64, [-(2**63), 3]), (VT.FLOAT32, [0.5, -1.25, 0.1]),
                     (VT.FLOAT64, [0.1, 2.5]), (VT.BOOL, [True, False, True])):
        w.add_key_value(f"a.{vt.name.lower()}", vals, VT.ARRAY, sub_type=vt)
    w.add_array("a.str", ["a", "", "ünï", "x" * 300])
    w.add_array("a.nested", [[1, 2], [3, 4, 5]])
    w.add_array("a.nested_str", [["a", "b"], ["ç"]])
    n = LAZY_ARRAY_LEN + 77
    w.add_array("big.str", [f"tok{i}-é" if i % 3 else "" for i in range(n)])
    w.add_key_value("big.i32", list(range(-(n // 2), n - n // 2)), VT.ARRAY, sub_type=VT.INT32)
    w.add_key_value("big.f32", [i * 0.25 for i in range(n)], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_key_value("big.bool", [i % 2 == 0 for i in range(n)], VT.ARRAY, sub_type=VT.BOOL)

    rng = np.random.default_rng(0)
    w.add_tensor("f32.1d", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("f32.3d", rng.standard_normal((2, 3, 5)).astype(np.float32))
    w.add_tensor("f16.2d", rng.standard_normal((4, 6)).astype(np.float16))
    w.add_tensor("i32.1d", np.arange(-5, 6, dtype=np.int32))

    def raw(name, qtype, shape):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        byte_shape = (*shape[:-1], shape[-1] // block * size)
        w.add_tensor(name, rng.integers(0, 256, byte_shape, dtype=np.uint8), raw_dtype=qtype)

    raw("bf16.2d", QT.BF16, (3, 8))
    raw("q8_0.2d", QT.Q8_0, (4, 64))
    raw("q4_0.3d", QT.Q4_0, (2, 3, 32))
    raw("q4_k.2d", QT.Q4_K, (2, 256))
    raw("q4_k.1d", QT.Q4_K, (256,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- the reference: gguf.GGUFReader -------------------------------------------------------------


def test_real_model_matches_gguf_reader(smollm2_path):
    gf, _ = assert_matches_reader(smollm2_path)
    tokens = gf.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, GGUFArray) and len(tokens) == 49152 and tokens[0] == "<|endoftext|>"
    assert isinstance(gf.metadata["tokenizer.ggml.merges"], GGUFArray)
    assert isinstance(gf.metadata["tokenizer.ggml.token_type"], GGUFArray)


def test_written_file_matches_gguf_reader(rich_gguf):
    gf, _ = assert_matches_reader(rich_gguf)
    meta = gf.metadata
    assert meta["general.alignment"] == 64
    assert meta["v.str"] == "héllo wörld ✓ 日本" and meta["v.empty"] == ""
    assert meta["v.true"] is True and meta["v.false"] is False
    assert meta["a.nested"] == [[1, 2], [3, 4, 5]]  # nested, where GGUFReader flattens
    assert meta["a.nested_str"] == [["a", "b"], ["ç"]]
    assert isinstance(meta["a.str"], list) and isinstance(meta["a.int32"], list)
    for key in ("big.str", "big.i32", "big.f32", "big.bool"):
        assert isinstance(meta[key], GGUFArray), key
    assert {t.data.dtype for t in gf.tensors.values()} == {np.dtype(np.float32), np.dtype(np.float16),
                                                           np.dtype(np.int32), np.dtype(np.uint8)}
    assert gf.tensors["q4_k.2d"].shape == (2, 256) and gf.tensors["q4_k.2d"].data.shape == (2, 144)
    assert gf.tensors["bf16.2d"].data.shape == (3, 16)
    assert all(t.data.ctypes.data % 64 == _memmap_of(t.data).ctypes.data % 64 for t in gf.tensors.values())


def test_hand_written_empty_arrays_match_gguf_reader(tmp_path):
    kvs = [_kv(f"empty.{vt.name.lower()}", VT.ARRAY, _array(vt, [])) for vt in VT]
    kvs.append(_kv("one.str", VT.ARRAY, _array(VT.STRING, [_str("only")])))
    kvs.append(_kv("nested.empty", VT.ARRAY, _array(VT.ARRAY, [_array(VT.INT32, [])])))
    data = np.arange(4, dtype=np.float32).tobytes()
    path = tmp_path / "empty.gguf"
    path.write_bytes(_raw_gguf(kvs, [_tensor_info("t", (4,), QT.F32, 0)], data, version=2))
    gf, _ = assert_matches_reader(path)
    assert all(gf.metadata[f"empty.{vt.name.lower()}"] == [] for vt in VT)
    assert gf.metadata["nested.empty"] == [[]]
    assert gf.tensors["t"].data.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_lazy_arrays_read_like_lists(rich_gguf):
    meta = read_gguf(rich_gguf).metadata
    n = LAZY_ARRAY_LEN + 77
    strs, ints, floats = meta["big.str"], meta["big.i32"], meta["big.f32"]
    expect = [f"tok{i}-é" if i % 3 else "" for i in range(n)]
    assert len(strs) == n and strs[1] == "tok1-é" and strs[0] == "" and strs[-1] == expect[-1]
    assert strs[-n] == expect[0] and strs[5:9] == expect[5:9] and strs[::-500] == expect[::-500]
    assert list(strs) == expect and strs.tolist() == expect and strs == expect and strs == tuple(expect)
    assert strs != expect[:-1] and strs != [*expect[:-1], "x"] and strs != "tok1"
    assert "tok4-é" in strs and strs.index("tok4-é") == 4
    expect_ints = list(range(-(n // 2), n - n // 2))
    assert ints[0] == expect_ints[0] and type(ints[0]) is int and ints[-1] == expect_ints[-1]
    assert ints[2:5] == expect_ints[2:5] and isinstance(ints[2:5], list)
    assert list(ints) == ints.tolist() == expect_ints and ints == expect_ints and ints != expect_ints[::-1]
    assert type(floats[3]) is float and floats[3] == 0.75
    assert meta["big.bool"][0] is True and meta["big.bool"][1] is False
    assert strs == read_gguf(rich_gguf).metadata["big.str"]
    for bad in (n, -n - 1):
        with pytest.raises(IndexError):
            strs[bad]
        with pytest.raises(IndexError):
            ints[bad]
    with pytest.raises(TypeError):
        hash(strs)
    with pytest.raises(TypeError):
        strs[0] = "x"
    assert "len=" in repr(strs)


def test_tensor_data_is_read_only_and_not_copied(rich_gguf):
    gf = read_gguf(rich_gguf)
    for t in gf.tensors.values():
        assert not t.data.flags.writeable
        with pytest.raises(ValueError):
            t.data.reshape(-1)[:1] = 0


def test_many_strings_parse_without_a_python_object_each(tmp_path):
    """A 100k-token vocabulary parses into one array of offsets over the mapped file (0.8 MB),
    not 100k Python strings (6.8 MB): what made big vocabularies slow to load. Measured as
    allocations (``tracemalloc``), not time."""
    import tracemalloc

    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("tokenizer.ggml.tokens", [f"token-{i}" for i in range(100_000)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    read_gguf(path)  # imports and caches warmed outside the measurement
    tracemalloc.start()
    try:
        gf = read_gguf(path)
        _, peak = tracemalloc.get_traced_memory()
        tokens = gf.metadata["tokenizer.ggml.tokens"]
        assert len(tokens) == 100_000 and tokens[-1] == "token-99999"
        before = tracemalloc.get_traced_memory()[0]
        materialized = list(tokens)
        per_string = (tracemalloc.get_traced_memory()[0] - before) / len(materialized)
    finally:
        tracemalloc.stop()
    assert peak < 20 * len(tokens), f"parsing allocated {peak / 1e6:.1f} MB for 100k strings"
    assert peak < 0.25 * per_string * len(tokens)  # a quarter of what Python strings would take


# --- broken files ---------------------------------------------------------------------------------


def test_truncated_files_raise_model_load_error(rich_gguf, tmp_path):
    full = rich_gguf.read_bytes()
    ref = gguf.GGUFReader(rich_gguf)
    data_end = max(t.data_offset + t.n_bytes for t in ref.tensors)
    first_data = min(t.data_offset for t in ref.tensors)
    big = ref.fields["big.str"]
    cuts = {0, 1, 3, 4, 7, 8, 15, 16, 23, 24, 25, first_data - 1, first_data, data_end - 1}
    cuts |= set(range(0, first_data, 11))  # header, key/values, the long string array, tensor infos
    cuts |= set(range(big.offset, big.offset + 200))  # around the long array's start
    cuts |= set(range(first_data, data_end, 37))  # tensor data
    path = tmp_path / "cut.gguf"
    for cut in sorted(c for c in cuts if 0 <= c < data_end):
        path.write_bytes(full[:cut])
        with pytest.raises(ModelLoadError) as info:
            read_gguf(path)
        assert str(path) in str(info.value), cut
    path.write_bytes(full[: data_end - 1])
    with pytest.raises(ModelLoadError, match=r"truncated file: tensor .* needs bytes up to .* but the file has"):
        read_gguf(path)


def test_missing_file_and_bad_magic(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        read_gguf(tmp_path / "nope.gguf")
    for content in (b"", b"GG", b"GGML" + b"\0" * 100, _raw_gguf([], magic=b"FUGG")):
        path = tmp_path / "bad.gguf"
        path.write_bytes(content)
        with pytest.raises(ModelLoadError, match="not a GGUF file"):
            read_gguf(path)


@pytest.mark.parametrize("version", [0, 1, 4, 99])
def test_unsupported_version(tmp_path, version):
    path = tmp_path / "v.gguf"
    path.write_bytes(_raw_gguf([_kv("a", VT.UINT8, b"\x01")], version=version))
    with pytest.raises(ModelLoadError, match=f"unsupported GGUF version {version}"):
        read_gguf(path)


def test_big_endian_file_is_refused(tmp_path):
    path = tmp_path / "be.gguf"
    path.write_bytes(b"GGUF" + struct.pack(">IQQ", 3, 0, 0))
    with pytest.raises(ModelLoadError, match="big-endian"):
        read_gguf(path)


@pytest.mark.parametrize("vtype,payload", [(VT.UINT32, struct.pack("<I", 0)), (VT.UINT32, struct.pack("<I", 48)),
                                           (VT.UINT64, struct.pack("<Q", 64)), (VT.INT32, struct.pack("<i", -32))])
def test_bad_alignment(tmp_path, vtype, payload):
    path = tmp_path / "align.gguf"
    path.write_bytes(_raw_gguf([_kv("general.alignment", vtype, payload)]))
    with pytest.raises(ModelLoadError, match="general.alignment"):
        read_gguf(path)


def test_duplicate_names(tmp_path):
    data = np.zeros(8, np.float32).tobytes()
    path = tmp_path / "dup.gguf"
    infos = [_tensor_info("w", (4,), QT.F32, 0), _tensor_info("w", (4,), QT.F32, 16)]
    path.write_bytes(_raw_gguf([], infos, data))
    with pytest.raises(ModelLoadError, match="duplicate tensor name 'w'"):
        read_gguf(path)
    path.write_bytes(_raw_gguf([_kv("k", VT.UINT8, b"\x01"), _kv("k", VT.UINT8, b"\x02")]))
    with pytest.raises(ModelLoadError, match="duplicate GGUF metadata key 'k'"):
        read_gguf(path)


@pytest.mark.parametrize("kvs,infos,data,match", [
    ([_kv("k", 13, b"\0" * 8)], [], b"", "unknown GGUF value type 13"),
    ([_kv("k", VT.ARRAY, struct.pack("<IQ", 77, 1) + b"\0" * 8)], [], b"", "unknown GGUF array item type 77"),
    ([], [_tensor_info("t", (4,), 250, 0)], b"\0" * 16, "unknown type 250"),
    ([], [_tensor_info("t", (33,), QT.Q8_0, 0)], b"\0" * 64, "block size"),
    ([_kv("k", VT.STRING, struct.pack("<Q", 2**63) + b"abc")], [], b"", "truncated"),
    ([_kv("k", VT.STRING, struct.pack("<Q", 2**64 - 1) + b"abc")], [], b"", "truncated"),
    ([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2**62))], [], b"", "truncated"),
    ([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.UINT64, 2**61))], [], b"", "truncated"),
    ([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, LAZY_ARRAY_LEN + 1) + _str("a") * LAZY_ARRAY_LEN
          + struct.pack("<Q", 2**64 - 9))], [], b"", "truncated"),
    ([_kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) * 40 + struct.pack("<IQ", VT.INT32, 0))], [], b"", "nested"),
    ([], [_tensor_info("t", (2**40, 2**40), QT.F32, 0)], b"", "truncated file: tensor 't'"),
])
def test_corrupt_headers(tmp_path, kvs, infos, data, match):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(_raw_gguf(kvs, infos, data))
    with pytest.raises(ModelLoadError, match=match):
        read_gguf(path)


def test_key_that_is_not_utf8(tmp_path):
    path = tmp_path / "key.gguf"
    path.write_bytes(_raw_gguf([_str(b"k\xff") + struct.pack("<I", VT.UINT8) + b"\x01"]))
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        read_gguf(path)


# --- memory ---------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm, trims glibc's heap")
def test_parsing_the_real_model_leaves_little_resident(smollm2_path):
    import localllm.platform.memory  # noqa: F401 - imported by the reader; not part of what it leaves

    libc = ctypes.CDLL("libc.so.6")
    read_gguf(smollm2_path)  # warm up
    gc.collect()
    libc.malloc_trim(0)
    before = _rss_bytes()
    tracemalloc.start()
    gf = read_gguf(smollm2_path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    gc.collect()
    libc.malloc_trim(0)
    growth = _rss_bytes() - before
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == 49152  # the vocabulary is kept (lazily)
    # GGUFReader peaked at ~158 MiB of Python heap and left ~15 MiB resident
    assert peak < 8 * 2**20, f"parsing peaked at {peak / 2**20:.1f} MiB of Python heap"
    assert growth < 6 * 2**20, f"parsing left {growth / 2**20:.1f} MiB resident"
