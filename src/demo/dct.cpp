// Chunk plans, the cached DCT basis and the separable chunked DCT over whole tensors.
// Each transform is two GEMMs on the block layout (rows of chunks, then columns of chunks), run
// over bands of chunk rows in parallel. (The fast path's per-chunk kernels are in kernels/.)
#include "flexdemo/dct.h"

#include "flexdemo/runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace flexdemo::dct {

namespace {

int64_t largest_divisor_at_most(int64_t n, int64_t target) {
  for (int64_t d = std::min(n, target); d > 1; --d) {
    if (n % d == 0) return d;
  }
  return 1;
}

void plan_dimension(int64_t n, int64_t target, ChunkMode mode, int64_t& chunk, int64_t& padded) {
  if (mode == ChunkMode::Divisor) {
    chunk = largest_divisor_at_most(n, target);
    padded = n;
  } else {
    chunk = std::min(n, target);
    padded = (n + chunk - 1) / chunk * chunk;
  }
}

}  // namespace

ChunkPlan make_chunk_plan(at::IntArrayRef shape, int64_t target, ChunkMode mode) {
  if (target <= 0) {
    throw std::invalid_argument("chunk size must be > 0, got " + std::to_string(target));
  }
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (numel <= 0) throw std::invalid_argument("cannot plan chunks for an empty tensor");

  ChunkPlan plan;
  if (shape.size() <= 1) {
    plan.rows = 1;
    plan.cols = numel;
  } else {
    plan.rows = shape[0];
    plan.cols = numel / shape[0];
  }
  if (plan.rows == 1) {
    plan.chunk_rows = plan.padded_rows = 1;
  } else {
    plan_dimension(plan.rows, target, mode, plan.chunk_rows, plan.padded_rows);
  }
  plan_dimension(plan.cols, target, mode, plan.chunk_cols, plan.padded_cols);
  return plan;
}

at::Tensor dct_basis(int64_t n, at::ScalarType dtype, at::Device device) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int, std::string>, at::Tensor> cache;
  const auto key = std::make_tuple(n, int(dtype), device.str());
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;

  at::Tensor basis = at::empty({n, n}, at::kDouble);
  auto b = basis.accessor<double, 2>();
  const double pi = std::acos(-1.0);
  for (int64_t k = 0; k < n; ++k) {
    const double scale = std::sqrt((k == 0 ? 1.0 : 2.0) / double(n));
    for (int64_t i = 0; i < n; ++i) b[k][i] = scale * std::cos(pi * (2 * i + 1) * k / (2.0 * n));
  }
  at::Tensor converted = basis.to(device, dtype).contiguous();
  cache.emplace(key, converted);
  return converted;
}

namespace {

// Scratch may be larger than needed; every other buffer must have exactly `numel` elements.
void check_floats(const at::Tensor& t, int64_t numel, const char* who, const char* what) {
  const bool is_scratch = std::string(what) == "scratch";
  if (t.scalar_type() != at::kFloat || !t.is_contiguous() ||
      (is_scratch ? t.numel() < numel : t.numel() != numel)) {
    throw std::invalid_argument(
        std::string(who) + ": " + what + " must be a contiguous float32 tensor of " +
        (is_scratch ? "at least " : "") + std::to_string(numel) + " elements");
  }
}

at::Tensor scratch_for(const ChunkPlan& plan, at::Tensor* scratch, const at::Tensor& like,
                       const char* who) {
  if (scratch == nullptr) return at::empty({plan.padded_numel()}, like.options().dtype(at::kFloat));
  check_floats(*scratch, plan.padded_numel(), who, "scratch");
  return scratch->narrow(0, 0, plan.padded_numel());
}

}  // namespace

void chunked_dct_accumulate(const at::Tensor& x, const ChunkPlan& plan, double beta, double alpha,
                            const at::Tensor& out, at::Tensor* scratch) {
  if (x.numel() != plan.numel()) {
    throw std::invalid_argument("chunked_dct: tensor has " + std::to_string(x.numel()) +
                                " elements, plan expects " + std::to_string(plan.numel()));
  }
  check_floats(out, plan.padded_numel(), "chunked_dct", "out");
  const int64_t h = plan.chunk_rows, w = plan.chunk_cols;
  const int64_t R = plan.padded_rows, C = plan.padded_cols;
  at::Tensor samples = x.reshape({plan.rows, plan.cols}).to(at::kFloat);
  if (plan.is_padded()) {
    samples = at::constant_pad_nd(samples, {0, C - plan.cols, 0, R - plan.rows});
  }
  samples = samples.contiguous();
  const auto device = out.device();
  const at::Tensor bh = dct_basis(h, at::kFloat, device);
  const at::Tensor bw_t = dct_basis(w, at::kFloat, device).t();
  const at::Tensor work =
      h > 1 ? scratch_for(plan, scratch, out, "chunked_dct").view({R, C}) : samples;
  // Bands of chunk rows in parallel; inside, one band is B_h @ [h, C] per chunk row (batched),
  // then (.) @ B_w^T fused with the accumulation out = beta*out + alpha*(...).
  SingleThreadedBlas one_blas_thread;
  at::parallel_for(0, R / h, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = (end - begin) * h;
    at::Tensor rows_done = work.narrow(0, begin * h, rows);
    if (h > 1) {
      at::Tensor band = rows_done.view({end - begin, h, C});
      at::bmm_out(band, bh.expand({end - begin, h, h}),
                  samples.narrow(0, begin * h, rows).view({end - begin, h, C}));
    }
    at::Tensor out2d = out.view({R, C}).narrow(0, begin * h, rows).view({rows * C / w, w});
    if (beta == 0.0) {
      at::mm_out(out2d, rows_done.reshape({rows * C / w, w}), bw_t);
      if (alpha != 1.0) out2d.mul_(alpha);
    } else {
      out2d.addmm_(rows_done.reshape({rows * C / w, w}), bw_t, beta, alpha);
    }
  });
}

at::Tensor chunked_dct(const at::Tensor& x, const ChunkPlan& plan) {
  at::Tensor out = at::empty({plan.padded_rows, plan.padded_cols}, x.options().dtype(at::kFloat));
  chunked_dct_accumulate(x, plan, 0.0, 1.0, out);
  return out;
}

void chunked_idct_into(const at::Tensor& coeffs, const ChunkPlan& plan, const at::Tensor& samples,
                       at::Tensor* scratch) {
  check_floats(coeffs, plan.padded_numel(), "chunked_idct", "coefficients");
  check_floats(samples, plan.padded_numel(), "chunked_idct", "samples");
  const int64_t h = plan.chunk_rows, w = plan.chunk_cols;
  const int64_t R = plan.padded_rows, C = plan.padded_cols;
  const auto device = coeffs.device();
  const at::Tensor bw = dct_basis(w, at::kFloat, device);
  const at::Tensor bh_t = dct_basis(h, at::kFloat, device).t();
  const at::Tensor work = h > 1 ? scratch_for(plan, scratch, coeffs, "chunked_idct").view({R, C})
                                : samples.view({R, C});
  // x = B_h^T C B_w per chunk: columns first (one GEMM per band), then rows (batched).
  SingleThreadedBlas one_blas_thread;
  at::parallel_for(0, R / h, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = (end - begin) * h;
    at::Tensor cols_done = work.narrow(0, begin * h, rows).view({rows * C / w, w});
    at::mm_out(cols_done, coeffs.view({R, C}).narrow(0, begin * h, rows).view({rows * C / w, w}),
               bw);
    if (h > 1) {
      at::Tensor band = samples.view({R, C}).narrow(0, begin * h, rows).view({end - begin, h, C});
      at::bmm_out(band, bh_t.expand({end - begin, h, h}), cols_done.view({end - begin, h, C}));
    }
  });
}

at::Tensor chunked_idct(const at::Tensor& coeffs, const ChunkPlan& plan) {
  if (coeffs.numel() != plan.padded_numel()) {
    throw std::invalid_argument("chunked_idct: coefficients have " +
                                std::to_string(coeffs.numel()) + " elements, plan expects " +
                                std::to_string(plan.padded_numel()));
  }
  at::Tensor c = coeffs.to(at::kFloat).contiguous();
  at::Tensor samples = at::empty({plan.padded_rows, plan.padded_cols}, c.options());
  chunked_idct_into(c, plan, samples);
  if (plan.is_padded()) return samples.narrow(0, 0, plan.rows).narrow(1, 0, plan.cols);
  return samples;
}

}  // namespace flexdemo::dct
