// Work over torch's OpenMP threads (parallel_chunks) and the decoder layers' scratch memory.
#pragma once

namespace {

// f(begin, end) over [0, n) in chunks of `chunk` on torch's OpenMP threads. Each thread owns a
// contiguous run of the chunks (an even share) and takes them front to back, so that it streams
// one long stretch of memory; a thread done with its run takes chunks from the back of the
// others' (when one thread is descheduled, a busy machine or an API server sharing the cores, the
// others take its chunks instead of waiting for it). Runs read memory faster than chunks handed
// out in turn: one row through six 16384x2048 weights beyond L3, 2 threads, Zen 4, median GB/s of
// 9 interleaved rounds, runs / chunks in turn: Q4_K 29.4 / 27.5, Q6_K 30.1 / 28.6, Q4_0 30.9 /
// 29.4 (a plain read of 19 MiB blocks: 40.3 / 36.4).
struct alignas(64) ChunkRun {  // the chunks [front, back) not yet taken, as one word (CAS)
  std::atomic<uint64_t> span;
  static uint64_t pack(uint32_t front, uint32_t back) { return static_cast<uint64_t>(back) << 32 | front; }
  // the next chunk from the front (the owner) or from the back (another thread); false when none is left
  bool take(bool from_back, int64_t& chunk) {
    uint64_t cur = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = static_cast<uint32_t>(cur), back = static_cast<uint32_t>(cur >> 32);
      if (front >= back) return false;
      const uint64_t next = from_back ? pack(front, back - 1) : pack(front + 1, back);
      if (span.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
        chunk = from_back ? back - 1 : front;
        return true;
      }
    }
  }
};

template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int threads = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), chunks));
  if (chunks <= 1 || threads <= 1 || omp_in_parallel()) {
    if (n > 0) f(0, n);
    return;
  }
  TORCH_CHECK(chunks < (int64_t{1} << 32), "parallel_chunks: too many chunks");
  std::unique_ptr<ChunkRun[]> runs(new ChunkRun[threads]);
  for (int t = 0; t < threads; ++t)
    runs[t].span.store(ChunkRun::pack(static_cast<uint32_t>(chunks * t / threads),
                                      static_cast<uint32_t>(chunks * (t + 1) / threads)));
  auto run = [&](int64_t c) { f(c * chunk, std::min(n, (c + 1) * chunk)); };
#pragma omp parallel num_threads(threads)
  {
    // a team smaller than asked for leaves runs without an owner: the others take them from the back
    const int t = omp_get_thread_num();
    int64_t c;
    while (runs[t].take(false, c)) run(c);
    for (int o = 1; o < threads; ++o)
      while (runs[(t + o) % threads].take(true, c)) run(c);
  }
}

// Memory that a step's native decoder layers take their buffers from: one region per calling thread,
// kept from step to step (a decode step asks for the same sizes each time). A layer then makes no
// tensor and dispatches no tensor op between its kernels: each such op cost 2-8 us in a decode step,
// its code and data evicted by the megabytes of weights streamed since its last call (36 us of a
// 690 us layer of a Llama-3.2-1B-shaped Q4_K_M file, 2 threads, Zen 4).
class Scratch {
 public:
  // Room for `bytes` from the start; what was taken before is given back (so: before taking any).
  void reserve(int64_t bytes) {
    used_ = 0;
    if (bytes <= size_) return;
    const int64_t size = round(bytes);
    data_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(size))));
    size_ = data_ != nullptr ? size : 0;
    TORCH_CHECK(data_ != nullptr, "out of memory for the decoder layers' scratch");
  }
  // n entries of T, 64-byte aligned
  template <typename T>
  T* take(int64_t n) {
    const int64_t bytes = size_of<T>(n);
    TORCH_CHECK(used_ + bytes <= size_, "decoder layers: scratch overrun (a bug)");
    T* at = reinterpret_cast<T*>(data_.get() + used_);
    used_ += bytes;
    return at;
  }
  int64_t mark() const { return used_; }
  void release(int64_t mark) { used_ = mark; }
  // what take<T>(n) uses up
  template <typename T>
  static int64_t size_of(int64_t n) { return round(n * static_cast<int64_t>(sizeof(T))); }

 private:
  static int64_t round(int64_t bytes) { return (bytes + 63) / 64 * 64; }
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  int64_t size_ = 0, used_ = 0;
};

}  // namespace
