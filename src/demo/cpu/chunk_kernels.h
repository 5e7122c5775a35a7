// The per-chunk CPU kernels of DeMo's fast path, free of ATen: the chunked 2-D DCT fused with the
// residual update, top-k by partial selection, and the inverse DCT of sparse coefficients.
// chunk_kernels.cpp is compiled once per instruction set (baseline x86-64, AVX2 + FMA, AVX-512),
// each copy in its own namespace; kernels.cpp picks the best one this CPU runs (runtime dispatch).
#pragma once

#include "demo/chunk_math.h"

#include <cstdint>

namespace flexdemo::kernels {

// One orthonormal 1-D DCT-II of size n, factorised: `splits` levels of even/odd splitting
// (level l works on size n >> l: the DCT-II of the sums x[i] + x[m-1-i] gives the even outputs,
// the DCT-IV of the differences the odd ones), down to a dense DCT-II of size n >> splits.
// `inverse_cost` estimates the inverse's work per transformed lane (dct_plans.cpp). Built once per
// size and never freed (kernels.cpp).
struct Dct1d {
  static constexpr int kMaxSplits = 12;
  int n = 0;
  int splits = 0;
  int64_t inverse_cost = 0;
  // Level l, half size m = (n >> l) / 2. The differences' DCT-IV as a dense m x m matrix D,
  // stored with its input (forward) or output (inverse) order reversed, as the in-place
  // butterflies leave the differences: forward_odd[i][j] = D[i][m-1-j], inverse_odd[j][i] =
  // D[m-1-j][i]. Where lee[l], the forward transform uses Lee's form instead: the differences
  // scaled by lee_scale[i] = 1 / (2 cos(pi (2i+1) / (4m))) / sqrt(2) (with the butterfly's
  // 1/sqrt(2)), a DCT-II of size m, and neighbouring outputs added; the inverse its transpose
  // (chunk_kernels.cpp: inverse_halves).
  bool lee[kMaxSplits] = {};
  const float* lee_scale[kMaxSplits] = {};
  const float* forward_odd[kMaxSplits] = {};
  const float* inverse_odd[kMaxSplits] = {};
  const float* base = nullptr;    // DCT-II of size b = n >> splits, row-major [k][i]
  const float* base_t = nullptr;  // its transpose [i][k]
  const float* full = nullptr;    // the dense DCT-II of size n, rows padded to a multiple of 8
  int full_stride = 0;            // (row k = basis vector k: the inverse of coefficient k)
  const float* full_t = nullptr;  // its transpose [i][k], the same stride (the GPU's forward pass)
};

// A chunk of h x w coefficients; along_rows transforms columns (size h), along_cols rows (w).
struct ChunkShape {
  int h = 1, w = 1;
  const Dct1d* along_rows = nullptr;
  const Dct1d* along_cols = nullptr;
};

// The next chunk (valid_h rows of valid_w floats, the row stride of this chunk's) of up to three
// tensors laid out alike (samples, the residual and the preconditioner's mean square; parameters
// and AdamW's moments), which a kernel asks the caches for while it works on this chunk. Null
// pointers: none.
struct NextChunk {
  const float* rows[3] = {};
  int valid_h = 0, valid_w = 0;
};

// Instead of writing the inverse x, the inner optimizer's step on the parameters at out, fused,
// for u < valid_h, v < valid_w:
//   SGD (m == nullptr): chunk_math::sgd_step with the constants in sgd (sign-SGD, or the
//   direction bounded)
//   AdamW: chunk_math::adamw_step with the constants in adamw, the moments m and v laid out as out
struct StepUpdate {
  chunk_math::SgdConstants sgd;
  int valid_h = 0, valid_w = 0;
  float* m = nullptr;  // AdamW
  float* v = nullptr;
  chunk_math::AdamWConstants adamw;
  NextChunk next;  // the next chunk's parameters (and moments)
};

// The preconditioner's arithmetic for one element (KernelTable::precondition): explicit fused
// multiply-adds, so that neither the compiler's contractions nor where the element falls (a
// vectorised loop's body or its tail) change its bits: a shard's result is the same however the
// tensor is cut.
inline float precondition_element(float g, float& v, float beta2, float one_minus_beta2, float bias,
                                  float eps) {
  v = chunk_math::fma32(one_minus_beta2 * g, g, beta2 * v);  // torch's order at v = 0
  return g / (chunk_math::sqrt32(v) / bias + eps);
}

// FlexDeMo's preconditioner applied to a chunk's samples as dct_accumulate reads them: each
// sample g becomes precondition_element(g, v, ...), v the chunk's running mean square laid out as
// its samples (the same row stride), updated in place. The same bits as KernelTable::
// precondition's pass before the transform, without writing and reading the scaled tensor.
struct ChunkPrecondition {
  float* v = nullptr;
  float beta2 = 0.0f, one_minus_beta2 = 1.0f, bias = 1.0f, eps = 0.0f;
};

// Entries of scratch select_topk needs for n values.
inline int64_t select_scratch(int64_t n) {
  return n + 8 + (n + 9) / 2 + (n + 63) / 64;
}

// Floats of scratch the kernels need per thread for a chunk shape (32-byte aligned).
int64_t scratch_floats(const ChunkShape& shape);

struct KernelTable {
  const char* isa;
  // out[u][v] = beta * out[u][v] + alpha * DCT(x)[u][v] over the chunk (beta == 0: overwrite),
  // x read from src (row stride src_stride) where u < valid_h and v < valid_w, 0 elsewhere;
  // out has row stride out_stride. If fresh is not null, the new values are also written there
  // contiguously (position u * w + v) for select_topk. next: the next chunk's samples (and its
  // residual where laid out alike, and its running mean square with pre), asked for while this
  // one runs. pre (null: none): the samples preconditioned as they are read.
  void (*dct_accumulate)(const ChunkShape& shape, const float* src, int64_t src_stride, int valid_h,
                         int valid_w, float* out, int64_t out_stride, float beta, float alpha,
                         float* fresh, float* scratch, const NextChunk& next,
                         const ChunkPrecondition* pre);
  // The k (<= n) entries of largest magnitude in values[0, n) (ties: the lower position), in
  // ascending position order, as the bounded heap of the plain path orders them. scratch needs
  // select_scratch(n) entries. Writes positions and their values.
  void (*select_topk)(const float* values, int64_t n, int64_t k, int64_t* positions,
                      float* selected, uint64_t* scratch);
  // The inverse DCT x of a chunk holding nnz coefficients (position u * w + v, value), written to
  // out (row stride out_stride), or, given update, applied as its step to the parameters at out.
  // Positions must be distinct and inside the chunk.
  void (*idct_sparse)(const ChunkShape& shape, const int32_t* positions, const float* values,
                      int64_t nnz, float* out, int64_t out_stride, const StepUpdate* update,
                      float* scratch);
  // FlexDeMo's preconditioner over n elements: v = beta2 * v + one_minus_beta2 * g^2, then
  // out = g / (sqrt(v) / bias + eps) (kernels::precondition).
  void (*precondition)(const float* g, float* v, float* out, int64_t n, float beta2,
                       float one_minus_beta2, float bias, float eps);
  // Whether none of x[0, n) is infinite or NaN.
  bool (*all_finite)(const float* x, int64_t n);
};

namespace baseline {
extern const KernelTable table;
}
namespace avx2 {
extern const KernelTable table;
}
namespace avx512 {  // the avx2 copy's code, 16 lanes at a time
extern const KernelTable table;
}
namespace portable {  // chunk_math.h's arithmetic, as the CUDA kernels run it
extern const KernelTable table;
}

// AdamW's per-element constants for one step (kernels.h's numbers rounded to float once).
struct AdamWHyper;
chunk_math::AdamWConstants adamw_constants(const AdamWHyper& step);
chunk_math::SgdConstants sgd_constants(const AdamWHyper& step);  // the SGD rule's

// The factorised plan of size n, built once and never freed (thread safe).
const Dct1d& dct1d(int64_t n);

}  // namespace flexdemo::kernels
