// A mixture-of-experts layer's experts in one call: the step's tokens grouped by expert, each
// expert's weights read once for all the tokens routed to it.
#pragma once

namespace {

#if LOCALLLM_HAVE_NATIVE
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
#endif

#if LOCALLLM_HAVE_NATIVE
// rows[r, :] += bias for the `count` rows of `width` floats at rows (a product, then a sum: the
// expert-by-expert route's `out += bias`, the same bits).
inline void add_bias_rows(float* rows, int64_t count, int64_t width, const float* bias) {
  for (int64_t r = 0; r < count; ++r)
    for (int64_t i = 0; i < width; ++i) rows[r * width + i] += bias[i];
}
#endif

// The experts of one mixture-of-experts layer for the rows x [T, H] (float32): token t goes through
// experts chosen[t, 0..k) (int64) and gets sum_j weights[t, j] * expert_j(x[t]), the products added
// in j's order (each token's own routing order, whatever its batch). Expert e is
// down_e(act(gate_e(x), up_e(x))): gate_up[e] its gate and up weights packed together ([2 I, H],
// gate's rows first, format gate_up_bits), down[e] ([H, I], format down_bits); I a multiple of 16;
// act "silu" (silu(gate) * up) or "swiglu_oai" (gpt-oss's clamped SwiGLU with alpha and limit:
// swiglu_oai_rows); gate_up_bias [E, 2 I] and down_bias [E, H] (float32, optional) added to each
// expert's outputs of those weights before what follows them (gpt-oss's experts have both).
// Each expert's rows go through the same kernels as qgemm, the bias's add and silu_mul or
// swiglu_oai_mul, which compute every row alone, so a token's output has the same bits whichever
// tokens share its step and its experts, and those of the layer's experts run one by one.
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
  TORCH_CHECK(E > 0 && static_cast<int64_t>(down.size()) == E, "moe_experts: one gate_up and one down weight per expert");
  TORCH_CHECK((is_tile_fmt(gate_up_bits) || is_int_fmt(gate_up_bits)) && (is_tile_fmt(down_bits) || is_int_fmt(down_bits)),
              "moe_experts: the weights must be in tiled formats");
  TORCH_CHECK(I > 0 && I % kTile == 0 && H % kTile == 0, "moe_experts: widths must be multiples of 16");
  for (int64_t e = 0; e < E; ++e) {
    check_weight(gate_up[e], gate_up_bits, 2 * I, H, passes);
    check_weight(down[e], down_bits, H, I, passes);
  }
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
  const int64_t* ids = chosen.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
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
  for (int64_t s = 0; s < T * k; ++s) std::memcpy(&gathered[row_of[s] * H], xp + (s / k) * H, H * sizeof(float));
  int64_t max_rows = 0;
  std::vector<ExpertPart> stage;
  for (int64_t e = 0; e < E; ++e) {
    if (!count[e]) continue;
    max_rows = std::max(max_rows, count[e]);
    stage.push_back({quantize_input(&gathered[first[e] * H], count[e], H, passes, half_sums(gate_up_bits)),
                     gate_up[e].data_ptr<uint8_t>(), &gu[first[e] * 2 * I]});
  }
  expert_tiles(stage, gate_up_bits, passes, 2 * I, H, 2 * I, max_rows);
  if (gate_up_bias) {
    const float* b = gate_up_bias->data_ptr<float>();
    for (int64_t e = 0; e < E; ++e) add_bias_rows(&gu[first[e] * 2 * I], count[e], 2 * I, b + e * 2 * I);
  }
  if (act == "silu") {
    silu_rows<VNative>(gu.data(), T * k, I, acts.data());
  } else {
    swiglu_oai_rows<VNative>(gu.data(), T * k, I, static_cast<float>(alpha), static_cast<float>(limit), acts.data());
  }
  stage.clear();
  for (int64_t e = 0; e < E; ++e) {
    if (!count[e]) continue;
    stage.push_back({quantize_input(&acts[first[e] * I], count[e], I, passes, half_sums(down_bits)),
                     down[e].data_ptr<uint8_t>(), &outs[first[e] * H]});
  }
  expert_tiles(stage, down_bits, passes, H, I, H, max_rows);
  if (down_bias) {
    const float* b = down_bias->data_ptr<float>();
    for (int64_t e = 0; e < E; ++e) add_bias_rows(&outs[first[e] * H], count[e], H, b + e * H);
  }
  // a product, then a sum, each rounded (two loops: a multiply-add would round once), as the
  // layer's expert-by-expert route adds them: the two routes give the same bits
  float* op = out.data_ptr<float>();
  std::vector<float> product(static_cast<size_t>(H));
  for (int64_t t = 0; t < T; ++t) {
    float* y = op + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const float* d = &outs[row_of[t * k + j] * H];
      const float wj = w[t * k + j];
      float* into = j == 0 ? y : product.data();
      for (int64_t h = 0; h < H; ++h) into[h] = d[h] * wj;
      if (j > 0)
        for (int64_t h = 0; h < H; ++h) y[h] = y[h] + product[h];
    }
  }
#endif
  return out;
}

}  // namespace
