// The activations as the integer kernels read them: quantized per row and 32-group to int8
// (quantize_rows), in the blocked layout of ActRows.
#pragma once

namespace {

#if LOCALLLM_HAVE_NATIVE

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

}  // namespace
