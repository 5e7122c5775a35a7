// The samplers: batches drawn from (seed, step, row) alone, whatever the rank count; translation
// pairs padded, cut and drawn like windows.
#include "test_mpi.h"

#include "flexdemo/data.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using namespace flexdemo;

TEST(Sampler, PairRowsArePaddedCutAndDrawnLikeWindows) {
  // Pairs (source, eot, target, eot): 3 pairs; lengths 2+3, 5+1, 1+2 (end-of-text 0).
  const std::vector<int32_t> tokens = {5, 0, 6, 7, 0, 1, 2, 3, 4, 0, 0, 9, 0, 8, 8, 0};
  const data::PairSampler a(tokens, 0, 3, 3, 42), b(tokens, 0, 3, 3, 42);
  const at::Tensor val = a.windows(0, 4);
  const at::Tensor expected = long_rows({{5, 0, -1, 6, 7, 0},
                                         {1, 2, 0, 0, -1, -1},  // source cut, eot kept
                                         {9, 0, -1, 8, 8, 0},
                                         {5, 0, -1, 6, 7, 0}});  // wraps around
  EXPECT_TRUE(at::equal(val, expected)) << val;
  EXPECT_EQ(a.num_windows(), 3);
  EXPECT_EQ(a.scored_tokens(val), 3 + 1 + 3 + 3);
  const at::Tensor whole = a.rows(7, 0, 8);
  EXPECT_TRUE(at::equal(whole, b.rows(7, 0, 8)));
  for (int r = 0; r < 8; r += 2) EXPECT_TRUE(at::equal(a.rows(7, r, 2), whole.narrow(0, r, 2)));
  for (int64_t r = 0; r < 8; ++r) {  // every row is one of the pairs
    EXPECT_TRUE(at::equal(whole[r], expected[0]) || at::equal(whole[r], expected[1]) ||
                at::equal(whole[r], expected[2]));
  }
  EXPECT_THROW(data::PairSampler({5, 0, 6}, 0, 3, 3, 1), std::invalid_argument);  // no target end
}

TEST(Sampler, DeterministicAndIndependentOfRankCount) {
  std::vector<int32_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t(i % 97);
  const data::BatchSampler a(tokens, 16, 42), b(tokens, 16, 42), other(tokens, 16, 43);
  const at::Tensor whole = a.rows(7, 0, 8);
  EXPECT_TRUE(at::equal(whole, b.rows(7, 0, 8)));       // the same seed: the same batch
  EXPECT_FALSE(at::equal(whole, other.rows(7, 0, 8)));  // another seed: another batch
  EXPECT_FALSE(at::equal(whole, a.rows(8, 0, 8)));      // another step: another batch
  for (int ranks : {1, 2, 4, 8}) {                      // any split gives the same rows
    for (int r = 0; r < ranks; ++r) {
      const int64_t n = 8 / ranks;
      EXPECT_TRUE(at::equal(a.rows(7, r * n, n), whole.narrow(0, r * n, n)));
    }
  }
  // A resumed run at step 7 draws exactly the batch the uninterrupted run drew.
  const data::BatchSampler resumed(tokens, 16, 42);
  EXPECT_TRUE(at::equal(resumed.rows(7, 0, 8), whole));
  // Each row is a contiguous window: targets are the inputs shifted by one.
  const at::Tensor row = whole[0];
  EXPECT_EQ(
      (row.narrow(0, 1, 16) - row.narrow(0, 0, 16)).remainder(97).eq(1).sum().item<int64_t>() +
          (row.narrow(0, 1, 16) == 0).sum().item<int64_t>(),
      16);
}
