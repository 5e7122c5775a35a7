// The device communicator's life (comm/comm_life.h), which nccl_communicator.cpp follows: checked
// here on the CPU with counters standing in for ncclCommAbort and ncclCommDestroy.
#include "comm/comm_life.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

namespace flexdemo::comm::detail {
namespace {

struct Counts {
  int aborts = 0, destroys = 0;
};

std::shared_ptr<CommLife> life_of(Counts& c) {
  return std::make_shared<CommLife>([&c] { ++c.aborts; }, [&c] { ++c.destroys; });
}

// The CommError `f` raises, or "(nothing raised)".
template <typename F>
std::string comm_error_of(F&& f) {
  try {
    f();
  } catch (const CommError& e) {
    return e.what();
  }
  return "(nothing raised)";
}
bool says(const std::string& error, const std::string& part) {
  return error.find(part) != std::string::npos;
}

PollState done() {
  return {PollState::Done, {}};
}
PollState pending() {
  return {PollState::Pending, {}};
}

TEST(CommLife, DestroyedOnceAfterTheLastHandleUnlessAborted) {
  Counts c;
  auto life = life_of(c);
  auto work = life;  // a collective's handle outliving the communicator
  life.reset();
  EXPECT_EQ(c.destroys, 0);
  work.reset();
  EXPECT_EQ(c.destroys, 1);
  EXPECT_EQ(c.aborts, 0);
}

TEST(CommLife, AbortedOnceAndNeverDestroyedAfter) {
  Counts c;
  {
    auto life = life_of(c);
    life->abort("first");
    life->abort("second");
    EXPECT_TRUE(life->aborted());
    const std::string error = comm_error_of([&] { life->throw_if_aborted("NCCL all_gather"); });
    EXPECT_TRUE(says(error, "NCCL all_gather")) << error;
    EXPECT_TRUE(says(error, "(first)")) << error;
  }
  EXPECT_EQ(c.aborts, 1);
  EXPECT_EQ(c.destroys, 0);
}

TEST(CommLife, SettlePollsUntilDone) {
  Counts c;
  auto life = life_of(c);
  int polls = 0;
  settle(*life, "init", 10.0, [&] { return ++polls < 5 ? pending() : done(); });
  EXPECT_EQ(polls, 5);
  EXPECT_EQ(c.aborts, 0);
}

TEST(CommLife, AFailureAbortsAndLaterWaitsDoNotPoll) {
  Counts c;
  auto life = life_of(c);
  EXPECT_THROW(settle(*life, "NCCL all_reduce", 10.0,
                      [] {
                        return PollState{PollState::Failed, "remote process exited"};
                      }),
               CommError);
  EXPECT_EQ(c.aborts, 1);
  int polls = 0;
  const std::string error = comm_error_of(
      [&] { settle(*life, "NCCL broadcast", 10.0, [&] { return ++polls, done(); }); });
  EXPECT_TRUE(says(error, "remote process exited")) << error;
  EXPECT_EQ(polls, 0);  // the freed handle is never touched
  EXPECT_EQ(c.aborts, 1);
  life.reset();
  EXPECT_EQ(c.destroys, 0);
}

TEST(CommLife, ATimeoutAbortsWithOneClearLine) {
  Counts c;
  auto life = life_of(c);
  const std::string error =
      comm_error_of([&] { settle(*life, "ncclCommInitRank over 4 ranks", 0.05, pending); });
  EXPECT_TRUE(says(error, "ncclCommInitRank over 4 ranks did not complete within")) << error;
  EXPECT_EQ(c.aborts, 1);
  life.reset();
  EXPECT_EQ(c.destroys, 0);
}

TEST(CommLife, NoTimeoutWaitsAsLongAsItTakes) {
  Counts c;
  auto life = life_of(c);
  int polls = 0;
  const double waited =
      settle(*life, "x", 0.0, [&] { return ++polls < 2000 ? pending() : done(); });
  EXPECT_EQ(polls, 2000);
  EXPECT_GT(waited, 0.0);
}

}  // namespace
}  // namespace flexdemo::comm::detail
