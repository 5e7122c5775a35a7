// The MPI communicator on real ranks: every collective's result against a closed form, the
// byte accounting, the engine's sum in rank order, sub-communicators, host staging, and MPI
// errors surfacing as CommError.
#include "test_mpi.h"

#include "comm/rank_order_sum.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

using flexdemo::comm::CommError;
using flexdemo::comm::ReduceOp;

TEST(Comm, AllGatherEqualSizes) {
  auto world = test_world();
  const int P = world->size(), r = world->rank();
  at::Tensor in = at::arange(3, at::kFloat) + 10 * r;
  at::Tensor out = at::empty({3 * P});
  world->all_gather(in, out);
  for (int q = 0; q < P; ++q)
    EXPECT_TRUE(at::equal(out.narrow(0, 3 * q, 3), at::arange(3, at::kFloat) + 10 * q));
}

TEST(Comm, AllGatherVariableSizes) {
  auto world = test_world();
  const int P = world->size(), r = world->rank();
  std::vector<int64_t> counts;
  int64_t total = 0;
  for (int q = 0; q < P; ++q) {
    counts.push_back(q + 1);
    total += q + 1;
  }
  at::Tensor in = at::full({r + 1}, double(r), at::kDouble);
  at::Tensor out = at::empty({total}, at::kDouble);
  world->all_gather_v(in, out, counts);
  int64_t at_ = 0;
  for (int q = 0; q < P; ++q) {
    EXPECT_TRUE(at::all(out.narrow(0, at_, q + 1) == q).item<bool>());
    at_ += q + 1;
  }
}

TEST(Comm, AllToAllVariableSizes) {
  // Rank s sends (s + d) % 3 elements to rank d (some none), element j worth 1000 s + 10 d + j.
  auto world = test_world();
  const int P = world->size(), r = world->rank();
  auto count = [](int s, int d) { return int64_t((s + d) % 3); };
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<double> values;
  uint64_t sent = 0, received = 0;
  for (int q = 0; q < P; ++q) {
    send_counts.push_back(count(r, q));
    recv_counts.push_back(count(q, r));
    for (int64_t j = 0; j < count(r, q); ++j) values.push_back(1000.0 * r + 10.0 * q + j);
    if (q != r) sent += 8 * count(r, q), received += 8 * count(q, r);
  }
  const at::Tensor in = at::tensor(values, at::kDouble);
  int64_t total = 0;
  for (int64_t c : recv_counts) total += c;
  at::Tensor out = at::full({total}, -1.0, at::kDouble);
  world->reset_stats();
  world->all_to_all_v(in, send_counts, out, recv_counts);
  int64_t at_ = 0;
  for (int q = 0; q < P; ++q) {
    for (int64_t j = 0; j < count(q, r); ++j) {
      EXPECT_EQ(out[at_++].item<double>(), 1000.0 * q + 10.0 * r + j) << "from rank " << q;
    }
  }
  EXPECT_EQ(world->stats().bytes_sent, sent);
  EXPECT_EQ(world->stats().bytes_received, received);
  // Counts that do not add up to the tensors are refused before anything is sent.
  std::vector<int64_t> short_counts = send_counts;
  short_counts[0] += 1;
  EXPECT_THROW(world->all_to_all_v(in, short_counts, out, recv_counts), std::invalid_argument);
  EXPECT_THROW(world->all_to_all_v(in, {1}, out, recv_counts), std::invalid_argument);
}

TEST(Comm, AllReduceSumAndAverage) {
  auto world = test_world();
  const int P = world->size(), r = world->rank();
  const double sum = P * (P + 1) / 2.0;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kDouble}) {
    at::Tensor t = at::full({5}, r + 1.0, at::TensorOptions().dtype(dtype));
    world->all_reduce(t, ReduceOp::Sum);
    EXPECT_TRUE(at::all(t == sum).item<bool>()) << dtype;
    at::Tensor a = at::full({5}, r + 1.0, at::TensorOptions().dtype(dtype));
    world->all_reduce(a, ReduceOp::Avg);
    EXPECT_TRUE(at::allclose(a.to(at::kDouble), at::full({5}, sum / P, at::kDouble), 1e-2))
        << dtype;
  }
  // Sizes on both sides of Open MPI's algorithm choices (under one element a rank, the
  // reduce-scatter and all-gather from 64 KiB), each element its own sum: r + 1 + (i mod 7).
  for (int64_t n : {int64_t(1), int64_t(3), int64_t(100003)}) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      const at::Tensor pattern = at::arange(n, at::kLong).remainder(7);
      at::Tensor t = (pattern + (r + 1)).to(dtype);
      world->all_reduce(t, ReduceOp::Sum);
      const at::Tensor expected = pattern.to(at::kDouble) * P + sum;
      EXPECT_TRUE(at::equal(t.to(at::kDouble), expected)) << n << " " << dtype;
    }
  }
  at::Tensor i = at::full({2}, int64_t(r), at::kLong);
  world->all_reduce(i, ReduceOp::Sum);
  EXPECT_EQ(i[0].item<int64_t>(), int64_t(P) * (P - 1) / 2);
  EXPECT_THROW(world->all_reduce(i, ReduceOp::Avg), std::invalid_argument);
}

// sum_in_rank_order: each element is ((x_0 + x_1) + x_2) + ... in float32, x_r rank r's, on every
// rank, at sizes under one element a rank, uneven and large; inputs of mixed magnitudes, so that
// another order rounds otherwise (checked: the reverse order differs somewhere). Bytes: a ring
// all-reduce's where the size divides evenly.
TEST(Comm, SumInRankOrderAddsRankZeroFirst) {
  auto world = test_world();
  auto group = world->split(0, world->rank());  // fresh counters
  const int P = group->size(), r = group->rank();
  auto input = [](int64_t n, int rank) {  // (1 + i/n) scaled by 2^((3 i + 5 rank) mod 29 - 14)
    const at::Tensor i = at::arange(n, at::kLong);
    const at::Tensor scale = at::pow(2.0, ((3 * i + 5 * rank).remainder(29) - 14).to(at::kDouble));
    return ((1 + i.to(at::kDouble) / double(n)) * scale).to(at::kFloat);
  };
  for (int64_t n : {int64_t(1), int64_t(3), int64_t(1001), int64_t(100003)}) {
    at::Tensor t = input(n, r);
    flexdemo::comm::sum_in_rank_order(*group, t);
    at::Tensor forward = input(n, 0), backward = input(n, P - 1);
    for (int q = 1; q < P; ++q) {
      forward.add_(input(n, q));
      backward.add_(input(n, P - 1 - q));
    }
    EXPECT_TRUE(at::equal(t, forward)) << n;
    if (n > 1000 && P > 2) EXPECT_FALSE(at::equal(forward, backward)) << n;
  }
  group->reset_stats();
  at::Tensor even = at::ones({64 * int64_t(P)});
  flexdemo::comm::sum_in_rank_order(*group, even);
  EXPECT_TRUE(at::all(even == float(P)).item<bool>());
  EXPECT_EQ(group->stats().bytes_sent, uint64_t(2 * (P - 1) * 64 * 4));
  // bf16 on the wire: every copy rounded to bfloat16, added in float32 in rank order, the sum
  // rounded again; half the bytes.
  auto bf16 = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kFloat); };
  for (int64_t n : {int64_t(3), int64_t(1001)}) {
    at::Tensor t = input(n, r);
    flexdemo::comm::sum_in_rank_order(*group, t, flexdemo::comm::SumWire::Bf16);
    at::Tensor forward = bf16(input(n, 0));
    for (int q = 1; q < P; ++q) forward.add_(bf16(input(n, q)));
    EXPECT_TRUE(at::equal(t, bf16(forward))) << n;
    if (n > 1000) EXPECT_FALSE(at::equal(t, forward)) << n;  // the sum was rounded too
  }
  group->reset_stats();
  flexdemo::comm::sum_in_rank_order(*group, even, flexdemo::comm::SumWire::Bf16);
  EXPECT_TRUE(at::all(even == float(P * P)).item<bool>());
  EXPECT_EQ(group->stats().bytes_sent, uint64_t(2 * (P - 1) * 64 * 2));
  // log8 on the wire, against log8 written out in float64 here: every slice's copy rounded to
  // eighths of an octave below its largest, added in float32 in rank order, the sum rounded so
  // again; a byte a value and 4 a slice.
  auto slices = [P](int64_t n) {  // (offset, count) of each rank's slice
    std::vector<std::pair<int64_t, int64_t>> out;
    int64_t at = 0;
    for (int q = 0; q < P; ++q) {
      const int64_t count = n / P + (q < n % P ? 1 : 0);
      out.push_back({at, count});
      at += count;
    }
    return out;
  };
  auto log8 = [&](const at::Tensor& t) {  // each slice: E, then 2^(E - d/8), d = 8 (E - log2 x)
    at::Tensor out = t.to(at::kDouble).clone();
    double* o = out.data_ptr<double>();
    for (const auto& [offset, count] : slices(t.numel())) {
      double largest = 0.0;
      for (int64_t i = offset; i < offset + count; ++i) largest = std::max(largest, o[i]);
      int E = 0;
      std::frexp(largest, &E);
      for (int64_t i = offset; i < offset + count; ++i) {
        if (o[i] <= 0.0) continue;
        const double d = std::min(253.0, std::nearbyint(8.0 * (E - std::log2(o[i]))));
        o[i] = std::exp2(double(E) - d / 8.0);
      }
    }
    return out.to(at::kFloat);
  };
  const double bound = std::exp2(1.0 / 8.0) * (1.0 + 1e-6) - 1.0;  // two roundings of 2^(1/16)
  for (int64_t n : {int64_t(3), int64_t(1001)}) {
    at::Tensor t = input(n, r);
    flexdemo::comm::sum_in_rank_order(*group, t, flexdemo::comm::SumWire::Log8);
    at::Tensor forward = log8(input(n, 0));
    at::Tensor exact = input(n, 0).to(at::kDouble);
    for (int q = 1; q < P; ++q) {
      forward.add_(log8(input(n, q)));
      exact.add_(input(n, q).to(at::kDouble));
    }
    EXPECT_TRUE(at::equal(t, log8(forward))) << n;
    const double worst = ((t.to(at::kDouble) - exact).abs() / exact).max().item<double>();
    EXPECT_LE(worst, bound) << n;
    if (n > 1000) {
      EXPECT_GT(worst, 0.02) << n;  // rounded, not carried exactly
    }
  }
  group->reset_stats();
  at::Tensor ones = at::ones({64 * int64_t(P)});
  flexdemo::comm::sum_in_rank_order(*group, ones, flexdemo::comm::SumWire::Log8);
  EXPECT_TRUE(at::equal(ones, log8(at::full({64 * int64_t(P)}, float(P)))));  // 1 is exact
  EXPECT_EQ(group->stats().bytes_sent, uint64_t(2 * (P - 1) * (64 + 4)));
}

TEST(Comm, Log8KeepsZeroPositiveAndNonFinite) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // The largest 3; 2^-40 lies more than the code's 31.6 octaves below it.
  const at::Tensor x = at::tensor({3.0f, 0.0f, -2.0f, std::ldexp(1.0f, -40), nan, inf, 1.0f});
  const auto [exponent, codes] = flexdemo::comm::log8_encode(x);
  EXPECT_EQ(exponent.item<int>(), 2);  // 3 < 2^2
  EXPECT_EQ(codes.numel(), x.numel());
  const at::Tensor back = flexdemo::comm::log8_decode(exponent, codes);
  const float* b = back.data_ptr<float>();
  EXPECT_NEAR(b[0], 3.0f, 3.0 * (std::exp2(1.0 / 16.0) - 1.0));
  EXPECT_EQ(b[1], 0.0f);
  EXPECT_EQ(b[2], 0.0f);  // a negative value has no code: zero
  EXPECT_GT(b[3], 0.0f);  // the lowest code: positive stays positive
  EXPECT_FLOAT_EQ(b[3], float(std::exp2(2.0 - 253.0 / 8.0)));
  EXPECT_TRUE(std::isnan(b[4]));
  EXPECT_TRUE(std::isnan(b[5]));
  EXPECT_EQ(b[6], 1.0f);  // a power of two: exact
  // The largest binade float32 has (E = 128), and the least normal ones (2^-126 and below, some
  // decoded as subnormals): still the nearest eighth of an octave.
  const float top = std::ldexp(1.4f, 127), low = std::ldexp(1.4f, -124);
  for (const float v : {top, low}) {
    const auto [e, c] = flexdemo::comm::log8_encode(at::tensor({v, v / 3.0f, v / 7.0f}));
    const at::Tensor d = flexdemo::comm::log8_decode(e, c).to(at::kDouble);
    const at::Tensor want = at::tensor({double(v), v / 3.0, v / 7.0}, at::kDouble);
    EXPECT_LE(((d - want).abs() / want).max().item<double>(), std::exp2(1.0 / 16.0) - 1.0 + 1e-6)
        << v;
    EXPECT_TRUE(std::isfinite(d[0].item<double>())) << v;
  }
  const auto [zero_exponent, zero_codes] = flexdemo::comm::log8_encode(at::zeros({4}));
  EXPECT_TRUE(at::all(flexdemo::comm::log8_decode(zero_exponent, zero_codes) == 0).item<bool>());
}

TEST(Comm, ReduceScatter) {
  auto world = test_world();
  const int P = world->size(), r = world->rank();
  at::Tensor in = at::arange(2 * P, at::kFloat) * (r + 1);  // slice q holds 2q, 2q+1 times r+1
  at::Tensor out = at::empty({2});
  world->reduce_scatter(in, out, ReduceOp::Sum);
  const double ranks = P * (P + 1) / 2.0;
  EXPECT_EQ(out[0].item<float>(), float(2 * r * ranks));
  EXPECT_EQ(out[1].item<float>(), float((2 * r + 1) * ranks));
  world->reduce_scatter(in, out, ReduceOp::Avg);
  EXPECT_FLOAT_EQ(out[1].item<float>(), float((2 * r + 1) * ranks / P));
}

TEST(Comm, BroadcastAndBarrier) {
  auto world = test_world();
  const int root = world->size() - 1;
  at::Tensor t = at::full({4}, world->rank() == root ? 42.0 : -1.0);
  world->broadcast(t, root);
  EXPECT_TRUE(at::all(t == 42.0).item<bool>());
  world->barrier();
}

TEST(Comm, NonBlockingHandlesCompleteOnWait) {
  auto world = test_world();
  const int P = world->size();
  at::Tensor a = at::ones({1000});
  at::Tensor in = at::full({2}, double(world->rank()));
  at::Tensor out = at::empty({2 * P});
  auto w1 = world->iall_reduce(a, ReduceOp::Sum);
  auto w2 = world->iall_gather(in, out);
  w2->wait();
  w1->wait();
  w1->wait();  // idempotent
  EXPECT_TRUE(w1->is_completed());
  EXPECT_TRUE(at::all(a == P).item<bool>());
  EXPECT_EQ(out[2 * P - 1].item<float>(), float(P - 1));
}

TEST(Comm, StagesNonContiguousTensors) {
  auto world = test_world();
  at::Tensor base = at::ones({3, 4});
  at::Tensor view = base.t();  // not contiguous: goes through a host copy and comes back
  world->all_reduce(view, ReduceOp::Sum);
  EXPECT_TRUE(at::all(base == world->size()).item<bool>());
}

TEST(Comm, SplitFormsSubgroups) {
  auto world = test_world();
  const int P = world->size(), r = world->rank();
  auto sub = world->split(r % 2, r);
  EXPECT_EQ(sub->size(), (P + 1 - r % 2) / 2);
  EXPECT_EQ(sub->rank(), r / 2);
  at::Tensor t = at::full({1}, 1.0);
  sub->all_reduce(t, ReduceOp::Sum);
  EXPECT_EQ(t.item<float>(), float(sub->size()));
  EXPECT_EQ(world->split(0, -r)->rank(), P - 1 - r);  // key orders the new ranks
}

TEST(Comm, CountsRingBytes) {
  auto world = test_world();
  auto group = world->split(0, world->rank());  // fresh counters
  const uint64_t P = group->size();
  at::Tensor in = at::zeros({100}, at::kByte);
  at::Tensor out = at::empty({int64_t(100 * P)}, at::kByte);
  group->all_gather(in, out);
  EXPECT_EQ(group->stats().bytes_sent, (P - 1) * 100);
  EXPECT_EQ(group->stats().bytes_received, (P - 1) * 100);
  at::Tensor f = at::zeros({64 * int64_t(P)});
  group->all_reduce(f, ReduceOp::Sum);
  EXPECT_EQ(group->stats().bytes_sent, (P - 1) * 100 + 2 * (P - 1) * 64 * 4);
  EXPECT_EQ(group->stats().collectives, 2u);
  EXPECT_GT(group->stats().seconds, 0.0);
  group->reset_stats();
  EXPECT_EQ(group->stats().bytes_sent, 0u);
}

TEST(Comm, MpiErrorsBecomeExceptions) {
  auto world = test_world();
  at::Tensor t = at::zeros({1});
  try {
    world->broadcast(t, world->size() + 3);  // no such root: MPI itself rejects it
    ADD_FAILURE() << "an invalid root was accepted";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("MPI_Ibcast"), std::string::npos) << e.what();
  }
  at::Tensor wrong = at::empty({1});
  EXPECT_THROW(world->all_gather(t, wrong.expand({1})), std::invalid_argument);
}
