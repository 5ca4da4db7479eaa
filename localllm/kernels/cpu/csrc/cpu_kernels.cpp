// Quantized matmul for x86 CPUs with AVX-512 VNNI, or AVX2 with FMA and F16C (the same layout and
// results; see "Vector traits"): y[m, n] = sum_k x[m, k] * w[n, k].
//
// Weights are unsigned integer codes with one affine map per 32-element group and output row,
// w = d * u + z, repacked by localllm/kernels/cpu/native.py into tiles of 16 output rows:
//
//   4-bit (Q4_1, GPTQ): per (tile, group) 320 bytes: four 64-byte vectors of nibbles,
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
// Every other GGUF type (Q4_0, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, F16, BF16) has a layout of its
// own that keeps the file's codes and scales exactly: see "Every other GGUF type" below. One
// kernel, written over the vector width (AVX2 or AVX-512, the same bits), serves every format,
// the 4- and 8-bit tiles too (the AVX2 build has tiles of its own for those: avx2::tile_rows).
// Rows need not be a multiple of 16 (zero rows pad the last tile).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <memory>
#include <utility>
#include <vector>

// The instruction set is chosen at compile time (-march=native): AVX-512 VNNI where the CPU has
// it, else AVX2 with FMA and F16C (same weight layout, same results: see "Vector traits"),
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
constexpr int kMTile = 4;  // activation rows per call of the tiles' multi-row kernel
constexpr int kRowBlock = 16;  // activation rows per block of the kernels' activation layout (ActRows; M rows if fewer)
// A matmul reads each weight tile from memory once, for its first activation rows (m0 == 0; the
// other rows find the tile in cache): those kernels ask for the bytes this far ahead of those they
// read into L2 (prefetcht1; L1's own prefetcher takes them from there). 8192x2048 weights beyond
// L3, 2 threads, Zen 4, median GB/s of 5 interleaved rounds, with / without: Q6_K 33.1 / 21.3,
// Q5_K 27.6 / 19.9, Q3_K 28.0 / 20.4, Q2_K 25.8 / 19.9, Q8_0 29.3 / 25.6, Q4_0 27.0 / 28.2;
// asking for them 8192 bytes ahead into L1 (prefetcht0), as before, was slower than not asking
// (Q6_K 18.7). The one-row kernels (decode) take their own distance per format: one_row_ahead.
constexpr int64_t kStreamAhead = 8192;
// A decode sequence's attention is split by KV heads over the threads (fewer sequences than threads)
// once its K and V hold this many bytes: below, a thread's wake-up costs about what it saves.
constexpr int64_t kAttentionSplitBytes = 64 << 10;

// The weight formats: qgemm's `bits` (layouts above, and at "Every other GGUF type" below).
constexpr int kFmtQ4 = 4, kFmtQ8 = 8;  // the 4- and 8-bit tiles
constexpr int kFmtQ5_0 = 50, kFmtQ5_1 = 51, kFmtQ5_K = 55, kFmtQ6_K = 66, kFmtQ3_K = 33, kFmtQ2_K = 22;
constexpr int kFmtQ4_K = 44, kFmtQ4_0 = 40;
constexpr int kFmtF16 = 116, kFmtBF16 = 216;

#if LOCALLLM_HAVE_NATIVE
// Asks for the cache lines of elems elements from p: into L1 (a one-row kernel's next activations,
// prefetch_row_window), or into L2 with _MM_HINT_T1 (weights streamed ahead, kStreamAhead; the
// decode attention's KV blocks ahead). (Always inlined: see prefetch_row_window on calls of
// functions that only prefetch.)
template <int Hint = _MM_HINT_T0, typename T>
__attribute__((always_inline)) inline void prefetch_rows(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(c + off, static_cast<_mm_hint>(Hint));
}

// The weight bytes [p + Ahead, p + Ahead + bytes) into L2, ahead of a kernel that streams them
// from memory (Ahead 0: none asked for, the hardware's prefetchers alone).
template <int64_t Ahead = kStreamAhead>
inline void stream_ahead(const uint8_t* p, int64_t bytes) {
  if constexpr (Ahead > 0) prefetch_rows<_MM_HINT_T1>(p + Ahead, bytes);
  else (void)p, (void)bytes;
}

#endif

// f(begin, end) over [0, n) in chunks of `chunk` on torch's OpenMP threads. Each thread owns a
// contiguous run of the chunks (an even share) and takes them front to back, so that it streams
// one long stretch of memory; a thread done with its run takes chunks from the back of the
// others' (when one thread is descheduled, a busy machine or an API server sharing the cores, the
// others take its chunks instead of waiting for it). Runs read memory faster than chunks handed
// out in turn: one row through six 16384x2048 weights beyond L3, 2 threads, Zen 4, median GB/s of
// 9 interleaved rounds, runs / chunks in turn: Q4_K 29.4 / 27.5, Q6_K 30.1 / 28.6, Q4_0 30.9 /
// 29.4 (a plain read of 19 MiB blocks: 40.3 / 36.4).
struct alignas(64) ChunkRun {  // the chunks [front, back) not yet taken, as one word (CAS)
  std::atomic<uint64_t> span;
  static uint64_t pack(uint32_t front, uint32_t back) { return static_cast<uint64_t>(back) << 32 | front; }
  // the next chunk from the front (the owner) or from the back (another thread); false when none is left
  bool take(bool from_back, int64_t& chunk) {
    uint64_t cur = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = static_cast<uint32_t>(cur), back = static_cast<uint32_t>(cur >> 32);
      if (front >= back) return false;
      const uint64_t next = from_back ? pack(front, back - 1) : pack(front + 1, back);
      if (span.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
        chunk = from_back ? back - 1 : front;
        return true;
      }
    }
  }
};

template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), chunks));
  if (chunks <= 1 || threads <= 1 || omp_in_parallel()) {
    if (n > 0) f(0, n);
    return;
  }
  TORCH_CHECK(chunks < (int64_t{1} << 32), "parallel_chunks: too many chunks");
  std::unique_ptr<ChunkRun[]> runs(new ChunkRun[threads]);
  for (int t = 0; t < threads; ++t)
    runs[t].span.store(ChunkRun::pack(static_cast<uint32_t>(chunks * t / threads),
                                      static_cast<uint32_t>(chunks * (t + 1) / threads)));
  auto run = [&](int64_t c) { f(c * chunk, std::min(n, (c + 1) * chunk)); };
#pragma omp parallel num_threads(threads)
  {
    // a team smaller than asked for leaves runs without an owner: the others take them from the back
    const int t = omp_get_thread_num();
    int64_t c;
    while (runs[t].take(false, c)) run(c);
    for (int o = 1; o < threads; ++o)
      while (runs[(t + o) % threads].take(true, c)) run(c);
  }
}

// Memory that a step's native decoder layers take their buffers from: one region per calling thread,
// kept from step to step (a decode step asks for the same sizes each time). A layer then makes no
// tensor and dispatches no tensor op between its kernels: each such op cost 2-8 us in a decode step,
// its code and data evicted by the megabytes of weights streamed since its last call (36 us of a
// 690 us layer of a Llama-3.2-1B-shaped Q4_K_M file, 2 threads, Zen 4).
class Scratch {
 public:
  // Room for `bytes` from the start; what was taken before is given back (so: before taking any).
  void reserve(int64_t bytes) {
    used_ = 0;
    if (bytes <= size_) return;
    const int64_t size = round(bytes);
    data_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(size))));
    size_ = data_ != nullptr ? size : 0;
    TORCH_CHECK(data_ != nullptr, "out of memory for the decoder layers' scratch");
  }
  // n entries of T, 64-byte aligned
  template <typename T>
  T* take(int64_t n) {
    const int64_t bytes = size_of<T>(n);
    TORCH_CHECK(used_ + bytes <= size_, "decoder layers: scratch overrun (a bug)");
    T* at = reinterpret_cast<T*>(data_.get() + used_);
    used_ += bytes;
    return at;
  }
  int64_t mark() const { return used_; }
  void release(int64_t mark) { used_ = mark; }
  // what take<T>(n) uses up
  template <typename T>
  static int64_t size_of(int64_t n) { return round(n * static_cast<int64_t>(sizeof(T))); }

 private:
  static int64_t round(int64_t bytes) { return (bytes + 63) / 64 * 64; }
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  int64_t size_ = 0, used_ = 0;
};

bool supported() { return LOCALLLM_HAVE_NATIVE; }

// The instruction set this build's kernels use: "avx512vnni", "avx2" or "none".
std::string isa() { return LOCALLLM_ISA; }

#if LOCALLLM_HAVE_NATIVE

// ---------------------------------------------------------------------------------------------
// Vector traits. Every kernel below is written once, as a template over the vector width, and
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

template <class FloatReg, class IntReg>
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

struct V256 : VectorOps<__m256, __m256i> {
  static constexpr int kAccumulators = 8;  // float accumulators a loop keeps (of 16 registers)
  static constexpr bool kHoldsQ = false;   // attention reads q's vectors from memory as it goes

  // integer lanes
  static I ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
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
    if constexpr (Fmt == kFmtQ6_K) {  // two 6-bit pairs per 16-bit lane at most (32004)
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
  // 8-bit codes u up to 255 would saturate a pair (2 * 255 * 127), so the signed codes q = u - 128
  // multiply instead (vpsignb moves q's sign onto x: |q| * (sign(q) x), pairs at most
  // 2 * 128 * 127 = 32512), each pair widened at once (avx2::tile_rows, the AVX2 build's 8-bit
  // tiles): sum + the products of q (|q| in aq) with 4 activation codes x per lane.
  static I add_centered_products(I sum, I q, I aq, I x) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(aq, _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1)));
  }
};

#if LOCALLLM_HAVE_VNNI
struct V512 : VectorOps<__m512, __m512i> {
  static constexpr int kAccumulators = 16;  // (of 32 registers)
  static constexpr bool kHoldsQ = true;     // attention holds q's vectors (at most 16) in registers

  // integer lanes
  static I ld(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
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

// Activation rows as the integer kernels read them: per pass and row, int8 codes, a scale and the
// code sum per 32-group, and (x16, for the file formats' sub-scales, mins and offsets) the sums per
// 16 codes. The rows lie in blocks of rb = min(M, kRowBlock) rows, each block group-major: codes
// [block][group][rb rows][32], scales and sums [block][group][rb rows], half sums [block][group][rb
// rows][2]; pass p's rows follow pass p - 1's, Mp apart (M rounded up to whole blocks; fewer rows
// than a block are one block, so that one row takes no more memory than row-major: 16 rows of
// padding made an 8192-wide row's buffer 128 KiB, above malloc's mmap threshold). So the rows that a kernel call takes together (always within one block:
// the calls take 16, 8, 4 and 1 rows from the first) are one pointer apart by constant offsets:
// in row-major order 8 rows a call needed 24 row pointers, which GCC kept in vector registers and
// on the stack (Q4_0, 512 rows, 4096x2048, 2 threads, 5 interleaved rounds: 531 against 471 G int8
// ops/s; at 32 rows, weights beyond L3, 1-5% slower than row-major for every type, within the noise).
struct ActRows {
  const int8_t* xq;
  const float* xs;
  const int32_t* xsum;
  const int32_t* x16;  // null unless the weights need it
  // xs * xsum per group, the factor of the offset's or min's share (Q4_1/GPTQ 4-bit tiles, Q5_1, Q4_K,
  // Q5_K), formed once as the codes are: the kernels take it by a broadcast load, where each of
  // them formed it per group (int -> float, a product, a broadcast from a register: the same bits).
  // One row in L2, median GB/s of 9 interleaved rounds: AVX-512 Q4_1 35.1 -> 36.8, Q4_K 23.3 ->
  // 24.8, Q5_1 29.9 -> 31.6; AVX2 Q4_1 32.7 -> 36.2, Q4_K 22.1 -> 24.1
  const float* xsx;
  int64_t K, Mp, rb;
  ActRows(const int8_t* xq, const float* xs, const int32_t* xsum, const int32_t* x16, const float* xsx, int64_t K,
          int64_t M)
      : xq(xq), xs(xs), xsum(xsum), x16(x16), xsx(xsx), K(K), Mp(padded(M)), rb(std::min<int64_t>(M, kRowBlock)) {}
  // M rows rounded up to whole blocks
  static int64_t padded(int64_t M) { return M < kRowBlock ? M : (M + kRowBlock - 1) / kRowBlock * kRowBlock; }
  // Row m of pass p, group g: its slot in the scale and sum arrays (the next group's: + rb).
  int64_t at(int p, int64_t m, int64_t g = 0) const {
    const int64_t s = p * Mp + m;
    return (s / rb) * rb * (K / kGroup) + g * rb + s % rb;
  }
  // Row m of pass p, group g: the offset of its codes (the next group's: + group_codes()).
  int64_t codes_at(int p, int64_t m, int64_t g = 0) const {
    const int64_t s = p * Mp + m;
    return (s / rb) * rb * K + g * group_codes() + (s % rb) * kGroup;
  }
  const int8_t* codes(int p, int64_t m) const { return xq + codes_at(p, m); }
  int64_t group_codes() const { return rb * kGroup; }
};

#if LOCALLLM_HAVE_NATIVE
// Groups per window of prefetch_row_window (256 codes: one K-quant super-block).
constexpr int kRowWindow = 8;

// A one-row kernel's next window of activations, groups g0 .. g0 + 8 of each pass of a row alone
// (rb == 1; xq, at: its codes and slot at group 0), into L1: codes, scales, the products xsx and
// the code sums the kernel reads (kWholeSums: xsum, else the halves' x16). Between two reads of
// the same activations a tile's weights stream through L1: a 16-row tile of K = 8192 is 74 KB in
// Q4_K, 107 in Q6_K, above L1's 32-48 KB, so a down projection's kernel found its activations in
// L2 at every super-block and waited on them. 2048x8192 beyond L3, 1 thread, Zen 4, median GB/s of
// 5 interleaved rounds, without / with: Q6_K 23.0 / 28.4, Q4_K 25.8 / 29.4, Q4_0 25.3 / 28.2, Q3_K
// 21.2 / 25.6, Q4_1 25.9 / 30.5; AVX2 Q6_K 19.4 / 24.3 (8192x2048: the same within 3%).
// (Always inlined, as prefetch_rows is, and every lambda around them: GCC takes a function that
// only prefetches for one without effects, and a call of it that it has not inlined yet for dead
// code, so the prefetches vanish.)
template <bool kWholeSums, int PASSES>
__attribute__((always_inline)) inline void prefetch_row_window(const ActRows& a, const int8_t* const (&xq)[PASSES],
                                                               const int64_t (&at)[PASSES], int64_t g0) {
  for (int p = 0; p < PASSES; ++p) {
    prefetch_rows(xq[p] + g0 * kGroup, kRowWindow * kGroup);
    const int64_t ig = at[p] + g0;  // (8 groups' floats or sums: 32 bytes, the halves' 64)
    prefetch_rows(a.xs + ig, kRowWindow);
    prefetch_rows(a.xsx + ig, kRowWindow);
    if constexpr (kWholeSums) prefetch_rows(a.xsum + ig, kRowWindow);
    else prefetch_rows(a.x16 + 2 * ig, 2 * kRowWindow);
  }
}
#endif

// x float32 [M, K] -> for each pass p and row m: codes, scale and code sum of each group g at
// offsets layout(p, m, g) = {codes, scale and sum} of xq, xs and xsum (and, where x16 is not null,
// the sums of the group's two halves of 16 codes at x16[2 * scale offset + h]; where xsx is not null,
// the scale times the code sum, xs * float(xsum), at the scale's offset). Pass 1 quantizes x,
// pass 2 (when passes == 2) the residual x - xs * xq of pass 1, so that x ~ xs1 * xq1 + xs2 * xq2.
// order (null: none): x's columns are read through it, element k of a row being x[m, order[k]] (a
// GPTQ act-order: the weight's input columns), gathered group by group (no copy of the rows).
template <class V, class Layout>
void quantize_rows(const float* x, int64_t M, int64_t K, int passes, int8_t* xq, float* xs, int32_t* xsum,
                   int32_t* x16, float* xsx, const Layout& layout, const int32_t* order = nullptr) {
  using F = typename V::F;
  using I = typename V::I;
  constexpr int kVecs = kGroup / V::kLanes;  // registers per 32-element group
  const int64_t G = K / kGroup;
  at::parallel_for(0, M * G, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / G, g = i % G;
      F a[kVecs];
      if (order == nullptr) {
        const float* src = x + i * kGroup;  // rows are contiguous: group i of the flattened matrix
        for (int j = 0; j < kVecs; ++j) a[j] = V::load(src + V::kLanes * j);
      } else {
        for (int j = 0; j < kVecs; ++j) a[j] = V::gather(x + m * K, order + g * kGroup + V::kLanes * j);
      }
      for (int p = 0; p < passes; ++p) {
        const float mx = V::reduce_max(max_abs<V, kVecs>(a));
        const float scale = mx / 127.0f;
        const float inv = mx > 0.0f ? 127.0f / mx : 0.0f;
        I q[kVecs];
        for (int j = 0; j < kVecs; ++j) q[j] = V::to_i32(V::fmul(a[j], V::set(inv)));  // round to nearest even
        const auto [at_codes, at] = layout(p, m, g);
        V::store_codes(xq + at_codes, q);
        xs[at] = scale;
        xsum[at] = V::reduce_add_i32(sum_i32<V, kVecs>(q));
        if (xsx != nullptr) xsx[at] = scale * static_cast<float>(xsum[at]);
        if (x16 != nullptr) {  // |x| * 127 / max|x| <= 127: the codes are the int32 values as they are
          x16[2 * at] = V::reduce_add_i32(sum_i32<V, kVecs / 2>(q));
          x16[2 * at + 1] = V::reduce_add_i32(sum_i32<V, kVecs / 2>(q + kVecs / 2));
        }
        // residual for the next pass: x - scale * q, rounded once (fnmadd)
        for (int j = 0; j < kVecs; ++j) a[j] = V::fnma(V::cvt(q[j]), V::set(scale), a[j]);
      }
    }
  });
}

#endif  // LOCALLLM_HAVE_NATIVE


// ---------------------------------------------------------------------------------------------
// Every other GGUF type (Q4_0 at its file's size, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, F16, BF16): one implementation, a
// template over the vector width (V256 in the AVX2 build, V512 in the AVX-512 one; F16/BF16 stay
// 256-bit in both). Per output both give the same
// bits (tests/test_cpu_types.py runs the two builds side by side on an AVX-512 CPU), so what is
// tested on one machine is what runs on the other. The format id is qgemm's `bits` argument:
//
//   id   type  super-block SB  per (tile of 16 rows, super-block) bytes           bits/weight  file
//   40   Q4_0      32   codes 256 | d f16[16]                                  4.5       4.5
//   50   Q5_0      32   codes 320 | d f16[16]                                  5.5       5.5
//   51   Q5_1      32   codes 320 | d f16[16] | m f16[16]                      6.0       6.0
//   44   Q4_K     256   8 x codes 256 | six-bit sc, m (192) | d, dmin         4.5       4.5
//   55   Q5_K     256   8 x codes 320 | six-bit sc, m (192) | d, dmin         5.5       5.5
//   66   Q6_K     256   8 x codes 384 | sc i8[16][16] | d f16[16]              6.5625    6.5625
//   33   Q3_K     256   8 x codes 192 | sc-32 i8[16][16] | d f16[16]           3.5625    3.4375
//   22   Q2_K     256   8 x codes 128 | (sc | m << 4) u8[16][16] | d, dmin     2.625     2.625
//   116  F16, 216 BF16: the file's rows as they are ([N, K], 2 bytes a weight).
//
// Scale arrays are [sub-block][row of the tile]; d/dmin are float16 [16] per super-block, the
// file's values. Q4_K and Q5_K keep their 16 six-bit values per row and super-block (sc and m of
// each 32-group) at the file's 12 bytes a row: see six_bit_value. (Q3_K's sub-scales stay a byte
// each: unpacked per group, six-bit ones cost its one-row kernel 11% (AVX-512) to 16% (AVX2) where
// it is bound by its integer work, for 3.5% fewer bytes.)
//
// Codes of one 32-element group, 16 rows, k = 4v + t (v = 0..7, t = 0..3):
//   nibble plane (256 bytes, the 4-bit layout above): vector s (64 bytes), byte 4j + t: row j's
//     code bits 0-3 for v = 2s (low nibble) and v = 2s + 1 (high nibble);
//   2-bit plane (128 bytes): vector s = 0, 1, byte 4j + t, bits 2h..2h+1: v = 4s + h;
//   1-bit plane (64 bytes): byte 4j + t, bit v;
//   three-bit bytes (192 bytes, Q3_K): vectors b0, b1, b2, byte 4j + t: b0 = (c6 & 3) | c0 << 2 | c1 << 5,
//     b1 = (c7 & 3) | c2 << 2 | c3 << 5, b2 = c4 | c5 << 3 | (c6 >> 2) << 6 | (c7 >> 2) << 7, with cv row
//     j's code for v (10 steps fewer a group than a 2-bit and a 1-bit plane, whose codes each took
//     two or three to assemble: Q3_K's one-row kernel is bound by its integer work where the
//     machine's bandwidth is high; c6's and c7's low bits lie where the code goes, so each of the
//     two codes that straddle bytes takes two steps with GFNI);
// 4-bit codes (Q4_K) = nibbles; 5-bit = nibbles | 1-bit plane << 4; 6-bit = nibbles | 2-bit plane
// << 4; 2-bit = the 2-bit plane. Each 64-byte vector is two 32-byte halves (rows 0-7, 8-15), one
// AVX2 register, one int32 lane per row.
//
// With the file's unsigned codes u (Q4_0: q + 8, Q5_0: q + 16, Q6_K: q + 32, Q3_K: q + 4) the weights are
//   Q4_0: d (u - 8)   Q5_0: d (u - 16)   Q5_1: d u + m   Q4_K, Q5_K: d sc u - dmin m   Q6_K: d sc (u - 32)
//   Q3_K: d sc (u - 4)  Q2_K: d sc u - dmin m
// with integer sub-scales sc (and mins m) per 32 (Q5_K) or 16 (Q6_K, Q3_K, Q2_K) weights. Per
// 32-group g and activation pass (Q4_K as Q5_K), with S0, S1 the exact integer sums of u * xq over the group's
// two halves (AVX2: vpmaddubsw + vpmaddwd, a 16-bit lane gathers at most 4 products of 5-bit codes
// (4 * 2 * 31 * 127 = 31496) or 2 of 6-bit ones (32004), then widens; AVX-512: vpdpbusd, four
// products straight into each int32 lane) and X0, X1 those of xq. The 4- and 8-bit tiles are two
// more formats of the same kernel: Q4 as Q5_1 with nibble codes, Q8 as Q5_0 with u - 128 (their
// code sums xsum = X0 + X1 come whole from quantize_rows):
//   Q5_0: Ti = S0 + S1 - 16 (X0 + X1)             y += (d xs) Ti
//   Q4_0: Ti = S0 + S1 - 8 (X0 + X1)              y += (d xs) Ti   (X0 + X1 = xsum, whole)
//   Q5_1: Ti = S0 + S1                            y += (d xs) Ti + m (xs (X0 + X1))
//   Q5_K: Ti = S0 + S1                            y += ((d sc) xs) Ti - (dmin m) (xs (X0 + X1))
//   Q4:   Ti = S0 + S1                            y += (d xs) Ti + z (xs (X0 + X1))
//   Q8:   Ti = S0 + S1 - 128 (X0 + X1)            y += (d xs) Ti
// and the formats with a sub-scale per 16, whose halves keep their own sums (Ti0, Ti1):
//   Q6_K: Ti_h = S_h - 32 X_h                     y += ((d sc0) Ti0 + (d sc1) Ti1) xs
//   Q3_K: Ti_h = S_h - 4 X_h                      y += ((d sc0) Ti0 + (d sc1) Ti1) xs
//   Q2_K: Ti_h = S_h                              y += ((d sc0) Ti0 + (d sc1) Ti1) xs - (dmin m0) (xs X0) - (dmin m1) (xs X1)
// Ti is an exact integer below 2^24 (so exact as float32 too), d sc and dmin m are exact float32
// products of the file's values: the only roundings are the float32 products and the sums, at
// most two per group before its term is added to the output (the sub-scales per 16 are applied
// as float multiplies rather than integer ones (vpmulld): 4096x2048, 512 rows, 5 interleaved
// rounds, Zen 4, G int8 ops/s Q6_K 393 -> 422, Q3_K 419 -> 498, Q2_K 424 -> 453), one fixed
// sequence per output whatever the batch (rows of a batch only share loads). F16/BF16: per output two 8-lane float32 FMA chains over k (lanes k mod
// 16), added and summed in the fixed hsum order; the activations are not quantized.


// The offset of a format's unsigned codes (w = d (u - offset), times its sub-scale): 0 where there is none.
constexpr int code_offset(int64_t f) {
  return f == kFmtQ4_0 ? 8 : f == kFmtQ5_0 ? 16 : f == kFmtQ6_K ? 32 : f == kFmtQ3_K ? 4 : 0;
}

constexpr bool is_int_fmt(int64_t f) {
  return f == kFmtQ5_0 || f == kFmtQ5_1 || f == kFmtQ5_K || f == kFmtQ6_K || f == kFmtQ3_K || f == kFmtQ2_K ||
         f == kFmtQ4_K || f == kFmtQ4_0;
}
// Whether the kernel takes each group's activation code sums whole (xsum: the 4- and 8-bit tiles,
// Q4_0, Q4_K, whose offsets and mins are per 32), or by halves (x16: the sub-scales and mins per 16
// of the other K-quants, the 5-bit formats' offsets).
constexpr bool whole_sums(int64_t f) { return f == kFmtQ4 || f == kFmtQ8 || f == kFmtQ4_0 || f == kFmtQ4_K; }
bool half_sums(int64_t f) { return is_int_fmt(f) && !whole_sums(f); }
bool is_float_fmt(int64_t f) { return f == kFmtF16 || f == kFmtBF16; }
bool is_fmt(int64_t f) { return f == kFmtQ4 || f == kFmtQ8 || is_int_fmt(f) || is_float_fmt(f); }

// Whether this build has the kernels for the formats below (AVX2, FMA and F16C: every native build).
bool formats() { return LOCALLLM_HAVE_NATIVE; }

// super-block size, code bytes per group, scale bytes per super-block, whether a dmin/m array follows d
struct FmtInfo {
  int sb, cb, scb;
  bool z;
  constexpr int sb_bytes() const { return (sb / kGroup) * cb + scb + 32 + (z ? 32 : 0); }
};

constexpr FmtInfo fmt_info(int64_t f) {
  return f == kFmtQ4     ? FmtInfo{32, 256, 0, true}
         : f == kFmtQ8   ? FmtInfo{32, 512, 0, false}
         : f == kFmtQ4_0 ? FmtInfo{32, 256, 0, false}
         : f == kFmtQ5_0 ? FmtInfo{32, 320, 0, false}
         : f == kFmtQ5_1 ? FmtInfo{32, 320, 0, true}
         : f == kFmtQ5_K ? FmtInfo{256, 320, 192, true}
         : f == kFmtQ4_K ? FmtInfo{256, 256, 192, true}
         : f == kFmtQ6_K ? FmtInfo{256, 384, 256, false}
         : f == kFmtQ3_K ? FmtInfo{256, 192, 256, false}
                         : FmtInfo{256, 128, 256, true};  // Q2_K
}

#if LOCALLLM_HAVE_NATIVE
// Whether the one-row kernel of format f at a vector width (Lanes: 16 for AVX-512, 8 for AVX2) takes
// each super-block's codes before its sub-scales and d (see tile_kernel's kCodesFirst): every format on
// AVX-512 (a 32-group format's super-block is its group); on AVX2 Q6_K, Q3_K and Q2_K (Q4_K has a
// kernel of its own there, avx2::).
// AVX2's Q5_K streamed slower so, in every prefetch variant tried, though it computes faster from
// L2 (19.9 -> 25.8 GB/s): one row of 8192x2048 beyond L3, the AVX2 build on Zen 4, median GB/s of 7
// interleaved rounds, header first / codes first: 1 thread Q6_K 24.5 / 23.8, Q5_K 21.8 / 13.3 (19.9
// with 8 KiB prefetched), Q3_K 12.2 / 20.6, Q2_K 12.5 / 14.2; 2 threads Q6_K 31.6 / 34.6, Q3_K 24.2
// / 35.1, Q2_K 25.4 / 30.2 (from L2, 1 thread, Q3_K 11.8 / 21.3: the interleaved loop over the
// tile's two registers compiled poorly). On AVX-512 the 32-group formats too, whose d follows each
// group's codes: read first, it sent every group's first access to the group's end. 8192x2048 beyond
// L3, Zen 4, median GB/s of 7 interleaved rounds, header first / codes first: 1 thread Q8_0 21.4 /
// 28.4, Q5_1 22.0 / 26.7, Q5_0 24.9 / 27.1, Q4_1 27.8 / 30.1, Q4_0 26.1 / 27.4; 2 threads Q8_0 28.1 /
// 39.4, Q5_1 35.4 / 48.4, Q4_0 35.2 / 39.3, Q4_1 and Q5_0 the same within 3%; 2048x8192, 1 thread,
// Q8_0 22.5 / 24.8, Q4_0 the same.
constexpr bool one_row_codes_first(int64_t f, int lanes) {
  if (lanes == 16) return fmt_info(f).sb >= kGroup;
  return fmt_info(f).sb > kGroup && f != kFmtQ5_K && f != kFmtQ4_K;
}

// How far ahead a one-row kernel (a decode step's matmul, all of it from memory) asks for a
// format's weight bytes, per vector width (Lanes: 16 for the AVX-512 kernels, 8 for AVX2's). The
// cheap-to-decode formats stream faster on the hardware's prefetchers alone: asked for, their
// lines land in L2 and the demand loads no longer train the prefetchers that run further ahead.
// The formats with more work per byte need the software's. One row through 12 copies of
// 8192x2048 beyond L3, 2 threads, Zen 4, an hour whose streaming read gave 63-66 GB/s, median
// GB/s of 6 interleaved rounds, none / 8 / 16 / 32 KiB ahead; AVX-512: Q4_0 62.9 / 45.8 / 48.6 /
// 50.5, Q4_1 66.5 / 47.5 / 50.2 / 54.5, Q8_0 46.0 / 39.7 / 41.5 / 42.7, Q5_0 61.0 / 53.5 / 57.2 /
// 61.9, Q5_1 51.3 / 52.1 / 55.1 / 59.1, Q4_K 46.6 / 49.6 / 50.4 / 49.1, Q5_K 28.8 / 55.6 / 57.3 /
// 55.0, Q6_K 41.2 / 47.1 / 51.4 / 45.8, Q3_K 38.9 / 51.9 / 52.2 / 46.9, Q2_K 32.9 / 39.6 / 39.5 /
// 38.2; AVX2 (the same machine): Q4_0 51.4 / 45.3 / 45.6 / 45.6, Q4_1 58.4 / 50.6 / 51.9 / 55.7,
// Q8_0 36.3 / 42.4 / 41.2 / 40.9, the others slowest without and best at 8 or 16 KiB (Q6_K 26.4 /
// 43.4 / 43.6 / 32.1). 16 KiB for the K-quants lost in a model's layers, whose smaller weights
// leave each thread a run of 0.3-5 MB: the 16 decode layers of the 1B Q4_K_M file read 43.5 ->
// 39.3 GB/s, Q3_K_M 44.2 -> 40.7 (8 KiB kept), while Q4_0's read 43.8 -> 54.6 GB/s without. (Those
// K-quant figures were taken before their AVX-512 kernel read its super-blocks codes first: since,
// the hardware's prefetchers alone stream them faster, see tile_kernel.)
constexpr int64_t one_row_ahead(int64_t f, int lanes) {
  const bool nibbles = f == kFmtQ4 || f == kFmtQ4_0;
  if (one_row_codes_first(f, lanes)) return 0;
  if (lanes == 16) return nibbles || f == kFmtQ8 || f == kFmtQ5_0 ? 0 : kStreamAhead;
  return nibbles ? 0 : kStreamAhead;
}

// Whether the one-row kernel of format f at a vector width asks for its next window of activations
// (prefetch_row_window): where the hardware's prefetchers alone stream the weight, but not for the
// 8-bit tiles, which it slowed (2048x8192 beyond L3, 1 thread, Zen 4, median GB/s of 9 interleaved
// rounds, without / with: 23.5 / 21.7). Where the weight's bytes are asked for ahead, the
// activations' lines asked for besides slowed AVX2's Q4_K (24.4 -> 20.3) and Q5_K (22.8 -> 16.5).
constexpr bool asks_row_window(int64_t f, int lanes) { return one_row_ahead(f, lanes) == 0 && f != kFmtQ8; }
#endif

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

// Scalar decode of one weight (row j of the tile, element k of group gi of the super-block at
// sbp): the file's float32 value, in its decoder's arithmetic (every product is exact in
// float32, so there is a single rounding, at the final sum, as in the reference).
template <int64_t f>
inline float fmt_weight_as(const uint8_t* sbp, int j, int gi, int k) {
  constexpr FmtInfo fi = fmt_info(f);
  const uint8_t* cb = sbp + gi * fi.cb;
  const uint8_t* scp = sbp + (fi.sb / kGroup) * fi.cb;
  const at::Half* dp = reinterpret_cast<const at::Half*>(scp + fi.scb);
  const float d = static_cast<float>(dp[j]);
  const float dz = fi.z ? static_cast<float>(dp[16 + j]) : 0.0f;
  const int v = k / 4, t = k % 4;
  int u;
  if constexpr (f == kFmtQ3_K) {
    const uint8_t* b = cb + 4 * j + t;  // its three code bytes: b[0], b[64], b[128]
    u = v < 4   ? (b[64 * (v / 2)] >> (2 + 3 * (v % 2))) & 7
        : v < 6 ? (b[128] >> (3 * (v % 2))) & 7
                : (b[64 * (v - 6)] & 3) | (((b[128] >> v) & 1) << 2);
  } else if constexpr (f == kFmtQ2_K) {
    u = (cb[64 * (v / 4) + 4 * j + t] >> (2 * (v % 4))) & 3;
  } else {
    const uint8_t byte = cb[64 * (v / 2) + 4 * j + t];
    u = (v % 2) ? byte >> 4 : byte & 0x0F;
    if constexpr (f == kFmtQ6_K) u |= ((cb[256 + 64 * (v / 4) + 4 * j + t] >> (2 * (v % 4))) & 3) << 4;
    else if constexpr (f != kFmtQ4_K && f != kFmtQ4_0) u |= ((cb[256 + 4 * j + t] >> v) & 1) << 4;
  }
  const int sub = 2 * gi + k / 16;  // 16-element sub-block in the super-block
  switch (f) {
    case kFmtQ4_0:
    case kFmtQ5_0: return d * static_cast<float>(u - code_offset(f));
    case kFmtQ5_1: return d * static_cast<float>(u) + dz;
    case kFmtQ4_K:
    case kFmtQ5_K: {
      const float dl = d * static_cast<float>(six_bit_value(scp, j, gi, 0));
      const float ml = dz * static_cast<float>(six_bit_value(scp, j, gi, 1));
      return dl * static_cast<float>(u) - ml;
    }
    case kFmtQ6_K:
    case kFmtQ3_K: {
      const float dl = d * static_cast<float>(static_cast<int8_t>(scp[sub * 16 + j]));
      return dl * static_cast<float>(u - code_offset(f));
    }
    default: {  // Q2_K
      const uint8_t s = scp[sub * 16 + j];
      const float dl = d * static_cast<float>(s & 0x0F), ml = dz * static_cast<float>(s >> 4);
      return dl * static_cast<float>(u) - ml;
    }
  }
}

// Calls f(std::integral_constant<int64_t, F>()) for the integer format F that bits names (is_int_fmt).
template <typename Fn>
void with_int_fmt(int64_t bits, Fn&& f) {
  switch (bits) {
    case kFmtQ4_0: f(std::integral_constant<int64_t, kFmtQ4_0>()); break;
    case kFmtQ5_0: f(std::integral_constant<int64_t, kFmtQ5_0>()); break;
    case kFmtQ5_1: f(std::integral_constant<int64_t, kFmtQ5_1>()); break;
    case kFmtQ4_K: f(std::integral_constant<int64_t, kFmtQ4_K>()); break;
    case kFmtQ5_K: f(std::integral_constant<int64_t, kFmtQ5_K>()); break;
    case kFmtQ6_K: f(std::integral_constant<int64_t, kFmtQ6_K>()); break;
    case kFmtQ3_K: f(std::integral_constant<int64_t, kFmtQ3_K>()); break;
    case kFmtQ2_K: f(std::integral_constant<int64_t, kFmtQ2_K>()); break;
    default: TORCH_CHECK(false, "not an integer format: ", bits);
  }
}

#if LOCALLLM_HAVE_NATIVE
// Tiles per parallel chunk of a weight of `tiles` tiles: about 64 KB of weights for one row, fewer
// as rows add work (a chunk is what a thread done with its own run takes from another's: see
// parallel_chunks). A matmul of at most about 256 KB for one row stays one chunk, on the calling
// thread: waking the pool costs more than it saves. More than one chunk is made a multiple of the
// threads, of even sizes (a 60-tile weight at 45 a chunk kept one thread on 45 tiles and the other
// on 15). 16384x2048 (2048x2048), one row, 2 threads, median GB/s, 64 / 256 KB chunks: Q4_K 33.0 /
// 31.3 (29.5 / 28.9), Q6_K 34.5 / 31.9 (28.8 / 28.0), Q4_0 (30.0 / 28.9).
inline int64_t tile_chunk(int64_t tiles, int64_t tile_bytes, int64_t M) {
  const int64_t bytes = std::max<int64_t>(1, tile_bytes) * std::max<int64_t>(1, M / 4);  // a tile's work, as bytes for one row
  if (tiles * bytes <= (256 << 10)) return std::max<int64_t>(1, tiles);
  const int64_t chunk = std::max<int64_t>(1, (64 << 10) / bytes);
  const int64_t threads = omp_get_max_threads();
  int64_t chunks = (tiles + chunk - 1) / chunk;
  if (chunks <= 1 || threads <= 1) return chunk;
  chunks = (chunks + threads - 1) / threads * threads;
  return std::max<int64_t>(1, (tiles + chunks - 1) / chunks);
}

template <typename F>
void for_each_tile(int64_t tiles, int64_t tile_bytes, int64_t M, const F& f) {
  parallel_chunks(tiles, tile_chunk(tiles, tile_bytes, M), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) f(t);
  });
}

namespace fmt {

// The per-group steps below are always inlined into the kernels: left to its own budget, GCC made
// decode a call of its own in the one-row kernel of a large caller (the codes through the stack,
// and a vzeroupper per group: Q6_K one row in L2 38 -> 27 GB/s).
#define LOCALLLM_STEP inline __attribute__((always_inline))

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

// The 8 code vectors c[v] (the rows of register H of each 64-byte tile vector, k = 4v..4v+3,
// one byte each) of the group at cb (kAffine: see V512::field).
template <int Fmt, class V, bool kAffine>
LOCALLLM_STEP void decode(const uint8_t* cb, int H, typename V::I* c) {
  const int at = V::kBytes * H;
  if constexpr (Fmt == kFmtQ3_K) {  // three-bit bytes: c[0..5] one field each, c[6], c[7] two
    const typename V::I b0 = V::ld(cb + at), b1 = V::ld(cb + 64 + at), b2 = V::ld(cb + 128 + at);
    c[0] = V::template field<2, 3, kAffine>(b0), c[1] = V::template field<5, 3, kAffine>(b0);
    c[2] = V::template field<2, 3, kAffine>(b1), c[3] = V::template field<5, 3, kAffine>(b1);
    split_fields<V, 3, 2, kAffine>(c + 4, b2);
    // (c6 & 3 lies where c6 goes: a mask and the high bit's move, merged by one vpternlog)
    c[6] = V::bor(V::band(b0, V::bytes(3)), V::template field<6, 1, kAffine, 2>(b2));
    c[7] = V::bor(V::band(b1, V::bytes(3)), V::template field<7, 1, kAffine, 2>(b2));
  } else if constexpr (Fmt == kFmtQ2_K) {
    for (int s = 0; s < 2; ++s) split_fields<V, 2, 4, kAffine>(c + 4 * s, V::ld(cb + 64 * s + at));
  } else if constexpr (Fmt == kFmtQ8) {  // one byte a code: vector v is c[v]
    for (int v = 0; v < 8; ++v) c[v] = V::ld(cb + 64 * v + at);
  } else {
    for (int s = 0; s < 4; ++s) split_fields<V, 4, 2, kAffine>(c + 2 * s, V::ld(cb + 64 * s + at));
    if constexpr (Fmt == kFmtQ6_K) {  // bits 2h..2h+1 of 2-bit vector s -> bits 4-5 of c[4s + h]
      for (int s = 0; s < 2; ++s) merge_fields<V, 2, 4, 4>(c + 4 * s, V::ld(cb + 256 + 64 * s + at));
    } else if constexpr (Fmt != kFmtQ4_K && Fmt != kFmtQ4 && Fmt != kFmtQ4_0) {  // 5-bit: bit v of the 1-bit plane -> bit 4 of c[v]
      merge_fields<V, 1, 4, 8>(c, V::ld(cb + 256 + at));
    }
  }
}

// Group gi's pair of six-bit values (see six_bit_value) for the rows of register H.
template <class V>
LOCALLLM_STEP void six_bit_pair(const uint8_t* scp, int gi, int H, typename V::I& A, typename V::I& B) {
  const typename V::I x = V::u8(scp + gi * 16 + V::kLanes * H);
  const typename V::I y = V::u8(scp + 128 + (gi / 2) * 16 + V::kLanes * H);
  A = V::band(x, V::i32(63));
  B = V::bor(V::shr32(x, 6), V::shl32(V::band(V::shr32(y, 4 * (gi % 2)), V::i32(15)), 2));
}

// The K-quants' float factors per 32-group and row (exact float32 products of the file's values):
// Q4_K, Q5_K: d sc and dmin m; Q6_K, Q3_K: d sc of each half; Q2_K: d sc and dmin m of each half.
constexpr int factor_vectors(int64_t f) {
  return f == kFmtQ2_K ? 4 : (f == kFmtQ4_K || f == kFmtQ5_K || f == kFmtQ6_K || f == kFmtQ3_K) ? 2 : 0;
}

// Group gi's factors (factor_vectors of them, in the order above) for the rows of register H,
// from its super-block's sub-scale block scp and d and dmin D, Z (those rows').
template <int Fmt, class V>
LOCALLLM_STEP void group_factors(const uint8_t* scp, int gi, int H, typename V::F D, typename V::F Z, typename V::F* out) {
  using I = typename V::I;
  constexpr int R = V::kLanes;
  if constexpr (Fmt == kFmtQ5_K || Fmt == kFmtQ4_K) {
    I sc, m;
    six_bit_pair<V>(scp, gi, H, sc, m);
    out[0] = V::fmul(D, V::cvt(sc));
    out[1] = V::fmul(Z, V::cvt(m));
  } else if constexpr (Fmt == kFmtQ3_K || Fmt == kFmtQ6_K) {
    const I a0 = V::s8(scp + 2 * gi * 16 + R * H);
    const I a1 = V::s8(scp + (2 * gi + 1) * 16 + R * H);
    out[0] = V::fmul(D, V::cvt(a0));
    out[1] = V::fmul(D, V::cvt(a1));
  } else if constexpr (Fmt == kFmtQ2_K) {
    const I s0 = V::u8(scp + 2 * gi * 16 + R * H), s1 = V::u8(scp + (2 * gi + 1) * 16 + R * H);
    const I m15 = V::i32(15);
    out[0] = V::fmul(D, V::cvt(V::band(s0, m15)));
    out[1] = V::fmul(D, V::cvt(V::band(s1, m15)));
    out[2] = V::fmul(Z, V::cvt(V::shr32_4(s0)));
    out[3] = V::fmul(Z, V::cvt(V::shr32_4(s1)));
  }
}

// How a multi-row call takes the K-quants' group factors: formed from the tile's sub-scales
// (kFormed), formed and written to a table for the tile's later calls (kFormedKept: the first
// call, as the tile streams in), or read from that table (kKept): the sub-scales' unpacking and
// the float products once per tile instead of once per block of rows.
enum FactorSource { kFormed, kFormedKept, kKept };

// A table of the calling thread's for one tile's group factors, [group][factor][16 rows].
inline float* factor_table(int64_t floats) {
  thread_local std::vector<float> table;
  if (table.size() < static_cast<size_t>(floats)) table.resize(floats);
  return table.data();
}

// Where factor v of group g (of a format with nf of them) lies in a tile's table: 16 rows' floats.
inline float* factor_at(float* table, int64_t g, int nf, int v) { return table + (g * nf + v) * kTile; }

// HALVES registers of one tile (from register H0) for activation rows m0 .. m0 + MT (within one
// block of the activation layout). factors: the tile's factor table (see FactorSource; unused
// for kFormed).
template <int Fmt, class V, int MT, int PASSES, int HALVES, int H0, FactorSource kSource = kFormed>
inline void tile_kernel(const uint8_t* tile, int64_t K, const ActRows& a, int64_t m0, float* y, int64_t ldy,
                        int64_t n0, float* factors = nullptr) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr FmtInfo fi = fmt_info(Fmt);
  constexpr int GS = fi.sb / kGroup;
  constexpr int R = V::kLanes;
  constexpr int NF = factor_vectors(Fmt);
  constexpr bool kWholeSums = whole_sums(Fmt);
  // One row of a K-quant (one_row_codes_first: every one on AVX-512, three on AVX2) takes a
  // super-block's codes first and its sub-scales and d after them, where they lie: a front-to-back
  // read of the weight, which the hardware's prefetchers alone stream (the codes' integer sums, 8
  // or 16 vectors a tile register, wait; the same arithmetic per output, so the same bits). Taken in the
  // order the factors are needed (header, then codes: a read 2 KB ahead and back at every
  // super-block), the kernel needed software prefetches and still fell behind. 8192x2048 beyond L3,
  // one row, Zen 4, AVX-512, median GB/s of 7 interleaved rounds, before / after: 1 thread Q4_K 18.7 / 26.5,
  // Q6_K 18.4 / 27.3, Q5_K 20.5 / 25.3, Q3_K 20.2 / 23.0, Q2_K 15.1 / 18.8; 2 threads Q4_K 30.9 /
  // 34.4, Q6_K 30.2 / 34.3, Q5_K 30.7 / 33.5, Q3_K 31.9 / 34.4, Q2_K 31.1 / 33.5; the 16 layers of
  // the 1B-shaped Q4_K_M file, replayed: 1093 -> 911 us a layer (1 thread: 1787 -> 1390). In the
  // AVX2 build (two registers a tile, 16 of them) it helps three formats: see one_row_codes_first.
  constexpr bool kCodesFirst = MT == 1 && kSource == kFormed && one_row_codes_first(Fmt, V::kLanes);
  const int64_t nsb = K / fi.sb;
  const int8_t* xq[PASSES];  // the rows' codes and scales, group 0 (row i: + i * kGroup, + i)
  int64_t at[PASSES];
  for (int p = 0; p < PASSES; ++p) xq[p] = a.codes(p, m0), at[p] = a.at(p, m0);
  F acc[HALVES][MT];
  for (int h = 0; h < HALVES; ++h)
    for (int i = 0; i < MT; ++i) acc[h][i] = V::zero();
  // Row i's activation codes of group g and pass p, and where its scales and sums lie.
  const auto codes_of = [&](int p, int64_t g, int i) { return xq[p] + g * a.group_codes() + i * kGroup; };
  const auto at_of = [&](int p, int64_t g, int i) { return at[p] + g * a.rb + i; };
  // The group's code sums: by halves (x16: the file formats), or whole (xsum: the 4- and 8-bit tiles).
  const auto sum_x = [&](int64_t ig, int half) -> int32_t {
    return kWholeSums ? (half ? 0 : a.xsum[ig]) : a.x16[2 * ig + half];
  };
  // The integer part of a group for one row and pass: the exact sums S0, S1 of its codes c with the
  // row's activation codes, less the offset's terms (the 8-bit tiles: their centered sum in S0):
  //   Q6_K, Q3_K: S_h - off X_h;  Q5_0, Q4_0: S0 - off (X0 + X1) and S1;  the others S0, S1.
  const auto int_sums = [&](const I* c, int p, int64_t g, int i, I& S0, I& S1) {
    const int8_t* xg = codes_of(p, g, i);
    const int64_t ig = at_of(p, g, i);
    if constexpr (Fmt == kFmtQ8) {
      S0 = V::centered_dot8(c, xg, sum_x(ig, 0)), S1 = S0;
      return;
    } else if constexpr (code_offset(Fmt) == 0) {
      S0 = V::i32(0), S1 = S0;
    } else if constexpr (Fmt == kFmtQ6_K || Fmt == kFmtQ3_K) {  // (a sub-scale per half)
      S0 = V::i32(-code_offset(Fmt) * sum_x(ig, 0)), S1 = V::i32(-code_offset(Fmt) * sum_x(ig, 1));
    } else {
      S0 = V::i32(-code_offset(Fmt) * (sum_x(ig, 0) + sum_x(ig, 1))), S1 = V::i32(0);
    }
    V::template isums<Fmt>(c, xg, S0, S1);
  };
  // Group gi's float factors for the rows of register H (see group_factors; the tile's table kept
  // or read per kSource), as (d sc or d, d sc of the second half, dmin m of each half).
  struct Factors {
    F dsc, dsc1, mmin, mmin1;
  };
  const auto factors_of = [&](const uint8_t* scp, int64_t g, int gi, int H, F D, F Z) {
    F fac[4];
    if constexpr (NF > 0) {
      if constexpr (kSource == kKept) {
        for (int v = 0; v < NF; ++v) fac[v] = V::load(factor_at(factors, g, NF, v) + R * H);
      } else {
        group_factors<Fmt, V>(scp, gi, H, D, Z, fac);
        if constexpr (kSource == kFormedKept)
          for (int v = 0; v < NF; ++v) V::store(factor_at(factors, g, NF, v) + R * H, fac[v]);
      }
    }
    // (Q4_K, Q5_K: d sc, dmin m; Q6_K, Q3_K: d sc per half; Q2_K: both per half)
    Factors f;
    f.dsc = NF ? fac[0] : D, f.dsc1 = f.dsc, f.mmin = f.dsc, f.mmin1 = f.dsc;
    if constexpr (Fmt == kFmtQ5_K || Fmt == kFmtQ4_K) {
      f.mmin = fac[1];
    } else if constexpr (Fmt == kFmtQ6_K || Fmt == kFmtQ3_K) {
      f.dsc1 = fac[1];
    } else if constexpr (Fmt == kFmtQ2_K) {
      f.dsc1 = fac[1], f.mmin = fac[2], f.mmin1 = fac[3];
    }
    return f;
  };
  // The float part: one row's sums of group g and pass p, scaled, into its accumulator (Z: the
  // offsets' z of the tiles, Q5_1).
  const auto accumulate = [&](F& out, const Factors& f, F Z, int p, int64_t g, int i, I S0, I S1) {
    const int64_t ig = at_of(p, g, i);
    const float sx = a.xs[ig];
    const F dx = V::fmul(f.dsc, V::set(sx));  // (d, or Q4_K's and Q5_K's d sc) xs
    if constexpr (Fmt == kFmtQ6_K || Fmt == kFmtQ3_K || Fmt == kFmtQ2_K) {  // a sub-scale per half
      const F t0 = V::fmul(V::cvt(S0), f.dsc);  // (the offsets' terms are in S0, S1: see int_sums)
      const F t = V::fma(V::cvt(S1), f.dsc1, t0);
      out = V::fma(t, V::set(sx), out);
    } else {
      I Ti;
      if constexpr (Fmt == kFmtQ8) {
        Ti = S0;
      } else {  // Q5_0, Q4_0 (offset terms in S0), Q5_1, Q4, Q5_K, Q4_K (the last two: times d sc in dx)
        Ti = V::add(S0, S1);
      }
      out = V::fma(V::cvt(Ti), dx, out);
    }
    // (X0 + X1 = xsum: a.xsx[ig] = sx * float(X0 + X1), formed as the codes were)
    if constexpr (Fmt == kFmtQ5_1 || Fmt == kFmtQ4) {
      out = V::fma(Z, V::set(a.xsx[ig]), out);
    } else if constexpr (Fmt == kFmtQ5_K || Fmt == kFmtQ4_K) {
      out = V::fnma(f.mmin, V::set(a.xsx[ig]), out);
    } else if constexpr (Fmt == kFmtQ2_K) {
      out = V::fnma(f.mmin, V::set(sx * static_cast<float>(sum_x(ig, 0))), out);
      out = V::fnma(f.mmin1, V::set(sx * static_cast<float>(sum_x(ig, 1))), out);
    } else {
      (void)Z;
    }
  };
  // the super-blocks by windows of 256 codes: one row alone asks for its next window's activations
  // as a window starts (see prefetch_row_window)
  constexpr int64_t kWindow = kRowWindow * kGroup / fi.sb;  // super-blocks a window
  const bool ask_window = MT == 1 && H0 == 0 && asks_row_window(Fmt, V::kLanes) && a.rb == 1;
  for (int64_t w0 = 0; w0 < nsb; w0 += kWindow) {
    if (ask_window && w0 + kWindow < nsb) prefetch_row_window<kWholeSums>(a, xq, at, (w0 + kWindow) * GS);
    const int64_t w1 = std::min(nsb, w0 + kWindow);
    for (int64_t sb = w0; sb < w1; ++sb) {
      const uint8_t* sbp = tile + sb * fi.sb_bytes();
      // the first rows stream the tile from memory (8192x2048 beyond L3, 2 threads, median GB/s with /
      // without: 4 rows Q6_K 24.7 / 11.2, Q4_0 25.8 / 16.3; 8 rows Q6_K 14.3 / 8.9; 32 rows 4.1 / 3.4);
      // AVX2's second half of the tile (H0 = 1) reads the same cache lines
      if (m0 == 0 && H0 == 0) stream_ahead<MT == 1 ? one_row_ahead(Fmt, V::kLanes) : kStreamAhead>(sbp, fi.sb_bytes());
      const uint8_t* scp = sbp + GS * fi.cb;
      const uint8_t* dp = scp + fi.scb;
      F D[HALVES] = {}, Z[HALVES] = {};
      const auto load_d = [&] {  // (the kept factors hold them)
        if constexpr (!(kSource == kKept && NF > 0)) {
          for (int h = 0; h < HALVES; ++h) {
            D[h] = V::half(dp + 2 * R * (H0 + h));
            Z[h] = fi.z ? V::half(dp + 32 + 2 * R * (H0 + h)) : V::zero();
          }
        }
      };
      if constexpr (kCodesFirst) {
        // the codes of every group first, then the sub-scales and d after them, so that the super-block
        // is read front to back (see kCodesFirst)
        I S[GS][HALVES][PASSES][2];
        for (int gi = 0; gi < GS; ++gi)
          for (int h = 0; h < HALVES; ++h) {
            I c[8];
            decode<Fmt, V, true>(sbp + gi * fi.cb, H0 + h, c);
            for (int p = 0; p < PASSES; ++p) int_sums(c, p, sb * GS + gi, 0, S[gi][h][p][0], S[gi][h][p][1]);
          }
        load_d();
        for (int gi = 0; gi < GS; ++gi)
          for (int h = 0; h < HALVES; ++h) {
            const Factors f = factors_of(scp, sb * GS + gi, gi, H0 + h, D[h], Z[h]);
            for (int p = 0; p < PASSES; ++p)
              accumulate(acc[h][0], f, Z[h], p, sb * GS + gi, 0, S[gi][h][p][0], S[gi][h][p][1]);
          }
        continue;
      }
      load_d();
      for (int gi = 0; gi < GS; ++gi) {
        const int64_t g = sb * GS + gi;
        for (int h = 0; h < HALVES; ++h) {
          const int H = H0 + h;
          I c[8];
          decode<Fmt, V, MT == 1>(sbp + gi * fi.cb, H, c);
          const Factors f = factors_of(scp, g, gi, H, D[h], Z[h]);
          for (int p = 0; p < PASSES; ++p) {
            // unrolled: each row's accumulator stays in its register (GCC's own choice of rolling
            // this loop, which depends on the body's size, kept them on the stack)
            _Pragma("GCC unroll 16") for (int i = 0; i < MT; ++i) {
              I S0, S1;
              int_sums(c, p, g, i, S0, S1);
              accumulate(acc[h][i], f, Z[h], p, g, i, S0, S1);
            }
          }
        }
      }
    }
  }
  for (int h = 0; h < HALVES; ++h)
    for (int i = 0; i < MT; ++i) V::store(y + (m0 + i) * ldy + n0 + R * (H0 + h), acc[h][i]);
}

// Whether a format's codes take more than one plane or field split to decode (the 5-, 6-, 3- and
// 2-bit formats): more work per tile vector to share among the activation rows of a call.
constexpr bool costly_decode(int64_t f) { return is_int_fmt(f) && f != kFmtQ4_0 && f != kFmtQ4_K; }

// Rows of activations per call of the multi-row kernel, per vector width and format (AVX2: one
// register of the tile at a time, 4 rows; AVX-512: the whole tile, 8 rows, or 16 where the decode
// costs more, then blocks of 8 and 4). 8192x2048 in L2, 2 threads, median G int8 ops/s of 4
// interleaved rounds, 8 / 4 rows a call: 32 rows Q6_K 396 / 366, Q4_1 493 / 471, Q3_K 387 / 361,
// Q8_0 502 / 462; 256 rows Q4_1 460 / 436, Q3_K 358 / 329. 4096x2048, 512 rows, 5 rounds, 16 / 8
// rows a call: Q6_K 394 / 382, Q3_K 394 / 368, Q5_K 432 / 383, Q2_K 369 / 359, Q5_0 419 / 405, but
// Q4_1 412 / 456, Q4_K 434 / 451, Q8_0 415 / 464 (their accumulators no longer fit the registers).
template <class V, int Fmt>
constexpr int kFmtRows = V::kLanes == 16 ? (costly_decode(Fmt) ? 4 : 2) * kMTile : kMTile;

// Tile t's rows by blocks of MT, then (AVX-512) a block of 8 and one of 4 where they are left:
// returns the first row not done (the rest, fewer than 4, take the one-row kernel). With two
// blocks of MT or more, the first one keeps the K-quants' group factors for the others.
template <int Fmt, class V, int MT, int PASSES>
int64_t multi_row_calls(const uint8_t* tile, int64_t K, const ActRows& a, int64_t M, float* y, int64_t Np, int64_t t) {
  constexpr int NF = factor_vectors(Fmt);
  float* factors = nullptr;
  if constexpr (NF > 0)
    if (M >= 2 * MT) factors = factor_table(K / kGroup * NF * kTile);
  int64_t m0 = 0;
  const auto block = [&](auto rows, auto source) {
    constexpr int kRows = decltype(rows)::value;
    constexpr FactorSource kSource = decltype(source)::value;
    tile_kernel<Fmt, V, kRows, PASSES, 1, 0, kSource>(tile, K, a, m0, y, Np, t * kTile, factors);
    if constexpr (V::kChunks == 2) tile_kernel<Fmt, V, kRows, PASSES, 1, 1, kSource>(tile, K, a, m0, y, Np, t * kTile, factors);
    m0 += kRows;
  };
  using Formed = std::integral_constant<FactorSource, kFormed>;
  using Kept = std::integral_constant<FactorSource, kKept>;
  if constexpr (NF > 0) {
    if (factors != nullptr) {
      block(std::integral_constant<int, MT>(), std::integral_constant<FactorSource, kFormedKept>());
      while (m0 + MT <= M) block(std::integral_constant<int, MT>(), Kept());
    }
  }
  while (m0 + MT <= M) block(std::integral_constant<int, MT>(), Formed());
  const auto tail = [&](auto rows) {  // a block of the rows left, with the kept factors where there are
    if constexpr (NF > 0)
      if (factors != nullptr) return block(rows, Kept());
    block(rows, Formed());
  };
  if constexpr (MT > 2 * kMTile) {  // (AVX-512) a block of 8 of the rows left
    if (m0 + 2 * kMTile <= M) tail(std::integral_constant<int, 2 * kMTile>());
  }
  if constexpr (MT > kMTile) {  // (AVX-512) a block of 4 of the rows left
    static_assert(V::kChunks == 1);
    if (m0 + kMTile <= M) tail(std::integral_constant<int, kMTile>());
  }
  return m0;
}

// Tile t (output rows 16 t .. 16 t + 15) of a weight [Np, K] for every activation row: y [M, Np].
template <int Fmt, class V, int PASSES>
void gemm_tile(const uint8_t* w, int64_t Np, int64_t K, const ActRows& a, int64_t M, float* y, int64_t t) {
  constexpr FmtInfo fi = fmt_info(Fmt);
  constexpr int MT = kFmtRows<V, Fmt>;
  const uint8_t* tile = w + t * (K / fi.sb) * fi.sb_bytes();
  int64_t m0 = multi_row_calls<Fmt, V, MT, PASSES>(tile, K, a, M, y, Np, t);
  // one row: the whole tile per group (the tile is read once, front to back, as it streams in)
  for (; m0 < M; ++m0) tile_kernel<Fmt, V, 1, PASSES, V::kChunks, 0>(tile, K, a, m0, y, Np, t * kTile);
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
// at their files' sizes.
constexpr bool nibble_codes(int f) { return f == kFmtQ4 || f == kFmtQ4_0 || f == kFmtQ4_K; }

// The group's integer sum as the format kernel's Ti: Q4_0's codes centred, the others' as they are.
template <int BITS>
inline __m256i group_sum(__m256i isum, int32_t sum_x) {
  if constexpr (BITS == kFmtQ4_0) return _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * sum_x));
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
    if constexpr (BITS == kFmtQ4_K) {  // d sc, dmin m: the format kernel's factors
      __m256 f[4];
      fmt::group_factors<BITS, V256>(scp, gi, h, s.d[h], s.z[h], f);
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
  if constexpr (BITS == kFmtQ4) r = _mm256_fmadd_ps(s.z[h], _mm256_set1_ps(sx_sum_x), r);
  if constexpr (BITS == kFmtQ4_K) r = _mm256_fnmadd_ps(s.z[h], _mm256_set1_ps(sx_sum_x), r);
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
    if constexpr (BITS == kFmtQ4_K && kSource == fmt::kKept) {
      sc = kept_scales(factors, g);
    } else {
      sc = group_scales<BITS>(sbp, gi);
      if constexpr (BITS == kFmtQ4_K && kSource == fmt::kFormedKept) keep_scales(factors, g, sc);
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
    if (ask_window && w0 + kRowWindow < G) prefetch_row_window<whole_sums(BITS)>(a, xq, at, w0 + kRowWindow);
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
  if constexpr (BITS == kFmtQ4_K) {
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

// x float32 [M, K] contiguous, w uint8 packed (see above) for N x K -> y float32 [M, N].
// bits: the format id (4, 8, or one of the kFmt* above). N need not be a multiple of 16: the
// quantized formats pack whole tiles (zero rows at the end), computed and then sliced off.
// passes: 1 = int8 activations; 2 = int8 activations plus their int8-quantized residual (the
// float formats take x as it is and ignore it).
// The weight w of N x K in format bits, packed (see above), and the activation passes.
void check_weight(const torch::Tensor& w, int64_t bits, int64_t N, int64_t K, int64_t passes) {
  TORCH_CHECK(supported(), "localllm qgemm: built without native kernels (AVX-512 VNNI or AVX2)");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "qgemm: w must be contiguous uint8");
  TORCH_CHECK(is_fmt(bits), "qgemm: bits must be 4 or 8 or a format id");
  TORCH_CHECK(passes == 1 || passes == 2, "qgemm: passes must be 1 or 2");
  TORCH_CHECK(N > 0 && K > 0 && K % kGroup == 0, "qgemm: K % 32 must be 0");
  TORCH_CHECK(!is_int_fmt(bits) || K % fmt_info(bits).sb == 0, "qgemm: K must be a multiple of the super-block");
  TORCH_CHECK(w.numel() == fmt_packed_bytes(bits, N, K), "qgemm: packed size mismatch");
}

void check_qgemm(const torch::Tensor& x, const torch::Tensor& w, int64_t bits, int64_t N, int64_t K, int64_t passes) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "qgemm: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "qgemm: x must be float32");
  check_weight(w, bits, N, K, passes);
}

#if LOCALLLM_HAVE_NATIVE
// Activation rows [M, K] as the integer kernels take them (the storage behind an ActRows): int8
// codes, scales and code sums per 32-group and pass, and (halves) the sums per 16 codes that the
// file formats' sub-scales need.
// The padding rows of the last block are never read, so nothing is initialized.
struct QuantizedRows {
  int64_t M = 0, K = 0;
  std::unique_ptr<uint8_t[]> storage;  // one allocation for all of them (none where the caller gave it)
  int8_t* xq = nullptr;
  float *xs = nullptr, *xsx = nullptr;
  int32_t *xsum = nullptr, *x16 = nullptr;
  ActRows view() const { return {xq, xs, xsum, x16, xsx, K, M}; }
};

// The bytes of a QuantizedRows of M rows of K: the codes, then 3 (halves: 5) arrays of a 4-byte
// entry per group.
int64_t quantized_code_bytes(int64_t M, int64_t K, int64_t passes) {
  return (passes * ActRows::padded(M) * K + 63) / 64 * 64;
}
int64_t quantized_bytes(int64_t M, int64_t K, int64_t passes, bool halves) {
  return quantized_code_bytes(M, K, passes) + passes * ActRows::padded(M) * (K / kGroup) * 4 * (halves ? 5 : 3);
}

// The rows x [M, K], read through order (null: as they are; see quantize_rows), quantized for the
// integer kernels (halves: with the sums per 16 codes), into `storage` (quantized_bytes of them;
// null: an allocation of their own).
QuantizedRows quantize_input(const float* x, int64_t M, int64_t K, int64_t passes, bool halves,
                             const int32_t* order = nullptr, uint8_t* storage = nullptr) {
  const int64_t G = K / kGroup;
  QuantizedRows a;
  a.M = M, a.K = K;
  const int64_t slots = passes * ActRows::padded(M);
  const int64_t code_bytes = quantized_code_bytes(M, K, passes), group_bytes = slots * G * 4;
  if (storage == nullptr) {
    a.storage.reset(new uint8_t[quantized_bytes(M, K, passes, halves)]);
    storage = a.storage.get();
  }
  uint8_t* at = storage;
  a.xq = reinterpret_cast<int8_t*>(at);
  a.xs = reinterpret_cast<float*>(at + code_bytes);
  a.xsum = reinterpret_cast<int32_t*>(at + code_bytes + group_bytes);
  a.xsx = reinterpret_cast<float*>(at + code_bytes + 2 * group_bytes);
  if (halves) a.x16 = reinterpret_cast<int32_t*>(at + code_bytes + 3 * group_bytes);  // per 16 codes, their sum
  const ActRows layout = a.view();
  quantize_rows<VNative>(
      x, M, K, static_cast<int>(passes), a.xq, a.xs, a.xsum, a.x16, a.xsx,
      [&](int p, int64_t m, int64_t g) { return std::pair<int64_t, int64_t>{layout.codes_at(p, m, g), layout.at(p, m, g)}; },
      order);
  return a;
}

// out[m, k] = x[m, order[k]] for rows x [M, K] (a GPTQ act-order: the weight's input columns).
void gather_columns(const float* x, int64_t M, int64_t K, const int32_t* order, float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = x[m * K + order[k]];
}

// Tile t of weight w (an integer format, [Np, K]) against the rows a: its 16 outputs of each row m
// at y[m * ldy + 16 t ..] (ldy >= Np: a part of a wider output).
void weight_tile(int64_t bits, int64_t passes, const uint8_t* w, int64_t ldy, int64_t K, const QuantizedRows& a,
                 float* y, int64_t t) {
  const ActRows rows = a.view();
#define LOCALLLM_FMT_CASE(F)                                                                \
  if (bits == F) {                                                                          \
    if (passes == 1) fmt::gemm_tile<F, VNative, 1>(w, ldy, K, rows, a.M, y, t);              \
    else fmt::gemm_tile<F, VNative, 2>(w, ldy, K, rows, a.M, y, t);                          \
    return;                                                                                 \
  }
#if LOCALLLM_HAVE_AVX2  // the AVX2 build's own 4- and 8-bit tiles (and Q4_0's and Q4_K's nibbles)
#define LOCALLLM_AVX2_CASE(F)                                                            \
  if (bits == F) {                                                                       \
    if (passes == 1) avx2::gemm_tile<F, 1>(w, ldy, K, rows, a.M, y, t);                   \
    else avx2::gemm_tile<F, 2>(w, ldy, K, rows, a.M, y, t);                               \
    return;                                                                              \
  }
  LOCALLLM_AVX2_CASE(kFmtQ4)
  LOCALLLM_AVX2_CASE(kFmtQ8)
  LOCALLLM_AVX2_CASE(kFmtQ4_0)
  LOCALLLM_AVX2_CASE(kFmtQ4_K)
#undef LOCALLLM_AVX2_CASE
#else
  LOCALLLM_FMT_CASE(kFmtQ4)
  LOCALLLM_FMT_CASE(kFmtQ8)
  LOCALLLM_FMT_CASE(kFmtQ4_0)
  LOCALLLM_FMT_CASE(kFmtQ4_K)
#endif
  LOCALLLM_FMT_CASE(kFmtQ5_0)
  LOCALLLM_FMT_CASE(kFmtQ5_1)
  LOCALLLM_FMT_CASE(kFmtQ5_K)
  LOCALLLM_FMT_CASE(kFmtQ6_K)
  LOCALLLM_FMT_CASE(kFmtQ3_K)
  LOCALLLM_FMT_CASE(kFmtQ2_K)
#undef LOCALLLM_FMT_CASE
}
#endif

// One input of a matmul part: rows x [M, K] (float32, contiguous) read through `order` (the
// weight's input columns, a GPTQ act-order: x[m, order[k]]; null: as they are).
struct PartInput {
  const float* x;
  const int32_t* order;
  bool operator==(const PartInput& o) const { return x == o.x && order == o.order; }
};

// qgemm's work on rows given as a PartInput (the weight checked by the caller) into y [M, Np] (Np: N,
// or in an integer format N rounded up to whole tiles); the quantized rows in `storage`
// (quantized_bytes; null: an allocation of their own).
void matmul_rows_into(const PartInput& input, int64_t M, int64_t K, const uint8_t* wp, int64_t bits, int64_t N,
                      int64_t passes, float* yp, uint8_t* storage = nullptr) {
#if LOCALLLM_HAVE_NATIVE
  if (is_float_fmt(bits)) {
    const float* x = input.x;
    std::vector<float> gathered;
    if (input.order != nullptr) {
      gathered.resize(static_cast<size_t>(M * K));
      gather_columns(input.x, M, K, input.order, gathered.data());
      x = gathered.data();
    }
    const uint16_t* w16 = reinterpret_cast<const uint16_t*>(wp);
    if (bits == kFmtF16) fmt::gemm_float<false>(w16, N, K, x, M, yp);
    else fmt::gemm_float<true>(w16, N, K, x, M, yp);
    return;
  }
  const int64_t Np = round_tile(N);
  const QuantizedRows a = quantize_input(input.x, M, K, passes, half_sums(bits), input.order, storage);
  for_each_tile(Np / kTile, fmt_packed_bytes(bits, kTile, K), M,
                [&](int64_t t) { weight_tile(bits, passes, wp, Np, K, a, yp, t); });
#endif
}

// qgemm's work on rows given as a PartInput (the weight checked by the caller): y [M, N].
torch::Tensor matmul_rows(const PartInput& input, int64_t M, int64_t K, const torch::Tensor& w, int64_t bits, int64_t N,
                          int64_t passes, const torch::TensorOptions& options) {
  const int64_t Np = is_float_fmt(bits) ? N : round_tile(N);
  auto y = torch::empty({M, Np}, options);
  matmul_rows_into(input, M, K, w.data_ptr<uint8_t>(), bits, N, passes, y.data_ptr<float>());
  return Np == N ? y : y.narrow(1, 0, N).contiguous();
}

// x float32 [M, K] contiguous, w uint8 packed (see above) for N x K -> y float32 [M, N].
// bits: the format id (4, 8, or one of the kFmt* above). N need not be a multiple of 16: the
// quantized formats pack whole tiles (zero rows at the end), computed and then sliced off.
// passes: 1 = int8 activations; 2 = int8 activations plus their int8-quantized residual (the
// float formats take x as it is and ignore it).
// The columns of an input order (a GPTQ act-order, see PartInput), checked: contiguous int32 (the
// gather's own index width, half int64's cache lines), one entry per input column, each in range;
// null where there is none.
const int32_t* input_order(const c10::optional<torch::Tensor>& perm, int64_t cols, const char* who) {
  if (!perm.has_value()) return nullptr;
  TORCH_CHECK(perm->scalar_type() == torch::kInt32 && perm->dim() == 1 && perm->is_contiguous() && perm->numel() == cols,
              who, ": an input order must be contiguous int32, one entry per input column");
  const int32_t* order = perm->data_ptr<int32_t>();
  bool outside = false;  // (one check after the loop: it vectorizes)
  for (int64_t k = 0; k < cols; ++k) outside |= static_cast<uint32_t>(order[k]) >= static_cast<uint64_t>(cols);
  TORCH_CHECK(!outside, who, ": input order out of range");
  return order;
}

// order (optional): x's columns read through it, x[m, order[k]] (a GPTQ act-order), gathered as
// the activations are quantized: the same bits as qgemm of x[:, order].
torch::Tensor qgemm(torch::Tensor x, torch::Tensor w, int64_t bits, int64_t N, int64_t K, int64_t passes,
                    c10::optional<torch::Tensor> order) {
  check_qgemm(x, w, bits, N, K, passes);
  x = x.contiguous();
  return matmul_rows({x.data_ptr<float>(), input_order(order, K, "qgemm")}, x.size(0), K, w, bits, N, passes,
                     x.options());
}

// The integer-format weights wps (two or more, of widths Nps: whole tiles) of one input width K, each
// against its input: their outputs side by side in y [M, sum Nps], in one parallel region over the
// tiles of all of them (a region each costs a fork, a join and an idle tail). Inputs that are the same
// rows in the same order are quantized once, into `scratch` (null: allocations of their own). Per
// output the same kernel and arithmetic as qgemm, so the same bits.
void matmul_parts_into(const std::vector<PartInput>& inputs, int64_t M, int64_t K, const std::vector<const uint8_t*>& wps,
                       const std::vector<int64_t>& bits, const std::vector<int64_t>& Nps, int64_t passes, float* yp,
                       Scratch* scratch = nullptr) {
#if LOCALLLM_HAVE_NATIVE
  const size_t n = wps.size();
  std::vector<int64_t> offsets(n);
  int64_t total_bytes = 0, width = 0;
  for (size_t i = 0; i < n; ++i) {
    offsets[i] = width;
    width += Nps[i];
    total_bytes += Nps[i] / kTile * fmt_packed_bytes(bits[i], kTile, K);
  }
  std::vector<PartInput> sources;  // distinct inputs, and which one each weight reads
  std::vector<bool> halves;
  std::vector<size_t> source_of(n);
  for (size_t i = 0; i < n; ++i) {
    size_t j = 0;
    while (j < sources.size() && !(sources[j] == inputs[i])) ++j;
    if (j == sources.size()) {
      sources.push_back(inputs[i]);
      halves.push_back(false);
    }
    halves[j] = halves[j] || half_sums(bits[i]);
    source_of[i] = j;
  }
  std::vector<QuantizedRows> rows;
  for (size_t j = 0; j < sources.size(); ++j) {
    uint8_t* storage = scratch ? scratch->take<uint8_t>(quantized_bytes(M, K, passes, halves[j])) : nullptr;
    rows.push_back(quantize_input(sources[j].x, M, K, passes, halves[j], sources[j].order, storage));
  }
  // The parts' tiles as one sequence (part 0's, then part 1's, ...) chunked as one weight of their
  // total size would be (tile_chunk, at their mean tile size), a chunk running on into the next part:
  // each thread then takes an even share of the whole, as of a fused weight (chunked part by part,
  // q/k/v of SmolLM2 had chunks of 10, 10, 10, 6, 10, 2, 10 and 2 tiles).
  std::vector<int64_t> part_end(n);  // the end of each part in the sequence
  int64_t tiles = 0;
  for (size_t i = 0; i < n; ++i) part_end[i] = tiles += Nps[i] / kTile;
  const int64_t chunk = tile_chunk(tiles, std::max<int64_t>(1, total_bytes / tiles), M);
  parallel_chunks(tiles, chunk, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    while (part_end[i] <= begin) ++i;
    for (int64_t s = begin; s < end; ++s) {
      if (s == part_end[i]) ++i;
      const int64_t t = s - (part_end[i] - Nps[i] / kTile);
      weight_tile(bits[i], passes, wps[i], width, K, rows[source_of[i]], yp + offsets[i], t);
    }
  });
#endif
}

// Several weights of one input width K (q/k/v or gate/up of types, or GPTQ input orders, that
// cannot share one repacked weight), each with its own input: their outputs side by side, [M, sum
// Ns] (matmul_parts_into), written in place where every part is whole tiles (else computed apart
// and joined). The weights are checked (check_qgemm).
torch::Tensor matmul_parts(const std::vector<PartInput>& inputs, int64_t M, int64_t K, const std::vector<torch::Tensor>& ws,
                           const std::vector<int64_t>& bits, const std::vector<int64_t>& Ns, int64_t passes,
                           const torch::TensorOptions& options) {
  const size_t n = ws.size();
  bool any_float = false;
  for (int64_t b : bits) any_float = any_float || is_float_fmt(b);
  // F16/BF16 beside other types: their own kernels, one call each; and one weight alone (in an input
  // order: the projections of a GPTQ act-order layer with one weight) takes qgemm's route, which the
  // region below was slower than for the same tiles (SmolLM2's act-order layer in cache, o, q/k/v and
  // gate/up each in one order: 67.1-67.7 -> 63.3-64.5 us; cause not found)
  if (any_float || n == 1) {
    std::vector<torch::Tensor> outs;
    for (size_t i = 0; i < n; ++i) outs.push_back(matmul_rows(inputs[i], M, K, ws[i], bits[i], Ns[i], passes, options));
    return n == 1 ? outs[0] : torch::cat(outs, 1);
  }
  std::vector<int64_t> Nps(n), offsets(n);
  std::vector<const uint8_t*> wps(n);
  int64_t width = 0;
  bool whole_tiles = true;
  for (size_t i = 0; i < n; ++i) {
    Nps[i] = round_tile(Ns[i]);
    whole_tiles = whole_tiles && Nps[i] == Ns[i];
    offsets[i] = width;
    width += Nps[i];
    wps[i] = ws[i].data_ptr<uint8_t>();
  }
  auto out = torch::empty({M, width}, options);
  matmul_parts_into(inputs, M, K, wps, bits, Nps, passes, out.data_ptr<float>());
  if (whole_tiles) return out;
  std::vector<torch::Tensor> parts;  // each part without its padding rows' outputs
  for (size_t i = 0; i < n; ++i) parts.push_back(out.narrow(1, offsets[i], Ns[i]));
  return torch::cat(parts, 1);
}

// matmul_parts for inputs given as tensors xs[i] [M, K] (the same tensor: quantized once).
torch::Tensor qgemm_parts(std::vector<torch::Tensor> xs, std::vector<torch::Tensor> ws, std::vector<int64_t> bits,
                          std::vector<int64_t> Ns, int64_t K, int64_t passes) {
  const size_t n = ws.size();
  TORCH_CHECK(n > 0 && xs.size() == n && bits.size() == n && Ns.size() == n,
              "qgemm_parts: one input, format and width per weight");
  std::vector<PartInput> inputs;
  for (size_t i = 0; i < n; ++i) {
    check_qgemm(xs[i], ws[i], bits[i], Ns[i], K, passes);
    TORCH_CHECK(xs[i].size(0) == xs[0].size(0), "qgemm_parts: the inputs must have the same rows");
    xs[i] = xs[i].contiguous();
    inputs.push_back({xs[i].data_ptr<float>(), nullptr});
  }
  return matmul_parts(inputs, xs[0].size(0), K, ws, bits, Ns, passes, xs[0].options());
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
  quantize_rows<VNative>(x.data_ptr<float>(), M, K, static_cast<int>(passes), xq.data_ptr<int8_t>(), xs.data_ptr<float>(),
                         xsum.data_ptr<int32_t>(), nullptr, nullptr, [&](int p, int64_t m, int64_t g) {  // row-major
                           return std::pair<int64_t, int64_t>{(p * M + m) * K + g * kGroup, (p * M + m) * G + g};
                         });
#endif
  return {xq, xs, xsum};
}


// ---------------------------------------------------------------------------------------------
// Elementwise and attention ops of a decoder layer, float32, so that a decode step is a few
// calls per layer instead of dozens of small torch ops. References: the reference ops of
// TorchBackend (localllm/kernels/torch_backend.py) and paged_attention in localllm/kernels/attention.py.

#if LOCALLLM_HAVE_NATIVE

// exp(x) per lane (Cephes' polynomial, relative error ~2e-7; inputs below -87 give 0).
template <class V>
inline typename V::F lane_exp(typename V::F x) {
  using F = typename V::F;
  const F lo = V::set(-87.33654f), hi = V::set(88.37626f);
  const F xc = V::fmin(V::fmax(x, lo), hi);
  const F fx = V::round(V::fmul(xc, V::set(1.44269504088896341f)));
  F r = V::fnma(fx, V::set(0.693359375f), xc);
  r = V::fnma(fx, V::set(-2.12194440e-4f), r);
  F p = V::set(1.9875691500E-4f);
  p = V::fma(p, r, V::set(1.3981999507E-3f));
  p = V::fma(p, r, V::set(8.3334519073E-3f));
  p = V::fma(p, r, V::set(4.1665795894E-2f));
  p = V::fma(p, r, V::set(1.6666665459E-1f));
  p = V::fma(p, r, V::set(5.0000001201E-1f));
  p = V::fma(p, V::fmul(r, r), V::fadd(r, V::set(1.0f)));
  return V::zero_where_less(V::ldexp(p, fx), x, lo);  // below -87: 0
}

// sum_i a[i] b[i] for n % 16 == 0: 16 lanes of products (V256: two registers, lanes j and j + 8),
// then their sum in V::reduce_add's order, which is the same in both widths.
template <class V>
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int kVecs = 16 / V::kLanes;
  typename V::F acc[kVecs];
  for (int c = 0; c < kVecs; ++c) acc[c] = V::zero();
  for (int64_t i = 0; i < n; i += 16)
    for (int c = 0; c < kVecs; ++c) acc[c] = V::fma(V::load(a + i + V::kLanes * c), V::load(b + i + V::kLanes * c), acc[c]);
  typename V::F sum = acc[0];
  for (int c = 1; c < kVecs; ++c) sum = V::fadd(acc[c], sum);
  return V::reduce_add(sum);
}

template <class V>
void rms_rows(const float* x, const float* w, float eps, int64_t T, int64_t H, float* out) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = x + t * H;
      float* o = out + t * H;
      const float ss = dot<V>(xr, xr, H);
      const typename V::F scale = V::set(1.0f / std::sqrt(ss / static_cast<float>(H) + eps));
      for (int64_t i = 0; i < H; i += V::kLanes) V::store(o + i, V::fmul(V::fmul(V::load(xr + i), scale), V::load(w + i)));
    }
  });
}

// silu(gate) * up, rows of gate_up [T, 2 I] (gate first) -> out [T, I]
template <class V>
void silu_rows(const float* gate_up, int64_t T, int64_t I, float* out) {
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    using F = typename V::F;
    const F one = V::set(1.0f);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < I; i += V::kLanes) {
        const F g = V::load(gate_up + t * 2 * I + i);
        const F u = V::load(gate_up + t * 2 * I + I + i);
        const F sg = V::fdiv(g, V::fadd(one, lane_exp<V>(V::fsub(V::zero(), g))));
        V::store(out + t * I + i, V::fmul(sg, u));
      }
    }
  });
}

#endif  // LOCALLLM_HAVE_NATIVE

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
  rms_rows<VNative>(x.data_ptr<float>(), w.data_ptr<float>(), static_cast<float>(eps), T, H, out.data_ptr<float>());
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
// Rounded to nearest even, as .to(float16): by F16C's vcvtps2ph, 8 at a time, in the native builds (a
// c10::Half made one at a time is a software conversion: a 1B layer's k and v, 1024 values, cost
// about 4 us of its serial steps).
inline void store_kv(c10::Half* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if LOCALLLM_HAVE_NATIVE
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}

template <typename T>
void rope_write_impl(const float* src, const int64_t* pos, const int64_t* slot, const float* ct, const float* st,
                     float* qd, T* kc, T* vc, int64_t T_, int64_t nh, int64_t nkv, int64_t hd, bool neox) {
  const int64_t width = (nh + 2 * nkv) * hd, half = hd / 2;
  at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> rotated;  // (kept: a decode layer's serial steps allocate nothing)
    if (rotated.size() < static_cast<size_t>(hd)) rotated.resize(hd);
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
// rope_write_kv's work on the rows qkv [T, (nh + 2 nkv) * hd] (float32), the rotated q into q [T, nh,
// hd]; the step's tensors checked here.
void rope_write_into(const float* qkv, int64_t T, const torch::Tensor& positions, const torch::Tensor& cos,
                     const torch::Tensor& sin, const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                     int64_t nh, int64_t nkv, int64_t hd, bool neox, float* q) {
  check_f32(cos, "rope_write_kv: cos");
  check_f32(sin, "rope_write_kv: sin");
  check_kv_cache(kv_cache, "rope_write_kv: kv_cache");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slot_mapping.scalar_type() == torch::kInt64 &&
                  positions.is_contiguous() && slot_mapping.is_contiguous(),
              "rope_write_kv: positions and slot_mapping must be contiguous int64");
  const int64_t half = hd / 2;
  TORCH_CHECK(hd % 32 == 0, "rope_write_kv: the head size must be a multiple of 32");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(), "rope_write_kv: bad tables");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(3) == nkv && kv_cache.size(4) == hd,
              "rope_write_kv: bad kv_cache shape");
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T, "rope_write_kv: one position and slot per token");
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2), max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rope_write_kv: position out of range");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "rope_write_kv: slot out of range");
  }
  if (kv_cache.scalar_type() == torch::kFloat16) {
    c10::Half* kc = kv_cache.data_ptr<c10::Half>();
    rope_write_impl(qkv, pos, slot, cos.data_ptr<float>(), sin.data_ptr<float>(), q, kc, kc + slots * nkv * hd, T, nh,
                    nkv, hd, neox);
  } else {
    float* kc = kv_cache.data_ptr<float>();
    rope_write_impl(qkv, pos, slot, cos.data_ptr<float>(), sin.data_ptr<float>(), q, kc, kc + slots * nkv * hd, T, nh,
                    nkv, hd, neox);
  }
}

torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor kv_cache, torch::Tensor slot_mapping, int64_t nh, int64_t nkv, int64_t hd,
                            bool neox) {
  check_f32(qkv, "rope_write_kv: qkv");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (nh + 2 * nkv) * hd, "rope_write_kv: bad qkv shape");
  auto q = torch::empty({T, nh, hd}, qkv.options());
  rope_write_into(qkv.data_ptr<float>(), T, positions, cos, sin, kv_cache, slot_mapping, nh, nkv, hd, neox,
                  q.data_ptr<float>());
  return q;
}

#if LOCALLLM_HAVE_NATIVE

// One sequence's decode attention, the query heads of KV heads [g0, g1): their rows of q [nh, hd] ->
// out [nh, hd]. Each head's arithmetic is its own, the same whichever heads a call takes. NV = hd / V::kLanes
// when known at compile time (0: read nv). K, then V, are streamed block by block (four blocks
// ahead prefetched): V::kLanes tokens' scores per head at a time (one transposed lane sum), the
// output accumulated in registers over each block, for up to V::kAccumulators vectors at a time
// (of one head, or of several heads' whole rows).
template <class V, int NV, typename T>
void attend_sequence(const float* q, const T* kc, const T* vc, const int64_t* table, int64_t ctx, int64_t nh,
                     int64_t nkv, int64_t nv_, int64_t bs, float scale, float* out, std::vector<float>& scores,
                     int64_t g0, int64_t g1) {
  using F = typename V::F;
  constexpr int L = V::kLanes;
  const int64_t nv = NV ? NV : nv_, hd = nv * L, group = nh / nkv, row = nkv * hd;
  const int64_t nblk = (ctx + bs - 1) / bs, padded = (ctx + L - 1) / L * L;
  const int64_t h_begin = g0 * group, h_end = g1 * group;  // the query heads taken
  scores.assign((h_end - h_begin) * padded, -INFINITY);  // (row hq - h_begin: head hq's scores)
  alignas(64) float k_tile[L * 256];  // (hd <= 256)
  // the K blocks then the V blocks (i: K block i, then V block i - nblk), read in that order: as a
  // KV head's part of block i is taken, its part of block i + kAhead is asked for into L2. (Each
  // KV head's rows as its turn comes: asked for a whole block at a time, 16 KB at once, the lines
  // came slower. Into L1, slower still. 4000 tokens of Llama-3.2-1B's heads, float16, 16 caches
  // beyond L3, Zen 4, median us, none / a block at a time 2 ahead into L2 / per KV head 4 ahead into L2:
  // 1 thread 1218 / 1144 / 665, 2 threads 599 / 347 / 344; from cache 616 / 569 / 545 and 291 / 295 /
  // 279. "None" was the kernel before: its prefetches into L1 sat in lambdas that GCC dropped as
  // dead code, see prefetch_row_window.)
  constexpr int64_t kAhead = 4;
  auto prefetch_head = [&](int64_t i, int64_t g) __attribute__((always_inline)) {
    if (i >= 2 * nblk) return;
    const T* block = i < nblk ? kc + table[i] * bs * row : vc + table[i - nblk] * bs * row;
    for (int64_t t = 0; t < bs; ++t) prefetch_rows<_MM_HINT_T1>(block + t * row + g * hd, hd);
  };
  for (int64_t i = 0; i < kAhead; ++i)
    for (int64_t g = g0; g < g1; ++g) prefetch_head(i, g);
  for (int64_t b = 0; b < nblk; ++b) {
    const T* kb = kc + table[b] * bs * row;
    const int64_t n = std::min<int64_t>(bs, ctx - b * bs);
    for (int64_t t0 = 0; t0 < n; t0 += L) {
      const int64_t w = std::min<int64_t>(L, n - t0);
      for (int64_t g = g0; g < g1; ++g) {
        if (t0 == 0) prefetch_head(b + kAhead, g);
        // the KV head's keys of these tokens: float16 ones converted once into k_tile for the
        // group's query heads (each converted per head before: 4 times for Llama-3.2's groups)
        const T* kr = kb + t0 * row + g * hd;
        const float* keys;
        int64_t key_stride;
        if constexpr (std::is_same_v<T, float>) {
          keys = kr, key_stride = row;
        } else {
          for (int64_t t = 0; t < w; ++t)
            for (int64_t i = 0; i < nv; ++i) V::store(k_tile + t * hd + L * i, V::load(kr + t * row + L * i));
          keys = k_tile, key_stride = hd;
        }
        for (int64_t hq = g * group; hq < (g + 1) * group; ++hq) {
          const float* qh = q + hq * hd;
          F qv[16];  // (V::kHoldsQ: hd <= 256 gives nv <= 16)
          if constexpr (V::kHoldsQ)
            for (int64_t i = 0; i < nv; ++i) qv[i] = V::load(qh + L * i);
          auto q_vec = [&](int64_t i) {
            if constexpr (V::kHoldsQ) return qv[i];
            else return V::load(qh + L * i);
          };
          F acc[L];
          for (int t = 0; t < L; ++t) {
            if (t < w) {
              const float* kt = keys + t * key_stride;
              F a = V::fmul(q_vec(0), V::load(kt));
              for (int64_t i = 1; i < nv; ++i) a = V::fma(q_vec(i), V::load(kt + L * i), a);
              acc[t] = a;
            } else {
              acc[t] = V::zero();
            }
          }
          V::store_first(scores.data() + (hq - h_begin) * padded + b * bs + t0, V::fmul(V::lane_sums(acc), V::set(scale)), w);
        }
      }
    }
  }
  float inv[256];
  for (int64_t hq = h_begin; hq < h_end; ++hq) {
    float* sg = scores.data() + (hq - h_begin) * padded;
    F mx = V::set(-INFINITY);
    for (int64_t t = 0; t < padded; t += L) mx = V::fmax(mx, V::load(sg + t));
    const F m = V::set(V::reduce_max(mx));
    F sum = V::zero();
    for (int64_t t = 0; t < padded; t += L) {
      const F e = lane_exp<V>(V::fsub(V::load(sg + t), m));  // padding: exp(-inf) = 0
      V::store(sg + t, e);
      sum = V::fadd(sum, e);
    }
    inv[hq] = 1.0f / V::reduce_add(sum);
    for (int64_t i = 0; i < hd; i += L) V::store(out + hq * hd + i, V::zero());
  }
  // per pass over a block: kPer heads x kChunk vectors of accumulators (at most V::kAccumulators)
  constexpr int64_t kRegs = V::kAccumulators;
  constexpr int64_t kChunk = NV ? std::min<int64_t>(NV, kRegs) : kRegs;
  constexpr int64_t kPer = NV ? std::max<int64_t>(kRegs / kChunk, 1) : 1;
  const int64_t per_pass = std::min<int64_t>(group, kPer);
  for (int64_t b = 0; b < nblk; ++b) {
    const T* vb = vc + table[b] * bs * row;
    const int64_t n = std::min<int64_t>(bs, ctx - b * bs);
    for (int64_t g = g0; g < g1; ++g) {
      prefetch_head(nblk + b + kAhead, g);
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += per_pass) {
        const int64_t nhp = std::min<int64_t>(per_pass, (g + 1) * group - h0);
        for (int64_t c0 = 0; c0 < nv; c0 += kChunk) {
          const int64_t nc = std::min<int64_t>(kChunk, nv - c0);
          F acc[kPer * kChunk];
          for (int64_t j = 0; j < kPer; ++j)
            if (j < nhp)
              for (int64_t i = 0; i < kChunk; ++i)
                if (i < nc) acc[j * kChunk + i] = V::load(out + (h0 + j) * hd + L * (c0 + i));
          for (int64_t t = 0; t < n; ++t) {
            const T* vr = vb + t * row + g * hd + L * c0;
            const float* p = scores.data() + (h0 - h_begin) * padded + b * bs + t;
            F pj[kPer];
            for (int64_t j = 0; j < kPer; ++j)
              if (j < nhp) pj[j] = V::set(p[j * padded]);
            for (int64_t i = 0; i < kChunk; ++i)
              if (i < nc) {
                const F v = V::load(vr + L * i);
                for (int64_t j = 0; j < kPer; ++j)
                  if (j < nhp) acc[j * kChunk + i] = V::fma(pj[j], v, acc[j * kChunk + i]);
              }
          }
          for (int64_t j = 0; j < kPer; ++j)
            if (j < nhp)
              for (int64_t i = 0; i < kChunk; ++i)
                if (i < nc) V::store(out + (h0 + j) * hd + L * (c0 + i), acc[j * kChunk + i]);
        }
      }
    }
  }
  for (int64_t hq = h_begin; hq < h_end; ++hq) {
    const F f = V::set(inv[hq]);
    for (int64_t i = 0; i < hd; i += L) V::store(out + hq * hd + i, V::fmul(f, V::load(out + hq * hd + i)));
  }
}

template <class V, typename T>
void decode_attention_impl(const float* qd, const T* kc, const T* vc, const int64_t* tables, const int64_t* lens,
                           int64_t max_blocks, int64_t nd, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, float sc,
                           float* od) {
  constexpr int L = V::kLanes;
  const int64_t nv = hd / L;
  // Fewer sequences than threads (one stream's decode): each sequence's KV heads are parts of the
  // work of their own, once its K/V are worth a thread's wake-up (kAttentionSplitBytes), so that
  // a long context's attention does not run on one thread while the others wait. A head's
  // arithmetic does not depend on the split: the same bits whatever the batch. One stream's decode
  // after a 4000-token prompt, the whole layers replayed, 2 threads, Zen 4: SmolLM2 (3 KV heads)
  // 411 -> 366 us a layer, a Llama-3.2-1B-shaped Q4_0 (8 KV heads) 1948 -> 1515 us.
  int64_t longest = 0;
  for (int64_t i = 0; i < nd; ++i) longest = std::max(longest, lens[i]);
  const bool split = nd < omp_get_max_threads() && longest * nkv * hd * 2 * static_cast<int64_t>(sizeof(T)) >= kAttentionSplitBytes;
  const int64_t parts = split ? nkv : 1;
  parallel_chunks(nd * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / parts, g0 = item % parts * nkv / parts, g1 = (item % parts + 1) * nkv / parts;
      const float* q = qd + seq * nh * hd;
      const int64_t* table = tables + seq * max_blocks;
      float* out = od + seq * nh * hd;
      switch (hd) {  // the common head sizes with their vector counts fixed
        case 32: attend_sequence<V, 32 / L>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores, g0, g1); break;
        case 64: attend_sequence<V, 64 / L>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores, g0, g1); break;
        case 128: attend_sequence<V, 128 / L>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores, g0, g1); break;
        default: attend_sequence<V, 0>(q, kc, vc, table, lens[seq], nh, nkv, nv, bs, sc, out, scores, g0, g1);
      }
    }
  });
}

#endif  // LOCALLLM_HAVE_NATIVE

// Decode attention straight from the paged cache (float32 or float16): q [nd, nh, hd] (one
// query per sequence, the first nd rows of block_tables [>= nd, max_blocks] / context_lens
// [>= nd]) -> out [nd, nh, hd] float32.
// paged_decode_attention's work on the queries q [nd, nh, hd] (float32) into out [nd, nh, hd]; the
// step's tensors checked here (block_tables and context_lens: contiguous).
void decode_attention_into(const float* q, int64_t nd, int64_t nh, int64_t hd, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                           float* out) {
  check_kv_cache(kv_cache, "paged_decode_attention: kv_cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64 &&
                  block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.dim() == 2,
              "paged_decode_attention: block_tables and context_lens must be contiguous int64");
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
#if LOCALLLM_HAVE_NATIVE
  const int64_t half = nblocks * bs * nkv * hd;  // elements of K (V follows)
  if (kv_cache.scalar_type() == torch::kFloat16) {
    const c10::Half* kc = kv_cache.data_ptr<c10::Half>();
    decode_attention_impl<VNative>(q, kc, kc + half, tables, lens, max_blocks, nd, nh, nkv, hd, bs,
                                   static_cast<float>(scale), out);
  } else {
    const float* kc = kv_cache.data_ptr<float>();
    decode_attention_impl<VNative>(q, kc, kc + half, tables, lens, max_blocks, nd, nh, nkv, hd, bs,
                                   static_cast<float>(scale), out);
  }
#endif
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  check_f32(q, "paged_decode_attention: q");
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q must be [sequences, heads, head size]");
  auto out = torch::empty_like(q);
  decode_attention_into(q.data_ptr<float>(), q.size(0), q.size(1), q.size(2), kv_cache, block_tables.contiguous(),
                        context_lens.contiguous(), scale, out.data_ptr<float>());
  return out;
}

// silu(gate) * up for gate_up [T, 2 I] (gate first) -> [T, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "silu_mul: gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.dim() == 2 && I % 16 == 0 && gate_up.size(1) == 2 * I, "silu_mul: bad shape");
  auto out = torch::empty({T, I}, gate_up.options());
#if LOCALLLM_HAVE_NATIVE
  silu_rows<VNative>(gate_up.data_ptr<float>(), T, I, out.data_ptr<float>());
#endif
  return out;
}

// One projection of a held layer: its weights (one, or parts side by side) of input width K, each
// checked once, when the layer is held.
struct HeldProjection {
  std::vector<torch::Tensor> ws;  // (kept alive: the pointers below are into them)
  std::vector<const uint8_t*> wps;
  std::vector<int64_t> bits, Ns;
  int64_t K = 0, width = 0;  // width: sum of Ns
  size_t first = 0;          // the index of its first weight in HeldLayer::perms
  bool any_float = false;

  HeldProjection() = default;
  HeldProjection(std::vector<torch::Tensor> ws_, std::vector<int64_t> bits_, std::vector<int64_t> Ns_, int64_t K_,
                 size_t first_, int64_t passes)
      : ws(std::move(ws_)), bits(std::move(bits_)), Ns(std::move(Ns_)), K(K_), first(first_) {
    for (size_t i = 0; i < ws.size(); ++i) {
      check_weight(ws[i], bits[i], Ns[i], K, passes);
      TORCH_CHECK(Ns[i] % kTile == 0, "decoder_layer: every projection's width must be a multiple of ", kTile);
      wps.push_back(ws[i].data_ptr<uint8_t>());
      any_float = any_float || is_float_fmt(bits[i]);
      width += Ns[i];
    }
  }
};

// One decoder layer's weights and shapes for decoder_layer (held by the Python side's plan for the
// layer's life, so that a call converts only the step's inputs): h + mlp(post_norm(h + attn(
// input_norm(h)))). The bias is optional. q/k/v come as one fused weight or three; gate/up as one
// fused weight or two. perms (GPTQ act-order) is empty, or holds each weight's input order in the
// order q/k/v (1 or 3), o, gate/up (1 or 2), down (None: the input as it is), checked once here
// (input_order) and read by every step through orders. The weights, norms and bias are checked here.
struct HeldLayer {
  torch::Tensor input_norm, post_norm;
  c10::optional<torch::Tensor> qkv_bias;
  int64_t H, nh, nkv, hd, inter;
  double eps, scale;
  int64_t passes;
  std::vector<c10::optional<torch::Tensor>> perms;
  std::vector<const int32_t*> orders;  // perms' entries (null: none), or empty
  HeldProjection qkv, o, gate_up, down;

  HeldLayer(torch::Tensor input_norm, std::vector<torch::Tensor> qkv_ws, std::vector<int64_t> qkv_bits,
            c10::optional<torch::Tensor> qkv_bias, torch::Tensor o_w, int64_t o_bits, torch::Tensor post_norm,
            std::vector<torch::Tensor> gate_up_ws, std::vector<int64_t> gate_up_bits, torch::Tensor down_w,
            int64_t down_bits, int64_t nh, int64_t nkv, int64_t hd, int64_t inter, double eps, double scale,
            int64_t passes, std::vector<c10::optional<torch::Tensor>> perms)
      : input_norm(std::move(input_norm)), post_norm(std::move(post_norm)), qkv_bias(std::move(qkv_bias)),
        H(this->input_norm.numel()), nh(nh), nkv(nkv), hd(hd), inter(inter), eps(eps), scale(scale), passes(passes),
        perms(std::move(perms)) {
    const size_t nq = qkv_ws.size(), ng = gate_up_ws.size();
    TORCH_CHECK((nq == 1 || nq == 3) && qkv_bits.size() == nq, "decoder_layer: q/k/v weights: one fused or three");
    TORCH_CHECK((ng == 1 || ng == 2) && gate_up_bits.size() == ng, "decoder_layer: gate/up weights: one fused or two");
    TORCH_CHECK(this->perms.empty() || this->perms.size() == nq + ng + 2,
                "decoder_layer: perms: none, or one per weight (q/k/v, o, gate/up, down)");
    check_f32(this->input_norm, "decoder_layer: input_norm");
    check_f32(this->post_norm, "decoder_layer: post_norm");
    TORCH_CHECK(H % 16 == 0 && this->post_norm.numel() == H, "decoder_layer: norms: hidden size a multiple of 16");
    TORCH_CHECK(inter % 16 == 0, "decoder_layer: the MLP's width must be a multiple of 16");
    const int64_t width = (nh + 2 * nkv) * hd;
    if (this->qkv_bias.has_value()) {
      check_f32(*this->qkv_bias, "decoder_layer: qkv_bias");
      TORCH_CHECK(this->qkv_bias->numel() == width, "decoder_layer: qkv_bias: one entry per q/k/v output");
    }
    qkv = HeldProjection(std::move(qkv_ws), std::move(qkv_bits),
                         nq == 1 ? std::vector<int64_t>{width} : std::vector<int64_t>{nh * hd, nkv * hd, nkv * hd}, H,
                         0, passes);
    o = HeldProjection({std::move(o_w)}, {o_bits}, {H}, nh * hd, nq, passes);
    gate_up = HeldProjection(std::move(gate_up_ws), std::move(gate_up_bits),
                             ng == 1 ? std::vector<int64_t>{2 * inter} : std::vector<int64_t>{inter, inter}, H, nq + 1,
                             passes);
    down = HeldProjection({std::move(down_w)}, {down_bits}, {H}, inter, nq + 1 + ng, passes);
    for (size_t i = 0; i < this->perms.size(); ++i) {  // each weight's input width
      const int64_t cols = i < nq ? H : i == nq ? nh * hd : i < nq + 1 + ng ? H : inter;
      orders.push_back(input_order(this->perms[i], cols, "decoder_layer"));
    }
  }

  // The scratch bytes that layer_rows takes for T rows.
  int64_t scratch_bytes(int64_t T) const {
    auto f = [](int64_t n) { return Scratch::size_of<float>(n); };
    auto quantized = [&](const HeldProjection& p) {  // at most one quantized input per weight
      int64_t bytes = 0;
#if LOCALLLM_HAVE_NATIVE
      if (!p.any_float)
        for (int64_t b : p.bits) bytes += Scratch::size_of<uint8_t>(quantized_bytes(T, p.K, passes, half_sums(b)));
#endif
      return bytes;
    };
    const int64_t buffers = f(T * H) + f(T * qkv.width) + 2 * f(T * nh * hd) + f(T * H) + f(T * gate_up.width) +
                            f(T * inter);
    return buffers + std::max({quantized(qkv), quantized(o), quantized(gate_up), quantized(down)});
  }
};

// The step's inputs that every layer of it shares: positions, the RoPE tables, the KV slots written
// and, per row, the block table and context length its attention reads.
struct LayerStep {
  const torch::Tensor &positions, &cos, &sin;
  bool neox;
  const torch::Tensor &slot_mapping, &block_tables, &context_lens;
};

#if LOCALLLM_HAVE_NATIVE
// The rows x [T, p.K] (float32) through the projection p (input orders from weight p.first of
// L.orders) into y [T, p.width]: as matmul_parts, the quantized rows in the scratch.
void project_into(const HeldLayer& L, const HeldProjection& p, const float* x, int64_t T, float* y, Scratch& scratch) {
  std::vector<PartInput> inputs;
  for (size_t i = 0; i < p.wps.size(); ++i) inputs.push_back({x, L.orders.empty() ? nullptr : L.orders[p.first + i]});
  const int64_t mark = scratch.mark();
  if (p.wps.size() == 1) {
    const bool halves = half_sums(p.bits[0]);
    uint8_t* storage = p.any_float ? nullptr : scratch.take<uint8_t>(quantized_bytes(T, p.K, L.passes, halves));
    matmul_rows_into(inputs[0], T, p.K, p.wps[0], p.bits[0], p.Ns[0], L.passes, y, storage);
  } else if (!p.any_float) {
    matmul_parts_into(inputs, T, p.K, p.wps, p.bits, p.Ns, L.passes, y, &scratch);
  } else {  // F16/BF16 beside other types: matmul_parts' own route (tensors), copied into place
    const auto out = matmul_parts(inputs, T, p.K, p.ws, p.bits, p.Ns, L.passes, torch::TensorOptions().dtype(torch::kFloat32));
    std::memcpy(y, out.data_ptr<float>(), static_cast<size_t>(T * p.width) * sizeof(float));
  }
  scratch.release(mark);
}
#endif

// Layer L on the rows h [T, L.H] of a step into h_out [T, L.H] (not h), its K/V written into (and read
// from) kv_cache; every buffer from the scratch. The same kernels, in the same order, as the ops one
// by one (rms_norm, qgemm, rope_write_kv, paged_decode_attention, add_rms_norm, silu_mul): the same bits.
void layer_rows(const HeldLayer& L, const float* h, float* h_out, int64_t T, const LayerStep& step,
                const torch::Tensor& kv_cache, Scratch& scratch) {
#if LOCALLLM_HAVE_NATIVE
  const int64_t H = L.H, nh = L.nh, hd = L.hd;
  const float eps = static_cast<float>(L.eps);
  const int64_t mark = scratch.mark();
  float* x = scratch.take<float>(T * H);
  rms_rows<VNative>(h, L.input_norm.data_ptr<float>(), eps, T, H, x);
  float* qkv = scratch.take<float>(T * L.qkv.width);
  project_into(L, L.qkv, x, T, qkv, scratch);
  if (L.qkv_bias.has_value()) {
    const float* bias = L.qkv_bias->data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < L.qkv.width; ++i) qkv[t * L.qkv.width + i] += bias[i];
  }
  float* q = scratch.take<float>(T * nh * hd);
  rope_write_into(qkv, T, step.positions, step.cos, step.sin, kv_cache, step.slot_mapping, nh, L.nkv, hd, step.neox, q);
  float* attended = scratch.take<float>(T * nh * hd);
  decode_attention_into(q, T, nh, hd, kv_cache, step.block_tables, step.context_lens, L.scale, attended);
  float* a = scratch.take<float>(T * H);
  project_into(L, L.o, attended, T, a, scratch);
  for (int64_t i = 0; i < T * H; ++i) h_out[i] = h[i] + a[i];  // the residual, then its norm into x
  rms_rows<VNative>(h_out, L.post_norm.data_ptr<float>(), eps, T, H, x);
  float* gate_up = scratch.take<float>(T * L.gate_up.width);
  project_into(L, L.gate_up, x, T, gate_up, scratch);
  float* act = scratch.take<float>(T * L.inter);
  silu_rows<VNative>(gate_up, T, L.inter, act);
  project_into(L, L.down, act, T, a, scratch);
  for (int64_t i = 0; i < T * H; ++i) h_out[i] += a[i];
  scratch.release(mark);
#else
  TORCH_CHECK(false, "localllm decoder_layer: built without native kernels (AVX-512 VNNI or AVX2)");
#endif
}

thread_local Scratch t_layer_scratch;  // the calling thread's (see Scratch)

// Every layer of layers on the rows h [T, H] (float32), layer i on the output of layer i - 1, its K/V
// in kv_caches[i]; then, where norm (float32 [H]) is given, rms_norm of the last one with it and eps.
torch::Tensor run_layers(torch::Tensor h, const std::vector<const HeldLayer*>& layers, const LayerStep& step,
                         const std::vector<torch::Tensor>& kv_caches, const c10::optional<torch::Tensor>& norm = {},
                         double eps = 0.0) {
  TORCH_CHECK(layers.size() == kv_caches.size(), "decoder_layers: one KV cache per layer");
  check_f32(h, "decoder_layer: h");
  TORCH_CHECK(h.dim() == 2, "decoder_layer: h must be [rows, hidden]");
  const int64_t T = h.size(0), H = h.size(1);
  if (norm.has_value()) {
    check_f32(*norm, "decoder_layers: norm");
    TORCH_CHECK(norm->numel() == H && H % 16 == 0, "decoder_layers: norm: one weight per hidden unit, a multiple of 16");
  }
  int64_t bytes = 0;
  for (const HeldLayer* L : layers) {
    TORCH_CHECK(L != nullptr, "decoder_layers: a layer is None");
    TORCH_CHECK(L->H == H, "decoder_layer: h's width is not the layer's hidden size");
    bytes = std::max(bytes, L->scratch_bytes(T));
  }
  auto out = torch::empty({T, H}, h.options());
  Scratch& scratch = t_layer_scratch;
  scratch.reserve(bytes + Scratch::size_of<float>(T * H));
  // the layers' outputs alternate between out and a buffer, so that the last one lands in out (with a
  // norm: in the buffer, normed into out)
  float* other = scratch.take<float>(T * H);
  const float* in = h.data_ptr<float>();
  for (size_t i = 0; i < layers.size(); ++i) {
    float* dst = ((layers.size() - i) % 2 == 1) != norm.has_value() ? out.data_ptr<float>() : other;
    layer_rows(*layers[i], in, dst, T, step, kv_caches[i], scratch);
    in = dst;
  }
  if (norm.has_value()) {
#if LOCALLLM_HAVE_NATIVE
    rms_rows<VNative>(in, norm->data_ptr<float>(), static_cast<float>(eps), T, H, out.data_ptr<float>());
#endif
    return out;
  }
  return layers.empty() ? h : out;
}

// One decoder layer for a decode-only step (or, batch-invariant, rows that attend as decodes at
// their positions), every piece native (see NativeCpuOps.decoder_layer), its weights held by `layer`.
torch::Tensor decoder_layer(torch::Tensor h, const HeldLayer& layer, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin, bool neox, torch::Tensor kv_cache, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor context_lens) {
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  return run_layers(h, {&layer}, {positions, cos, sin, neox, slot_mapping, block_tables, context_lens}, {kv_cache});
}

// A model's decoder layers bound to what every decode step of theirs reads the same: each layer's
// KV cache, the one RoPE's tables and (given) the final norm with its eps; converted from Python and
// checked once, at binding, so that a step's call converts only the step's own tensors (with the
// Python that checked the caches each step: 88 -> 63 us of SmolLM2's decode step outside the layers'
// native work, 30 layers, cold).
struct HeldLayers {
  std::vector<std::shared_ptr<HeldLayer>> layers;
  std::vector<const HeldLayer*> held;
  std::vector<torch::Tensor> kv_caches;
  torch::Tensor cos, sin;
  bool neox;
  c10::optional<torch::Tensor> norm;
  double norm_eps;

  HeldLayers(std::vector<std::shared_ptr<HeldLayer>> layers, torch::Tensor cos, torch::Tensor sin, bool neox,
             std::vector<torch::Tensor> kv_caches, c10::optional<torch::Tensor> norm, double norm_eps)
      : layers(std::move(layers)), kv_caches(std::move(kv_caches)), cos(std::move(cos)), sin(std::move(sin)),
        neox(neox), norm(std::move(norm)), norm_eps(norm_eps) {
    TORCH_CHECK(this->layers.size() == this->kv_caches.size(), "decoder_layers: one KV cache per layer");
    for (const auto& layer : this->layers) {
      TORCH_CHECK(layer != nullptr, "decoder_layers: a layer is None");
      held.push_back(layer.get());
    }
    for (const auto& kv_cache : this->kv_caches) check_kv_cache(kv_cache, "decoder_layers: a KV cache");
  }
};

// Every decoder layer of a step in one call: layer i on the output of layer i - 1, its K/V in its bound
// KV cache, then (bound with a norm) the model's final norm, rms_norm with it and its eps (a torch op
// of its own cost 80 us in a decode step, with its Python); the same calls as decoder_layer's one by
// one and rms_norm's, so the same bits, without a Python call
// and its argument conversion per layer (about 4 us for the conversion of decoder_layer's 28 arguments,
// before the layers were held, and as much again in Python). SmolLM2-135M Q4_1's decode, 64 tokens in
// process, best of 3, five pairs of processes alternating: 202-232 -> 233-264 tok/s (1.09-1.19x).
torch::Tensor decoder_layers(torch::Tensor h, const HeldLayers& bound, torch::Tensor positions,
                             torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens) {
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  return run_layers(h, bound.held, {positions, bound.cos, bound.sin, bound.neox, slot_mapping, block_tables, context_lens},
                    bound.kv_caches, bound.norm, bound.norm_eps);
}

// For each row of logits [S, V] (float32, contiguous), on the calling thread: the index of its first
// largest entry (torch's argmax; any index where the row holds a NaN) and whether it can be sampled
// (no NaN, no +inf, not only -inf: the sampler's finite_rows). Two passes over a row from the cache,
// the maximum and then its first place, in place of the sampler's several torch ops (each of which
// cost 20-100 us in a decode step, its code evicted by the step's weights, against about 5 us here for
// a 49152-entry row).
// The largest of x[0..n) (the vector lanes' maximum, then the tail's: NaNs do not order) and, in nan,
// whether one of them is NaN.
float row_max(const float* x, int64_t n, bool& nan) {
  float mx = -INFINITY;
  nan = false;
  int64_t i = 0;
#if LOCALLLM_HAVE_NATIVE
  using V = VNative;
  typename V::F vmx = V::set(-INFINITY);
  uint32_t nans = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    const typename V::F v = V::load(x + i);
    nans |= V::nan_bits(v);
    vmx = V::fmax(vmx, v);
  }
  mx = V::reduce_max(vmx);
  nan = nans != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    mx = std::max(mx, x[i]);
  }
  return mx;
}

std::pair<std::vector<int64_t>, std::vector<bool>> greedy_rows(torch::Tensor logits) {
  check_f32(logits, "greedy_rows: logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_rows: logits must be [rows, vocabulary]");
  const int64_t S = logits.size(0), N = logits.size(1);
  std::vector<int64_t> ids(static_cast<size_t>(S), 0);
  std::vector<bool> finite(static_cast<size_t>(S), false);
  for (int64_t r = 0; r < S; ++r) {
    const float* x = logits.data_ptr<float>() + r * N;
    bool nan;
    const float mx = row_max(x, N, nan);
    if (nan) continue;
    finite[r] = std::isfinite(mx);
    int64_t i = 0;
#if LOCALLLM_HAVE_NATIVE
    using V = VNative;
    for (; i + V::kLanes <= N; i += V::kLanes) {
      const uint32_t at = V::ge_bits(V::load(x + i), V::set(mx));
      if (at != 0) break;
    }
#endif
    while (i < N && !(x[i] >= mx)) ++i;
    ids[r] = i;
  }
  return {ids, finite};
}

// For each row r of out [M, N] (float32), the columns c with out[r, c] >= max_r - (abs_margin[r]
// + rel_margin * |max_r|) (abs_margin[r] times abs_scale, where given): returns (rows, cols) int64,
// row-major order.
std::vector<torch::Tensor> near_max(torch::Tensor out, torch::Tensor abs_margin, double rel_margin, double abs_scale = 1.0) {
  check_f32(out, "near_max: out");
  check_f32(abs_margin, "near_max: abs_margin");
  TORCH_CHECK(out.dim() == 2 && abs_margin.numel() == out.size(0), "near_max: one margin per row");
  const int64_t M = out.size(0), N = out.size(1);
  const float* o = out.data_ptr<float>();
  const float* am = abs_margin.data_ptr<float>();
  std::vector<int64_t> rows, cols;
  for (int64_t r = 0; r < M; ++r) {
    const float* x = o + r * N;
    bool nan;
    const float mx = row_max(x, N, nan);
    const float thr = mx - (static_cast<float>(abs_scale) * am[r] + static_cast<float>(rel_margin) * std::fabs(mx));
    int64_t i = 0;
#if LOCALLLM_HAVE_NATIVE
    using V = VNative;
    for (; i + V::kLanes <= N; i += V::kLanes) {
      uint32_t mask = V::ge_bits(V::load(x + i), V::set(thr));
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
    // (the format a constant of each loop: an LM head's refined rows, Q6_K 2048 wide, 7.5 us a row
    // through fmt_weight's own dispatch)
    with_int_fmt(bits, [&](auto fmt) {
      constexpr int64_t F = decltype(fmt)::value;
      for (int64_t i = 0; i < m; ++i) {
        const int64_t t = id[i] / kTile, j = id[i] % kTile;
        for (int64_t sb = 0; sb < nsb; ++sb) {
          const uint8_t* sbp = wp + t * tile_bytes + sb * fi.sb_bytes();
          for (int64_t gi = 0; gi < GS; ++gi)
            for (int k = 0; k < kGroup; ++k)
              o[i * K + (sb * GS + gi) * kGroup + k] =
                  fmt_weight_as<F>(sbp, static_cast<int>(j), static_cast<int>(gi), k);
        }
      }
    });
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

// Per row of x [M, K] (float32), a bound on every output's error in qgemm(x, w, ..., passes) against
// x @ W.T, W the file's weights (NativeWeight.error_bound, where the terms are explained):
// (|e| max_row_norm + |x| max_scale_error + sum |xs_p xq_p| max_row_norm (passes K / 32 + 4) 2^-24) 1.001,
// e = x - sum_p xs_p xq_p the activation codes' error (the codes quantize_activations makes; the sum
// over the passes in float32, the norms in double), max_row_norm >= max_n |W_n| (>= every stored
// weight's magnitude) and max_scale_error >= max_n |W_n - stored w_n|. The last term is the
// float32 arithmetic's. For the formats without a min or offset (the 8-bit codes, Q4_0, Q5_0, Q6_K,
// Q3_K) it is a bound: each of the passes * K / 32 group terms (at most |xs_p xq_p| . |w| over its
// group) takes at most two roundings before it is added, and the sum one per term after it. Where
// a group adds its min's or offset's share apart (Q4_K, Q5_K, Q5_1, Q2_K, the 4-bit tiles: two or
// three additions, a share bounded by |xs_p xq_p| . dmin m rather than . |w|) it is not proven; it
// holds through max_row_norm's slack (|w_k| <= max_row_norm for every weight; error / bound at most
// 0.008 measured with exact activation codes, against 0.001 for Q6_K).
torch::Tensor qgemm_error_bounds(torch::Tensor x, int64_t passes, double max_row_norm, double max_scale_error) {
  const std::vector<torch::Tensor> codes = quantize_activations(x, passes);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  auto bounds = torch::empty({M}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* xq = codes[0].data_ptr<int8_t>();
  const float* xs = codes[1].data_ptr<float>();
  float* out = bounds.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    double err2 = 0.0, x2 = 0.0, coded_abs = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      float approx = 0.0f;
      for (int64_t p = 0; p < passes; ++p) {
        const float term = xs[(p * M + m) * G + k / kGroup] * static_cast<float>(xq[(p * M + m) * K + k]);
        approx += term;
        coded_abs += std::fabs(static_cast<double>(term));
      }
      const double v = xp[m * K + k], e = static_cast<double>(xp[m * K + k] - approx);
      err2 += e * e;
      x2 += v * v;
    }
    const double roundings = static_cast<double>(passes * G + 4) * std::ldexp(1.0, -24);
    out[m] = static_cast<float>(
        (std::sqrt(err2) * max_row_norm + std::sqrt(x2) * max_scale_error + coded_abs * max_row_norm * roundings) * 1.001);
  }
  return bounds;
}

// An LM head's top logits made exact: in each row r of out [M, N] (float32: x [M, K] times the packed
// weight w of format `bits` through qgemm), the outputs near_max selects (within abs_scale abs_margin[r]
// + rel_margin |max_r| of the row's maximum; its largest max_candidates where it selects more) are
// recomputed from the weight's rows as dequant_rows gives them (the file's values for the exact
// formats): sum_k x[r, k] w[c, k] in double, rounded to float32. Returns how many were recomputed.
int64_t refine_near_max(torch::Tensor out, torch::Tensor x, torch::Tensor w, int64_t bits, int64_t N, int64_t K,
                        torch::Tensor abs_margin, double rel_margin, int64_t max_candidates,
                        double abs_scale) {
  check_f32(x, "refine_near_max: x");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == N && x.dim() == 2 && x.size(0) == out.size(0) && x.size(1) == K,
              "refine_near_max: out must be [M, N] and x [M, K]");
  TORCH_CHECK(max_candidates > 0, "refine_near_max: max_candidates must be positive");
  const std::vector<torch::Tensor> near = near_max(out, abs_margin, rel_margin, abs_scale);
  const int64_t picked = near[0].numel();
  const int64_t* rows = near[0].data_ptr<int64_t>();
  const int64_t* cols = near[1].data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  std::vector<std::pair<int64_t, int64_t>> chosen;  // (row, col), rows in order
  for (int64_t i = 0; i < picked;) {
    int64_t j = i;
    while (j < picked && rows[j] == rows[i]) ++j;
    std::vector<int64_t> cs(cols + i, cols + j);
    if (j - i > max_candidates) {  // a flat row: its largest max_candidates (ties: the lower column)
      const float* row = o + rows[i] * N;
      std::partial_sort(cs.begin(), cs.begin() + max_candidates, cs.end(), [&](int64_t a, int64_t b) {
        return row[a] > row[b] || (row[a] == row[b] && a < b);
      });
      cs.resize(max_candidates);
    }
    for (int64_t c : cs) chosen.emplace_back(rows[i], c);
    i = j;
  }
  if (chosen.empty()) return 0;
  std::vector<int64_t> ids;
  for (const auto& rc : chosen) ids.push_back(rc.second);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  auto id_tensor = torch::empty({static_cast<int64_t>(ids.size())}, torch::TensorOptions().dtype(torch::kInt64));
  std::memcpy(id_tensor.data_ptr<int64_t>(), ids.data(), ids.size() * sizeof(int64_t));
  const torch::Tensor weights = dequant_rows(w, bits, N, K, id_tensor);
  const float* wr = weights.data_ptr<float>();
  const torch::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  for (const auto& rc : chosen) {
    const int64_t u = std::lower_bound(ids.begin(), ids.end(), rc.second) - ids.begin();
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k) sum += static_cast<double>(xp[rc.first * K + k]) * wr[u * K + k];
    o[rc.first * N + rc.second] = static_cast<float>(sum);
  }
  return static_cast<int64_t>(chosen.size());
}

// An LM head's logits with each row's top ones exact: qgemm of x [M, K] through w, then
// refine_near_max from the weight's exact rows (rows_w, rows_bits: w itself where it holds the file's
// values, else the file's F16/BF16 rows) of the outputs within abs_scale times qgemm_error_bounds' bound
// and rel_margin of their row's maximum. The same three calls as from Python, so the same bits, in one
// (SmolLM2's decode step, the head's Python and tensors outside the kernels: 80 -> 60 us, cold).
torch::Tensor refined_logits(torch::Tensor x, torch::Tensor w, int64_t bits, int64_t N, int64_t K, int64_t passes,
                             double max_row_norm, double max_scale_error, torch::Tensor rows_w, int64_t rows_bits,
                             double rel_margin, int64_t max_candidates, double abs_scale) {
  check_f32(x, "refined_logits: x");
  torch::Tensor out = qgemm(x, w, bits, N, K, passes, c10::nullopt);
  const torch::Tensor bounds = qgemm_error_bounds(x, passes, max_row_norm, max_scale_error);
  refine_near_max(out, x, rows_w, rows_bits, N, K, bounds, rel_margin, max_candidates, abs_scale);
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
  m.def("qgemm", &qgemm, "quantized matmul (see cpu_kernels.cpp)", py::arg("x"), py::arg("w"), py::arg("bits"),
        py::arg("N"), py::arg("K"), py::arg("passes"), py::arg("order") = py::none(), nogil);
  m.def("qgemm_parts", &qgemm_parts, "several quantized matmuls of one input width, outputs side by side", nogil);
  m.def("quantize_activations", &quantize_activations, "int8 activation codes per 32-group", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm, float32", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x), float32", nogil);
  m.def("rope_write_kv", &rope_write_kv, "RoPE on a fused qkv; k/v into the paged cache; returns q", nogil);
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up", nogil);
  py::class_<HeldLayer, std::shared_ptr<HeldLayer>>(m, "HeldLayer", "a decoder layer's weights and shapes, held")
      .def(py::init<torch::Tensor, std::vector<torch::Tensor>, std::vector<int64_t>, c10::optional<torch::Tensor>,
                    torch::Tensor, int64_t, torch::Tensor, std::vector<torch::Tensor>, std::vector<int64_t>,
                    torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t,
                    std::vector<c10::optional<torch::Tensor>>>())
      .def_readonly("passes", &HeldLayer::passes);
  m.def("decoder_layer", &decoder_layer, "a whole decoder layer for a decode-only step", nogil);
  py::class_<HeldLayers, std::shared_ptr<HeldLayers>>(m, "HeldLayers",
                                                      "a model's held layers bound to their KV caches, RoPE and norm")
      .def(py::init<std::vector<std::shared_ptr<HeldLayer>>, torch::Tensor, torch::Tensor, bool, std::vector<torch::Tensor>,
                    c10::optional<torch::Tensor>, double>(),
           py::arg("layers"), py::arg("cos"), py::arg("sin"), py::arg("neox"), py::arg("kv_caches"),
           py::arg("norm") = py::none(), py::arg("norm_eps") = 0.0)
      .def_readonly("layers", &HeldLayers::layers);
  m.def("decoder_layers", &decoder_layers, "every decoder layer of a decode-only step, one after the other", py::arg("h"),
        py::arg("bound"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"),
        py::arg("context_lens"), nogil);
  m.def("dequant_rows", &dequant_rows, "rows of a packed weight, dequantized to float32", nogil);
  m.def("refined_logits", &refined_logits, "an LM head's logits, each row's top ones recomputed exactly",
        py::arg("x"), py::arg("w"), py::arg("bits"), py::arg("n"), py::arg("k"), py::arg("passes"),
        py::arg("max_row_norm"), py::arg("max_scale_error"), py::arg("rows_w"), py::arg("rows_bits"),
        py::arg("rel_margin"), py::arg("max_candidates"), py::arg("abs_scale"), nogil);
  m.def("stream_read", &stream_read, "xor of every byte of a uint8 tensor, read once on all threads", nogil);
  m.def("greedy_rows", &greedy_rows, "each row's first largest entry, and whether the row can be sampled", nogil);
  m.def("near_max", &near_max, "(rows, cols) of the entries within a margin of their row's maximum", py::arg("out"),
        py::arg("abs_margin"), py::arg("rel_margin"), py::arg("abs_scale") = 1.0, nogil);
  m.def("qgemm_error_bounds", &qgemm_error_bounds, "per row, a bound on qgemm's output error", nogil);
  m.def("refine_near_max", &refine_near_max, "an LM head's logits near each row's maximum, recomputed from the weight",
        py::arg("out"), py::arg("x"), py::arg("w"), py::arg("bits"), py::arg("n"), py::arg("k"), py::arg("abs_margin"),
        py::arg("rel_margin"), py::arg("max_candidates"), py::arg("abs_scale") = 1.0, nogil);
}