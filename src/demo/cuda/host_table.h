// How a bucket of tensors is laid out for the CUDA DeMo kernels (cuda_kernels.h): per tensor its
// geometry, top-k and payload layout, its chunks' place in the bucket-wide numbering and its
// payload's offset, its header and its checksum segments. Host code; the data and DCT-basis
// pointers are the caller's to fill in.
#pragma once

#include "demo/cuda/cuda_kernels.h"

#include "flexdemo/compress.h"
#include "flexdemo/dct.h"

#include <cstdint>
#include <vector>

namespace flexdemo::kernels::cuda {

struct HostTable {
  std::vector<TensorDesc> tensors;      // pointers unset
  std::vector<int32_t> chunk_tensor;    // per bucket chunk: its tensor
  std::vector<size_t> payload_bytes;    // per tensor
  size_t bytes = 0;                     // one replica's payloads, back to back
  int64_t encode_shared_floats = 1;     // encode_shared_floats' maximum over the tensors
  int64_t decode_shared_floats = 1;     // decode_shared_floats'
  std::vector<int32_t> segment_tensor;  // per checksum segment: its tensor
  int max_k = 1;
};

// Throws std::invalid_argument for chunks of more than kMaxChunkNumel coefficients.
HostTable host_table(const std::vector<dct::ChunkPlan>& plans, int64_t k,
                     compress::ValueEncoding encoding);

}  // namespace flexdemo::kernels::cuda
