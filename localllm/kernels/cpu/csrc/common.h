// What every part of the kernels reads first: the includes, the instruction set the build picks,
// the tuning constants shared by the kernels, and the prefetch helpers.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <memory>
#include <utility>
#include <vector>

// The instruction set is chosen at compile time (-march=native): AVX-512 VNNI where the CPU has
// it, else AVX2 with FMA and F16C (same weight layout, same results: see "Vector traits"),
// else nothing (supported() is false and the Python side keeps its torch route).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define LOCALLLM_HAVE_VNNI 1
#define LOCALLLM_HAVE_AVX2 0
#define LOCALLLM_ISA "avx512vnni"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LOCALLLM_HAVE_VNNI 0
#define LOCALLLM_HAVE_AVX2 1
#define LOCALLLM_ISA "avx2"
#else
#define LOCALLLM_HAVE_VNNI 0
#define LOCALLLM_HAVE_AVX2 0
#define LOCALLLM_ISA "none"
#endif
#define LOCALLLM_HAVE_NATIVE (LOCALLLM_HAVE_VNNI || LOCALLLM_HAVE_AVX2)

namespace {

constexpr int kMTile = 4;  // activation rows per call of the tiles' multi-row kernel
constexpr int kRowBlock = 16;  // activation rows per block of the kernels' activation layout (ActRows; M rows if fewer)
// A matmul reads each weight tile from memory once, for its first activation rows (m0 == 0; the
// other rows find the tile in cache): those kernels ask for the bytes this far ahead of those they
// read into L2 (prefetcht1; L1's own prefetcher takes them from there). 8192x2048 weights beyond
// L3, 2 threads, Zen 4, median GB/s of 5 interleaved rounds, with / without: Q6_K 33.1 / 21.3,
// Q5_K 27.6 / 19.9, Q3_K 28.0 / 20.4, Q2_K 25.8 / 19.9, Q8_0 29.3 / 25.6, Q4_0 27.0 / 28.2;
// asking for them 8192 bytes ahead into L1 (prefetcht0), as before, was slower than not asking
// (Q6_K 18.7). The one-row kernels (decode) take their own distance per format: one_row_ahead.
constexpr int64_t kStreamAhead = 8192;
// A decode sequence's attention is split by KV heads over the threads (fewer sequences than threads)
// once its K and V hold this many bytes: below, a thread's wake-up costs about what it saves.
constexpr int64_t kAttentionSplitBytes = 64 << 10;

#if LOCALLLM_HAVE_NATIVE
// Asks for the cache lines of elems elements from p: into L1 (a one-row kernel's next activations,
// prefetch_row_window), or into L2 with _MM_HINT_T1 (weights streamed ahead, kStreamAhead; the
// decode attention's KV blocks ahead). (Always inlined: see prefetch_row_window on calls of
// functions that only prefetch.)
template <int Hint = _MM_HINT_T0, typename T>
__attribute__((always_inline)) inline void prefetch_rows(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(c + off, static_cast<_mm_hint>(Hint));
}

// The weight bytes [p + Ahead, p + Ahead + bytes) into L2, ahead of a kernel that streams them
// from memory (Ahead 0: none asked for, the hardware's prefetchers alone).
template <int64_t Ahead = kStreamAhead>
inline void stream_ahead(const uint8_t* p, int64_t bytes) {
  if constexpr (Ahead > 0) prefetch_rows<_MM_HINT_T1>(p + Ahead, bytes);
  else (void)p, (void)bytes;
}

#endif

bool supported() { return LOCALLLM_HAVE_NATIVE; }

// The instruction set this build's kernels use: "avx512vnni", "avx2" or "none".
std::string isa() { return LOCALLLM_ISA; }

}  // namespace
