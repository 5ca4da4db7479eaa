// The quantized matmul's driver: the checks, the activations' quantization, the dispatch of a
// tile to its format's kernel and the parallel loops over the tiles of one weight or several.
#pragma once

namespace {

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
#endif

// Whether format f's kernel takes the activations' code sums by halves (x16: Format::kWholeSums).
bool half_sums(int64_t f) {
  bool halves = false;
#define LOCALLLM_HALVES(F) \
  if (f == F) halves = !Format<F>::kWholeSums;
  FOR_EACH_INT_FORMAT(LOCALLLM_HALVES)
#undef LOCALLLM_HALVES
  return halves;
}

// The weight w of N x K in format bits, packed (formats.h), and the activation passes.
void check_weight(const torch::Tensor& w, int64_t bits, int64_t N, int64_t K, int64_t passes) {
  TORCH_CHECK(supported(), "localllm qgemm: built without native kernels (AVX-512 VNNI or AVX2)");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "qgemm: w must be contiguous uint8");
  TORCH_CHECK(is_fmt(bits), "qgemm: bits must be 4 or 8 or a format id");
  TORCH_CHECK(lattice_ready(bits), "qgemm: the lattice format's grid is not set (set_lattice_grid)");
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

// Tile t of weight w (a tiled format, [Np, K]) against the rows a: its 16 outputs of each row m
// at y[m * ldy + 16 t ..] (ldy >= Np: a part of a wider output).
void weight_tile(int64_t bits, int64_t passes, const uint8_t* w, int64_t ldy, int64_t K, const QuantizedRows& a,
                 float* y, int64_t t) {
  const ActRows rows = a.view();
#if LOCALLLM_HAVE_AVX2  // the AVX2 build's own kernels, where a format has them (Format::kAvx2Tiles)
#define LOCALLLM_FMT_CASE(F)                                                                  \
  if (bits == F) {                                                                            \
    if constexpr (Format<F>::kAvx2Tiles) {                                                    \
      if (passes == 1) avx2::gemm_tile<F, 1>(w, ldy, K, rows, a.M, y, t);                     \
      else avx2::gemm_tile<F, 2>(w, ldy, K, rows, a.M, y, t);                                 \
    } else {                                                                                  \
      if (passes == 1) fmt::gemm_tile<F, VNative, 1>(w, ldy, K, rows, a.M, y, t);             \
      else fmt::gemm_tile<F, VNative, 2>(w, ldy, K, rows, a.M, y, t);                         \
    }                                                                                         \
    return;                                                                                   \
  }
#else
#define LOCALLLM_FMT_CASE(F)                                                                \
  if (bits == F) {                                                                          \
    if (passes == 1) fmt::gemm_tile<F, VNative, 1>(w, ldy, K, rows, a.M, y, t);              \
    else fmt::gemm_tile<F, VNative, 2>(w, ldy, K, rows, a.M, y, t);                          \
    return;                                                                                 \
  }
#endif
  FOR_EACH_TILED_FORMAT(LOCALLLM_FMT_CASE)
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

// x float32 [M, K] contiguous, w uint8 packed (formats.h) for N x K -> y float32 [M, N].
// bits: the format id (one of formats.h's kFmt*). N need not be a multiple of 16: the
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

}  // namespace
