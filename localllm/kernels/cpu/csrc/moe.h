// A mixture-of-experts layer in native code: the router (its float32 logits and the choice of each
// token's experts) and the experts, the step's tokens grouped by expert, each expert's weights read
// once for all the tokens routed to it. The op-by-op route (moe_route, moe_experts) and the
// one-call layer (layers.h) run the same functions, so they give the same bits.
#pragma once

namespace {

// MoeConfig.gating's kinds, in the order of models/config.py's GATINGS.
constexpr int64_t kGateSoftmax = 0;        // a softmax over all experts, the top ones kept
constexpr int64_t kGateSoftmaxWeight = 1;  // the top logits kept, a softmax over them alone (gpt-oss)

// One token's routing from its router logits [E]: its k experts by descending weight into ids, their
// weights into w (probs: scratch of E floats). Ties go to the lower expert index. With norm the kept
// weights are divided by their sum (added in rank order, at least 2^-14); scale multiplies them (1:
// not at all).
inline void route_row(const float* logits, int64_t E, int64_t k, int64_t gating, bool norm, float scale, int64_t* ids,
                      float* w, float* probs) {
  const float* score = logits;
  if (gating == kGateSoftmax) {
    float m = logits[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, logits[e]);
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += probs[e] = std::exp(logits[e] - m);
    for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    score = probs;
  }
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || ids[i] == e;
      if (!taken && (best < 0 || score[e] > score[best])) best = e;
    }
    ids[j] = best;
    w[j] = score[best];
  }
  if (gating == kGateSoftmaxWeight) {  // (the first kept logit is the largest)
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += w[j] = std::exp(logits[ids[j]] - logits[ids[0]]);
    for (int64_t j = 0; j < k; ++j) w[j] /= sum;
  }
  if (norm) {  // (the sum kept from zero as llama.cpp keeps it: decoder.py's MIN_WEIGHTS_SUM)
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += w[j];
    sum = std::max(sum, 6.103515625e-5f);
    for (int64_t j = 0; j < k; ++j) w[j] /= sum;
  }
  if (scale != 1.0f)
    for (int64_t j = 0; j < k; ++j) w[j] *= scale;
}

#if LOCALLLM_HAVE_NATIVE
// rows[r, :] += bias for the `count` rows of `width` floats at rows (a product, then a sum: the
// expert-by-expert route's `out += bias`, the same bits).
inline void add_bias_rows(float* rows, int64_t count, int64_t width, const float* bias) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t i = 0; i < width; ++i) rows[r * width + i] += bias[i];
}

// The rows x [T, H] through the router (float32 [E, H]): each token's experts and weights (route_row),
// each logit a dot product of its own (the same bits whatever the batch).
void route_rows(const float* x, int64_t T, int64_t H, const float* router, int64_t E, int64_t k, int64_t gating,
                bool norm, float scale, int64_t* ids, float* w) {
  std::vector<float> logits(static_cast<size_t>(T * E));
  at::parallel_for(0, T * E, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) logits[i] = dot<VNative>(x + (i / E) * H, router + (i % E) * H, H);
  });
  std::vector<float> probs(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t)
    route_row(&logits[t * E], E, k, gating, norm, scale, ids + t * k, w + t * k, probs.data());
}

// One expert's share of a stage: its rows (quantized), its weight and where its outputs go.
struct ExpertPart {
  QuantizedRows rows;
  const uint8_t* w;
  float* y;  // the expert's first output row (ldy floats apart)
};

// Every part's tiles (each weight `Np` rows of tiles, `K` wide) in one parallel region: the tiles of
// part 0, then part 1's, ... chunked as one weight of their total size would be (as matmul_parts_into).
void expert_tiles(std::vector<ExpertPart>& parts, int64_t bits, int64_t passes, int64_t Np, int64_t K, int64_t ldy,
                  int64_t max_rows) {
  const int64_t per_part = Np / kTile, tiles = per_part * static_cast<int64_t>(parts.size());
  const int64_t chunk = tile_chunk(tiles, fmt_packed_bytes(bits, kTile, K), max_rows);
  parallel_chunks(tiles, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const ExpertPart& p = parts[s / per_part];
      weight_tile(bits, passes, p.w, ldy, K, p.rows, p.y, s % per_part);
    }
  });
}

// The experts' activation: silu(gate) * up, or gpt-oss's clamped SwiGLU (swiglu_oai_rows) with its
// alpha and limit.
struct ExpertActivation {
  bool oai = false;
  float alpha = 0.0f, limit = 0.0f;
};

// The experts of one layer for the rows x [T, H] into out [T, H]: token t goes through experts
// ids[t, 0..k) and gets sum_j w[t, j] * expert_j(x[t]), the products added in j's order (each
// token's own routing order, whatever its batch). Expert e is down_e(act(gate_e(x), up_e(x))):
// gate_up[e] its gate and up weights packed together ([2 I, H], gate's rows first, format
// gate_up_bits), down[e] ([H, I], format down_bits); gate_up_bias [E, 2 I] and down_bias [E, H]
// (float32, or null) added to each expert's outputs of those weights before what follows them
// (gpt-oss's experts have both). Each expert's rows go through the same kernels as qgemm, the
// bias's add and silu_mul or swiglu_oai_mul, which compute every row alone, so a token's output
// has the same bits whichever tokens share its step and its experts, and those of the layer's
// experts run one by one.
void moe_rows(const float* x, int64_t T, int64_t H, const int64_t* ids, const float* w, int64_t k, int64_t E,
              const std::vector<const uint8_t*>& gate_up, int64_t gate_up_bits, const std::vector<const uint8_t*>& down,
              int64_t down_bits, int64_t I, int64_t passes, float* out, const float* gate_up_bias = nullptr,
              const float* down_bias = nullptr, ExpertActivation act = {}) {
  // each (token, rank) slot's place among its expert's rows: the slots by expert, then by slot
  std::vector<int64_t> count(E, 0), first(E + 1, 0), row_of(T * k);
  for (int64_t s = 0; s < T * k; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "moe_experts: expert index out of range");
    ++count[ids[s]];
  }
  for (int64_t e = 0; e < E; ++e) first[e + 1] = first[e] + count[e];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t s = 0; s < T * k; ++s) row_of[s] = next[ids[s]]++;
  std::vector<float> gathered(static_cast<size_t>(T * k * H)), gu(static_cast<size_t>(T * k * 2 * I)),
      acts(static_cast<size_t>(T * k * I)), outs(static_cast<size_t>(T * k * H));
  for (int64_t s = 0; s < T * k; ++s) std::memcpy(&gathered[row_of[s] * H], x + (s / k) * H, H * sizeof(float));
  int64_t max_rows = 0;
  std::vector<ExpertPart> stage;
  for (int64_t e = 0; e < E; ++e) {
    if (!count[e]) continue;
    max_rows = std::max(max_rows, count[e]);
    stage.push_back({quantize_input(&gathered[first[e] * H], count[e], H, passes, half_sums(gate_up_bits)), gate_up[e],
                     &gu[first[e] * 2 * I]});
  }
  expert_tiles(stage, gate_up_bits, passes, 2 * I, H, 2 * I, max_rows);
  if (gate_up_bias != nullptr)
    for (int64_t e = 0; e < E; ++e) add_bias_rows(&gu[first[e] * 2 * I], count[e], 2 * I, gate_up_bias + e * 2 * I);
  if (act.oai) swiglu_oai_rows<VNative>(gu.data(), T * k, I, act.alpha, act.limit, acts.data());
  else silu_rows<VNative>(gu.data(), T * k, I, acts.data());
  stage.clear();
  for (int64_t e = 0; e < E; ++e) {
    if (!count[e]) continue;
    stage.push_back({quantize_input(&acts[first[e] * I], count[e], I, passes, half_sums(down_bits)), down[e],
                     &outs[first[e] * H]});
  }
  expert_tiles(stage, down_bits, passes, H, I, H, max_rows);
  if (down_bias != nullptr)
    for (int64_t e = 0; e < E; ++e) add_bias_rows(&outs[first[e] * H], count[e], H, down_bias + e * H);
  // a product, then a sum, each rounded (two loops: a multiply-add would round once), as the
  // layer's expert-by-expert route adds them: the two routes give the same bits
  std::vector<float> product(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    float* y = out + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const float* d = &outs[row_of[t * k + j] * H];
      const float wj = w[t * k + j];
      float* into = j == 0 ? y : product.data();
      for (int64_t h = 0; h < H; ++h) into[h] = d[h] * wj;
      if (j > 0)
        for (int64_t h = 0; h < H; ++h) y[h] = y[h] + product[h];
    }
  }
}
#endif

// Each expert's gate_up [2 I, H] and down [H, I] weights checked (tiled formats, widths multiples of
// 16, one of each per expert) and their bytes' addresses, (gate_up, down).
std::pair<std::vector<const uint8_t*>, std::vector<const uint8_t*>> expert_weights(
    const std::vector<torch::Tensor>& gate_up, int64_t gate_up_bits, const std::vector<torch::Tensor>& down,
    int64_t down_bits, int64_t I, int64_t H, int64_t passes, const char* who) {
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), who, ": one gate_up and one down weight per expert");
  TORCH_CHECK((is_tile_fmt(gate_up_bits) || is_int_fmt(gate_up_bits)) && (is_tile_fmt(down_bits) || is_int_fmt(down_bits)),
              who, ": the experts' weights must be in tiled formats");
  TORCH_CHECK(I > 0 && I % kTile == 0 && H % kTile == 0, who, ": widths must be multiples of 16");
  std::vector<const uint8_t*> gate_up_ptrs, down_ptrs;
  for (size_t e = 0; e < gate_up.size(); ++e) {
    check_weight(gate_up[e], gate_up_bits, 2 * I, H, passes);
    check_weight(down[e], down_bits, H, I, passes);
    gate_up_ptrs.push_back(gate_up[e].data_ptr<uint8_t>());
    down_ptrs.push_back(down[e].data_ptr<uint8_t>());
  }
  return {gate_up_ptrs, down_ptrs};
}

// A layer's router and experts as the one-call layer holds them (checked once, here): the router
// float32 [E, H], each expert's gate_up [2 I, H] and down [H, I] in the formats given, the routing's
// k, gating kind, norm and scale.
struct HeldMoe {
  torch::Tensor router;
  std::vector<torch::Tensor> gate_up, down;  // (kept alive: the pointers below are into them)
  std::vector<const uint8_t*> gate_up_ptrs, down_ptrs;
  int64_t gate_up_bits, down_bits, inter, k, gating;
  bool norm;
  double scale;

  HeldMoe(torch::Tensor router_, std::vector<torch::Tensor> gate_up_, int64_t gate_up_bits_,
          std::vector<torch::Tensor> down_, int64_t down_bits_, int64_t inter_, int64_t k_, int64_t gating_, bool norm_,
          double scale_, int64_t passes)
      : router(std::move(router_)), gate_up(std::move(gate_up_)), down(std::move(down_)), gate_up_bits(gate_up_bits_),
        down_bits(down_bits_), inter(inter_), k(k_), gating(gating_), norm(norm_), scale(scale_) {
    check_f32(router, "moe: router");
    TORCH_CHECK(router.dim() == 2 && router.size(1) % kTile == 0, "moe: the router must be [experts, hidden]");
    const int64_t E = router.size(0), H = router.size(1);
    TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == E, "moe: one expert per router row");
    TORCH_CHECK(0 < k && k <= E, "moe: experts per token out of range");
    TORCH_CHECK(gating == kGateSoftmax || gating == kGateSoftmaxWeight, "moe: unknown gating kind");
    std::tie(gate_up_ptrs, down_ptrs) = expert_weights(gate_up, gate_up_bits, down, down_bits, inter, H, passes, "moe");
  }
  int64_t experts() const { return router.size(0); }
};

// Each row of x [T, H] (float32)'s experts through the router (float32 [E, H]): (weights float32
// [T, k], experts int64 [T, k]), by descending weight (route_row).
std::vector<torch::Tensor> moe_route(torch::Tensor x, torch::Tensor router, int64_t k, int64_t gating, bool norm,
                                     double scale) {
  check_f32(x, "moe_route: x");
  check_f32(router, "moe_route: router");
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && x.size(1) == router.size(1) && x.size(1) % kTile == 0,
              "moe_route: x [T, H] and the router [E, H], H a multiple of 16");
  const int64_t T = x.size(0), H = x.size(1), E = router.size(0);
  TORCH_CHECK(0 < k && k <= E, "moe_route: experts per token out of range");
  TORCH_CHECK(gating == kGateSoftmax || gating == kGateSoftmaxWeight, "moe_route: unknown gating kind");
  auto weights = torch::empty({T, k}, x.options());
  auto chosen = torch::empty({T, k}, x.options().dtype(torch::kInt64));
#if LOCALLLM_HAVE_NATIVE
  route_rows(x.data_ptr<float>(), T, H, router.data_ptr<float>(), E, k, gating, norm, static_cast<float>(scale),
             chosen.data_ptr<int64_t>(), weights.data_ptr<float>());
#endif
  return {weights, chosen};
}

// The experts of one mixture-of-experts layer for the rows x [T, H] (float32): moe_rows, with
// chosen int64 [T, k] and weights float32 [T, k]; act "silu" or "swiglu_oai" (with alpha and limit),
// the biases optional.
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor chosen, torch::Tensor weights, std::vector<torch::Tensor> gate_up,
                          int64_t gate_up_bits, std::vector<torch::Tensor> down, int64_t down_bits, int64_t I,
                          int64_t passes, c10::optional<torch::Tensor> gate_up_bias, c10::optional<torch::Tensor> down_bias,
                          const std::string& act, double alpha, double limit) {
  check_f32(x, "moe_experts: x");
  check_f32(weights, "moe_experts: weights");
  TORCH_CHECK(x.dim() == 2, "moe_experts: x must be [T, H]");
  const int64_t T = x.size(0), H = x.size(1), E = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(chosen.scalar_type() == torch::kInt64 && chosen.is_contiguous() && chosen.dim() == 2 && chosen.size(0) == T,
              "moe_experts: chosen must be contiguous int64 [T, k]");
  const int64_t k = chosen.size(1);
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == T && weights.size(1) == k, "moe_experts: weights must be [T, k]");
  const auto [gate_up_ptrs, down_ptrs] = expert_weights(gate_up, gate_up_bits, down, down_bits, I, H, passes, "moe_experts");
  TORCH_CHECK(act == "silu" || act == "swiglu_oai", "moe_experts: act must be silu or swiglu_oai");
  if (gate_up_bias) {
    check_f32(*gate_up_bias, "moe_experts: gate_up_bias");
    TORCH_CHECK(gate_up_bias->numel() == E * 2 * I, "moe_experts: gate_up_bias must be [E, 2 I]");
  }
  if (down_bias) {
    check_f32(*down_bias, "moe_experts: down_bias");
    TORCH_CHECK(down_bias->numel() == E * H, "moe_experts: down_bias must be [E, H]");
  }
  auto out = torch::empty({T, H}, x.options());
#if LOCALLLM_HAVE_NATIVE
  moe_rows(x.data_ptr<float>(), T, H, chosen.data_ptr<int64_t>(), weights.data_ptr<float>(), k, E, gate_up_ptrs,
           gate_up_bits, down_ptrs, down_bits, I, passes, out.data_ptr<float>(),
           gate_up_bias ? gate_up_bias->data_ptr<float>() : nullptr, down_bias ? down_bias->data_ptr<float>() : nullptr,
           {act == "swiglu_oai", static_cast<float>(alpha), static_cast<float>(limit)});
#endif
  return out;
}

}  // namespace
