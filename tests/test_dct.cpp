// Chunk plans and the chunked DCT against the direct float64 formula.
#include "demo/kernels.h"
#include "flexdemo/compress.h"
#include "flexdemo/dct.h"
#include "flexdemo/optim.h"
#include "isa.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

using flexdemo::dct::ChunkMode;
using flexdemo::dct::ChunkPlan;
using flexdemo::dct::make_chunk_plan;

namespace {

// Direct 2-D DCT-II of every chunk in float64, written into the block layout.
at::Tensor reference_dct(const at::Tensor& x, const ChunkPlan& plan) {
  at::Tensor padded = at::zeros({plan.padded_rows, plan.padded_cols}, at::kDouble);
  padded.narrow(0, 0, plan.rows)
      .narrow(1, 0, plan.cols)
      .copy_(x.reshape({plan.rows, plan.cols}).to(at::kDouble));
  auto in = padded.accessor<double, 2>();
  at::Tensor out = at::zeros_like(padded);
  auto o = out.accessor<double, 2>();
  const int64_t h = plan.chunk_rows, w = plan.chunk_cols;
  const double pi = std::acos(-1.0);
  auto a = [](int64_t k, int64_t n) { return std::sqrt((k == 0 ? 1.0 : 2.0) / double(n)); };
  for (int64_t i0 = 0; i0 < plan.padded_rows; i0 += h)
    for (int64_t j0 = 0; j0 < plan.padded_cols; j0 += w)
      for (int64_t u = 0; u < h; ++u)
        for (int64_t v = 0; v < w; ++v) {
          double sum = 0.0;
          for (int64_t m = 0; m < h; ++m)
            for (int64_t n = 0; n < w; ++n)
              sum += in[i0 + m][j0 + n] * std::cos(pi * (2 * m + 1) * u / (2.0 * h)) *
                     std::cos(pi * (2 * n + 1) * v / (2.0 * w));
          o[i0 + u][j0 + v] = a(u, h) * a(v, w) * sum;
        }
  return out;
}

}  // namespace

TEST(ChunkPlan, DivisorModeTakesLargestDivisorPerDimension) {
  ChunkPlan p = make_chunk_plan({128, 192}, 64, ChunkMode::Divisor);
  EXPECT_EQ(p.chunk_rows, 64);
  EXPECT_EQ(p.chunk_cols, 64);
  EXPECT_EQ(p.num_chunks(), 6);
  EXPECT_FALSE(p.is_padded());

  ChunkPlan emb = make_chunk_plan({50257, 768}, 64, ChunkMode::Divisor);
  EXPECT_EQ(emb.chunk_rows, 29);  // 50257 = 29 * 1733
  EXPECT_EQ(emb.chunk_cols, 64);

  ChunkPlan prime = make_chunk_plan({97, 10}, 64, ChunkMode::Divisor);
  EXPECT_EQ(prime.chunk_rows, 1);
  EXPECT_EQ(prime.chunk_cols, 10);
}

TEST(ChunkPlan, PaddedModePadsToMultipleOfTarget) {
  ChunkPlan emb = make_chunk_plan({50257, 768}, 64, ChunkMode::Padded);
  EXPECT_EQ(emb.chunk_rows, 64);
  EXPECT_EQ(emb.padded_rows, 50304);
  EXPECT_EQ(emb.padded_cols, 768);
  EXPECT_TRUE(emb.is_padded());

  ChunkPlan prime = make_chunk_plan({97}, 64, ChunkMode::Padded);
  EXPECT_EQ(prime.rows, 1);
  EXPECT_EQ(prime.chunk_rows, 1);
  EXPECT_EQ(prime.chunk_cols, 64);
  EXPECT_EQ(prime.padded_cols, 128);

  ChunkPlan small = make_chunk_plan({50}, 64, ChunkMode::Padded);  // smaller than the target
  EXPECT_EQ(small.chunk_cols, 50);
  EXPECT_FALSE(small.is_padded());
}

TEST(ChunkPlan, HigherRankTensorsAreDim0ByRest) {
  ChunkPlan p = make_chunk_plan({4, 6, 8}, 64, ChunkMode::Divisor);
  EXPECT_EQ(p.rows, 4);
  EXPECT_EQ(p.cols, 48);
  EXPECT_EQ(p.chunk_rows, 4);
  EXPECT_EQ(p.chunk_cols, 48);
}

TEST(ChunkPlan, RejectsBadInput) {
  EXPECT_THROW(make_chunk_plan({8, 8}, 0, ChunkMode::Divisor), std::invalid_argument);
  EXPECT_THROW(make_chunk_plan({0, 8}, 8, ChunkMode::Divisor), std::invalid_argument);
  EXPECT_THROW(flexdemo::parse_name<flexdemo::dct::ChunkMode>("pad"), std::invalid_argument);
}

TEST(Dct, BasisIsOrthonormal) {
  for (int64_t n : {1, 2, 7, 29, 64}) {
    at::Tensor b = flexdemo::dct::dct_basis(n, at::kDouble, at::kCPU);
    EXPECT_TRUE(at::allclose(at::mm(b, b.t()), at::eye(n, at::kDouble), 0, 1e-12)) << n;
    EXPECT_TRUE(at::allclose(at::mm(b.t(), b), at::eye(n, at::kDouble), 0, 1e-12)) << n;
  }
}

TEST(Dct, MatchesDirectFormula) {
  at::manual_seed(1);
  struct Case {
    std::vector<int64_t> shape;
    int64_t target;
    ChunkMode mode;
  };
  for (const Case& c :
       {Case{{12, 20}, 8, ChunkMode::Divisor}, Case{{30}, 16, ChunkMode::Divisor},
        Case{{13, 7}, 4, ChunkMode::Padded}, Case{{3, 4, 5}, 64, ChunkMode::Divisor},
        Case{{19}, 8, ChunkMode::Padded}}) {
    ChunkPlan plan = make_chunk_plan(c.shape, c.target, c.mode);
    at::Tensor x = at::randn(c.shape);
    at::Tensor got = flexdemo::dct::chunked_dct(x, plan);
    at::Tensor want = reference_dct(x, plan);
    EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, 1e-5, 1e-5))
        << "shape " << at::IntArrayRef(c.shape) << " max err "
        << (got.to(at::kDouble) - want).abs().max().item<double>();
  }
}

TEST(Dct, RoundTripRecoversSamples) {
  at::manual_seed(2);
  for (ChunkMode mode : {ChunkMode::Divisor, ChunkMode::Padded}) {
    for (auto shape : std::vector<std::vector<int64_t>>{{130, 70}, {97}, {5, 3, 11}, {1, 64}}) {
      ChunkPlan plan = make_chunk_plan(shape, 64, mode);
      at::Tensor x = at::randn(shape);
      at::Tensor back = flexdemo::dct::chunked_idct(flexdemo::dct::chunked_dct(x, plan), plan);
      EXPECT_TRUE(at::allclose(back.reshape(shape), x, 1e-5, 1e-5)) << at::IntArrayRef(shape);
    }
  }
}

TEST(Dct, AccumulateScalesAndAdds) {
  at::manual_seed(3);
  ChunkPlan plan = make_chunk_plan({32, 48}, 16, ChunkMode::Divisor);
  at::Tensor x = at::randn({32, 48});
  at::Tensor base = at::randn({32, 48});
  at::Tensor out = base.clone();
  flexdemo::dct::chunked_dct_accumulate(x, plan, 0.9, 0.01, out);
  at::Tensor want = base.to(at::kDouble) * 0.9 + 0.01 * reference_dct(x, plan);
  EXPECT_TRUE(at::allclose(out.to(at::kDouble), want, 1e-5, 1e-6));
}

// ====== The fast path's kernels, in every instruction set this CPU has ======
namespace {

// Direct inverse of every chunk in float64 (x = B_h^T X B_w), from block-layout coefficients.
at::Tensor reference_idct(const at::Tensor& coeffs, const ChunkPlan& plan) {
  const int64_t h = plan.chunk_rows, w = plan.chunk_cols;
  const at::Tensor bh = flexdemo::dct::dct_basis(h, at::kDouble, at::kCPU);
  const at::Tensor bw = flexdemo::dct::dct_basis(w, at::kDouble, at::kCPU);
  at::Tensor blocks = coeffs.to(at::kDouble)
                          .view({plan.row_chunks(), h, plan.col_chunks(), w})
                          .permute({0, 2, 1, 3});
  at::Tensor x = at::matmul(at::matmul(bh.t(), blocks), bw);
  return x.permute({0, 2, 1, 3}).reshape({plan.padded_rows, plan.padded_cols});
}

struct KernelCase {
  std::vector<int64_t> shape;
  int64_t chunk;
  ChunkMode mode;
};
// 64 x 64 (three even/odd splits), 26 x 35 (one split, then odd), 48 x 48 (split down to 6),
// padded 64 x 50, vectors, chunks of 1 and 7, 128 x 128 (four splits).
const KernelCase kKernelCases[] = {
    {{256, 192}, 64, ChunkMode::Divisor},  {{130, 70}, 64, ChunkMode::Divisor},
    {{96, 48}, 64, ChunkMode::Divisor},    {{70, 50}, 64, ChunkMode::Padded},
    {{97}, 64, ChunkMode::Padded},         {{200}, 64, ChunkMode::Divisor},
    {{5, 3, 11}, 64, ChunkMode::Divisor},  {{37, 14}, 7, ChunkMode::Divisor},
    {{128, 128}, 128, ChunkMode::Divisor},
};

}  // namespace

TEST(Kernels, DctAccumulateMatchesFloat64Reference) {
  at::manual_seed(4);
  for (const KernelCase& c : kKernelCases) {
    ChunkPlan plan = make_chunk_plan(c.shape, c.chunk, c.mode);
    at::Tensor x = at::randn(c.shape);
    at::Tensor base = at::randn({plan.padded_rows, plan.padded_cols});
    const at::Tensor dct = reference_dct(x, plan);
    for (flexdemo::kernels::Isa isa : flexdemo::isa_testing::supported_isas()) {
      flexdemo::isa_testing::ScopedIsa scoped(isa);
      for (double beta : {0.0, 0.9}) {
        at::Tensor out = base.clone();
        if (beta == 0.0) out.view(-1)[0] = NAN;  // beta = 0 overwrites, even NaN
        flexdemo::kernels::dct_accumulate(x, plan, beta, 0.5, out);
        const at::Tensor want = base.to(at::kDouble) * beta + 0.5 * dct;
        EXPECT_TRUE(at::allclose(out.to(at::kDouble), want, 1e-5, 1e-5))
            << at::IntArrayRef(c.shape) << " " << to_string(isa) << " beta " << beta << " max err "
            << (out.to(at::kDouble) - want).abs().max().item<double>();
      }
      at::Tensor decayed = base.clone();
      flexdemo::kernels::dct_accumulate(at::Tensor(), plan, 0.5, 1.0, decayed);  // no gradient
      EXPECT_TRUE(at::equal(decayed, base * 0.5));
    }
  }
}

TEST(Kernels, FusedTopKSelectsFromTheNewResidual) {
  // dct_accumulate_topk leaves the residual dct_accumulate leaves, and picks what the plain
  // heap picks from it.
  at::manual_seed(5);
  for (const KernelCase& c : kKernelCases) {
    ChunkPlan plan = make_chunk_plan(c.shape, c.chunk, c.mode);
    at::Tensor x = at::randn(c.shape);
    at::Tensor base = at::randn({plan.padded_rows, plan.padded_cols});
    for (flexdemo::kernels::Isa isa : flexdemo::isa_testing::supported_isas()) {
      flexdemo::isa_testing::ScopedIsa scoped(isa);
      at::Tensor fused = base.clone(), separate = base.clone();
      const flexdemo::compress::TopK got =
          flexdemo::kernels::dct_accumulate_topk(x, plan, 0.9, 0.1, fused, 9);
      flexdemo::kernels::dct_accumulate(x, plan, 0.9, 0.1, separate);
      EXPECT_TRUE(at::equal(fused, separate)) << at::IntArrayRef(c.shape);
      const flexdemo::compress::TopK want = flexdemo::compress::select_topk_plain(fused, plan, 9);
      EXPECT_TRUE(at::equal(got.indices, want.indices)) << at::IntArrayRef(c.shape);
      EXPECT_TRUE(at::equal(got.values, want.values)) << at::IntArrayRef(c.shape);
    }
  }
}

TEST(Kernels, FusedEncodeEqualsTheSeparateSteps) {
  // dct_accumulate_encode writes the bytes, and leaves the residual, that dct_accumulate_topk,
  // encode_payload and add_selected(-1) do one after the other: every encoding (packed fields
  // shared between chunks included), every instruction set, with and without a gradient.
  at::manual_seed(8);
  for (const KernelCase& c : kKernelCases) {
    ChunkPlan plan = make_chunk_plan(c.shape, c.chunk, c.mode);
    const at::Tensor x = at::randn(c.shape);
    const at::Tensor base = at::randn({plan.padded_rows, plan.padded_cols});
    for (const auto& [encoding, name] :
         flexdemo::NameTable<flexdemo::compress::ValueEncoding>::entries) {
      const size_t bytes = flexdemo::compress::wire_payload_bytes(plan, 5, encoding);
      for (flexdemo::kernels::Isa isa : flexdemo::isa_testing::supported_isas()) {
        flexdemo::isa_testing::ScopedIsa scoped(isa);
        for (const at::Tensor& grad : {x, at::Tensor()}) {
          at::Tensor fused = base.clone(), separate = base.clone();
          std::vector<uint8_t> got(bytes, 0xAB), want(bytes, 0);
          flexdemo::kernels::dct_accumulate_encode(grad, plan, 0.9, 0.1, fused, 5, encoding,
                                                   got.data());
          flexdemo::compress::TopK topk =
              flexdemo::kernels::dct_accumulate_topk(grad, plan, 0.9, 0.1, separate, 5);
          flexdemo::compress::encode_payload(plan, topk, encoding, want.data());
          flexdemo::compress::add_selected(separate, plan, topk, -1.0f);
          EXPECT_EQ(got, want) << name << " " << at::IntArrayRef(c.shape);
          EXPECT_TRUE(at::equal(fused, separate)) << name << " " << at::IntArrayRef(c.shape);
        }
      }
    }
  }
}

TEST(Kernels, PreconditionedAsReadEqualsPreconditioningFirst) {
  // The preconditioner fused into the transform's read (Preconditioning) leaves the same running
  // mean square, residual and payload bytes, bit for bit, as precondition() into a tensor and the
  // transform of that: whole chunks and padded ones, every instruction set, with and without a
  // gradient, with and without the encode.
  at::manual_seed(12);
  const double beta2 = 0.95, eps = 1e-8;
  const int64_t step = 3;
  const auto encoding = flexdemo::compress::ValueEncoding::Fp8;
  for (const KernelCase& c : kKernelCases) {
    ChunkPlan plan = make_chunk_plan(c.shape, c.chunk, c.mode);
    const at::Tensor x = at::randn(c.shape);
    const at::Tensor base = at::randn({plan.padded_rows, plan.padded_cols});
    const at::Tensor v0 = at::rand({plan.rows, plan.cols}) * 1e-2;
    const size_t bytes = flexdemo::compress::wire_payload_bytes(plan, 5, encoding);
    for (flexdemo::kernels::Isa isa : flexdemo::isa_testing::supported_isas()) {
      flexdemo::isa_testing::ScopedIsa scoped(isa);
      for (const at::Tensor& grad : {x, at::Tensor()}) {
        for (const bool encode : {true, false}) {
          at::Tensor fused = base.clone(), separate = base.clone();
          const at::Tensor v_fused = v0.clone(), v_separate = v0.clone();
          at::Tensor scaled;
          if (grad.defined()) {
            scaled = at::empty({plan.rows, plan.cols});
            flexdemo::kernels::precondition(grad, v_separate, scaled, beta2, eps, step);
          } else {
            v_separate.mul_(beta2);
          }
          const flexdemo::kernels::Preconditioning pre{v_fused, beta2, eps, step};
          std::vector<uint8_t> got(bytes, 0xAB), want(bytes, 0);
          if (encode) {
            flexdemo::kernels::dct_accumulate_encode(grad, plan, 0.9, 0.1, fused, 5, encoding,
                                                     got.data(), &pre);
            flexdemo::kernels::dct_accumulate_encode(scaled, plan, 0.9, 0.1, separate, 5,
                                                     encoding, want.data());
          } else {
            flexdemo::kernels::dct_accumulate(grad, plan, 0.9, 0.1, fused, &pre);
            flexdemo::kernels::dct_accumulate(scaled, plan, 0.9, 0.1, separate);
            got = want;
          }
          const std::string what = to_string(isa) + (encode ? " encode " : " accumulate ") +
                                   (grad.defined() ? "gradient" : "none");
          EXPECT_EQ(got, want) << at::IntArrayRef(c.shape) << " " << what;
          EXPECT_TRUE(at::equal(fused, separate)) << at::IntArrayRef(c.shape) << " " << what;
          EXPECT_TRUE(at::equal(v_fused, v_separate)) << at::IntArrayRef(c.shape) << " " << what;
        }
      }
    }
  }
}

TEST(Kernels, SparseInverseMatchesFloat64Reference) {
  // Per chunk: no coefficient, a few (the direct column pass), many (the factorised one), all.
  at::manual_seed(6);
  for (const KernelCase& c : kKernelCases) {
    ChunkPlan plan = make_chunk_plan(c.shape, c.chunk, c.mode);
    const int64_t n = plan.chunk_numel(), chunks = plan.num_chunks();
    for (int64_t nnz : {int64_t(0), int64_t(3), n / 3, n}) {
      flexdemo::compress::SparseChunks sparse;
      sparse.positions = at::empty({chunks, std::max<int64_t>(nnz, 1)}, at::kInt);
      sparse.values = at::randn({chunks, std::max<int64_t>(nnz, 1)});
      sparse.counts = at::full({chunks}, nnz, at::kLong);
      at::Tensor dense = at::zeros({plan.padded_rows, plan.padded_cols});
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const at::Tensor pos = at::randperm(n, at::kInt).narrow(0, 0, nnz);
        sparse.positions[ch].narrow(0, 0, nnz).copy_(pos);
        for (int64_t e = 0; e < nnz; ++e) {
          const int64_t p = pos[e].item<int32_t>();
          dense.view(-1)[plan.chunk_origin(ch) + plan.offset_in_chunk(p)] = sparse.values[ch][e];
        }
      }
      const at::Tensor want = reference_idct(dense, plan);
      for (flexdemo::kernels::Isa isa : flexdemo::isa_testing::supported_isas()) {
        flexdemo::isa_testing::ScopedIsa scoped(isa);
        at::Tensor got = at::full({plan.padded_rows, plan.padded_cols}, NAN);
        flexdemo::kernels::idct_sparse(sparse, plan, got);
        EXPECT_TRUE(at::allclose(got.to(at::kDouble), want, 1e-5, 1e-5))
            << at::IntArrayRef(c.shape) << " nnz " << nnz << " " << to_string(isa) << " max err "
            << (got.to(at::kDouble) - want).abs().max().item<double>();
        // The fused sign-SGD step: p = keep * p - lr * sign(x) where x is not within rounding
        // of 0, p itself where x = 0 exactly (no coefficient in its chunk).
        const at::Tensor param = at::randn({plan.rows, plan.cols});
        flexdemo::kernels::SgdStep step{param.clone(), 0.25f, 0.5f};
        flexdemo::kernels::idct_sparse_sgd_step(sparse, plan, step);
        const at::Tensor x = want.narrow(0, 0, plan.rows).narrow(1, 0, plan.cols);
        const at::Tensor expect = param.to(at::kDouble) * 0.5 - 0.25 * x.sign();
        const at::Tensor clear = (x.abs() > 1e-4) | (x == 0);
        EXPECT_TRUE(at::allclose(step.param.to(at::kDouble).masked_select(clear),
                                 expect.masked_select(clear), 1e-6, 1e-6))
            << at::IntArrayRef(c.shape) << " nnz " << nnz << " " << to_string(isa);
        // The fused plain step, sign off: p = keep * p - lr * clamp(x, -bound, bound), with
        // the bound at the middle of |x| (half the elements clamped) and without one (0).
        const double middle = x.abs().median().item<double>();
        for (double bound : {middle, 0.0}) {
          flexdemo::kernels::SgdStep plain{param.clone(), 0.25f, 0.5f, false, float(bound)};
          flexdemo::kernels::idct_sparse_sgd_step(sparse, plan, plain);
          const at::Tensor g = bound > 0 ? x.clamp(-bound, bound) : x;
          EXPECT_TRUE(at::allclose(plain.param.to(at::kDouble),
                                   param.to(at::kDouble) * 0.5 - 0.25 * g, 1e-5, 1e-5))
              << at::IntArrayRef(c.shape) << " nnz " << nnz << " " << to_string(isa) << " bound "
              << bound;
        }
        // The fused AdamW step (torch.optim.AdamW's formula, step 3, weight decay), fed with
        // sign(x) or x, on the parameters and both moments.
        for (bool sign : {true, false}) {
          flexdemo::kernels::AdamWStep adamw;
          adamw.param = param.clone();
          adamw.exp_avg = at::randn({plan.rows, plan.cols});
          adamw.exp_avg_sq = at::rand({plan.rows, plan.cols});
          adamw.lr = 0.01, adamw.weight_decay = 0.1, adamw.sign = sign;
          adamw.bias_correction1 = 1 - std::pow(0.9, 3),
          adamw.bias_correction2 = 1 - std::pow(0.999, 3);
          const at::Tensor m0 = adamw.exp_avg.to(at::kDouble),
                           v0 = adamw.exp_avg_sq.to(at::kDouble);
          flexdemo::kernels::idct_sparse_adamw_step(sparse, plan, adamw);
          const at::Tensor g = sign ? x.sign() : x;
          const at::Tensor m = 0.9 * m0 + 0.1 * g, v = 0.999 * v0 + 0.001 * g * g;
          const at::Tensor p = param.to(at::kDouble) * (1 - 0.01 * 0.1) -
                               0.01 / adamw.bias_correction1 * m /
                                   (v.sqrt() / std::sqrt(adamw.bias_correction2) + 1e-8);
          const at::Tensor where = sign ? clear : at::ones_like(clear);
          for (const auto& [got_t, want_t] :
               {std::pair{adamw.param, p}, {adamw.exp_avg, m}, {adamw.exp_avg_sq, v}}) {
            EXPECT_TRUE(at::allclose(got_t.to(at::kDouble).masked_select(where),
                                     want_t.masked_select(where), 1e-5, 1e-6))
                << at::IntArrayRef(c.shape) << " nnz " << nnz << " " << to_string(isa)
                << " adamw sign " << sign;
          }
        }
      }
    }
  }
}

TEST(Kernels, FusedPlainStepEqualsTheInverseThenTheRule) {
  // The plain SGD step (sign off) fused into the sparse inverse, bit for bit what the inverse
  // alone writes and then chunk_math::sgd_step (keep * p - lr * x, x clamped to the bound,
  // rounded once) makes of it, on every path the inverse takes: few rows holding a coefficient
  // (the direct column pass) and many (the factorised inverse, Lee's form from 32 rows), whole
  // chunks (the step fused into the last pass) and others. Positions as a decode of two replicas
  // lays them out: the first payload's ascending, then the second's new ones ascending, so that
  // a row's runs come apart.
  at::manual_seed(9);
  for (const KernelCase& c : kKernelCases) {
    ChunkPlan plan = make_chunk_plan(c.shape, c.chunk, c.mode);
    const int64_t n = plan.chunk_numel(), chunks = plan.num_chunks();
    for (const auto& [first, second] : {std::pair<int64_t, int64_t>{3, 2}, {n / 4, n / 8}}) {
      const int64_t nnz = std::min(n, first + second);
      flexdemo::compress::SparseChunks sparse;
      sparse.positions = at::empty({chunks, std::max<int64_t>(nnz, 1)}, at::kInt);
      sparse.values = at::randn({chunks, std::max<int64_t>(nnz, 1)});
      sparse.counts = at::full({chunks}, nnz, at::kLong);
      for (int64_t ch = 0; ch < chunks; ++ch) {
        const at::Tensor pos = at::randperm(n, at::kInt).narrow(0, 0, nnz);
        const int64_t a = std::min(first, nnz);
        sparse.positions[ch].narrow(0, 0, a).copy_(std::get<0>(pos.narrow(0, 0, a).sort()));
        sparse.positions[ch]
            .narrow(0, a, nnz - a)
            .copy_(std::get<0>(pos.narrow(0, a, nnz - a).sort()));
      }
      for (flexdemo::kernels::Isa isa : flexdemo::isa_testing::supported_isas()) {
        flexdemo::isa_testing::ScopedIsa scoped(isa);
        at::Tensor samples = at::empty({plan.padded_rows, plan.padded_cols});
        flexdemo::kernels::idct_sparse(sparse, plan, samples);
        const at::Tensor x = samples.narrow(0, 0, plan.rows).narrow(1, 0, plan.cols).contiguous();
        const at::Tensor param = at::randn({plan.rows, plan.cols});
        for (float bound : {float(x.abs().median().item<double>()), 0.0f}) {
          const float lr = 0.25f, keep = 0.5f;
          at::Tensor want = param.clone();
          const float* xs = x.data_ptr<float>();
          float* w = want.data_ptr<float>();
          for (int64_t e = 0; e < want.numel(); ++e) {
            const float g = bound > 0.0f ? std::min(std::max(xs[e], -bound), bound) : xs[e];
            w[e] = std::fma(keep, w[e], -(lr * g));
          }
          flexdemo::kernels::SgdStep step{param.clone(), lr, keep, false, bound};
          flexdemo::kernels::idct_sparse_sgd_step(sparse, plan, step);
          EXPECT_TRUE(at::equal(step.param, want))
              << at::IntArrayRef(c.shape) << " nnz " << nnz << " " << to_string(isa) << " bound "
              << bound << " max diff " << (step.param - want).abs().max().item<float>();
        }
      }
    }
  }
}

TEST(Kernels, AllFiniteFindsANonFiniteValueAnywhere) {
  // kernels::all_finite against std::isfinite, element by element: one infinity, NaN or none at
  // every position of lengths around the kernels' blocks (128) and vectors (8), among finite
  // extremes (the largest float, subnormals, -0), every instruction set; and a strided view, a
  // double tensor (ATen's path).
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> specials = {inf, -inf, std::numeric_limits<float>::quiet_NaN(),
                                       -std::numeric_limits<float>::quiet_NaN()};
  const std::vector<float> finite = {std::numeric_limits<float>::max(),
                                     -std::numeric_limits<float>::max(),
                                     std::numeric_limits<float>::denorm_min(), -0.0f, 1.0f};
  for (int64_t n : {0, 1, 7, 8, 9, 127, 128, 129, 263, 1000}) {
    at::Tensor x = at::empty({n});
    float* p = x.data_ptr<float>();
    for (int64_t j = 0; j < n; ++j) p[j] = finite[size_t(j) % finite.size()];
    auto reference = [&] {
      for (int64_t j = 0; j < n; ++j) {
        if (!std::isfinite(p[j])) return false;
      }
      return true;
    };
    for (flexdemo::kernels::Isa isa : flexdemo::isa_testing::supported_isas()) {
      flexdemo::isa_testing::ScopedIsa scoped(isa);
      ASSERT_TRUE(reference());
      EXPECT_TRUE(flexdemo::kernels::all_finite(x)) << n << " " << to_string(isa);
      for (int64_t j = 0; j < n; ++j) {
        const float kept = p[j];
        p[j] = specials[size_t(j) % specials.size()];
        EXPECT_EQ(flexdemo::kernels::all_finite(x), reference())
            << n << " " << j << " " << to_string(isa);
        p[j] = kept;
      }
    }
  }
  at::Tensor wide = at::ones({4, 6});
  wide[3][5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(flexdemo::kernels::all_finite(wide.narrow(1, 0, 5)));  // the NaN is not in view
  EXPECT_TRUE(flexdemo::kernels::all_finite(wide.narrow(0, 1, 2)));  // contiguous, offset: kernel
  EXPECT_FALSE(flexdemo::kernels::all_finite(wide.narrow(0, 2, 2)));
  EXPECT_TRUE(flexdemo::optim::all_finite(std::vector<at::Tensor>{at::Tensor(), wide[0]}));
  EXPECT_FALSE(flexdemo::optim::all_finite(std::vector<at::Tensor>{wide[0], at::Tensor(), wide}));
  EXPECT_FALSE(flexdemo::kernels::all_finite(wide.t()));
  EXPECT_FALSE(flexdemo::kernels::all_finite(wide.to(at::kDouble)));
}
