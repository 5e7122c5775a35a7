// flexdemo/shard.h — FSDP-style sharding inside a shard group, without hooks.
// Each parameter is cut along dim 0 in whole chunk-rows (a vector: in whole chunks), so every
// DCT chunk lies in one shard and the optimizer's result does not depend on the shard size.
// A unit's forward all-gathers its parameters; its backward reduce-scatters (averages) their
// gradients and adds them to the shards' .grad() as soon as that unit's backward is done.
#pragma once

#include "flexdemo/dct.h"
#include "flexdemo/optim.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::shard {

// How one parameter is split among the S ranks of a shard group.
struct ShardSpec {
  std::vector<int64_t> shape;  // the full parameter
  dct::ChunkPlan plan;         // the full parameter's chunk plan
  int64_t unit_numel = 0;      // elements of one indivisible unit: a chunk-row, or a vector chunk
  int64_t shard_numel = 0;     // storage per rank, the same on every rank (a tail is padding)
  int64_t begin = 0;           // this rank's elements [begin, end) of the flattened parameter
  int64_t end = 0;
  dct::ChunkPlan shard_plan;  // this rank's part of the chunk grid; numel() == end - begin
};
ShardSpec make_shard_spec(at::IntArrayRef shape, int64_t chunk, dct::ChunkMode mode, int shard_rank,
                          int shard_size);

struct ShardOptions {
  // The parameters' chunk geometry. The optimizer takes it from the units (optim_params: each
  // shard's plan), so it is set here only.
  int64_t chunk = 64;
  dct::ChunkMode chunk_mode = dct::ChunkMode::Divisor;
  // true: free the gathered parameters after forward and gather them again in backward,
  // recomputing the unit (FSDP's FULL_SHARD with checkpointing); false: keep them until the
  // backward (SHARD_GRAD_OP).
  bool reshard_after_forward = true;
  // Where the shards, the gathered parameters and the gradients live (the full parameters given
  // may be anywhere). The shard group's communicator must take tensors there.
  at::Device device = at::kCPU;
};

// fn(full parameters, inputs) -> output. Must be deterministic: it may run twice.
using UnitFn = std::function<at::Tensor(const std::vector<at::Tensor>& params,
                                        const std::vector<at::Tensor>& inputs)>;

class ShardedUnit;

// Prefetching (as FSDP2 does) around one forward of a unit: next, the unit the forward runs after
// it, starts its all-gather as soon as this unit's own gather is complete, so that it travels
// while this unit computes; before, the unit whose output this one takes, likewise in the
// backward (its backward runs next; with reshard_after_forward, where the backward gathers again).
struct Prefetch {
  ShardedUnit* next = nullptr;
  ShardedUnit* before = nullptr;
};

// A group of parameters that is gathered and reduce-scattered together (one collective each
// way), e.g. a transformer block. Must outlive the backward of every forward it ran.
class ShardedUnit {
 public:
  // full_params: float32, the same values on every rank of the shard group (the initial model).
  ShardedUnit(std::string name, const std::vector<at::Tensor>& full_params,
              std::shared_ptr<comm::Communicator> shard_group, ShardOptions options = {});
  ~ShardedUnit();
  ShardedUnit(const ShardedUnit&) = delete;
  ShardedUnit& operator=(const ShardedUnit&) = delete;

  const std::string& name() const;
  // Runs fn on the gathered parameters. With grad mode on, gradients reach the shards' .grad()
  // (averaged over the shard group); without, it is a plain gathered evaluation.
  at::Tensor forward(const UnitFn& fn, const std::vector<at::Tensor>& inputs,
                     const Prefetch& prefetch = {});
  // Starts this unit's all-gather without waiting; its next gather uses it, unless the
  // parameters have changed since (in-place writes bump their version). Collective: every rank
  // of the shard group prefetches in the same order.
  void prefetch();
  // fn runs in the backward, each time the backward of the unit's last outstanding forward (in
  // grad mode) has added its gradients to the shards' .grad(): from then until the next forward
  // the shards' gradients are complete (e.g. to start their exchange). Empty: none.
  void on_gradients_ready(std::function<void()> fn);
  // The full parameters, detached (evaluation, checkpoints). Collective over the shard group.
  std::vector<at::Tensor> gather() const;
  // Sets this rank's shards from full parameters (a checkpoint); shapes must match.
  void load(const std::vector<at::Tensor>& full_params);

  const std::vector<at::Tensor>& shards() const;  // leaves: float32 [shard_numel], requires_grad
  const std::vector<ShardSpec>& specs() const;
  std::vector<optim::OptimParam> optim_params() const;  // for an Optimizer
  int64_t param_bytes() const;                          // this rank's shards
  int64_t grad_bytes() const;                           // this rank's shard gradients

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ====== A model's units together ======
using Units = std::vector<std::unique_ptr<ShardedUnit>>;

// Every unit's optimizer tensors, unit after unit: the order an Optimizer over a model indexes.
std::vector<optim::OptimParam> optim_params(const Units& units);

// Owns the exchange-in-backward hook for one backward: while it lives, each unit whose backward
// is done (its gradients final) hands its tensors to optimizer.start_exchange, so the exchange
// between nodes starts during the rest of the backward. The optimizer must index the units'
// tensors as optim_params(units) does. Every replica runs the same backward, so the buckets
// start in the same order everywhere. Removes the callbacks when it goes.
class ExchangeInBackward {
 public:
  ExchangeInBackward(const Units& units, optim::Optimizer& optimizer);
  ~ExchangeInBackward();
  ExchangeInBackward(const ExchangeInBackward&) = delete;
  ExchangeInBackward& operator=(const ExchangeInBackward&) = delete;

 private:
  const Units& units_;
};

}  // namespace flexdemo::shard
