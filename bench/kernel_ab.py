"""Two or more builds of the native CPU kernels side by side, in one process (outside CI).

Each source given (a ``csrc`` directory, or a ``cpu_kernels.cpp`` with the headers it includes
beside it) is compiled as a module of its own, with the flags ``native.load`` gives
``csrc/cpu_kernels.cpp`` for ``--isa`` (``native.compiler_flags``; default: the build this CPU
and ``LOCALLLM_CPU_ISA`` pick), checked to give the first source's bits (qgemm's outputs and
dequant_rows' rows, bit for bit), then every build multiplies the same random weights
(``--copies`` copies of an ``--n`` x ``--k`` weight per type, beyond the last-level cache) in
interleaved rounds: this machine's speed moves between minutes, so only figures taken turn about
compare. Prints GB/s of held weight bytes and G int8 ops/s (2 x rows x n x k x passes per
second), median and best per build.

    cp -r localllm/kernels/cpu/csrc /tmp/before   # then edit the sources
    python bench/kernel_ab.py /tmp/before localllm/kernels/cpu/csrc --types Q6_K,Q4_0 --rows 1 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import torch

from localllm.kernels.cpu import native
from localllm.kernels.cpu.options import CpuOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_stream import held_copies


def translation_unit(source: Path) -> Path:
    """The ``.cpp`` a source names: itself, or a directory's ``cpu_kernels.cpp``."""
    return source / native.SOURCE.name if source.is_dir() else source


def build(source: Path, isa: str, root: Path, prefetch: int | None = None):
    """``source`` (see :func:`translation_unit`) compiled for ``isa``, once per its files' bytes."""
    from torch.utils import cpp_extension

    cpp = translation_unit(source)
    options = CpuOptions.from_env()  # (the K-quants' distance as this CPU's own build takes it)
    cflags = native.compiler_flags(isa, prefetch, native.kquant_prefetch(options) if prefetch is None else None)
    digest = hashlib.sha256(native.source_digest(cpp) + " ".join(cflags).encode()).hexdigest()[:12]
    directory = root / f"kernel_ab_{digest}"
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=f"kernel_ab_{digest}", sources=[str(cpp)], build_directory=str(directory), verbose=False,
        extra_cflags=cflags, extra_ldflags=["-fopenmp"])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # (float32 compared bit for bit: -0.0 is not 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", type=Path)
    ap.add_argument("--types", default="Q4_0,Q8_0,Q6_K")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--passes", type=int, default=1, choices=(1, 2))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small-pages", action="store_true", help="the copies in 4 KiB pages (default: huge pages)")
    ap.add_argument("--isa", choices=("avx2", "avx512vnni"), default=None, help="the build to compare")
    ap.add_argument("--build-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    options = CpuOptions.from_env()
    isa = args.isa or native.build_isa(options)
    if native.load(options) is None or isa is None:  # (the weights are repacked by the loaded build)
        raise SystemExit("the native CPU kernels did not load on this machine")
    prefetch = native.weight_prefetch(options)
    builds = {str(s): build(s, isa, args.build_dir, prefetch) for s in args.sources}
    torch.set_num_threads(args.threads)
    n, k = args.n, args.k
    held = held_copies(args.types.split(","), n, k, args.copies, huge_pages=not args.small_pages)
    x = torch.randn(args.rows, k)
    ids = torch.cat([torch.arange(min(n, 64)), torch.tensor([n - 1])])
    for name, (weight, _) in held.items():
        first = None
        for label, module in builds.items():
            out = (module.qgemm(x, weight.packed, weight.bits, n, k, args.passes),
                   module.dequant_rows(weight.packed, weight.bits, n, k, ids))
            if first is None:
                first = out
                continue
            same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(out, first))
            print(f"{'' if same else 'note: '}{name}: {label} gives {'the same' if same else 'other'} bits "
                  f"as {args.sources[0]} (qgemm, dequant_rows)")
    rates: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, (weight, copies) in held.items():
            for label, module in builds.items():
                start = time.perf_counter()
                for packed in copies:
                    module.qgemm(x, packed, weight.bits, n, k, args.passes)
                rates.setdefault((name, label), []).append(len(copies) / (time.perf_counter() - start))
    pages = "4 KiB" if args.small_pages else "huge"
    print(f"{args.rows} row(s), {args.passes} pass(es), {args.threads} threads, {args.copies} copies of {n}x{k} "
          f"in {pages} pages, {args.rounds} interleaved rounds, {isa} builds")
    print("| type | build | GB/s median | GB/s best | G int8 ops/s median |")
    print("|---|---|---|---|---|")
    for (name, label), per_s in rates.items():
        per_s.sort()
        nbytes = held[name][0].nbytes
        median, best = per_s[len(per_s) // 2], per_s[-1]
        ops = 2 * args.rows * n * k * args.passes * median / 1e9
        print(f"| {name} | {label} | {nbytes * median / 1e9:.1f} | {nbytes * best / 1e9:.1f} | {ops:.0f} |")


if __name__ == "__main__":
    main()
