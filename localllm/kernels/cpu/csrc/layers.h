// Whole decoder layers in one call: their weights held once (HeldLayer), every step's ops in order
// from the calling thread's scratch memory.
#pragma once

namespace {

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
// (input_order) and read by every step through orders. rotate false: a layer without RoPE (its q
// and k as projected); q_scale (float32 [positions], optional): each rotated query row multiplied
// by the entry of its position (llama 4's attention temperature). The weights, norms, bias and
// q_scale are checked here. set_qk_norm gives the per-head norms of the queries and keys (Qwen3),
// applied to each head's row of the projection's output before RoPE. A mixture of experts in place
// of the MLP: no gate/up weight (and an empty down), then set_moe.
struct HeldLayer {
  torch::Tensor input_norm, post_norm;
  c10::optional<torch::Tensor> qkv_bias;
  int64_t H, nh, nkv, hd, inter;
  double eps, scale;
  int64_t passes;
  std::vector<c10::optional<torch::Tensor>> perms;
  std::vector<const int32_t*> orders;  // perms' entries (null: none), or empty
  HeldProjection qkv, o, gate_up, down;
  bool rotate;
  c10::optional<torch::Tensor> q_scale;
  c10::optional<torch::Tensor> q_norm, k_norm;  // [hd] each, or none
  double qk_eps = 0.0;
  std::shared_ptr<HeldMoe> moe;  // the experts in place of the MLP, or none

  HeldLayer(torch::Tensor input_norm, std::vector<torch::Tensor> qkv_ws, std::vector<int64_t> qkv_bits,
            c10::optional<torch::Tensor> qkv_bias, torch::Tensor o_w, int64_t o_bits, torch::Tensor post_norm,
            std::vector<torch::Tensor> gate_up_ws, std::vector<int64_t> gate_up_bits, torch::Tensor down_w,
            int64_t down_bits, int64_t nh, int64_t nkv, int64_t hd, int64_t inter, double eps, double scale,
            int64_t passes, std::vector<c10::optional<torch::Tensor>> perms, bool rotate,
            c10::optional<torch::Tensor> q_scale)
      : input_norm(std::move(input_norm)), post_norm(std::move(post_norm)), qkv_bias(std::move(qkv_bias)),
        H(this->input_norm.numel()), nh(nh), nkv(nkv), hd(hd), inter(inter), eps(eps), scale(scale), passes(passes),
        perms(std::move(perms)), rotate(rotate), q_scale(std::move(q_scale)) {
    if (this->q_scale.has_value()) {
      check_f32(*this->q_scale, "decoder_layer: q_scale");
      TORCH_CHECK(this->q_scale->dim() == 1, "decoder_layer: q_scale: one factor per position");
    }
    const size_t nq = qkv_ws.size(), ng = gate_up_ws.size();
    TORCH_CHECK((nq == 1 || nq == 3) && qkv_bits.size() == nq, "decoder_layer: q/k/v weights: one fused or three");
    TORCH_CHECK(ng <= 2 && gate_up_bits.size() == ng, "decoder_layer: gate/up weights: one fused, two or none");
    TORCH_CHECK(this->perms.empty() || (ng > 0 && this->perms.size() == nq + ng + 2),
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
    if (ng > 0) {  // (none: set_moe follows)
      gate_up = HeldProjection(std::move(gate_up_ws), std::move(gate_up_bits),
                               ng == 1 ? std::vector<int64_t>{2 * inter} : std::vector<int64_t>{inter, inter}, H,
                               nq + 1, passes);
      down = HeldProjection({std::move(down_w)}, {down_bits}, {H}, inter, nq + 1 + ng, passes);
    }
    for (size_t i = 0; i < this->perms.size(); ++i) {  // each weight's input width
      const int64_t cols = i < nq ? H : i == nq ? nh * hd : i < nq + 1 + ng ? H : inter;
      orders.push_back(input_order(this->perms[i], cols, "decoder_layer"));
    }
  }

  void set_qk_norm(torch::Tensor q_weight, torch::Tensor k_weight, double eps) {
    check_f32(q_weight, "decoder_layer: q_norm");
    check_f32(k_weight, "decoder_layer: k_norm");
    TORCH_CHECK(q_weight.numel() == hd && k_weight.numel() == hd && hd % 16 == 0,
                "decoder_layer: q/k norms: one weight per head dimension, a multiple of 16");
    q_norm = q_weight;
    k_norm = k_weight;
    qk_eps = eps;
  }

  void set_moe(std::shared_ptr<HeldMoe> experts) {
    TORCH_CHECK(experts != nullptr && gate_up.wps.empty(), "decoder_layer: experts in place of no MLP");
    TORCH_CHECK(experts->router.size(1) == H, "decoder_layer: the router's width is not the hidden size");
    moe = std::move(experts);
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
  int64_t k_type = -1, v_type = -1;  // the KV caches' types (kv_rows.h; -1: a float cache's, from its dtype)
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
  if (L.q_norm.has_value()) {  // each head's row alone, as rms_norm of the heads' rows: the same bits
    const float *qn = L.q_norm->data_ptr<float>(), *kn = L.k_norm->data_ptr<float>();
    const float qk_eps = static_cast<float>(L.qk_eps);
    for (int64_t t = 0; t < T; ++t) {
      float* row = qkv + t * L.qkv.width;
      for (int64_t i = 0; i < nh; ++i) rms_row<VNative>(row + i * hd, qn, qk_eps, hd, row + i * hd);
      for (int64_t i = nh; i < nh + L.nkv; ++i) rms_row<VNative>(row + i * hd, kn, qk_eps, hd, row + i * hd);
    }
  }
  float* q = scratch.take<float>(T * nh * hd);
  rope_write_into(qkv, T, step.positions, step.cos, step.sin, kv_cache, step.slot_mapping, nh, L.nkv, hd, step.neox, q,
                  L.rotate, step.k_type, step.v_type);
  if (L.q_scale.has_value()) {  // as the op by op route's q * factor: one rounding per element
    const float* factors = L.q_scale->data_ptr<float>();
    const int64_t* pos = step.positions.data_ptr<int64_t>();
    const int64_t positions = L.q_scale->numel();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(pos[t] < positions, "decoder_layer: position out of q_scale's range");
      const float f = factors[pos[t]];
      for (int64_t i = 0; i < nh * hd; ++i) q[t * nh * hd + i] *= f;
    }
  }
  float* attended = scratch.take<float>(T * nh * hd);
  decode_attention_into(q, T, nh, hd, kv_cache, step.block_tables, step.context_lens, L.scale, attended, 0, nullptr,
                        step.k_type, step.v_type);
  float* a = scratch.take<float>(T * H);
  project_into(L, L.o, attended, T, a, scratch);
  for (int64_t i = 0; i < T * H; ++i) h_out[i] = h[i] + a[i];  // the residual, then its norm into x
  rms_rows<VNative>(h_out, L.post_norm.data_ptr<float>(), eps, T, H, x);
  if (L.moe != nullptr) {  // as moe_route, then moe_experts, op by op
    const HeldMoe& M = *L.moe;
    std::vector<int64_t> ids(static_cast<size_t>(T * M.k));
    std::vector<float> weights(static_cast<size_t>(T * M.k));
    route_rows(x, T, H, M.router.data_ptr<float>(), M.experts(), M.k, M.gating, M.norm, static_cast<float>(M.scale),
               ids.data(), weights.data());
    moe_rows(x, T, H, ids.data(), weights.data(), M.k, M.experts(), M.gate_up_ptrs, M.gate_up_bits, M.down_ptrs,
             M.down_bits, M.inter, L.passes, a);
  } else {
    float* gate_up = scratch.take<float>(T * L.gate_up.width);
    project_into(L, L.gate_up, x, T, gate_up, scratch);
    float* act = scratch.take<float>(T * L.inter);
    silu_rows<VNative>(gate_up, T, L.inter, act);
    project_into(L, L.down, act, T, a, scratch);
  }
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
                            torch::Tensor block_tables, torch::Tensor context_lens, int64_t k_type, int64_t v_type) {
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  return run_layers(h, {&layer}, {positions, cos, sin, neox, slot_mapping, block_tables, context_lens, k_type, v_type},
                    {kv_cache});
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
  int64_t k_type, v_type;  // the caches' types (LayerStep's)

  HeldLayers(std::vector<std::shared_ptr<HeldLayer>> layers, torch::Tensor cos, torch::Tensor sin, bool neox,
             std::vector<torch::Tensor> kv_caches, c10::optional<torch::Tensor> norm, double norm_eps,
             int64_t k_type, int64_t v_type)
      : layers(std::move(layers)), kv_caches(std::move(kv_caches)), cos(std::move(cos)), sin(std::move(sin)),
        neox(neox), norm(std::move(norm)), norm_eps(norm_eps), k_type(k_type), v_type(v_type) {
    TORCH_CHECK(this->layers.size() == this->kv_caches.size(), "decoder_layers: one KV cache per layer");
    for (const auto& layer : this->layers) {
      TORCH_CHECK(layer != nullptr, "decoder_layers: a layer is None");
      held.push_back(layer.get());
    }
    for (size_t i = 0; i < this->kv_caches.size(); ++i)  // (checked once, as the steps will read them)
      kv_rows_of(this->kv_caches[i], k_type, v_type, held[i]->hd, "decoder_layers: a KV cache");
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
  return run_layers(h, bound.held,
                    {positions, bound.cos, bound.sin, bound.neox, slot_mapping, block_tables, context_lens, bound.k_type,
                     bound.v_type},
                    bound.kv_caches, bound.norm, bound.norm_eps);
}

}  // namespace
