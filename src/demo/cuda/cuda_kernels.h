// The DeMo step's CUDA kernels over a whole bucket of tensors, one launch per bucket: (1) encode —
// chunked DCT fused with the residual update, per-chunk top-k, error feedback and the payload
// bodies in the wire format; (2) decode — the mean over replicas, the inverse DCT and the inner
// optimizer's step, fused. Every element is computed with chunk_math.h, as the portable CPU
// kernels compute it. Plain pointers only (no ATen): gpu_step.cpp prepares the arguments.
#pragma once

#include "demo/chunk_math.h"
#include "demo/codec.h"

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace flexdemo::kernels::cuda {

// One tensor of a bucket, as the kernels see it. Pointers are device memory.
struct TensorDesc {
  const float* grad = nullptr;  // [rows, cols] row-major; null: a zero gradient (encode)
  float* residual = nullptr;    // [padded_rows, padded_cols] block-layout coefficients (encode)
  float* param = nullptr;       // [rows, cols] row-major (decode)
  float* exp_avg = nullptr;     // [rows, cols] AdamW's moments, or null (decode)
  float* exp_avg_sq = nullptr;
  // DCT-II of size chunk_h (rows) and chunk_w (cols), row k = basis vector k, and their
  // transposes (row i = entry i of every basis vector), rows 16-byte aligned (stride % 8 == 0).
  const float* basis_rows = nullptr;
  const float* basis_cols = nullptr;
  const float* basis_rows_t = nullptr;
  const float* basis_cols_t = nullptr;
  int64_t basis_rows_stride = 0, basis_cols_stride = 0;
  int64_t rows = 0, cols = 0, padded_cols = 0;
  int chunk_h = 1, chunk_w = 1;
  int64_t col_chunks = 1;
  int64_t first_chunk = 0;     // the bucket-wide number of its chunk 0
  int64_t payload_offset = 0;  // bytes from the start of a replica's bucket to its payload
  demo::codec::Layout body;    // the payload's body (k: top-k per chunk), after the header
  int64_t first_segment = 0;   // the bucket-wide number of its body's first checksum segment
  uint8_t header[32] = {};     // the payload's header before its checksum (the same every step)
};

// The payload bodies' CRC-32 (zlib's) is computed in segments of this many bytes, in parallel,
// then combined per payload (crc(A B) = x^(8|B|) crc(A) + crc(B) over GF(2)).
constexpr int64_t kChecksumSegment = 256;

// The whole bucket: tensors and chunk_tensor (per bucket chunk: its tensor) in device memory.
struct TensorTable {
  const TensorDesc* tensors = nullptr;
  const int32_t* chunk_tensor = nullptr;
  int64_t num_chunks = 0;
  // The dynamic shared memory of the encode and of the decode: encode_shared_floats' and
  // decode_shared_floats' maxima over the tensors (each kernel launched with its own, so that the
  // encode leaves more of the SM's memory to L1, where its DCT bases are read from).
  int64_t encode_shared_floats = 1;
  int64_t decode_shared_floats = 1;
  int64_t num_tensors = 0;
  const int32_t* segment_tensor = nullptr;  // per checksum segment: its tensor
  int64_t num_segments = 0;
  int max_k = 1;  // the largest top-k
  compress::ValueEncoding encoding = compress::ValueEncoding::Fp32;
  uint32_t crc_x2n[32] = {};  // codec::crc_x2n_table's, made on the host once
};

// Encode: residual = beta * residual + alpha * DCT(grad), its top-k, residual -= what a receiver
// decodes, and each payload's body written after its header's room (the header and its checksum
// are the host's: compress::seal_payload). payloads holds bucket_bytes, zeroed first.
void encode(const TensorTable& table, float beta, float alpha, uint8_t* payloads,
            int64_t bucket_bytes, cudaStream_t stream);

// Seal: every payload's header and its body's checksum, written into payloads (one bucket).
// scratch: num_segments uint32.
void seal(const TensorTable& table, uint8_t* payloads, uint32_t* scratch, cudaStream_t stream);

// Screen `replicas` buckets back to back, as the host's screen_payloads does but for the scale
// check, which needs only what this writes: per replica and tensor, errors[r * tensors + i] gets
// bit 1 for a header that differs from this layout's, 2 for a checksum mismatch, 4 for a chunk
// whose positions are not k strictly ascending ones inside the chunk, 8 for a value that is not
// finite (zeroed first); squares[r * tensors + i] the values' sum of squares in codec.h's order
// (codec::kScreenRun). scratch: replicas * num_segments uint32; chunk_squares: replicas *
// num_chunks doubles.
void screen(const TensorTable& table, const uint8_t* gathered, int64_t bucket_bytes, int replicas,
            uint32_t* scratch, double* chunk_squares, uint32_t* errors, double* squares,
            cudaStream_t stream);

// Decode and step: `replicas` buckets of payloads back to back (each bucket_bytes, validated),
// per coefficient the mean of the replicas that sent it (in rank order), its inverse DCT, and the
// SGD step (adamw == nullptr: sign-SGD or the bounded direction, as sgd says) or AdamW's on each
// tensor's param (and moments).
void decode_step(const TensorTable& table, const uint8_t* gathered, int64_t bucket_bytes,
                 int replicas, const chunk_math::SgdConstants& sgd,
                 const chunk_math::AdamWConstants* adamw, cudaStream_t stream);

// The largest chunk (coefficients) the kernels take: the decode's shared memory holds three.
constexpr int kMaxChunkNumel = 16384;

// Floats of dynamic shared memory the encode needs for a chunk of h x w: the chunk (rows padded
// to 8, then odd for the coefficients) and its transform.
inline int64_t encode_shared_floats(int h, int w) {
  return int64_t(h) * ((w + 7) / 8 * 8 + 1) + int64_t(h) * w;
}
// The decode's: the sums, the counts (then the nonzeros' positions), the inverse along the rows
// of the rows holding coefficients, and those rows' numbers and starts.
inline int64_t decode_shared_floats(int h, int w) {
  return 3 * int64_t(h) * w + 2 * (int64_t(h) + 1);
}

}  // namespace flexdemo::kernels::cuda
