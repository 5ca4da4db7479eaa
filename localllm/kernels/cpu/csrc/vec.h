// The vector traits V256 (AVX2) and V512 (AVX-512 VNNI) that every kernel is written over.
#pragma once

namespace {

#if LOCALLLM_HAVE_NATIVE

// ---------------------------------------------------------------------------------------------
// Vector traits. Every kernel is written once, as a template over the vector width, and
// instantiated for the build's instruction set (VNative): V256 (AVX2 + FMA + F16C: 8 float or
// int32 lanes) or V512 (AVX-512 VNNI: 16 lanes; an AVX-512 build has the AVX2 instructions too).
// A traits struct names its register types and wraps each intrinsic the kernels use in one
// static function. Where the two instruction sets do a step differently (a lane sum, the int8
// dot products, exp's scaling by 2^n), each does it with the same values and float operations in
// the same order, so the matmuls, the activation codes, dot/rms_norm and exp give the same bits
// in both builds; attention sums a score's lanes in each width's own order (lane_sums).
//
// In the quantized tiles one int32 or float lane is one output row: a 64-byte tile vector (16
// rows x 4 code bytes) is kChunks registers (V256: rows 0-7, then rows 8-15; V512: one).
//
// The operations that read the same at both widths are written once, in VectorOps, with GCC's
// vector extensions (as GCC's own headers define those intrinsics: _mm256_add_ps(a, b) is a + b):
// the same instructions and results. (Not max and min: written a > b ? a : b, GCC does not
// always make vmaxps of it.)
template <int Bytes>
struct LaneTypes {  // a register's bits as int32, unsigned int32, uint16 and byte lanes
  typedef int32_t I32 __attribute__((vector_size(Bytes)));
  typedef uint32_t U32 __attribute__((vector_size(Bytes)));
  typedef uint16_t U16 __attribute__((vector_size(Bytes)));
  typedef uint8_t U8 __attribute__((vector_size(Bytes)));
};

template <class FloatReg, class IntReg, class Derived>
struct VectorOps {
  using F = FloatReg;  // float lanes
  using I = IntReg;    // integer lanes: int32 unless a name says otherwise
  using I32 = typename LaneTypes<sizeof(I)>::I32;
  using U32 = typename LaneTypes<sizeof(I)>::U32;
  using U16 = typename LaneTypes<sizeof(I)>::U16;
  using U8 = typename LaneTypes<sizeof(I)>::U8;
  static constexpr int kLanes = sizeof(F) / 4;      // int32 / float lanes: rows per register
  static constexpr int kBytes = 4 * kLanes;         // bytes of one register of codes
  static constexpr int kChunks = kTile / kLanes;    // registers per 16-row tile vector

  static I bytes(int c) { return I(U8{} + static_cast<uint8_t>(c)); }  // c in every byte
  static I i32(int v) { return I(U32{} + static_cast<uint32_t>(v)); }
  static I b4(const int8_t* p) {  // 4 activation codes, broadcast to every int32 lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return i32(v);
  }
  static I band(I a, I b) { return a & b; }
  static I bor(I a, I b) { return a | b; }
  static I bxor(I a, I b) { return a ^ b; }
  // p negated (mod 256) in the bytes where spread has a bit of bits (one bit a byte) set.
  static I negate_where(I p, I spread, I bits) {
    const U8 neg = U8((U8(spread) & U8(bits)) == U8(bits));  // 0xff where negated
    return I((U8(p) ^ neg) - neg);
  }
  // The sign bytes of 7-bit ksigns indices s (one a lane, the other bits 0): s with its parity as
  // bit 7, the parity of the nibble s ^ (s >> 4) looked up (vpshufb).
  static I ksign_bytes(I s) {
    alignas(16) static constexpr uint8_t kParity[16] = {0, 0x80, 0x80, 0, 0x80, 0, 0, 0x80,
                                                        0x80, 0, 0, 0x80, 0, 0x80, 0x80, 0};
    const I n = (s ^ shr32(s, 4)) & i32(15);
    return s | Derived::lookup16(Derived::table16(kParity), n);
  }
  template <int N> static I shl16(I a) { return I(U16(a) << N); }  // per 16-bit lane
  template <int N> static I shr16(I a) { return I(U16(a) >> N); }
  template <int N> static I shift16(I a) {  // left by N, or right by -N where N < 0
    if constexpr (N >= 0) return shl16<N>(a);
    else return shr16<-N>(a);
  }
  // Bits Shift .. Shift + Width - 1 of each byte, moved to bits To .. To + Width - 1 (the other
  // bits 0): a shift and a mask. (kAffine: whether a build that can do it in one instruction
  // should; see V512::field.)
  template <int Shift, int Width, bool kAffine = false, int To = 0> static I field(I a) {
    return shift16<To - Shift>(a) & bytes(((1 << Width) - 1) << To);
  }
  static I shr32_4(I a) { return I(U32(a) >> 4); }
  static I shr32(I a, int n) { return I(U32(a) >> n); }  // per 32-bit lane, by a count known at run time
  static I shl32(I a, int n) { return I(U32(a) << n); }
  static I add(I a, I b) { return I(U32(a) + U32(b)); }  // wrapping, as vpaddd
  static I sub(I a, I b) { return I(U32(a) - U32(b)); }
  static I mul(I a, I b) { return I(U32(a) * U32(b)); }  // the low 32 bits, as vpmulld

  static F zero() { return F{}; }
  static F cvt(I a) { return __builtin_convertvector(I32(a), F); }  // int32 -> float, as vcvtdq2ps
  static F fadd(F a, F b) { return a + b; }
  static F fsub(F a, F b) { return a - b; }
  static F fmul(F a, F b) { return a * b; }
  static F fdiv(F a, F b) { return a / b; }
  static F abs(F a) { return F(I32(a) & 0x7fffffff); }  // the sign bit cleared
};

struct V256 : VectorOps<__m256, __m256i, V256> {
  static constexpr int kAccumulators = 8;  // float accumulators a loop keeps (of 16 registers)
  static constexpr bool kHoldsQ = false;   // attention reads q's vectors from memory as it goes
  static constexpr bool kByteProducts = false;  // vpmaddubsw's pairs saturate for 8-bit values u

  // integer lanes
  static I ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I u16(const uint8_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // base[idx] per lane, base read as int32 at Scale bytes a step (vpgatherdd)
  template <int Scale> static I gather32(const int32_t* base, I idx) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), idx, Scale);
  }
  // The pairs of int32 base[2 idx], base[2 idx + 1] per lane, as two registers: one 64-bit gather a
  // half (the gathers cost per element: half the loads of two 32-bit gathers), then unzipped.
  static void gather_pairs(const int32_t* base, I idx, I& lo, I& hi) {
    const long long* b = reinterpret_cast<const long long*>(base);
    const __m256 q0 = _mm256_castsi256_ps(_mm256_i32gather_epi64(b, _mm256_castsi256_si128(idx), 8));
    const __m256 q1 = _mm256_castsi256_ps(_mm256_i32gather_epi64(b, _mm256_extracti128_si256(idx, 1), 8));
    lo = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(q0, q1, 0x88)), 0xD8);
    hi = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(q0, q1, 0xDD)), 0xD8);
  }
  // The 16 bytes at p in every 128-bit lane: a table for lookup16.
  static I table16(const uint8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // Per byte, table byte idx (idx < 16: vpshufb within each 128-bit lane, whose tables are the same).
  static I lookup16(I table, I idx) { return _mm256_shuffle_epi8(table, idx); }
  static int32_t reduce_add_i32(I v) {
    __m128i s = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
  }
  // 32 int32 codes (q[0..3]) -> 32 bytes at dst: int32 -> int16 -> int8, each saturating (as one
  // int32 -> int8 saturation), then the packs' lane interleave undone.
  static void store_codes(int8_t* dst, const I* q) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
  }

  // float lanes
  static F half(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const c10::Half* p) { return half(reinterpret_cast<const uint8_t*>(p)); }
  static F gather(const float* row, const int32_t* cols) {  // row[cols[0]], ..., row[cols[7]]
    return _mm256_setr_ps(row[cols[0]], row[cols[1]], row[cols[2]], row[cols[3]], row[cols[4]], row[cols[5]],
                          row[cols[6]], row[cols[7]]);
  }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static void store_first(float* p, F a, int64_t n) {  // lanes 0 .. n - 1
    if (n == kLanes) return store(p, a);
    alignas(32) float part[kLanes];
    _mm256_store_ps(part, a);
    std::memcpy(p, part, n * sizeof(float));
  }
  static F set(float v) { return _mm256_set1_ps(v); }
  static I to_i32(F a) { return _mm256_cvtps_epi32(a); }  // round to nearest even
  static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F fmax(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmin(F a, F b) { return _mm256_min_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F zero_where_less(F v, F x, F lo) { return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), v); }
  static uint32_t ge_bits(F a, F b) {  // bit j: lane j of a >= lane j of b
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)));
  }
  static uint32_t nan_bits(F a) {  // bit j: lane j is NaN
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
  }
  // p * 2^n for the integral n in [-126, 128] that fx holds, as two exact power-of-two products
  // (2^128 is no float): vscalefps's single rounding.
  static F ldexp(F p, F fx) {
    const __m256i n = _mm256_cvtps_epi32(fx);
    const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
  }
  static float reduce_max(F v) {
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
  }
  // The lane sum in _mm512_reduce_add_ps's order (halves, quarters, then pairs).
  static float reduce_add(F v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(s) + _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
  }
  // The lane sums of a[0..7], as one vector: lane j = a[j][0] + ... + a[j][7].
  static F lane_sums(const F* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    // per 128-bit lane: the sums of a[0..3] (u0) and a[4..7] (u1) over that lane
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }

  // The int8 dot products of a tile's codes c[v] (one register each, k = 4v .. 4v + 3 of a
  // 32-group) with the activation codes xg of that group: vpmaddubsw (u8 x s8 products summed in
  // pairs to int16, saturating) and vpmaddwd by ones (int16 pairs summed to int32). The
  // activation codes of finite inputs are within [-127, 127] (|x| <= amax gives
  // |x * 127 / amax| <= 127 after rounding), so the sums below are exact.
  //
  // S0, S1: per row (int32 lane) the sums of u * xq over k = 0..15 and 16..31, added to the
  // values S0 and S1 hold (the format's offset terms, or zero). Each product vector is added as
  // it comes (a tree of adds over all eight made the compiler spill them).
  template <int Fmt>
  static void isums(const I* c, const int8_t* xg, I& S0, I& S1) {
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (code_bits(Fmt) == 6) {  // two 6-bit pairs per 16-bit lane at most (32004)
      __m256i S[2];
      for (int half = 0; half < 2; ++half) {
        const __m256i* ch = c + 4 * half;
        const int8_t* xh = xg + 16 * half;
        const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(ch[0], b4(xh)), _mm256_maddubs_epi16(ch[1], b4(xh + 4)));
        const __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(ch[2], b4(xh + 8)), _mm256_maddubs_epi16(ch[3], b4(xh + 12)));
        S[half] = _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones));
      }
      S0 = add(S0, S[0]), S1 = add(S1, S[1]);
    } else {  // four pairs of at most 5-bit codes per 16-bit lane (4 * 2 * 31 * 127 = 31496)
      __m256i a = _mm256_maddubs_epi16(c[0], b4(xg));
      for (int v = 1; v < 4; ++v) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(c[v], b4(xg + 4 * v)));
      S0 = add(S0, _mm256_madd_epi16(a, ones));
      a = _mm256_maddubs_epi16(c[4], b4(xg + 16));
      for (int v = 5; v < 8; ++v) a = _mm256_add_epi16(a, _mm256_maddubs_epi16(c[v], b4(xg + 4 * v)));
      S1 = add(S1, _mm256_madd_epi16(a, ones));
    }
  }
  // The sums of the codebook formats' 8-bit values u (value + 128, which would saturate a pair as
  // the 4-pair sums above take them): per row S_h += sum (u - 128) xq over half h, the signed values
  // q = u ^ 0x80 multiplied as |q| * (sign(q) x) (vpsignb; |q| <= 127: a pair at most 2 * 127 * 127
  // = 32258), each product vector widened at once (the offset's share is in these sums already:
  // the kernel seeds S0 and S1 with nothing, see fmt::tile_kernel's int_sums).
  static void signed_isums(const I* c, const int8_t* xg, I& S0, I& S1) {
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int half = 0; half < 2; ++half) {
      __m256i s = half ? S1 : S0;
      for (int v = 4 * half; v < 4 * half + 4; ++v) {
        const __m256i q = _mm256_xor_si256(c[v], flip);
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(b4(xg + 4 * v), q));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
      }
      (half ? S1 : S0) = s;
    }
  }
  // 8-bit codes u up to 255 would saturate a pair (2 * 255 * 127), so the signed codes q = u - 128
  // multiply instead (vpsignb moves q's sign onto x: |q| * (sign(q) x), pairs at most
  // 2 * 128 * 127 = 32512), each pair widened at once (avx2::tile_rows, the AVX2 build's 8-bit
  // tiles): sum + the products of q (|q| in aq) with 4 activation codes x per lane.
  static I add_centered_products(I sum, I q, I aq, I x) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1)));
  }
};

#if LOCALLLM_HAVE_VNNI
struct V512 : VectorOps<__m512, __m512i, V512> {
  static constexpr int kAccumulators = 16;  // (of 32 registers)
  static constexpr bool kHoldsQ = true;     // attention holds q's vectors (at most 16) in registers
  static constexpr bool kByteProducts = true;  // vpdpbusd takes unsigned bytes u up to 255 as they are

  // integer lanes
  static I ld(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I u16(const uint8_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  template <int Scale> static I gather32(const int32_t* base, I idx) { return _mm512_i32gather_epi32(idx, base, Scale); }
  static void gather_pairs(const int32_t* base, I idx, I& lo, I& hi) {  // (see V256's)
    const __m512i q0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(idx), base, 8);
    const __m512i q1 = _mm512_i32gather_epi64(_mm512_extracti32x8_epi32(idx, 1), base, 8);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    lo = _mm512_permutex2var_epi32(q0, even, q1);
    hi = _mm512_permutex2var_epi32(q0, _mm512_add_epi32(even, _mm512_set1_epi32(1)), q1);
  }
  static I negate_where(I p, I spread, I bits) {  // (a mask from one test, a masked subtract)
    return _mm512_mask_sub_epi8(p, _mm512_test_epi8_mask(spread, bits), _mm512_setzero_si512(), p);
  }
#if defined(__AVX512VPOPCNTDQ__)
  static I ksign_bytes(I s) {  // (the parity from vpopcntd)
    return _mm512_or_si512(s, _mm512_and_si512(_mm512_slli_epi32(_mm512_popcnt_epi32(s), 7), _mm512_set1_epi32(0x80)));
  }
#endif
  static I table16(const uint8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I lookup16(I table, I idx) { return _mm512_shuffle_epi8(table, idx); }
  static int32_t reduce_add_i32(I v) { return _mm512_reduce_add_epi32(v); }
  static void store_codes(int8_t* dst, const I* q) {  // 32 int32 codes (q[0], q[1]), saturated to int8
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q[0]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q[1]));
  }

  // float lanes
  static F half(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const c10::Half* p) { return half(reinterpret_cast<const uint8_t*>(p)); }
  static F gather(const float* row, const int32_t* cols) {  // row[cols[0]], ..., row[cols[15]]
    return _mm512_i32gather_ps(_mm512_loadu_si512(cols), row, 4);
  }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static void store_first(float* p, F a, int64_t n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a); }
  static F set(float v) { return _mm512_set1_ps(v); }
  static I to_i32(F a) { return _mm512_cvtps_epi32(a); }
  static F round(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F fmax(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmin(F a, F b) { return _mm512_min_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F zero_where_less(F v, F x, F lo) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), v, _mm512_set1_ps(0.0f)); }
  static uint32_t ge_bits(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static uint32_t nan_bits(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static F ldexp(F p, F fx) { return _mm512_scalef_ps(p, fx); }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
  // The lane sums of a[0..15], as one vector: lane j = a[j][0] + ... + a[j][15].
  static F lane_sums(const F* a) {
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

#if defined(__GFNI__)
  // Bits Shift .. Shift + Width - 1 of each byte at bits To .. To + Width - 1. With kAffine, one affine
  // transform over GF(2) per byte (vgf2p8affineqb: output bit i is the parity of matrix byte 7 - i
  // and the input byte) where a shift and a mask take two instructions: the one-row kernels, whose
  // vector pipes have room, take it. Where vpdpbusd keeps the pipes busy (the multi-row kernels) it
  // competes with the dot products and lost. Zen 4, 512x2048 in L2, 1 thread, shift and mask /
  // affine: one row, median GB/s of 9 interleaved rounds, Q3_K 28.5 / 29.5, Q4_K 40.0 / 41.7, Q5_K
  // 35.2 / 36.4; 128 rows, median G int8 ops/s of 11, Q4_K 296 / 284, Q4_0 315 / 310.
  template <int Shift, int Width, bool kAffine = false, int To = 0> static I field(I a) {
    if constexpr (Shift == To || !kAffine) {
      return VectorOps::field<Shift, Width, false, To>(a);
    } else {
      constexpr uint64_t m = [] {
        uint64_t r = 0;
        for (int i = 0; i < Width; ++i) r |= (uint64_t{1} << (i + Shift)) << (8 * (7 - (i + To)));
        return r;
      }();
      return _mm512_gf2p8affine_epi64_epi8(a, _mm512_set1_epi64(static_cast<long long>(m)), 0);
    }
  }
#endif
  // acc + vpdpbusd of the codes c with the 4 activation codes at p in every lane, broadcast by the
  // instruction's own load ({1to16}; from the intrinsic, GCC made a vpbroadcastd of each, an
  // operation more per product vector). Zen 4, the same bits, median GB/s of 7-9 interleaved
  // rounds, one row: in L2 (512x2048, 1 thread) Q4_0 45.8 -> 48.4, Q4_K 34.2 -> 37.0, Q6_K 35.4
  // -> 36.9, Q8_0 62.3 -> 65.7; beyond L3 (12 x 8192x2048, 2 threads) Q4_0 58.1 -> 59.4, Q4_K
  // 51.4 -> 53.1, Q6_K 49.0 -> 53.9, Q8_0 47.5 -> 49.3; 128 rows in L2, G int8 ops/s: Q4_0 642 ->
  // 657, Q8_0 638 -> 672, the others +1-3%.
  static I dot4(I acc, I c, const int8_t* p) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(c), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
  // V256's sums by vpdpbusd: four u8 x s8 products added into each int32 lane, no intermediate
  // 16-bit sums, so no pairing is needed for any code width. The products accumulate onto S0's
  // and S1's values (the offset terms seed the chains: an instruction less than subtracting them
  // after).
  template <int Fmt>
  static void isums(const I* c, const int8_t* xg, I& S0, I& S1) {
    I a = S0, b = S1;
    for (int v = 0; v < 4; ++v) {
      a = dot4(a, c[v], xg + 4 * v);
      b = dot4(b, c[4 + v], xg + 16 + 4 * v);
    }
    S0 = a, S1 = b;
  }
  // Per row the sum of (u - 128) * xq over the group, for 8-bit codes u (sum_x: the sum of xq):
  // sum u xq - 128 sum_x, the unsigned codes multiplied as they are, in two chains that take the
  // code vectors in memory order (faster than isums' halves here).
  static I centered_dot8(const I* c, const int8_t* xg, int32_t sum_x) {
    I a = i32(-128 * sum_x), b = _mm512_setzero_si512();
    for (int v = 0; v < 8; v += 2) {
      a = dot4(a, c[v], xg + 4 * v);
      b = dot4(b, c[v + 1], xg + 4 * v + 4);
    }
    return add(a, b);
  }
};
using VNative = V512;
#else
using VNative = V256;
#endif

// The lane-wise maximum of |a[0]|, ..., |a[N - 1]|, pairwise (a[0] with a[1], then the pairs).
template <class V, int N>
inline typename V::F max_abs(const typename V::F* a) {
  if constexpr (N == 1) return V::abs(a[0]);
  else return V::fmax(max_abs<V, N / 2>(a), max_abs<V, N / 2>(a + N / 2));
}

// The lane-wise sum of a[0], ..., a[N - 1] (int32), pairwise.
template <class V, int N>
inline typename V::I sum_i32(const typename V::I* a) {
  if constexpr (N == 1) return a[0];
  else return V::add(sum_i32<V, N / 2>(a), sum_i32<V, N / 2>(a + N / 2));
}

#endif  // LOCALLLM_HAVE_NATIVE

}  // namespace
