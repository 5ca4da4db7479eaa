// A benchmark's probe (bench/): the machine's streaming read bandwidth, not used by the server.
#pragma once

namespace {

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
