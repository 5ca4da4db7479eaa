// The K-quants in their files' own formats: super-blocks of 256 weights a row, integer sub-scales
// (and mins) per 32 (Q4_K, Q5_K) or 16 (Q6_K, Q3_K, Q2_K) weights, float16 d (and dmin) per
// super-block, the file's values.
//
// Q4_K and Q5_K keep their 16 six-bit values per row and super-block (sc and m of each 32-group)
// at the file's 12 bytes a row: see six_bit_value. (Q3_K's sub-scales stay a byte each: unpacked
// per group, six-bit ones cost its one-row kernel 11% (AVX-512) to 16% (AVX2) where it is bound by
// its integer work, for 3.5% fewer bytes.)
//
// Q3_K's codes are three-bit bytes (192 bytes a group): vectors b0, b1, b2, byte 4j + t:
//   b0 = (c6 & 3) | c0 << 2 | c1 << 5, b1 = (c7 & 3) | c2 << 2 | c3 << 5,
//   b2 = c4 | c5 << 3 | (c6 >> 2) << 6 | (c7 >> 2) << 7,
// with cv row j's code for v (10 steps fewer a group than a 2-bit and a 1-bit plane, whose codes
// each took two or three to assemble: Q3_K's one-row kernel is bound by its integer work where the
// machine's bandwidth is high; c6's and c7's low bits lie where the code goes, so each of the two
// codes that straddle bytes takes two steps with GFNI).
//
// With the file's unsigned codes u (Q6_K: q + 32, Q3_K: q + 4) the weights are
//   Q4_K, Q5_K: d sc u - dmin m   Q6_K: d sc (u - 32)   Q3_K: d sc (u - 4)   Q2_K: d sc u - dmin m
// and per 32-group and activation pass (S0, S1, X0, X1: see fmt_common.h; Q4_K as Q5_K):
//   Q5_K: Ti = S0 + S1                            y += ((d sc) xs) Ti - (dmin m) (xs (X0 + X1))
// and the formats with a sub-scale per 16, whose halves keep their own sums (Ti0, Ti1):
//   Q6_K: Ti_h = S_h - 32 X_h                     y += ((d sc0) Ti0 + (d sc1) Ti1) xs
//   Q3_K: Ti_h = S_h - 4 X_h                      y += ((d sc0) Ti0 + (d sc1) Ti1) xs
//   Q2_K: Ti_h = S_h                              y += ((d sc0) Ti0 + (d sc1) Ti1) xs - (dmin m0) (xs X0) - (dmin m1) (xs X1)
// The sub-scales per 16 are applied as float multiplies rather than integer ones (vpmulld):
// 4096x2048, 512 rows, 5 interleaved rounds, Zen 4, G int8 ops/s Q6_K 393 -> 422, Q3_K 419 -> 498,
// Q2_K 424 -> 453.
#pragma once

namespace {

// Q4_K's and Q5_K's six-bit sub-scales and mins at the file's 12 bytes a row and super-block:
// each 32-group's pair (A, B) = (sc, m), laid out so that a group's pair for 16 rows unpacks from
// two 16-byte loads in a few steps (a byte a value took 256 bytes): bytes [gi][j] = A | (B & 3) << 6,
// then bytes [gi / 2][j] = (B >> 2) of the even group | (B >> 2) of the odd one << 4.
//
// Value A (second = 0) or B (second = 1) of group gi's pair for row j of a tile (scp: the sub-scale block).
inline int six_bit_value(const uint8_t* scp, int j, int gi, int second) {
  const int x = scp[gi * 16 + j];
  if (!second) return x & 63;
  return (x >> 6) | (((scp[128 + (gi / 2) * 16 + j] >> (4 * (gi % 2))) & 15) << 2);
}

namespace fmt {

// Group gi's pair of six-bit values (see six_bit_value) for the rows of register H.
template <class V>
LOCALLLM_STEP void six_bit_pair(const uint8_t* scp, int gi, int H, typename V::I& A, typename V::I& B) {
  const typename V::I x = V::u8(scp + gi * 16 + V::kLanes * H);
  const typename V::I y = V::u8(scp + 128 + (gi / 2) * 16 + V::kLanes * H);
  A = V::band(x, V::i32(63));
  B = V::bor(V::shr32(x, 6), V::shl32(V::band(V::shr32(y, 4 * (gi % 2)), V::i32(15)), 2));
}

// Q6_K's and Q3_K's factors of group gi: d sc of each half, from the signed byte sub-scales.
template <class V>
LOCALLLM_STEP void byte_scale_factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F* out) {
  constexpr int R = V::kLanes;
  const typename V::I a0 = V::s8(scp + 2 * gi * 16 + R * H);
  const typename V::I a1 = V::s8(scp + (2 * gi + 1) * 16 + R * H);
  out[0] = V::fmul(D, V::cvt(a0));
  out[1] = V::fmul(D, V::cvt(a1));
}

}  // namespace fmt

// d sc of sub-block `sub` (16 weights) for row j, from the signed byte sub-scales (Q6_K, Q3_K).
inline float byte_scale(const uint8_t* scp, int j, int sub, float d) {
  return d * static_cast<float>(static_cast<int8_t>(scp[sub * 16 + j]));
}

// Q4_K: nibbles, six-bit sc and m per 32, d and dmin per 256 (the AVX2 build: avx2::tile_rows).
template <>
struct Format<kFmtQ4_K> : FormatDefaults {
  static constexpr Share kShare = Share::kMin;
  static constexpr int kFactors = 2;
  static constexpr bool kWholeSums = true;
  static constexpr bool kAvx2Tiles = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::nibble_plane<V, kAffine>(cb, at, c);
  }
  // d sc and dmin m (exact float32 products of the file's values; D, Z: the rows' d and dmin)
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F Z,
                                    typename V::F* out) {
    typename V::I sc, m;
    fmt::six_bit_pair<V>(scp, gi, H, sc, m);
    out[0] = V::fmul(D, V::cvt(sc));
    out[1] = V::fmul(Z, V::cvt(m));
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t); }
  static float weight(int u, float d, float dz, const uint8_t* scp, int j, int gi, int) {
    const float dl = d * static_cast<float>(six_bit_value(scp, j, gi, 0));
    const float ml = dz * static_cast<float>(six_bit_value(scp, j, gi, 1));
    return dl * static_cast<float>(u) - ml;
  }
};

// Q5_K: nibbles and the 1-bit plane, six-bit sc and m per 32, d and dmin per 256.
template <>
struct Format<kFmtQ5_K> : FormatDefaults {
  static constexpr Share kShare = Share::kMin;
  static constexpr int kFactors = 2;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::nibble_plane<V, kAffine>(cb, at, c);
    fmt::merge_bit_plane<V>(cb + 256, at, c);
  }
  // d sc and dmin m (exact float32 products of the file's values; D, Z: the rows' d and dmin)
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F Z,
                                    typename V::F* out) {
    typename V::I sc, m;
    fmt::six_bit_pair<V>(scp, gi, H, sc, m);
    out[0] = V::fmul(D, V::cvt(sc));
    out[1] = V::fmul(Z, V::cvt(m));
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t) | bit_at(cb + 256, j, v, t) << 4; }
  static float weight(int u, float d, float dz, const uint8_t* scp, int j, int gi, int) {
    const float dl = d * static_cast<float>(six_bit_value(scp, j, gi, 0));
    const float ml = dz * static_cast<float>(six_bit_value(scp, j, gi, 1));
    return dl * static_cast<float>(u) - ml;
  }
};

// Q6_K: nibbles and the 2-bit plane (6-bit codes), int8 sc per 16, d per 256 (u - 32).
template <>
struct Format<kFmtQ6_K> : FormatDefaults {
  static constexpr int kFactors = 2;
  static constexpr bool kHalfScales = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::nibble_plane<V, kAffine>(cb, at, c);
    fmt::merge_crumb_plane<V>(cb + 256, at, c);
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F,
                                    typename V::F* out) {
    fmt::byte_scale_factors<V>(scp, gi, H, D, out);
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t) | crumb_at(cb + 256, j, v, t) << 4; }
  static float weight(int u, float d, float, const uint8_t* scp, int j, int gi, int k) {
    const float dl = byte_scale(scp, j, 2 * gi + k / 16, d);
    return dl * static_cast<float>(u - code_offset(kFmtQ6_K));
  }
};

// Q3_K: three-bit bytes, int8 (sc - 32) per 16, d per 256 (u - 4).
template <>
struct Format<kFmtQ3_K> : FormatDefaults {
  static constexpr int kFactors = 2;
  static constexpr bool kHalfScales = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    // c[0..5] one field each, c[6], c[7] two
    const typename V::I b0 = V::ld(cb + at), b1 = V::ld(cb + 64 + at), b2 = V::ld(cb + 128 + at);
    c[0] = V::template field<2, 3, kAffine>(b0), c[1] = V::template field<5, 3, kAffine>(b0);
    c[2] = V::template field<2, 3, kAffine>(b1), c[3] = V::template field<5, 3, kAffine>(b1);
    fmt::split_fields<V, 3, 2, kAffine>(c + 4, b2);
    // (c6 & 3 lies where c6 goes: a mask and the high bit's move, merged by one vpternlog)
    c[6] = V::bor(V::band(b0, V::bytes(3)), V::template field<6, 1, kAffine, 2>(b2));
    c[7] = V::bor(V::band(b1, V::bytes(3)), V::template field<7, 1, kAffine, 2>(b2));
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F,
                                    typename V::F* out) {
    fmt::byte_scale_factors<V>(scp, gi, H, D, out);
  }
  static int code(const uint8_t* cb, int j, int v, int t) {
    const uint8_t* b = cb + 4 * j + t;  // its three code bytes: b[0], b[64], b[128]
    return v < 4   ? (b[64 * (v / 2)] >> (2 + 3 * (v % 2))) & 7
           : v < 6 ? (b[128] >> (3 * (v % 2))) & 7
                   : (b[64 * (v - 6)] & 3) | (((b[128] >> v) & 1) << 2);
  }
  static float weight(int u, float d, float, const uint8_t* scp, int j, int gi, int k) {
    const float dl = byte_scale(scp, j, 2 * gi + k / 16, d);
    return dl * static_cast<float>(u - code_offset(kFmtQ3_K));
  }
};

// Q2_K: the 2-bit plane, the file's (sc | m << 4) bytes per 16, d and dmin per 256.
template <>
struct Format<kFmtQ2_K> : FormatDefaults {
  static constexpr Share kShare = Share::kHalfMins;
  static constexpr int kFactors = 4;
  static constexpr bool kHalfScales = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::crumb_plane<V, kAffine>(cb, at, c);
  }
  // d sc and dmin m of each half
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F Z,
                                    typename V::F* out) {
    using I = typename V::I;
    constexpr int R = V::kLanes;
    const I s0 = V::u8(scp + 2 * gi * 16 + R * H), s1 = V::u8(scp + (2 * gi + 1) * 16 + R * H);
    const I m15 = V::i32(15);
    out[0] = V::fmul(D, V::cvt(V::band(s0, m15)));
    out[1] = V::fmul(D, V::cvt(V::band(s1, m15)));
    out[2] = V::fmul(Z, V::cvt(V::shr32_4(s0)));
    out[3] = V::fmul(Z, V::cvt(V::shr32_4(s1)));
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return crumb_at(cb, j, v, t); }
  static float weight(int u, float d, float dz, const uint8_t* scp, int j, int gi, int k) {
    const uint8_t s = scp[(2 * gi + k / 16) * 16 + j];
    const float dl = d * static_cast<float>(s & 0x0F), ml = dz * static_cast<float>(s >> 4);
    return dl * static_cast<float>(u) - ml;
  }
};

}  // namespace
