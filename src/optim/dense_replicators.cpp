// The dense replicators: Full (all-reduce average of the gradient, plain HSDP), None (local
// only) and Random (a seeded random subset of rows of a residual, dense-averaged). Each sends a
// step's tensors in one flat bucket.
#include "replicator.h"
#include "step_rule.h"

#include "flexdemo/comm.h"

#include <ATen/ATen.h>

#include <cmath>
#include <random>

namespace flexdemo::optim {
namespace {

// Where each tensor sits in a flat float32 bucket.
std::vector<int64_t> bucket_offsets(const std::vector<dct::ChunkPlan>& plans, int64_t* total) {
  std::vector<int64_t> offsets;
  *total = 0;
  for (const auto& p : plans) {
    offsets.push_back(*total);
    *total += p.numel();
  }
  return offsets;
}

// ====== Full and None ======
class DenseReplicator final : public Replicator {
 public:
  DenseReplicator(const std::vector<dct::ChunkPlan>& plans, const OptimizerOptions& options,
                  std::shared_ptr<comm::Communicator> group, bool exchange, at::Device device)
      : plans_(plans), options_(options), group_(std::move(group)), exchange_(exchange) {
    int64_t total = 0;
    offsets_ = bucket_offsets(plans_, &total);
    bucket_ = at::zeros({total}, at::dtype(at::kFloat).device(device));
    traffic_.params = total;
    traffic_.wire_bytes = exchange_ ? uint64_t(total) * 4 : 0;
  }

  void accumulate(const std::vector<at::Tensor>& grads, double) override {
    for (size_t i = 0; i < plans_.size(); ++i) {
      if (grads[i].defined()) slice(i).add_(grads[i].reshape({-1}));
    }
    ++pending_;
  }

  void exchange(const std::vector<at::Tensor>& grads, double lr, StepRule& inner) override {
    accumulate(grads, lr);
    if (pending_ > 1) bucket_.div_(double(pending_));  // the mean gradient since the last one
    if (exchange_ && group_ && group_->size() > 1) {
      group_->all_reduce(bucket_, comm::ReduceOp::Avg);
    }
    for (size_t i = 0; i < plans_.size(); ++i) {
      inner.apply(i, slice(i).view({plans_[i].rows, plans_[i].cols}));
    }
    bucket_.zero_();
    pending_ = 0;
  }

  ExchangeTraffic traffic() const override { return traffic_; }
  // The bucket carries gradients from one step to the next only when exchanges are spaced out;
  // each tensor's part is a view of it.
  NamedTensors state_tensors() const override {
    if (options_.replicate_every == 1) return {};
    std::vector<at::Tensor> sums;
    for (size_t i = 0; i < plans_.size(); ++i) {
      sums.push_back(slice(i).view({plans_[i].rows, plans_[i].cols}));
    }
    return numbered("gradient_sum", sums);
  }
  void restore_counters(int64_t, int64_t pending) override { pending_ = pending; }

 private:
  at::Tensor slice(size_t i) const { return bucket_.narrow(0, offsets_[i], plans_[i].numel()); }

  std::vector<dct::ChunkPlan> plans_;
  OptimizerOptions options_;
  std::shared_ptr<comm::Communicator> group_;
  bool exchange_;
  std::vector<int64_t> offsets_;
  at::Tensor bucket_;  // float32: every tensor's summed gradient back to back
  int64_t pending_ = 0;
  ExchangeTraffic traffic_;
};

// ====== Random ======
// Rows of a matrix, elements of a vector: the units Random picks from.
struct Units {
  int64_t count, length;
};
Units units_of(const dct::ChunkPlan& p) {
  return p.rows > 1 ? Units{p.rows, p.cols} : Units{p.cols, 1};
}

// `count` distinct units out of `n`, ascending, from a generator every replica seeds alike.
std::vector<int64_t> pick_units(uint64_t seed, uint64_t exchange, uint64_t tensor, int64_t n,
                                int64_t count) {
  std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), uint32_t(exchange),
                    uint32_t(exchange >> 32), uint32_t(tensor)};
  std::mt19937_64 rng(seq);
  std::vector<int64_t> all(n);
  for (int64_t u = 0; u < n; ++u) all[u] = u;
  for (int64_t j = 0; j < count; ++j) {  // partial Fisher-Yates, the same on every platform
    const int64_t r = j + int64_t(rng() % uint64_t(n - j));
    std::swap(all[j], all[r]);
  }
  all.resize(count);
  std::sort(all.begin(), all.end());
  return all;
}

class RandomReplicator final : public Replicator {
 public:
  RandomReplicator(const std::vector<dct::ChunkPlan>& plans, const OptimizerOptions& options,
                   std::shared_ptr<comm::Communicator> group, at::Device device)
      : plans_(plans), options_(options), group_(std::move(group)), device_(device) {
    int64_t total = 0;
    for (const auto& p : plans_) {
      residuals_.push_back(at::zeros({p.rows, p.cols}, at::dtype(at::kFloat).device(device)));
      const Units u = units_of(p);
      picked_.push_back(std::max<int64_t>(1, std::llround(options.random_fraction * u.count)));
      total += picked_.back() * u.length;
      traffic_.params += p.numel();
    }
    bucket_ = at::empty({total}, at::dtype(at::kFloat).device(device));
    traffic_.wire_bytes = uint64_t(total) * 4;
  }

  void accumulate(const std::vector<at::Tensor>& grads, double lr) override {
    for (size_t i = 0; i < plans_.size(); ++i) {
      residuals_[i].mul_(options_.decay);
      if (grads[i].defined()) residuals_[i].add_(grads[i].view(residuals_[i].sizes()), lr);
    }
  }

  void exchange(const std::vector<at::Tensor>& grads, double lr, StepRule& inner) override {
    accumulate(grads, lr);
    std::vector<at::Tensor> indices;
    int64_t offset = 0;
    for (size_t i = 0; i < plans_.size(); ++i) {  // pack the picked units; they leave the residual
      const Units u = units_of(plans_[i]);
      const std::vector<int64_t> picked =
          pick_units(options_.seed, exchanges_, i, u.count, picked_[i]);
      indices.push_back(at::tensor(picked, at::kLong).to(device_));
      const at::Tensor units = residuals_[i].view({u.count, u.length});
      bucket_.narrow(0, offset, picked_[i] * u.length)
          .view({picked_[i], u.length})
          .copy_(units.index_select(0, indices[i]));
      units.index_fill_(0, indices[i], 0.0);
      offset += picked_[i] * u.length;
    }
    if (group_ && group_->size() > 1) group_->all_reduce(bucket_, comm::ReduceOp::Avg);
    offset = 0;
    for (size_t i = 0; i < plans_.size(); ++i) {
      const Units u = units_of(plans_[i]);
      at::Tensor direction = at::zeros({u.count, u.length}, bucket_.options());
      direction.index_copy_(
          0, indices[i],
          bucket_.narrow(0, offset, picked_[i] * u.length).view({picked_[i], u.length}));
      offset += picked_[i] * u.length;
      inner.apply(i, direction.view({plans_[i].rows, plans_[i].cols}));
    }
    ++exchanges_;
  }

  ExchangeTraffic traffic() const override { return traffic_; }
  NamedTensors state_tensors() const override { return numbered("residual", residuals_); }
  void restore_counters(int64_t exchanges, int64_t) override { exchanges_ = uint64_t(exchanges); }
  const at::Tensor& residual(size_t i) const override { return residuals_.at(i); }

 private:
  std::vector<dct::ChunkPlan> plans_;
  OptimizerOptions options_;
  std::shared_ptr<comm::Communicator> group_;
  at::Device device_;                  // where the state lives
  std::vector<at::Tensor> residuals_;  // per tensor, sample domain, [rows, cols]
  std::vector<int64_t> picked_;        // units exchanged per tensor
  at::Tensor bucket_;                  // float32: the picked units of every tensor
  uint64_t exchanges_ = 0;
  ExchangeTraffic traffic_;
};

}  // namespace

std::unique_ptr<Replicator> make_dense_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                  const OptimizerOptions& options,
                                                  std::shared_ptr<comm::Communicator> group,
                                                  bool exchange, at::Device device) {
  return std::make_unique<DenseReplicator>(plans, options, std::move(group), exchange, device);
}

std::unique_ptr<Replicator> make_random_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                   const OptimizerOptions& options,
                                                   std::shared_ptr<comm::Communicator> group,
                                                   at::Device device) {
  return std::make_unique<RandomReplicator>(plans, options, std::move(group), device);
}

}  // namespace flexdemo::optim
