// Shared by the MPI test files: the world communicator of this test process, small helpers.
#pragma once
#include "flexdemo/comm.h"

#include <ATen/ATen.h>

#include <vector>

std::shared_ptr<flexdemo::comm::Communicator> test_world();

// An int64 [rows, columns] tensor of equally long rows.
inline at::Tensor long_rows(const std::vector<std::vector<int64_t>>& rows) {
  std::vector<at::Tensor> out;
  for (const auto& r : rows) out.push_back(at::tensor(r, at::kLong));
  return at::stack(out);
}
