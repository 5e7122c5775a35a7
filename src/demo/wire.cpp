// The wire format: encode one tensor's top-k into a self-describing payload, validate a
// received payload completely before use, and decode R payloads into their per-coefficient mean.
#include "flexdemo/compress.h"

#include "demo/chunk_math.h"
#include "demo/codec.h"
#include "demo/screen.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <caffe2/serialize/crc_alt.h>  // CRC-32 (zlib's polynomial), in every LibTorch

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace flexdemo::compress {

namespace cm = kernels::chunk_math;
namespace codec = demo::codec;
using codec::get_u32;
using codec::kHeaderBytes;
using codec::Layout;
using codec::put_u32;

namespace {

Layout layout_of(const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding) {
  return codec::layout(plan.num_chunks(), plan.chunk_numel(), k, encoding);
}

// CRC-32 of the body. Slicing-by-16 reads 4-byte words, so the bytes before the first 4-byte
// boundary (a payload starts anywhere in its bucket) go through the bytewise table first.
uint32_t checksum(const uint8_t* body, size_t n) {
  const size_t head = std::min(n, (4 - reinterpret_cast<uintptr_t>(body) % 4) % 4);
  return crc32_16bytes(body + head, n - head, crc32_1byte(body, head));
}

uint32_t to_u32(int64_t v, const char* what) {
  if (v < 0 || v > int64_t(std::numeric_limits<uint32_t>::max())) {
    throw std::invalid_argument(std::string("wire format: ") + what + " " + std::to_string(v) +
                                " does not fit 32 bits");
  }
  return uint32_t(v);
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
  return size_t(kHeaderBytes + layout_of(plan, k, encoding).body_bytes);
}

void encode_payload(const dct::ChunkPlan& plan, TopK& topk, ValueEncoding encoding, uint8_t* dst) {
  const Layout l = layout_of(plan, topk.k, encoding);
  if (l.k != topk.k || topk.indices.numel() != l.entries || topk.values.numel() != l.entries) {
    throw std::invalid_argument("encode_payload: top-k does not match the chunk plan");
  }
  uint8_t* body = dst + kHeaderBytes;
  const int64_t* idx = topk.indices.data_ptr<int64_t>();
  float* val = topk.values.data_ptr<float>();
  std::memset(body, 0, size_t(l.body_bytes));
  for (int64_t c = 0; c < l.chunks; ++c) {
    codec::put_chunk<codec::PlainBytes>(body, l, encoding, c, idx + c * l.k, val + c * l.k);
  }
  seal_payload(plan, topk.k, encoding, dst);
}

void seal_payload(const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding, uint8_t* dst) {
  const Layout l = layout_of(plan, k, encoding);
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
  put_u32(dst + 28, to_u32(l.body_bytes, "body bytes"));
  put_u32(dst + 32, checksum(dst + kHeaderBytes, size_t(l.body_bytes)));
}

void validate_payload(const uint8_t* data, size_t size, const dct::ChunkPlan& plan, int64_t k,
                      ValueEncoding encoding) {
  if (size < size_t(kHeaderBytes)) {
    reject("truncated: " + std::to_string(size) + " bytes, the header alone is " +
           std::to_string(kHeaderBytes));
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
  const Layout l = layout_of(plan, k, encoding);
  expect_field(data[6], l.index_bytes, "index width");
  expect_field(data[7], 0, "reserved byte");
  expect_field(get_u32(data + 8), plan.rows, "rows");
  expect_field(get_u32(data + 12), plan.cols, "cols");
  expect_field(get_u32(data + 16), plan.chunk_rows, "chunk rows");
  expect_field(get_u32(data + 20), plan.chunk_cols, "chunk cols");
  expect_field(get_u32(data + 24), l.k, "k");
  expect_field(get_u32(data + 28), l.body_bytes, "body size");
  const size_t expected = size_t(kHeaderBytes + l.body_bytes);
  if (size != expected) {
    reject(std::string(size < expected ? "truncated" : "oversized") + ": " + std::to_string(size) +
           " bytes, expected " + std::to_string(expected));
  }
  const uint8_t* body = data + kHeaderBytes;
  if (checksum(body, size_t(l.body_bytes)) != get_u32(data + 32)) reject("checksum mismatch");
  const int64_t limit = plan.chunk_numel();
  std::vector<int64_t> positions(l.k);
  for (int64_t c = 0; c < l.chunks; ++c) {
    const int64_t held = codec::get_positions(body, l, c, positions.data());
    if (held != l.k) {
      reject("chunk " + std::to_string(c) + "'s packed indices " +
             (held < 0 ? std::string("have padding bits set")
                       : "hold " + std::to_string(held) + " positions, expected " +
                             std::to_string(l.k)));
    }
    // Checked without a branch per entry; which one is wrong, and how, only where one is.
    bool valid = l.k == 0 || positions[l.k - 1] < limit;
    for (int64_t j = 1; j < l.k; ++j) valid &= positions[j] > positions[j - 1];
    if (valid) continue;
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

PayloadValues scan_payload_values(const uint8_t* data, const dct::ChunkPlan& plan, int64_t k,
                                  ValueEncoding encoding) {
  const Layout l = layout_of(plan, k, encoding);
  const uint8_t* body = data + kHeaderBytes;
  PayloadValues scan;
  std::vector<float> values(size_t(l.k));
  // codec::chunk_squares' sums in codec.h's order (the GPU's screening sums the same way), the
  // chunk's values unpacked at once.
  for (int64_t run = 0; run < l.chunks; run += codec::kScreenRun) {
    double run_sum = 0.0;
    for (int64_t c = run; c < std::min(l.chunks, run + codec::kScreenRun); ++c) {
      codec::get_values(body, l, encoding, c, values.data());
      double chunk_sum = 0.0;
      for (const float v : values) {
        scan.finite = scan.finite && codec::finite_value(v);
        chunk_sum += double(v) * double(v);
      }
      run_sum += chunk_sum;
    }
    scan.sum_squares += run_sum;
  }
  return scan;
}

void tamper_payload(uint8_t* data, const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding,
                    Tamper how, double factor) {
  const Layout l = layout_of(plan, k, encoding);
  uint8_t* body = data + kHeaderBytes;
  if (how == Tamper::Corrupt) {
    body[l.body_bytes / 2] ^= 0x10;  // the checksum no longer matches
    return;
  }
  const float f = float(factor);
  if (codec::scales_per_chunk(encoding) > 0) {  // every value is a code times its chunk's scales
    for (int64_t s = 0; s < l.chunks * codec::scales_per_chunk(encoding); ++s) {
      uint8_t* at = body + l.scales_at + 4 * s;
      codec::put_f32(at, codec::get_f32(at) * f);
    }
  } else {
    for (int64_t e = 0; e < l.entries; ++e) {  // fp32, bf16: whole bytes a value
      const float v = codec::get_value(body, l, encoding, e) * f;
      codec::put_value<codec::PlainBytes>(body, l, encoding, e, v, codec::ChunkScales{});
    }
  }
  seal_payload(plan, k, encoding, data);
}

SparseChunks decode_mean_sparse(const std::vector<const uint8_t*>& payloads, size_t size,
                                const dct::ChunkPlan& plan, int64_t k, ValueEncoding encoding) {
  for (const uint8_t* p : payloads) validate_payload(p, size, plan, k, encoding);
  return demo::mean_of_screened(payloads, plan, k, encoding);
}

}  // namespace flexdemo::compress

namespace flexdemo::demo {

compress::SparseChunks mean_of_screened(const std::vector<const uint8_t*>& payloads,
                                        const dct::ChunkPlan& plan, int64_t k,
                                        compress::ValueEncoding encoding) {
  using compress::SparseChunks;
  namespace cm = kernels::chunk_math;
  const codec::Layout l = codec::layout(plan.num_chunks(), plan.chunk_numel(), k, encoding);
  const int64_t capacity = int64_t(payloads.size()) * l.k;
  SparseChunks out;
  out.positions = at::empty({l.chunks, capacity}, at::kInt);
  out.values = at::empty({l.chunks, capacity}, at::kFloat);
  out.counts = at::empty({l.chunks}, at::kLong);
  int32_t* positions = out.positions.data_ptr<int32_t>();
  float* values = out.values.data_ptr<float>();
  int64_t* counts = out.counts.data_ptr<int64_t>();

  const bool alone = payloads.size() == 1;  // no sums: no slots, no replicas' counts
  at::parallel_for(0, l.chunks, 16, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> slot(plan.chunk_numel(), -1);  // per coefficient: its entry, or -1
    std::vector<uint32_t> seen(capacity);               // per entry: how many replicas sent it
    std::vector<int64_t> chunk_positions(l.k);
    std::vector<float> chunk_values(l.k);
    for (int64_t c = begin; c < end; ++c) {
      int32_t* pos_out = positions + c * capacity;
      float* val_out = values + c * capacity;
      int64_t count = 0;
      for (const uint8_t* payload : payloads) {  // rank order: the same sums on every replica
        const uint8_t* body = payload + codec::kHeaderBytes;
        codec::get_positions(body, l, c, chunk_positions.data());
        codec::get_values(body, l, encoding, c, chunk_values.data());
        if (count == 0) {  // the first payload: its positions are distinct, each a new entry
          for (int64_t j = 0; j < l.k; ++j) {
            pos_out[j] = int32_t(chunk_positions[j]);
            val_out[j] = 0.0f + chunk_values[j];  // as the sum below starts: -0 becomes +0
          }
          count = l.k;
          if (alone) break;  // one payload: its values are the means (mean_of(x, 1) is x)
          for (int64_t j = 0; j < l.k; ++j) {
            slot[chunk_positions[j]] = int32_t(j);
            seen[j] = 1;
          }
          continue;
        }
        for (int64_t j = 0; j < l.k; ++j) {
          const int64_t pos = chunk_positions[j];
          int32_t& s = slot[pos];
          if (s < 0) {
            s = int32_t(count++);
            pos_out[s] = int32_t(pos);
            val_out[s] = 0.0f;
            seen[s] = 0;
          }
          val_out[s] += chunk_values[j];
          seen[s] += 1;
        }
      }
      for (int64_t s = 0; s < count && !alone; ++s) {  // divide once a coefficient, reset slots
        val_out[s] = cm::mean_of(val_out[s], seen[s]);
        slot[pos_out[s]] = -1;
      }
      counts[c] = count;
    }
  });
  return out;
}

}  // namespace flexdemo::demo

namespace flexdemo::compress {

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

namespace flexdemo::demo {

std::optional<optim::PeerFault> check_payload(const uint8_t* payload, const dct::ChunkPlan& plan,
                                              int64_t k, compress::ValueEncoding encoding,
                                              int replica, size_t tensor, double* norm) {
  optim::PeerFault fault;
  fault.replica = replica;
  fault.tensor = tensor;
  try {
    compress::validate_payload(payload, compress::wire_payload_bytes(plan, k, encoding), plan, k,
                               encoding);
  } catch (const compress::WireFormatError& e) {
    fault.detail = e.what();
    return fault;
  }
  const compress::PayloadValues scan = compress::scan_payload_values(payload, plan, k, encoding);
  if (!scan.finite) {
    fault.kind = optim::PeerFault::Kind::NonFinite;
    return fault;
  }
  *norm = std::sqrt(scan.sum_squares);
  return std::nullopt;
}

std::vector<optim::PeerFault> screen_payloads(const uint8_t* gathered, int replicas,
                                              size_t replica_bytes,
                                              const std::vector<dct::ChunkPlan>& plans,
                                              const std::vector<size_t>& offsets, int64_t k,
                                              compress::ValueEncoding encoding,
                                              double scale_bound) {
  std::vector<optim::PeerFault> found;
  std::vector<double> norms(size_t(replicas), 0.0);
  std::vector<char> judged(size_t(replicas), 0);  // passed the other checks: its norm counts
  for (size_t t = 0; t < plans.size(); ++t) {
    for (int r = 0; r < replicas; ++r) {
      const uint8_t* payload = gathered + size_t(r) * replica_bytes + offsets[t];
      const std::optional<optim::PeerFault> fault =
          check_payload(payload, plans[t], k, encoding, r, t, &norms[r]);
      judged[r] = !fault;
      if (fault) found.push_back(*fault);
    }
    add_out_of_scale(norms, judged, t, scale_bound, found);
  }
  return found;
}

void add_out_of_scale(const std::vector<double>& norms, const std::vector<char>& judged,
                      size_t tensor, double scale_bound, std::vector<optim::PeerFault>& found) {
  if (!(scale_bound > 0)) return;
  std::vector<double> sorted;
  for (size_t r = 0; r < norms.size(); ++r) {
    if (judged[r]) sorted.push_back(norms[r]);
  }
  if (sorted.size() < 2) return;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[(sorted.size() - 1) / 2];  // the lower one
  for (size_t r = 0; r < norms.size(); ++r) {
    if (!judged[r] || !(median > 0.0) || norms[r] <= scale_bound * median) continue;
    optim::PeerFault fault;
    fault.kind = optim::PeerFault::Kind::OutOfScale;
    fault.replica = int(r);
    fault.tensor = tensor;
    fault.ratio = norms[r] / median;
    found.push_back(fault);
  }
}

}  // namespace flexdemo::demo
