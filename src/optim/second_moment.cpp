// SharedSecondMoment (second_moment.h): the factored second moment the replicas share.
#include "second_moment.h"

#include "flexdemo/comm.h"
#include "flexdemo/elastic.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace flexdemo::optim {
namespace {

comm::SumWire sum_wire(StatisticsEncoding values) {
  switch (values) {
    case StatisticsEncoding::Fp32:
      return comm::SumWire::Native;
    case StatisticsEncoding::Bf16:
      return comm::SumWire::Bf16;
    case StatisticsEncoding::Log8:
      return comm::SumWire::Log8;
    case StatisticsEncoding::Auto:
      break;  // resolved before (resolved_statistics_values)
  }
  throw std::logic_error("SharedSecondMoment: unknown statistics encoding");
}

constexpr double kTiny = std::numeric_limits<float>::min();  // a total of zero divides nothing

// Which of the given tensors are matrices, and their columns, agreed over the shard group: a
// shard of one row cannot tell a matrix from a vector by itself (its plan is 1 x cols either
// way). A tensor is a matrix where some shard has more than one row; then every shard must have
// its columns (shards cut along dim 0). Each rank reaches the same verdict from the same sums, so
// a bad cut throws on every rank alike.
std::vector<int64_t> agreed_matrix_cols(const std::vector<dct::ChunkPlan>& plans,
                                        const ShardSums& shards) {
  const int64_t n = shards.tensors;
  // Per given tensor, over the shards: (count, sum of cols, sum of cols^2) of those with more
  // than one row, then the same of those with one.
  at::Tensor mine = at::zeros({n, 6}, at::kDouble);
  double* m = mine.data_ptr<double>();
  for (size_t i = 0; i < plans.size(); ++i) {
    if (plans[i].numel() == 0) continue;
    double* row = m + 6 * shards.given.at(i) + (plans[i].rows > 1 ? 0 : 3);
    const double cols = double(plans[i].cols);
    row[0] += 1.0;
    row[1] += cols;
    row[2] += cols * cols;
  }
  comm::Communicator& group = *shards.group;
  const at::Tensor sums = mine.to(group.device());
  group.all_reduce(sums, comm::ReduceOp::Sum);
  const at::Tensor host = sums.to(at::kCPU);
  const double* s = host.data_ptr<double>();
  std::vector<int64_t> cols(size_t(n), 0);
  for (int64_t g = 0; g < n; ++g) {
    const double* t = s + 6 * g;
    if (t[0] == 0) continue;  // a vector (or a matrix whose every shard holds one row)
    // All shards of the matrix hold the same columns: count x sum of squares = square of sum.
    const double many = t[0] * t[2] - t[1] * t[1], one = t[3] * t[5] - t[4] * t[4];
    const double width = t[1] / t[0];
    if (many != 0 || one != 0 || (t[3] > 0 && t[4] / t[3] != width)) {
      throw std::invalid_argument("optimizer: tensor " + std::to_string(g) +
                                  " is cut into shards of different columns; --second-moment "
                                  "shared needs a matrix's shards cut along dim 0");
    }
    cols[size_t(g)] = std::llround(width);
  }
  return cols;
}

}  // namespace

SharedSecondMoment::SharedSecondMoment(const std::vector<dct::ChunkPlan>& plans,
                                       const OptimizerOptions& options, const ShardSums& shards,
                                       std::shared_ptr<comm::Communicator> replicas,
                                       at::Device device)
    : beta2_(options.beta2),
      eps_(options.eps),
      every_(options.second_moment_every),
      wire_(sum_wire(resolved_statistics_values(options.second_moment_values,
                                                options.demo_exchange))),
      shards_(shards),
      replicas_(std::move(replicas)) {
  const bool sharded = shards_.group && shards_.group->size() > 1;
  if (sharded) {
    if (shards_.given.size() != plans.size()) {
      throw std::logic_error("SharedSecondMoment: one given index per sharded tensor");
    }
    shard_cols_ = agreed_matrix_cols(plans, shards_);
  }
  const auto floats = at::dtype(at::kFloat).device(device);
  for (size_t i = 0; i < plans.size(); ++i) {
    Moment t;
    t.rows = plans[i].rows;
    t.cols = plans[i].cols;
    t.matrix = t.rows > 1;
    if (sharded) {
      t.given = shards_.given[i];
      t.matrix = shard_cols_[size_t(t.given)] > 0;
    }
    if (t.matrix) t.shared_rows = at::zeros({t.rows, 1}, floats);
    t.shared_cols = at::zeros({1, t.cols}, floats);
    t.own = at::zeros({t.rows, t.cols}, floats);
    tensors_.push_back(std::move(t));
  }
}

void SharedSecondMoment::accumulate(size_t i, const at::Tensor& grad) {
  Moment& s = tensors_.at(i);
  if (!grad.defined()) {  // a step of zero
    s.own.mul_(beta2_);
    return;
  }
  const at::Tensor g = grad.reshape({s.rows, s.cols}).to(at::kFloat);
  s.own.mul_(beta2_).addcmul_(g, g, 1 - beta2_);
}

at::Tensor SharedSecondMoment::scaled(size_t i, const at::Tensor& grad, int64_t t,
                                      int64_t n) const {
  if (!grad.defined()) return {};
  const Moment& s = tensors_.at(i);
  const at::Tensor g = grad.reshape({s.rows, s.cols}).to(at::kFloat);
  const double decay = std::pow(beta2_, double(n));
  const at::Tensor shared =
      s.matrix ? s.shared_rows * (s.shared_cols * decay / s.shared_cols.sum().clamp_min(kTiny))
               : s.shared_cols * decay;
  const double correction = 1 - std::pow(beta2_, double(t));
  const at::Tensor denominator = shared.add_(s.own).div_(correction).sqrt_().add_(eps_);
  return (g / denominator).reshape(grad.sizes());
}

at::Tensor SharedSecondMoment::precondition(size_t i, const at::Tensor& grad, int64_t t) {
  if (sums_at(t)) {
    throw std::logic_error("SharedSecondMoment: step " + std::to_string(t) +
                           " sums over the replicas: precondition_all");
  }
  accumulate(i, grad);
  return scaled(i, grad, t, since_ + 1);
}

std::vector<at::Tensor> SharedSecondMoment::precondition_all(const std::vector<at::Tensor>& grads,
                                                             int64_t t) {
  if (!sums_at(t) || grads.size() != tensors_.size()) {
    throw std::logic_error("SharedSecondMoment: precondition_all of " +
                           std::to_string(grads.size()) + " gradients for " +
                           std::to_string(tensors_.size()) + " tensors at step " +
                           std::to_string(t) + " (a summing step takes every tensor at once)");
  }
  for (size_t i = 0; i < grads.size(); ++i) accumulate(i, grads[i]);
  sum_over_replicas();  // own is now zero, its steps in shared
  std::vector<at::Tensor> out(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) out[i] = scaled(i, grads[i], t, 0);
  return out;
}

double SharedSecondMoment::link_bytes_per_step() const {
  const int replicas = replicas_ ? replicas_->size() : 1;
  if (replicas < 2) return 0.0;
  int64_t floats = 0;  // what sum_over_replicas sums
  for (const Moment& s : tensors_) floats += s.matrix ? s.rows + s.cols : s.own.numel();
  return comm::sum_in_rank_order_gathered_bytes(floats, replicas, wire_) / double(every_);
}

void SharedSecondMoment::sum_over_replicas() {
  // The own statistics in one buffer: per tensor its row sums (matrices), then its column sums
  // (a vector: its elements).
  std::vector<at::Tensor> parts;
  for (const Moment& s : tensors_) {
    if (s.matrix) parts.push_back(s.own.sum(1));
    parts.push_back(s.matrix ? s.own.sum(0) : s.own.view(-1));
  }
  const at::Device device = replicas_ ? replicas_->device() : at::Device(at::kCPU);
  const at::Tensor sums = parts.empty() ? at::zeros({0}, at::dtype(at::kFloat).device(device))
                                        : at::cat(parts).to(device);
  if (!shard_cols_.empty()) {
    // A matrix's columns are summed over its shards: laid out by given tensor, so that every
    // shard (an empty one too) adds the same places.
    std::vector<int64_t> offset(shard_cols_.size() + 1, 0);
    for (size_t g = 0; g < shard_cols_.size(); ++g) offset[g + 1] = offset[g] + shard_cols_[g];
    comm::Communicator& group = *shards_.group;
    const at::Tensor cols =
        at::zeros({offset.back()}, at::dtype(at::kFloat).device(group.device()));
    int64_t place = 0;
    std::vector<std::pair<int64_t, const Moment*>> placed;  // its columns' place in sums
    for (const Moment& s : tensors_) {
      if (s.matrix) {
        place += s.rows;
        cols.narrow(0, offset[size_t(s.given)], s.cols).copy_(sums.narrow(0, place, s.cols));
        placed.push_back({place, &s});
      }
      place += s.cols;
    }
    comm::sum_in_rank_order(group, cols);
    for (const auto& [where, s] : placed) {
      sums.narrow(0, where, s->cols).copy_(cols.narrow(0, offset[size_t(s->given)], s->cols));
    }
  }
  // Added in rank order: the same bits whatever the transport (both doors agree at any count).
  if (replicas_ && replicas_->size() > 1) comm::sum_in_rank_order(*replicas_, sums, wire_);
  // A replica's non-finite statistics (a corrupt peer: the sum cannot say whose) are left out of
  // the shared ones on every replica alike, as the step's own are; the screening of payloads
  // does not see this sum.
  const bool finite = at::isfinite(sums).all().item<bool>();
  // shared = beta2^n shared + the mean, n the steps in own (this one included).
  const double decay = std::pow(beta2_, double(since_ + 1));
  const at::Device here = tensors_.empty() ? at::Device(at::kCPU) : tensors_[0].own.device();
  const at::Tensor mean = sums.to(here).div_(replicas_ ? double(replicas_->size()) : 1.0);
  int64_t place = 0;
  for (Moment& s : tensors_) {
    if (s.matrix) {
      s.shared_rows.mul_(decay);
      if (finite) s.shared_rows.add_(mean.narrow(0, place, s.rows).view({s.rows, 1}));
      place += s.rows;
    }
    s.shared_cols.mul_(decay);
    if (finite) s.shared_cols.add_(mean.narrow(0, place, s.cols).view({1, s.cols}));
    place += s.cols;
    s.own.zero_();
  }
  since_ = 0;
}

NamedTensors SharedSecondMoment::state_tensors() const {
  NamedTensors state;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Moment& s = tensors_[i];
    const std::string n = "." + std::to_string(i);
    if (s.matrix) state.push_back({kMomentRowsState + n, s.shared_rows});
    state.push_back({kMomentColsState + n, s.shared_cols});
    if (every_ > 1) state.push_back({kMomentOwnState + n, s.own});
  }
  return state;
}

// ====== The second moment across a resume (flexdemo/elastic.h) ======

std::vector<std::string> second_moment_state(SecondMoment kind) {
  switch (kind) {
    case SecondMoment::Own:
      return {kOwnMomentState};
    case SecondMoment::Shared:
      return {kMomentRowsState, kMomentColsState, kMomentOwnState};
    case SecondMoment::Auto:
      break;
  }
  return {};
}

SecondMoment second_moment_of(const std::string& name) {
  const std::string first = name.substr(0, name.find('.'));
  for (const SecondMoment kind : {SecondMoment::Own, SecondMoment::Shared}) {
    for (const std::string& state : second_moment_state(kind)) {
      if (first == state) return kind;
    }
  }
  return SecondMoment::Auto;
}

SavedSecondMoment saved_second_moment(const std::vector<std::string>& state_names) {
  bool own = false, shared = false, summed_apart = false;
  for (const std::string& name : state_names) {
    const SecondMoment kind = second_moment_of(name);
    own = own || kind == SecondMoment::Own;
    shared = shared || kind == SecondMoment::Shared;
    summed_apart = summed_apart || name.substr(0, name.find('.')) == kMomentOwnState;
  }
  if (own == shared) return {};
  return {own ? SecondMoment::Own : SecondMoment::Shared, summed_apart};
}

OptimizerOptions resumed_second_moment(OptimizerOptions options, int64_t replicas,
                                       const SavedSecondMoment& saved) {
  if (!options.precondition || saved.kind == SecondMoment::Auto) return options;
  const SecondMoment ours = resolved_second_moment(options.second_moment, replicas);
  if (ours != saved.kind) {
    if (options.second_moment != SecondMoment::Auto) {
      throw OptionsError("the checkpoint holds the " + name_of(saved.kind) +
                         " second moment, this run's is " + name_of(ours) + " (" +
                         std::to_string(replicas) + " replicas): pass {second_moment} " +
                         name_of(saved.kind) + " or auto to keep the checkpoint's");
    }
    options.second_moment = saved.kind;
    if (saved.kind == SecondMoment::Own) {  // which takes no interval or encoding
      const OptimizerOptions defaults;
      options.second_moment_every = defaults.second_moment_every;
      options.second_moment_values = defaults.second_moment_values;
    }
  }
  if (saved.kind == SecondMoment::Shared &&
      saved.summed_apart != (options.second_moment_every > 1)) {
    throw OptionsError(std::string("the checkpoint's shared second moment was summed ") +
                       (saved.summed_apart ? "every few steps" : "every step") +
                       ", this run's {second_moment_every} is " +
                       std::to_string(options.second_moment_every) +
                       ": pass the checkpoint's run's");
  }
  return options;
}

}  // namespace flexdemo::optim
