// Step rules: apply a direction, the same on every replica, to this rank's tensors. Sign-SGD
// (DeMo's; plain SGD with sign off), AdamW (the same formula as torch.optim.AdamW) or SGD with
// Nesterov momentum (the same as torch.optim.SGD(nesterov=True)), with decoupled weight decay.
// With sign off, the direction may first be rescaled: each chunk to unit RMS (`normalize`), the
// whole tensor to `update_rms` (or down to `rms_cap` where above it), and each element clamped
// to `step_bound`, in that order. A tensor's RMS is the whole tensor's: where it is sharded
// (a shard group), each shard's sum of squares is gathered over the group, so the step does not
// depend on where the shards are cut; then the updates wait for settle() (one all-gather a
// step; two with --overlap-step, whose committed update is settled before the preview).
// The Optimizer's inner step is one (--inner); with --inner-steps the outer step is another.
#pragma once

#include "demo/backend.h"
#include "demo/kernels.h"
#include "flexdemo/optim.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::optim {

// Where a rule's tensors are shards of larger ones: the group holding the other shards, and per
// tensor its index among the Optimizer's given tensors (of which there are `tensors`, the same
// on every rank of the group: a rank's empty shards take part with nothing).
struct ShardSums {
  std::shared_ptr<comm::Communicator> group;  // null or of size 1: the tensors are whole
  std::vector<int64_t> given;
  int64_t tensors = 0;
};

class StepRule {
 public:
  StepRule(const std::vector<OptimParam>& params, const OptimizerOptions& options,
           ShardSums shards = {});
  void begin_step(double lr);  // once per applied step, before the apply() calls
  // Tensor i: p *= 1 - lr*wd, then the update from direction ([rows, cols] float32); where the
  // RMS is gathered over shards (waits()), at the next settle().
  void apply(size_t i, const at::Tensor& direction);
  // --overlap-step's preview, SGD's step without weight decay: p -= lr * sign(direction), or
  // with sign off the direction rescaled and bounded as the options say; likewise at settle().
  void preview(size_t i, const at::Tensor& direction, double lr);
  // The updates waiting for the whole tensors' RMS, applied: one all-gather over the shard group,
  // made by every rank of the group at the same points (after each step's applies and previews;
  // under --overlap-step also after the committed update), whether or not it holds any; nothing
  // where the rule does not wait.
  void settle();
  // Whether updates wait for settle(): an RMS rule (update_rms, rms_cap; sign off) on shards.
  bool waits() const { return waits_; }
  // Tensor i's update as a DeMo backend applies it fused into the decode (the same update as
  // apply()): sign-SGD with sign, or AdamW, on a float32 tensor; none otherwise (then apply()).
  std::optional<demo::Update> fused_update(size_t i);
  // This step's numbers (AdamW's; sign-SGD reads lr and weight_decay).
  kernels::AdamWHyper hyper() const;
  at::Tensor param(size_t i) const { return params_.at(i); }  // [rows, cols] view of tensor i
  // AdamW's moments or Nesterov's momentum, named for files (handles: loading copies into them).
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  void restore_step(int64_t applied_steps) { step_ = applied_steps; }

 private:
  std::pair<double, double> bias_corrections() const;  // AdamW's 1 - beta1^t, 1 - beta2^t
  // An update waiting for its tensor's whole RMS: this shard's sum of squares, and the update,
  // given the whole tensor's sum and element count.
  struct Pending {
    size_t tensor;
    double squares;
    std::function<void(double squares, double count)> run;
  };
  void take(size_t i, const at::Tensor& direction, double lr);  // apply's and preview's
  // A fused update's sum of squares (demo::Update::measured): its step at the cap's factor, now
  // or at settle().
  void measure(size_t i, double squares, std::function<void(double s)> step);
  // Tensor i's update by a direction (measured(), owned or valid during the call) whose RMS is
  // sqrt(squares / count): the step (lr < 0) or a preview at lr.
  void update(size_t i, const at::Tensor& direction, double lr, double squares, double count);
  // Whether the step measures a direction's RMS (update_rms or rms_cap, sign off).
  bool measures_rms() const {
    return !options_.sign && (options_.update_rms > 0.0 || options_.rms_cap > 0.0);
  }
  // Direction d as the RMS rules measure it: each chunk at unit RMS with `normalize`.
  at::Tensor measured(size_t i, const at::Tensor& direction) const;
  // The SGD step's input from a measured direction: scaled to update_rms (or down to rms_cap)
  // by the RMS sqrt(squares / count), then clamped to step_bound.
  at::Tensor rescaled(const at::Tensor& d, double squares, double count) const;

  std::vector<at::Tensor> params_;  // views [rows, cols] of the leaves
  std::vector<dct::ChunkPlan> plans_;
  OptimizerOptions options_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;  // AdamW moments (float32)
  std::vector<at::Tensor> momentum_;              // Nesterov's (float32)
  int64_t step_ = 0;
  double lr_ = 0.0;  // this step's
  ShardSums shards_;
  bool waits_ = false;
  std::vector<Pending> pending_;  // until settle()
};

}  // namespace flexdemo::optim
