// libFuzzer target: the decoder of DeMo payloads received from other nodes (validate + decode).
// Byte 0 picks the receiver's chunk plan and k, byte 1 the value encoding (bits 0-2, modulo the
// number of encodings) and whether to repair the CRC-32 (bit 3) (so that mutations also reach the
// checks behind it); the rest is the payload. Anything but a WireFormatError, or a read out of
// bounds, is a finding.
#include "flexdemo/compress.h"
#include "flexdemo/dct.h"
#include "demo/kernels.h"

#include <ATen/ATen.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

using namespace flexdemo;

namespace {

struct Shape {
  int64_t rows, cols, chunk;
  dct::ChunkMode mode;
};
const Shape kShapes[] = {
    {64, 64, 64, dct::ChunkMode::Divisor},  {1, 100, 64, dct::ChunkMode::Divisor},
    {30, 50, 8, dct::ChunkMode::Padded},    {7, 13, 4, dct::ChunkMode::Padded},
    {128, 32, 16, dct::ChunkMode::Divisor}, {3, 1000, 64, dct::ChunkMode::Padded},
    {1, 5, 64, dct::ChunkMode::Divisor},    {20, 20, 1, dct::ChunkMode::Divisor}};
constexpr int kNumShapes = sizeof(kShapes) / sizeof(kShapes[0]);
const std::vector<compress::ValueEncoding> kEncodings = values_of<compress::ValueEncoding>();
const int kNumEncodings = int(kEncodings.size());  // at most 8: bits 0-2 of byte 1
constexpr size_t kHeaderBytes = 36;
constexpr uint8_t kRepairCrc = 8;

struct Receiver {
  dct::ChunkPlan plan;
  int64_t k;
  compress::ValueEncoding encoding;
};

Receiver receiver_for(uint8_t b0, uint8_t b1) {
  const Shape& s = kShapes[b0 % kNumShapes];
  Receiver r;
  r.plan = dct::make_chunk_plan({s.rows, s.cols}, s.chunk, s.mode);
  r.k = compress::clamp_topk(1 + (b0 / kNumShapes) % 33, r.plan);
  r.encoding = kEncodings[(b1 & 7) % kNumEncodings];
  return r;
}

void repair_crc(std::vector<uint8_t>& payload) {
  if (payload.size() < kHeaderBytes) return;
  const uint8_t* body = payload.data() + kHeaderBytes;
  const uint32_t crc =
      uint32_t(crc32_z(crc32_z(0L, Z_NULL, 0), body, payload.size() - kHeaderBytes));
  for (int b = 0; b < 4; ++b) payload[32 + b] = uint8_t(crc >> (8 * b));
}

// Seeds from the real encoder: one valid input per shape and encoding.
void write_seeds(const std::string& dir) {
  at::manual_seed(0);
  for (int shape = 0; shape < kNumShapes; ++shape) {
    for (uint8_t e = 0; e < kNumEncodings; ++e) {
      const uint8_t b0 = uint8_t(shape + kNumShapes * 3), b1 = uint8_t(e | kRepairCrc);
      Receiver r = receiver_for(b0, b1);
      const at::Tensor coeffs = at::randn({r.plan.padded_rows, r.plan.padded_cols});
      compress::TopK topk = kernels::select_topk(coeffs, r.plan, r.k);
      std::vector<uint8_t> input = {b0, b1};
      input.resize(2 + compress::wire_payload_bytes(r.plan, r.k, r.encoding));
      compress::encode_payload(r.plan, topk, r.encoding, input.data() + 2);
      std::ofstream(dir + "/seed-" + std::to_string(shape) + "-" + std::to_string(e),
                    std::ios::binary)
          .write(reinterpret_cast<const char*>(input.data()), std::streamsize(input.size()));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("FLEXDEMO_FUZZ_SEEDS")) write_seeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const Receiver r = receiver_for(data[0], data[1]);
  std::vector<uint8_t> payload(data + 2, data + size);
  if (data[1] & kRepairCrc) repair_crc(payload);
  const at::Tensor out = at::empty({r.plan.padded_rows, r.plan.padded_cols});
  try {
    // Two replicas sent the same bytes: the decoder reads both.
    compress::decode_mean({payload.data(), payload.data()}, payload.size(), r.plan, r.k, r.encoding,
                          out);
  } catch (const compress::WireFormatError&) {
  }
  return 0;
}
