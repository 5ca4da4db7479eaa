// F16 and BF16: the file's rows as they are, multiplied in float32 (two 8-lane FMA chains per
// output over k (lanes k mod 16), added and summed in the fixed hsum order; the activations are not
// quantized). 256-bit in both builds.
#pragma once

namespace {

#if LOCALLLM_HAVE_NATIVE
namespace fmt {

template <bool BF>
inline __m256 ldw(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  else return _mm256_cvtph_ps(v);
}

// NR weight rows (K apart) times one activation row x: NR outputs, each two FMA chains then hsum.
template <bool BF, int NR>
inline void float_rows(const uint16_t* w, int64_t K, const float* x, float* out) {
  __m256 a0[NR], a1[NR];
  for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    // the next block's rows into L2 as these stream in (a prefetch past the weight's end is harmless):
    // 8192x2048 beyond L3, 2 threads, median GB/s with / without: BF16 27.3 / 21.2, F16 24.6 / 22.4
    if (k % 32 == 0)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r + NR) * K + k), _MM_HINT_T1);
    for (int r = 0; r < NR; ++r) {
      a0[r] = _mm256_fmadd_ps(ldw<BF>(w + r * K + k), x0, a0[r]);
      a1[r] = _mm256_fmadd_ps(ldw<BF>(w + r * K + k + 8), x1, a1[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = V256::reduce_add(_mm256_add_ps(a0[r], a1[r]));
}

// NR weight rows times MR activation rows (K apart): float_rows' two FMA chains per output, one
// chain after the other (the first one's vectors wait in memory), so that each converted weight
// vector serves MR rows: the same operations in the same order per output as float_rows.
template <bool BF, int NR, int MR>
inline void float_block(const uint16_t* w, int64_t K, const float* x, float* out /* [MR][NR] */) {
  alignas(32) float first[MR][NR][8];
  for (int chain = 0; chain < 2; ++chain) {
    __m256 a[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) a[m][r] = _mm256_setzero_ps();
    for (int64_t k = 8 * chain; k < K; k += 16) {
      __m256 wv[NR];
      for (int r = 0; r < NR; ++r) wv[r] = ldw<BF>(w + r * K + k);
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_loadu_ps(x + m * K + k);
        for (int r = 0; r < NR; ++r) a[m][r] = _mm256_fmadd_ps(wv[r], xv, a[m][r]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) {
        if (chain == 0) _mm256_store_ps(first[m][r], a[m][r]);
        else out[m * NR + r] = V256::reduce_add(_mm256_add_ps(_mm256_load_ps(first[m][r]), a[m][r]));
      }
  }
}

template <bool BF>
void gemm_float(const uint16_t* w, int64_t N, int64_t K, const float* x, int64_t M, float* y) {
  constexpr int NR = 4;          // weight rows per block (float_rows: one activation row)
  constexpr int BR = 4, MR = 2;  // float_block: 8 accumulators + 4 weight vectors + 1 activation vector
  const int64_t blocks = (N + NR - 1) / NR;
  // Blocks are taken in groups whose weights fit in half of L2: each pair of activation rows is
  // multiplied with a whole group before the next pair comes (a row pair stays in L1; the rows
  // stream from L3 once per group instead of once per block).
  const int64_t group = std::max<int64_t>(1, (128 << 10) / (NR * K * 2));
  const int64_t groups = (blocks + group - 1) / group;
  parallel_chunks(groups, 1, [&](int64_t begin, int64_t end) {
    float out[MR * BR > NR ? MR * BR : NR];
    for (int64_t gi = begin; gi < end; ++gi) {
      const int64_t b0 = gi * group, b1 = std::min(blocks, b0 + group);
      const bool full = b1 * NR <= N;  // the last block of N % NR rows takes the one-row path
      int64_t m = 0;
      for (; full && m + MR <= M; m += MR)
        for (int64_t b = b0; b < b1; ++b) {
          float_block<BF, BR, MR>(w + b * NR * K, K, x + m * K, out);
          for (int i = 0; i < MR; ++i)
            for (int r = 0; r < BR; ++r) y[(m + i) * N + b * NR + r] = out[i * BR + r];
        }
      for (; m < M; ++m)
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * NR, nr = std::min<int64_t>(NR, N - n0);
          if (nr == NR) {
            float_rows<BF, NR>(w + n0 * K, K, x + m * K, out);
          } else {
            for (int64_t r = 0; r < nr; ++r) float_rows<BF, 1>(w + (n0 + r) * K, K, x + m * K, out + r);
          }
          for (int64_t r = 0; r < nr; ++r) y[m * N + n0 + r] = out[r];
        }
    }
  });
}

}  // namespace fmt
#endif  // LOCALLLM_HAVE_NATIVE

}  // namespace
