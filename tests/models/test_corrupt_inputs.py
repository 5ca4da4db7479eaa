"""Corrupt and hostile model files at load: one ModelLoadError line naming the file, nothing else.

Hand-made broken GGUF and safetensors files for each check of the readers (header limits,
tensor entries, dims, alignment, counts), then a fuzz test that flips, overwrites and cuts
bytes of small valid files: opening (and reading every tensor of) the result either works or
raises ModelLoadError, never an IndexError, TypeError, MemoryError or a crash.
"""

from __future__ import annotations

import itertools
import json
import struct
import tracemalloc
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localllm.errors import ModelLoadError
from localllm.models import gguf_file
from localllm.models.gguf_file import GGUFArray, read_gguf
from localllm.models.safetensors import MAX_HEADER_SIZE, HFCheckpoint, SafetensorsFile


def _fails(fn, path, match: str) -> str:
    """``fn(path)`` raises ModelLoadError matching ``match``; one line that names the file."""
    with pytest.raises(ModelLoadError, match=match) as info:
        fn(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message, message
    return message


# --- GGUF, written byte by byte ------------------------------------------------------------------


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _tensor_info(name: str, dims: tuple[int, ...], qtype: int, offset: int = 0) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, qtype, offset)


def _gguf(kvs=(), infos=(), data: bytes = b"", *, n_kv: int | None = None, n_tensors: int | None = None,
          alignment: int = 32) -> bytes:
    n_tensors = len(infos) if n_tensors is None else n_tensors
    counts = struct.pack("<QQ", n_tensors, len(kvs) if n_kv is None else n_kv)
    head = b"GGUF" + struct.pack("<I", 3) + counts + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (-len(head) % alignment) + data


def _write(tmp_path, content: bytes, name: str = "bad.gguf"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("n_dims", [5, 64, 2**32 - 1])
def test_gguf_too_many_dims(tmp_path, n_dims):
    info = _str("t") + struct.pack("<I", n_dims) + b"\1\0\0\0\0\0\0\0" * 5 + struct.pack("<IQ", QT.F32, 0)
    path = _write(tmp_path, _gguf(infos=[info]))
    _fails(read_gguf, path, rf"tensor 't' has {n_dims:,} dimensions \(GGUF allows at most 4\)")


@pytest.mark.parametrize("dims", [(2**64 - 1,), (4, 2**63), (2**63, 0)])
def test_gguf_dim_negative_in_ggml(tmp_path, dims):
    path = _write(tmp_path, _gguf(infos=[_tensor_info("t", dims, QT.F32)]))
    _fails(read_gguf, path, r"tensor 't' has a dimension over 2\*\*63")


@pytest.mark.parametrize("dims,qtype", [
    ((2**62, 2**62, 2**62, 2**62), QT.F32),  # 2**248 elements
    ((2**63 - 1, 2), QT.F32),
    ((2**63 - 32, 1), QT.Q8_0),
    ((32, 2**40), QT.F16),
])
def test_gguf_element_count_beyond_the_file(tmp_path, dims, qtype):
    path = _write(tmp_path, _gguf(infos=[_tensor_info("t", dims, qtype)], data=b"\0" * 64))
    _fails(read_gguf, path, r"truncated file: tensor 't' needs bytes up to .* but the file has")


def test_gguf_empty_and_rank_4_tensors_load(tmp_path):
    data = np.arange(16, dtype=np.float32).tobytes()
    infos = [_tensor_info("empty", (0, 4), QT.F32, 0), _tensor_info("r4", (2, 2, 2, 2), QT.F32, 0)]
    gf = read_gguf(_write(tmp_path, _gguf(infos=infos, data=data)))
    assert gf.tensors["empty"].shape == (4, 0) and gf.tensors["empty"].data.size == 0
    assert gf.tensors["r4"].shape == (2, 2, 2, 2) and gf.tensors["r4"].data.sum() == 120


@pytest.mark.parametrize("alignment", [2**22, 2**31])
def test_gguf_alignment_over_the_cap(tmp_path, alignment):
    path = _write(tmp_path, _gguf([_kv("general.alignment", VT.UINT32, struct.pack("<I", alignment))]))
    _fails(read_gguf, path, r"invalid general.alignment .* at most 2,097,152")


@pytest.mark.parametrize("alignment", [1, 4096, gguf_file.MAX_ALIGNMENT])
def test_gguf_alignment_within_the_cap(tmp_path, alignment):
    kvs = [_kv("general.alignment", VT.UINT32, struct.pack("<I", alignment))]
    data = np.arange(4, dtype=np.float32).tobytes()
    gf = read_gguf(_write(tmp_path, _gguf(kvs, [_tensor_info("t", (4,), QT.F32)], data, alignment=alignment)))
    assert gf.metadata["general.alignment"] == alignment and gf.tensors["t"].data.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("n_kv,n_tensors", [(2**64 - 1, 0), (0, 2**64 - 1), (1000, 0), (0, 100),
                                            (2**40, 2**40)])
def test_gguf_counts_beyond_the_file(tmp_path, n_kv, n_tensors):
    content = _gguf([_kv("a", VT.UINT8, b"\1")], [_tensor_info("t", (1,), QT.F32)], b"\0" * 32,
                    n_kv=n_kv, n_tensors=n_tensors)
    _fails(read_gguf, _write(tmp_path, content),
           rf"GGUF header corrupt: it claims {n_kv:,} metadata key/values and {n_tensors:,} tensors, "
           "more than the [0-9,]+ bytes after it can hold")


@pytest.mark.parametrize("payload", [
    _kv("k", VT.STRING, struct.pack("<Q", 2**40) + b"abc"),  # a string longer than the file
    _kv("k", VT.ARRAY, struct.pack("<IQ", VT.UINT8, 2**40)),  # an array longer than the file
    _kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2**40)),
    _kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 2**40)),
    _kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1) + struct.pack("<IQ", VT.FLOAT64, 2**60)),
    b"\xff" * 8 + b"\0" * 8,  # a key length of 2**64 - 1
])
def test_gguf_lengths_beyond_the_file_allocate_nothing(tmp_path, payload):
    path = _write(tmp_path, _gguf([payload], data=b"\0" * 64))
    tracemalloc.start()
    try:
        _fails(read_gguf, path, "truncated")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"a hostile length made the reader allocate {peak / 2**20:.1f} MiB"


# --- safetensors ---------------------------------------------------------------------------------


def _safetensors(header: dict | bytes, data: bytes = b"", *, header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def _open_st(path):
    return SafetensorsFile(path)


def _st_path(tmp_path, content: bytes):
    return _write(tmp_path, content, "model.safetensors")


W = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize("header_len", [MAX_HEADER_SIZE + 1, 2**40, 2**64 - 1])
def test_st_header_length_over_the_limit(tmp_path, header_len):
    path = _st_path(tmp_path, _safetensors({"w": W}, b"\0" * 8, header_len=header_len))
    _fails(_open_st, path, "header length .* is over the 100,000,000-byte limit")


def test_st_header_longer_than_the_file(tmp_path):
    path = _st_path(tmp_path, _safetensors({"w": W}, header_len=10_000))
    _fails(_open_st, path, r"truncated or not a safetensors file \(header length 10000\)")
    _fails(_open_st, _st_path(tmp_path, b"\1\0\0"), "shorter than its header")


@pytest.mark.parametrize("raw", [
    b'{"w\xff": 1}',
    b'{"w": "\xc3"}',
    json.dumps({"w": W}).encode("utf-16"),  # json.loads(bytes) would take it; the format is UTF-8
])
def test_st_header_not_utf8(tmp_path, raw):
    _fails(_open_st, _st_path(tmp_path, _safetensors(raw, b"\0" * 8)), "safetensors header is not UTF-8")


@pytest.mark.parametrize("raw", [b"", b"{", b'{"w": }', b"\xef\xbb\xbf{}", b"[" * 200_000 + b"]" * 200_000,
                                 b'{"w": ' + b"9" * 5000 + b"}"])
def test_st_header_not_json(tmp_path, raw):
    _fails(_open_st, _st_path(tmp_path, _safetensors(raw, b"\0" * 8)), "safetensors header is not valid JSON")


@pytest.mark.parametrize("raw", [b"[]", b"null", b'"w"', b"8"])
def test_st_header_not_an_object(tmp_path, raw):
    _fails(_open_st, _st_path(tmp_path, _safetensors(raw)), "safetensors header is not a JSON object")


def test_st_duplicate_keys(tmp_path):
    entry = json.dumps(W)
    raw = f'{{"w": {entry}, "v": {entry}, "w": {entry}}}'.encode()
    path = _st_path(tmp_path, _safetensors(raw, b"\0" * 8))
    _fails(_open_st, path, "safetensors header has the key 'w' twice")
    raw = b'{"w": {"dtype": "F32", "dtype": "F16", "shape": [2], "data_offsets": [0, 8]}}'
    _fails(_open_st, _st_path(tmp_path, _safetensors(raw, b"\0" * 8)), "has the key 'dtype' twice")


@pytest.mark.parametrize("metadata", [[], "x", 3, {"format": 1}, {"a": None}, {"a": ["b"]}])
def test_st_metadata_not_strings(tmp_path, metadata):
    path = _st_path(tmp_path, _safetensors({"__metadata__": metadata, "w": W}, b"\0" * 8))
    _fails(_open_st, path, "__metadata__ is not a map of strings to strings")


def _entry(**changes):
    return {k: v for k, v in {**W, **changes}.items() if v is not ...}


@pytest.mark.parametrize("entry,match", [
    ("F32", "tensor 'w': header entry is not an object"),
    ([W], "tensor 'w': header entry is not an object"),
    (_entry(dtype=...), "tensor 'w' has dtype None, which localllm does not read"),
    (_entry(dtype="F8_E4M3"), "tensor 'w' has dtype 'F8_E4M3', which localllm does not read"),
    (_entry(dtype=["F32"]), r"tensor 'w' has dtype \['F32'\]"),
    (_entry(dtype={"F32": 1}), "tensor 'w' has dtype"),
    (_entry(shape=...), "tensor 'w': shape None is not a list of non-negative int64 sizes"),
    (_entry(shape="2"), "shape '2' is not a list"),
    (_entry(shape=[2.0]), r"shape \[2.0\] is not a list"),
    (_entry(shape=[-1]), r"shape \[-1\] is not a list"),
    (_entry(shape=[True, 2]), r"shape \[True, 2\] is not a list"),
    (_entry(shape=[2**63]), "is not a list of non-negative int64 sizes"),
    (_entry(shape=[None]), "is not a list of non-negative int64 sizes"),
    (_entry(shape=[1] * 65), r"tensor 'w': shape has 65 dimensions \(at most 64\)"),
    (_entry(data_offsets=...), "tensor 'w': data_offsets None is not a list of two offsets"),
    (_entry(data_offsets="ab"), "data_offsets 'ab' is not a list of two offsets"),
    (_entry(data_offsets=[0]), "data_offsets"),
    (_entry(data_offsets=[0, 8, 16]), "data_offsets"),
    (_entry(data_offsets=[0, 8.0]), r"data_offsets \[0, 8.0\] is not a list of two offsets"),
    (_entry(data_offsets=[False, 8]), "data_offsets"),
    (_entry(data_offsets=[-8, 0]), "data_offsets"),
    (_entry(data_offsets=[0, 2**64]), "data_offsets"),
    (_entry(data_offsets=[8, 0]), r"data_offsets \[8, 0\] end before they begin"),
    (_entry(data_offsets=[0, 4]), r"tensor 'w' of shape \(2,\) F32 needs 8 bytes, its data_offsets span 4"),
    (_entry(shape=[2, 0]), "needs 0 bytes, its data_offsets span 8"),
    (_entry(shape=[2**62] * 4), "needs over 2\\*\\*63 bytes"),
    (_entry(data_offsets=[8, 16]), "truncated file: tensor 'w' needs [0-9,]+ bytes, the file has"),
])
def test_st_bad_tensor_entries(tmp_path, entry, match):
    _fails(_open_st, _st_path(tmp_path, _safetensors({"w": entry}, b"\0" * 8)), match)


def test_st_overlapping_tensors(tmp_path):
    header = {"a": W, "b": {**W, "data_offsets": [4, 12]}}
    path = _st_path(tmp_path, _safetensors(header, b"\0" * 12))
    _fails(_open_st, path, "tensors 'a' and 'b' overlap in the file")
    header = {"a": {**W, "shape": [4], "data_offsets": [0, 16]}, "b": {**W, "data_offsets": [16, 24]},
              "c": {**W, "data_offsets": [4, 12]}}
    _fails(_open_st, _st_path(tmp_path, _safetensors(header, b"\0" * 24)), "tensors 'a' and 'c' overlap")


def test_st_edge_cases_that_load(tmp_path):
    """Empty tensors anywhere, gaps, trailing bytes and unaligned data are fine."""
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
        "e1": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
        "e2": {"dtype": "BF16", "shape": [0, 2**62], "data_offsets": [4, 4]},
        "s": {"dtype": "I64", "shape": [], "data_offsets": [16, 24]},
    }
    data = b"\0" + np.array([1.5, -2.0], np.float32).tobytes() + b"\0" * 7 + struct.pack("<q", -7) + b"junk"
    f = _open_st(_st_path(tmp_path, _safetensors(header, data)))
    assert f.metadata == {"format": "pt"}
    assert f.get("a").tolist() == [1.5, -2.0]
    assert f.get("e1").shape == (0,) and f.get("e2").shape == (0, 2**62)
    assert f.get("e2").dtype == torch.bfloat16
    assert f.get("s").item() == -7
    _open_st(_st_path(tmp_path, _safetensors({"__metadata__": None})))  # no tensors at all


@pytest.mark.parametrize("shard", ["../model.safetensors", "/etc/model.safetensors", "", 3, None, ["a"]])
def test_index_names_a_file_outside_the_directory(tmp_path, shard):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    _write(tmp_path, _safetensors({"w": W}, b"\0" * 8), "model.safetensors")
    _fails(HFCheckpoint, model, "weight_map names .*, which is not a file in the model directory")


# --- fuzz: flip, overwrite and cut bytes of small valid files -----------------------------------

_SPECIAL = [b"\xff" * 8, b"\0" * 8, struct.pack("<Q", 2**63), struct.pack("<Q", 2**32), b"\x05\0\0\0",
            b"[", b"{", b"-", b"1e999", b"99999999999", b"\xc3", b'"']


@st.composite
def _damage(draw, size: int) -> list:
    """Up to 6 edits (a random byte or a nasty value at a random offset), then maybe a cut."""
    edits = draw(st.lists(st.tuples(st.integers(0, size - 1),
                                    st.one_of(st.binary(min_size=1, max_size=1), st.sampled_from(_SPECIAL))),
                          min_size=0, max_size=6))
    cut = draw(st.one_of(st.none(), st.integers(0, size - 1)))
    return [edits, cut]


def _apply(data: bytes, damage: list) -> bytes:
    edits, cut = damage
    buf = bytearray(data)
    for pos, value in edits:
        buf[pos:pos + len(value)] = value[: len(buf) - pos]
    return bytes(buf if cut is None else buf[:cut])


def _small_gguf(path) -> bytes:
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "cd", "é", "", "<s>"])  # lazy (LAZY_ARRAY_LEN patched)
    w.add_array("tokenizer.ggml.scores", [0.5, 1.0, -1.0, 2.0, 0.0, 3.0])
    w.add_array("short", [1, 2])
    w.add_array("nested", [[1, 2], ["x"]])
    w.add_tensor("f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("f16", np.ones(4, dtype=np.float16))
    w.add_tensor("q8", np.zeros((1, 34), dtype=np.uint8), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _small_safetensors(path) -> bytes:
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16),
               "c": torch.tensor([1, -2]), "d": torch.zeros(0, 4)}
    save_file(tensors, str(path), {"format": "pt"})
    return path.read_bytes()


def _read_all_gguf(path) -> None:
    gf = read_gguf(path)
    for value in gf.metadata.values():
        if isinstance(value, GGUFArray):
            value.tolist()
    for t in gf.tensors.values():
        t.data.tobytes()


def _read_all_safetensors(path) -> None:
    f = SafetensorsFile(path)
    for name in f.entries:
        f.get(name).sum()


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


_FUZZ = settings(max_examples=60, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
_counter = itertools.count()


def _fuzz_one(fuzz_dir, base: bytes, suffix: str, damage: list, read) -> None:
    path = fuzz_dir / f"{next(_counter)}{suffix}"  # a fresh file: an old mapping never sees a new size
    path.write_bytes(_apply(base, damage))
    try:
        read(path)
    except ModelLoadError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc), str(exc)


@pytest.fixture(scope="module")
def gguf_base(fuzz_dir):
    return _small_gguf(fuzz_dir / "base.gguf")


@pytest.fixture(scope="module")
def safetensors_base(fuzz_dir):
    return _small_safetensors(fuzz_dir / "base.safetensors")


def test_fuzz_bases_are_valid(fuzz_dir, gguf_base, safetensors_base):
    with mock.patch.object(gguf_file, "LAZY_ARRAY_LEN", 4):
        gf = read_gguf(fuzz_dir / "base.gguf")
    assert isinstance(gf.metadata["tokenizer.ggml.tokens"], GGUFArray) and len(gf.tensors) == 3
    assert len(SafetensorsFile(fuzz_dir / "base.safetensors").entries) == 4


@_FUZZ
@given(data=st.data())
def test_fuzz_gguf(fuzz_dir, gguf_base, data):
    damage = data.draw(_damage(len(gguf_base)))
    with mock.patch.object(gguf_file, "LAZY_ARRAY_LEN", 4):  # the short arrays take the lazy path too
        _fuzz_one(fuzz_dir, gguf_base, ".gguf", damage, _read_all_gguf)


@_FUZZ
@given(data=st.data())
def test_fuzz_safetensors(fuzz_dir, safetensors_base, data):
    damage = data.draw(_damage(len(safetensors_base)))
    _fuzz_one(fuzz_dir, safetensors_base, ".safetensors", damage, _read_all_safetensors)
