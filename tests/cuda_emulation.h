// Just enough of CUDA's execution model on a CPU to run src/demo/cuda/cuda_kernels.cuh unchanged:
// a block's threads are real threads (std::thread, so __syncthreads is a real barrier and every
// interleaving the barriers allow can happen), blocks run one after another, __shared__ variables
// are statics (one block at a time shares them), atomics are the compiler's. Not a simulator of
// warps or memory models: it checks the kernels' logic (indexing, selection, scans, packing),
// not their speed; their speed is estimated from the accesses and multiply-adds it records (the
// performance model below, used by bench/gpu_model.cpp). Include before the kernels, in one
// translation unit.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
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
  unsigned generations() {  // how many times the block has passed a barrier
    std::unique_lock<std::mutex> lock(mutex_);
    return generation_;
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

// ====== The performance model's records ======
// Each thread records the accesses the kernels trace (FLEXDEMO_TRACE_*) and its multiply-adds.
// After a block, the lanes of each warp (32 consecutive threads) that reach the same access site
// for the same time form one request, as the hardware serves them: a global request touches so
// many 32-byte sectors; a shared one takes so many wavefronts (the most distinct 4-byte words in
// one of the 32 banks; an atomic, the most accesses to one bank, as they serialise). A warp's
// FMA instructions are its busiest lane's multiply-adds.
enum class Space { Shared, Global, Atomic };
struct Access {
  int site;
  Space space;
  uintptr_t address;
  int bytes;
};
struct ThreadRecord {
  std::vector<Access> accesses;
  int64_t fma = 0;
};
struct Counts {
  double fma_instructions = 0;
  double shared_requests = 0, shared_wavefronts = 0;
  double global_requests = 0, global_sectors = 0;
  double blocks = 0, barriers = 0;  // the blocks counted and the barriers they passed
  void add(const Counts& o, double weight) {
    blocks += weight * o.blocks;
    barriers += weight * o.barriers;
    fma_instructions += weight * o.fma_instructions;
    shared_requests += weight * o.shared_requests;
    shared_wavefronts += weight * o.shared_wavefronts;
    global_requests += weight * o.global_requests;
    global_sectors += weight * o.global_sectors;
  }
};
inline ThreadRecord*& my_record() {
  thread_local ThreadRecord* record = nullptr;
  return record;
}
// Every traced access, recorded where a block is being counted. A 16-byte access (a tile's float4
// load) must be 16-byte aligned, as a GPU needs it: the dynamic shared memory is (its base here,
// and __align__(16) on the device), so a misaligned offset inside it is the kernel's fault, caught
// here rather than as a misaligned-address fault on the first GPU.
inline void trace(int site, Space space, const void* p, int bytes) {
  if (bytes == 16 && uintptr_t(p) % 16 != 0) {
    std::fprintf(stderr, "cuda_emulation: a 16-byte load at cuda_kernels.cuh:%d from %p, not "
                 "16-byte aligned\n", site, p);
    std::abort();
  }
  if (ThreadRecord* r = my_record()) r->accesses.push_back({site, space, uintptr_t(p), bytes});
}
inline void trace_fma(int count) {
  if (ThreadRecord* r = my_record()) r->fma += count;
}

inline Counts count_block(const std::vector<ThreadRecord>& threads) {
  Counts c;
  for (size_t w0 = 0; w0 < threads.size(); w0 += 32) {
    const size_t w1 = std::min(threads.size(), w0 + 32);
    int64_t fma = 0;
    std::map<std::pair<int, int>, std::vector<const Access*>> requests;  // (site, n-th time)
    for (size_t lane = w0; lane < w1; ++lane) {
      fma = std::max(fma, threads[lane].fma);
      std::map<int, int> seen;
      for (const Access& a : threads[lane].accesses) {
        requests[{a.site, seen[a.site]++}].push_back(&a);
      }
    }
    c.fma_instructions += double(fma);
    for (const auto& request : requests) {
      const std::vector<const Access*>& lanes = request.second;
      if (lanes.front()->space == Space::Global) {
        std::set<uintptr_t> sectors;
        for (const Access* a : lanes) {
          for (uintptr_t s = a->address / 32; s <= (a->address + a->bytes - 1) / 32; ++s) {
            sectors.insert(s);
          }
        }
        c.global_requests += 1;
        c.global_sectors += double(sectors.size());
        continue;
      }
      std::map<uintptr_t, std::set<uintptr_t>> words;  // bank -> distinct words
      std::map<uintptr_t, int> hits;                   // bank -> accesses
      for (const Access* a : lanes) {
        for (uintptr_t w = a->address / 4; w < (a->address + a->bytes + 3) / 4; ++w) {
          words[w % 32].insert(w);
          hits[w % 32] += 1;
        }
      }
      size_t wavefronts = 1;
      for (const auto& bank : words) {
        wavefronts =
            std::max(wavefronts, lanes.front()->space == Space::Atomic ? size_t(hits[bank.first])
                                                                       : bank.second.size());
      }
      c.shared_requests += 1;
      c.shared_wavefronts += double(wavefronts);
    }
  }
  return c;
}

// kernel(args...) on the given blocks of `threads` threads each, with `shared_bytes` of dynamic
// shared memory, one block after another; with `counts`, every block's accesses are traced and
// counted into it.
template <typename Kernel, typename... Args>
void launch_blocks(Kernel kernel, const std::vector<unsigned>& blocks, unsigned threads,
                   size_t shared_bytes, Counts* counts, Args... args) {
  dynamic_shared_memory().assign(shared_bytes + 16, 0);
  if (uintptr_t(dynamic_shared_memory().data()) % 16 != 0) std::abort();  // as on the device
  block_dim().x = threads;
  for (unsigned b : blocks) {
    block_index().x = b;
    block_barrier().reset(threads);
    const unsigned before = block_barrier().generations();
    std::vector<ThreadRecord> records(counts != nullptr ? threads : 0);
    std::vector<std::thread> team;
    for (unsigned t = 0; t < threads; ++t) {
      ThreadRecord* record = counts != nullptr ? &records[t] : nullptr;
      team.emplace_back([=] {
        thread_index().x = t;
        my_record() = record;
        kernel(args...);
      });
    }
    for (std::thread& th : team) th.join();
    if (counts != nullptr) {
      Counts block = count_block(records);
      block.blocks = 1;
      block.barriers = double(block_barrier().generations() - before);
      counts->add(block, 1.0);
    }
  }
}

// kernel(args...) on grid blocks, one after another.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, unsigned grid, unsigned threads, size_t shared_bytes, Args... args) {
  std::vector<unsigned> blocks(grid);
  for (unsigned b = 0; b < grid; ++b) blocks[b] = b;
  launch_blocks(kernel, blocks, threads, shared_bytes, nullptr, args...);
}

}  // namespace flexdemo::cuda_emulation

#define __global__
#define __device__
#define __shared__ static
#define threadIdx (::flexdemo::cuda_emulation::thread_index())
#define blockIdx (::flexdemo::cuda_emulation::block_index())
#define blockDim (::flexdemo::cuda_emulation::block_dim())
#define FLEXDEMO_TRACE_SHARED(p, bytes)                                                       \
  ::flexdemo::cuda_emulation::trace(__LINE__, ::flexdemo::cuda_emulation::Space::Shared, (p), \
                                    (bytes))
#define FLEXDEMO_TRACE_GLOBAL(p, bytes)                                                       \
  ::flexdemo::cuda_emulation::trace(__LINE__, ::flexdemo::cuda_emulation::Space::Global, (p), \
                                    (bytes))
#define FLEXDEMO_TRACE_ATOMIC(p) \
  ::flexdemo::cuda_emulation::trace(__LINE__, ::flexdemo::cuda_emulation::Space::Atomic, (p), 4)
#define FLEXDEMO_TRACE_FMA(count) ::flexdemo::cuda_emulation::trace_fma(count)
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
