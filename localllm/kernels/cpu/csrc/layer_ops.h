// A decoder layer's other ops: RMSNorm, SiLU, RoPE with the KV cache's writes, decode attention.
#pragma once

namespace {

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

// One row x [H] normed into o (o may be x: each element is read before it is written).
template <class V>
inline void rms_row(const float* x, const float* w, float eps, int64_t H, float* o) {
  const float ss = dot<V>(x, x, H);
  const typename V::F scale = V::set(1.0f / std::sqrt(ss / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += V::kLanes) V::store(o + i, V::fmul(V::fmul(V::load(x + i), scale), V::load(w + i)));
}

template <class V>
void rms_rows(const float* x, const float* w, float eps, int64_t T, int64_t H, float* out) {
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_row<V>(x + t * H, w, eps, H, out + t * H);
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

// gpt-oss's clamped SwiGLU of gate_up [T, 2 I] (gate first) into out [T, I], as ggml's swiglu_oai:
// x = min(gate, limit), y = clamp(up, -limit, limit), x / (1 + exp(-alpha x)) * (y + 1)
template <class V>
void swiglu_oai_rows(const float* gate_up, int64_t T, int64_t I, float alpha, float limit, float* out) {
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    using F = typename V::F;
    const F one = V::set(1.0f), hi = V::set(limit), lo = V::set(-limit), minus_alpha = V::set(-alpha);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < I; i += V::kLanes) {
        const F x = V::fmin(V::load(gate_up + t * 2 * I + i), hi);
        const F y = V::fmin(V::fmax(V::load(gate_up + t * 2 * I + I + i), lo), hi);
        const F glu = V::fdiv(x, V::fadd(one, lane_exp<V>(V::fmul(minus_alpha, x))));
        V::store(out + t * I + i, V::fmul(glu, V::fadd(y, one)));
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

// One head's row of k or v into the cache, in its type (rotated first where the side is: in `turned`, hd floats).
inline void store_row(const KvRows& kv, bool key, int64_t slot, int64_t h, const float* src, float* turned) {
  const int64_t b = slot / kv.bs, t = slot % kv.bs;
  uint8_t* dst = key ? kv.k(b, t, h) : kv.v(b, t, h);
  const int type = key ? kv.k_type : kv.v_type;
  if (const int64_t n = key ? kv.k_rot : kv.v_rot) {
    std::memcpy(turned, src, static_cast<size_t>(kv.hd) * sizeof(float));
    hadamard_rows(turned, 1, kv.hd, n);
    src = turned;
  }
  if (type == kKvF32) std::memcpy(dst, src, static_cast<size_t>(kv.hd) * sizeof(float));
  else if (type == kKvF16) store_kv(reinterpret_cast<c10::Half*>(dst), src, kv.hd);
  else encode_kv_row(type, src, dst, kv.hd);
}

void rope_write_impl(const float* src, const int64_t* pos, const int64_t* slot, const float* ct, const float* st,
                     float* qd, const KvRows& kv, int64_t T_, int64_t nh, int64_t nkv, int64_t hd, bool neox,
                     bool rotate_rows) {
  const int64_t width = (nh + 2 * nkv) * hd, half = hd / 2;
  at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> rotated, turned;  // (kept: a decode layer's serial steps allocate nothing)
    if (rotated.size() < static_cast<size_t>(hd)) rotated.resize(hd), turned.resize(hd);
    for (int64_t t = begin; t < end; ++t) {
      const float* c = rotate_rows ? ct + pos[t] * half : nullptr;
      const float* s = rotate_rows ? st + pos[t] * half : nullptr;
      const float* row = src + t * width;
      auto rotate = [&](const float* x, float* o) {
        if (!rotate_rows) {  // a layer without RoPE: the head as it is
          std::memcpy(o, x, static_cast<size_t>(hd) * sizeof(float));
        } else if (neox) {
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
        store_row(kv, true, slot[t], h, rotated.data(), turned.data());
        store_row(kv, false, slot[t], h, row + (nh + nkv + h) * hd, turned.data());
      }
    }
  });
}

// Rotate q and k of a fused projection qkv [T, (nh + 2 nkv) * hd] with RoPE (cos/sin tables
// [max_pos, hd / 2]; neox: halves, else adjacent pairs), write the rotated k and v into
// kv_cache [2, blocks, block_size, nkv, hd] (float32 or float16) at slot_mapping [T]; return
// the rotated q [T, nh, hd]. rotate false (a layer without RoPE): q and k as they are, the tables
// not read (any shape).
// rope_write_kv's work on the rows qkv [T, (nh + 2 nkv) * hd] (float32), the rotated q into q [T, nh,
// hd]; the step's tensors checked here.
void rope_write_into(const float* qkv, int64_t T, const torch::Tensor& positions, const torch::Tensor& cos,
                     const torch::Tensor& sin, const torch::Tensor& kv_cache, const torch::Tensor& slot_mapping,
                     int64_t nh, int64_t nkv, int64_t hd, bool neox, float* q, bool rotate = true,
                     int64_t k_type = -1, int64_t v_type = -1) {
  const KvRows kv = kv_rows_of(kv_cache, k_type, v_type, hd, "rope_write_kv: kv_cache");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slot_mapping.scalar_type() == torch::kInt64 &&
                  positions.is_contiguous() && slot_mapping.is_contiguous(),
              "rope_write_kv: positions and slot_mapping must be contiguous int64");
  const int64_t half = hd / 2;
  TORCH_CHECK(hd % 32 == 0, "rope_write_kv: the head size must be a multiple of 32");
  if (rotate) {
    check_f32(cos, "rope_write_kv: cos");
    check_f32(sin, "rope_write_kv: sin");
    TORCH_CHECK(cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(), "rope_write_kv: bad tables");
  }
  TORCH_CHECK(kv.nkv == nkv, "rope_write_kv: bad kv_cache shape");
  TORCH_CHECK(positions.numel() == T && slot_mapping.numel() == T, "rope_write_kv: one position and slot per token");
  const int64_t slots = kv.blocks * kv.bs;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && (!rotate || pos[t] < cos.size(0)), "rope_write_kv: position out of range");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "rope_write_kv: slot out of range");
  }
  const float* ct = rotate ? cos.data_ptr<float>() : nullptr;
  const float* st = rotate ? sin.data_ptr<float>() : nullptr;
  rope_write_impl(qkv, pos, slot, ct, st, q, kv, T, nh, nkv, hd, neox, rotate);
}

torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor kv_cache, torch::Tensor slot_mapping, int64_t nh, int64_t nkv, int64_t hd,
                            bool neox, bool rotate, int64_t k_type, int64_t v_type) {
  check_f32(qkv, "rope_write_kv: qkv");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (nh + 2 * nkv) * hd, "rope_write_kv: bad qkv shape");
  auto q = torch::empty({T, nh, hd}, qkv.options());
  rope_write_into(qkv.data_ptr<float>(), T, positions, cos, sin, kv_cache, slot_mapping, nh, nkv, hd, neox,
                  q.data_ptr<float>(), rotate, k_type, v_type);
  return q;
}

#if LOCALLLM_HAVE_NATIVE

// Up to kRowsPerPass query rows of one sequence at consecutive positions (a prompt's tokens, each
// attending as a decode at its position would) share each K and V tile they read.
constexpr int64_t kRowsPerPass = 8;

// The decode attention of `rows` query rows of one sequence (one block table) at consecutive positions,
// contexts ctxs[0] < ctxs[1] < ... (one row: a decode), the query heads of KV heads [g0, g1): row r's q
// [nh, hd] at q + r nh hd -> its out at out + r nh hd. Each row's arithmetic, and each head's, is its
// own, the same as alone and whichever heads a call takes: rows share the tiles they read, not sums.
// NV = hd / V::kLanes when known at compile time (0: read nv). K, then V, are streamed block by
// block (four blocks ahead prefetched): V::kLanes tokens' scores per head at a time (one transposed
// lane sum), the output accumulated in registers over each block, for up to V::kAccumulators vectors
// at a time (of one head, or of several heads' whole rows). window (> 0): a row sees only its last
// `window` keys (a sliding-window layer), the blocks before them not read; sinks (per query head, or
// null): a logit of its own in each head's softmax that brings no value (gpt-oss). T: the cache's
// float32 or float16 values at kc / vc, or uint8_t: rows of any types (kv_rows.h) that kv says where
// they lie, each KV head's keys of L tokens and its values of a block decoded into float32 tiles as
// they come.
template <class V, int NV, typename T>
void attend_sequence(const float* q, const T* kc, const T* vc, const KvRows& kv, const int64_t* table,
                     const int64_t* ctxs, int64_t rows, int64_t nh, int64_t nkv, int64_t nv_, int64_t bs, float scale,
                     float* out, std::vector<float>& scores, int64_t g0, int64_t g1, int64_t window = 0,
                     const float* sinks = nullptr) {
  constexpr bool kCoded = std::is_same_v<T, uint8_t>;
  using F = typename V::F;
  constexpr int L = V::kLanes;
  const int64_t nv = NV ? NV : nv_, hd = nv * L, group = nh / nkv, row = nkv * hd;
  const int64_t ctx_max = ctxs[rows - 1], nblk = (ctx_max + bs - 1) / bs;
  const int64_t h_begin = g0 * group, h_end = g1 * group, heads = h_end - h_begin;  // the query heads taken
  const int64_t span = (ctx_max + L - 1) / L * L;  // (a row's head's scores: span apart)
  int64_t first[kRowsPerPass], b_first[kRowsPerPass];  // per row: the first key seen, its block
  for (int64_t r = 0; r < rows; ++r) {
    first[r] = window > 0 ? std::max<int64_t>(0, ctxs[r] - window) : 0;
    b_first[r] = first[r] / bs;
  }
  // (row r, head hq)'s scores; the tokens a row does not see stay -inf
  scores.assign(rows * heads * span, -INFINITY);
  auto scores_of = [&](int64_t r, int64_t hq) { return scores.data() + (r * heads + hq - h_begin) * span; };
  alignas(64) float k_tile[L * 256];  // (hd <= 256)
  thread_local std::vector<float> v_tile;  // a block's values of one KV head, decoded (kCoded)
  if constexpr (kCoded) v_tile.resize(static_cast<size_t>(bs * hd));
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
    if constexpr (kCoded) {
      for (int64_t t = 0; t < bs; ++t) {
        if (i < nblk) prefetch_rows<_MM_HINT_T1>(kv.k(table[i], t, g), kv.k_row);
        else prefetch_rows<_MM_HINT_T1>(kv.v(table[i - nblk], t, g), kv.v_row);
      }
    } else {
      const T* block = i < nblk ? kc + table[i] * bs * row : vc + table[i - nblk] * bs * row;
      for (int64_t t = 0; t < bs; ++t) prefetch_rows<_MM_HINT_T1>(block + t * row + g * hd, hd);
    }
  };
  for (int64_t i = b_first[0]; i < b_first[0] + kAhead; ++i)
    for (int64_t g = g0; g < g1; ++g) prefetch_head(i, g);
  for (int64_t b = b_first[0]; b < nblk; ++b) {
    const T* kb = kCoded ? nullptr : kc + table[b] * bs * row;
    const int64_t n = std::min<int64_t>(bs, ctx_max - b * bs);
    for (int64_t t0 = 0; t0 < n; t0 += L) {
      const int64_t w = std::min<int64_t>(L, n - t0);
      for (int64_t g = g0; g < g1; ++g) {
        if (t0 == 0) prefetch_head(b + kAhead, g);
        // the KV head's keys of these tokens: float16 ones converted once into k_tile for the
        // group's query heads (each converted per head before: 4 times for Llama-3.2's groups)
        const T* kr = kb + t0 * row + g * hd;
        const float* keys;
        int64_t key_stride;
        if constexpr (kCoded) {
          decode_kv_rows(kv.k_type, kv.k(table[b], t0, g), nkv * kv.k_row, w, hd, k_tile);
          keys = k_tile, key_stride = hd;
        } else if constexpr (std::is_same_v<T, float>) {
          keys = kr, key_stride = row;
        } else {
          for (int64_t t = 0; t < w; ++t)
            for (int64_t i = 0; i < nv; ++i) V::store(k_tile + t * hd + L * i, V::load(kr + t * row + L * i));
          keys = k_tile, key_stride = hd;
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t w_r = std::min<int64_t>(L, std::min<int64_t>(bs, ctxs[r] - b * bs) - t0);  // (its tokens)
          if (b < b_first[r] || w_r <= 0) continue;
          for (int64_t hq = g * group; hq < (g + 1) * group; ++hq) {
            const float* qh = q + (r * nh + hq) * hd;
            F qv[16];  // (V::kHoldsQ: hd <= 256 gives nv <= 16)
            if constexpr (V::kHoldsQ)
              for (int64_t i = 0; i < nv; ++i) qv[i] = V::load(qh + L * i);
            auto q_vec = [&](int64_t i) {
              if constexpr (V::kHoldsQ) return qv[i];
              else return V::load(qh + L * i);
            };
            F acc[L];
            for (int t = 0; t < L; ++t) {
              if (t < w_r) {
                const float* kt = keys + t * key_stride;
                F a = V::fmul(q_vec(0), V::load(kt));
                for (int64_t i = 1; i < nv; ++i) a = V::fma(q_vec(i), V::load(kt + L * i), a);
                acc[t] = a;
              } else {
                acc[t] = V::zero();
              }
            }
            V::store_first(scores_of(r, hq) + b * bs + t0, V::fmul(V::lane_sums(acc), V::set(scale)), w_r);
          }
        }
      }
    }
  }
  float inv[kRowsPerPass * 256];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t padded = (ctxs[r] + L - 1) / L * L, t_first = b_first[r] * bs / L * L;  // (bs: a multiple of L)
    for (int64_t hq = h_begin; hq < h_end; ++hq) {
      float* sg = scores_of(r, hq);
      for (int64_t t = b_first[r] * bs; t < first[r]; ++t) sg[t] = -INFINITY;  // (keys before the window)
      F mx = V::set(-INFINITY);
      for (int64_t t = t_first; t < padded; t += L) mx = V::fmax(mx, V::load(sg + t));
      float top = V::reduce_max(mx);
      if (sinks != nullptr) top = std::max(top, sinks[hq]);
      const F m = V::set(top);
      F sum = V::zero();
      for (int64_t t = t_first; t < padded; t += L) {
        const F e = lane_exp<V>(V::fsub(V::load(sg + t), m));  // padding: exp(-inf) = 0
        V::store(sg + t, e);
        sum = V::fadd(sum, e);
      }
      float total = V::reduce_add(sum);
      if (sinks != nullptr) total += std::exp(sinks[hq] - top);
      inv[r * 256 + hq] = 1.0f / total;
      for (int64_t i = 0; i < hd; i += L) V::store(out + (r * nh + hq) * hd + i, V::zero());
    }
  }
  // per pass over a block: kPer heads x kChunk vectors of accumulators (at most V::kAccumulators)
  constexpr int64_t kRegs = V::kAccumulators;
  constexpr int64_t kChunk = NV ? std::min<int64_t>(NV, kRegs) : kRegs;
  constexpr int64_t kPer = NV ? std::max<int64_t>(kRegs / kChunk, 1) : 1;
  const int64_t per_pass = std::min<int64_t>(group, kPer);
  for (int64_t b = b_first[0]; b < nblk; ++b) {
    const int64_t n = std::min<int64_t>(bs, ctx_max - b * bs);
    for (int64_t g = g0; g < g1; ++g) {
      prefetch_head(nblk + b + kAhead, g);
      // the KV head's values of this block: in the cache (rows `row` apart), or decoded (hd apart)
      using VT = std::conditional_t<kCoded, float, T>;
      const VT* vg;
      int64_t v_stride;
      if constexpr (kCoded) {
        decode_kv_rows(kv.v_type, kv.v(table[b], 0, g), nkv * kv.v_row, n, hd, v_tile.data());
        vg = v_tile.data(), v_stride = hd;
      } else {
        vg = vc + table[b] * bs * row + g * hd, v_stride = row;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n_r = std::min<int64_t>(bs, ctxs[r] - b * bs);  // (the row's tokens of the block)
        if (b < b_first[r] || n_r <= 0) continue;
        float* out_r = out + r * nh * hd;
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += per_pass) {
          const int64_t nhp = std::min<int64_t>(per_pass, (g + 1) * group - h0);
          for (int64_t c0 = 0; c0 < nv; c0 += kChunk) {
            const int64_t nc = std::min<int64_t>(kChunk, nv - c0);
            F acc[kPer * kChunk];
            for (int64_t j = 0; j < kPer; ++j)
              if (j < nhp)
                for (int64_t i = 0; i < kChunk; ++i)
                  if (i < nc) acc[j * kChunk + i] = V::load(out_r + (h0 + j) * hd + L * (c0 + i));
            for (int64_t t = 0; t < n_r; ++t) {
              const VT* vr = vg + t * v_stride + L * c0;
              const float* p = scores_of(r, h0) + b * bs + t;
              F pj[kPer];
              for (int64_t j = 0; j < kPer; ++j)
                if (j < nhp) pj[j] = V::set(p[j * span]);
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
                  if (i < nc) V::store(out_r + (h0 + j) * hd + L * (c0 + i), acc[j * kChunk + i]);
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t hq = h_begin; hq < h_end; ++hq) {
      float* o = out + (r * nh + hq) * hd;
      const F f = V::set(inv[r * 256 + hq]);
      for (int64_t i = 0; i < hd; i += L) V::store(o + i, V::fmul(f, V::load(o + i)));
    }
}

template <class V, typename T>
void decode_attention_impl(const float* qd, const T* kc, const T* vc, const KvRows& kv, const int64_t* tables,
                           const int64_t* lens, int64_t max_blocks, int64_t nd, int64_t nh, int64_t nkv, int64_t hd,
                           int64_t bs, float sc, float* od, int64_t window, const float* sinks) {
  constexpr int L = V::kLanes;
  const int64_t nv = hd / L;
  // Rows of one sequence at consecutive positions (a prompt's tokens as decodes) go together, up to
  // kRowsPerPass, so that each K/V tile is read once for all of them: same block table, contexts one apart.
  // (first row, rows). Kept between steps, so that a decode step allocates nothing; bound to a plain
  // reference, since the worker threads below must read this thread's list, not their own.
  thread_local std::vector<std::pair<int64_t, int64_t>> kept_runs;
  std::vector<std::pair<int64_t, int64_t>>& runs = kept_runs;
  runs.clear();
  for (int64_t i = 0; i < nd;) {
    int64_t n = 1;
    while (i + n < nd && n < kRowsPerPass && lens[i + n] == lens[i + n - 1] + 1 &&
           std::equal(tables + (i + n) * max_blocks, tables + (i + n) * max_blocks + (lens[i + n] + bs - 1) / bs,
                      tables + i * max_blocks))
      ++n;
    runs.emplace_back(i, n);
    i += n;
  }
  const int64_t items = static_cast<int64_t>(runs.size());
  // Fewer sequences than threads (one stream's decode): each sequence's KV heads are parts of the
  // work of their own, once its K/V are worth a thread's wake-up (kAttentionSplitBytes), so that
  // a long context's attention does not run on one thread while the others wait. A head's
  // arithmetic does not depend on the split: the same bits whatever the batch. One stream's decode
  // after a 4000-token prompt, the whole layers replayed, 2 threads, Zen 4: SmolLM2 (3 KV heads)
  // 411 -> 366 us a layer, a Llama-3.2-1B-shaped Q4_0 (8 KV heads) 1948 -> 1515 us.
  int64_t longest = 0;
  for (int64_t i = 0; i < nd; ++i) longest = std::max(longest, lens[i]);
  const bool split = items < omp_get_max_threads() && longest * nkv * (kv.k_row + kv.v_row) >= kAttentionSplitBytes;
  const int64_t parts = split ? nkv : 1;
  parallel_chunks(items * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const auto [seq, rows] = runs[item / parts];
      const int64_t g0 = item % parts * nkv / parts, g1 = (item % parts + 1) * nkv / parts;
      const float* q = qd + seq * nh * hd;
      const int64_t* table = tables + seq * max_blocks;
      const int64_t* ctxs = lens + seq;
      float* out = od + seq * nh * hd;
      switch (hd) {  // the common head sizes with their vector counts fixed
        case 32: attend_sequence<V, 32 / L>(q, kc, vc, kv, table, ctxs, rows, nh, nkv, nv, bs, sc, out, scores, g0,
                                            g1, window, sinks); break;
        case 64: attend_sequence<V, 64 / L>(q, kc, vc, kv, table, ctxs, rows, nh, nkv, nv, bs, sc, out, scores, g0,
                                            g1, window, sinks); break;
        case 128: attend_sequence<V, 128 / L>(q, kc, vc, kv, table, ctxs, rows, nh, nkv, nv, bs, sc, out, scores,
                                              g0, g1, window, sinks); break;
        default: attend_sequence<V, 0>(q, kc, vc, kv, table, ctxs, rows, nh, nkv, nv, bs, sc, out, scores, g0, g1,
                                       window, sinks);
      }
    }
  });
}

#endif  // LOCALLLM_HAVE_NATIVE

// Decode attention straight from the paged cache (kv_rows.h's, any types): q [nd, nh, hd] (one
// query per sequence, the first nd rows of block_tables [>= nd, max_blocks] / context_lens
// [>= nd]) -> out [nd, nh, hd] float32.
// paged_decode_attention's work on the queries q [nd, nh, hd] (float32) into out [nd, nh, hd]; the
// step's tensors checked here (block_tables and context_lens: contiguous).
void decode_attention_into(const float* q, int64_t nd, int64_t nh, int64_t hd, const torch::Tensor& kv_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                           float* out, int64_t window = 0, const float* sinks = nullptr, int64_t k_type = -1,
                           int64_t v_type = -1) {
  const KvRows kv = kv_rows_of(kv_cache, k_type, v_type, hd, "paged_decode_attention: kv_cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64 &&
                  block_tables.is_contiguous() && context_lens.is_contiguous() && block_tables.dim() == 2,
              "paged_decode_attention: block_tables and context_lens must be contiguous int64");
  const int64_t nblocks = kv.blocks, bs = kv.bs, nkv = kv.nkv;
  TORCH_CHECK(hd % 16 == 0 && hd <= 256 && nh % nkv == 0 && nh <= 256, "paged_decode_attention: bad shapes");
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
  const float sc = static_cast<float>(scale);
  if (kv.split) {
    // rotated keys: the queries turned alike (their dot products unchanged); rotated values: the output turned back
    thread_local std::vector<float> turned_q;
    if (kv.k_rot) {
      turned_q.assign(q, q + nd * nh * hd);
      hadamard_rows(turned_q.data(), nd * nh, hd, kv.k_rot);
      q = turned_q.data();
    }
    decode_attention_impl<VNative, uint8_t>(q, nullptr, nullptr, kv, tables, lens, max_blocks, nd, nh, nkv, hd, bs,
                                            sc, out, window, sinks);
    hadamard_rows(out, nd * nh, hd, kv.v_rot);
  } else if (kv.k_type == kKvF16) {
    const c10::Half* kc = kv_cache.data_ptr<c10::Half>();
    decode_attention_impl<VNative>(q, kc, kc + nblocks * bs * nkv * hd, kv, tables, lens, max_blocks, nd, nh, nkv, hd,
                                   bs, sc, out, window, sinks);
  } else {
    const float* kc = kv_cache.data_ptr<float>();
    decode_attention_impl<VNative>(q, kc, kc + nblocks * bs * nkv * hd, kv, tables, lens, max_blocks, nd, nh, nkv, hd,
                                   bs, sc, out, window, sinks);
  }
#endif
}

// window (> 0): each query sees the last `window` keys only; sinks (float32 [heads], optional): a
// logit per query head in each softmax's denominator.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, int64_t window,
                                     c10::optional<torch::Tensor> sinks, int64_t k_type, int64_t v_type) {
  check_f32(q, "paged_decode_attention: q");
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q must be [sequences, heads, head size]");
  TORCH_CHECK(window >= 0, "paged_decode_attention: window must be >= 0");
  if (sinks.has_value()) {
    check_f32(*sinks, "paged_decode_attention: sinks");
    TORCH_CHECK(sinks->numel() == q.size(1), "paged_decode_attention: sinks: one per query head");
  }
  auto out = torch::empty_like(q);
  decode_attention_into(q.data_ptr<float>(), q.size(0), q.size(1), q.size(2), kv_cache, block_tables.contiguous(),
                        context_lens.contiguous(), scale, out.data_ptr<float>(), window,
                        sinks.has_value() ? sinks->data_ptr<float>() : nullptr, k_type, v_type);
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

// gpt-oss's clamped SwiGLU (swiglu_oai_rows) of gate_up [T, 2 I] (gate first) -> [T, I]
torch::Tensor swiglu_oai_mul(torch::Tensor gate_up, double alpha, double limit) {
  check_f32(gate_up, "swiglu_oai_mul: gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.dim() == 2 && I % 16 == 0 && gate_up.size(1) == 2 * I, "swiglu_oai_mul: bad shape");
  auto out = torch::empty({T, I}, gate_up.options());
#if LOCALLLM_HAVE_NATIVE
  swiglu_oai_rows<VNative>(gate_up.data_ptr<float>(), T, I, static_cast<float>(alpha), static_cast<float>(limit),
                           out.data_ptr<float>());
#endif
  return out;
}

}  // namespace
