// The KV cache's row types and where a layer's rows lie (localllm/quant/kv_rows.py, the reference).
//
// A head's row of hd values is stored as float32, float16, bfloat16, or GGML's q8_0 / q4_0 blocks
// (32 values: a float16 scale d, then 32 int8 codes, or 16 bytes of 4-bit codes, element j in the low
// nibble of byte j and element j + 16 in its high one; the value is d * code, d * (code - 8)). A cache
// of one float type for keys and values is the tensor [2, blocks, block_size, nkv, hd]; any other pair
// is a split cache, uint8 [blocks, block_size, nkv, k_row + v_row] by its sizes, each block's K rows
// [block_size, nkv, k_row] first, then its V rows. Rows are written as the reference writes them
// (ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref), the same bytes.

enum KvType : int { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2, kKvQ8_0 = 3, kKvQ4_0 = 4 };
constexpr int64_t kKvBlock = 32;  // values of a q8_0 / q4_0 block

inline int64_t kv_row_bytes(int type, int64_t hd) {
  switch (type) {
    case kKvF32: return 4 * hd;
    case kKvF16:
    case kKvBF16: return 2 * hd;
    case kKvQ8_0: return hd / kKvBlock * (2 + kKvBlock);
    case kKvQ4_0: return hd / kKvBlock * (2 + kKvBlock / 2);
  }
  TORCH_CHECK(false, "unknown KV cache type ", type);
}

inline uint16_t half_bits(float x) { return c10::Half(x).x; }
inline float half_value(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if LOCALLLM_HAVE_NATIVE
  return _cvtsh_ss(bits);  // (F16C: exact, as c10::Half's software conversion)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#if LOCALLLM_HAVE_NATIVE
// 8 signed codes at q (int8) times d into dst: each product one rounding, as the scalar d * code
inline void scale_codes8(const __m128i codes, float d, float* dst) {
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes))));
}
#endif

// One row of hd values into dst as the reference writes it (bf16, q8_0, q4_0; f32 and f16 rows are
// stored by layer_ops.h's store_row): the scale d = amax / 127 (q8_0; q4_0: the value of largest
// magnitude / -8), the codes from x * (1 / d), rounded half away from zero (q8_0) or truncated after
// + 8.5 (q4_0). Never contracted into fused multiply-adds: the reference rounds each product, and the
// bytes must be the same.
__attribute__((noinline, optimize("fp-contract=off"))) void encode_kv_row(int type, const float* x, uint8_t* dst,
                                                                            int64_t hd) {
  switch (type) {
    case kKvBF16:
      for (int64_t i = 0; i < hd; ++i) {
        const uint16_t b = c10::BFloat16(x[i]).x;
        std::memcpy(dst + 2 * i, &b, 2);
      }
      return;
    case kKvQ8_0:
      for (int64_t j = 0; j < hd; j += kKvBlock, dst += 2 + kKvBlock) {
        float amax = 0.0f;
        for (int64_t i = 0; i < kKvBlock; ++i) amax = std::max(amax, std::fabs(x[j + i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t b = half_bits(d);
        std::memcpy(dst, &b, 2);
        for (int64_t i = 0; i < kKvBlock; ++i) {
          const float v = x[j + i] * id, t = std::trunc(v);
          const float r = std::fabs(v - t) >= 0.5f ? t + std::copysign(1.0f, v) : t;
          dst[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(r));
        }
      }
      return;
    case kKvQ4_0:
      for (int64_t j = 0; j < hd; j += kKvBlock, dst += 2 + kKvBlock / 2) {
        float amax = 0.0f, peak = 0.0f;
        for (int64_t i = 0; i < kKvBlock; ++i)
          if (amax < std::fabs(x[j + i])) amax = std::fabs(x[j + i]), peak = x[j + i];
        const float d = peak / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t b = half_bits(d);
        std::memcpy(dst, &b, 2);
        for (int64_t i = 0; i < kKvBlock / 2; ++i) {
          const float v0 = x[j + i] * id, v1 = x[j + kKvBlock / 2 + i] * id;
          const int q0 = std::min(15, static_cast<int>(v0 + 8.5f)), q1 = std::min(15, static_cast<int>(v1 + 8.5f));
          dst[2 + i] = static_cast<uint8_t>(q0 | (q1 << 4));
        }
      }
      return;
  }
  TORCH_CHECK(false, "unknown KV cache type ", type);
}

// n rows of hd values, `stride` bytes apart from src, into dst [n, hd] (float32): d * code, one
// rounding, as the reference's dequantize_rows.
inline void decode_kv_rows(int type, const uint8_t* src, int64_t stride, int64_t n, int64_t hd, float* dst) {
  for (int64_t t = 0; t < n; ++t, src += stride, dst += hd) {
    switch (type) {
      case kKvF32: std::memcpy(dst, src, static_cast<size_t>(hd) * 4); break;
      case kKvF16: {
        int64_t i = 0;
#if LOCALLLM_HAVE_NATIVE
        for (; i + 8 <= hd; i += 8)
          _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
#endif
        for (; i < hd; ++i) dst[i] = half_value(src + 2 * i);
        break;
      }
      case kKvBF16:
        for (int64_t i = 0; i < hd; ++i) {
          uint16_t b;
          std::memcpy(&b, src + 2 * i, 2);
          const uint32_t bits = static_cast<uint32_t>(b) << 16;
          std::memcpy(dst + i, &bits, 4);
        }
        break;
      case kKvQ8_0: {
        const uint8_t* blk = src;
        for (int64_t j = 0; j < hd; j += kKvBlock, blk += 2 + kKvBlock) {
          const float d = half_value(blk);
#if LOCALLLM_HAVE_NATIVE
          for (int64_t i = 0; i < kKvBlock; i += 8)
            scale_codes8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + i)), d, dst + j + i);
#else
          const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
          for (int64_t i = 0; i < kKvBlock; ++i) dst[j + i] = d * static_cast<float>(qs[i]);
#endif
        }
        break;
      }
      case kKvQ4_0: {
        const uint8_t* blk = src;
        for (int64_t j = 0; j < hd; j += kKvBlock, blk += 2 + kKvBlock / 2) {
          const float d = half_value(blk);
#if LOCALLLM_HAVE_NATIVE
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
          const __m128i low = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
          const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, low), eight);  // elements 0..15
          const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), eight);  // 16..31
          scale_codes8(lo, d, dst + j);
          scale_codes8(_mm_srli_si128(lo, 8), d, dst + j + 8);
          scale_codes8(hi, d, dst + j + 16);
          scale_codes8(_mm_srli_si128(hi, 8), d, dst + j + 24);
#else
          for (int64_t i = 0; i < kKvBlock / 2; ++i) {
            dst[j + i] = d * static_cast<float>((blk[2 + i] & 15) - 8);
            dst[j + kKvBlock / 2 + i] = d * static_cast<float>((blk[2 + i] >> 4) - 8);
          }
#endif
        }
        break;
      }
      default: TORCH_CHECK(false, "unknown KV cache type ", type);
    }
  }
}

// A quantized side is stored rotated (kv_rows.py's `rotation`): each row through the orthonormal
// Walsh-Hadamard transform of blocks of n values (keys: the largest power of two dividing hd, the
// queries turned alike; values: 64, the output turned back), the reference's butterflies in its order.
constexpr int64_t kRotationBlock = 64;

inline int64_t kv_rotation(int type, int64_t hd, bool keys) {
  if (type < kKvQ8_0 || hd % kRotationBlock) return 0;
  return keys ? (hd & -hd) : kRotationBlock;
}

// rows of hd values at x (hd apart), each block of n (0: none) through the transform, in place
inline void hadamard_rows(float* x, int64_t rows, int64_t hd, int64_t n) {
  if (n == 0) return;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < hd; b += n) {
      float* y = x + r * hd + b;
      for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
          for (int64_t j = i; j < i + h; ++j) {
            const float a = y[j], c = y[j + h];
            y[j] = a + c, y[j + h] = a - c;
          }
      for (int64_t i = 0; i < n; ++i) y[i] *= scale;
    }
}

// Where a layer's K and V rows lie, for either layout: the row of token t of block b, KV head g.
struct KvRows {
  uint8_t* base = nullptr;
  int k_type = kKvF32, v_type = kKvF32;
  int64_t blocks = 0, bs = 0, nkv = 0, hd = 0;
  int64_t k_row = 0, v_row = 0;  // bytes of one head's row
  int64_t block_stride = 0;      // bytes from a block's K (or V) rows to the next block's
  int64_t v_base = 0;            // bytes from K's rows of a block to its V rows
  int64_t k_rot = 0, v_rot = 0;  // the sides' Walsh-Hadamard blocks (0: stored as they are)
  bool split = false;            // a split cache (else the float tensor [2, blocks, bs, nkv, hd])

  uint8_t* k(int64_t b, int64_t t, int64_t g) const { return base + b * block_stride + (t * nkv + g) * k_row; }
  uint8_t* v(int64_t b, int64_t t, int64_t g) const {
    return base + v_base + b * block_stride + (t * nkv + g) * v_row;
  }
};

// A layer's cache as KvRows: a float32 / float16 tensor [2, blocks, bs, nkv, hd] (k_type and v_type -1),
// or a split cache's uint8 [blocks, bs, nkv, k_row + v_row] of the types k_type and v_type.
KvRows kv_rows_of(const torch::Tensor& kv_cache, int64_t k_type, int64_t v_type, int64_t hd, const char* what) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.device().is_cpu(), what, " must be a contiguous CPU tensor");
  KvRows r;
  r.base = static_cast<uint8_t*>(kv_cache.data_ptr());
  r.hd = hd;
  if (k_type < 0 && v_type < 0) {
    TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat32 || kv_cache.scalar_type() == torch::kFloat16, what,
                " must be float32 or float16 (or a split cache's bytes with their types)");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(4) == hd, what, ": bad shape");
    r.k_type = r.v_type = kv_cache.scalar_type() == torch::kFloat32 ? kKvF32 : kKvF16;
    r.blocks = kv_cache.size(1), r.bs = kv_cache.size(2), r.nkv = kv_cache.size(3);
    r.k_row = r.v_row = kv_row_bytes(r.k_type, hd);
    r.block_stride = r.bs * r.nkv * r.k_row;
    r.v_base = r.blocks * r.block_stride;
    return r;
  }
  TORCH_CHECK(k_type >= kKvF32 && k_type <= kKvQ4_0 && v_type >= kKvF32 && v_type <= kKvQ4_0, what,
              ": unknown KV cache types ", k_type, ", ", v_type);
  TORCH_CHECK(hd % kKvBlock == 0, what, ": a split cache needs a head size that is a multiple of 32");
  r.k_type = static_cast<int>(k_type), r.v_type = static_cast<int>(v_type), r.split = true;
  r.k_row = kv_row_bytes(r.k_type, hd), r.v_row = kv_row_bytes(r.v_type, hd);
  TORCH_CHECK(kv_cache.scalar_type() == torch::kUInt8 && kv_cache.dim() == 4 && kv_cache.size(3) == r.k_row + r.v_row,
              what, ": a split cache must be uint8 [blocks, block_size, nkv, k_row + v_row]");
  r.blocks = kv_cache.size(0), r.bs = kv_cache.size(1), r.nkv = kv_cache.size(2);
  r.block_stride = r.bs * r.nkv * (r.k_row + r.v_row);
  r.v_base = r.bs * r.nkv * r.k_row;
  r.k_rot = kv_rotation(r.k_type, hd, true), r.v_rot = kv_rotation(r.v_type, hd, false);
  return r;
}
