// The lattice formats: each group of 8 weights (IQ2) or 4 (IQ3) is a point of a fixed grid, named by
// its index, with its signs given apart (a 7-bit index into ksigns, whose eighth bit is the parity
// of the seven, or 8 plain bits), and one or two 4-bit sub-scales per 32-group. The kernels keep
// each 32-group's file bytes as they are (localllm/kernels/cpu/fields.py's LATTICE_FIELDS gives
// which and in what order), per group and tile: byte-wide fields as [field][16 rows], wider ones
// as [field][16 rows][width], so that one load gives a field for every row of a register:
//   IQ2_XXS (8 a row):  idx u8[4][16]        | word u32[16] (4 x 7 sign bits, sc << 28)
//   IQ2_XS  (9 a row):  q u16[4][16] (idx 9 bits, 7 sign bits) | sc u8[16] (a nibble a half)
//   IQ2_S  (10 a row):  idx u8[4][16]        | signs u8[16][4] | qh u8[16] (2 bits an idx) | sc u8[16]
//   IQ3_XXS (12 a row): idx u8[8][16]        | word u32[16] (4 x 7 sign bits, sc << 28)
//   IQ3_S  (13 a row):  idx u8[8][16]        | qh u8[16] (1 bit an idx) | signs u8[16][4]
//                       and per super-block sc u8[4][16] (a nibble a group: the sub-scale block)
// then d f16[16] per super-block: the file's bytes exactly.
//
// The grid points are looked up as the codes are decoded (IQ3's points are one int32 of 4 values,
// one 32-bit gather a code vector; IQ2's two int32, one 64-bit gather a half register for two code
// vectors: gathers cost per element), from tables set once from localllm/quant/grids.py
// (set_lattice_grid), the one table the reference reads too, held as 128 + value. The signs negate
// them (mod 256), making u = 128 + value (value in [-62, 62]), multiplied as the codebook formats'
// 8-bit values are (fmt_codebook.h: on AVX2 as signed values, V256::signed_isums), so that with the
// factor f of a group (or of each half)
//   IQ2_XXS: f = d (sc + 1/2) / 4    IQ3_XXS: f = d (sc + 1/2) / 2    IQ3_S: f = d (1 + 2 sc)
//   IQ2_XS, IQ2_S: f_h = d (sc_h + 1/2) / 4 per half
//   Ti = S0 + S1 - 128 (X0 + X1)     y += (f xs) Ti     (halves: y += (f_0 Ti0 + f_1 Ti1) xs)
// Each f is an exact float32 (a float16 times a 5-bit integer, times a power of two), as the
// reference's.
#pragma once

namespace {

// The int32 words of a lattice format's grid: 4 values each (byte t: 128 + value t, the kernels'
// u), IQ2's points two words.
constexpr int lattice_grid_words(int64_t f) {
  return f == kFmtIQ2_XXS ? 256 * 2
       : f == kFmtIQ2_XS  ? 512 * 2
       : f == kFmtIQ2_S   ? 1024 * 2
       : f == kFmtIQ3_XXS ? 256
       : f == kFmtIQ3_S   ? 512
       : 0;
}

template <int64_t F>
inline int32_t* lattice_grid() {
  alignas(64) static int32_t words[lattice_grid_words(F)];
  return words;
}

// The lattice formats whose grid has been set (bit: the format's position in kLatticeFormats).
constexpr int64_t kLatticeFormats[] = {kFmtIQ2_XXS, kFmtIQ2_XS, kFmtIQ2_S, kFmtIQ3_XXS, kFmtIQ3_S};
inline int& lattice_grids_set() {
  static int set = 0;
  return set;
}
inline int lattice_bit(int64_t f) {
  for (int i = 0; i < 5; ++i)
    if (kLatticeFormats[i] == f) return 1 << i;
  return 0;
}
inline bool lattice_ready(int64_t f) { return !is_lattice_fmt(f) || (lattice_grids_set() & lattice_bit(f)); }

// Sets format f's grid from its points (int8 [entries, width]: localllm/quant/grids.py's GRIDS).
void set_lattice_grid(int64_t f, torch::Tensor points) {
  TORCH_CHECK(is_lattice_fmt(f), "set_lattice_grid: not a lattice format: ", f);
  TORCH_CHECK(points.scalar_type() == torch::kInt8 && points.is_contiguous(), "set_lattice_grid: int8 points");
  TORCH_CHECK(points.numel() == 4 * lattice_grid_words(f), "set_lattice_grid: the grid has the wrong size");
  int32_t* words = nullptr;
  with_tiled_fmt(f, [&](auto fmt) {
    constexpr int64_t F = decltype(fmt)::value;
    if constexpr (lattice_grid_words(F) > 0) words = lattice_grid<F>();
  });
  const int8_t* values = points.data_ptr<int8_t>();
  uint8_t* u = reinterpret_cast<uint8_t*>(words);
  for (int i = 0; i < 4 * lattice_grid_words(f); ++i) u[i] = static_cast<uint8_t>(128 + values[i]);
  lattice_grids_set() |= lattice_bit(f);
}

// The sign byte of a 7-bit ksigns index s: s with the parity of its bits as bit 7 (ksigns_iq2xs[s]).
inline int ksign(int s) { return s | (__builtin_parity(s) << 7); }

// Value t of grid word w.
inline int grid_value(int32_t w, int t) { return static_cast<int>((static_cast<uint32_t>(w) >> (8 * t)) & 255) - 128; }

// A row's u = 128 + value of a grid value and its sign bit.
inline int signed_code(int value, int negative) { return 128 + (negative ? -value : value); }

namespace fmt {

// Byte B of each int32 lane in all four of its bytes (vpshufb).
template <class V, int B>
LOCALLLM_STEP typename V::I spread_byte(typename V::I a) {
  alignas(16) static constexpr uint8_t kIdx[16] = {B, B, B, B, 4 + B, 4 + B, 4 + B, 4 + B,
                                                   8 + B, 8 + B, 8 + B, 8 + B, 12 + B, 12 + B, 12 + B, 12 + B};
  return V::lookup16(a, V::table16(kIdx));
}

// u = the grid's u = 128 + value (4 a lane), negated (mod 256: 128 - value) where the value's sign
// bit is set: bits 4 Nib .. 4 Nib + 3 of the lane's sign byte, spread over its four bytes (spread_byte).
template <class V, int Nib>
LOCALLLM_STEP typename V::I signed_values(typename V::I u, typename V::I spread) {
  return V::negate_where(u, spread, V::i32(Nib ? 0x80402010 : 0x08040201));
}

// c[0], c[1] = the signed values of IQ2's 8-value points idx (values 0-3, then 4-7; one 64-bit gather
// a half register) with the signs of sign byte s (spread: spread_byte).
template <class V>
LOCALLLM_STEP void signed_pair(const int32_t* grid, typename V::I idx, typename V::I s, typename V::I* c) {
  typename V::I lo, hi;
  V::gather_pairs(grid, idx, lo, hi);
  c[0] = signed_values<V, 0>(lo, s);
  c[1] = signed_values<V, 1>(hi, s);
}

// The factors d (2 sc + 1) / Div of 4-bit sub-scales sc (one a lane).
template <class V, int Div>
LOCALLLM_STEP typename V::F odd_scale(typename V::F D, typename V::I sc) {
  const typename V::F odd = V::fmul(D, V::cvt(V::add(V::shl32(sc, 1), V::i32(1))));
  if constexpr (Div == 1) return odd;
  else return V::fmul(odd, V::set(1.0f / Div));
}

// IQ2_XS's and IQ2_S's factors of each half from their sub-scale bytes at p (a nibble a half).
template <class V>
LOCALLLM_STEP void half_scales(const uint8_t* p, typename V::F D, typename V::F* out) {
  const typename V::I sc = V::u8(p);
  out[0] = odd_scale<V, 8>(D, V::band(sc, V::i32(15)));
  out[1] = odd_scale<V, 8>(D, V::shr32(sc, 4));
}

// Fo::point<V, l>(args...) for each l of the sequence (a format's code vectors, one point at a time).
template <class Fo, class V, int... l, class... A>
LOCALLLM_STEP void each_point(std::integer_sequence<int, l...>, const A&... args) {
  (Fo::template point<V, l>(args...), ...);
}

}  // namespace fmt

// What the five formats share: the kernel's traits, and where a group's bytes lie.
template <int64_t F>
struct LatticeDefaults : FormatDefaults {
  static constexpr FmtInfo kInfo = fmt_info(F);
  static constexpr int kGroups = kInfo.sb / kGroup;
  static constexpr int kFactors = 1;
  static constexpr bool kWholeSums = true;
  // The group's bytes, from its sub-scale block and index (the scalar decoders' and factors' view).
  static const uint8_t* group_of(const uint8_t* scp, int gi) { return scp - (kGroups - gi) * kInfo.cb; }
  static int32_t word_at(const uint8_t* p) {
    int32_t w;
    std::memcpy(&w, p, 4);
    return w;
  }
  // A weight d (sc + 1/2) step value, in the reference's order (u: 128 + value).
  static float odd_weight(float d, int sc, float step, int u) {
    return d * (0.5f + static_cast<float>(sc)) * step * static_cast<float>(u - 128);
  }
  // The sub-scale of weight k's half from its byte (a nibble a half: IQ2_XS, IQ2_S).
  static int half_scale(uint8_t byte, int k) { return (byte >> (k < 16 ? 0 : 4)) & 15; }
};

// IQ2_XXS: idx u8[4][16] at 0, the 32-bit words [16] at 64.
template <>
struct Format<kFmtIQ2_XXS> : LatticeDefaults<kFmtIQ2_XXS> {
  template <class V, bool>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    const int r0 = at / 4;
    const typename V::I w = V::ld(cb + 64 + at);
    const int32_t* grid = lattice_grid<kFmtIQ2_XXS>();
    for (int l = 0; l < 4; ++l) {
      const typename V::I s = fmt::spread_byte<V, 0>(V::ksign_bytes(V::band(V::shr32(w, 7 * l), V::i32(127))));
      fmt::signed_pair<V>(grid, V::u8(cb + 16 * l + r0), s, c + 2 * l);
    }
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F,
                                    typename V::F* out) {
    out[0] = fmt::odd_scale<V, 8>(D, V::shr32(V::ld(group_of(scp, gi) + 64 + V::kBytes * H), 28));
  }
  static int code(const uint8_t* cb, int j, int v, int t) {
    const int l = v / 2, half = v % 2;
    const int32_t w = word_at(cb + 64 + 4 * j);
    const int s = ksign((static_cast<uint32_t>(w) >> (7 * l)) & 127);
    const int32_t point = lattice_grid<kFmtIQ2_XXS>()[2 * cb[16 * l + j] + half];
    return signed_code(grid_value(point, t), (s >> (4 * half + t)) & 1);
  }
  static float weight(int u, float d, float, const uint8_t* scp, int j, int gi, int) {
    return odd_weight(d, static_cast<uint32_t>(word_at(group_of(scp, gi) + 64 + 4 * j)) >> 28, 0.25f, u);
  }
};

// IQ2_XS: q u16[4][16] at 0 (idx: bits 0-8, ksigns index: 9-15), sc u8[16] at 128.
template <>
struct Format<kFmtIQ2_XS> : LatticeDefaults<kFmtIQ2_XS> {
  static constexpr int kFactors = 2;
  static constexpr bool kHalfScales = true;
  static constexpr bool kWholeSums = false;
  template <class V, bool>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    const int r0 = at / 4;
    const int32_t* grid = lattice_grid<kFmtIQ2_XS>();
    for (int l = 0; l < 4; ++l) {
      const typename V::I q = V::u16(cb + 32 * l + 2 * r0);
      const typename V::I s = fmt::spread_byte<V, 0>(V::ksign_bytes(V::shr32(q, 9)));
      fmt::signed_pair<V>(grid, V::band(q, V::i32(511)), s, c + 2 * l);
    }
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F,
                                    typename V::F* out) {
    fmt::half_scales<V>(group_of(scp, gi) + 128 + V::kLanes * H, D, out);
  }
  static int code(const uint8_t* cb, int j, int v, int t) {
    const int l = v / 2, half = v % 2;
    const int q = cb[32 * l + 2 * j] | cb[32 * l + 2 * j + 1] << 8;
    const int32_t point = lattice_grid<kFmtIQ2_XS>()[2 * (q & 511) + half];
    return signed_code(grid_value(point, t), (ksign(q >> 9) >> (4 * half + t)) & 1);
  }
  static float weight(int u, float d, float, const uint8_t* scp, int j, int gi, int k) {
    return odd_weight(d, half_scale(group_of(scp, gi)[128 + j], k), 0.25f, u);
  }
};

// IQ2_S: idx u8[4][16] at 0, sign bytes [16][4] at 64, qh u8[16] at 128 (bits 2l..2l+1: idx l's
// bits 8-9), sc u8[16] at 144.
template <>
struct Format<kFmtIQ2_S> : LatticeDefaults<kFmtIQ2_S> {
  static constexpr int kFactors = 2;
  static constexpr bool kHalfScales = true;
  static constexpr bool kWholeSums = false;
  template <class V, int l>
  static LOCALLLM_STEP void point(const uint8_t* cb, int r0, typename V::I sg, typename V::I qh, typename V::I* c) {
    const typename V::I high = V::band(V::shl32(qh, 8 - 2 * l), V::i32(0x300));
    const typename V::I idx = V::bor(V::u8(cb + 16 * l + r0), high);
    fmt::signed_pair<V>(lattice_grid<kFmtIQ2_S>(), idx, fmt::spread_byte<V, l>(sg), c + 2 * l);
  }
  template <class V, bool>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    const int r0 = at / 4;
    const typename V::I sg = V::ld(cb + 64 + at), qh = V::u8(cb + 128 + r0);
    fmt::each_point<Format, V>(std::make_integer_sequence<int, 4>(), cb, r0, sg, qh, c);
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F,
                                    typename V::F* out) {
    fmt::half_scales<V>(group_of(scp, gi) + 144 + V::kLanes * H, D, out);
  }
  static int code(const uint8_t* cb, int j, int v, int t) {
    const int l = v / 2, half = v % 2;
    const int idx = cb[16 * l + j] | ((cb[128 + j] >> (2 * l)) & 3) << 8;
    const int32_t point = lattice_grid<kFmtIQ2_S>()[2 * idx + half];
    return signed_code(grid_value(point, t), (cb[64 + 4 * j + l] >> (4 * half + t)) & 1);
  }
  static float weight(int u, float d, float, const uint8_t* scp, int j, int gi, int k) {
    return odd_weight(d, half_scale(group_of(scp, gi)[144 + j], k), 0.25f, u);
  }
};

// IQ3_XXS: idx u8[8][16] at 0, the 32-bit words [16] at 128.
template <>
struct Format<kFmtIQ3_XXS> : LatticeDefaults<kFmtIQ3_XXS> {
  template <class V, bool>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    const int r0 = at / 4;
    const typename V::I w = V::ld(cb + 128 + at);
    const int32_t* grid = lattice_grid<kFmtIQ3_XXS>();
    for (int l = 0; l < 4; ++l) {
      const typename V::I s = fmt::spread_byte<V, 0>(V::ksign_bytes(V::band(V::shr32(w, 7 * l), V::i32(127))));
      c[2 * l] = fmt::signed_values<V, 0>(V::template gather32<4>(grid, V::u8(cb + 32 * l + r0)), s);
      c[2 * l + 1] = fmt::signed_values<V, 1>(V::template gather32<4>(grid, V::u8(cb + 32 * l + 16 + r0)), s);
    }
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F,
                                    typename V::F* out) {
    out[0] = fmt::odd_scale<V, 4>(D, V::shr32(V::ld(group_of(scp, gi) + 128 + V::kBytes * H), 28));
  }
  static int code(const uint8_t* cb, int j, int v, int t) {
    const int s = ksign((static_cast<uint32_t>(word_at(cb + 128 + 4 * j)) >> (7 * (v / 2))) & 127);
    const int32_t point = lattice_grid<kFmtIQ3_XXS>()[cb[16 * v + j]];
    return signed_code(grid_value(point, t), (s >> (4 * (v % 2) + t)) & 1);
  }
  static float weight(int u, float d, float, const uint8_t* scp, int j, int gi, int) {
    return odd_weight(d, static_cast<uint32_t>(word_at(group_of(scp, gi) + 128 + 4 * j)) >> 28, 0.5f, u);
  }
};

// IQ3_S: idx u8[8][16] at 0, qh u8[16] at 128 (bit v: idx v's bit 8), sign bytes [16][4] at 144;
// the sub-scale block: sc u8[4][16] (group gi: nibble gi % 2 of byte gi / 2).
template <>
struct Format<kFmtIQ3_S> : LatticeDefaults<kFmtIQ3_S> {
  template <class V, int v>
  static LOCALLLM_STEP void point(const uint8_t* cb, int r0, typename V::I sg, typename V::I qh, typename V::I* c) {
    const typename V::I high = V::band(V::shl32(qh, 8 - v), V::i32(0x100));
    const typename V::I idx = V::bor(V::u8(cb + 16 * v + r0), high);
    c[v] = fmt::signed_values<V, v % 2>(V::template gather32<4>(lattice_grid<kFmtIQ3_S>(), idx),
                                        fmt::spread_byte<V, v / 2>(sg));
  }
  template <class V, bool>
  static LOCALLLM_STEP void decode(const uint8_t* cb, int at, typename V::I* c) {
    const int r0 = at / 4;
    const typename V::I qh = V::u8(cb + 128 + r0), sg = V::ld(cb + 144 + at);
    fmt::each_point<Format, V>(std::make_integer_sequence<int, 8>(), cb, r0, sg, qh, c);
  }
  template <class V>
  static LOCALLLM_STEP void factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F,
                                    typename V::F* out) {
    const typename V::I sc = V::band(V::shr32(V::u8(scp + 16 * (gi / 2) + V::kLanes * H), 4 * (gi % 2)), V::i32(15));
    out[0] = fmt::odd_scale<V, 1>(D, sc);
  }
  static int code(const uint8_t* cb, int j, int v, int t) {
    const int idx = cb[16 * v + j] | ((cb[128 + j] >> v) & 1) << 8;
    const int32_t point = lattice_grid<kFmtIQ3_S>()[idx];
    return signed_code(grid_value(point, t), (cb[144 + 4 * j + v / 2] >> (4 * (v % 2) + t)) & 1);
  }
  static float weight(int u, float d, float, const uint8_t* scp, int j, int gi, int) {
    const int sc = (scp[16 * (gi / 2) + j] >> (4 * (gi % 2))) & 15;
    return d * static_cast<float>(1 + 2 * sc) * static_cast<float>(u - 128);
  }
};

}  // namespace
