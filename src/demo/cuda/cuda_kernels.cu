// The launches of the DeMo step's CUDA kernels (cuda_kernels.cuh holds the kernels): shared memory,
// checks, streams. Compiled with --fmad=false: no contraction nvcc would choose and the host
// compiler would not.
#include "demo/cuda/cuda_kernels.cuh"

#include <cuda_runtime.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

namespace flexdemo::kernels::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(status));
  }
}

// FLEXDEMO_CUDA_SYNC=1: every launch waited for and checked at once, so that a kernel's fault is
// reported by that kernel's name rather than by the next copy.
bool sync_every_launch() {
  static const bool on = [] {
    const char* v = std::getenv("FLEXDEMO_CUDA_SYNC");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}
void launched(const char* what, cudaStream_t stream) {
  check(cudaGetLastError(), what);
  if (sync_every_launch()) check(cudaStreamSynchronize(stream), what);
}

// The most shared memory a block of `device` may opt in to, static and dynamic together
// (227 KB on Hopper, 163 KB on an A100, 99 KB on other Ampere and Ada parts).
size_t max_shared_bytes(int device) {
  int bytes = 0;
  check(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "the device's shared memory");
  return size_t(bytes);
}

// Lets `kernel` launch with `dynamic` bytes of dynamic shared memory: past 48 KB of shared
// memory in all (its static arrays count), a block must opt in. Throws, naming the chunk size,
// where even the opt-in's most is too little. Done once per device, kernel and size (the opt-in
// persists): every step's launches would otherwise make these host calls again.
template <typename Kernel>
void allow_shared(Kernel kernel, size_t dynamic, const char* what) {
  int device = 0;
  check(cudaGetDevice(&device), "the current device");
  static std::mutex mutex;
  static std::set<std::tuple<int, const void*, size_t>> allowed;
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), dynamic);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (allowed.count(key) > 0) return;
  }
  cudaFuncAttributes attributes{};
  check(cudaFuncGetAttributes(&attributes, kernel), what);
  const size_t total = attributes.sharedSizeBytes + dynamic, most = max_shared_bytes(device);
  if (total > most) {
    throw std::invalid_argument(std::string("GPU DeMo kernels: the ") + what + " needs " +
                                std::to_string(total) + " bytes of shared memory for a chunk; " +
                                "this GPU gives a block at most " + std::to_string(most) +
                                " (a smaller --chunk)");
  }
  if (total > 48 * 1024) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dynamic)),
          what);
  }
  std::lock_guard<std::mutex> lock(mutex);
  allowed.insert(key);
}

}  // namespace

void encode(const TensorTable& table, float beta, float alpha, uint8_t* payloads,
            int64_t bucket_bytes, cudaStream_t stream) {
  const size_t bytes = size_t(table.encode_shared_floats) * sizeof(float);
  allow_shared(encode_kernel, bytes, "encode kernel");
  // The decode's too, now: a chunk too large for it fails before the exchange, not after.
  allow_shared(decode_step_kernel, size_t(table.decode_shared_floats) * sizeof(float),
               "decode kernel");
  check(cudaMemsetAsync(payloads, 0, size_t(bucket_bytes), stream), "zeroing the payloads");
  if (table.num_chunks == 0) return;
  encode_kernel<<<unsigned(table.num_chunks), kThreads, bytes, stream>>>(table, beta, alpha,
                                                                         payloads);
  launched("encode kernel launch", stream);
}

void seal(const TensorTable& table, uint8_t* payloads, uint32_t* scratch, cudaStream_t stream) {
  if (table.num_tensors == 0) return;
  if (table.num_segments > 0) {
    crc_segments_kernel<<<unsigned((table.num_segments + kThreads - 1) / kThreads), kThreads, 0,
                          stream>>>(table, payloads, 0, 1, scratch);
    launched("checksum segments kernel launch", stream);
  }
  crc_finish_kernel<<<unsigned(table.num_tensors), kThreads, 0, stream>>>(table, payloads, 0,
                                                                          scratch, nullptr);
  launched("seal kernel launch", stream);
}

void screen(const TensorTable& table, const uint8_t* gathered, int64_t bucket_bytes, int replicas,
            uint32_t* scratch, double* chunk_squares, uint32_t* errors, double* squares,
            cudaStream_t stream) {
  check(cudaMemsetAsync(errors, 0, sizeof(uint32_t) * size_t(replicas * table.num_tensors), stream),
        "zeroing the screening's errors");
  if (table.num_tensors == 0) return;
  uint8_t* buckets = const_cast<uint8_t*>(gathered);  // crc_finish_kernel only reads it here
  if (table.num_segments > 0) {
    const int64_t segments = replicas * table.num_segments;
    crc_segments_kernel<<<unsigned((segments + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        table, buckets, bucket_bytes, replicas, scratch);
    launched("checksum segments kernel launch", stream);
  }
  crc_finish_kernel<<<unsigned(replicas * table.num_tensors), kThreads, 0, stream>>>(
      table, buckets, bucket_bytes, scratch, errors);
  launched("checksum kernel launch", stream);
  const int64_t chunks = replicas * table.num_chunks;
  if (chunks > 0) {
    screen_chunks_kernel<<<unsigned((chunks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        table, gathered, bucket_bytes, replicas, chunk_squares, errors);
    launched("chunk screening kernel launch", stream);
  }
  screen_sums_kernel<<<unsigned(replicas * table.num_tensors), kThreads, 0, stream>>>(
      table, chunk_squares, squares);
  launched("screening sums kernel launch", stream);
}

void decode_step(const TensorTable& table, const uint8_t* gathered, int64_t bucket_bytes,
                 int replicas, const chunk_math::SgdConstants& sgd,
                 const chunk_math::AdamWConstants* adamw, cudaStream_t stream) {
  const size_t bytes = size_t(table.decode_shared_floats) * sizeof(float);
  allow_shared(decode_step_kernel, bytes, "decode kernel");
  if (table.num_chunks == 0) return;
  decode_step_kernel<<<unsigned(table.num_chunks), kThreads, bytes, stream>>>(
      table, gathered, bucket_bytes, replicas, sgd,
      adamw != nullptr ? *adamw : chunk_math::AdamWConstants{}, adamw != nullptr);
  launched("decode kernel launch", stream);
}

}  // namespace flexdemo::kernels::cuda
