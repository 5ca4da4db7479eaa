// Quantized matmul for x86 CPUs with AVX-512 VNNI, or AVX2 with FMA and F16C (the same layout and
// results; see the AVX2 sections): y[m, n] = sum_k x[m, k] * w[n, k].
//
// Weights are unsigned integer codes with one affine map per 32-element group and output row,
// w = d * u + z, repacked by localllm/kernels/cpu/native.py into tiles of 16 output rows:
//
//   4-bit (Q4_0, Q4_1): per (tile, group) 320 bytes: four 64-byte vectors of nibbles,
//     then d[16] and z[16] as float16. In vector s, byte 4*j + t holds row j's code for
//     k = 8s + t in its low nibble and for k = 8s + 4 + t in its high nibble.
//   8-bit (Q8_0, codes u = q + 128, z = -128 d): per (tile, group) 544 bytes: eight 64-byte
//     vectors, byte 4*j + t of vector s = row j's code for k = 4s + t, then d[16] as float16.
//
// Activations are quantized per row and 32-element group to int8 with one float scale (as
// llama.cpp's Q8 activations), so each group's dot product is exact integer arithmetic
// (vpdpbusd: unsigned weight code x signed activation code, 4 products per int32 lane, one lane
// per output row) followed by one float multiply-add with the two scales. With two passes the
// quantization residual is quantized and multiplied too (x ~ xs1*xq1 + xs2*xq2), which leaves
// an activation error 254x smaller (below bfloat16's) for twice the integer work.
//
// The reference this is tested against is the float64 definition in localllm/kernels/cpu/native.py.
//
// Every other GGUF type (Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, F16, BF16) has a layout of its
// own that keeps the file's codes and scales exactly, and one kernel written over the vector width
// (AVX2 or AVX-512, the same bits): see "Every other GGUF type" below. Rows need not be a multiple of 16 (zero rows pad the last tile).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

// The instruction set is chosen at compile time (-march=native): AVX-512 VNNI where the CPU has
// it, else AVX2 with FMA and F16C (same weight layout, same results: see the AVX2 sections),
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

constexpr int kGroup = 32;
constexpr int kTile = 16;
constexpr int kMTile = 4;     // activation rows per call of the AVX-512 and the formats' multi-row kernels
constexpr int kAvx2Rows = 2;  // those of the AVX2 4- and 8-bit tiles' (tile_rows)
// One activation row streams its weight tiles from memory once: the one-row kernels prefetch the
// bytes this far ahead of those they read (8192x2048 weights beyond L3, 2 threads, this EPYC:
// 2048 beat 512, 1024, 4096 and 8192, and no prefetch by 6-30% depending on the type).
constexpr int64_t kStreamAhead = 2048;

#if LOCALLLM_HAVE_NATIVE
// Asks for the cache lines of elems elements from p (weights streamed ahead, KV blocks ahead).
template <typename T>
inline void prefetch_rows(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}
#endif

// f(begin, end) over [0, n) in chunks of `chunk`, handed out dynamically to torch's OpenMP
// threads: when one thread is descheduled (a busy machine, an API server sharing the cores),
// the others take its chunks instead of waiting for it at the end of a static split.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks <= 1 || omp_get_max_threads() == 1 || omp_in_parallel()) {
    if (n > 0) f(0, n);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t c = 0; c < chunks; ++c) f(c * chunk, std::min(n, (c + 1) * chunk));
}

bool supported() { return LOCALLLM_HAVE_NATIVE; }

// The instruction set this build's kernels use: "avx512vnni", "avx2" or "none".
std::string isa() { return LOCALLLM_ISA; }

#if LOCALLLM_HAVE_VNNI

// x float32 [M, K] -> for each pass p: xq int8 [M, K], xs float [M, G] (scale), xsum int32
// [M, G] (sum of codes), at offsets p * M * K and p * M * G. Pass 1 quantizes x, pass 2 (when
// passes == 2) the residual x - xs * xq of pass 1, so that x ~ xs1 * xq1 + xs2 * xq2.
void quantize_rows(const float* x, int64_t M, int64_t K, int passes, int8_t* xq, float* xs, int32_t* xsum) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M * G, 256, [&](int64_t begin, int64_t end) {
    const __m512 sign_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kGroup;  // rows are contiguous: group i of the flattened matrix
      __m512 a = _mm512_loadu_ps(src);
      __m512 b = _mm512_loadu_ps(src + 16);
      for (int p = 0; p < passes; ++p) {
        __m512 amax = _mm512_max_ps(_mm512_and_ps(a, sign_mask), _mm512_and_ps(b, sign_mask));
        float mx = _mm512_reduce_max_ps(amax);
        float scale = mx / 127.0f;
        float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));  // round to nearest even
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        int8_t* dst = xq + p * M * K + i * kGroup;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
        xs[p * M * G + i] = scale;
        xsum[p * M * G + i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        // residual for the next pass: x - scale * q, rounded once (fnmadd)
        a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), _mm512_set1_ps(scale), a);
        b = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qb), _mm512_set1_ps(scale), b);
      }
    }
  });
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One tile of 16 output rows for rows m0 .. m0 + MT of the activations. No software prefetch in
// the one-row case (unlike the AVX2 tile_row): on the AVX-512 EPYC (Zen 4) the hardware prefetcher
// alone streams faster, one row through 8 random 8192x2048 matrices, 2 threads, two A/B pairs:
// 35.7-35.9 against 25.6-29.7 GB/s (Q4_0), 34.2-37.0 against 28.8-33.5 (Q4_K), 28.0-28.4 against
// 21.1-25.0 (Q8_0).
template <int BITS, int MT, int PASSES>
inline void tile_kernel(const uint8_t* tile, int64_t G, const int8_t* xq, const float* xs,
                        const int32_t* xsum, int64_t M, int64_t K, int64_t m0, float* y, int64_t N, int64_t n0) {
  constexpr int kBlockBytes = BITS == 4 ? 320 : 544;
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = tile + g * kBlockBytes;
    __m512i w[8];
    __m512 d, z;
    if constexpr (BITS == 4) {
      for (int s = 0; s < 4; ++s) {
        __m512i v = _mm512_loadu_si512(blk + 64 * s);
        w[2 * s] = _mm512_and_si512(v, low4);
        w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
      z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    } else {
      for (int s = 0; s < 8; ++s) w[s] = _mm512_loadu_si512(blk + 64 * s);
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 512)));
      z = _mm512_setzero_ps();
    }
    for (int p = 0; p < PASSES; ++p) {
      for (int i = 0; i < MT; ++i) {
        const int8_t* xg = xq + p * M * K + (m0 + i) * K + g * kGroup;
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        if constexpr (BITS == 4) {
          // w[2s] pairs with k = 8s..8s+3, w[2s+1] with k = 8s+4..8s+7
          for (int s = 0; s < 4; ++s) {
            a0 = _mm512_dpbusd_epi32(a0, w[2 * s], bcast4(xg + 8 * s));
            a1 = _mm512_dpbusd_epi32(a1, w[2 * s + 1], bcast4(xg + 8 * s + 4));
          }
        } else {
          for (int s = 0; s < 8; s += 2) {
            a0 = _mm512_dpbusd_epi32(a0, w[s], bcast4(xg + 4 * s));
            a1 = _mm512_dpbusd_epi32(a1, w[s + 1], bcast4(xg + 4 * s + 4));
          }
        }
        __m512i isum = _mm512_add_epi32(a0, a1);
        const float sx = xs[p * M * G + (m0 + i) * G + g];
        const int32_t cx = xsum[p * M * G + (m0 + i) * G + g];
        if constexpr (BITS == 8) {
          isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * cx));
        }
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_set1_ps(sx)), acc[i]);
        if constexpr (BITS == 4) {
          acc[i] = _mm512_fmadd_ps(z, _mm512_set1_ps(sx * static_cast<float>(cx)), acc[i]);
        }
      }
    }
  }
  for (int i = 0; i < MT; ++i) _mm512_storeu_ps(y + (m0 + i) * N + n0, acc[i]);
}

template <int BITS, int PASSES>
void gemm(const uint8_t* w, int64_t N, int64_t K, const int8_t* xq, const float* xs, const int32_t* xsum,
          int64_t M, float* y) {
  constexpr int kBlockBytes = BITS == 4 ? 320 : 544;
  const int64_t G = K / kGroup;
  const int64_t tiles = N / kTile;
  const int64_t tile_bytes = G * kBlockBytes;
  // Chunks of about 256 KB of weights for one row (a small matmul runs on the calling thread:
  // waking the pool costs more than it saves), fewer tiles per chunk as rows add work.
  const int64_t chunk = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, tile_bytes) / std::max<int64_t>(1, M / 4));
  parallel_chunks(tiles, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      int64_t m0 = 0;
      for (; m0 + kMTile <= M; m0 += kMTile)
        tile_kernel<BITS, kMTile, PASSES>(tile, G, xq, xs, xsum, M, K, m0, y, N, t * kTile);
      for (; m0 < M; ++m0) tile_kernel<BITS, 1, PASSES>(tile, G, xq, xs, xsum, M, K, m0, y, N, t * kTile);
    }
  });
}

#endif  // LOCALLLM_HAVE_VNNI

#if LOCALLLM_HAVE_AVX2

// The AVX2 (+FMA, F16C) route: the same layout, activation codes and results as the AVX-512
// one above. A 64-byte tile vector is two 256-bit halves (rows 0-7, rows 8-15 of the tile), and
// vpdpbusd becomes vpmaddubsw (u8 x s8 products summed in pairs to int16, saturating) and
// vpmaddwd by ones (int16 pairs summed to int32). The activation codes of finite inputs are
// within [-127, 127] (|x| <= amax gives |x * 127 / amax| <= 127 after rounding), so:
//   4-bit: u <= 15, a product's magnitude is at most 1905, and all 16 products a 16-bit lane
//     gathers over a group sum to at most 30480 (30720 even for -128): one int16 sum per group
//     and row, widened once, exact.
//   8-bit: u up to 255 would saturate a pair (2 * 255 * 127), so the signed codes q = u - 128
//     multiply instead (vpsignb moves q's sign onto x: |q| * (sign(q) x), pairs at most
//     2 * 128 * 127 = 32512), each pair widened at once: sum q x = sum u x - 128 sum x, which is
//     the AVX-512 route's isum after its zero-point correction.
// The integer group sums are the AVX-512 route's exactly, and every float operation per output
// is the same one in the same order, so both routes give the same bits.

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
}

// The lane sum in _mm512_reduce_add_ps's order (halves, quarters, then pairs).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// As the AVX-512 quantize_rows: the same scale, codes (round to nearest even, saturated to
// int8), code sums and residuals.
void quantize_rows(const float* x, int64_t M, int64_t K, int passes, int8_t* xq, float* xs, int32_t* xsum) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, M * G, 256, [&](int64_t begin, int64_t end) {
    const __m256 sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
    for (int64_t i = begin; i < end; ++i) {
      const float* src = x + i * kGroup;
      __m256 a[4];
      for (int j = 0; j < 4; ++j) a[j] = _mm256_loadu_ps(src + 8 * j);
      for (int p = 0; p < passes; ++p) {
        const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(a[0], sign_mask), _mm256_and_ps(a[1], sign_mask)),
                                          _mm256_max_ps(_mm256_and_ps(a[2], sign_mask), _mm256_and_ps(a[3], sign_mask)));
        const float mx = hmax8(amax);
        const float scale = mx / 127.0f;
        const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
        __m256i q[4];
        for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(a[j], _mm256_set1_ps(inv)));
        // int32 -> int16 -> int8, each saturating (as one int32 -> int8 saturation)
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + p * M * K + i * kGroup), bytes);
        xs[p * M * G + i] = scale;
        xsum[p * M * G + i] = hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        for (int j = 0; j < 4; ++j) a[j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(q[j]), _mm256_set1_ps(scale), a[j]);
      }
    }
  });
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// MT activation rows (m0 .. m0 + MT) against both halves of one tile, every pass at once: each
// code vector is decoded once for all rows and passes, each activation broadcast serves both
// halves. Per output the same integer sums and then the same float operations in the same order
// as tile_row (the float accumulators live in memory between groups: 2 x 2 x 2 int16/int32
// accumulators take the registers). The s loops are kept rolled: unrolled, the compiler
// reassociates the integer adds and spills every product.
template <int BITS, int MT, int PASSES>
inline void tile_rows(const uint8_t* tile, int64_t G, const int8_t* xq, const float* xs, const int32_t* xsum,
                      int64_t M, int64_t K, int64_t m0, float* y, int64_t N, int64_t n0) {
  constexpr int kBlockBytes = BITS == 4 ? 320 : 544;
  constexpr int kScales = BITS == 4 ? 256 : 512;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  alignas(32) float acc[MT][2][8] = {};
  const int8_t* xr = xq + m0 * K;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = tile + g * kBlockBytes;
    __m256i isum[PASSES][MT][2];
    if constexpr (BITS == 4) {
      __m256i s16[PASSES][MT][2];
      for (int p = 0; p < PASSES; ++p)
        for (int i = 0; i < MT; ++i) s16[p][i][0] = s16[p][i][1] = _mm256_setzero_si256();
      // Vector s: its low nibbles pair with k = 8s .. 8s+3, its high nibbles with k = 8s+4 .. 8s+7.
      _Pragma("GCC unroll 1") for (int s = 0; s < 4; ++s) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s + 32));
        const __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
        const __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
        for (int p = 0; p < PASSES; ++p)
          for (int i = 0; i < MT; ++i) {
            const int8_t* xg = xr + p * M * K + i * K + g * kGroup + 8 * s;
            const __m256i xl = bcast4(xg), xh = bcast4(xg + 4);
            s16[p][i][0] = _mm256_add_epi16(s16[p][i][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl),
                                                                            _mm256_maddubs_epi16(hi0, xh)));
            s16[p][i][1] = _mm256_add_epi16(s16[p][i][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl),
                                                                            _mm256_maddubs_epi16(hi1, xh)));
          }
      }
      for (int p = 0; p < PASSES; ++p)
        for (int i = 0; i < MT; ++i)
          for (int h = 0; h < 2; ++h) isum[p][i][h] = _mm256_madd_epi16(s16[p][i][h], ones);
    } else {
      for (int p = 0; p < PASSES; ++p)
        for (int i = 0; i < MT; ++i) isum[p][i][0] = isum[p][i][1] = _mm256_setzero_si256();
      _Pragma("GCC unroll 1") for (int s = 0; s < 8; ++s) {
        const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s)), flip);
        const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s + 32)), flip);
        const __m256i aq0 = _mm256_abs_epi8(q0), aq1 = _mm256_abs_epi8(q1);  // -128 -> 0x80: 128 unsigned
        for (int p = 0; p < PASSES; ++p)
          for (int i = 0; i < MT; ++i) {
            const __m256i xb = bcast4(xr + p * M * K + i * K + g * kGroup + 4 * s);
            isum[p][i][0] = _mm256_add_epi32(isum[p][i][0],
                                             _mm256_madd_epi16(_mm256_maddubs_epi16(aq0, _mm256_sign_epi8(xb, q0)), ones));
            isum[p][i][1] = _mm256_add_epi32(isum[p][i][1],
                                             _mm256_madd_epi16(_mm256_maddubs_epi16(aq1, _mm256_sign_epi8(xb, q1)), ones));
          }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kScales + 16 * h)));
      for (int i = 0; i < MT; ++i) {
        __m256 a = _mm256_load_ps(acc[i][h]);
        for (int p = 0; p < PASSES; ++p) {
          const float sx = xs[p * M * G + (m0 + i) * G + g];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[p][i][h]), _mm256_mul_ps(d, _mm256_set1_ps(sx)), a);
          if constexpr (BITS == 4) {
            const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)));
            a = _mm256_fmadd_ps(z, _mm256_set1_ps(sx * static_cast<float>(xsum[p * M * G + (m0 + i) * G + g])), a);
          }
        }
        _mm256_store_ps(acc[i][h], a);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + i) * N + n0 + 8 * h, _mm256_load_ps(acc[i][h]));
}

// One activation row (row m0) against a whole tile: tile_rows<BITS, 1, PASSES>'s arithmetic (the
// same integer sums, then the same float operations in the same order), with its accumulators in
// registers and the weights prefetched as they stream in.
template <int BITS, int PASSES>
inline void tile_row(const uint8_t* tile, int64_t G, const int8_t* xq, const float* xs, const int32_t* xsum,
                     int64_t M, int64_t K, int64_t m0, float* y, int64_t N, int64_t n0) {
  constexpr int kBlockBytes = BITS == 4 ? 320 : 544;
  constexpr int kScales = BITS == 4 ? 256 : 512;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = tile + g * kBlockBytes;
    prefetch_rows(blk + kStreamAhead, kBlockBytes);
    const int8_t* xg[PASSES];
    for (int p = 0; p < PASSES; ++p) xg[p] = xq + p * M * K + m0 * K + g * kGroup;
    __m256i isum[PASSES][2];
    if constexpr (BITS == 4) {
      __m256i s16[PASSES][2];
      for (int p = 0; p < PASSES; ++p) s16[p][0] = s16[p][1] = _mm256_setzero_si256();
      for (int s = 0; s < 4; ++s) {
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s + 32));
        const __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
        const __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
        for (int p = 0; p < PASSES; ++p) {
          const __m256i xl = bcast4(xg[p] + 8 * s), xh = bcast4(xg[p] + 8 * s + 4);
          s16[p][0] = _mm256_add_epi16(s16[p][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl), _mm256_maddubs_epi16(hi0, xh)));
          s16[p][1] = _mm256_add_epi16(s16[p][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl), _mm256_maddubs_epi16(hi1, xh)));
        }
      }
      for (int p = 0; p < PASSES; ++p) {
        isum[p][0] = _mm256_madd_epi16(s16[p][0], ones);
        isum[p][1] = _mm256_madd_epi16(s16[p][1], ones);
      }
    } else {
      for (int p = 0; p < PASSES; ++p) isum[p][0] = isum[p][1] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s)), flip);
        const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * s + 32)), flip);
        const __m256i aq0 = _mm256_abs_epi8(q0), aq1 = _mm256_abs_epi8(q1);
        for (int p = 0; p < PASSES; ++p) {
          const __m256i xb = bcast4(xg[p] + 4 * s);
          isum[p][0] = _mm256_add_epi32(isum[p][0], _mm256_madd_epi16(_mm256_maddubs_epi16(aq0, _mm256_sign_epi8(xb, q0)), ones));
          isum[p][1] = _mm256_add_epi32(isum[p][1], _mm256_madd_epi16(_mm256_maddubs_epi16(aq1, _mm256_sign_epi8(xb, q1)), ones));
        }
      }
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kScales)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kScales + 16)));
    for (int p = 0; p < PASSES; ++p) {
      const float sx = xs[p * M * G + m0 * G + g];
      const __m256 vsx = _mm256_set1_ps(sx);
      acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[p][0]), _mm256_mul_ps(d0, vsx), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[p][1]), _mm256_mul_ps(d1, vsx), acc1);
      if constexpr (BITS == 4) {
        const __m256 zx = _mm256_set1_ps(sx * static_cast<float>(xsum[p * M * G + m0 * G + g]));
        acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288))), zx, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 304))), zx, acc1);
      }
    }
  }
  _mm256_storeu_ps(y + m0 * N + n0, acc0);
  _mm256_storeu_ps(y + m0 * N + n0 + 8, acc1);
}

template <int BITS, int PASSES>
void gemm(const uint8_t* w, int64_t N, int64_t K, const int8_t* xq, const float* xs, const int32_t* xsum,
          int64_t M, float* y) {
  constexpr int kBlockBytes = BITS == 4 ? 320 : 544;
  const int64_t G = K / kGroup;
  const int64_t tiles = N / kTile;
  const int64_t tile_bytes = G * kBlockBytes;
  const int64_t chunk = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, tile_bytes) / std::max<int64_t>(1, M / 4));
  parallel_chunks(tiles, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      int64_t m0 = 0;
      // rows in pairs (2 rows x 2 halves x 2 passes of integer accumulators fill the registers),
      // an odd last row by tile_row
      for (; m0 + kAvx2Rows <= M; m0 += kAvx2Rows)
        tile_rows<BITS, kAvx2Rows, PASSES>(tile, G, xq, xs, xsum, M, K, m0, y, N, t * kTile);
      for (; m0 < M; ++m0) tile_row<BITS, PASSES>(tile, G, xq, xs, xsum, M, K, m0, y, N, t * kTile);
    }
  });
}

#endif  // LOCALLLM_HAVE_AVX2

// ---------------------------------------------------------------------------------------------
// Every other GGUF type (Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, F16, BF16): one implementation, a
// template over the vector width (fmt::V256 for AVX2 + FMA + F16C, fmt::V512 for AVX-512 VNNI,
// which the AVX-512 build takes; F16/BF16 stay 256-bit in both). Per output both give the same
// bits (tests/test_cpu_types.py runs the two builds side by side on an AVX-512 CPU), so what is
// tested on one machine is what runs on the other. The format id is qgemm's `bits` argument:
//
//   id   type  super-block SB  per (tile of 16 rows, super-block) bytes           bits/weight  file
//   50   Q5_0      32   codes 320 | d f16[16]                                  5.5       5.5
//   51   Q5_1      32   codes 320 | d f16[16] | m f16[16]                      6.0       6.0
//   44   Q4_K     256   8 x codes 256 | sc u8[8][16] | m u8[8][16] | d, dmin   4.625     4.5
//   55   Q5_K     256   8 x codes 320 | sc u8[8][16] | m u8[8][16] | d, dmin   5.625     5.5
//   66   Q6_K     256   8 x codes 384 | sc i8[16][16] | d f16[16]              6.5625    6.5625
//   33   Q3_K     256   8 x codes 192 | sc-32 i8[16][16] | d f16[16]           3.5625    3.4375
//   22   Q2_K     256   8 x codes 128 | (sc | m << 4) u8[16][16] | d, dmin     2.625     2.625
//   116  F16, 216 BF16: the file's rows as they are ([N, K], 2 bytes a weight).
//
// Scale arrays are [sub-block][row of the tile]; d/dmin are float16 [16] per super-block, the
// file's values. Codes of one 32-element group, 16 rows, k = 4v + t (v = 0..7, t = 0..3):
//   nibble plane (256 bytes, the 4-bit layout above): vector s (64 bytes), byte 4j + t: row j's
//     code bits 0-3 for v = 2s (low nibble) and v = 2s + 1 (high nibble);
//   2-bit plane (128 bytes): vector s = 0, 1, byte 4j + t, bits 2h..2h+1: v = 4s + h;
//   1-bit plane (64 bytes): byte 4j + t, bit v;
// 4-bit codes (Q4_K) = nibbles; 5-bit = nibbles | 1-bit plane << 4; 6-bit = nibbles | 2-bit plane << 4; 3-bit = 2-bit
// plane | 1-bit plane << 2; 2-bit = the 2-bit plane. Each 64-byte vector is two 32-byte halves
// (rows 0-7, 8-15), one AVX2 register, one int32 lane per row.
//
// With the file's unsigned codes u (Q5_0: q + 16, Q6_K: q + 32, Q3_K: q + 4) the weights are
//   Q5_0: d (u - 16)   Q5_1: d u + m   Q4_K, Q5_K: d sc u - dmin m   Q6_K: d sc (u - 32)
//   Q3_K: d sc (u - 4)  Q2_K: d sc u - dmin m
// with integer sub-scales sc (and mins m) per 32 (Q5_K) or 16 (Q6_K, Q3_K, Q2_K) weights. Per
// 32-group g and activation pass (Q4_K as Q5_K), with S0, S1 the exact integer sums of u * xq over the group's
// two halves (AVX2: vpmaddubsw + vpmaddwd, a 16-bit lane gathers at most 4 products of 5-bit codes
// (4 * 2 * 31 * 127 = 31496) or 2 of 6-bit ones (32004), then widens; AVX-512: vpdpbusd, four
// products straight into each int32 lane) and X0, X1 those of xq:
//   Q5_0: Ti = S0 + S1 - 16 (X0 + X1)             y += (d xs) Ti
//   Q5_1: Ti = S0 + S1                            y += (d xs) Ti + m (xs (X0 + X1))
//   Q5_K: Ti = S0 + S1                            y += ((d sc) xs) Ti - (dmin m) (xs (X0 + X1))
//   Q6_K: Ti = sc0 (S0 - 32 X0) + sc1 (S1 - 32 X1) y += (d xs) Ti
//   Q3_K: Ti = sc0 (S0 - 4 X0) + sc1 (S1 - 4 X1)   y += (d xs) Ti
//   Q2_K: Ti = sc0 S0 + sc1 S1                    y += (d xs) Ti - (dmin m0) (xs X0) - (dmin m1) (xs X1)
// Ti is an exact integer below 2^24 (so exact as float32 too), d sc and dmin m are exact float32
// products of the file's values: the only roundings are the float32 products with xs and the
// sums, one fixed sequence per output whatever the batch (rows of a batch only share loads). F16/BF16: per output two 8-lane float32 FMA chains over k (lanes k mod
// 16), added and summed in the fixed hsum order; the activations are not quantized.

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOCALLLM_HAVE_FMT 1
#else
#define LOCALLLM_HAVE_FMT 0
#endif

constexpr int kFmtQ5_0 = 50, kFmtQ5_1 = 51, kFmtQ5_K = 55, kFmtQ6_K = 66, kFmtQ3_K = 33, kFmtQ2_K = 22;
constexpr int kFmtQ4_K = 44;
constexpr int kFmtF16 = 116, kFmtBF16 = 216;

bool is_int_fmt(int64_t f) {
  return f == kFmtQ5_0 || f == kFmtQ5_1 || f == kFmtQ5_K || f == kFmtQ6_K || f == kFmtQ3_K || f == kFmtQ2_K ||
         f == kFmtQ4_K;
}
bool is_float_fmt(int64_t f) { return f == kFmtF16 || f == kFmtBF16; }
bool is_fmt(int64_t f) { return f == 4 || f == 8 || is_int_fmt(f) || is_float_fmt(f); }

// Whether this build has the kernels for the formats below (AVX2, FMA and F16C: every native build).
bool formats() { return LOCALLLM_HAVE_NATIVE && LOCALLLM_HAVE_FMT; }

// super-block size, code bytes per group, scale bytes per super-block, whether a dmin/m array follows d
struct FmtInfo {
  int sb, cb, scb;
  bool z;
  constexpr int sb_bytes() const { return (sb / kGroup) * cb + scb + 32 + (z ? 32 : 0); }
};

constexpr FmtInfo fmt_info(int64_t f) {
  return f == kFmtQ5_0   ? FmtInfo{32, 320, 0, false}
         : f == kFmtQ5_1 ? FmtInfo{32, 320, 0, true}
         : f == kFmtQ5_K ? FmtInfo{256, 320, 256, true}
         : f == kFmtQ4_K ? FmtInfo{256, 256, 256, true}
         : f == kFmtQ6_K ? FmtInfo{256, 384, 256, false}
         : f == kFmtQ3_K ? FmtInfo{256, 192, 256, false}
                         : FmtInfo{256, 128, 256, true};  // Q2_K
}

int64_t round_tile(int64_t n) { return (n + kTile - 1) / kTile * kTile; }

// Bytes of a packed weight [N, K] in format f (N rounded up to whole tiles for the quantized ones).
int64_t fmt_packed_bytes(int64_t f, int64_t N, int64_t K) {
  if (is_float_fmt(f)) return N * K * 2;
  const int64_t tiles = round_tile(N) / kTile, G = K / kGroup;
  if (f == 4) return tiles * G * 320;
  if (f == 8) return tiles * G * 544;
  const FmtInfo fi = fmt_info(f);
  return tiles * (K / fi.sb) * fi.sb_bytes();
}

// Scalar decode of one weight (row j of the tile, element k of group gi of the super-block at
// sbp): the file's float32 value, in its decoder's arithmetic (every product is exact in
// float32, so there is a single rounding, at the final sum, as in the reference).
float fmt_weight(int64_t f, const uint8_t* sbp, int j, int gi, int k) {
  const FmtInfo fi = fmt_info(f);
  const uint8_t* cb = sbp + gi * fi.cb;
  const uint8_t* scp = sbp + (fi.sb / kGroup) * fi.cb;
  const at::Half* dp = reinterpret_cast<const at::Half*>(scp + fi.scb);
  const float d = static_cast<float>(dp[j]);
  const float dz = fi.z ? static_cast<float>(dp[16 + j]) : 0.0f;
  const int v = k / 4, t = k % 4;
  int u;
  if (f == kFmtQ3_K || f == kFmtQ2_K) {
    u = (cb[64 * (v / 4) + 4 * j + t] >> (2 * (v % 4))) & 3;
    if (f == kFmtQ3_K) u |= ((cb[128 + 4 * j + t] >> v) & 1) << 2;
  } else {
    const uint8_t byte = cb[64 * (v / 2) + 4 * j + t];
    u = (v % 2) ? byte >> 4 : byte & 0x0F;
    if (f == kFmtQ6_K) u |= ((cb[256 + 64 * (v / 4) + 4 * j + t] >> (2 * (v % 4))) & 3) << 4;
    else if (f != kFmtQ4_K) u |= ((cb[256 + 4 * j + t] >> v) & 1) << 4;
  }
  const int sub = 2 * gi + k / 16;  // 16-element sub-block in the super-block
  switch (f) {
    case kFmtQ5_0: return d * static_cast<float>(u - 16);
    case kFmtQ5_1: return d * static_cast<float>(u) + dz;
    case kFmtQ4_K:
    case kFmtQ5_K: {
      const float dl = d * static_cast<float>(scp[gi * 16 + j]), ml = dz * static_cast<float>(scp[128 + gi * 16 + j]);
      return dl * static_cast<float>(u) - ml;
    }
    case kFmtQ6_K:
    case kFmtQ3_K: {
      const float dl = d * static_cast<float>(static_cast<int8_t>(scp[sub * 16 + j]));
      return dl * static_cast<float>(u - (f == kFmtQ6_K ? 32 : 4));
    }
    default: {  // Q2_K
      const uint8_t s = scp[sub * 16 + j];
      const float dl = d * static_cast<float>(s & 0x0F), ml = dz * static_cast<float>(s >> 4);
      return dl * static_cast<float>(u) - ml;
    }
  }
}

#if LOCALLLM_HAVE_FMT
namespace fmt {

inline __m256 ldh(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum(__m256 v) {  // halves, quarters, then pairs
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

// The formats' kernels are written once, over the vector width: V256 (AVX2: a 64-byte tile
// vector is two registers, rows 0-7 and 8-15) or V512 (AVX-512: one register, the 16 rows).
// Each lane is one output row; every operation a lane sees is the same in both, so the two
// builds give the same bits. What differs is only the integer dot product (isums below) and
// how many registers a tile takes (kChunks).
struct V256 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kRows = 8;                  // int32 / float lanes: rows per register
  static constexpr int kBytes = 4 * kRows;         // bytes of one register of codes
  static constexpr int kChunks = kTile / kRows;    // registers per 16-row tile vector
  static I ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bytes(int c) { return _mm256_set1_epi8(static_cast<char>(c)); }
  static I i32(int v) { return _mm256_set1_epi32(v); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  template <int N> static I shl16(I a) { return N == 0 ? a : _mm256_slli_epi16(a, N); }
  template <int N> static I shr16(I a) { return N == 0 ? a : _mm256_srli_epi16(a, N); }
  static I shr32_4(I a) { return _mm256_srli_epi32(a, 4); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static F half(const uint8_t* p) { return ldh(p); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set(float v) { return _mm256_set1_ps(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static I b4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  // S0, S1: per row (int32 lane) the exact sums of u * xq over k = 0..15 and 16..31, by
  // vpmaddubsw (u8 x s8 pairs to int16) and vpmaddwd by ones. Each product vector is added as it
  // comes (a tree of adds over all eight made the compiler spill them).
  template <int Fmt>
  static void isums(const I* c, const int8_t* xg, I& S0, I& S1) {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (Fmt == kFmtQ6_K) {  // two 6-bit pairs per 16-bit lane at most
      __m256i S[2];
      for (int half = 0; half < 2; ++half) {
        const __m256i* ch = c + 4 * half;
        const int8_t* xh = xg + 16 * half;
        const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(ch[0], b4(xh)), _mm256_maddubs_epi16(ch[1], b4(xh + 4)));
        const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(ch[2], b4(xh + 8)), _mm256_maddubs_epi16(ch[3], b4(xh + 12)));
        S[half] = _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones));
      }
      S0 = S[0], S1 = S[1];
    } else {  // four pairs of at most 5-bit codes per 16-bit lane
      __m256i a = _mm256_maddubs_epi16(c[0], b4(xg));
      for (int v = 1; v < 4; ++v) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(c[v], b4(xg + 4 * v)));
      S0 = _mm256_madd_epi16(a, ones);
      a = _mm256_maddubs_epi16(c[4], b4(xg + 16));
      for (int v = 5; v < 8; ++v) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(c[v], b4(xg + 4 * v)));
      S1 = _mm256_madd_epi16(a, ones);
    }
  }
};

#if LOCALLLM_HAVE_VNNI
struct V512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kRows = 16;
  static constexpr int kBytes = 4 * kRows;
  static constexpr int kChunks = kTile / kRows;
  static I ld(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I bytes(int c) { return _mm512_set1_epi8(static_cast<char>(c)); }
  static I i32(int v) { return _mm512_set1_epi32(v); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  template <int N> static I shl16(I a) { return N == 0 ? a : _mm512_slli_epi16(a, N); }
  template <int N> static I shr16(I a) { return N == 0 ? a : _mm512_srli_epi16(a, N); }
  static I shr32_4(I a) { return _mm512_srli_epi32(a, 4); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set(float v) { return _mm512_set1_ps(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  // The same sums by vpdpbusd: four u8 x s8 products added into each int32 lane, no
  // intermediate 16-bit sums, so no pairing is needed for any code width.
  template <int Fmt>
  static void isums(const I* c, const int8_t* xg, I& S0, I& S1) {
    I a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) {
      a = _mm512_dpbusd_epi32(a, c[v], bcast4(xg + 4 * v));
      b = _mm512_dpbusd_epi32(b, c[4 + v], bcast4(xg + 16 + 4 * v));
    }
    S0 = a, S1 = b;
  }
};
using VBest = V512;
#else
using VBest = V256;
#endif

// The 8 code vectors c[v] (the rows of register H of each 64-byte tile vector, k = 4v..4v+3,
// one byte each) of the group at cb. (16-bit shifts are safe: the bits they carry across a byte
// boundary land outside each mask.)
template <int Fmt, class V>
inline void decode(const uint8_t* cb, int H, typename V::I* c) {
  using I = typename V::I;
  const I m4 = V::bytes(0x0F), m2 = V::bytes(3);
  const int at = V::kBytes * H;
  if constexpr (Fmt == kFmtQ3_K || Fmt == kFmtQ2_K) {
    for (int s = 0; s < 2; ++s) {
      const I v = V::ld(cb + 64 * s + at);
      c[4 * s] = V::band(v, m2);
      c[4 * s + 1] = V::band(V::template shr16<2>(v), m2);
      c[4 * s + 2] = V::band(V::template shr16<4>(v), m2);
      c[4 * s + 3] = V::band(V::template shr16<6>(v), m2);
    }
    if constexpr (Fmt == kFmtQ3_K) {  // bit v of the 1-bit plane -> bit 2 of c[v]
      const I hv = V::ld(cb + 128 + at), b2 = V::bytes(4);
      c[0] = V::bor(c[0], V::band(V::template shl16<2>(hv), b2));
      c[1] = V::bor(c[1], V::band(V::template shl16<1>(hv), b2));
      c[2] = V::bor(c[2], V::band(hv, b2));
      c[3] = V::bor(c[3], V::band(V::template shr16<1>(hv), b2));
      c[4] = V::bor(c[4], V::band(V::template shr16<2>(hv), b2));
      c[5] = V::bor(c[5], V::band(V::template shr16<3>(hv), b2));
      c[6] = V::bor(c[6], V::band(V::template shr16<4>(hv), b2));
      c[7] = V::bor(c[7], V::band(V::template shr16<5>(hv), b2));
    }
  } else {
    for (int s = 0; s < 4; ++s) {
      const I v = V::ld(cb + 64 * s + at);
      c[2 * s] = V::band(v, m4);
      c[2 * s + 1] = V::band(V::template shr16<4>(v), m4);
    }
    if constexpr (Fmt == kFmtQ6_K) {  // bits 2h..2h+1 of 2-bit vector s -> bits 4-5 of c[4s + h]
      const I b45 = V::bytes(0x30);
      for (int s = 0; s < 2; ++s) {
        const I hv = V::ld(cb + 256 + 64 * s + at);
        c[4 * s] = V::bor(c[4 * s], V::band(V::template shl16<4>(hv), b45));
        c[4 * s + 1] = V::bor(c[4 * s + 1], V::band(V::template shl16<2>(hv), b45));
        c[4 * s + 2] = V::bor(c[4 * s + 2], V::band(hv, b45));
        c[4 * s + 3] = V::bor(c[4 * s + 3], V::band(V::template shr16<2>(hv), b45));
      }
    } else if constexpr (Fmt != kFmtQ4_K) {  // 5-bit: bit v of the 1-bit plane -> bit 4 of c[v]
      const I hv = V::ld(cb + 256 + at), b4m = V::bytes(0x10);
      c[0] = V::bor(c[0], V::band(V::template shl16<4>(hv), b4m));
      c[1] = V::bor(c[1], V::band(V::template shl16<3>(hv), b4m));
      c[2] = V::bor(c[2], V::band(V::template shl16<2>(hv), b4m));
      c[3] = V::bor(c[3], V::band(V::template shl16<1>(hv), b4m));
      c[4] = V::bor(c[4], V::band(hv, b4m));
      c[5] = V::bor(c[5], V::band(V::template shr16<1>(hv), b4m));
      c[6] = V::bor(c[6], V::band(V::template shr16<2>(hv), b4m));
      c[7] = V::bor(c[7], V::band(V::template shr16<3>(hv), b4m));
    }
  }
}

// HALVES registers of one tile (from register H0) for activation rows m0 .. m0 + MT.
template <int Fmt, class V, int MT, int PASSES, int HALVES, int H0>
inline void tile_kernel(const uint8_t* tile, int64_t K, const int8_t* xq, const float* xs, const int32_t* x16,
                        int64_t M, int64_t m0, float* y, int64_t ldy, int64_t n0) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr FmtInfo fi = fmt_info(Fmt);
  constexpr int GS = fi.sb / kGroup;
  constexpr int R = V::kRows;
  const int64_t G = K / kGroup, nsb = K / fi.sb;
  F acc[HALVES][MT];
  for (int h = 0; h < HALVES; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = V::zero();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* sbp = tile + sb * fi.sb_bytes();
    // One row streams the weights: software prefetch, except where Zen 4's hardware prefetcher streams
    // faster alone (one row through 8 random 8192x2048 matrices, 2 threads, three A/B pairs, GB/s with /
    // without: Q6_K 14.9-21.3 / 24.3-32.7, Q5_K 15.9-18.8 / 16.9-24.2, Q5_0 29.0-33.6 / 33.1-35.2; Q2_K
    // 30.2-35.9 / 14.0-25.6 and Q3_K (mixed) keep it). AVX2 keeps it everywhere (kStreamAhead).
    constexpr bool kPrefetch = V::kRows == 8 || Fmt == kFmtQ2_K || Fmt == kFmtQ3_K;
    if constexpr (MT == 1 && kPrefetch) prefetch_rows(sbp + kStreamAhead, fi.sb_bytes());
    const uint8_t* scp = sbp + GS * fi.cb;
    const uint8_t* dp = scp + fi.scb;
    F D[HALVES], Z[HALVES];
    for (int h = 0; h < HALVES; ++h) {
      D[h] = V::half(dp + 2 * R * (H0 + h));
      Z[h] = fi.z ? V::half(dp + 32 + 2 * R * (H0 + h)) : V::zero();
    }
    for (int gi = 0; gi < GS; ++gi) {
      const int64_t g = sb * GS + gi;
      for (int h = 0; h < HALVES; ++h) {
        const int H = H0 + h;
        I c[8];
        decode<Fmt, V>(sbp + gi * fi.cb, H, c);
        I a0, a1, b0, b1;
        if constexpr (Fmt == kFmtQ5_K || Fmt == kFmtQ4_K) {
          a0 = V::u8(scp + gi * 16 + R * H);
          b0 = V::u8(scp + 128 + gi * 16 + R * H);
        } else if constexpr (Fmt == kFmtQ6_K || Fmt == kFmtQ3_K) {
          a0 = V::s8(scp + 2 * gi * 16 + R * H);
          a1 = V::s8(scp + (2 * gi + 1) * 16 + R * H);
        } else if constexpr (Fmt == kFmtQ2_K) {
          const I s0 = V::u8(scp + 2 * gi * 16 + R * H), s1 = V::u8(scp + (2 * gi + 1) * 16 + R * H);
          const I m15 = V::i32(15);
          a0 = V::band(s0, m15);
          a1 = V::band(s1, m15);
          b0 = V::shr32_4(s0);
          b1 = V::shr32_4(s1);
        }
        (void)a0, (void)a1, (void)b0, (void)b1;
        // Q4_K, Q5_K: d sc and dmin m per row (exact float32 products of the file's values)
        F dsc = D[h], mmin = Z[h], mmin1 = Z[h];
        if constexpr (Fmt == kFmtQ5_K || Fmt == kFmtQ4_K) {
          dsc = V::fmul(D[h], V::cvt(a0));
          mmin = V::fmul(Z[h], V::cvt(b0));
        } else if constexpr (Fmt == kFmtQ2_K) {
          mmin = V::fmul(Z[h], V::cvt(b0));
          mmin1 = V::fmul(Z[h], V::cvt(b1));
        }
        (void)dsc, (void)mmin, (void)mmin1;
        for (int p = 0; p < PASSES; ++p) {
          for (int i = 0; i < MT; ++i) {
            const int64_t row = p * M + m0 + i;
            const int8_t* xg = xq + row * K + g * kGroup;
            const float sx = xs[row * G + g];
            const int32_t X0 = x16[row * 2 * G + 2 * g], X1 = x16[row * 2 * G + 2 * g + 1];
            I S0, S1;
            V::template isums<Fmt>(c, xg, S0, S1);
            const F dx = V::fmul(Fmt == kFmtQ5_K || Fmt == kFmtQ4_K ? dsc : D[h], V::set(sx));
            I Ti;
            if constexpr (Fmt == kFmtQ5_0) {
              Ti = V::sub(V::add(S0, S1), V::i32(16 * (X0 + X1)));
            } else if constexpr (Fmt == kFmtQ5_1) {
              Ti = V::add(S0, S1);
            } else if constexpr (Fmt == kFmtQ5_K || Fmt == kFmtQ4_K) {
              Ti = V::add(S0, S1);  // times d sc in dx
            } else if constexpr (Fmt == kFmtQ6_K || Fmt == kFmtQ3_K) {
              constexpr int off = Fmt == kFmtQ6_K ? 32 : 4;
              Ti = V::add(V::mul(a0, V::sub(S0, V::i32(off * X0))), V::mul(a1, V::sub(S1, V::i32(off * X1))));
            } else {  // Q2_K
              Ti = V::add(V::mul(a0, S0), V::mul(a1, S1));
            }
            acc[h][i] = V::fma(V::cvt(Ti), dx, acc[h][i]);
            if constexpr (Fmt == kFmtQ5_1) {
              acc[h][i] = V::fma(Z[h], V::set(sx * static_cast<float>(X0 + X1)), acc[h][i]);
            } else if constexpr (Fmt == kFmtQ5_K || Fmt == kFmtQ4_K) {
              acc[h][i] = V::fnma(mmin, V::set(sx * static_cast<float>(X0 + X1)), acc[h][i]);
            } else if constexpr (Fmt == kFmtQ2_K) {
              acc[h][i] = V::fnma(mmin, V::set(sx * static_cast<float>(X0)), acc[h][i]);
              acc[h][i] = V::fnma(mmin1, V::set(sx * static_cast<float>(X1)), acc[h][i]);
            }
          }
        }
      }
    }
  }
  for (int h = 0; h < HALVES; ++h)
    for (int i = 0; i < MT; ++i) V::store(y + (m0 + i) * ldy + n0 + R * (H0 + h), acc[h][i]);
}

// Rows of activations per call of the multi-row kernel, per vector width (AVX2: one register of
// the tile at a time, 4 rows; AVX-512: the whole tile, 4 rows).
template <class V>
constexpr int kFmtRows = kMTile;

template <int Fmt, class V, int PASSES>
void gemm(const uint8_t* w, int64_t Np, int64_t K, const int8_t* xq, const float* xs, const int32_t* x16, int64_t M,
          float* y) {
  constexpr FmtInfo fi = fmt_info(Fmt);
  constexpr int MT = kFmtRows<V>;
  const int64_t tiles = Np / kTile;
  const int64_t tile_bytes = (K / fi.sb) * fi.sb_bytes();
  const int64_t chunk = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, tile_bytes) / std::max<int64_t>(1, M / 4));
  parallel_chunks(tiles, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* tile = w + t * tile_bytes;
      int64_t m0 = 0;
      for (; m0 + MT <= M; m0 += MT) {
        tile_kernel<Fmt, V, MT, PASSES, 1, 0>(tile, K, xq, xs, x16, M, m0, y, Np, t * kTile);
        if constexpr (V::kChunks == 2) tile_kernel<Fmt, V, MT, PASSES, 1, 1>(tile, K, xq, xs, x16, M, m0, y, Np, t * kTile);
      }
      // one row: the whole tile per group (the tile is read once, front to back, as it streams in)
      for (; m0 < M; ++m0) tile_kernel<Fmt, V, 1, PASSES, V::kChunks, 0>(tile, K, xq, xs, x16, M, m0, y, Np, t * kTile);
    }
  });
}

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
    for (int r = 0; r < NR; ++r) {
      a0[r] = _mm256_fmadd_ps(ldw<BF>(w + r * K + k), x0, a0[r]);
      a1[r] = _mm256_fmadd_ps(ldw<BF>(w + r * K + k + 8), x1, a1[r]);
    }
  }
  for (int r = 0; r < NR; ++r) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
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
        else out[m * NR + r] = hsum(_mm256_add_ps(_mm256_load_ps(first[m][r]), a[m][r]));
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
#endif  // LOCALLLM_HAVE_FMT

// x float32 [M, K] contiguous, w uint8 packed (see above) for N x K -> y float32 [M, N].
// bits: the format id (4, 8, or one of the kFmt* above). N need not be a multiple of 16: the
// quantized formats pack whole tiles (zero rows at the end), computed and then sliced off.
// passes: 1 = int8 activations; 2 = int8 activations plus their int8-quantized residual (the
// float formats take x as it is and ignore it).
torch::Tensor qgemm(torch::Tensor x, torch::Tensor w, int64_t bits, int64_t N, int64_t K, int64_t passes) {
  TORCH_CHECK(supported(), "localllm qgemm: built without native kernels (AVX-512 VNNI or AVX2)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "qgemm: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "qgemm: x must be float32");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "qgemm: w must be contiguous uint8");
  TORCH_CHECK(is_fmt(bits), "qgemm: bits must be 4 or 8 or a format id");
  TORCH_CHECK(passes == 1 || passes == 2, "qgemm: passes must be 1 or 2");
  TORCH_CHECK(N > 0 && K > 0 && K % kGroup == 0, "qgemm: K % 32 must be 0");
  TORCH_CHECK(!is_int_fmt(bits) || K % fmt_info(bits).sb == 0, "qgemm: K must be a multiple of the super-block");
  TORCH_CHECK(bits == 4 || bits == 8 || LOCALLLM_HAVE_FMT, "qgemm: this build has no kernels for format ", bits);
  TORCH_CHECK(w.numel() == fmt_packed_bytes(bits, N, K), "qgemm: packed size mismatch");
  x = x.contiguous();
  const int64_t M = x.size(0);
  const int64_t G = K / kGroup;
  const int64_t Np = is_float_fmt(bits) ? N : round_tile(N);
  auto y = torch::empty({M, Np}, x.options());
#if LOCALLLM_HAVE_NATIVE
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
#if LOCALLLM_HAVE_FMT
  if (is_float_fmt(bits)) {
    const uint16_t* w16 = reinterpret_cast<const uint16_t*>(wp);
    if (bits == kFmtF16) fmt::gemm_float<false>(w16, N, K, x.data_ptr<float>(), M, yp);
    else fmt::gemm_float<true>(w16, N, K, x.data_ptr<float>(), M, yp);
    return y;
  }
#endif
  std::vector<int8_t> xq(passes * M * K);
  std::vector<float> xs(passes * M * G);
  std::vector<int32_t> xsum(passes * M * G);
  quantize_rows(x.data_ptr<float>(), M, K, static_cast<int>(passes), xq.data(), xs.data(), xsum.data());
  if (bits == 4 && passes == 1) gemm<4, 1>(wp, Np, K, xq.data(), xs.data(), xsum.data(), M, yp);
  if (bits == 4 && passes == 2) gemm<4, 2>(wp, Np, K, xq.data(), xs.data(), xsum.data(), M, yp);
  if (bits == 8 && passes == 1) gemm<8, 1>(wp, Np, K, xq.data(), xs.data(), xsum.data(), M, yp);
  if (bits == 8 && passes == 2) gemm<8, 2>(wp, Np, K, xq.data(), xs.data(), xsum.data(), M, yp);
#if LOCALLLM_HAVE_FMT
  if (is_int_fmt(bits)) {
    // per 16 activation codes, their sum (the zero points' and mins' share)
    std::vector<int32_t> x16(passes * M * 2 * G);
    for (int64_t i = 0; i < passes * M * 2 * G; ++i) {
      const int8_t* q = xq.data() + i * 16;
      int32_t s = 0;
      for (int j = 0; j < 16; ++j) s += q[j];
      x16[i] = s;
    }
    const int32_t* xp = x16.data();
#define LOCALLLM_FMT_CASE(F)                                                        \
  if (bits == F) {                                                                  \
    if (passes == 1) fmt::gemm<F, fmt::VBest, 1>(wp, Np, K, xq.data(), xs.data(), xp, M, yp); \
    else fmt::gemm<F, fmt::VBest, 2>(wp, Np, K, xq.data(), xs.data(), xp, M, yp);             \
  }
    LOCALLLM_FMT_CASE(kFmtQ5_0)
    LOCALLLM_FMT_CASE(kFmtQ5_1)
    LOCALLLM_FMT_CASE(kFmtQ4_K)
    LOCALLLM_FMT_CASE(kFmtQ5_K)
    LOCALLLM_FMT_CASE(kFmtQ6_K)
    LOCALLLM_FMT_CASE(kFmtQ3_K)
    LOCALLLM_FMT_CASE(kFmtQ2_K)
#undef LOCALLLM_FMT_CASE
  }
#endif
#endif
  return Np == N ? y : y.narrow(1, 0, N).contiguous();
}

// The activation codes exactly as qgemm makes them: xq int8 [passes, M, K], xs float
// [passes, M, K/32], xsum int32 [passes, M, K/32].
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t passes) {
  TORCH_CHECK(supported(), "localllm qgemm: built without native kernels (AVX-512 VNNI or AVX2)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) % kGroup == 0,
              "quantize_activations: x must be float32 [M, K] with K % 32 == 0");
  TORCH_CHECK(passes == 1 || passes == 2, "quantize_activations: passes must be 1 or 2");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  auto xq = torch::empty({passes, M, K}, x.options().dtype(torch::kInt8));
  auto xs = torch::empty({passes, M, G}, x.options());
  auto xsum = torch::empty({passes, M, G}, x.options().dtype(torch::kInt32));
#if LOCALLLM_HAVE_NATIVE
  quantize_rows(x.data_ptr<float>(), M, K, static_cast<int>(passes), xq.data_ptr<int8_t>(), xs.data_ptr<float>(),
                xsum.data_ptr<int32_t>());
#endif
  return {xq, xs, xsum};
}


// ---------------------------------------------------------------------------------------------
// Elementwise and attention ops of a decoder layer, float32, so that a decode step is a few
// calls per layer instead of dozens of small torch ops. References: the reference ops of
// TorchBackend (localllm/kernels/torch_backend.py) and paged_attention in localllm/kernels/attention.py.

#if LOCALLLM_HAVE_VNNI

// exp(x) for a vector (Cephes' polynomial, relative error ~2e-7; inputs below -87 give 0).
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f), hi = _mm512_set1_ps(88.37626f);
  __m512 under = _mm512_set1_ps(0.0f);
  __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_mask_blend_ps(tiny, _mm512_scalef_ps(p, fx), under);
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

void rms_rows(const float* x, const float* w, float eps, int64_t T, int64_t H, float* out) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x + t * H;
      float* o = out + t * H;
      const float ss = dot(xr, xr, H);
      const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(H) + eps));
      for (int64_t i = 0; i < H; i += 16)
        _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), scale), _mm512_loadu_ps(w + i)));
    }
  });
}

#endif  // LOCALLLM_HAVE_VNNI

#if LOCALLLM_HAVE_AVX2

// exp(x) for 8 lanes: exp512's polynomial, and its scaling by 2^n (n in [-126, 128]) as two
// exact power-of-two products (2^128 is no float), i.e. vscalefps's single rounding.
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.37626f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_cvtps_epi32(fx);
  const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(_mm256_mul_ps(p, f1), f2));
}

// n % 16 == 0; the same sum as the AVX-512 dot (lanes j and j + 8 of its accumulator are a0, a1)
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
  }
  return hsum8(_mm256_add_ps(a1, a0));
}

void rms_rows(const float* x, const float* w, float eps, int64_t T, int64_t H, float* out) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x + t * H;
      float* o = out + t * H;
      const float ss = dot(xr, xr, H);
      const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(ss / static_cast<float>(H) + eps));
      for (int64_t i = 0; i < H; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), scale), _mm256_loadu_ps(w + i)));
    }
  });
}

#endif  // LOCALLLM_HAVE_AVX2

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(),
              what, " must be a contiguous float32 CPU tensor");
}

// x float32 [T, H] (H % 16 == 0) -> x / sqrt(mean(x^2) + eps) * w
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "rms_norm: x");
  check_f32(w, "rms_norm: weight");
  const int64_t H = x.size(-1), T = x.numel() / H;
  TORCH_CHECK(H % 16 == 0 && w.numel() == H, "rms_norm: hidden size must be a multiple of 16");
  auto out = torch::empty_like(x);
#if LOCALLLM_HAVE_NATIVE
  rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), T, H, out.data_ptr<float>());
#endif
  return out;
}

// (rms_norm(residual + x), residual + x)
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_f32(x, "add_rms_norm: x");
  check_f32(residual, "add_rms_norm: residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: shapes differ");
  auto h = torch::add(residual, x);
  return {rms_norm(h, w, eps), h};
}

// The KV cache holds float32 or float16 (c10::Half) values.
void check_kv_cache(const torch::Tensor& kv_cache, const char* what) {
  TORCH_CHECK((kv_cache.scalar_type() == torch::kFloat32 || kv_cache.scalar_type() == torch::kFloat16) &&
                  kv_cache.is_contiguous() && kv_cache.device().is_cpu(),
              what, " must be a contiguous float32 or float16 CPU tensor");
}

inline void store_kv(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_kv(c10::Half* dst, const float* src, int64_t n) {  // round to nearest even, as .to(float16)
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}

template <typename T>
void rope_write_impl(const float* src, const int64_t* pos, const int64_t* slot, const float* ct, const float* st,
                     float* qd, T* kc, T* vc, int64_t T_, int64_t nh, int64_t nkv, int64_t hd, bool neox) {
  const int64_t width = (nh + 2 * nkv) * hd, half = hd / 2;
  at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(hd);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = ct + pos[t] * half;
      const float* s = st + pos[t] * half;
      const float* row = src + t * width;
      auto rotate = [&](const float* x, float* o) {
        if (neox) {
          for (int64_t i = 0; i < half; ++i) {
            const float a = x[i], b = x[i + half];
            o[i] = a * c[i] - b * s[i];
            o[i + half] = b * c[i] + a * s[i];
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float a = x[2 * i], b = x[2 * i + 1];
            o[2 * i] = a * c[i] - b * s[i];
            o[2 * i + 1] = b * c[i] + a * s[i];
          }
        }
      };
      for (int64_t h = 0; h < nh; ++h) rotate(row + h * hd, qd + (t * nh + h) * hd);
      for (int64_t h = 0; h < nkv; ++h) {
        rotate(row + (nh + h) * hd, rotated.data());
        store_kv(kc + (slot[t] * nkv + h) * hd, rotated.data(), hd);
        store_kv(vc + (slot[t] * nkv + h) * hd, row + (nh + nkv + h) * hd, hd);
      }
    }
  });
}

// Rotate q and k of a fused projection qkv [T, (nh + 2 nkv) * hd] with RoPE (cos/sin tables
// [max_pos, hd / 2]; neox: halves, else adjacent pairs), write the rotated k and v into
// kv_cache [2, blocks, block_size, nkv, hd] (float32 or float16) at slot_mapping [T]; return
// the rotated q [T, nh, hd].
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor kv_cache, torch::Tensor slot_mapping, int64_t nh, int64_t nkv, int64_t hd,
                            bool neox) {
  check_f32(qkv, "rope_write_kv: qkv");
  check_f32(cos, "rope_write_kv: cos");
  check_f32(sin, "rope_write_kv: sin");
  check_kv_cache(kv_cache, "rope_write_kv: kv_cache");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slot_mapping.scalar_type() == torch::kInt64 &&
                  positions.is_contiguous() && slot_mapping.is_contiguous(),
              "rope_write_kv: positions and slot_mapping must be contiguous int64");
  const int64_t T = qkv.size(0), width = (nh + 2 * nkv) * hd, half = hd / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width && hd % 32 == 0, "rope_write_kv: bad qkv shape");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(), "rope_write_kv: bad tables");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == nkv && kv_cache.size(4) == hd,
              "rope_write_kv: bad kv_cache shape");
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T, "rope_write_kv: one position and slot per token");
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2), max_pos = cos.size(0);
  auto q = torch::empty({T, nh, hd}, qkv.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope_write_kv: position out of range");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "rope_write_kv: slot out of range");
  }
  const float* src = qkv.data_ptr<float>();
  if (kv_cache.scalar_type() == torch::kFloat16) {
    c10::Half* kc = kv_cache.data_ptr<c10::Half>();
    rope_write_impl(src, pos, slot, cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(), kc,
                    kc + slots * nkv * hd, T, nh, nkv, hd, neox);
  } else {
    float* kc = kv_cache.data_ptr<float>();
    rope_write_impl(src, pos, slot, cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(), kc,
                    kc + slots * nkv * hd, T, nh, nkv, hd, neox);
  }
  return q;
}

#if LOCALLLM_HAVE_VNNI

inline __m512 load_kv(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_kv(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The lane sums of a[0..15], as one vector: lane j = a[j][0] + ... + a[j][15].
inline __m512 transpose_sum16(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a[2i] and a[2i+1] halved to 2 partial sums each
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the sums of a[4i .. 4i+3] over that lane
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// One sequence's decode attention, all heads: q [nh, hd] -> out [nh, hd]. NV = hd / 16 when
// known at compile time (0: read nv). K, then V, are streamed block by block (two blocks
// ahead prefetched): 16 tokens' scores per head from register accumulators (one transposed lane
// sum), the output accumulated in registers per KV head over each block.
template <int NV, typename T>
void attend_sequence(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t ctx, int64_t nh,
                     int64_t nkv, int64_t nv_, int64_t bs, float scale, float* out, std::vector<float>& scores) {
  const int64_t nv = NV ? NV : nv_, hd = nv * 16, group = nh / nkv, row = nkv * hd;
  const int64_t nblk = (ctx + bs - 1) / bs, padded = (ctx + 15) / 16 * 16;
  scores.assign(nh * padded, -INFINITY);
  // the K blocks then the V blocks, read in that order: each prefetched kAhead blocks early
  constexpr int64_t kAhead = 2;
  auto prefetch_block = [&](int64_t i) {
    if (i < nblk) prefetch_rows(kc + table[i] * bs * row, bs * row);
    else if (i < 2 * nblk) prefetch_rows(vc + table[i - nblk] * bs * row, bs * row);
  };
  for (int64_t i = 1; i < kAhead; ++i) prefetch_block(i);
  for (int64_t b = 0; b < nblk; ++b) {
    const T* kb = kc + table[b] * bs * row;
    prefetch_block(b + kAhead);
    const int64_t n = std::min<int64_t>(bs, ctx - b * bs);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t w = std::min<int64_t>(16, n - t0);
      for (int64_t hq = 0; hq < nh; ++hq) {
        __m512 qv[16];
        for (int64_t i = 0; i < nv; ++i) qv[i] = _mm512_loadu_ps(q + hq * hd + 16 * i);
        const T* kr = kb + t0 * row + (hq / group) * hd;
        __m512 acc[16];
        for (int t = 0; t < 16; ++t) {
          if (t < w) {
            __m512 a = _mm512_mul_ps(qv[0], load_kv(kr + t * row));
            for (int64_t i = 1; i < nv; ++i) a = _mm512_fmadd_ps(qv[i], load_kv(kr + t * row + 16 * i), a);
            acc[t] = a;
          } else {
            acc[t] = _mm512_setzero_ps();
          }
        }
        const __m512 s = _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores.data() + hq * padded + b * bs + t0, static_cast<__mmask16>((1u << w) - 1), s);
      }
    }
  }
  float inv[256];
  for (int64_t hq = 0; hq < nh; ++hq) {
    float* sg = scores.data() + hq * padded;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + t));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < padded; t += 16) {
      __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m));  // padding: exp(-inf) = 0
      _mm512_storeu_ps(sg + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv[hq] = 1.0f / _mm512_reduce_add_ps(sum);
    for (int64_t i = 0; i < hd; i += 16) _mm512_storeu_ps(out + hq * hd + i, _mm512_setzero_ps());
  }
  // heads per pass over a block: their accumulators (heads x nv vectors) stay in 16 registers
  constexpr int64_t kPer = NV ? 16 / NV : 1;
  const int64_t per_pass = std::min<int64_t>(group, kPer);
  for (int64_t b = 0; b < nblk; ++b) {
    const T* vb = vc + table[b] * bs * row;
    prefetch_block(nblk + b + kAhead);
    const int64_t n = std::min<int64_t>(bs, ctx - b * bs);
    for (int64_t g = 0; g < nkv; ++g) {
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += per_pass) {
        const int64_t nhp = std::min<int64_t>(per_pass, (g + 1) * group - h0);
        __m512 acc[16];
        for (int64_t j = 0; j < kPer; ++j)
          if (j < nhp)
            for (int64_t i = 0; i < nv; ++i) acc[j * nv + i] = _mm512_loadu_ps(out + (h0 + j) * hd + 16 * i);
        for (int64_t t = 0; t < n; ++t) {
          const T* vr = vb + t * row + g * hd;
          __m512 v[16];
          for (int64_t i = 0; i < nv; ++i) v[i] = load_kv(vr + 16 * i);
          const float* p = scores.data() + h0 * padded + b * bs + t;
          for (int64_t j = 0; j < kPer; ++j)
            if (j < nhp) {
              const __m512 pj = _mm512_set1_ps(p[j * padded]);
              for (int64_t i = 0; i < nv; ++i) acc[j * nv + i] = _mm512_fmadd_ps(pj, v[i], acc[j * nv + i]);
            }
        }
        for (int64_t j = 0; j < kPer; ++j)
          if (j < nhp)
            for (int64_t i = 0; i < nv; ++i) _mm512_storeu_ps(out + (h0 + j) * hd + 16 * i, acc[j * nv + i]);
      }
    }
  }
  for (int64_t hq = 0; hq < nh; ++hq) {
    const __m512 f = _mm512_set1_ps(inv[hq]);
    for (int64_t i = 0; i < hd; i += 16)
      _mm512_storeu_ps(out + hq * hd + i, _mm512_mul_ps(f, _mm512_loadu_ps(out + hq * hd + i)));
  }
}

template <typename T>
void decode_attention_impl(const float* qd, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens,
                           int64_t max_blocks, int64_t nd, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float sc,
                           float* od) {
  const int64_t nv = hd / 16;
  parallel_chunks(nd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t seq = begin; seq < end; ++seq) {
      const float* q = qd + seq * nh * hd;
      const int64_t* table = tables + seq * max_blocks;
      float* out = od + seq * nh * hd;
      switch (nv) {
        case 2: attend_sequence<2>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores); break;
        case 4: attend_sequence<4>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores); break;
        case 8: attend_sequence<8>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores); break;
        default: attend_sequence<0>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores);
      }
    }
  });
}

#endif  // LOCALLLM_HAVE_VNNI

#if LOCALLLM_HAVE_AVX2

inline __m256 load_kv(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_kv(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The lane sums of a[0..7], as one vector: lane j = a[j][0] + ... + a[j][7].
inline __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  // per 128-bit lane: the sums of a[0..3] (u0) and a[4..7] (u1) over that lane
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The AVX-512 attend_sequence in 8 lanes: NV = hd / 8 when known at compile time (0: read nv).
// Scores for 8 tokens per head at a time (one transposed lane sum); the output accumulated in
// registers over each block, for up to 8 vectors at a time (of one head, or of two heads of
// 32 elements).
template <int NV, typename T>
void attend_sequence(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t ctx, int64_t nh,
                     int64_t nkv, int64_t nv_, int64_t bs, float scale, float* out, std::vector<float>& scores) {
  const int64_t nv = NV ? NV : nv_, hd = nv * 8, group = nh / nkv, row = nkv * hd;
  const int64_t nblk = (ctx + bs - 1) / bs, padded = (ctx + 7) / 8 * 8;
  scores.assign(nh * padded, -INFINITY);
  constexpr int64_t kAhead = 2;
  auto prefetch_block = [&](int64_t i) {
    if (i < nblk) prefetch_rows(kc + table[i] * bs * row, bs * row);
    else if (i < 2 * nblk) prefetch_rows(vc + table[i - nblk] * bs * row, bs * row);
  };
  for (int64_t i = 1; i < kAhead; ++i) prefetch_block(i);
  for (int64_t b = 0; b < nblk; ++b) {
    const T* kb = kc + table[b] * bs * row;
    prefetch_block(b + kAhead);
    const int64_t n = std::min<int64_t>(bs, ctx - b * bs);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const int64_t w = std::min<int64_t>(8, n - t0);
      for (int64_t hq = 0; hq < nh; ++hq) {
        const float* qh = q + hq * hd;
        const T* kr = kb + t0 * row + (hq / group) * hd;
        __m256 acc[8];
        for (int t = 0; t < 8; ++t) {
          if (t < w) {
            __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qh), load_kv(kr + t * row));
            for (int64_t i = 1; i < nv; ++i) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), load_kv(kr + t * row + 8 * i), a);
            acc[t] = a;
          } else {
            acc[t] = _mm256_setzero_ps();
          }
        }
        const __m256 s = _mm256_mul_ps(transpose_sum8(acc), _mm256_set1_ps(scale));
        float* dst = scores.data() + hq * padded + b * bs + t0;
        if (w == 8) {
          _mm256_storeu_ps(dst, s);
        } else {
          alignas(32) float part[8];
          _mm256_store_ps(part, s);
          std::memcpy(dst, part, w * sizeof(float));
        }
      }
    }
  }
  float inv[256];
  for (int64_t hq = 0; hq < nh; ++hq) {
    float* sg = scores.data() + hq * padded;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + t));
    const __m256 m = _mm256_set1_ps(hmax8(mx));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m));  // padding: exp(-inf) = 0
      _mm256_storeu_ps(sg + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    inv[hq] = 1.0f / hsum8(sum);
    for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(out + hq * hd + i, _mm256_setzero_ps());
  }
  // per pass over a block: kPer heads x kChunk vectors of accumulators (at most 8 registers)
  constexpr int64_t kChunk = NV ? (NV < 8 ? NV : 8) : 8;
  constexpr int64_t kPer = NV ? (8 / kChunk > 0 ? 8 / kChunk : 1) : 1;
  const int64_t per_pass = std::min<int64_t>(group, kPer);
  for (int64_t b = 0; b < nblk; ++b) {
    const T* vb = vc + table[b] * bs * row;
    prefetch_block(nblk + b + kAhead);
    const int64_t n = std::min<int64_t>(bs, ctx - b * bs);
    for (int64_t g = 0; g < nkv; ++g) {
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += per_pass) {
        const int64_t nhp = std::min<int64_t>(per_pass, (g + 1) * group - h0);
        for (int64_t c0 = 0; c0 < nv; c0 += kChunk) {
          const int64_t nc = std::min<int64_t>(kChunk, nv - c0);
          __m256 acc[kPer * kChunk];
          for (int64_t j = 0; j < kPer; ++j)
            if (j < nhp)
              for (int64_t i = 0; i < kChunk; ++i)
                if (i < nc) acc[j * kChunk + i] = _mm256_loadu_ps(out + (h0 + j) * hd + 8 * (c0 + i));
          for (int64_t t = 0; t < n; ++t) {
            const T* vr = vb + t * row + g * hd + 8 * c0;
            const float* p = scores.data() + h0 * padded + b * bs + t;
            __m256 pj[kPer];
            for (int64_t j = 0; j < kPer; ++j)
              if (j < nhp) pj[j] = _mm256_set1_ps(p[j * padded]);
            for (int64_t i = 0; i < kChunk; ++i)
              if (i < nc) {
                const __m256 v = load_kv(vr + 8 * i);
                for (int64_t j = 0; j < kPer; ++j)
                  if (j < nhp) acc[j * kChunk + i] = _mm256_fmadd_ps(pj[j], v, acc[j * kChunk + i]);
              }
          }
          for (int64_t j = 0; j < kPer; ++j)
            if (j < nhp)
              for (int64_t i = 0; i < kChunk; ++i)
                if (i < nc) _mm256_storeu_ps(out + (h0 + j) * hd + 8 * (c0 + i), acc[j * kChunk + i]);
        }
      }
    }
  }
  for (int64_t hq = 0; hq < nh; ++hq) {
    const __m256 f = _mm256_set1_ps(inv[hq]);
    for (int64_t i = 0; i < hd; i += 8)
      _mm256_storeu_ps(out + hq * hd + i, _mm256_mul_ps(f, _mm256_loadu_ps(out + hq * hd + i)));
  }
}

template <typename T>
void decode_attention_impl(const float* qd, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens,
                           int64_t max_blocks, int64_t nd, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float sc,
                           float* od) {
  const int64_t nv = hd / 8;
  parallel_chunks(nd, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t seq = begin; seq < end; ++seq) {
      const float* q = qd + seq * nh * hd;
      const int64_t* table = tables + seq * max_blocks;
      float* out = od + seq * nh * hd;
      switch (nv) {
        case 4: attend_sequence<4>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores); break;
        case 8: attend_sequence<8>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores); break;
        case 16: attend_sequence<16>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores); break;
        default: attend_sequence<0>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores);
      }
    }
  });
}

#endif  // LOCALLLM_HAVE_AVX2

// Decode attention straight from the paged cache (float32 or float16): q [nd, nh, hd] (one
// query per sequence, the first nd rows of block_tables [>= nd, max_blocks] / context_lens
// [>= nd]) -> out [nd, nh, hd] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  check_f32(q, "paged_decode_attention: q");
  check_kv_cache(kv_cache, "paged_decode_attention: kv_cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "paged_decode_attention: block_tables and context_lens must be int64");
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t nd = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nblocks = kv_cache.size(1), bs = kv_cache.size(2), nkv = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == hd && hd % 16 == 0 && hd <= 256 && nh % nkv == 0 && nh <= 256,
              "paged_decode_attention: bad shapes");
  TORCH_CHECK(block_tables.size(0) >= nd && context_lens.size(0) >= nd, "paged_decode_attention: too few sequences");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < nd; ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * bs, "paged_decode_attention: bad context length");
    for (int64_t b = 0; b < (lens[i] + bs - 1) / bs; ++b)
      TORCH_CHECK(tables[i * max_blocks + b] >= 0 && tables[i * max_blocks + b] < nblocks,
                  "paged_decode_attention: block id out of range");
  }
  auto out = torch::empty_like(q);
#if LOCALLLM_HAVE_NATIVE
  const int64_t half = nblocks * bs * nkv * hd;  // elements of K (V follows)
  if (kv_cache.scalar_type() == torch::kFloat16) {
    const c10::Half* kc = kv_cache.data_ptr<c10::Half>();
    decode_attention_impl(q.data_ptr<float>(), kc, kc + half, tables, lens, max_blocks, nd, nh, nkv, hd, bs,
                          static_cast<float>(scale), out.data_ptr<float>());
  } else {
    const float* kc = kv_cache.data_ptr<float>();
    decode_attention_impl(q.data_ptr<float>(), kc, kc + half, tables, lens, max_blocks, nd, nh, nkv, hd, bs,
                          static_cast<float>(scale), out.data_ptr<float>());
  }
#endif
  return out;
}

// silu(gate) * up for gate_up [T, 2 I] (gate first) -> [T, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "silu_mul: gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.dim() == 2 && I % 16 == 0 && gate_up.size(1) == 2 * I, "silu_mul: bad shape");
  auto out = torch::empty({T, I}, gate_up.options());
#if LOCALLLM_HAVE_VNNI
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < I; i += 16) {
        __m512 g = _mm512_loadu_ps(src + t * 2 * I + i);
        __m512 u = _mm512_loadu_ps(src + t * 2 * I + I + i);
        __m512 sg = _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_storeu_ps(dst + t * I + i, _mm512_mul_ps(sg, u));
      }
    }
  });
#elif LOCALLLM_HAVE_AVX2
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < I; i += 8) {
        __m256 g = _mm256_loadu_ps(src + t * 2 * I + i);
        __m256 u = _mm256_loadu_ps(src + t * 2 * I + I + i);
        __m256 sg = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(dst + t * I + i, _mm256_mul_ps(sg, u));
      }
    }
  });
#endif
  return out;
}

// One decoder layer for a decode-only step, every piece native (see NativeCpuOps.decoder_layer):
// h + mlp(post_norm(h + attn(input_norm(h)))). Biases are optional (undefined tensors).
// q/k/v come as one fused weight or three; gate/up as one fused weight or two. perms (GPTQ
// act-order) is empty, or holds each weight's input order in the order q/k/v (1 or 3), o,
// gate/up (1 or 2), down (None: the input as it is).
torch::Tensor decoder_layer(torch::Tensor h, torch::Tensor input_norm, std::vector<torch::Tensor> qkv_ws,
                            std::vector<int64_t> qkv_bits, c10::optional<torch::Tensor> qkv_bias, torch::Tensor o_w, int64_t o_bits,
                            torch::Tensor post_norm, std::vector<torch::Tensor> gate_up_ws,
                            std::vector<int64_t> gate_up_bits, torch::Tensor down_w, int64_t down_bits, int64_t nh,
                            int64_t nkv, int64_t hd, int64_t inter, double eps, torch::Tensor positions,
                            torch::Tensor cos, torch::Tensor sin, bool neox, torch::Tensor kv_cache,
                            torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                            double scale, int64_t passes, std::vector<c10::optional<torch::Tensor>> perms) {
  const int64_t T = h.size(0), H = h.size(1), width = (nh + 2 * nkv) * hd;
  const size_t nq = qkv_ws.size(), ng = gate_up_ws.size();
  TORCH_CHECK((nq == 1 || nq == 3) && qkv_bits.size() == nq, "decoder_layer: q/k/v weights: one fused or three");
  TORCH_CHECK((ng == 1 || ng == 2) && gate_up_bits.size() == ng, "decoder_layer: gate/up weights: one fused or two");
  TORCH_CHECK(perms.empty() || perms.size() == nq + ng + 2,
              "decoder_layer: perms: none, or one per weight (q/k/v, o, gate/up, down)");
  // GPTQ act-order: the input columns of weight i in its group order (None: as they are)
  auto gather = [&](const torch::Tensor& t, size_t i) {
    return perms.empty() || !perms[i].has_value() ? t : t.index_select(1, *perms[i]).contiguous();
  };
  const size_t o_at = nq, gate_up_at = nq + 1, down_at = nq + 1 + ng;
  auto x = rms_norm(h, input_norm, eps);
  torch::Tensor qkv;
  if (nq == 1) {
    qkv = qgemm(gather(x, 0), qkv_ws[0], qkv_bits[0], width, H, passes);
  } else {  // types (or input orders) that cannot share one repacked weight
    const int64_t widths[3] = {nh * hd, nkv * hd, nkv * hd};
    std::vector<torch::Tensor> parts;
    for (size_t i = 0; i < 3; ++i) parts.push_back(qgemm(gather(x, i), qkv_ws[i], qkv_bits[i], widths[i], H, passes));
    qkv = torch::cat(parts, 1);
  }
  if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  auto q = rope_write_kv(qkv, positions, cos, sin, kv_cache, slot_mapping, nh, nkv, hd, neox);
  auto o = paged_decode_attention(q, kv_cache, block_tables, context_lens, scale);
  auto a = qgemm(gather(o.view({T, nh * hd}), o_at), o_w, o_bits, H, nh * hd, passes);
  auto normed = add_rms_norm(a, h, post_norm, eps);
  auto gu = ng == 1 ? qgemm(gather(normed[0], gate_up_at), gate_up_ws[0], gate_up_bits[0], 2 * inter, H, passes)
                    : torch::cat({qgemm(gather(normed[0], gate_up_at), gate_up_ws[0], gate_up_bits[0], inter, H, passes),
                                  qgemm(gather(normed[0], gate_up_at + 1), gate_up_ws[1], gate_up_bits[1], inter, H,
                                        passes)},
                                 1);
  auto d = qgemm(gather(silu_mul(gu), down_at), down_w, down_bits, H, inter, passes);
  return normed[1].add_(d);
}

// For each row r of out [M, N] (float32), the columns c with out[r, c] >= max_r - (abs_margin[r]
// + rel_margin * |max_r|): returns (rows, cols) int64, row-major order.
std::vector<torch::Tensor> near_max(torch::Tensor out, torch::Tensor abs_margin, double rel_margin) {
  check_f32(out, "near_max: out");
  check_f32(abs_margin, "near_max: abs_margin");
  TORCH_CHECK(out.dim() == 2 && abs_margin.numel() == out.size(0), "near_max: one margin per row");
  const int64_t M = out.size(0), N = out.size(1);
  const float* o = out.data_ptr<float>();
  const float* am = abs_margin.data_ptr<float>();
  std::vector<int64_t> rows, cols;
  for (int64_t r = 0; r < M; ++r) {
    const float* x = o + r * N;
    float mx = -INFINITY;
    int64_t i = 0;
#if LOCALLLM_HAVE_VNNI
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= N; i += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(x + i));
    mx = _mm512_reduce_max_ps(vmx);
#elif LOCALLLM_HAVE_AVX2
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= N; i += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(x + i));
    mx = hmax8(vmx);
#endif
    for (; i < N; ++i) mx = std::max(mx, x[i]);
    const float thr = mx - (am[r] + static_cast<float>(rel_margin) * std::fabs(mx));
    i = 0;
#if LOCALLLM_HAVE_VNNI
    const __m512 vt = _mm512_set1_ps(thr);
    for (; i + 16 <= N; i += 16) {
      uint32_t mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vt, _CMP_GE_OQ);
      while (mask) {
        const int bit = __builtin_ctz(mask);
        rows.push_back(r);
        cols.push_back(i + bit);
        mask &= mask - 1;
      }
    }
#elif LOCALLLM_HAVE_AVX2
    const __m256 vt = _mm256_set1_ps(thr);
    for (; i + 8 <= N; i += 8) {
      uint32_t mask = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vt, _CMP_GE_OQ)));
      while (mask) {
        const int bit = __builtin_ctz(mask);
        rows.push_back(r);
        cols.push_back(i + bit);
        mask &= mask - 1;
      }
    }
#endif
    for (; i < N; ++i)
      if (x[i] >= thr) {
        rows.push_back(r);
        cols.push_back(i);
      }
  }
  auto opts = torch::TensorOptions().dtype(torch::kInt64);
  auto rt = torch::empty({static_cast<int64_t>(rows.size())}, opts);
  auto ct = torch::empty({static_cast<int64_t>(cols.size())}, opts);
  std::memcpy(rt.data_ptr<int64_t>(), rows.data(), rows.size() * sizeof(int64_t));
  std::memcpy(ct.data_ptr<int64_t>(), cols.data(), cols.size() * sizeof(int64_t));
  return {rt, ct};
}

// Rows ids [m] of a packed weight (see the top of this file and the formats above), dequantized:
// float32 [m, K], the file's values for the exact formats.
torch::Tensor dequant_rows(torch::Tensor w, int64_t bits, int64_t N, int64_t K, torch::Tensor ids) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "dequant_rows: w must be contiguous uint8");
  TORCH_CHECK(is_fmt(bits), "dequant_rows: bits must be 4 or 8 or a format id");
  TORCH_CHECK(K % kGroup == 0 && (!is_int_fmt(bits) || K % fmt_info(bits).sb == 0), "dequant_rows: bad K");
  TORCH_CHECK(w.numel() == fmt_packed_bytes(bits, N, K), "dequant_rows: packed size mismatch");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64, "dequant_rows: ids must be int64");
  const int64_t G = K / kGroup, block = bits == 4 ? 320 : 544;
  ids = ids.contiguous();
  const int64_t m = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "dequant_rows: row id out of range");
  auto out = torch::empty({m, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  if (is_float_fmt(bits)) {
    for (int64_t i = 0; i < m; ++i) {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(wp) + id[i] * K;
      for (int64_t k = 0; k < K; ++k) {
        if (bits == kFmtF16) {
          o[i * K + k] = static_cast<float>(c10::Half(src[k], c10::Half::from_bits()));
        } else {
          const uint32_t u = static_cast<uint32_t>(src[k]) << 16;
          std::memcpy(o + i * K + k, &u, 4);
        }
      }
    }
    return out;
  }
  if (is_int_fmt(bits)) {
    const FmtInfo fi = fmt_info(bits);
    const int64_t nsb = K / fi.sb, GS = fi.sb / kGroup, tile_bytes = nsb * fi.sb_bytes();
    for (int64_t i = 0; i < m; ++i) {
      const int64_t t = id[i] / kTile, j = id[i] % kTile;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* sbp = wp + t * tile_bytes + sb * fi.sb_bytes();
        for (int64_t gi = 0; gi < GS; ++gi)
          for (int k = 0; k < kGroup; ++k)
            o[i * K + (sb * GS + gi) * kGroup + k] = fmt_weight(bits, sbp, static_cast<int>(j), static_cast<int>(gi), k);
      }
    }
    return out;
  }
  for (int64_t i = 0; i < m; ++i) {
    const int64_t t = id[i] / kTile, j = id[i] % kTile;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* blk = wp + (t * G + g) * block;
      const at::Half* scales = reinterpret_cast<const at::Half*>(blk + (bits == 4 ? 256 : 512));
      const float d = static_cast<float>(scales[j]);
      const float z = bits == 4 ? static_cast<float>(scales[16 + j]) : -128.0f * d;
      float* dst = o + i * K + g * kGroup;
      for (int64_t k = 0; k < kGroup; ++k) {
        int code;
        if (bits == 4) {
          const int s = k / 8, h = (k % 8) / 4, tt = k % 4;
          const uint8_t byte = blk[64 * s + 4 * j + tt];
          code = h ? byte >> 4 : byte & 0x0F;
        } else {
          code = blk[64 * (k / 4) + 4 * j + k % 4];
        }
        dst[k] = d * static_cast<float>(code) + z;  // d*code is exact in float32: one rounding
      }
    }
  }
  return out;
}

// Reads every byte of x (uint8, contiguous) once, on all of torch's threads in 4 MiB chunks, and
// returns their xor folded to 64 bits (so that the reads cannot be optimized away): the machine's
// streaming read bandwidth as the kernels see it, for the benchmarks' decode bounds. Eight
// independent accumulators, one 64-byte line per iteration: the compiler vectorizes to the
// build's widest registers, and no add chain limits the loop.
int64_t stream_read(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kByte && x.is_contiguous() && x.numel() % 64 == 0,
              "stream_read needs a contiguous uint8 tensor of whole 64-byte lines");
  const uint64_t* p = reinterpret_cast<const uint64_t*>(x.data_ptr<uint8_t>());
  const int64_t lines = x.numel() / 64;
  std::vector<uint64_t> partial(static_cast<size_t>(std::max(1, omp_get_max_threads())) * 8, 0);
  parallel_chunks(lines, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t l = begin; l < end; ++l)
      for (int i = 0; i < 8; ++i) a[i] ^= p[8 * l + i];
    uint64_t* mine = partial.data() + 8 * static_cast<size_t>(omp_get_thread_num());
    for (int i = 0; i < 8; ++i) mine[i] ^= a[i];
  });
  uint64_t folded = 0;
  for (uint64_t v : partial) folded ^= v;
  return static_cast<int64_t>(folded);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs: the API's event loop keeps serving meanwhile
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("supported", &supported, "whether this build has native kernels (AVX-512 VNNI or AVX2)");
  m.def("formats", &formats, "whether this build has the kernels of the formats beyond 4- and 8-bit codes");
  m.def("isa", &isa, "the instruction set of this build's kernels: avx512vnni, avx2 or none");
  m.def("qgemm", &qgemm, "quantized matmul (see cpu_kernels.cpp)", nogil);
  m.def("quantize_activations", &quantize_activations, "int8 activation codes per 32-group", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm, float32", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x), float32", nogil);
  m.def("rope_write_kv", &rope_write_kv, "RoPE on a fused qkv; k/v into the paged cache; returns q", nogil);
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up", nogil);
  m.def("decoder_layer", &decoder_layer, "a whole decoder layer for a decode-only step", nogil);
  m.def("dequant_rows", &dequant_rows, "rows of a packed weight, dequantized to float32", nogil);
  m.def("stream_read", &stream_read, "xor of every byte of a uint8 tensor, read once on all threads", nogil);
  m.def("near_max", &near_max, "(rows, cols) of the entries within a margin of their row's maximum", nogil);
}
