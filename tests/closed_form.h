// Closed forms the tests compare the library's counts against, written out independently.
#pragma once

#include "flexdemo/optim.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// The orthonormal DCT-II matrix of size n by its direct formula, float64: DCT(x) = B x.
inline at::Tensor naive_dct_basis(int64_t n) {
  at::Tensor b = at::empty({n, n}, at::kDouble);
  const double pi = std::acos(-1.0);
  for (int64_t k = 0; k < n; ++k)
    for (int64_t i = 0; i < n; ++i)
      b[k][i] = std::sqrt((k == 0 ? 1.0 : 2.0) / n) * std::cos(pi * (2 * i + 1) * k / (2.0 * n));
  return b;
}

// One replica's DeMo payload for these chunk plans: header + indices + scales + values.
inline uint64_t closed_form_payload_bytes(const std::vector<flexdemo::dct::ChunkPlan>& plans,
                                          const flexdemo::optim::OptimizerOptions& o) {
  using flexdemo::compress::ValueEncoding;
  uint64_t total = 0;
  for (const auto& plan : plans) {
    if (plan.numel() == 0) continue;
    const uint64_t n = plan.chunk_numel();
    const uint64_t k = std::min<uint64_t>(o.topk, n);
    const uint64_t entries = plan.num_chunks() * k;
    uint64_t index_bytes = (n <= 256 ? 1 : n <= 65536 ? 2 : 4) * entries;
    uint64_t value_bytes = 0;
    switch (o.values) {
      case ValueEncoding::Fp32:
        value_bytes = 4 * entries;
        break;
      case ValueEncoding::Bf16:
        value_bytes = 2 * entries;
        break;
      case ValueEncoding::Int8:
        value_bytes = entries + 4 * plan.num_chunks();
        break;
      case ValueEncoding::Sign:
        value_bytes = (entries + 7) / 8 + 4 * plan.num_chunks();
        break;
      case ValueEncoding::TwoBit: {  // Elias-Fano: low = floor(log2(n / k)) bits + a bitmap
        uint64_t low = 0;
        while (k << (low + 1) <= n) ++low;
        index_bytes = plan.num_chunks() * ((k * low + ((n - 1) >> low) + k + 7) / 8);
        value_bytes = (2 * entries + 7) / 8 + 8 * plan.num_chunks();
        break;
      }
      case ValueEncoding::Fp8: {  // the same packed records, a byte a value, a scale a chunk
        uint64_t low = 0;
        while (k << (low + 1) <= n) ++low;
        index_bytes = plan.num_chunks() * ((k * low + ((n - 1) >> low) + k + 7) / 8);
        value_bytes = entries + 4 * plan.num_chunks();
        break;
      }
    }
    total += 36 + index_bytes + value_bytes;
  }
  return total;
}
