// sum_in_rank_order: an all-reduce built from the collectives that adds in rank order, so that the
// same inputs give the same bits on every transport. The engine's (cmake/engine.cmake).
#pragma once

#include "flexdemo/comm.h"

namespace flexdemo::comm {

// Sums `tensor` over `group` in place (any dtype the all-to-all takes), every element added in
// rank order, rank 0 first: the same bits under MPI, NCCL and torch.distributed, where a
// transport's own all-reduce adds in an order of its choosing (from 3 ranks on, the doors would
// round apart). Each rank sums its slice (n / size() elements, the first n % size() ranks one
// more) from every rank's copy (an all-to-all), then the slices are gathered: a ring all-reduce's
// bytes, in two collectives. Collective over `group`; `tensor` contiguous.
// wire: a narrower dtype on the wire (bf16 for a float32 tensor: half the bytes), or Undefined
// for the tensor's own. Each rank's copy is rounded to it before it is sent, the owner adds the
// copies in the tensor's dtype and rounds the sum to it: every rank ends with the same widened
// sums.
void sum_in_rank_order(Communicator& group, const at::Tensor& tensor,
                       at::ScalarType wire = at::ScalarType::Undefined);

}  // namespace flexdemo::comm
