// The chunk kernels written with chunk_math.h alone: dense transforms, every element computed as
// the CUDA kernels compute it (cuda_kernels.cu), so FLEXDEMO_ISA=portable gives on a CPU the bits a
// GPU gives. Slower than the factorised baseline/AVX2 kernels; there to check the GPU against.
#include "demo/chunk_math.h"
#include "demo/cpu/chunk_kernels.h"

#include <algorithm>
#include <functional>

namespace flexdemo::kernels::portable {
namespace {

namespace cm = chunk_math;

void dct_accumulate(const ChunkShape& shape, const float* src, int64_t src_stride, int valid_h,
                    int valid_w, float* out, int64_t out_stride, float beta, float alpha,
                    float* fresh, float* scratch, const NextChunk& /*next*/,
                    const ChunkPrecondition* pre) {
  const int h = shape.h, w = shape.w;
  const Dct1d& rows = *shape.along_rows;
  const Dct1d& cols = *shape.along_cols;
  float* x = scratch;          // the chunk, zeros outside the tensor: h x w
  float* y = scratch + h * w;  // transformed along the rows' axis (columns): h x w
  for (int i = 0; i < h; ++i) {
    for (int j = 0; j < w; ++j) {
      if (i >= valid_h || j >= valid_w) {
        x[i * w + j] = 0.0f;
      } else if (pre != nullptr) {
        x[i * w + j] = precondition_element(src[i * src_stride + j], pre->v[i * src_stride + j],
                                            pre->beta2, pre->one_minus_beta2, pre->bias, pre->eps);
      } else {
        x[i * w + j] = src[i * src_stride + j];
      }
    }
  }
  for (int u = 0; u < h; ++u) {
    for (int j = 0; j < w; ++j)
      y[u * w + j] = cm::forward_dot(rows.full, rows.full_stride, u, x + j, w, h);
  }
  for (int u = 0; u < h; ++u) {
    for (int v = 0; v < w; ++v) {
      const float c = cm::forward_dot(cols.full, cols.full_stride, v, y + u * w, 1, w);
      float& r = out[u * out_stride + v];
      r = cm::accumulate(beta, r, alpha, c);
      if (fresh != nullptr) fresh[u * w + v] = r;
    }
  }
}

void select_topk(const float* values, int64_t n, int64_t k, int64_t* positions, float* selected,
                 uint64_t* scratch) {
  for (int64_t i = 0; i < n; ++i) scratch[i] = cm::topk_key(values[i], i);
  std::nth_element(scratch, scratch + (k - 1), scratch + n, std::greater<uint64_t>());
  for (int64_t j = 0; j < k; ++j) positions[j] = cm::key_position(scratch[j]);
  std::sort(positions, positions + k);
  for (int64_t j = 0; j < k; ++j) selected[j] = values[positions[j]];
}

void idct_sparse(const ChunkShape& shape, const int32_t* positions, const float* values,
                 int64_t nnz, float* out, int64_t out_stride, const StepUpdate* update,
                 float* scratch) {
  const int h = shape.h, w = shape.w;
  const Dct1d& rows = *shape.along_rows;
  const Dct1d& cols = *shape.along_cols;
  float* X = scratch;          // the dense coefficients: h x w
  float* t = scratch + h * w;  // inverse along the columns' axis (rows): h x w
  std::fill(X, X + h * w, 0.0f);
  for (int64_t e = 0; e < nnz; ++e) X[positions[e]] = values[e];
  for (int u = 0; u < h; ++u) {
    for (int j = 0; j < w; ++j)
      t[u * w + j] = cm::inverse_dot(cols.full, cols.full_stride, j, X + u * w, 1, w);
  }
  for (int i = 0; i < h; ++i) {
    for (int j = 0; j < w; ++j) {
      const float x = cm::inverse_dot(rows.full, rows.full_stride, i, t + j, w, h);
      if (update == nullptr) {
        out[i * out_stride + j] = x;
      } else if (i < update->valid_h && j < update->valid_w) {
        float& p = out[i * out_stride + j];
        if (update->m == nullptr) {
          p = cm::sgd_step(p, x, update->sgd);
        } else {
          cm::adamw_step(p, update->m[i * out_stride + j], update->v[i * out_stride + j], x,
                         update->adamw);
        }
      }
    }
  }
}

void precondition(const float* g, float* v, float* out, int64_t n, float beta2,
                  float one_minus_beta2, float bias, float eps) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = precondition_element(g[j], v[j], beta2, one_minus_beta2, bias, eps);
  }
}

bool all_finite(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if ((cm::float_bits(x[j]) & 0x7f800000u) == 0x7f800000u) return false;
  }
  return true;
}

}  // namespace

extern const KernelTable table;
const KernelTable table = {"portable",  dct_accumulate, select_topk, idct_sparse,
                           precondition, all_finite};

}  // namespace flexdemo::kernels::portable
