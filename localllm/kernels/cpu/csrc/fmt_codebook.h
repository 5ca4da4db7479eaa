// The codebook formats: 4-bit codes that each name one of 16 int8 values (formats.h's codebook(f),
// from localllm/quant/traits.py's CODEBOOKS), at their files' sizes, the file's codes and scales:
//   MXFP4: 32-groups, E2M1 values doubled, one E8M0 byte e a group and row (the scale 2^(e - 128):
//     e8m0_half, ggml's ggml_e8m0_to_fp32_half), no d;
//   IQ4_NL: 32-groups, kvalues_iq4nl, d f16 a group and row;
//   IQ4_XS: super-blocks of 256, kvalues_iq4nl, six-bit sc (stored sc + 32) a group and row, d f16
//     a super-block and row. Its 96 sub-scale bytes are the file's: per row its 4 bytes of low
//     nibbles (byte i: group 2i, then 2i + 1 in the high nibble) and its 2 bytes of high crumbs
//     (group g at bits 2g..2g+1 of the little-endian pair), byte b of row j at 16 b + j.
//
// The codes are looked up as they are decoded (fmt::codebook_plane: one vpshufb a code vector) into
// u = value + code_offset (MXFP4: 12, u <= 24, multiplied as the 5-bit codes are; IQ4: 128, u <= 241),
// so every format's integer sums are those of the other formats (fmt_common.h), with
//   MXFP4:  Ti = S0 + S1 - 12 (X0 + X1)           y += (e8m0_half(e) xs) Ti
//   IQ4_NL: Ti = S0 + S1 - 128 (X0 + X1)          y += (d xs) Ti
//   IQ4_XS: Ti = S0 + S1 - 128 (X0 + X1)          y += ((d sc) xs) Ti
// (AVX2 takes IQ4's u as signed values q = u - 128 instead, the offset's share then in S0 + S1
// itself: V256::signed_isums; the same Ti.) The scales are exact float32 values (a power of two;
// a float16 times a small integer), the weights d sc value too: one rounding per product, as the
// reference's.
#pragma once

namespace {

// The E8M0 byte e's scale, halved as MXFP4's doubled values need: 2^(e - 128), a subnormal for e < 2.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IQ4_XS's sub-scale sc (in [-32, 31]) of group gi for row j of a tile (scp: the sub-scale block).
inline int iq4_xs_scale(const uint8_t* scp, int j, int gi) {
  const int low = (scp[(gi / 2) * 16 + j] >> (4 * (gi % 2))) & 15;
  const int high = (scp[64 + (gi / 4) * 16 + j] >> (2 * (gi % 4))) & 3;
  return (low | high << 4) - 32;
}

namespace fmt {

// e8m0_half of the E8M0 bytes at p for the rows of a register.
template <class V>
LOCALLLM_STEP typename V::F e8m0_half_rows(const uint8_t* p) {
  using I32 = typename V::I32;
  const I32 e = I32(V::u8(p));
  const I32 bits = e < I32(V::i32(2)) ? I32(V::i32(0x00200000)) << e : (e - I32(V::i32(1))) << I32(V::i32(23));
  return typename V::F(bits);
}

}  // namespace fmt

// MXFP4: nibbles, an E8M0 byte per group (the factor: its scale), no d.
template <>
struct Format<kFmtMXFP4> : FormatDefaults {
  static constexpr int kFactors = 1;
  static constexpr bool kWholeSums = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::codebook_plane<V, kFmtMXFP4, kAffine>(cb, at, c);
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int, int H, typename V::F, typename V::F,
                                    typename V::F* out) {
    out[0] = fmt::e8m0_half_rows<V>(scp + V::kLanes * H);
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t); }
  static float weight(int u, float, float, const uint8_t* scp, int j, int, int) {
    return e8m0_half(scp[j]) * static_cast<float>(codebook(kFmtMXFP4)[u]);
  }
};

// IQ4_NL: nibbles, d per group (Q4_0 with its codes looked up).
template <>
struct Format<kFmtIQ4_NL> : FormatDefaults {
  static constexpr bool kWholeSums = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::codebook_plane<V, kFmtIQ4_NL, kAffine>(cb, at, c);
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t); }
  static float weight(int u, float d, float, const uint8_t*, int, int, int) {
    return d * static_cast<float>(codebook(kFmtIQ4_NL)[u]);
  }
};

// IQ4_XS: nibbles, six-bit sc per group, d per 256 (the factor: d sc).
template <>
struct Format<kFmtIQ4_XS> : FormatDefaults {
  static constexpr int kFactors = 1;
  static constexpr bool kWholeSums = true;
  template <class V, bool kAffine>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    fmt::codebook_plane<V, kFmtIQ4_XS, kAffine>(cb, at, c);
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F,
                                    typename V::F* out) {
    using I = typename V::I;
    constexpr int R = V::kLanes;
    const I low = V::band(V::shr32(V::u8(scp + (gi / 2) * 16 + R * H), 4 * (gi % 2)), V::i32(15));
    const I high = V::band(V::shr32(V::u8(scp + 64 + (gi / 4) * 16 + R * H), 2 * (gi % 4)), V::i32(3));
    out[0] = V::fmul(D, V::cvt(V::sub(V::bor(low, V::shl32(high, 4)), V::i32(32))));
  }
  static int code(const uint8_t* cb, int j, int v, int t) { return nibble_at(cb, j, v, t); }
  static float weight(int u, float d, float, const uint8_t* scp, int j, int gi, int) {
    const float dl = d * static_cast<float>(iq4_xs_scale(scp, j, gi));
    return dl * static_cast<float>(codebook(kFmtIQ4_XS)[u]);
  }
};

}  // namespace
