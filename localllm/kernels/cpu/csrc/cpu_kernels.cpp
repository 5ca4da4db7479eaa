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
// Every other GGUF type (Q4_0, Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K, MXFP4, IQ4_NL, IQ4_XS, F16, BF16)
// has a layout of its own that keeps the file's codes and scales exactly: see fmt_common.h. One kernel, written over
// the vector width (AVX2 or AVX-512, the same bits), serves every format, the 4- and 8-bit tiles
// too (the AVX2 build has kernels of its own for some: avx2_tiles.h). Rows need not be a multiple
// of 16 (zero rows pad the last tile).
//
// One translation unit (a unity build: the extension compiles this file alone), its parts in the
// headers below, each reading those before it:
//   common.h       includes, the instruction set (-march=native picks it), shared constants, prefetches
//   formats.h      the format ids and their geometry, generated from localllm/quant/traits.py
//                  (`python -m localllm.quant.cpu_header`)
//   threads.h      parallel_chunks over torch's OpenMP threads, the layers' Scratch
//   vec.h          the vector traits V256 (AVX2) and V512 (AVX-512 VNNI)
//   act_rows.h     the activations' int8 codes per 32-group (quantize_rows, ActRows)
//   fmt_common.h   the code planes, the Format<F> traits, the scalar decode of a weight
//   fmt_legacy.h   Format<F> of the 32-group formats: the 4- and 8-bit tiles, Q4_0, Q5_0, Q5_1
//   fmt_kquants.h  Format<F> of the K-quants: Q4_K, Q5_K, Q6_K, Q3_K, Q2_K
//   fmt_codebook.h Format<F> of the codebook formats (codes looked up into int8 values): MXFP4, IQ4_NL, IQ4_XS
//   fmt_lattice.h  Format<F> of the lattice formats (grid points looked up): IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
//   fmt_kernel.h   the integer kernel of every tiled format (fmt::tile_kernel, fmt::gemm_tile)
//   fmt_float.h    F16 and BF16's float32 kernel
//   avx2_tiles.h   the AVX2 build's own kernels of the nibble formats and the 8-bit tiles
//   qgemm.h        the matmul's driver: checks, activations, dispatch by format, parallel loops
//   kv_rows.h      the KV cache's row types (f32, f16, bf16, q8_0, q4_0) and where a layer's rows lie
//   layer_ops.h    RMSNorm, SiLU (and gpt-oss's clamped SwiGLU), RoPE and the KV cache's writes, decode attention
//   layers.h       whole decoder layers in one call (HeldLayer, HeldLayers)
//   moe.h          a mixture of experts' experts in one call, the tokens grouped by expert
//   logits.h       an LM head's logits: greedy picks, rows of a packed weight, exact top logits
//   stream_read.h  the benchmarks' read-bandwidth probe

#include "common.h"
#include "formats.h"
#include "threads.h"
#include "vec.h"
#include "act_rows.h"
#include "fmt_common.h"
#include "fmt_legacy.h"
#include "fmt_kquants.h"
#include "fmt_codebook.h"
#include "fmt_lattice.h"
#include "fmt_kernel.h"
#include "fmt_float.h"
#include "avx2_tiles.h"
#include "qgemm.h"
#include "kv_rows.h"
#include "layer_ops.h"
#include "moe.h"
#include "layers.h"
#include "logits.h"
#include "stream_read.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while a kernel runs: the API's event loop keeps serving meanwhile
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("supported", &supported, "whether this build has native kernels (AVX-512 VNNI or AVX2)");
  m.def("formats", &formats, "whether this build has the kernels of the formats beyond 4- and 8-bit codes");
  m.def("isa", &isa, "the instruction set of this build's kernels: avx512vnni, avx2 or none");
  m.def("set_lattice_grid", &set_lattice_grid, "a lattice format's grid points (int8 [entries, width])");
  m.def("qgemm", &qgemm, "quantized matmul (see cpu_kernels.cpp)", py::arg("x"), py::arg("w"), py::arg("bits"),
        py::arg("N"), py::arg("K"), py::arg("passes"), py::arg("order") = py::none(), nogil);
  m.def("qgemm_parts", &qgemm_parts, "several quantized matmuls of one input width, outputs side by side", nogil);
  m.def("quantize_activations", &quantize_activations, "int8 activation codes per 32-group", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm, float32", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x), float32", nogil);
  m.def("rope_write_kv", &rope_write_kv, "RoPE on a fused qkv (rotate false: none); k/v into the paged cache; returns q",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"),
        py::arg("slot_mapping"), py::arg("nh"), py::arg("nkv"), py::arg("hd"), py::arg("neox"), py::arg("rotate") = true,
        py::arg("k_type") = -1, py::arg("v_type") = -1, nogil);
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache", py::arg("q"),
        py::arg("kv_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("sinks") = py::none(), py::arg("k_type") = -1, py::arg("v_type") = -1, nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate_up", nogil);
  m.def("swiglu_oai_mul", &swiglu_oai_mul, "gpt-oss's clamped SwiGLU of a fused gate_up", nogil);
  py::class_<HeldLayer, std::shared_ptr<HeldLayer>>(m, "HeldLayer", "a decoder layer's weights and shapes, held")
      .def(py::init<torch::Tensor, std::vector<torch::Tensor>, std::vector<int64_t>, c10::optional<torch::Tensor>,
                    torch::Tensor, int64_t, torch::Tensor, std::vector<torch::Tensor>, std::vector<int64_t>,
                    torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t,
                    std::vector<c10::optional<torch::Tensor>>, bool, c10::optional<torch::Tensor>>())
      .def("set_moe", &HeldLayer::set_moe, "a mixture of experts in place of the MLP", py::arg("experts"))
      .def("set_qk_norm", &HeldLayer::set_qk_norm, "the per-head norms of the queries and keys", py::arg("q_weight"),
           py::arg("k_weight"), py::arg("eps"))
      .def_readonly("passes", &HeldLayer::passes);
  m.def("decoder_layer", &decoder_layer, "a whole decoder layer for a decode-only step", py::arg("h"),
        py::arg("layer"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("neox"), py::arg("kv_cache"),
        py::arg("slot_mapping"), py::arg("block_tables"), py::arg("context_lens"), py::arg("k_type") = -1,
        py::arg("v_type") = -1, nogil);
  py::class_<HeldLayers, std::shared_ptr<HeldLayers>>(m, "HeldLayers",
                                                      "a model's held layers bound to their KV caches, RoPE and norm")
      .def(py::init<std::vector<std::shared_ptr<HeldLayer>>, torch::Tensor, torch::Tensor, bool, std::vector<torch::Tensor>,
                    c10::optional<torch::Tensor>, double, int64_t, int64_t>(),
           py::arg("layers"), py::arg("cos"), py::arg("sin"), py::arg("neox"), py::arg("kv_caches"),
           py::arg("norm") = py::none(), py::arg("norm_eps") = 0.0, py::arg("k_type") = -1, py::arg("v_type") = -1)
      .def_readonly("layers", &HeldLayers::layers);
  m.def("decoder_layers", &decoder_layers, "every decoder layer of a decode-only step, one after the other", py::arg("h"),
        py::arg("bound"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"),
        py::arg("context_lens"), nogil);
  py::class_<HeldMoe, std::shared_ptr<HeldMoe>>(m, "HeldMoe", "a mixture-of-experts layer's router and experts, held")
      .def(py::init<torch::Tensor, std::vector<torch::Tensor>, int64_t, std::vector<torch::Tensor>, int64_t, int64_t,
                    int64_t, int64_t, bool, double, int64_t>(),
           py::arg("router"), py::arg("gate_up"), py::arg("gate_up_bits"), py::arg("down"), py::arg("down_bits"),
           py::arg("inter"), py::arg("k"), py::arg("gating"), py::arg("norm"), py::arg("scale"), py::arg("passes"));
  m.def("moe_route", &moe_route, "each row's experts and their weights through a float32 router", py::arg("x"),
        py::arg("router"), py::arg("k"), py::arg("gating"), py::arg("norm"), py::arg("scale"), nogil);
  m.def("moe_experts", &moe_experts, "a mixture-of-experts layer's experts, the tokens grouped by expert", nogil);
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