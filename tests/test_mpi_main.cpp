// GoogleTest main for the MPI suites: one MpiRuntime per process, every rank runs every test.
// Rank 0 prints the usual progress; other ranks print only their failed assertions. A test
// that fails on any rank makes that rank exit non-zero, and mpirun with it.
#include "test_mpi.h"

#include "flexdemo/runtime.h"

#include <gtest/gtest.h>

#include <cstdio>

namespace {

flexdemo::comm::MpiRuntime* g_runtime = nullptr;

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "rank %d: %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.summary());
    }
  }

 private:
  int rank_;
};

}  // namespace

std::shared_ptr<flexdemo::comm::Communicator> test_world() {
  return g_runtime->world();
}

int main(int argc, char** argv) {
  flexdemo::use_native_blas(argv);  // the kernels the command runs on this CPU
  flexdemo::comm::MpiRuntime runtime(&argc, &argv);
  g_runtime = &runtime;
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = runtime.world()->rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  const int failed = RUN_ALL_TESTS();
  if (failed) std::fprintf(stderr, "rank %d: tests failed\n", rank);
  return failed;
}
