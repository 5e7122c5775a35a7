// The wire format: encode one tensor's top-k into a self-describing payload, validate a
// received payload completely before use, and decode R payloads into their per-coefficient mean.
#include "flexdemo/compress.h"

#include "kernels/chunk_math.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace flexdemo::compress {

namespace cm = kernels::chunk_math;

int index_bytes_for(int64_t chunk_numel) {
  if (chunk_numel <= 256) return 1;
  if (chunk_numel <= 65536) return 2;
  return 4;
}

namespace {

// ====== Byte order ======
void put_u32(uint8_t* p, uint32_t v) {
  for (int b = 0; b < 4; ++b) p[b] = uint8_t(v >> (8 * b));
}
uint32_t get_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
void put_f32(uint8_t* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  put_u32(p, bits);
}
float get_f32(const uint8_t* p) {
  const uint32_t bits = get_u32(p);
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

using Layout = PayloadLayout;

int scales_per_chunk(ValueEncoding e) {
  switch (e) {
    case ValueEncoding::Int8:
    case ValueEncoding::Sign:
      return 1;
    case ValueEncoding::TwoBit:
      return 2;
    default:
      return 0;
  }
}

}  // namespace

PayloadLayout payload_layout(const dct::ChunkPlan& plan, int64_t k_requested,
                             ValueEncoding encoding) {
  Layout l;
  l.chunks = plan.num_chunks();
  l.k = clamp_topk(k_requested, plan);
  l.entries = l.chunks * l.k;
  if (packed_indices(encoding)) {
    l.index_bytes = 0;
    l.record_bytes = size_t(cm::packed_record_bytes(plan.chunk_numel(), l.k));
    l.scales_at = size_t(l.chunks) * l.record_bytes;
  } else {
    l.index_bytes = index_bytes_for(plan.chunk_numel());
    l.scales_at = size_t(l.entries) * l.index_bytes;
  }
  l.values_at = l.scales_at + size_t(l.chunks) * 4 * scales_per_chunk(encoding);
  size_t value_bytes = 0;
  switch (encoding) {
    case ValueEncoding::Fp32:
      value_bytes = size_t(l.entries) * 4;
      break;
    case ValueEncoding::Bf16:
      value_bytes = size_t(l.entries) * 2;
      break;
    case ValueEncoding::Int8:
      value_bytes = size_t(l.entries);
      break;
    case ValueEncoding::Sign:
      value_bytes = (size_t(l.entries) + 7) / 8;
      break;
    case ValueEncoding::TwoBit:
      value_bytes = (size_t(l.entries) + 3) / 4;
      break;
  }
  l.body_bytes = l.values_at + value_bytes;
  return l;
}

namespace {

uint32_t checksum(const uint8_t* body, size_t n) {
  return uint32_t(crc32_z(crc32_z(0L, Z_NULL, 0), body, n));
}

uint32_t to_u32(int64_t v, const char* what) {
  if (v < 0 || v > int64_t(std::numeric_limits<uint32_t>::max())) {
    throw std::invalid_argument(std::string("wire format: ") + what + " " + std::to_string(v) +
                                " does not fit 32 bits");
  }
  return uint32_t(v);
}

int64_t read_index(const uint8_t* p, int width) {
  switch (width) {
    case 1:
      return p[0];
    case 2:
      return int64_t(p[0]) | int64_t(p[1]) << 8;
    default:
      return int64_t(get_u32(p));
  }
}

void write_index(uint8_t* p, int64_t v, int width) {
  for (int b = 0; b < width; ++b) p[b] = uint8_t(v >> (8 * b));
}

void set_bit(uint8_t* p, int64_t bit) {
  p[bit / 8] |= uint8_t(1u << (bit % 8));
}

// ORs the low `width` (< 32) bits of v in from bit `bit` on, LSB first, a byte's share at a time.
void put_bits(uint8_t* p, int64_t bit, int64_t v, int width) {
  for (int done = 0; done < width;) {
    const int64_t at = bit + done;
    const int shift = int(at % 8), take = std::min(8 - shift, width - done);
    p[at / 8] |= uint8_t(((v >> done) & ((1 << take) - 1)) << shift);
    done += take;
  }
}

// Chunk c's k ascending positions (idx) into its part of the index section (zeroed first).
void write_positions(uint8_t* body, const Layout& l, int64_t n, int64_t c, const int64_t* idx) {
  if (l.index_bytes > 0) {
    for (int64_t j = 0; j < l.k; ++j) {
      write_index(body + (c * l.k + j) * l.index_bytes, idx[j], l.index_bytes);
    }
    return;
  }
  uint8_t* record = body + c * l.record_bytes;
  const int low = cm::packed_low_bits(n, l.k);
  for (int64_t j = 0; j < l.k; ++j) {
    put_bits(record, j * low, idx[j], low);
    set_bit(record, l.k * low + (idx[j] >> low) + j);
  }
}

// Chunk c's positions, in the order sent, into out[0, k). Returns how many the chunk holds: k, or
// for a damaged packed record another count (then out holds the first min(count, k)).
int64_t read_positions(const uint8_t* body, const Layout& l, int64_t n, int64_t c, int64_t* out) {
  if (l.index_bytes > 0) {
    for (int64_t j = 0; j < l.k; ++j) {
      out[j] = read_index(body + (c * l.k + j) * l.index_bytes, l.index_bytes);
    }
    return l.k;
  }
  const uint8_t* record = body + c * l.record_bytes;
  const int low = cm::packed_low_bits(n, l.k);
  const int64_t high_at = l.k * low, high_bits = cm::packed_high_bits(n, l.k);
  int64_t found = 0;
  for (int64_t b = 0; b < high_bits; ++b) {
    if (!cm::get_bit(record, high_at + b)) continue;
    if (found < l.k) out[found] = (b - found) << low | cm::get_bits(record, found * low, low);
    ++found;
  }
  for (int64_t b = high_at + high_bits; b < int64_t(l.record_bytes) * 8; ++b) {
    if (cm::get_bit(record, b)) return -1;  // a padding bit set: not a record this build writes
  }
  return found;
}

// Value j (0-based among all entries) of a validated body.
inline float read_value(const uint8_t* body, const Layout& l, ValueEncoding e, int64_t entry) {
  const uint8_t* values = body + l.values_at;
  switch (e) {
    case ValueEncoding::Fp32:
      return get_f32(values + 4 * entry);
    case ValueEncoding::Bf16: {
      return cm::bf16_value(uint16_t(values[2 * entry] | values[2 * entry + 1] << 8));
    }
    case ValueEncoding::Int8:
      return float(int8_t(values[entry])) * get_f32(body + l.scales_at + 4 * (entry / l.k));
    case ValueEncoding::Sign: {
      const float scale = get_f32(body + l.scales_at + 4 * (entry / l.k));
      return (values[entry / 8] >> (entry % 8)) & 1 ? -scale : scale;
    }
    case ValueEncoding::TwoBit: {
      const bool large = cm::get_bit(values, 2 * entry + 1);
      const float level = get_f32(body + l.scales_at + 8 * (entry / l.k) + (large ? 4 : 0));
      return cm::get_bit(values, 2 * entry) ? -level : level;
    }
  }
  return 0.0f;
}

[[noreturn]] void reject(const std::string& why) {
  throw WireFormatError("invalid wire payload: " + why);
}

void expect_field(uint32_t got, int64_t want, const char* field) {
  if (int64_t(got) != want) {
    reject(std::string(field) + " is " + std::to_string(got) + ", this replica expects " +
           std::to_string(want));
  }
}

}  // namespace

size_t wire_payload_bytes(const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding) {
  return kWireHeaderBytes + payload_layout(plan, k, encoding).body_bytes;
}

void encode_payload(const dct::ChunkPlan& plan, TopK& topk, ValueEncoding encoding, uint8_t* dst) {
  const Layout l = payload_layout(plan, topk.k, encoding);
  if (l.k != topk.k || topk.indices.numel() != l.entries || topk.values.numel() != l.entries) {
    throw std::invalid_argument("encode_payload: top-k does not match the chunk plan");
  }
  uint8_t* body = dst + kWireHeaderBytes;
  const int64_t* idx = topk.indices.data_ptr<int64_t>();
  float* val = topk.values.data_ptr<float>();

  std::memset(body, 0, l.body_bytes);
  for (int64_t c = 0; c < l.chunks; ++c)
    write_positions(body, l, plan.chunk_numel(), c, idx + c * l.k);
  uint8_t* values = body + l.values_at;
  switch (encoding) {
    case ValueEncoding::Fp32:
      for (int64_t e = 0; e < l.entries; ++e) put_f32(values + 4 * e, val[e]);
      break;
    case ValueEncoding::Bf16:
      for (int64_t e = 0; e < l.entries; ++e) {
        const uint16_t bits = cm::bf16_bits(val[e]);
        values[2 * e] = uint8_t(bits);
        values[2 * e + 1] = uint8_t(bits >> 8);
        val[e] = cm::bf16_value(bits);
      }
      break;
    case ValueEncoding::Int8:
      for (int64_t c = 0; c < l.chunks; ++c) {
        float max_abs = 0.0f;
        for (int64_t j = 0; j < l.k; ++j) max_abs = std::max(max_abs, std::fabs(val[c * l.k + j]));
        const float scale = cm::int8_scale(max_abs);
        put_f32(body + l.scales_at + 4 * c, scale);
        for (int64_t j = 0; j < l.k; ++j) {
          const int64_t e = c * l.k + j;
          const int8_t stored = cm::int8_quantize(val[e], scale);
          values[e] = uint8_t(stored);
          val[e] = float(stored) * scale;
        }
      }
      break;
    case ValueEncoding::Sign:
      for (int64_t c = 0; c < l.chunks; ++c) {
        double sum_abs = 0.0;
        for (int64_t j = 0; j < l.k; ++j) sum_abs += std::fabs(val[c * l.k + j]);
        const float scale = cm::sign_scale(sum_abs, l.k);
        put_f32(body + l.scales_at + 4 * c, scale);
        for (int64_t j = 0; j < l.k; ++j) {
          const int64_t e = c * l.k + j;
          const bool negative = std::signbit(val[e]);
          if (negative) values[e / 8] |= uint8_t(1u << (e % 8));
          val[e] = negative ? -scale : scale;
        }
      }
      break;
    case ValueEncoding::TwoBit:
      for (int64_t c = 0; c < l.chunks; ++c) {
        float* v = val + c * l.k;
        double sum_abs = 0.0, sum_large = 0.0;
        for (int64_t j = 0; j < l.k; ++j) sum_abs += std::fabs(v[j]);
        const float mean_abs = cm::sign_scale(sum_abs, l.k);
        int64_t large = 0;
        for (int64_t j = 0; j < l.k; ++j) {
          if (cm::two_bit_large(v[j], mean_abs)) sum_large += std::fabs(v[j]), ++large;
        }
        double sum_small = 0.0;  // summed apart, in entry order, as the GPU does
        for (int64_t j = 0; j < l.k; ++j) {
          if (!cm::two_bit_large(v[j], mean_abs)) sum_small += std::fabs(v[j]);
        }
        const float levels[2] = {cm::two_bit_level(sum_small, l.k - large, mean_abs),
                                 cm::two_bit_level(sum_large, large, mean_abs)};
        put_f32(body + l.scales_at + 8 * c, levels[0]);
        put_f32(body + l.scales_at + 8 * c + 4, levels[1]);
        for (int64_t j = 0; j < l.k; ++j) {
          const int64_t e = c * l.k + j;
          const bool negative = std::signbit(v[j]), is_large = cm::two_bit_large(v[j], mean_abs);
          if (negative) set_bit(values, 2 * e);
          if (is_large) set_bit(values, 2 * e + 1);
          v[j] = negative ? -levels[is_large] : levels[is_large];
        }
      }
      break;
  }

  seal_payload(plan, topk.k, encoding, dst);
}

void seal_payload(const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding, uint8_t* dst) {
  const Layout l = payload_layout(plan, k, encoding);
  put_u32(dst + 0, kWireMagic);
  dst[4] = kWireVersion;
  dst[5] = uint8_t(encoding);
  dst[6] = uint8_t(l.index_bytes);
  dst[7] = 0;
  put_u32(dst + 8, to_u32(plan.rows, "rows"));
  put_u32(dst + 12, to_u32(plan.cols, "cols"));
  put_u32(dst + 16, to_u32(plan.chunk_rows, "chunk rows"));
  put_u32(dst + 20, to_u32(plan.chunk_cols, "chunk cols"));
  put_u32(dst + 24, to_u32(l.k, "k"));
  put_u32(dst + 28, to_u32(int64_t(l.body_bytes), "body bytes"));
  put_u32(dst + 32, checksum(dst + kWireHeaderBytes, l.body_bytes));
}

void validate_payload(const uint8_t* data, size_t size, const dct::ChunkPlan& plan, int64_t k,
                      ValueEncoding encoding) {
  if (size < kWireHeaderBytes) {
    reject("truncated: " + std::to_string(size) + " bytes, the header alone is " +
           std::to_string(kWireHeaderBytes));
  }
  if (get_u32(data) != kWireMagic) reject("bad magic (not a flexdemo payload)");
  if (data[4] != kWireVersion) {
    reject("version " + std::to_string(data[4]) + ", this build reads version " +
           std::to_string(kWireVersion));
  }
  if (data[5] != uint8_t(encoding)) {
    reject("value encoding " + std::to_string(data[5]) + ", this replica expects " +
           name_of(encoding));
  }
  const Layout l = payload_layout(plan, k, encoding);
  expect_field(data[6], l.index_bytes, "index width");
  expect_field(data[7], 0, "reserved byte");
  expect_field(get_u32(data + 8), plan.rows, "rows");
  expect_field(get_u32(data + 12), plan.cols, "cols");
  expect_field(get_u32(data + 16), plan.chunk_rows, "chunk rows");
  expect_field(get_u32(data + 20), plan.chunk_cols, "chunk cols");
  expect_field(get_u32(data + 24), l.k, "k");
  expect_field(get_u32(data + 28), int64_t(l.body_bytes), "body size");
  if (size != kWireHeaderBytes + l.body_bytes) {
    reject(std::string(size < kWireHeaderBytes + l.body_bytes ? "truncated" : "oversized") + ": " +
           std::to_string(size) + " bytes, expected " +
           std::to_string(kWireHeaderBytes + l.body_bytes));
  }
  const uint8_t* body = data + kWireHeaderBytes;
  if (checksum(body, l.body_bytes) != get_u32(data + 32)) reject("checksum mismatch");
  const int64_t limit = plan.chunk_numel();
  std::vector<int64_t> positions(l.k);
  for (int64_t c = 0; c < l.chunks; ++c) {
    const int64_t held = read_positions(body, l, limit, c, positions.data());
    if (held != l.k) {
      reject("chunk " + std::to_string(c) + "'s packed indices " +
             (held < 0 ? std::string("have padding bits set")
                       : "hold " + std::to_string(held) + " positions, expected " +
                             std::to_string(l.k)));
    }
    for (int64_t j = 0; j < l.k; ++j) {
      if (positions[j] >= limit) {
        reject("index " + std::to_string(positions[j]) + " outside a chunk of " +
               std::to_string(limit) + " coefficients");
      }
      if (j > 0 && positions[j] <= positions[j - 1]) {  // distinct: the GPU's decode never races
        reject("chunk " + std::to_string(c) + "'s indices are not strictly ascending");
      }
    }
  }
}

SparseChunks decode_mean_sparse(const std::vector<const uint8_t*>& payloads, size_t size,
                                const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding) {
  for (const uint8_t* p : payloads) validate_payload(p, size, plan, k, encoding);
  const Layout l = payload_layout(plan, k, encoding);
  const int64_t capacity = int64_t(payloads.size()) * l.k;
  SparseChunks out;
  out.positions = at::empty({l.chunks, capacity}, at::kInt);
  out.values = at::empty({l.chunks, capacity}, at::kFloat);
  out.counts = at::empty({l.chunks}, at::kLong);
  int32_t* positions = out.positions.data_ptr<int32_t>();
  float* values = out.values.data_ptr<float>();
  int64_t* counts = out.counts.data_ptr<int64_t>();

  at::parallel_for(0, l.chunks, 16, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> slot(plan.chunk_numel(), -1);  // per coefficient: its entry, or -1
    std::vector<uint32_t> seen(capacity);               // per entry: how many replicas sent it
    std::vector<int64_t> chunk_positions(l.k);
    for (int64_t c = begin; c < end; ++c) {
      int32_t* pos_out = positions + c * capacity;
      float* val_out = values + c * capacity;
      int64_t count = 0;
      for (const uint8_t* payload : payloads) {  // rank order: the same sums on every replica
        const uint8_t* body = payload + kWireHeaderBytes;
        read_positions(body, l, plan.chunk_numel(), c, chunk_positions.data());
        for (int64_t e = c * l.k; e < (c + 1) * l.k; ++e) {
          const int64_t pos = chunk_positions[e - c * l.k];
          int32_t& s = slot[pos];
          if (s < 0) {
            s = int32_t(count++);
            pos_out[s] = int32_t(pos);
            val_out[s] = 0.0f;
            seen[s] = 0;
          }
          val_out[s] += read_value(body, l, encoding, e);
          seen[s] += 1;
        }
      }
      for (int64_t s = 0; s < count; ++s) {  // divide once per coefficient, reset the slots
        val_out[s] = cm::mean_of(val_out[s], seen[s]);
        slot[pos_out[s]] = -1;
      }
      counts[c] = count;
    }
  });
  return out;
}

void decode_mean(const std::vector<const uint8_t*>& payloads, size_t size,
                 const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding,
                 const at::Tensor& out) {
  if (out.scalar_type() != at::kFloat || !out.is_contiguous() || !out.is_cpu() ||
      out.numel() != plan.padded_numel()) {
    throw std::invalid_argument("decode_mean: out must be a contiguous float32 CPU tensor of " +
                                std::to_string(plan.padded_numel()) + " elements");
  }
  const SparseChunks sparse = decode_mean_sparse(payloads, size, plan, k, encoding);
  const int64_t capacity = sparse.positions.size(1);
  const int32_t* positions = sparse.positions.data_ptr<int32_t>();
  const float* values = sparse.values.data_ptr<float>();
  const int64_t* counts = sparse.counts.data_ptr<int64_t>();
  out.zero_();
  float* dst = out.data_ptr<float>();
  for (int64_t c = 0; c < plan.num_chunks(); ++c) {
    float* base = dst + plan.chunk_origin(c);
    for (int64_t e = c * capacity; e < c * capacity + counts[c]; ++e) {
      base[plan.offset_in_chunk(positions[e])] = values[e];
    }
  }
}

}  // namespace flexdemo::compress
