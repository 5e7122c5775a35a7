// flexdemo/kernels.h — DeMo's CPU fast path: fused per-chunk kernels for the chunked DCT, the
// residual update and top-k, and the inverse DCT of sparse coefficients (optionally applying the
// inner optimizer's step as it goes). Each kernel exists for
// several instruction sets (chosen at run time: the best this CPU has, or FLEXDEMO_ISA) and is
// checked against the plain path (dct.h's matrix products, compress.h's heap top-k).
#pragma once

#include "flexdemo/compress.h"
#include "flexdemo/dct.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace flexdemo::kernels {

enum class Isa { Baseline, Avx2 };
std::string to_string(Isa isa);          // "baseline" "avx2"
Isa parse_isa(const std::string& name);  // inverse of to_string
bool supported(Isa isa);                 // whether this CPU runs it
// The instruction set the kernels use: at start the best supported one, or FLEXDEMO_ISA when set.
Isa active_isa();
void set_active_isa(Isa isa);  // throws std::invalid_argument if this CPU lacks it

// residual = beta * residual + alpha * DCT(x) (dct::chunked_dct_accumulate's contract, float32
// residual in block layout); x undefined scales the residual only. beta = 0 overwrites.
void dct_accumulate(const at::Tensor& x, const dct::ChunkPlan& plan, double beta, double alpha,
                    const at::Tensor& residual);
// The same, then every chunk's top-k of the new residual (compress::select_topk's result),
// chunk by chunk while it is in cache.
compress::TopK dct_accumulate_topk(const at::Tensor& x, const dct::ChunkPlan& plan, double beta,
                                   double alpha, const at::Tensor& residual, int64_t k);
// Per-chunk top-k of block-layout coefficients by partial selection.
compress::TopK select_topk(const at::Tensor& coeffs, const dct::ChunkPlan& plan, int64_t k);

// Inverse DCT of per-chunk sparse coefficients (compress::decode_mean_sparse's result) into
// samples: a contiguous float32 [padded_rows, padded_cols] tensor, overwritten. Equal to
// dct::chunked_idct_into of the dense coefficients up to float rounding; deterministic.
void idct_sparse(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                 const at::Tensor& samples);

// DeMo's sign-SGD step with decoupled weight decay, param = keep * param - lr * sign(direction),
// where direction is what idct_sparse would write: applied chunk by chunk as it is made, so the
// direction never goes through memory. param: float32 [plan.rows, plan.cols], rows contiguous.
struct SignStep {
  at::Tensor param;
  float lr = 0.0f;
  float keep = 1.0f;  // 1 - lr * weight_decay
};
void idct_sparse_sign_step(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                           const SignStep& step);

// The AdamW step (torch.optim.AdamW's formula, with decoupled weight decay) fed with
// sign(direction), or the direction with sign off, applied the same way: the parameters and
// both moments are updated chunk by chunk as the direction is made. All three float32
// [plan.rows, plan.cols], rows contiguous. bias_correction1/2: 1 - beta1^t, 1 - beta2^t.
struct AdamWStep {
  at::Tensor param, exp_avg, exp_avg_sq;
  double lr = 0.0, weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double bias_correction1 = 1.0, bias_correction2 = 1.0;
  bool sign = true;
};
void idct_sparse_adamw_step(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                            const AdamWStep& step);

}  // namespace flexdemo::kernels
