// SharedSecondMoment: the preconditioner's second moment shared by the replicas (--second-moment
// shared), for ExchangeEveryStep. Each replica's own running mean square (the default) comes from
// its share of the batch alone; with R replicas that is R times noisier than the one AdamW-HSDP
// divides by, and DeMo averages the replicas' gradients after that division, so the gap to
// AdamW-HSDP grows with R (docs/results/many-nodes.md). Here the second moment is factored as
// Adafactor's: per tensor, the running mean over replicas of its row sums and column sums of g^2
// (a vector: its elements'), the estimate v_ij = rows_i * cols_j / total, over the whole tensor
// where it is sharded (column sums added over the shard group). What is exchanged is rows + cols
// floats a tensor, summed over the replicas every `every` steps; the steps since, each replica
// adds its own, so that step t divides by
//   v = beta2^n * shared + own,  own = the EMA of this replica's factored g^2 over its n steps,
// bias-corrected by 1 - beta2^t as AdamW's. The sum starts at the end of a step and travels while
// the next step's forward and backward run; the next precondition() waits for it.
#pragma once

#include "replicator.h"
#include "step_rule.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace flexdemo::comm {
class Communicator;
class Work;
}  // namespace flexdemo::comm

namespace flexdemo::optim {

class SharedSecondMoment {
 public:
  // plans: this rank's tensors (shards: their part of the chunk grid, cut along dim 0); shards:
  // where they are shards (null or of size 1: whole; a collective over it agrees which tensors
  // are matrices); replicas: the replica group (null: one replica).
  SharedSecondMoment(const std::vector<dct::ChunkPlan>& plans, const OptimizerOptions& options,
                     const ShardSums& shards, std::shared_ptr<comm::Communicator> replicas,
                     at::Device device);
  ~SharedSecondMoment();

  // Tensor i's gradient divided by the root of the second moment, at step t (1-based). An
  // undefined gradient counts as zero and stays undefined.
  at::Tensor precondition(size_t i, const at::Tensor& grad, int64_t t);
  // After every tensor of step t: every `every` steps, starts the sum over the replicas.
  void end_step(int64_t t);
  // The shared statistics (moment_rows.i of matrices, moment_cols.i; with every > 1 also this
  // replica's own since the last sum, moment_own.i), a sum in flight finished first.
  NamedTensors state_tensors() const;
  // After loading state written after step `steps`.
  void restore(int64_t steps);

 private:
  void finish() const;  // the sum in flight, if any, folded into the shared statistics

  struct Tensor {
    int64_t rows = 1, cols = 1;
    bool matrix = false;         // factored (rows x cols); a vector keeps its elements' squares
    int64_t given = 0;           // its index among the Optimizer's given tensors
    at::Tensor shared_rows;      // [rows, 1] (matrices): the replicas' mean, running
    at::Tensor shared_cols;      // [1, cols]: likewise, a matrix's over the whole tensor
    at::Tensor own;              // [rows, cols]: this replica's g^2 since the last sum
  };
  std::vector<Tensor> tensors_;
  double beta2_, eps_;
  int64_t every_;
  ShardSums shards_;
  std::vector<int64_t> shard_cols_;  // per given tensor: its columns summed over shards (0: none)
  std::shared_ptr<comm::Communicator> replicas_;
  int64_t since_ = 0;  // steps in the own statistics
  // The sum in flight: its buffer, its handle and the steps it holds.
  mutable at::Tensor wire_;
  mutable std::unique_ptr<comm::Work> work_;
  mutable int64_t wire_steps_ = 0;
};

}  // namespace flexdemo::optim
