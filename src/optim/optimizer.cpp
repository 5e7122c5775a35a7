// The optimizer driver: validates options, asks the replicator for each tensor's direction
// (every replicate_every steps) and has the inner optimizer apply it; or, with inner_steps > 1,
// takes local steps and every inner_steps steps has the replicator exchange the pseudo-gradient
// and the outer optimizer apply it. Never talks to MPI.
#include "flexdemo/optim.h"

#include "replicator.h"
#include "step_rule.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <sstream>
#include <stdexcept>

namespace flexdemo::optim {

// ====== Options ======
void OptimizerOptions::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("optimizer: " + what); };
  auto str = [](double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  if (!(lr > 0.0)) fail("lr must be > 0, got " + str(lr));
  if (!(weight_decay >= 0.0) || !(lr * weight_decay < 1.0)) {
    fail("weight_decay must be >= 0 with lr * weight_decay < 1, got " + str(weight_decay));
  }
  if (!(beta1 >= 0.0 && beta1 < 1.0)) fail("beta1 must be in [0, 1), got " + str(beta1));
  if (!(beta2 >= 0.0 && beta2 < 1.0)) fail("beta2 must be in [0, 1), got " + str(beta2));
  if (!(eps > 0.0)) fail("eps must be > 0, got " + str(eps));
  if (!(decay >= 0.0 && decay < 1.0)) fail("decay must be in [0, 1), got " + str(decay));
  if (topk <= 0) fail("topk must be > 0, got " + std::to_string(topk));
  if (chunk <= 0) fail("chunk must be > 0, got " + std::to_string(chunk));
  if (replicate_every < 1) {
    fail("replicate_every must be >= 1, got " + std::to_string(replicate_every));
  }
  if (overlap_step && replicator != ReplicatorKind::Demo) {
    fail("overlap_step needs the demo replicator");
  }
  if (!(random_fraction > 0.0 && random_fraction <= 1.0)) {
    fail("random_fraction must be in (0, 1], got " + str(random_fraction));
  }
  if (!(momentum >= 0.0 && momentum < 1.0))
    fail("momentum must be in [0, 1), got " + str(momentum));
  if (inner_steps < 1) fail("inner_steps must be >= 1, got " + std::to_string(inner_steps));
  if (!(outer_lr > 0.0)) fail("outer_lr must be > 0, got " + str(outer_lr));
  if (!(outer_momentum >= 0.0 && outer_momentum < 1.0)) {
    fail("outer_momentum must be in [0, 1), got " + str(outer_momentum));
  }
  if (inner_steps > 1 && replicate_every > 1) {
    fail(
        "inner_steps and replicate_every exclude each other (both set how often replicas "
        "exchange)");
  }
  if (inner_steps > 1 && overlap_step) fail("overlap_step does not take inner_steps");
}

// ====== The driver ======
struct Optimizer::Impl {
  std::vector<OptimParam> params;  // non-empty tensors only
  std::vector<int64_t> slot;       // per tensor given: its index in params, -1 if empty
  std::vector<int64_t> given;      // per tensor in params: its index among those given
  std::vector<dct::ChunkPlan> plans;
  OptimizerOptions options;
  std::unique_ptr<Replicator> replicator;
  std::unique_ptr<StepRule> inner;
  int64_t steps = 0;
  ExchangeSchedule schedule;  // as set; the replicator reports the top-k and values in use
  ExchangeCounters counters;
  // inner_steps > 1: `replicator` exchanges pseudo-gradients and `outer` (Nesterov SGD, on them or
  // on their sign) applies them to `anchors`, the parameters of the last exchange; `inner` takes
  // the local steps.
  std::vector<at::Tensor> anchors;  // float32 [rows, cols]
  std::unique_ptr<StepRule> outer;

  bool local_steps() const { return options.inner_steps > 1; }
  void local_step(const std::vector<at::Tensor>& grads, double lr);
  void outer_step();
};

namespace {

std::vector<OptimParam> whole_parameters(std::vector<at::Tensor> params,
                                         const OptimizerOptions& o) {
  o.validate();
  std::vector<OptimParam> out;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].defined() || params[i].numel() == 0) {
      throw std::invalid_argument("optimizer: parameter " + std::to_string(i) + " is empty");
    }
    out.push_back({params[i], dct::make_chunk_plan(params[i].sizes(), o.chunk, o.chunk_mode)});
  }
  return out;
}

}  // namespace

Optimizer::Optimizer(std::vector<at::Tensor> params, OptimizerOptions options,
                     std::shared_ptr<comm::Communicator> replica_group)
    : Optimizer(whole_parameters(std::move(params), options), options, std::move(replica_group)) {}

Optimizer::Optimizer(std::vector<OptimParam> params, OptimizerOptions options,
                     std::shared_ptr<comm::Communicator> replica_group)
    : impl_(std::make_unique<Impl>()) {
  options.validate();
  Impl& s = *impl_;
  s.options = options;
  s.schedule = {options.topk, options.values, options.replicate_every};
  for (size_t i = 0; i < params.size(); ++i) {
    const OptimParam& p = params[i];
    s.slot.push_back(-1);
    if (p.plan.numel() == 0) continue;  // an empty shard: nothing to update or send
    if (!p.leaf.defined() || !at::isFloatingType(p.leaf.scalar_type()) || !p.leaf.is_contiguous() ||
        p.leaf.numel() < p.plan.numel()) {
      throw std::invalid_argument("optimizer: parameter " + std::to_string(i) +
                                  " must be a contiguous floating tensor of at least " +
                                  std::to_string(p.plan.numel()) + " elements");
    }
    if (!s.params.empty() && p.leaf.device() != s.params.front().leaf.device()) {
      throw std::invalid_argument("optimizer: parameter " + std::to_string(i) + " is on " +
                                  p.leaf.device().str() + ", the others on " +
                                  s.params.front().leaf.device().str());
    }
    s.slot.back() = int64_t(s.params.size());
    s.given.push_back(int64_t(i));
    s.params.push_back(p);
    s.plans.push_back(p.plan);
  }
  const at::Device device =
      s.params.empty() ? at::Device(at::kCPU) : s.params.front().leaf.device();
  s.inner = std::make_unique<StepRule>(s.params, options);
  if (!s.local_steps()) {
    s.replicator = make_replicator(s.plans, options, std::move(replica_group), device);
    return;
  }
  if (device.is_cuda() && options.replicator != ReplicatorKind::Full &&
      options.replicator != ReplicatorKind::None) {
    throw std::invalid_argument(
        "optimizer: inner_steps > 1 exchanges through the demo or random replicator on CPUs only "
        "(on a GPU: the full one)");
  }
  std::vector<OptimParam> anchors;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const dct::ChunkPlan& plan = s.plans[i];
    s.anchors.push_back(at::empty({plan.rows, plan.cols}, at::dtype(at::kFloat).device(device)));
    anchors.push_back({s.anchors.back(), plan});
  }
  OptimizerOptions outer = options;
  outer.inner = InnerKind::Nesterov;
  outer.sign = options.outer_sign;
  outer.lr = options.outer_lr;
  outer.momentum = options.outer_momentum;
  outer.weight_decay = 0.0;  // the local steps decay the weights
  s.replicator = make_replicator(s.plans, outer, std::move(replica_group), device);
  s.outer = std::make_unique<StepRule>(anchors, outer);
}

Optimizer::~Optimizer() = default;

namespace {

// Tensor p's gradient as the replicator takes it: plan.numel() elements, undefined = zero.
at::Tensor flat_grad(const OptimParam& p) {
  const at::Tensor& g = p.leaf.grad();
  return g.defined() ? g.reshape({-1}).narrow(0, 0, p.plan.numel()) : at::Tensor();
}

}  // namespace

void Optimizer::start_exchange(const std::vector<size_t>& tensors) {
  Impl& s = *impl_;
  if (s.counters.folded + 1 < s.schedule.every) return;  // step() only folds them in
  if (s.local_steps()) return;  // the exchange is of the parameters, after the step
  at::NoGradGuard no_grad;
  std::vector<size_t> mine;
  std::vector<at::Tensor> grads;
  for (size_t t : tensors) {
    if (t >= s.slot.size()) {
      throw std::out_of_range("optimizer: start_exchange of tensor " + std::to_string(t) +
                              ", only " + std::to_string(s.slot.size()) + " given");
    }
    if (s.slot[t] < 0) continue;
    mine.push_back(size_t(s.slot[t]));
    grads.push_back(flat_grad(s.params[mine.back()]));
  }
  s.replicator->start(mine, grads, s.options.lr);
}

void Optimizer::step() {
  Impl& s = *impl_;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const OptimParam& p : s.params) grads.push_back(flat_grad(p));
  ++s.steps;
  const double lr = s.options.lr;
  if (s.local_steps()) {
    s.local_step(grads, lr);
    if (s.steps % s.options.inner_steps == 0) s.outer_step();
    return;
  }
  if (s.counters.folded + 1 < s.schedule.every) {
    ++s.counters.folded;
    s.replicator->accumulate(grads, lr);
    return;
  }
  s.counters.folded = 0;
  ++s.counters.exchanges;
  s.inner->begin_step(lr);
  s.replicator->exchange(grads, lr, *s.inner);
}

void Optimizer::Impl::local_step(const std::vector<at::Tensor>& grads, double lr) {
  if (steps == 1) {  // the parameters as training starts (after any --init-from) anchor round 1
    for (size_t i = 0; i < anchors.size(); ++i) anchors[i].copy_(inner->param(i));
  }
  inner->begin_step(lr);
  for (size_t i = 0; i < params.size(); ++i) {
    const dct::ChunkPlan& plan = plans[i];
    inner->apply(i, grads[i].defined() ? grads[i].view({plan.rows, plan.cols}).to(at::kFloat)
                                       : at::zeros({plan.rows, plan.cols}, anchors[i].options()));
  }
}

// The pseudo-gradient (anchor - now) through the replicator with lr 1, its replicas' mean applied
// to the anchors by the outer optimizer; every replica continues from the new anchors.
void Optimizer::Impl::outer_step() {
  std::vector<at::Tensor> pseudo;
  for (size_t i = 0; i < params.size(); ++i) {
    pseudo.push_back((anchors[i] - inner->param(i).to(at::kFloat)).reshape({-1}));
  }
  outer->begin_step(options.outer_lr);
  replicator->exchange(pseudo, 1.0, *outer);
  for (size_t i = 0; i < params.size(); ++i) inner->param(i).copy_(anchors[i]);
}

void Optimizer::zero_grad() {
  for (OptimParam& p : impl_->params) {
    if (p.leaf.grad().defined()) p.leaf.mutable_grad().zero_();
  }
}

const OptimizerOptions& Optimizer::options() const {
  return impl_->options;
}
void Optimizer::set_lr(double lr) {
  if (!(lr > 0.0))
    throw std::invalid_argument("optimizer: lr must be > 0, got " + std::to_string(lr));
  impl_->options.lr = lr;
}
ExchangeTraffic Optimizer::traffic() const {
  return impl_->replicator->traffic();
}
int64_t Optimizer::steps() const {
  return impl_->steps;
}

ExchangeSchedule Optimizer::schedule() const {
  return impl_->schedule;
}

ExchangeSchedule Optimizer::schedule_in_flight() const {
  ExchangeSchedule in_use = impl_->schedule;
  if (const auto layout = impl_->replicator->layout()) {
    in_use.topk = layout->first;
    in_use.values = layout->second;
  }
  return in_use;
}

void Optimizer::set_schedule(const ExchangeSchedule& schedule) {
  Impl& s = *impl_;
  if (s.options.replicator != ReplicatorKind::Demo || s.local_steps()) {
    throw std::invalid_argument(
        "optimizer: the exchange schedule changes with the demo replicator and inner_steps 1 only");
  }
  if (schedule.topk <= 0 || schedule.every < 1) {
    throw std::invalid_argument("optimizer: a schedule needs topk > 0 and every >= 1, got topk " +
                                std::to_string(schedule.topk) + ", every " +
                                std::to_string(schedule.every));
  }
  s.schedule = schedule;
  s.replicator->set_layout(schedule.topk, schedule.values);
}

ExchangeCounters Optimizer::counters() const {
  return impl_->counters;
}

void Optimizer::wait_in_flight() {
  impl_->replicator->wait_in_flight();
}

uint64_t Optimizer::wire_bytes(const ExchangeSchedule& schedule) const {
  if (impl_->options.replicator != ReplicatorKind::Demo) return traffic().wire_bytes;
  uint64_t bytes = 0;
  for (const dct::ChunkPlan& plan : impl_->plans) {
    bytes += compress::wire_payload_bytes(plan, schedule.topk, schedule.values);
  }
  return bytes;
}
std::vector<std::pair<std::string, at::Tensor>> Optimizer::state_tensors() const {
  const Impl& s = *impl_;
  NamedTensors state;
  if (s.local_steps()) {  // this replica's own parameters, loaded after the checkpoint's weights
    for (size_t i = 0; i < s.params.size(); ++i) {
      state.push_back({"local." + std::to_string(i), s.inner->param(i)});
    }
    for (auto& t : numbered("anchor", s.anchors)) state.push_back(t);
    for (auto& [name, t] : s.outer->state_tensors()) state.push_back({"outer." + name, t});
    for (auto& [name, t] : s.replicator->state_tensors()) state.push_back({"outer." + name, t});
  } else {
    state = s.replicator->state_tensors();
    // --overlap-step's preview: the checkpoint's weights are replica 0's, each replica's own
    // parameters (the committed ones plus its own preview) are loaded after them.
    if (!s.replicator->committed_params().empty()) {
      for (size_t i = 0; i < s.params.size(); ++i) {
        state.push_back({"previewed." + std::to_string(i), s.inner->param(i)});
      }
    }
  }
  for (auto& t : s.inner->state_tensors()) state.push_back(t);
  // The replicator and the inner optimizer number the non-empty tensors; the name carries the
  // index among all given, the same on every sharding (elastic resume matches them by it).
  for (auto& [name, t] : state) {
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos) continue;
    name.replace(dot + 1, std::string::npos,
                 std::to_string(impl_->given.at(std::stoul(name.substr(dot + 1)))));
  }
  return state;
}

int64_t Optimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& [name, t] : state_tensors()) bytes += t.numel() * t.element_size();
  return bytes;
}

void Optimizer::restore_steps(int64_t steps) {
  Impl& s = *impl_;
  if (s.local_steps()) {
    s.steps = steps;
    s.inner->restore_step(steps);
    s.outer->restore_step(steps / s.options.inner_steps);
    s.replicator->restore_counters(steps / s.options.inner_steps, 0);
    return;
  }
  const int64_t every = s.schedule.every;
  restore_steps(steps, {steps / every, steps % every});
}

void Optimizer::restore_steps(int64_t steps, ExchangeCounters counters) {
  Impl& s = *impl_;
  if (s.local_steps()) {
    restore_steps(steps);
    return;
  }
  s.steps = steps;
  s.counters = counters;
  s.inner->restore_step(counters.exchanges);
  s.replicator->restore_counters(counters.exchanges, counters.folded);
}

const dct::ChunkPlan& Optimizer::chunk_plan(size_t i) const {
  return impl_->plans.at(i);
}
std::vector<at::Tensor> Optimizer::replicated_params() const {
  if (impl_->local_steps()) return impl_->anchors;
  std::vector<at::Tensor> committed = impl_->replicator->committed_params();
  if (!committed.empty()) return committed;
  std::vector<at::Tensor> views;
  for (size_t i = 0; i < impl_->params.size(); ++i) views.push_back(impl_->inner->param(i));
  return views;
}

const at::Tensor& Optimizer::residual(size_t i) const {
  return impl_->replicator->residual(i);
}

}  // namespace flexdemo::optim
