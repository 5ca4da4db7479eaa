// What every tiled weight format shares: the code planes and their decoders (vector and scalar), the
// traits that each format's header specializes (Format<F>: fmt_legacy.h, fmt_kquants.h,
// fmt_codebook.h), and the packed sizes. The formats' ids and geometry: formats.h (generated from localllm/quant/traits.py).
#pragma once

namespace {

// ---------------------------------------------------------------------------------------------
// The 4- and 8-bit tiles and every other GGUF type (Q4_0 at its file's size, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K, Q3_K, Q2_K, MXFP4, IQ4_NL, IQ4_XS, F16, BF16): one implementation, a template over the vector width (V256
// in the AVX2 build, V512 in the AVX-512 one; F16/BF16 stay 256-bit in both: fmt_float.h). Per
// output both give the same bits (tests/kernels/test_cpu_types.py runs the two builds side by side on an
// AVX-512 CPU), so what is tested on one machine is what runs on the other. The format id is
// qgemm's `bits` argument; the table of formats, their super-blocks and bytes is at the top of
// formats.h. Every format but the tiles keeps the file's codes and scales exactly.
//
// Scale arrays are [sub-block][row of the tile]; d (and z, dmin) are float16 [16] per super-block,
// the file's values.
//
// Codes of one 32-group, 16 rows, k = 4v + t (v = 0..7, t = 0..3), in planes (a codebook format's
// 4-bit codes in nibbles, looked up into their values as they are decoded: fmt_codebook.h):
//   nibbles (256 bytes, the 4-bit layout of cpu_kernels.cpp): vector s (64 bytes), byte 4j + t:
//     row j's code bits 0-3 for v = 2s (low nibble) and v = 2s + 1 (high nibble);
//   crumbs (the 2-bit plane, 128 bytes): vector s = 0, 1, byte 4j + t, bits 2h..2h+1: v = 4s + h;
//   bits (the 1-bit plane, 64 bytes): byte 4j + t, bit v;
//   bytes (512 bytes, the 8-bit tiles): vector v, byte 4j + t;
//   three_bit (192 bytes, Q3_K): see fmt_kquants.h.
// A format's codes are its planes' fields, the first plane's lowest: 4-bit codes (Q4_0, Q4_K) =
// nibbles; 5-bit = nibbles | bits << 4; 6-bit = nibbles | crumbs << 4; 2-bit = crumbs. Each 64-byte
// vector is two 32-byte halves (rows 0-7, 8-15), one AVX2 register, one int32 lane per row.
//
// Per 32-group g and activation pass, with S0, S1 the exact integer sums of u * xq over the
// group's two halves (AVX2: vpmaddubsw + vpmaddwd, a 16-bit lane gathers at most 4 products of
// 5-bit codes (4 * 2 * 31 * 127 = 31496) or 2 of 6-bit ones (32004), then widens, and the codebook
// formats' 8-bit values one pair of signed ones (V256::signed_isums); AVX-512:
// vpdpbusd, four products straight into each int32 lane) and X0, X1 those of xq, each format's
// header gives its weights and its output terms (Ti: the group's integer sum). Ti is an exact
// integer below 2^24 (so exact as float32 too), d sc and dmin m are exact float32 products of the
// file's values: the only roundings are the float32 products and the sums, at most two per group
// before its term is added to the output, one fixed sequence per output whatever the batch (rows of
// a batch only share loads).

int64_t round_tile(int64_t n) { return (n + kTile - 1) / kTile * kTile; }

// Bytes of a packed weight [N, K] in format f (N rounded up to whole tiles for the quantized ones).
int64_t fmt_packed_bytes(int64_t f, int64_t N, int64_t K) {
  if (is_float_fmt(f)) return N * K * 2;
  const int64_t tiles = round_tile(N) / kTile;
  const FmtInfo fi = fmt_info(f);
  return tiles * (K / fi.sb) * fi.sb_bytes();
}

// Whether this build has the kernels for the formats (AVX2, FMA and F16C: every native build).
bool formats() { return LOCALLLM_HAVE_NATIVE; }

// How a group's offset or min enters its outputs, after its scaled integer sum (fmt_kernel.h's
// accumulate): not at all (the offsets in the codes' sums, or none), + z (xs (X0 + X1)) with the
// format's z (kZ), - (dmin m) (xs (X0 + X1)) with a min per group (kMin), or per half (kHalfMins).
enum class Share { kNone, kZ, kMin, kHalfMins };

// A format's kernel traits, each format's specialization of Format<F> overriding what differs:
//   kShare: see Share;
//   kFactors: float factor vectors per group and row register (Format::factors, from the
//     sub-scales: d sc, of each half where kHalfScales, then dmin m, of each half for kHalfMins),
//     which a multi-row call keeps for the tile's later calls (fmt_kernel.h's FactorSource);
//   kHalfScales: a sub-scale per 16 weights, each half's sum scaled apart;
//   kWholeSums: the kernel takes each group's activation code sums whole (xsum: offsets and mins
//     per 32), else by halves (x16: the sub-scales and mins per 16, the 5-bit formats' offsets);
//   kCentered: the 8-bit tiles, whose codes multiply as u - 128 (V512::centered_dot8);
//   kAvx2Tiles: the AVX2 build multiplies it with avx2::gemm_tile (avx2_tiles.h), not fmt::.
// and (every format) decode<V, kAffine>(cb, at, c): the group's 8 code vectors c[v] of the rows at
// byte `at` of each 64-byte vector (see fmt::decode); code(cb, j, v, t): row j's code k = 4v + t,
// scalar; weight(u, d, dz, scp, j, gi, k): its weight in the file's decoder's arithmetic (see
// fmt_weight_as).
struct FormatDefaults {
  static constexpr Share kShare = Share::kNone;
  static constexpr int kFactors = 0;
  static constexpr bool kHalfScales = false;
  static constexpr bool kWholeSums = false;
  static constexpr bool kCentered = false;
  static constexpr bool kAvx2Tiles = false;
};

template <int64_t F>
struct Format;

// The per-group steps (the formats' decoders and factors) are always inlined into the kernels: left
// to its own budget, GCC made decode a call of its own in the one-row kernel of a large caller (the
// codes through the stack, and a vzeroupper per group: Q6_K one row in L2 38 -> 27 GB/s).
#define LOCALLLM_STEP inline __attribute__((always_inline))

namespace fmt {

// c[j] = field j of the code vector v (bits Width * j .. Width * j + Width - 1 of each byte), for
// j = 0 .. Fields - 1. (16-bit shifts are safe: the bits they carry across a byte boundary land
// outside each mask.)
template <class V, int Width, int Fields, bool kAffine, int j = 0>
LOCALLLM_STEP void split_fields(typename V::I* c, typename V::I v) {
  if constexpr (j < Fields) {
    c[j] = V::template field<Width * j, Width, kAffine>(v);
    split_fields<V, Width, Fields, kAffine, j + 1>(c, v);
  }
}

// c[j] |= field j of the plane vector hv, moved to bits To .. To + Width - 1, for j = 0 .. Fields - 1.
template <class V, int Width, int To, int Fields, int j = 0>
LOCALLLM_STEP void merge_fields(typename V::I* c, typename V::I hv) {
  if constexpr (j < Fields) {
    c[j] = V::bor(c[j], V::band(V::template shift16<To - Width * j>(hv), V::bytes(((1 << Width) - 1) << To)));
    merge_fields<V, Width, To, Fields, j + 1>(c, hv);
  }
}

// The planes' vector decoders: c[v] for v = 0..7 from the plane at p, the rows at byte `at` of each
// of its 64-byte vectors (kAffine: see V512::field).
template <class V, bool kAffine>
LOCALLLM_STEP void nibble_plane(const uint8_t* p, int at, typename V::I* c) {
  for (int s = 0; s < 4; ++s) split_fields<V, 4, 2, kAffine>(c + 2 * s, V::ld(p + 64 * s + at));
}
template <class V, bool kAffine>
LOCALLLM_STEP void crumb_plane(const uint8_t* p, int at, typename V::I* c) {
  for (int s = 0; s < 2; ++s) split_fields<V, 2, 4, kAffine>(c + 4 * s, V::ld(p + 64 * s + at));
}
template <class V>
LOCALLLM_STEP void byte_plane(const uint8_t* p, int at, typename V::I* c) {  // one byte a code: vector v is c[v]
  for (int v = 0; v < 8; ++v) c[v] = V::ld(p + 64 * v + at);
}
// A codebook format's values as the kernels multiply them, u = value + code_offset (formats.h).
template <int64_t F>
constexpr std::array<uint8_t, 16> codebook_values() {
  std::array<uint8_t, 16> u{};
  for (int i = 0; i < 16; ++i) u[i] = static_cast<uint8_t>(codebook(F)[i] + code_offset(F));
  return u;
}
template <int64_t F>
inline constexpr std::array<uint8_t, 16> kCodebookValues = codebook_values<F>();

// The nibble plane's codes looked up into their values u (one vpshufb a vector: the codes are < 16).
template <class V, int64_t F, bool kAffine>
LOCALLLM_STEP void codebook_plane(const uint8_t* p, int at, typename V::I* c) {
  nibble_plane<V, kAffine>(p, at, c);
  const typename V::I table = V::table16(kCodebookValues<F>.data());
  for (int v = 0; v < 8; ++v) c[v] = V::lookup16(table, c[v]);
}
// c[v] |= the crumbs (bits 2h..2h+1 of 2-bit vector s) at bits 4-5 of c[4s + h] (6-bit codes).
template <class V>
LOCALLLM_STEP void merge_crumb_plane(const uint8_t* p, int at, typename V::I* c) {
  for (int s = 0; s < 2; ++s) merge_fields<V, 2, 4, 4>(c + 4 * s, V::ld(p + 64 * s + at));
}
// c[v] |= bit v of the 1-bit plane at bit 4 (5-bit codes).
template <class V>
LOCALLLM_STEP void merge_bit_plane(const uint8_t* p, int at, typename V::I* c) {
  merge_fields<V, 1, 4, 8>(c, V::ld(p + at));
}

}  // namespace fmt

// The planes' scalar decoders: row j's field of code k = 4v + t from the plane at p.
inline int nibble_at(const uint8_t* p, int j, int v, int t) {
  const uint8_t byte = p[64 * (v / 2) + 4 * j + t];
  return (v % 2) ? byte >> 4 : byte & 0x0F;
}
inline int crumb_at(const uint8_t* p, int j, int v, int t) { return (p[64 * (v / 4) + 4 * j + t] >> (2 * (v % 4))) & 3; }
inline int bit_at(const uint8_t* p, int j, int v, int t) { return (p[4 * j + t] >> v) & 1; }
inline int byte_at(const uint8_t* p, int j, int v, int t) { return p[64 * v + 4 * j + t]; }

// Scalar decode of one weight (row j of the tile, element k of group gi of the super-block at
// sbp): the file's float32 value, in its decoder's arithmetic (every product is exact in
// float32, so there is a single rounding, at the final sum, as in the reference).
template <int64_t f>
inline float fmt_weight_as(const uint8_t* sbp, int j, int gi, int k) {
  constexpr FmtInfo fi = fmt_info(f);
  const uint8_t* cb = sbp + gi * fi.cb;
  const uint8_t* scp = sbp + (fi.sb / kGroup) * fi.cb;
  const at::Half* dp = reinterpret_cast<const at::Half*>(scp + fi.scb);
  const float d = fi.d ? static_cast<float>(dp[j]) : 0.0f;
  const float dz = fi.z ? static_cast<float>(dp[16 + j]) : 0.0f;
  const int v = k / 4, t = k % 4;
  return Format<f>::weight(Format<f>::code(cb, j, v, t), d, dz, scp, j, gi, k);
}

// Calls f(std::integral_constant<int64_t, F>()) for the tiled format F that bits names (formats.h).
template <typename Fn>
void with_tiled_fmt(int64_t bits, Fn&& f) {
  switch (bits) {
#define LOCALLLM_CASE(F) \
  case F: f(std::integral_constant<int64_t, F>()); break;
    FOR_EACH_TILED_FORMAT(LOCALLLM_CASE)
#undef LOCALLLM_CASE
    default: TORCH_CHECK(false, "not a tiled format: ", bits);
  }
}

}  // namespace
