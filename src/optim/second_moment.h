// SharedSecondMoment: the preconditioner's second moment shared by the replicas (--second-moment
// shared), for ExchangeEveryStep. Each replica's own running mean square (the default) comes from
// its share of the batch alone; with R replicas it is noisier than the one AdamW-HSDP divides by,
// and DeMo averages the replicas' gradients after that division, so the gap to AdamW-HSDP grows
// with R (docs/results/many-nodes.md). Here the second moment is shared and factored as
// Adafactor's: per tensor, the running mean over the replicas of its row sums and column sums of
// g^2 (a vector: of its elements' g^2), estimating v_ij = rows_i * cols_j / total over the whole
// tensor where it is sharded (column sums added over the shard group). Exchanged: rows + cols
// floats a tensor, summed over the replicas every `every` steps, that step's g^2 included. The
// n steps since the last sum are each replica's own, element by element, so that step t divides
// by
//   v = beta2^n * shared + own,   own = (1 - beta2) * sum over those steps of beta2^(n-k) g_k^2,
// bias-corrected by 1 - beta2^t as AdamW's (every 1: v is the shared one alone). It does not
// depend on where the shards are cut, except for a matrix whose every shard holds one row (a
// shard's plan cannot tell it from a vector's piece: it keeps its elements' g^2).
#pragma once

#include "comm/rank_order_sum.h"
#include "replicator.h"
#include "step_rule.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}  // namespace flexdemo::comm

namespace flexdemo::optim {

// The state's names, before each tensor's ".i" (flexdemo/elastic.h reads a checkpoint's kind of
// second moment from them): each replica's own (ExchangeEveryStep's), then the shared one's.
inline constexpr char kOwnMomentState[] = "grad_sq";
inline constexpr char kMomentRowsState[] = "moment_rows";  // of matrices
inline constexpr char kMomentColsState[] = "moment_cols";
inline constexpr char kMomentOwnState[] = "moment_own";  // every > 1: own since the last sum

class SharedSecondMoment {
 public:
  // plans: this rank's tensors (shards: their part of the chunk grid, cut along dim 0); shards:
  // where they are shards (null or of size 1: whole; a collective over it agrees which tensors
  // are matrices); replicas: the replica group (null: one replica).
  SharedSecondMoment(const std::vector<dct::ChunkPlan>& plans, const OptimizerOptions& options,
                     const ShardSums& shards, std::shared_ptr<comm::Communicator> replicas,
                     at::Device device);

  // Whether step t's statistics are summed over the replicas: its gradients are then
  // preconditioned all at once (precondition_all), not one by one.
  bool sums_at(int64_t t) const { return t % every_ == 0; }
  // Step t's gradients, where sums_at(t) (this rank's tensors; undefined = zero), divided by the
  // root of the second moment: a collective over the shard group and the replicas.
  std::vector<at::Tensor> precondition_all(const std::vector<at::Tensor>& grads, int64_t t);
  // Tensor i's gradient of step t, where !sums_at(t); end_step() after the step's last one.
  at::Tensor precondition(size_t i, const at::Tensor& grad, int64_t t);
  void end_step() { ++since_; }
  // The shared statistics (moment_rows.i of matrices, moment_cols.i; with every > 1 also this
  // replica's own since the last sum, moment_own.i).
  NamedTensors state_tensors() const;
  // After loading state written after step `steps`.
  void restore(int64_t steps) { since_ = steps % every_; }
  // What its sums put on the link between replicas a step, on average, as the bytes a rank of an
  // all-gather sends each other rank: a rank-order sum of n values of b bytes over R replicas
  // sends what an all-gather of 2bn / R bytes does (2 (R - 1) / R of the values, as a ring
  // all-reduce), every `every` steps.
  double link_bytes_per_step() const;

 private:
  void accumulate(size_t i, const at::Tensor& grad);  // own = beta2 * own + (1 - beta2) g^2
  // g / (sqrt((beta2^n shared + own) / (1 - beta2^t)) + eps).
  at::Tensor scaled(size_t i, const at::Tensor& grad, int64_t t, int64_t n) const;
  void sum_over_replicas();  // shared = beta2^n shared + the replicas' mean of own; own = 0

  struct Moment {
    int64_t rows = 1, cols = 1;
    bool matrix = false;         // factored (rows x cols); a vector keeps its elements' squares
    int64_t given = 0;           // its index among the Optimizer's given tensors
    at::Tensor shared_rows;      // [rows, 1] (matrices): the replicas' mean, running
    at::Tensor shared_cols;      // [1, cols]: likewise, a matrix's over the whole tensor
    at::Tensor own;              // [rows, cols]: this replica's g^2 since the last sum
  };
  std::vector<Moment> tensors_;
  double beta2_, eps_;
  int64_t every_;
  comm::SumWire wire_;  // of the sum over the replicas (second_moment_values)
  ShardSums shards_;
  std::vector<int64_t> shard_cols_;  // per given tensor: its columns summed over shards (0: none)
  std::shared_ptr<comm::Communicator> replicas_;
  int64_t since_ = 0;  // the steps in own before this one
};

}  // namespace flexdemo::optim
