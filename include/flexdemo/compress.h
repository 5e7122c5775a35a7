// flexdemo/compress.h — top-k extraction per chunk, the compact wire format, and the
// deterministic decode-aggregate. Never reads a received payload out of bounds: every payload
// is validated (header, sizes, checksum, index range) before a byte of its body is used.
#pragma once

#include "flexdemo/dct.h"

#include "flexdemo/value_encoding.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace flexdemo::compress {

// Raised for a payload that is truncated, corrupt, of another version or another shape.
class WireFormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ====== Top-k ======
// The k coefficients of largest magnitude in every chunk, indices ascending within a chunk.
struct TopK {
  int64_t k = 0;       // per chunk
  at::Tensor indices;  // int64 [num_chunks, k]: position u * chunk_cols + v inside the chunk
  at::Tensor values;   // float32 [num_chunks, k]: the signed coefficients
};
int64_t clamp_topk(int64_t k, const dct::ChunkPlan& plan);  // into [1, chunk_numel]
// coeffs: float32 contiguous block layout (see dct.h). Ties go to the lower index. A bounded
// heap per chunk: the plain path that kernels::select_topk (partial selection) is tested against.
TopK select_topk_plain(const at::Tensor& coeffs, const dct::ChunkPlan& plan, int64_t k);
// coeffs[selected] += alpha * values: with alpha = -1 this is DeMo's error feedback.
void add_selected(const at::Tensor& coeffs, const dct::ChunkPlan& plan, const TopK& topk,
                  float alpha);

// ====== Wire format ======
// One payload per tensor: a 36-byte little-endian header, then the body:
//   u32 magic "FDMO" | u8 version | u8 value encoding | u8 index bytes (0: packed) | u8 0
//   u32 rows | u32 cols | u32 chunk_rows | u32 chunk_cols | u32 k | u32 body bytes | u32 crc32
//   body: positions, per-chunk fp32 scales, values, laid out per value encoding by the codec
//         (src/demo/codec.h; docs/wire-format.md): positions are 1 byte if chunk_numel <= 256,
//         2 if <= 65536, else 4, or one packed Elias-Fano record per chunk (index bytes 0).
// Version 2 added the 2bit encoding and packed indices (index bytes 0).
constexpr uint32_t kWireMagic = 0x4F4D4446;  // "FDMO" read as little-endian bytes
constexpr uint8_t kWireVersion = 2;

// Exact payload size (header + body) for one tensor; k is clamped as select_topk does.
size_t wire_payload_bytes(const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding);

// Writes the payload (wire_payload_bytes bytes) to dst and replaces topk.values by what a
// receiver decodes, so that error feedback removes exactly what was sent.
void encode_payload(const dct::ChunkPlan& plan, TopK& topk, ValueEncoding encoding, uint8_t* dst);
// Writes the header (and the body's checksum) of a payload whose body is already at
// dst + 36: encode_payload's last step, and the GPU encoder's (kernels.h).
void seal_payload(const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding, uint8_t* dst);

// Throws WireFormatError unless `data` (size bytes) is a complete, intact payload for this
// plan, k and encoding, every chunk's indices inside it and strictly ascending.
void validate_payload(const uint8_t* data, size_t size, const dct::ChunkPlan& plan, int64_t k,
                      ValueEncoding encoding);

// What a valid payload's values hold (validate_payload first): whether every value is finite,
// and the sum of their squares (float64), as a receiver decodes them.
struct PayloadValues {
  bool finite = true;
  double sum_squares = 0.0;
};
PayloadValues scan_payload_values(const uint8_t* data, const dct::ChunkPlan& plan, int64_t k,
                                  ValueEncoding encoding);

// How a test aid (Optimizer::tamper_next_exchange, FLEXDEMO_INJECT_PAYLOAD) makes a payload
// faulty: Scale multiplies every value a receiver decodes by a factor (NaN: non-finite values)
// and re-seals the payload, so that only a check of the values finds it; Corrupt flips one bit
// of the body, so the checksum fails (src/demo/screen.h: tamper_payload).
enum class Tamper { Scale, Corrupt };

// Decodes the payloads of one tensor from R replicas, given in rank order, each `size` bytes,
// into out (float32 block layout, overwritten): per coefficient, the mean of the values of the
// replicas that selected it, 0 where none did. Summed in rank order, so the result is
// bit-identical on every replica. Every payload is validated first.
void decode_mean(const std::vector<const uint8_t*>& payloads, size_t size,
                 const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding,
                 const at::Tensor& out);

// The same means, chunk by chunk as lists: chunk c's distinct positions (u * chunk_cols + v, in
// the order they first appear, rank by rank) and their means are entries [0, counts[c]) of row c.
struct SparseChunks {
  at::Tensor positions;  // int32 [num_chunks, replicas * k]
  at::Tensor values;     // float32 [num_chunks, replicas * k]
  at::Tensor counts;     // int64 [num_chunks]
};
SparseChunks decode_mean_sparse(const std::vector<const uint8_t*>& payloads, size_t size,
                                const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding);

}  // namespace flexdemo::compress
