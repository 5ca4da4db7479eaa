"""This CPU's peak rate for the instructions localllm's CPU kernels multiply with (outside CI).

    python bench/cpu_peak.py [--threads N]

Compiles a small C++ program with the system compiler (``c++``, ``-march=native``) whose threads
each run a loop of independent instructions with no memory traffic, all threads at once, and
prints the rate they reach together:

* ``int8``: AVX2's ``vpmaddubsw`` followed by the ``vpaddw`` that accumulates its result (the
  pair the AVX2 kernels issue for every 32 products), or AVX-512 VNNI's ``vpdpbusd`` on 512-bit
  registers (64 products, accumulated); ``vpmaddubsw`` alone as well;
* ``fp32``: 256-bit ``vfmadd231ps`` (the F16/BF16 route and llama.cpp's float kernels).

An operation is a multiply or an add: a product accumulated counts 2. ``bench/real_size.py``
prints these peaks next to the rates a 512-token prefill achieves.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = r"""
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define R8(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)
#define PAIR(r) "vpmaddubsw %%ymm14, %%ymm15, %%ymm" #r "\n\t" "vpaddw %%ymm" #r ", %%ymm8, %%ymm" #r "\n\t"
#define MADDUBS(r) "vpmaddubsw %%ymm14, %%ymm15, %%ymm" #r "\n\t"
#define FMA(r) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #r "\n\t"
#define VNNI(r) "vpdpbusd %%zmm14, %%zmm15, %%zmm" #r "\n\t"

static void pair(long n) { asm volatile("1:\n\t" R8(PAIR) "dec %0\n\tjnz 1b" : "+r"(n)::"memory"); }
static void maddubs(long n) { asm volatile("1:\n\t" R8(MADDUBS) "dec %0\n\tjnz 1b" : "+r"(n)::"memory"); }
static void fma(long n) { asm volatile("1:\n\t" R8(FMA) "dec %0\n\tjnz 1b" : "+r"(n)::"memory"); }
#if defined(__AVX512VNNI__)
static void vnni(long n) { asm volatile("1:\n\t" R8(VNNI) "dec %0\n\tjnz 1b" : "+r"(n)::"memory"); }
#endif

// instructions per second of `f` (8 per iteration) on `threads` threads at once, best of 3
static double rate(void (*f)(long), int threads, long iters) {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::thread> pool;
    auto t0 = std::chrono::steady_clock::now();
    for (int t = 0; t < threads; ++t) pool.emplace_back(f, iters);
    for (auto& th : pool) th.join();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double r = 8.0 * iters * threads / s;
    if (r > best) best = r;
  }
  return best;
}

int main(int argc, char** argv) {
  int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  long iters = 100000000;
  // name, instructions/s, operations per instruction
  std::printf("maddubs_add %.6g 64\n", rate(pair, threads, iters));
  std::printf("maddubs %.6g 64\n", rate(maddubs, threads, iters));
  std::printf("fma %.6g 16\n", rate(fma, threads, iters));
#if defined(__AVX512VNNI__)
  std::printf("vnni %.6g 128\n", rate(vnni, threads, iters / 2));
#endif
  return 0;
}
"""

LABELS = {
    "maddubs_add": "int8 vpmaddubsw + vpaddw (256-bit)",
    "maddubs": "int8 vpmaddubsw alone (256-bit)",
    "vnni": "int8 vpdpbusd (512-bit)",
    "fma": "fp32 vfmadd231ps (256-bit)",
}


@dataclass(frozen=True)
class Peak:
    """Operations per second of one instruction (mix) on ``threads`` threads at once."""

    name: str
    ops_per_s: float
    threads: int

    @property
    def label(self) -> str:
        return LABELS[self.name]


def build(cache: Path | None = None) -> Path:
    """The program, compiled for this machine once per source (cached beside the peer build)."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    cache = cache or Path(os.environ.get("LOCALLLM_PEER_DIR", Path.home() / ".cache" / "localllm-peer"))
    cache.mkdir(parents=True, exist_ok=True)
    binary = cache / f"cpu-peak-{hashlib.sha256(SOURCE.encode()).hexdigest()[:12]}"
    if not binary.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "peak.cpp"
            src.write_text(SOURCE)
            subprocess.run([compiler, "-O2", "-march=native", "-pthread", "-o", str(binary), str(src)], check=True)
    return binary


def measure(threads: int) -> dict[str, Peak]:
    """Each instruction's peak on ``threads`` threads at once (a few seconds)."""
    out = subprocess.run([str(build()), str(threads)], check=True, capture_output=True, text=True).stdout
    peaks = {}
    for line in out.splitlines():
        name, per_s, ops = line.split()
        peaks[name] = Peak(name, float(per_s) * int(ops), threads)
    return peaks


def int8_peak(peaks: dict[str, Peak]) -> Peak:
    """The int8 rate the kernels can reach: VNNI where the CPU has it, else the AVX2 pair."""
    return peaks.get("vnni") or peaks["maddubs_add"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    print(f"{args.threads} threads at once:\n\n| instruction | G operations/s |\n|---|---|")
    for p in measure(args.threads).values():
        print(f"| {p.label} | {p.ops_per_s / 1e9:.0f} |")


if __name__ == "__main__":
    main()
