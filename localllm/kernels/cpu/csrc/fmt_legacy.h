// The 32-group formats: the 4- and 8-bit tiles (any source: Q4_1, Q8_0, GPTQ, an LM head held as
// 8-bit codes) and Q4_0, Q5_0, Q5_1 at their files' sizes, with d (and z) per group and row.
//
// With the unsigned codes u (Q4_0: q + 8, Q5_0: q + 16, the 8-bit tiles: q + 128) the weights are
//   Q4: d u + z   Q8: d (u - 128)   Q4_0: d (u - 8)   Q5_0: d (u - 16)   Q5_1: d u + m
// and per 32-group and activation pass (S0, S1, X0, X1: see fmt_common.h; the tiles' code sums
// xsum = X0 + X1 come whole from quantize_rows):
//   Q5_0: Ti = S0 + S1 - 16 (X0 + X1)             y += (d xs) Ti
//   Q4_0: Ti = S0 + S1 - 8 (X0 + X1)              y += (d xs) Ti   (X0 + X1 = xsum, whole)
//   Q5_1: Ti = S0 + S1                            y += (d xs) Ti + m (xs (X0 + X1))
//   Q4:   Ti = S0 + S1                            y += (d xs) Ti + z (xs (X0 + X1))
//   Q8:   Ti = S0 + S1 - 128 (X0 + X1)            y += (d xs) Ti
// (Q4 as Q5_1 with nibble codes, Q8 as Q5_0 with u - 128.)
#pragma once

namespace {

// The 4-bit tiles: nibbles, d and z per group (the AVX2 build: avx2::tile_rows).
template <>
struct Format<kFmtQ4> : FormatDefaults {
  static constexpr Share kShare = Share::kZ;
  static constexpr bool kWholeSums = true;
  static constexpr bool kAvx2Tiles = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::nibble_plane<V, kAffine>(cb, at, c);
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t); }
  static float weight(int u, float d, float dz, const uint8_t*, int, int, int) { return d * static_cast<float>(u) + dz; }
};

// The 8-bit tiles: bytes, d per group, z = -128 d (their sums centred: V512::centered_dot8, AVX2's
// V256::add_centered_products).
template <>
struct Format<kFmtQ8> : FormatDefaults {
  static constexpr bool kWholeSums = true;
  static constexpr bool kCentered = true;
  static constexpr bool kAvx2Tiles = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::byte_plane<V>(cb, at, c);
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return byte_at(cb, j, v, t); }
  static float weight(int u, float d, float, const uint8_t*, int, int, int) {
    return d * static_cast<float>(u) + -128.0f * d;  // d*u is exact in float32: one rounding
  }
};

// Q4_0: nibbles, d per group (no stored offset: u - 8).
template <>
struct Format<kFmtQ4_0> : FormatDefaults {
  static constexpr bool kWholeSums = true;
  static constexpr bool kAvx2Tiles = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::nibble_plane<V, kAffine>(cb, at, c);
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t); }
  static float weight(int u, float d, float, const uint8_t*, int, int, int) {
    return d * static_cast<float>(u - code_offset(kFmtQ4_0));
  }
};

// Q5_0: nibbles and the 1-bit plane, d per group (u - 16).
template <>
struct Format<kFmtQ5_0> : FormatDefaults {
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::nibble_plane<V, kAffine>(cb, at, c);
    fmt::merge_bit_plane<V>(cb + 256, at, c);
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t) | bit_at(cb + 256, j, v, t) << 4; }
  static float weight(int u, float d, float, const uint8_t*, int, int, int) {
    return d * static_cast<float>(u - code_offset(kFmtQ5_0));
  }
};

// Q5_1: nibbles and the 1-bit plane, d and m per group.
template <>
struct Format<kFmtQ5_1> : FormatDefaults {
  static constexpr Share kShare = Share::kZ;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::nibble_plane<V, kAffine>(cb, at, c);
    fmt::merge_bit_plane<V>(cb + 256, at, c);
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t) | bit_at(cb + 256, j, v, t) << 4; }
  static float weight(int u, float d, float dz, const uint8_t*, int, int, int) { return d * static_cast<float>(u) + dz; }
};

}  // namespace
