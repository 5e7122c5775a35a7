// --link-budget auto's choice against hand-computed cases: the ladder of schedules the bounds
// allow, and the first one whose predicted exchange fits its budget.
#include "flexdemo/link_budget.h"

#include <gtest/gtest.h>

using namespace flexdemo;
using compress::ValueEncoding;
using optim::ExchangeSchedule;

TEST(LinkBudget, LadderGoesDownTopKThenOutInInterval) {
  optim::LinkBounds b;
  b.min_topk = 8;
  b.max_topk = 128;
  b.max_every = 4;
  b.values = {ValueEncoding::Bf16, ValueEncoding::TwoBit};
  const std::vector<ExchangeSchedule> expected = {
      {128, ValueEncoding::Bf16, 1}, {128, ValueEncoding::TwoBit, 1},
      {64, ValueEncoding::Bf16, 1},  {64, ValueEncoding::TwoBit, 1},
      {32, ValueEncoding::Bf16, 1},  {32, ValueEncoding::TwoBit, 1},
      {16, ValueEncoding::Bf16, 1},  {16, ValueEncoding::TwoBit, 1},
      {8, ValueEncoding::Bf16, 1},   {8, ValueEncoding::TwoBit, 1},
      {8, ValueEncoding::TwoBit, 2}, {8, ValueEncoding::TwoBit, 4}};
  EXPECT_EQ(optim::link_ladder(b), expected);
  // Bounds off the powers of two end on the bounds themselves.
  b.min_topk = 30;
  b.max_topk = 100;
  b.max_every = 6;
  b.values = {ValueEncoding::Fp32};
  const std::vector<ExchangeSchedule> odd = {
      {100, ValueEncoding::Fp32, 1}, {50, ValueEncoding::Fp32, 1}, {30, ValueEncoding::Fp32, 1},
      {30, ValueEncoding::Fp32, 2},  {30, ValueEncoding::Fp32, 4}, {30, ValueEncoding::Fp32, 6}};
  EXPECT_EQ(optim::link_ladder(b), odd);
  b.min_topk = b.max_topk = 16;
  b.max_every = 1;
  EXPECT_EQ(optim::link_ladder(b), std::vector<ExchangeSchedule>({{16, ValueEncoding::Fp32, 1}}));
}

TEST(LinkBudget, ChoosesTheFirstScheduleThatFitsItsBudget) {
  // 1 ms latency, 101 ms for the probe: 0.1 s per kProbeBytes beyond the latency.
  optim::LinkMeasure m;
  m.latency_s = 0.001;
  m.probe_s = 0.101;
  m.probe_bytes = optim::LinkBudget::kProbeBytes;
  m.compute_s = 1.0;
  EXPECT_DOUBLE_EQ(m.exchange_s(2 * m.probe_bytes), 0.201);
  EXPECT_DOUBLE_EQ(optim::exchange_budget_s(true, 1.0, 1), 0.8);
  EXPECT_DOUBLE_EQ(optim::exchange_budget_s(false, 1.0, 4), 0.4);
  const std::vector<ExchangeSchedule> ladder = {{64, ValueEncoding::Bf16, 1},
                                                {64, ValueEncoding::TwoBit, 1},
                                                {32, ValueEncoding::TwoBit, 1},
                                                {32, ValueEncoding::TwoBit, 4}};
  // Under --overlap-step an exchange every step may take 0.8 s: 0.001 + 0.1 * bytes / probe
  // <= 0.8 holds up to 7.99 probes' worth of bytes.
  const double probe = m.probe_bytes;
  std::vector<double> bytes = {9 * probe, 8 * probe, 7 * probe, 7 * probe};
  EXPECT_EQ(optim::choose_schedule(ladder, bytes, m, true), 2u);
  bytes = {7.9 * probe, 7 * probe, 6 * probe, 6 * probe};
  EXPECT_EQ(optim::choose_schedule(ladder, bytes, m, true), 0u);
  // Without it an exchange every step may take 0.1 s (half a probe: 0.051 s), every 4 steps
  // 0.4 s (3.9 probes: 0.391 s).
  bytes = {4 * probe, 2 * probe, 0.5 * probe, 3.9 * probe};
  EXPECT_EQ(optim::choose_schedule(ladder, bytes, m, false), 2u);
  bytes = {4 * probe, 2 * probe, 1.5 * probe, 3.9 * probe};
  EXPECT_EQ(optim::choose_schedule(ladder, bytes, m, false), 3u);
  // Nothing fits: the last, the fewest bytes a step.
  bytes = {40 * probe, 20 * probe, 15 * probe, 39 * probe};
  EXPECT_EQ(optim::choose_schedule(ladder, bytes, m, false), 3u);
  // One replica (nothing measured): the first.
  EXPECT_EQ(optim::choose_schedule(ladder, bytes, optim::LinkMeasure{0, 0, probe, 1.0}, true), 0u);
}
