// The launches of the DeMo step's CUDA kernels (cuda_kernels.cuh holds the kernels): shared memory,
// checks, streams. Compiled with --fmad=false: no contraction nvcc would choose and the host
// compiler would not.
#include "demo/cuda/cuda_kernels.cuh"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace flexdemo::kernels::cuda {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(status));
  }
}

size_t shared_bytes(const TensorTable& table) {
  return size_t(table.shared_floats) * sizeof(float);
}

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
          "shared memory for the largest chunk");
  }
}

// Hopper's (and Ampere's) most dynamic shared memory a block may opt in to.
constexpr size_t kMaxSharedBytes = 227 * 1024;

void check_table(const TensorTable& table) {
  if (shared_bytes(table) > kMaxSharedBytes) {
    throw std::invalid_argument("GPU DeMo kernels: a chunk needs " +
                                std::to_string(shared_bytes(table)) +
                                " bytes of shared memory; at most " +
                                std::to_string(kMaxSharedBytes) + " (a smaller --chunk)");
  }
}

}  // namespace

void encode(const TensorTable& table, float beta, float alpha, uint8_t* payloads,
            int64_t bucket_bytes, cudaStream_t stream) {
  check_table(table);
  check(cudaMemsetAsync(payloads, 0, size_t(bucket_bytes), stream), "zeroing the payloads");
  if (table.num_chunks == 0) return;
  const size_t bytes = shared_bytes(table);
  allow_shared(encode_kernel, bytes);
  encode_kernel<<<unsigned(table.num_chunks), kThreads, bytes, stream>>>(table, beta, alpha,
                                                                         payloads);
  check(cudaGetLastError(), "encode kernel launch");
}

void decode_step(const TensorTable& table, const uint8_t* gathered, int64_t bucket_bytes,
                 int replicas, float lr, float keep, const chunk_math::AdamWConstants* adamw,
                 cudaStream_t stream) {
  check_table(table);
  if (table.num_chunks == 0) return;
  const size_t bytes = shared_bytes(table);
  allow_shared(decode_step_kernel, bytes);
  decode_step_kernel<<<unsigned(table.num_chunks), kThreads, bytes, stream>>>(
      table, gathered, bucket_bytes, replicas, lr, keep,
      adamw != nullptr ? *adamw : chunk_math::AdamWConstants{}, adamw != nullptr);
  check(cudaGetLastError(), "decode kernel launch");
}

}  // namespace flexdemo::kernels::cuda
