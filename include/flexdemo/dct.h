// flexdemo/dct.h — chunk plans and the chunked orthonormal DCT-II / DCT-III (its inverse).
// A tensor is viewed as 2-D ([n] as 1 x n, [d0, d1, ...] as [d0, rest]) and cut into h x w
// chunks; each chunk is transformed on its own, all chunks of a tensor at once.
#pragma once

#include "flexdemo/names.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace flexdemo::dct {

enum class ChunkMode {
  Divisor,  // per dimension the largest divisor <= target (the reference DeMo; primes get 1)
  Padded,   // per dimension min(dim, target), the tensor zero-padded to a multiple of it
};

// How one tensor is cut into chunks.
struct ChunkPlan {
  int64_t rows = 1;  // the tensor viewed as 2-D: rows x cols (a vector is 1 x n)
  int64_t cols = 1;
  int64_t chunk_rows = 1;   // chunk edge along rows (1 for vectors)
  int64_t chunk_cols = 1;   // chunk edge along cols
  int64_t padded_rows = 1;  // rows rounded up to a multiple of chunk_rows (== rows: Divisor)
  int64_t padded_cols = 1;

  int64_t row_chunks() const { return padded_rows / chunk_rows; }
  int64_t col_chunks() const { return padded_cols / chunk_cols; }
  int64_t num_chunks() const { return row_chunks() * col_chunks(); }
  int64_t chunk_numel() const { return chunk_rows * chunk_cols; }  // coefficients per chunk
  int64_t numel() const { return rows * cols; }
  int64_t padded_numel() const { return padded_rows * padded_cols; }
  bool is_padded() const { return padded_rows != rows || padded_cols != cols; }

  // Block-layout offset (see Transforms below) of chunk c's first coefficient, chunks counted
  // row-major, and of its coefficient pos = u * chunk_cols + v.
  int64_t chunk_origin(int64_t c) const {
    return (c / col_chunks()) * chunk_rows * padded_cols + (c % col_chunks()) * chunk_cols;
  }
  int64_t offset_in_chunk(int64_t pos) const {
    return (pos / chunk_cols) * padded_cols + pos % chunk_cols;
  }
};

// Plan for a tensor of `shape` (at least one element) with chunk edge `target` (> 0).
ChunkPlan make_chunk_plan(at::IntArrayRef shape, int64_t target, ChunkMode mode);

// Orthonormal DCT-II matrix of size n: row k is the k-th basis vector, so DCT(x) = B x and
// x = B^T DCT(x). Cached per (n, dtype, device); thread safe.
at::Tensor dct_basis(int64_t n, at::ScalarType dtype, at::Device device);

// ====== Transforms ======
// Coefficients use the "block layout": a float32 [padded_rows, padded_cols] tensor in which
// coefficient (u, v) of chunk (i, j) sits at (i*chunk_rows + u, j*chunk_cols + v), where
// sample (u, v) of that chunk came from. No permutes are needed in either direction.

// out = beta * out + alpha * DCT(x). x has plan.numel() elements (any floating dtype); out is a
// float32 [padded_rows, padded_cols] contiguous tensor. beta = 0 overwrites out (even NaN).
// scratch, if given, is a contiguous float32 tensor of >= plan.padded_numel() elements that
// holds the intermediate (so that a hot loop allocates nothing); otherwise one is allocated.
void chunked_dct_accumulate(const at::Tensor& x, const ChunkPlan& plan, double beta, double alpha,
                            const at::Tensor& out, at::Tensor* scratch = nullptr);
at::Tensor chunked_dct(const at::Tensor& x, const ChunkPlan& plan);  // new coefficient tensor

// Inverse into samples: a contiguous float32 [padded_rows, padded_cols] tensor (the padding
// rows/cols hold what the inverse gives there). scratch as above.
void chunked_idct_into(const at::Tensor& coeffs, const ChunkPlan& plan, const at::Tensor& samples,
                       at::Tensor* scratch = nullptr);
// Inverse: float32 [rows, cols] samples (padding cropped) from block-layout coefficients.
at::Tensor chunked_idct(const at::Tensor& coeffs, const ChunkPlan& plan);

}  // namespace flexdemo::dct

namespace flexdemo {
template <>
struct NameTable<dct::ChunkMode> {
  static constexpr const char* what = "chunk mode";
  static constexpr std::pair<dct::ChunkMode, const char*> entries[] = {
      {dct::ChunkMode::Divisor, "divisor"}, {dct::ChunkMode::Padded, "padded"}};
};
}  // namespace flexdemo
