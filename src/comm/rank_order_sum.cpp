// sum_in_rank_order (rank_order_sum.h): two collectives and a sum in rank order between them.
#include "rank_order_sum.h"

#include <ATen/ATen.h>

#include <stdexcept>
#include <vector>

namespace flexdemo::comm {

void sum_in_rank_order(Communicator& group, const at::Tensor& tensor, at::ScalarType wire) {
  const int ranks = group.size();
  const int64_t n = tensor.numel();
  if (ranks == 1 || n == 0) return;
  if (!tensor.is_contiguous()) {
    throw std::invalid_argument("sum_in_rank_order: the tensor must be contiguous");
  }
  if (wire == at::ScalarType::Undefined) wire = tensor.scalar_type();
  // Rank r owns counts[r] elements, back to back in rank order.
  std::vector<int64_t> counts(size_t(ranks), n / ranks);
  for (int64_t r = 0; r < n % ranks; ++r) ++counts[size_t(r)];
  const int64_t mine = counts[size_t(group.rank())];
  const at::Tensor flat = tensor.view({-1});
  const at::Tensor sent = flat.to(wire);  // the tensor itself where the wire is its dtype
  // pieces[r]: rank r's copy of this rank's slice.
  const at::Tensor pieces = at::empty({ranks, mine}, sent.options());
  const at::Tensor whole = at::empty_like(sent);
  // A narrower dtype travels as its bytes, which every transport takes.
  const bool narrowed = wire != tensor.scalar_type();
  const int64_t size = narrowed ? int64_t(sent.element_size()) : 1;
  auto on_wire = [&](const at::Tensor& t) { return narrowed ? t.view(at::kByte) : t; };
  std::vector<int64_t> sizes = counts;
  for (int64_t& s : sizes) s *= size;
  group.all_to_all_v(on_wire(sent), sizes, on_wire(pieces.view({-1})),
                     std::vector<int64_t>(size_t(ranks), mine * size));
  const at::Tensor sum = pieces[0].to(tensor.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  for (int r = 1; r < ranks; ++r) sum.add_(pieces[r].to(tensor.scalar_type()));
  group.all_gather_v(on_wire(sum.to(wire)), on_wire(whole), sizes);
  flat.copy_(whole);
}

}  // namespace flexdemo::comm
