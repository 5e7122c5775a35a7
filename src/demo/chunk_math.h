// The per-element arithmetic of a DeMo step, shared by the CPU and the GPU: the selection order of
// top-k, the dense chunk transforms, the residual update, the decoded mean and the inner
// optimizers' steps (the payload's bits are the codec's: src/demo/codec.h). Compiled by the host
// compiler (portable_kernels.cpp, topk.cpp, the tests) and by nvcc (cuda_kernels.cu) from this one
// text: every multiply-add is an explicit fmaf in a fixed order, so host and device get the same
// bits.
// No ATen and nothing from the standard library that a device cannot call.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FLEXDEMO_HD __host__ __device__ inline
#else
#define FLEXDEMO_HD inline
#endif

namespace flexdemo::kernels::chunk_math {

// ====== Bits ======
FLEXDEMO_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return bits;
#endif
}

FLEXDEMO_HD float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
#endif
}

FLEXDEMO_HD float fma32(float a, float b, float c) {  // a * b + c, rounded once
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
FLEXDEMO_HD float sqrt32(float x) {  // correctly rounded on both (nvcc's default -prec-sqrt=true)
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

// ====== The order of top-k ======
// IEEE bits of |x|: they compare like |x| (NaN above infinity).
FLEXDEMO_HD uint32_t magnitude_bits(float x) {
  return float_bits(x) & 0x7fffffffu;
}
// A coefficient's rank key: magnitude first, then the lower position (pos < 2^32). The k largest
// keys of a chunk are its top-k; keys are distinct, so the set is unique whatever the algorithm.
FLEXDEMO_HD uint64_t topk_key(float value, int64_t pos) {
  return uint64_t(magnitude_bits(value)) << 32 | (0xffffffffu - uint32_t(pos));
}
FLEXDEMO_HD int64_t key_position(uint64_t key) {
  return int64_t(0xffffffffu - (key & 0xffffffffu));
}

// ====== Dense chunk transforms ======
// `basis` is the orthonormal DCT-II of size n with row stride `stride`: row k is basis vector k.
// Forward along one axis: out[k] = sum_i basis[k][i] x[i], for i = 0, 1, ... in order.
FLEXDEMO_HD float forward_dot(const float* basis, int64_t stride, int k, const float* x,
                              int64_t x_stride, int n) {
  const float* row = basis + k * stride;
  float acc = 0.0f;
  for (int i = 0; i < n; ++i) acc = fma32(row[i], x[i * x_stride], acc);
  return acc;
}
// Inverse along one axis: out[i] = sum_k basis[k][i] X[k], for k = 0, 1, ... in order.
FLEXDEMO_HD float inverse_dot(const float* basis, int64_t stride, int i, const float* X,
                              int64_t x_stride, int n) {
  float acc = 0.0f;
  for (int k = 0; k < n; ++k) acc = fma32(basis[k * stride + i], X[k * x_stride], acc);
  return acc;
}

// The residual update of one coefficient: beta * residual + alpha * coefficient (beta = 0
// overwrites, whatever the residual held).
FLEXDEMO_HD float accumulate(float beta, float residual, float alpha, float coeff) {
  return beta == 0.0f ? alpha * coeff : fma32(beta, residual, alpha * coeff);
}

// ====== Decode ======
// A coefficient's value after the all-gather: the sum of the replicas that sent it (added in
// rank order, starting from 0) over their count.
FLEXDEMO_HD float mean_of(float sum, uint32_t count) {
  return count > 1 ? sum / float(count) : sum;
}

// ====== Inner optimizer steps on one parameter ======
FLEXDEMO_HD float sign_of(float x) {
  return float((x > 0.0f) - (x < 0.0f));  // 0 for 0 and NaN
}
// SGD with decoupled weight decay, keep * p - lr * g: DeMo's sign-SGD (g = sign(x)), or the
// direction itself (g = x), clamped to [-bound, bound] when bound > 0.
struct SgdConstants {
  float lr = 0.0f, keep = 1.0f;
  bool sign = true;
  float bound = 0.0f;  // without sign: the largest |g| (0: none)
};
FLEXDEMO_HD float bounded(float x, float bound) {  // NaN stays NaN, as torch's clamp keeps it
  return bound > 0.0f && x > bound ? bound : bound > 0.0f && x < -bound ? -bound : x;
}
FLEXDEMO_HD float sgd_step(float p, float x, const SgdConstants& c) {
  return fma32(c.keep, p, -(c.lr * (c.sign ? sign_of(x) : bounded(x, c.bound))));
}
// AdamW (torch.optim.AdamW's formula) on g = sign(x), or x without sign; lr is already divided by
// 1 - beta1^t, sqrt_bc2 = sqrt(1 - beta2^t).
struct AdamWConstants {
  float lr = 0.0f, keep = 1.0f;
  float beta1 = 0.0f, one_minus_beta1 = 0.0f, beta2 = 0.0f, one_minus_beta2 = 0.0f;
  float sqrt_bc2 = 1.0f, eps = 0.0f;
  bool sign = true;
};
FLEXDEMO_HD void adamw_step(float& p, float& m, float& v, float x, const AdamWConstants& c) {
  const float g = c.sign ? sign_of(x) : x;
  m = fma32(c.beta1, m, c.one_minus_beta1 * g);
  v = fma32(c.beta2, v, c.one_minus_beta2 * (g * g));
  p = fma32(c.keep, p, -(c.lr * m / (sqrt32(v) / c.sqrt_bc2 + c.eps)));
}

}  // namespace flexdemo::kernels::chunk_math
