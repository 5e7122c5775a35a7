// Just enough of CUDA's execution model on a CPU to run src/demo/cuda/cuda_kernels.cuh unchanged:
// a block's threads are real threads (std::thread, so __syncthreads is a real barrier and every
// interleaving the barriers allow can happen), blocks run one after another, __shared__ variables
// are statics (one block at a time shares them), atomics are the compiler's. Not a simulator of
// warps or memory models: it checks the kernels' logic (indexing, selection, scans, packing),
// not their speed. Include before the kernels, in one translation unit.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace flexdemo::cuda_emulation {

struct Dim3 {
  unsigned x = 0;
};

inline Dim3& block_index() {
  static Dim3 index;
  return index;
}
inline Dim3& block_dim() {
  static Dim3 dim;
  return dim;
}
inline Dim3& thread_index() {
  thread_local Dim3 index;
  return index;
}
inline std::vector<unsigned char>& dynamic_shared_memory() {
  static std::vector<unsigned char> memory;
  return memory;
}

// A reusable barrier for the block's threads.
class Barrier {
 public:
  void reset(unsigned count) {
    count_ = count;
    waiting_ = 0;
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const unsigned generation = generation_;
    if (++waiting_ == count_) {
      waiting_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation != generation_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  unsigned count_ = 0, waiting_ = 0, generation_ = 0;
};
inline Barrier& block_barrier() {
  static Barrier barrier;
  return barrier;
}

// kernel(args...) on grid blocks of `threads` threads, with `shared_bytes` of dynamic shared
// memory, blocks one after another.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, unsigned grid, unsigned threads, size_t shared_bytes, Args... args) {
  dynamic_shared_memory().assign(shared_bytes + 16, 0);
  block_dim().x = threads;
  for (unsigned b = 0; b < grid; ++b) {
    block_index().x = b;
    block_barrier().reset(threads);
    std::vector<std::thread> team;
    for (unsigned t = 0; t < threads; ++t) {
      team.emplace_back([=] {
        thread_index().x = t;
        kernel(args...);
      });
    }
    for (std::thread& th : team) th.join();
  }
}

}  // namespace flexdemo::cuda_emulation

#define __global__
#define __device__
#define __shared__ static
#define threadIdx (::flexdemo::cuda_emulation::thread_index())
#define blockIdx (::flexdemo::cuda_emulation::block_index())
#define blockDim (::flexdemo::cuda_emulation::block_dim())
#define FLEXDEMO_DYNAMIC_SHARED(T, name) \
  T* name = reinterpret_cast<T*>(::flexdemo::cuda_emulation::dynamic_shared_memory().data())

inline void __syncthreads() {
  ::flexdemo::cuda_emulation::block_barrier().wait();
}
inline unsigned atomicAdd(uint32_t* address, uint32_t value) {
  return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline unsigned atomicOr(unsigned* address, unsigned value) {
  return __atomic_fetch_or(address, value, __ATOMIC_SEQ_CST);
}
inline unsigned atomicMax(uint32_t* address, uint32_t value) {
  uint32_t old = __atomic_load_n(address, __ATOMIC_SEQ_CST);
  while (old < value && !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_SEQ_CST,
                                                     __ATOMIC_SEQ_CST)) {
  }
  return old;
}
using std::fabs;
using std::min;
using std::signbit;
