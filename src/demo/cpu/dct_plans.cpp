// The fast path's factorised 1-D DCT plans (chunk_kernels.h's Dct1d): the even/odd splitting
// levels, Lee's scaled DCT-IV where it pays, the dense base and the full dense matrix the sparse
// inverse and the portable kernels use. Built once per size, in double, kept for the process.
#include "demo/cpu/chunk_kernels.h"

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace flexdemo::kernels {

namespace {

struct Dct1dStorage {
  Dct1d plan;
  std::vector<std::vector<float>> matrices;
  const float* keep(std::vector<float> m) {
    matrices.push_back(std::move(m));
    return matrices.back().data();
  }
};

// Orthonormal DCT-IV of size n, entry [k][i], in double.
double dct4_entry(int n, int k, int i) {
  const double pi = std::acos(-1.0);
  return std::sqrt(2.0 / n) * std::cos(pi * (2 * i + 1) * (2 * k + 1) / (4.0 * n));
}

// Orthonormal DCT-II of size n, entry [k][i], in double.
double dct_entry(int n, int k, int i) {
  const double pi = std::acos(-1.0);
  return std::sqrt((k == 0 ? 1.0 : 2.0) / n) * std::cos(pi * (2 * i + 1) * k / (2.0 * n));
}

std::unique_ptr<Dct1dStorage> build_dct1d(int n) {
  auto s = std::make_unique<Dct1dStorage>();
  Dct1d& p = s->plan;
  p.n = n;
  const double pi = std::acos(-1.0);
  int size = n;
  std::vector<int> halves;
  // Measured on the encode microbenchmark (AVX2): splitting down to a dense base of at most 8,
  // Lee's DCT-IV where the half is >= 16, dense DCT-IVs below, is the fastest mix. The sparse
  // inverse takes the same levels in Lee's form (its transpose), which measured faster than the
  // dense DCT-IVs for the default chunk of 64 (its halves of 32 and 16; the whole step, AVX-512
  // EPYC; other sizes not measured).
  constexpr int kBaseMax = 8, kLeeMin = 16;
  while (size % 2 == 0 && size > kBaseMax && p.splits < Dct1d::kMaxSplits) {
    const int m = size / 2;
    std::vector<float> fwd(size_t(m) * m), inv(size_t(m) * m);
    for (int i = 0; i < m; ++i) {
      for (int j = 0; j < m; ++j) {
        fwd[size_t(i) * m + j] = float(dct4_entry(m, i, m - 1 - j));
        inv[size_t(j) * m + i] = float(dct4_entry(m, m - 1 - j, i));
      }
    }
    p.forward_odd[p.splits] = s->keep(std::move(fwd));
    p.inverse_odd[p.splits] = s->keep(std::move(inv));
    if (m >= kLeeMin) {
      std::vector<float> scale(m);
      for (int i = 0; i < m; ++i) {
        scale[i] = float(1.0 / (2.0 * std::cos(pi * (2 * i + 1) / (4.0 * m))) / std::sqrt(2.0));
      }
      p.lee[p.splits] = true;
      p.lee_scale[p.splits] = s->keep(std::move(scale));
    }
    halves.push_back(m);
    size = m;
    ++p.splits;
  }
  std::vector<float> base(size_t(size) * size), base_t(size_t(size) * size);
  for (int k = 0; k < size; ++k) {
    for (int i = 0; i < size; ++i) {
      base[size_t(k) * size + i] = base_t[size_t(i) * size + k] = float(dct_entry(size, k, i));
    }
  }
  p.base = s->keep(std::move(base));
  p.base_t = s->keep(std::move(base_t));
  // The inverse's work per lane, from the base up: a level costs its two halves (the even one
  // the level below, the odd one a dense DCT-IV or, in Lee's form, the level below and the
  // neighbours' additions) and its butterflies. A pass over rows counts as two multiply-adds a
  // row, loads and stores being what bounds it: so counted, the sparse inverse's choice between
  // the direct column pass and this one falls where the two took the same time (about 32 of 64
  // rows holding a coefficient, measured on an AVX-512 EPYC).
  p.inverse_cost = int64_t(size) * size;
  for (int l = p.splits - 1; l >= 0; --l) {
    const int64_t m = halves[size_t(l)];
    p.inverse_cost += (p.lee[l] ? p.inverse_cost + 2 * m : m * m) + 4 * m;
  }
  p.full_stride = (n + 7) / 8 * 8;
  std::vector<float> full(size_t(n) * p.full_stride, 0.0f);
  for (int k = 0; k < n; ++k) {
    for (int i = 0; i < n; ++i) full[size_t(k) * p.full_stride + i] = float(dct_entry(n, k, i));
  }
  std::vector<float> full_t(full.size(), 0.0f);
  for (int k = 0; k < n; ++k) {
    for (int i = 0; i < n; ++i)
      full_t[size_t(i) * p.full_stride + k] = full[size_t(k) * p.full_stride + i];
  }
  p.full = s->keep(std::move(full));
  p.full_t = s->keep(std::move(full_t));
  return s;
}

}  // namespace

const Dct1d& dct1d(int64_t n) {
  static std::mutex mutex;
  static std::map<int64_t, std::unique_ptr<Dct1dStorage>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = cache[n];
  if (!slot) slot = build_dct1d(int(n));
  return slot->plan;
}

}  // namespace flexdemo::kernels
