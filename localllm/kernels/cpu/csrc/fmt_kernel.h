// The integer kernel of every tiled format, a template over the vector width and the format
// (Format<F>: fmt_legacy.h, fmt_kquants.h, fmt_codebook.h), and its per-format tuning of the one-row (decode) reads.
#pragma once

namespace {

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
// A build for a CPU whose cores need the software's prefetches for every format (Intel's: see
// native.py's INTEL_WEIGHT_PREFETCH) sets one distance for all of them, LOCALLLM_WEIGHT_AHEAD. A
// build for a CPU whose cores need them for the K-quants' AVX-512 codes-first kernels alone (Zen 5's:
// see native.py's KQUANT_WEIGHT_PREFETCH) sets theirs, LOCALLLM_KQUANT_AHEAD.
#ifndef LOCALLLM_KQUANT_AHEAD
#define LOCALLLM_KQUANT_AHEAD 0
#endif
constexpr int64_t one_row_ahead(int64_t f, int lanes) {
#ifdef LOCALLLM_WEIGHT_AHEAD
  (void)f, (void)lanes;
  return LOCALLLM_WEIGHT_AHEAD;
#endif
  const bool nibbles = f == kFmtQ4 || f == kFmtQ4_0;
  if (one_row_codes_first(f, lanes)) return lanes == 16 && fmt_info(f).sb > kGroup ? LOCALLLM_KQUANT_AHEAD : 0;
  if (lanes == 16) return nibbles || f == kFmtQ8 || f == kFmtQ5_0 ? 0 : kStreamAhead;
  return nibbles ? 0 : kStreamAhead;
}

// Whether the one-row kernel of format f at a vector width asks for its next window of activations
// (prefetch_row_window): where the hardware's prefetchers alone stream the weight, but not for the
// 8-bit tiles, which it slowed (2048x8192 beyond L3, 1 thread, Zen 4, median GB/s of 9 interleaved
// rounds, without / with: 23.5 / 21.7). Where the weight's bytes are asked for ahead, the
// activations' lines asked for besides slowed AVX2's Q4_K (24.4 -> 20.3) and Q5_K (22.8 -> 16.5).
constexpr bool asks_row_window(int64_t f, int lanes) { return one_row_ahead(f, lanes) == 0 && f != kFmtQ8; }

namespace fmt {

// The 8 code vectors c[v] (the rows of register H of each 64-byte tile vector, k = 4v..4v+3,
// one byte each) of the group at cb (kAffine: see V512::field): the format's decoder.
template <int Fmt, class V, bool kAffine>
LOCALLLM_STEP void decode(const uint8_t* cb, int H, typename V::I* c) {
  Format<Fmt>::template decode<V, kAffine>(cb, V::kBytes * H, c);
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
  using Fo = Format<Fmt>;
  constexpr int NF = Fo::kFactors;
  constexpr bool kWholeSums = Fo::kWholeSums;
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
    if constexpr (Fo::kCentered) {
      S0 = V::centered_dot8(c, xg, sum_x(ig, 0)), S1 = S0;
      return;
    } else if constexpr (value_bits(Fmt) == 8 && !V::kByteProducts) {
      // (AVX2: the codebook and lattice formats' 8-bit values multiply as signed ones, the offset's
      // share in them, each half's sum apart)
      S0 = V::i32(0), S1 = S0;
      V::signed_isums(c, xg, S0, S1);
      return;
    } else if constexpr (code_offset(Fmt) == 0) {
      S0 = V::i32(0), S1 = S0;
    } else if constexpr (Fo::kHalfScales) {  // (a sub-scale per half)
      S0 = V::i32(-code_offset(Fmt) * sum_x(ig, 0)), S1 = V::i32(-code_offset(Fmt) * sum_x(ig, 1));
    } else {
      S0 = V::i32(-code_offset(Fmt) * (sum_x(ig, 0) + sum_x(ig, 1))), S1 = V::i32(0);
    }
    V::template isums<Fmt>(c, xg, S0, S1);
  };
  // Group gi's float factors for the rows of register H (Format::factors; the tile's table kept
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
        Fo::template factors<V>(scp, gi, H, D, Z, fac);
        if constexpr (kSource == kFormedKept)
          for (int v = 0; v < NF; ++v) V::store(factor_at(factors, g, NF, v) + R * H, fac[v]);
      }
    }
    // (Q4_K, Q5_K: d sc, dmin m; Q6_K, Q3_K: d sc per half; Q2_K: both per half)
    Factors f;
    f.dsc = NF ? fac[0] : D, f.dsc1 = f.dsc, f.mmin = f.dsc, f.mmin1 = f.dsc;
    if constexpr (Fo::kShare == Share::kMin) {
      f.mmin = fac[1];
    } else if constexpr (Fo::kShare == Share::kHalfMins) {
      f.dsc1 = fac[1], f.mmin = fac[2], f.mmin1 = fac[3];
    } else if constexpr (Fo::kHalfScales) {
      f.dsc1 = fac[1];
    }
    return f;
  };
  // The float part: one row's sums of group g and pass p, scaled, into its accumulator (Z: the
  // offsets' z of the tiles, Q5_1).
  const auto accumulate = [&](F& out, const Factors& f, F Z, int p, int64_t g, int i, I S0, I S1) {
    const int64_t ig = at_of(p, g, i);
    const float sx = a.xs[ig];
    const F dx = V::fmul(f.dsc, V::set(sx));  // (d, or Q4_K's and Q5_K's d sc) xs
    if constexpr (Fo::kHalfScales) {  // a sub-scale per half
      const F t0 = V::fmul(V::cvt(S0), f.dsc);  // (the offsets' terms are in S0, S1: see int_sums)
      const F t = V::fma(V::cvt(S1), f.dsc1, t0);
      out = V::fma(t, V::set(sx), out);
    } else {
      I Ti;
      if constexpr (Fo::kCentered) {
        Ti = S0;
      } else {  // Q5_0, Q4_0 (offset terms in S0), Q5_1, Q4, Q5_K, Q4_K (the last two: times d sc in dx)
        Ti = V::add(S0, S1);
      }
      out = V::fma(V::cvt(Ti), dx, out);
    }
    // (X0 + X1 = xsum: a.xsx[ig] = sx * float(X0 + X1), formed as the codes were)
    if constexpr (Fo::kShare == Share::kZ) {
      out = V::fma(Z, V::set(a.xsx[ig]), out);
    } else if constexpr (Fo::kShare == Share::kMin) {
      out = V::fnma(f.mmin, V::set(a.xsx[ig]), out);
    } else if constexpr (Fo::kShare == Share::kHalfMins) {
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
            D[h] = fi.d ? V::half(dp + 2 * R * (H0 + h)) : V::zero();
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

// Whether a format's codes take more than one plane or field split to decode (the integer formats
// but the nibbles': 5-, 6-, 3- and 2-bit codes): more work per tile vector to share among the
// activation rows of a call.
constexpr bool costly_decode(int64_t f) { return is_int_fmt(f) && code_bits(f) != 4; }

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
  constexpr int NF = Format<Fmt>::kFactors;
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

}  // namespace fmt
#endif  // LOCALLLM_HAVE_NATIVE

}  // namespace
