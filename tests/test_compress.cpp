// Top-k against a sort-based reference, the wire format's round trip and closed-form size,
// rejection of malformed payloads, and decode-aggregate against a naive mean.
#include "demo/codec.h"
#include "demo/screen.h"
#include "flexdemo/compress.h"
#include "demo/kernels.h"
#include "isa.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <vector>

using namespace flexdemo;
using compress::ValueEncoding;

namespace {

namespace codec = demo::codec;
const std::vector<ValueEncoding> kAllEncodings = values_of<ValueEncoding>();

// Sort-based reference: per chunk, positions by descending magnitude (ties: lower position).
std::vector<std::vector<int64_t>> reference_topk(const at::Tensor& coeffs, const dct::ChunkPlan& p,
                                                 int64_t k) {
  auto c = coeffs.accessor<float, 2>();
  std::vector<std::vector<int64_t>> result;
  for (int64_t i0 = 0; i0 < p.padded_rows; i0 += p.chunk_rows) {
    for (int64_t j0 = 0; j0 < p.padded_cols; j0 += p.chunk_cols) {
      std::vector<std::pair<float, int64_t>> all;
      for (int64_t u = 0; u < p.chunk_rows; ++u)
        for (int64_t v = 0; v < p.chunk_cols; ++v)
          all.push_back({std::fabs(c[i0 + u][j0 + v]), u * p.chunk_cols + v});
      std::stable_sort(all.begin(), all.end(),
                       [](const auto& a, const auto& b) { return a.first > b.first; });
      std::vector<int64_t> kept;
      for (int64_t j = 0; j < std::min<int64_t>(k, int64_t(all.size())); ++j)
        kept.push_back(all[j].second);
      std::sort(kept.begin(), kept.end());
      result.push_back(kept);
    }
  }
  return result;
}

std::vector<uint8_t> encode(const dct::ChunkPlan& plan, compress::TopK& topk, ValueEncoding e) {
  std::vector<uint8_t> bytes(compress::wire_payload_bytes(plan, topk.k, e));
  compress::encode_payload(plan, topk, e, bytes.data());
  return bytes;
}

// fp8 e4m3 (OCP E4M3FN) by search: |x| saturated to 448, then the nearest of the finite codes'
// values (in double), ties to the even code; NaN for NaN.
float reference_fp8(float x) {
  if (std::isnan(x)) return x;
  const double target = std::max(-448.0, std::min(448.0, double(x)));
  double best = 0.0, best_err = INFINITY;
  int best_code = 0;
  for (int code = 0; code < 256; ++code) {
    const int e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) continue;  // NaN
    const double magnitude =
        e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
    const double value = code & 0x80 ? -magnitude : magnitude;
    const double err = std::fabs(target - value);
    if (err < best_err || (err == best_err && (code & 1) == 0 && (best_code & 1) == 1)) {
      best = value, best_err = err, best_code = code;
    }
  }
  return float(best);
}

void put_u32(uint8_t* p, uint32_t v) {
  for (int b = 0; b < 4; ++b) p[b] = uint8_t(v >> (8 * b));
}

void refresh_checksum(std::vector<uint8_t>& bytes) {
  const uint8_t* body = bytes.data() + codec::kHeaderBytes;
  put_u32(bytes.data() + 32, uint32_t(crc32(0L, body, uInt(bytes.size() - codec::kHeaderBytes))));
}

}  // namespace

TEST(TopK, MatchesSortBasedReference) {
  at::manual_seed(10);
  for (auto mode : {dct::ChunkMode::Divisor, dct::ChunkMode::Padded}) {
    dct::ChunkPlan plan = dct::make_chunk_plan({24, 40}, 16, mode);
    at::Tensor coeffs = at::randn({plan.padded_rows, plan.padded_cols});
    for (int64_t k : {1, 5, 37}) {
      std::vector<compress::TopK> results = {compress::select_topk_plain(coeffs, plan, k)};
      for (kernels::Isa isa : isa_testing::supported_isas()) {
        isa_testing::ScopedIsa scoped(isa);
        results.push_back(kernels::select_topk(coeffs, plan, k));
      }
      const auto want = reference_topk(coeffs, plan, k);
      for (const compress::TopK& t : results) {
        ASSERT_EQ(t.indices.size(0), int64_t(want.size()));
        for (size_t c = 0; c < want.size(); ++c) {
          for (int64_t j = 0; j < k; ++j) {
            const int64_t pos = t.indices[c][j].item<int64_t>();
            EXPECT_EQ(pos, want[c][j]) << "chunk " << c << " k " << k;
            const float expect =
                coeffs.view(-1)[plan.chunk_origin(c) + plan.offset_in_chunk(pos)].item<float>();
            EXPECT_EQ(t.values[c][j].item<float>(), expect);
          }
        }
      }
    }
  }
}

TEST(TopK, FastSelectionEqualsHeapOnTiesAndZeros) {
  // Few distinct magnitudes (many ties, whole chunks of zeros), and Gaussian values with a few
  // huge ones, infinities and NaN: the partial selection must pick what the heap picks, ties
  // broken by the lower position, in every instruction set.
  at::manual_seed(11);
  dct::ChunkPlan plan = dct::make_chunk_plan({64, 128}, 64, dct::ChunkMode::Divisor);
  at::Tensor ties = at::randint(-3, 4, {64, 128}).to(at::kFloat);
  ties.narrow(1, 64, 64).zero_();
  at::Tensor spiky = at::randn({64, 128});
  spiky.view(-1).index_put_({at::randint(0, 64 * 128, {40})}, 1e30f);
  spiky[3][5] = INFINITY;
  spiky[40][100] = -INFINITY;
  spiky[7][70] = NAN;
  for (const at::Tensor& coeffs : {ties, spiky}) {
    for (int64_t k : {1, 32, 511, 1000, 4096}) {
      compress::TopK plain = compress::select_topk_plain(coeffs, plan, k);
      for (kernels::Isa isa : isa_testing::supported_isas()) {
        isa_testing::ScopedIsa scoped(isa);
        compress::TopK fast = kernels::select_topk(coeffs, plan, k);
        EXPECT_TRUE(at::equal(fast.indices, plain.indices)) << "k " << k << " " << to_string(isa);
        EXPECT_TRUE(at::allclose(fast.values, plain.values, 0, 0, /*equal_nan=*/true))
            << "k " << k << " " << to_string(isa);
      }
    }
  }
}

TEST(TopK, ClampsKAndBreaksTiesByLowerIndex) {
  dct::ChunkPlan plan = dct::make_chunk_plan({8}, 8, dct::ChunkMode::Divisor);
  EXPECT_EQ(compress::clamp_topk(100, plan), 8);
  EXPECT_EQ(compress::clamp_topk(0, plan), 1);
  at::Tensor ties = at::tensor({1.f, -1.f, 1.f, 0.5f, -1.f, 1.f, 0.f, 1.f}).view({1, 8});
  compress::TopK t = kernels::select_topk(ties, plan, 3);
  EXPECT_TRUE(at::equal(t.indices, at::tensor({0L, 1L, 2L}).view({1, 3})));
  compress::TopK all = kernels::select_topk(ties, plan, 100);
  EXPECT_EQ(all.k, 8);
}

TEST(WireFormat, IndexWidthIsNarrowestLossless) {
  EXPECT_EQ(codec::index_bytes_for(256), 1);
  EXPECT_EQ(codec::index_bytes_for(257), 2);
  EXPECT_EQ(codec::index_bytes_for(65536), 2);
  EXPECT_EQ(codec::index_bytes_for(65537), 4);
}

TEST(WireFormat, PayloadSizeIsClosedForm) {
  // 128 x 128 in 64 x 64 chunks: 4 chunks of 4096 coefficients, k = 32 -> 128 entries of 2 bytes.
  dct::ChunkPlan plan = dct::make_chunk_plan({128, 128}, 64, dct::ChunkMode::Divisor);
  EXPECT_EQ(compress::wire_payload_bytes(plan, 32, ValueEncoding::Fp32), 36u + 256 + 512);
  EXPECT_EQ(compress::wire_payload_bytes(plan, 32, ValueEncoding::Bf16), 36u + 256 + 256);
  EXPECT_EQ(compress::wire_payload_bytes(plan, 32, ValueEncoding::Int8), 36u + 256 + 16 + 128);
  EXPECT_EQ(compress::wire_payload_bytes(plan, 32, ValueEncoding::Sign), 36u + 256 + 16 + 16);
  // 2bit: per chunk a packed record of 32 * 7 low bits + a 63-bit bitmap (36 bytes), two fp32
  // levels, and 32 values of 2 bits: 1.5 bytes per kept coefficient before the header.
  EXPECT_EQ(compress::wire_payload_bytes(plan, 32, ValueEncoding::TwoBit),
            36u + 4 * 36 + 4 * 8 + 4 * 8);
  // fp8: the same records, one fp32 scale a chunk, a byte a value: 2.25 bytes per coefficient.
  EXPECT_EQ(compress::wire_payload_bytes(plan, 32, ValueEncoding::Fp8), 36u + 4 * 36 + 4 * 4 + 128);
  // A vector of 192 in chunks of 64: 3 chunks, 1-byte indices.
  dct::ChunkPlan vec = dct::make_chunk_plan({192}, 64, dct::ChunkMode::Divisor);
  EXPECT_EQ(compress::wire_payload_bytes(vec, 32, ValueEncoding::Bf16), 36u + 96 + 192);
}

TEST(WireFormat, RoundTripEveryEncoding) {
  at::manual_seed(11);
  dct::ChunkPlan plan = dct::make_chunk_plan({40, 72}, 16, dct::ChunkMode::Padded);
  at::Tensor coeffs = at::randn({plan.padded_rows, plan.padded_cols});
  for (ValueEncoding e : kAllEncodings) {
    compress::TopK t = kernels::select_topk(coeffs, plan, 7);
    const at::Tensor original = t.values.clone();
    std::vector<uint8_t> bytes = encode(plan, t, e);
    at::Tensor out = at::empty({plan.padded_numel()});
    compress::decode_mean({bytes.data()}, bytes.size(), plan, 7, e, out);

    // The decoded tensor holds exactly the (quantised) values at the selected positions.
    at::Tensor expected = at::zeros({plan.padded_numel()});
    for (int64_t c = 0; c < plan.num_chunks(); ++c)
      for (int64_t j = 0; j < t.k; ++j)
        expected[plan.chunk_origin(c) + plan.offset_in_chunk(t.indices[c][j].item<int64_t>())] =
            t.values[c][j];
    EXPECT_TRUE(at::equal(out, expected)) << name_of(e);

    // Quantisation error within what the encoding promises.
    const at::Tensor err = (t.values - original).abs();
    switch (e) {
      case ValueEncoding::Fp32:
        EXPECT_TRUE(at::equal(t.values, original));
        break;
      case ValueEncoding::Bf16:
        EXPECT_TRUE(at::all(err <= original.abs() * (1.0 / 256)).item<bool>());
        break;
      case ValueEncoding::Int8: {
        const at::Tensor scale = std::get<0>(original.abs().max(1, true)) / 127.0;
        EXPECT_TRUE(at::all(err <= scale * 0.5001).item<bool>());
        break;
      }
      case ValueEncoding::Sign: {
        const at::Tensor mean_abs = original.abs().mean(1, true).expand_as(original);
        EXPECT_TRUE(at::allclose(t.values.abs(), mean_abs, 1e-6, 1e-7));
        EXPECT_TRUE(at::equal(t.values.sign(), original.sign()));
        break;
      }
      case ValueEncoding::TwoBit: {  // per chunk, float64: above the mean |v| or not, group means
        const at::Tensor a = original.abs().to(at::kDouble);
        const at::Tensor large = a > a.mean(1, true);
        const at::Tensor ones = at::ones_like(a);
        const at::Tensor level_large =
            (a * large).sum(1, true) / (ones * large).sum(1, true).clamp_min(1);
        const at::Tensor level_small =
            (a * ~large).sum(1, true) / (ones * ~large).sum(1, true).clamp_min(1);
        const at::Tensor want = at::where(large, level_large, level_small);
        EXPECT_TRUE(at::allclose(t.values.abs().to(at::kDouble), want, 1e-6, 1e-7));
        EXPECT_TRUE(at::equal(t.values.sign(), original.sign()));
        EXPECT_TRUE(at::all(err <= a.to(at::kFloat)).item<bool>());
        break;
      }
      case ValueEncoding::Fp8: {  // per chunk: the nearest e4m3 code of v / (max |v| / 448)
        const at::Tensor scale = std::get<0>(original.abs().max(1, true)) / 448.0f;
        for (int64_t c = 0; c < original.size(0); ++c) {
          const float s = scale[c][0].item<float>();
          for (int64_t j = 0; j < original.size(1); ++j) {
            const float want = reference_fp8(original[c][j].item<float>() / s) * s;
            ASSERT_EQ(t.values[c][j].item<float>(), want) << "chunk " << c << " entry " << j;
          }
        }
        break;
      }
    }
  }
  EXPECT_THROW(parse_name<compress::ValueEncoding>("fp16"), std::invalid_argument);
}

// fp8's rounding against the search above: every code's value and the midpoints between
// neighbours (the ties), their neighbouring floats, and floats spread over every exponent.
TEST(WireFormat, Fp8RoundsToNearestEvenAndSaturates) {
  std::vector<float> xs = {0.0f, -0.0f, 448.0f, 464.0f, 479.0f, 1e6f, INFINITY, -INFINITY, 1e-30f};
  for (int code = 0; code < 0x7e; ++code) {  // 0x7e: 448, the largest; 0x7f: NaN
    const float v = codec::fp8_value(uint8_t(code)), next = codec::fp8_value(uint8_t(code + 1));
    const float mid = float((double(v) + double(next)) / 2);
    for (float x : {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  for (uint32_t bits = 0; bits < 0x7f800000u; bits += 0x1000u + 7u) {
    float x;
    std::memcpy(&x, &bits, 4);
    xs.push_back(x);
  }
  for (float x : xs) {
    const float got = codec::fp8_value(codec::fp8_bits(x));
    ASSERT_EQ(got, reference_fp8(x)) << x;
    ASSERT_EQ(std::signbit(got), std::signbit(x)) << x;
  }
  EXPECT_TRUE(std::isnan(codec::fp8_value(codec::fp8_bits(NAN))));
}

TEST(WireFormat, RejectsMalformedPayloads) {
  at::manual_seed(12);
  dct::ChunkPlan plan = dct::make_chunk_plan({32, 32}, 16, dct::ChunkMode::Divisor);
  at::Tensor coeffs = at::randn({32, 32});
  compress::TopK t = kernels::select_topk(coeffs, plan, 4);
  const std::vector<uint8_t> good = encode(plan, t, ValueEncoding::Bf16);
  auto expect_reject = [&](const std::vector<uint8_t>& bytes, const std::string& why) {
    try {
      compress::validate_payload(bytes.data(), bytes.size(), plan, 4, ValueEncoding::Bf16);
      ADD_FAILURE() << "accepted a payload with " << why;
    } catch (const compress::WireFormatError& err) {
      EXPECT_NE(std::string(err.what()).find(why), std::string::npos) << err.what();
    }
  };
  compress::validate_payload(good.data(), good.size(), plan, 4, ValueEncoding::Bf16);

  expect_reject(std::vector<uint8_t>(good.begin(), good.begin() + 20), "truncated");
  expect_reject(std::vector<uint8_t>(good.begin(), good.end() - 1), "truncated");
  std::vector<uint8_t> longer(good.begin(), good.end());
  longer.push_back(0);
  expect_reject(longer, "oversized");
  std::vector<uint8_t> magic(good.begin(), good.end());
  magic[0] ^= 0xff;
  expect_reject(magic, "magic");
  std::vector<uint8_t> version(good.begin(), good.end());
  version[4] = 1;
  expect_reject(version, "version 1");
  std::vector<uint8_t> encoding(good.begin(), good.end());
  encoding[5] = uint8_t(ValueEncoding::Fp32);
  expect_reject(encoding, "value encoding");
  std::vector<uint8_t> shape(good.begin(), good.end());
  shape[8] = 31;  // rows 32 -> 31
  expect_reject(shape, "rows");
  std::vector<uint8_t> corrupt(good.begin(), good.end());
  corrupt[corrupt.size() - 1] ^= 0x01;
  expect_reject(corrupt, "checksum");
  // Chunks of 1024 coefficients use 2-byte indices, so an index outside its chunk is expressible.
  dct::ChunkPlan wide = dct::make_chunk_plan({32, 32}, 32, dct::ChunkMode::Divisor);
  compress::TopK tw = kernels::select_topk(at::randn({32, 32}), wide, 4);
  std::vector<uint8_t> bad_index = encode(wide, tw, ValueEncoding::Fp32);
  put_u32(bad_index.data() + codec::kHeaderBytes, 1024);  // 2-byte index 1024 >= 1024
  refresh_checksum(bad_index);
  try {
    compress::validate_payload(bad_index.data(), bad_index.size(), wide, 4, ValueEncoding::Fp32);
    ADD_FAILURE() << "accepted an out-of-range index";
  } catch (const compress::WireFormatError& err) {
    EXPECT_NE(std::string(err.what()).find("index 1024"), std::string::npos) << err.what();
  }
  at::Tensor out = at::empty({1024});
  EXPECT_THROW(compress::decode_mean({bad_index.data()}, bad_index.size(), wide, 4,
                                     ValueEncoding::Fp32, out),
               compress::WireFormatError);
}

// Packed indices (2bit): a record per chunk of the closed-form size, read back exactly, for chunk
// sizes that are and are not powers of two and k from 1 to the whole chunk.
TEST(WireFormat, ValueScanAndTamperingAsAReceiverSeesThem) {
  // scan_payload_values: the sum of squares of what a receiver decodes (encode_payload leaves
  // exactly that in topk.values), computed here in float64 from those values; a tampered payload
  // still validates after Scale (re-sealed) and fails its checksum after Corrupt.
  at::manual_seed(13);
  const dct::ChunkPlan plan = dct::make_chunk_plan({32, 48}, 16, dct::ChunkMode::Divisor);
  for (auto e : values_of<ValueEncoding>()) {
    compress::TopK t = kernels::select_topk(at::randn({32, 48}), plan, 5);
    std::vector<uint8_t> bytes = encode(plan, t, e);
    const double expected = t.values.to(at::kDouble).square().sum().item<double>();
    const compress::PayloadValues scan = compress::scan_payload_values(bytes.data(), plan, 5, e);
    EXPECT_TRUE(scan.finite) << name_of(e);
    EXPECT_NEAR(scan.sum_squares, expected, 1e-9 * expected) << name_of(e);

    std::vector<uint8_t> scaled = bytes;
    compress::tamper_payload(scaled.data(), plan, 5, e, compress::Tamper::Scale, 1000.0);
    compress::validate_payload(scaled.data(), scaled.size(), plan, 5, e);
    const double ratio =
        std::sqrt(compress::scan_payload_values(scaled.data(), plan, 5, e).sum_squares / expected);
    EXPECT_NEAR(ratio, 1000.0, 1000.0 * 1e-2) << name_of(e);  // bf16 rounds each value

    std::vector<uint8_t> nan = bytes;
    compress::tamper_payload(nan.data(), plan, 5, e, compress::Tamper::Scale, NAN);
    compress::validate_payload(nan.data(), nan.size(), plan, 5, e);
    EXPECT_FALSE(compress::scan_payload_values(nan.data(), plan, 5, e).finite) << name_of(e);

    std::vector<uint8_t> corrupt = bytes;
    compress::tamper_payload(corrupt.data(), plan, 5, e, compress::Tamper::Corrupt);
    EXPECT_THROW(compress::validate_payload(corrupt.data(), corrupt.size(), plan, 5, e),
                 compress::WireFormatError)
        << name_of(e);
  }
}

TEST(WireFormat, PackedIndicesRoundTripAtEveryShape) {
  at::manual_seed(14);
  for (int64_t chunk : {4, 12, 16, 64}) {
    const dct::ChunkPlan plan =
        dct::make_chunk_plan({2 * chunk, 3 * chunk}, chunk, dct::ChunkMode::Divisor);
    const int64_t n = plan.chunk_numel();
    for (int64_t k : {int64_t(1), int64_t(3), n / 8 + 1, n / 2, n - 1, n}) {
      if (k < 1) continue;
      compress::TopK t = kernels::select_topk(at::randn({2 * chunk, 3 * chunk}), plan, k);
      const std::vector<uint8_t> bytes = encode(plan, t, ValueEncoding::TwoBit);
      int low = 0;  // floor(log2(n / k)), by doubles
      while (double(k) * std::pow(2.0, low + 1) <= double(n)) ++low;
      const int64_t bits = k * low + (n - 1) / (int64_t(1) << low) + k;
      const size_t want = size_t(36 + plan.num_chunks() * ((bits + 7) / 8 + 8) +
                                 (2 * plan.num_chunks() * k + 7) / 8);
      EXPECT_EQ(bytes.size(), want) << "n " << n << " k " << k;
      const compress::SparseChunks back = compress::decode_mean_sparse(
          {bytes.data()}, bytes.size(), plan, k, ValueEncoding::TwoBit);
      EXPECT_TRUE(at::equal(back.positions.to(at::kLong), t.indices)) << "n " << n << " k " << k;
      EXPECT_TRUE(at::equal(back.values, t.values)) << "n " << n << " k " << k;
    }
  }
}

// A packed record that does not hold exactly k ascending positions, or sets a padding bit, is
// refused; so is every single-bit change of the index section (the checksum refreshed).
TEST(WireFormat, RejectsMalformedPackedIndices) {
  at::manual_seed(15);
  const dct::ChunkPlan plan = dct::make_chunk_plan({8, 8}, 8, dct::ChunkMode::Divisor);
  compress::TopK t = kernels::select_topk(at::randn({8, 8}), plan, 5);  // low 3, 12 bitmap bits
  const std::vector<uint8_t> good = encode(plan, t, ValueEncoding::TwoBit);
  const codec::Layout l =
      codec::layout(plan.num_chunks(), plan.chunk_numel(), 5, ValueEncoding::TwoBit);
  ASSERT_EQ(l.record_bytes, 4);  // 15 + 12 = 27 bits: 5 of padding
  int refused = 0, changes = 0;
  for (size_t bit = 0; bit < 8 * size_t(l.record_bytes); ++bit) {
    std::vector<uint8_t> bytes = good;
    bytes[codec::kHeaderBytes + bit / 8] ^= uint8_t(1u << (bit % 8));
    refresh_checksum(bytes);
    ++changes;
    // The GPU's one-pass check (codec::positions_valid) agrees with the host's validation.
    const bool valid = codec::positions_valid(bytes.data() + codec::kHeaderBytes, l, 0);
    try {
      compress::validate_payload(bytes.data(), bytes.size(), plan, 5, ValueEncoding::TwoBit);
      EXPECT_TRUE(valid) << "positions_valid refused what validate_payload took, bit " << bit;
      // A changed low bit can still spell 5 ascending positions: then they must differ.
      const compress::SparseChunks back = compress::decode_mean_sparse(
          {bytes.data()}, bytes.size(), plan, 5, ValueEncoding::TwoBit);
      EXPECT_LT(bit, 15u) << "accepted a change of bitmap or padding bit " << bit;
      EXPECT_FALSE(at::equal(back.positions.to(at::kLong), t.indices)) << bit;
    } catch (const compress::WireFormatError& err) {
      ++refused;
      EXPECT_FALSE(valid) << "positions_valid took what validate_payload refused, bit " << bit;
      const std::string what = err.what();
      EXPECT_TRUE(what.find("positions, expected 5") != std::string::npos ||
                  what.find("padding bits") != std::string::npos ||
                  what.find("not strictly ascending") != std::string::npos ||
                  what.find("outside a chunk") != std::string::npos)
          << what;
    }
  }
  EXPECT_GE(refused, 12 + 5) << "of " << changes;  // every bitmap and padding bit at least
}

// Positions a whole byte each (bf16's): every single-bit change of a chunk's positions (the
// checksum refreshed) is judged by codec::positions_valid, the GPU's one-pass check, as
// validate_payload judges it.
TEST(WireFormat, PositionsCheckOfOnePassAgreesWithValidation) {
  at::manual_seed(16);
  const dct::ChunkPlan plan = dct::make_chunk_plan({32, 32}, 16, dct::ChunkMode::Divisor);
  compress::TopK t = kernels::select_topk(at::randn({32, 32}), plan, 6);
  const std::vector<uint8_t> good = encode(plan, t, ValueEncoding::Bf16);
  const codec::Layout l =
      codec::layout(plan.num_chunks(), plan.chunk_numel(), 6, ValueEncoding::Bf16);
  ASSERT_EQ(l.index_bytes, 1);
  for (int64_t c = 0; c < l.chunks; ++c) {
    EXPECT_TRUE(codec::positions_valid(good.data() + codec::kHeaderBytes, l, c)) << c;
  }
  int refused = 0;
  for (size_t bit = 0; bit < 8 * size_t(l.k); ++bit) {  // chunk 1's positions
    std::vector<uint8_t> bytes = good;
    bytes[codec::kHeaderBytes + size_t(l.k) + bit / 8] ^= uint8_t(1u << (bit % 8));
    refresh_checksum(bytes);
    bool accepted = true;
    try {
      compress::validate_payload(bytes.data(), bytes.size(), plan, 6, ValueEncoding::Bf16);
    } catch (const compress::WireFormatError&) {
      accepted = false;
      ++refused;
    }
    EXPECT_EQ(codec::positions_valid(bytes.data() + codec::kHeaderBytes, l, 1), accepted) << bit;
    EXPECT_TRUE(codec::positions_valid(bytes.data() + codec::kHeaderBytes, l, 0)) << bit;
  }
  EXPECT_GT(refused, 0);  // some change leaves the chunk or breaks the order
}

TEST(DecodeMean, AveragesOverReplicasThatSelectedEachCoefficient) {
  at::manual_seed(13);
  dct::ChunkPlan plan = dct::make_chunk_plan({16, 24}, 8, dct::ChunkMode::Divisor);
  const int replicas = 3;
  const int64_t k = 6;
  std::vector<std::vector<uint8_t>> payloads;
  std::map<int64_t, std::vector<double>> selected;  // block-layout offset -> values sent
  for (int r = 0; r < replicas; ++r) {
    at::Tensor coeffs = at::randn({16, 24});
    coeffs.view(-1)[0] = 100.0f;  // every replica selects coefficient 0 of chunk 0
    compress::TopK t = kernels::select_topk(coeffs, plan, k);
    payloads.push_back(encode(plan, t, ValueEncoding::Fp32));
    for (int64_t c = 0; c < plan.num_chunks(); ++c)
      for (int64_t j = 0; j < k; ++j)
        selected[plan.chunk_origin(c) + plan.offset_in_chunk(t.indices[c][j].item<int64_t>())]
            .push_back(t.values[c][j].item<float>());
  }
  std::vector<const uint8_t*> views;
  for (auto& p : payloads) views.push_back(p.data());
  at::Tensor out = at::full({plan.padded_numel()}, 7.0f);  // must be overwritten
  compress::decode_mean(views, payloads[0].size(), plan, k, ValueEncoding::Fp32, out);

  at::Tensor want = at::zeros({plan.padded_numel()}, at::kDouble);
  for (auto& [offset, values] : selected) {
    double sum = 0;
    for (double v : values) sum += v;
    want[offset] = sum / double(values.size());
  }
  EXPECT_EQ(selected[0].size(), size_t(replicas));
  EXPECT_TRUE(at::allclose(out.to(at::kDouble), want, 1e-6, 1e-6));
  EXPECT_EQ(at::count_nonzero(out).item<int64_t>(), int64_t(selected.size()));
}

// The bfloat16 rounding the CPU and GPU encoders share (demo/codec.h) is LibTorch's own, on every
// bit pattern class: random floats, ties, the largest finite values, infinities, NaN, zeros.
TEST(ChunkMath, Bf16RoundingIsLibTorchs) {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -1.0f,
                               3.4028235e38f,
                               -3.4028235e38f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               1e-40f,
                               -1e-45f};
  for (uint32_t tie : {0x3f808000u, 0x3f818000u, 0x7f7f8000u, 0x00008000u}) {
    float x;
    std::memcpy(&x, &tie, 4);
    values.push_back(x);
    values.push_back(-x);
  }
  const at::Tensor random = at::randn({100000}) * 1000.0;
  for (int64_t i = 0; i < random.numel(); ++i) values.push_back(random[i].item<float>());
  for (float x : values) {
    const c10::BFloat16 reference(x);
    const uint16_t bits = codec::bf16_bits(x);
    ASSERT_EQ(bits, reference.x) << x;
    const float back = codec::bf16_value(bits);
    const float expected = float(reference);
    ASSERT_EQ(std::memcmp(&back, &expected, 4), 0) << x;
  }
  EXPECT_TRUE(std::isnan(codec::bf16_value(codec::bf16_bits(NAN))));
}
