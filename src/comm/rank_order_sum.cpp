// sum_in_rank_order (rank_order_sum.h): two collectives and a sum in rank order between them.
#include "rank_order_sum.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <vector>

namespace flexdemo::comm {

void sum_in_rank_order(Communicator& group, const at::Tensor& tensor) {
  const int ranks = group.size();
  const int64_t n = tensor.numel();
  if (ranks == 1 || n == 0) return;
  if (!tensor.is_contiguous()) {
    throw std::invalid_argument("sum_in_rank_order: the tensor must be contiguous");
  }
  // Rank r owns counts[r] elements, back to back in rank order.
  std::vector<int64_t> counts(size_t(ranks), n / ranks);
  for (int64_t r = 0; r < n % ranks; ++r) ++counts[size_t(r)];
  const int64_t mine = counts[size_t(group.rank())];
  const at::Tensor flat = tensor.view({-1});
  // pieces[r]: rank r's copy of this rank's slice.
  const at::Tensor pieces = at::empty({ranks, mine}, tensor.options());
  group.all_to_all_v(flat, counts, pieces.view({-1}), std::vector<int64_t>(size_t(ranks), mine));
  const at::Tensor sum = pieces[0].clone();
  for (int r = 1; r < ranks; ++r) sum.add_(pieces[r]);
  const at::Tensor whole = at::empty_like(flat);
  group.all_gather_v(sum, whole, counts);
  flat.copy_(whole);
}

}  // namespace flexdemo::comm
