// The AVX2 build's own kernels of the formats whose Format<F>::kAvx2Tiles is set (the 4- and 8-bit
// tiles, Q4_0 and Q4_K).
#pragma once

namespace {

#if LOCALLLM_HAVE_AVX2
// The AVX2 build's 4- and 8-bit tiles, Q4_0 and Q4_K: the format kernel's layout, integer sums and float
// operations per output (so the same bits as the AVX-512 build), blocked for AVX2's 16 registers:
// kAvx2Rows activation rows against both halves of a tile (rows 0-7, 8-15) at once, each code
// vector decoded once for all rows and passes (faster here than the format kernel's one half at a
// time). The integer sums are V256's (see isums), exact:
//   4-bit: u <= 15, a product's magnitude is at most 1905, and all 16 products a 16-bit lane
//     gathers over a group sum to at most 30480 (30720 even for -128): one int16 sum per group
//     and row, widened once.
//   8-bit: the signed codes q = u - 128 multiply (see V256::add_centered_products), each pair
//     widened at once: sum q x = sum u x - 128 sum x, the format kernel's Ti.
namespace avx2 {

constexpr int kAvx2Rows = 2;  // activation rows per call of tile_rows

// The nibble formats: the 4-bit tiles (d u + z), Q4_0 (d (u - 8), no z) and Q4_K (d sc u - dmin m)
// at their files' sizes; the others here, the 8-bit tiles, multiply their centred codes.
constexpr bool nibble_codes(int f) { return code_bits(f) == 4; }

// The group's integer sum as the format kernel's Ti: Q4_0's codes centred (its offset), the others'
// as they are (the 8-bit tiles' sums are centred already).
template <int BITS>
inline __m256i group_sum(__m256i isum, int32_t sum_x) {
  if constexpr (!Format<BITS>::kCentered && code_offset(BITS) != 0)
    return _mm256_sub_epi32(isum, _mm256_set1_epi32(code_offset(BITS) * sum_x));
  return isum;
}

// A group's weight scales and offsets per half h of the tile (rows 8h .. 8h + 7), as the format
// kernel computes them: d (Q4_K: d sc, an exact float32 product of the file's values) and the
// offset z (Q4_K: dmin m, subtracted; Q4_0 and the 8-bit tiles have none).
struct GroupScales {
  __m256 d[2], z[2];
};
template <int BITS>
inline GroupScales group_scales(const uint8_t* sbp, int gi) {
  constexpr FmtInfo fi = fmt_info(BITS);
  const uint8_t* scp = sbp + (fi.sb / kGroup) * fi.cb;
  const uint8_t* dp = scp + fi.scb;
  GroupScales s;
  for (int h = 0; h < 2; ++h) {
    s.d[h] = V256::half(dp + 16 * h);
    s.z[h] = fi.z ? V256::half(dp + 32 + 16 * h) : _mm256_setzero_ps();
    if constexpr (Format<BITS>::kFactors > 0) {  // d sc, dmin m: the format kernel's factors
      static_assert(Format<BITS>::kFactors == 2 && Format<BITS>::kShare == Share::kMin);
      __m256 f[4];
      Format<BITS>::template factors<V256>(scp, gi, h, s.d[h], s.z[h], f);
      s.d[h] = f[0], s.z[h] = f[1];
    }
  }
  return s;
}

// Q4_K's group scales (d sc, dmin m of group g) kept in, or read from, a tile's factor table
// (fmt::FactorSource; the format kernel's layout of it).
inline void keep_scales(float* factors, int64_t g, const GroupScales& s) {
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(fmt::factor_at(factors, g, 2, 0) + 8 * h, s.d[h]);
    _mm256_storeu_ps(fmt::factor_at(factors, g, 2, 1) + 8 * h, s.z[h]);
  }
}
inline GroupScales kept_scales(float* factors, int64_t g) {
  GroupScales s;
  for (int h = 0; h < 2; ++h) {
    s.d[h] = _mm256_loadu_ps(fmt::factor_at(factors, g, 2, 0) + 8 * h);
    s.z[h] = _mm256_loadu_ps(fmt::factor_at(factors, g, 2, 1) + 8 * h);
  }
  return s;
}

// r + the group's share of an output: its integer sum times d xs, then the offset's share.
// (sx_sum_x: sx * float(sum_x), ActRows::xsx.)
template <int BITS>
inline __m256 add_group(__m256 r, __m256i isum, int32_t sum_x, float sx, float sx_sum_x, const GroupScales& s, int h) {
  r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(group_sum<BITS>(isum, sum_x)), _mm256_mul_ps(s.d[h], _mm256_set1_ps(sx)), r);
  if constexpr (Format<BITS>::kShare == Share::kZ) r = _mm256_fmadd_ps(s.z[h], _mm256_set1_ps(sx_sum_x), r);
  if constexpr (Format<BITS>::kShare == Share::kMin) r = _mm256_fnmadd_ps(s.z[h], _mm256_set1_ps(sx_sum_x), r);
  return r;
}

// Code vector s of a 4-bit group, both halves h: its low nibbles (pair with k = 8s .. 8s+3) and
// its high nibbles (k = 8s+4 .. 8s+7).
struct Nibbles {
  __m256i lo[2], hi[2];
};
inline Nibbles nibbles(const uint8_t* blk, int s) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  Nibbles n;
  for (int h = 0; h < 2; ++h) {
    const __m256i v = V256::ld(blk + 64 * s + 32 * h);
    n.lo[h] = _mm256_and_si256(v, low4);
    n.hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
  return n;
}

// Code vector s of an 8-bit group, both halves h: the signed codes q = u - 128 and |q|.
struct Centered {
  __m256i q[2], aq[2];
};
inline Centered centered(const uint8_t* blk, int s) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  Centered c;
  for (int h = 0; h < 2; ++h) {
    c.q[h] = _mm256_xor_si256(V256::ld(blk + 64 * s + 32 * h), flip);
    c.aq[h] = _mm256_abs_epi8(c.q[h]);  // -128 -> 0x80: 128 unsigned
  }
  return c;
}

// MT activation rows (m0 .. m0 + MT) against both halves of one tile, every pass at once: each
// code vector is decoded once for all rows and passes, each activation broadcast serves both
// halves. Per output the same integer sums and then the same float operations in the same order
// as tile_row (the float accumulators live in memory between groups: 2 x 2 x 2 int16/int32
// accumulators take the registers). The s loops are kept rolled: unrolled, the compiler
// reassociates the integer adds and spills every product.
template <int BITS, int MT, int PASSES, fmt::FactorSource kSource>
inline void tile_rows(const uint8_t* tile, int64_t G, const ActRows& a, int64_t m0, float* y, int64_t N, int64_t n0,
                      float* factors) {
  constexpr FmtInfo fi = fmt_info(BITS);
  constexpr int GS = fi.sb / kGroup;  // groups per super-block (Q4_K: 8)
  alignas(32) float acc[MT][2][8] = {};
  const int8_t* xq[PASSES];  // the rows' codes and scales, group 0 (row i: + i * kGroup, + i)
  int64_t at[PASSES];
  for (int p = 0; p < PASSES; ++p) xq[p] = a.codes(p, m0), at[p] = a.at(p, m0);
  for (int64_t g = 0; g < G; ++g) {
    const int gi = static_cast<int>(g % GS);
    const uint8_t* sbp = tile + (g / GS) * fi.sb_bytes();
    const uint8_t* blk = sbp + gi * fi.cb;  // the group's codes
    if (m0 == 0 && gi == 0) stream_ahead(sbp, fi.sb_bytes());  // the first rows stream the tile from memory
    __m256i isum[PASSES][MT][2] = {};
    if constexpr (nibble_codes(BITS)) {
      __m256i s16[PASSES][MT][2] = {};
      _Pragma("GCC unroll 1") for (int s = 0; s < 4; ++s) {
        const Nibbles n = nibbles(blk, s);
        for (int p = 0; p < PASSES; ++p)
          for (int i = 0; i < MT; ++i) {
            const int8_t* xg = xq[p] + g * a.group_codes() + i * kGroup + 8 * s;
            const __m256i xl = V256::b4(xg), xh = V256::b4(xg + 4);
            for (int h = 0; h < 2; ++h)
              s16[p][i][h] = _mm256_add_epi16(s16[p][i][h], _mm256_add_epi16(_mm256_maddubs_epi16(n.lo[h], xl),
                                                                              _mm256_maddubs_epi16(n.hi[h], xh)));
          }
      }
      const __m256i ones = _mm256_set1_epi16(1);
      for (int p = 0; p < PASSES; ++p)
        for (int i = 0; i < MT; ++i)
          for (int h = 0; h < 2; ++h) isum[p][i][h] = _mm256_madd_epi16(s16[p][i][h], ones);
    } else {
      _Pragma("GCC unroll 1") for (int s = 0; s < 8; ++s) {
        const Centered c = centered(blk, s);
        for (int p = 0; p < PASSES; ++p)
          for (int i = 0; i < MT; ++i) {
            const __m256i xb = V256::b4(xq[p] + g * a.group_codes() + i * kGroup + 4 * s);
            for (int h = 0; h < 2; ++h) isum[p][i][h] = V256::add_centered_products(isum[p][i][h], c.q[h], c.aq[h], xb);
          }
      }
    }
    GroupScales sc;  // (Q4_K: formed by the tile's first call, kept for the others)
    if constexpr (Format<BITS>::kFactors > 0 && kSource == fmt::kKept) {
      sc = kept_scales(factors, g);
    } else {
      sc = group_scales<BITS>(sbp, gi);
      if constexpr (Format<BITS>::kFactors > 0 && kSource == fmt::kFormedKept) keep_scales(factors, g, sc);
    }
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < MT; ++i) {
        __m256 r = _mm256_load_ps(acc[i][h]);
        for (int p = 0; p < PASSES; ++p) {
          const int64_t ig = at[p] + g * a.rb + i;
          r = add_group<BITS>(r, isum[p][i][h], a.xsum[ig], a.xs[ig], a.xsx[ig], sc, h);
        }
        _mm256_store_ps(acc[i][h], r);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + i) * N + n0 + 8 * h, _mm256_load_ps(acc[i][h]));
}

// One activation row (row m0) against a whole tile: tile_rows' arithmetic for one row (the
// same integer sums, then the same float operations in the same order), with its accumulators in
// registers and the weights prefetched as they stream in.
template <int BITS, int PASSES>
inline void tile_row(const uint8_t* tile, int64_t G, const ActRows& a, int64_t m0, float* y, int64_t N, int64_t n0) {
  constexpr FmtInfo fi = fmt_info(BITS);
  constexpr int GS = fi.sb / kGroup;  // groups per super-block (Q4_K: 8)
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const int8_t* xq[PASSES];  // the row's codes and scales, group 0
  int64_t at[PASSES];
  for (int p = 0; p < PASSES; ++p) xq[p] = a.codes(p, m0), at[p] = a.at(p, m0);
  const bool ask_window = asks_row_window(BITS, 8) && a.rb == 1;  // (see prefetch_row_window)
  for (int64_t w0 = 0; w0 < G; w0 += kRowWindow) {
    if (ask_window && w0 + kRowWindow < G) prefetch_row_window<Format<BITS>::kWholeSums>(a, xq, at, w0 + kRowWindow);
    const int64_t w1 = std::min(G, w0 + kRowWindow);
    for (int64_t g = w0; g < w1; ++g) {
      const int gi = static_cast<int>(g % GS);
      const uint8_t* sbp = tile + (g / GS) * fi.sb_bytes();
      const uint8_t* blk = sbp + gi * fi.cb;  // the group's codes
      if (m0 == 0 && gi == 0) stream_ahead<one_row_ahead(BITS, 8)>(sbp, fi.sb_bytes());  // the first row streams the tile from memory
      const int8_t* xg[PASSES];
      for (int p = 0; p < PASSES; ++p) xg[p] = xq[p] + g * a.group_codes();
      __m256i isum[PASSES][2] = {};
      if constexpr (nibble_codes(BITS)) {
        __m256i s16[PASSES][2] = {};
        for (int s = 0; s < 4; ++s) {
          const Nibbles n = nibbles(blk, s);
          for (int p = 0; p < PASSES; ++p) {
            const __m256i xl = V256::b4(xg[p] + 8 * s), xh = V256::b4(xg[p] + 8 * s + 4);
            for (int h = 0; h < 2; ++h)
              s16[p][h] = _mm256_add_epi16(s16[p][h], _mm256_add_epi16(_mm256_maddubs_epi16(n.lo[h], xl), _mm256_maddubs_epi16(n.hi[h], xh)));
          }
        }
        const __m256i ones = _mm256_set1_epi16(1);
        for (int p = 0; p < PASSES; ++p)
          for (int h = 0; h < 2; ++h) isum[p][h] = _mm256_madd_epi16(s16[p][h], ones);
      } else {
        for (int s = 0; s < 8; ++s) {
          const Centered c = centered(blk, s);
          for (int p = 0; p < PASSES; ++p) {
            const __m256i xb = V256::b4(xg[p] + 4 * s);
            for (int h = 0; h < 2; ++h) isum[p][h] = V256::add_centered_products(isum[p][h], c.q[h], c.aq[h], xb);
          }
        }
      }
      const GroupScales sc = group_scales<BITS>(sbp, gi);
      for (int p = 0; p < PASSES; ++p) {
        const int64_t ig = at[p] + g * a.rb;
        for (int h = 0; h < 2; ++h) acc[h] = add_group<BITS>(acc[h], isum[p][h], a.xsum[ig], a.xs[ig], a.xsx[ig], sc, h);
      }
    }
  }
  for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + m0 * N + n0 + 8 * h, acc[h]);
}

// Tile t of a weight [N, K] for every activation row: y [M, N].
template <int BITS, int PASSES>
void gemm_tile(const uint8_t* w, int64_t N, int64_t K, const ActRows& a, int64_t M, float* y, int64_t t) {
  const int64_t G = K / kGroup;
  const uint8_t* tile = w + t * (K / fmt_info(BITS).sb) * fmt_info(BITS).sb_bytes();
  int64_t m0 = 0;
  // rows in pairs (2 rows x 2 halves x 2 passes of integer accumulators fill the registers),
  // an odd last row by tile_row
  if constexpr (Format<BITS>::kFactors > 0) {
    if (M >= 2 * kAvx2Rows) {  // Q4_K's first call keeps its group scales for the others
      float* factors = fmt::factor_table(G * 2 * kTile);
      tile_rows<BITS, kAvx2Rows, PASSES, fmt::kFormedKept>(tile, G, a, m0, y, N, t * kTile, factors);
      for (m0 += kAvx2Rows; m0 + kAvx2Rows <= M; m0 += kAvx2Rows)
        tile_rows<BITS, kAvx2Rows, PASSES, fmt::kKept>(tile, G, a, m0, y, N, t * kTile, factors);
    }
  }
  for (; m0 + kAvx2Rows <= M; m0 += kAvx2Rows)
    tile_rows<BITS, kAvx2Rows, PASSES, fmt::kFormed>(tile, G, a, m0, y, N, t * kTile, nullptr);
  for (; m0 < M; ++m0) tile_row<BITS, PASSES>(tile, G, a, m0, y, N, t * kTile);
}

}  // namespace avx2
#endif  // LOCALLLM_HAVE_AVX2

}  // namespace
