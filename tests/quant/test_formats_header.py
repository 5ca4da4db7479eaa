"""The native CPU formats have one home, localllm/quant/traits.py (CPU_FORMATS): the C++ kernels read
each format's id and geometry from csrc/formats.h, which ``python -m localllm.quant.cpu_header``
writes from that table, and the Python packers from the table itself."""

from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES

from localllm.quant import cpu_header
from localllm.quant.traits import CPU_FORMATS, CPU_GROUP, CPU_TILE, PLANE_BITS, TRAITS


def test_the_checked_in_header_is_the_tables():
    assert cpu_header.HEADER.read_text() == cpu_header.render(), f"run `{cpu_header.COMMAND}`"


def test_the_check_fails_on_a_header_that_is_not_the_tables(tmp_path):
    header = tmp_path / "formats.h"
    header.write_text(cpu_header.render().replace("kFmtQ4_0 = 40;", "kFmtQ4_0 = 41;"))
    assert cpu_header.main(["--check", "--out", str(header)]) == 1
    assert cpu_header.main(["--out", str(header)]) == 0
    assert cpu_header.main(["--check", "--out", str(header)]) == 0


def test_each_format_has_one_id_and_name_and_whole_planes():
    assert len({f.id for f in CPU_FORMATS}) == len({f.name for f in CPU_FORMATS}) == len(CPU_FORMATS)
    for f in CPU_FORMATS:
        assert all(p in PLANE_BITS for p in f.planes), f.name
        assert (f.layout == "float") == (not f.planes and not f.group_bytes), f.name
        assert not (f.planes and f.group_bytes), f.name  # code planes, or a lattice format's group bytes
        code_bytes = CPU_TILE * (f.group_bytes or CPU_GROUP * f.code_bits // 8)
        assert f.super_block % CPU_GROUP == 0 and f.code_bytes == code_bytes, f.name
        assert f"constexpr int kFmt{f.name} = {f.id};" in cpu_header.render()


def test_the_file_formats_hold_the_files_bytes():
    """A ``format`` layout keeps the file's codes and scales: at its bytes (Q3_K: its sub-scales a byte
    each) and with the file's super-block."""
    for qtype, tr in TRAITS.items():
        if tr.cpu_layout != "format":
            continue
        block, type_size = GGML_QUANT_SIZES[qtype]
        f = tr.cpu
        assert f.super_block == block, qtype.name
        extra = 4 if qtype.name == "Q3_K" else 0  # (its 16 six-bit sub-scales a row: 12 bytes in the file)
        assert f.block_bytes == CPU_TILE * (type_size + extra), qtype.name


def test_the_packer_writes_the_tables_bytes():
    from localllm.kernels.cpu import native
    from localllm.kernels.cpu.fields import LATTICE_FIELDS

    for qtype, (group_fields, scale_fields) in LATTICE_FIELDS.items():  # the lattice formats: the file's blocks
        f = TRAITS[qtype].cpu
        n, k = 20, 2 * f.super_block
        blocks = torch.randint(0, 256, (n * k // f.super_block, GGML_QUANT_SIZES[qtype][1]), dtype=torch.uint8)
        packed = native.pack_lattice(f.id, blocks, n, group_fields, scale_fields)
        assert packed.numel() == native.packed_bytes(n, k, f.id) == f.packed_bytes(n, k), f.name
    for fmt, f in native.FORMATS.items():
        if f.group_bytes:
            continue
        n, k = 20, 2 * f.super_block
        codes = torch.randint(0, 2**f.code_bits, (n, k), dtype=torch.uint8)
        nsb = k // f.super_block
        scales = torch.zeros(n, nsb, 16 if f.six_bit_scales else f.scale_bytes // CPU_TILE, dtype=torch.uint8)
        d = torch.ones(n, nsb, dtype=torch.float16)
        packed = native.pack_format(fmt, codes, scales if f.scale_bytes else None, d, d if f.has_z else None)
        assert packed.numel() == native.packed_bytes(n, k, fmt) == f.packed_bytes(n, k), f.name
