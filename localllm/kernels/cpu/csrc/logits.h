// An LM head's logits: greedy picks, the entries near each row's maximum, the packed weight's rows
// and the error bounds by which the top logits are recomputed exactly.
#pragma once

namespace {

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

// Rows ids [m] of a packed weight (formats.h), dequantized: float32 [m, K], the file's values for
// the exact formats.
torch::Tensor dequant_rows(torch::Tensor w, int64_t bits, int64_t N, int64_t K, torch::Tensor ids) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "dequant_rows: w must be contiguous uint8");
  TORCH_CHECK(is_fmt(bits), "dequant_rows: bits must be 4 or 8 or a format id");
  TORCH_CHECK(lattice_ready(bits), "dequant_rows: the lattice format's grid is not set (set_lattice_grid)");
  TORCH_CHECK(K % kGroup == 0 && (!is_int_fmt(bits) || K % fmt_info(bits).sb == 0), "dequant_rows: bad K");
  TORCH_CHECK(w.numel() == fmt_packed_bytes(bits, N, K), "dequant_rows: packed size mismatch");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64, "dequant_rows: ids must be int64");
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
  const FmtInfo fi = fmt_info(bits);
  const int64_t nsb = K / fi.sb, GS = fi.sb / kGroup, tile_bytes = nsb * fi.sb_bytes();
  // (the format a constant of each loop: an LM head's refined rows, Q6_K 2048 wide, 7.5 us a row
  // through fmt_weight's own dispatch)
  with_tiled_fmt(bits, [&](auto fmt) {
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

}  // namespace
