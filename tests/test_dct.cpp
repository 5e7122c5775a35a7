// Chunk plans and the chunked DCT against the direct float64 formula.
#include "flexdemo/dct.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

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
  EXPECT_THROW(flexdemo::dct::parse_chunk_mode("pad"), std::invalid_argument);
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

TEST(Dct, SparseInverseMatchesDenseInverse) {
  at::manual_seed(4);
  for (ChunkMode mode : {ChunkMode::Divisor, ChunkMode::Padded}) {
    for (auto shape : std::vector<std::vector<int64_t>>{{130, 70}, {97}, {256, 192}, {1, 64}}) {
      ChunkPlan plan = make_chunk_plan(shape, 64, mode);
      // Scattered coefficients (sparse rows, then the dense fallback), and low frequencies only
      // (the first 4 rows of every chunk: the sparse path).
      for (double density : {0.0, 0.002, 0.3, 1.0, -1.0}) {
        at::Tensor coeffs = at::randn({plan.padded_rows, plan.padded_cols});
        if (density >= 0) {
          coeffs.mul_(at::rand_like(coeffs) < density);
        } else {
          at::Tensor row_in_chunk = at::arange(plan.padded_rows).remainder(plan.chunk_rows);
          coeffs.mul_((row_in_chunk < 4).unsqueeze(1));
        }
        at::Tensor dense = at::empty({plan.padded_numel()}),
                   sparse = at::empty({plan.padded_numel()});
        flexdemo::dct::chunked_idct_into(coeffs, plan, dense);
        flexdemo::dct::chunked_idct_sparse_into(coeffs, plan, sparse);
        EXPECT_TRUE(at::allclose(sparse, dense, 1e-5, 1e-6))
            << at::IntArrayRef(shape) << " density " << density << " max err "
            << (sparse - dense).abs().max().item<double>();
      }
    }
  }
}
