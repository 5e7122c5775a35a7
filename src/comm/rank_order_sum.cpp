// sum_in_rank_order (rank_order_sum.h): two collectives and a sum in rank order between them;
// the log8 codec its statistics may travel in.
#include "rank_order_sum.h"

#include <ATen/ATen.h>

#include <limits>
#include <stdexcept>
#include <vector>

namespace flexdemo::comm {
namespace {

// log8's constants, float32 written out so that no device computes them: 2^(-(j + 1/2) / 8)
// (each the float nearest it), the mantissas (of [1/2, 1)) below which a value rounds j + 1
// eighths further down, and 2^(-k / 8), the mantissa of k eighths below a power of two.
constexpr float kThresholds[8] = {0x1.ea4afap-1f, 0x1.c199bep-1f, 0x1.9c4918p-1f, 0x1.7a1148p-1f,
                                  0x1.5ab07ep-1f, 0x1.3dea64p-1f, 0x1.2387a6p-1f, 0x1.0b5586p-1f};
constexpr float kEighths[8] = {0x1p+0f,        0x1.d5818ep-1f, 0x1.ae89fap-1f, 0x1.8ace54p-1f,
                               0x1.6a09e6p-1f, 0x1.4bfdaep-1f, 0x1.306fe0p-1f, 0x1.172b84p-1f};
constexpr int kTop = 254, kNonFinite = 255;
// A decoded value's power of two, 2^p, is applied as two factors 2^a 2^b (each a normal float
// built from its bits), so that every p a float32 slice can have is exact (an underflow rounds as
// float multiplication does); p is first kept within what two such factors reach, so that a
// corrupt exponent decodes to infinity or zero rather than to other bits.
constexpr int kLeastPower = -252, kMostPower = 254;

// 2^e from its bits, e (int32) within a normal float's exponents [-126, 127].
at::Tensor power_of_two(const at::Tensor& e) {
  return at::bitwise_left_shift(e + 127, 23).to(at::kInt).view(at::kFloat);
}

// A log8 slice's header: its exponent, an int32 in the machine's byte order.
constexpr int64_t kLog8HeaderBytes = sizeof(int32_t);

// A value's bytes on the wire (Native: the tensor's, native_bytes) and a slice's header's.
struct WireFormat {
  int64_t value_bytes = 0;
  int64_t header_bytes = 0;
};
WireFormat wire_format(SumWire wire, int64_t native_bytes) {
  switch (wire) {
    case SumWire::Native:
      return {native_bytes, 0};
    case SumWire::Bf16:
      return {2, 0};
    case SumWire::Log8:
      return {1, kLog8HeaderBytes};
  }
  throw std::logic_error("sum_in_rank_order: unknown wire");
}

// A slice of `count` values on the wire: elements of the tensor's dtype (Native), else bytes.
int64_t wire_size(SumWire wire, int64_t count) {
  if (wire == SumWire::Native) return count;
  const WireFormat f = wire_format(wire, 0);
  return count * f.value_bytes + f.header_bytes;
}

at::Tensor encoded(SumWire wire, const at::Tensor& values) {  // bytes (Native: the values)
  switch (wire) {
    case SumWire::Native:
      return values;
    case SumWire::Bf16:
      return values.to(at::kBFloat16).view(at::kByte);
    case SumWire::Log8: {
      const auto [exponent, codes] = log8_encode(values);
      return at::cat({exponent.view(at::kByte), codes});
    }
  }
  throw std::logic_error("sum_in_rank_order: unknown wire");
}

at::Tensor decoded(SumWire wire, const at::Tensor& bytes) {  // float32 (Native: as they are)
  switch (wire) {
    case SumWire::Native:
      return bytes;
    case SumWire::Bf16:
      return bytes.view(at::kBFloat16).to(at::kFloat);
    case SumWire::Log8:
      return log8_decode(bytes.narrow(0, 0, kLog8HeaderBytes).clone().view(at::kInt),
                         bytes.narrow(0, kLog8HeaderBytes, bytes.numel() - kLog8HeaderBytes));
  }
  throw std::logic_error("sum_in_rank_order: unknown wire");
}

}  // namespace

std::pair<at::Tensor, at::Tensor> log8_encode(const at::Tensor& values) {
  if (values.scalar_type() != at::kFloat) {
    throw std::invalid_argument("log8_encode: float32 values only");
  }
  const at::Tensor x = values.reshape({-1});
  const at::Tensor finite = at::isfinite(x);
  const at::Tensor positive = at::where(finite & (x > 0), x, at::zeros({}, x.options()));
  const at::Tensor largest = x.numel() ? positive.max().reshape({1}) : at::zeros({1}, x.options());
  const at::Tensor exponent = std::get<1>(at::frexp(largest)).to(at::kInt);  // 0 for zeros
  const auto [mantissa, e] = at::frexp(positive);
  at::Tensor eighths = at::zeros_like(e);  // k: round(-8 log2 mantissa), 0..8
  for (const float t : kThresholds) eighths.add_((mantissa < t).to(at::kInt));
  const at::Tensor below = (exponent - e) * 8 + eighths;  // d, >= 0
  at::Tensor codes = (kTop - below).clamp(1, kTop);
  codes = at::where(positive > 0, codes, at::zeros_like(codes));
  codes = at::where(finite, codes, at::full_like(codes, kNonFinite));
  return {exponent, codes.to(at::kByte)};
}

at::Tensor log8_decode(const at::Tensor& exponent, const at::Tensor& codes) {
  const at::Tensor c = codes.to(at::kInt);
  const at::Tensor below = kTop - c.clamp_max(kTop);  // d; code 0 and 255 masked below
  // 2^(-(d mod 8) / 8) from the table, picked by comparisons (no table to copy to a device).
  const at::Tensor eighth = below.remainder(8);
  at::Tensor mantissa = at::full(c.sizes(), kEighths[0], c.options().dtype(at::kFloat));
  for (int k = 1; k < 8; ++k) mantissa = at::where(eighth == k, at::Scalar(kEighths[k]), mantissa);
  // Times 2^(E - floor(d / 8)), exactly.
  const at::Tensor p =
      (exponent.to(codes.device()) - below.div(8, "floor")).clamp(kLeastPower, kMostPower);
  const at::Tensor a = p.div(2, "floor");
  at::Tensor out = mantissa * power_of_two(a) * power_of_two(p - a);
  out = at::where(c == 0, at::zeros_like(out), out);
  return at::where(c == kNonFinite, at::full_like(out, std::numeric_limits<float>::quiet_NaN()),
                   out);
}

double sum_in_rank_order_gathered_bytes(int64_t n, int ranks, SumWire wire, int64_t native_bytes) {
  if (ranks < 2) return 0.0;
  const WireFormat f = wire_format(wire, native_bytes);
  return 2.0 * (double(f.value_bytes) * double(n) / double(ranks) + double(f.header_bytes));
}

void sum_in_rank_order(Communicator& group, const at::Tensor& tensor, SumWire wire) {
  const int ranks = group.size();
  const int64_t n = tensor.numel();
  if (ranks == 1 || n == 0) return;
  if (!tensor.is_contiguous()) {
    throw std::invalid_argument("sum_in_rank_order: the tensor must be contiguous");
  }
  if (wire != SumWire::Native && tensor.scalar_type() != at::kFloat) {
    throw std::invalid_argument("sum_in_rank_order: a narrower wire takes float32 tensors only");
  }
  // Rank r owns counts[r] elements, back to back in rank order.
  std::vector<int64_t> counts(size_t(ranks), n / ranks);
  for (int64_t r = 0; r < n % ranks; ++r) ++counts[size_t(r)];
  const int me = group.rank();
  const at::Tensor flat = tensor.view({-1});
  // Each slice in the wire's bytes (a narrower wire travels as bytes, which every transport
  // takes; Native as the tensor itself), in rank order.
  std::vector<int64_t> sizes(size_t(ranks), 0), offsets(size_t(ranks), 0);
  std::vector<at::Tensor> slices;
  for (int r = 0; r < ranks; ++r) {
    if (r > 0) offsets[size_t(r)] = offsets[size_t(r - 1)] + counts[size_t(r - 1)];
    sizes[size_t(r)] = wire_size(wire, counts[size_t(r)]);
    if (wire != SumWire::Native) {
      slices.push_back(encoded(wire, flat.narrow(0, offsets[size_t(r)], counts[size_t(r)])));
    }
  }
  const at::Tensor sent = wire == SumWire::Native ? flat : at::cat(slices);
  const int64_t piece = sizes[size_t(me)];
  // Rank r's copy of this rank's slice at r * piece (narrowed, not indexed: an empty slice's
  // views start at 0, which a narrower dtype's view needs).
  const at::Tensor pieces = at::empty({ranks * piece}, sent.options());
  group.all_to_all_v(sent, sizes, pieces, std::vector<int64_t>(size_t(ranks), piece));
  auto copy = [&](int r) { return decoded(wire, pieces.narrow(0, r * piece, piece)); };
  const at::Tensor sum = copy(0).to(tensor.scalar_type(), false, /*copy=*/true);
  for (int r = 1; r < ranks; ++r) sum.add_(copy(r));
  const at::Tensor whole = at::empty({sent.numel()}, sent.options());
  group.all_gather_v(encoded(wire, sum).contiguous(), whole, sizes);
  int64_t place = 0;
  for (int r = 0; r < ranks; ++r) {
    flat.narrow(0, offsets[size_t(r)], counts[size_t(r)])
        .copy_(decoded(wire, whole.narrow(0, place, sizes[size_t(r)])));
    place += sizes[size_t(r)];
  }
}

}  // namespace flexdemo::comm
