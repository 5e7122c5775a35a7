// sum_in_rank_order: an all-reduce built from the collectives that adds in rank order, so that the
// same inputs give the same bits on every transport. The engine's (cmake/engine.cmake).
#pragma once

#include "flexdemo/comm.h"

#include <cstdint>
#include <utility>

namespace flexdemo::comm {

// How sum_in_rank_order's copies and sums cross the group.
enum class SumWire {
  Native,  // the tensor's own dtype
  Bf16,    // float32 rounded to bfloat16: half the bytes
  Log8,    // non-negative float32 as log8 (below): a quarter of the bytes, 4 more a slice
};

// Sums `tensor` over `group` in place (any dtype the all-to-all takes), every element added in
// rank order, rank 0 first: the same bits under MPI, NCCL and torch.distributed, where a
// transport's own all-reduce adds in an order of its choosing (from 3 ranks on, the doors would
// round apart). Each rank sums its slice (n / size() elements, the first n % size() ranks one
// more) from every rank's copy (an all-to-all), then the slices are gathered: a ring all-reduce's
// bytes, in two collectives. Collective over `group`; `tensor` contiguous.
// wire other than Native (float32 tensors only): each rank's copy is rounded to it before it is
// sent, the owner of a slice adds the copies in float32 and rounds the sum to it: every rank ends
// with the same widened sums.
void sum_in_rank_order(Communicator& group, const at::Tensor& tensor,
                       SumWire wire = SumWire::Native);

// The bytes one rank sends in sum_in_rank_order of n values over `ranks` ranks, counted as an
// all-gather's contribution (what a link budget weighs): 2 (b n / ranks + h), b a value's bytes
// and h a slice's header (4 under Log8). Uneven slices differ from it by at most a value a slice.
// native_bytes: a value's bytes under Native.
double sum_in_rank_order_gathered_bytes(int64_t n, int ranks, SumWire wire,
                                        int64_t native_bytes = 4);

// log8: a slice of non-negative float32 values as one int32 exponent E (max < 2^E, the largest
// finite value's binade; the machine's byte order) and a byte a value, value ~ 2^(E - d/8) at
// d = 254 - code: the nearest eighth of an octave (a rounding within 2^(1/16), 4.4%; a sum of
// rounded copies rounded again is within 2^(1/8)) over 31.6 octaves below the slice's largest.
// Code 0 is zero (and a negative value), 255 a non-finite one (decoded as NaN, so a sum can
// still tell), and a positive value further below the largest travels as the lowest code: it
// stays positive, decoded larger than it was (a statistic the preconditioner divides by: that
// element's step smaller, never larger). Every step is exact float arithmetic and comparisons
// (frexp, a table of eight constants, powers of two from their bits), so every device decodes
// the same bits; a decoded value below float32's least normal rounds as float multiplication does.
std::pair<at::Tensor, at::Tensor> log8_encode(const at::Tensor& values);  // (E int32 [1], uint8)
at::Tensor log8_decode(const at::Tensor& exponent, const at::Tensor& codes);  // float32

}  // namespace flexdemo::comm
