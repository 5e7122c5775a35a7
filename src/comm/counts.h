// Argument checks shared by the communicator's backends.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::comm::detail {

// iall_to_all_v's counts against its tensors (one count per rank, none negative, each list's
// sum the tensor's size, one dtype). Returns the bytes this rank sends to and receives from the
// other ranks. Throws std::invalid_argument naming what does not fit.
inline std::pair<uint64_t, uint64_t> check_all_to_all_counts(
    int size, int rank, const at::Tensor& input, const std::vector<int64_t>& send_counts,
    const at::Tensor& output, const std::vector<int64_t>& recv_counts) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("all_to_all_v: " + what); };
  if (input.dtype() != output.dtype()) fail("input and output must have one dtype");
  const uint64_t element = uint64_t(input.element_size());
  uint64_t sent = 0, received = 0;
  for (const auto* counts : {&send_counts, &recv_counts}) {
    const bool sending = counts == &send_counts;
    const char* name = sending ? "send_counts" : "recv_counts";
    if (int(counts->size()) != size) {
      fail(std::string("need one of ") + name + " per rank (" + std::to_string(size) + "), got " +
           std::to_string(counts->size()));
    }
    int64_t total = 0;
    for (int r = 0; r < size; ++r) {
      const int64_t c = (*counts)[r];
      if (c < 0) fail(std::string(name) + "[" + std::to_string(r) + "] is negative");
      total += c;
      if (r != rank) (sending ? sent : received) += uint64_t(c) * element;
    }
    const int64_t have = sending ? input.numel() : output.numel();
    if (total != have) {
      fail(std::string(name) + " sum to " + std::to_string(total) + " elements, the " +
           (sending ? "input" : "output") + " has " + std::to_string(have));
    }
  }
  return {sent, received};
}

}  // namespace flexdemo::comm::detail
