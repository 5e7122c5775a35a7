// The optimizer driver: validates options, gathers the tensors and their gradients, and hands
// each step to its mode (stepping.h): the replicator's direction applied by the inner step rule
// every replicate_every steps, or local steps with an outer step every inner_steps steps.
// Never talks to MPI.
#include "flexdemo/optim.h"

#include "flexdemo/link_budget.h"
#include "stepping.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace flexdemo::optim {

// ====== Options ======
namespace {

// OptionsError unless a number option's value is in its range (words and switches: nothing).
template <class T>
void check_range(const char* name, const T& value, const Range& range) {
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (range.holds(double(value))) return;
    std::ostringstream got;
    got << value;
    throw OptionsError("{" + std::string(name) + "} must be " + range.text() + ", got " +
                       got.str());
  }
}

std::string as_is(const std::string& name) {
  return name;
}

}  // namespace

OptionsError::OptionsError(std::string text)
    : std::invalid_argument("optimizer: " + spell(text, as_is)), text_(std::move(text)) {}

std::string OptionsError::spelled(
    const std::function<std::string(const std::string&)>& name) const {
  return spell(text_, name);
}

void OptimizerOptions::validate() const {
  auto fail = [](const std::string& text) { throw OptionsError(text); };
  auto str = [](double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  // Each number within its declared range.
#define FLEXDEMO_CHECK_RANGE(name, type, default_value, range, help) check_range(#name, name, range);
  FLEXDEMO_OPTIMIZER_OPTIONS(FLEXDEMO_CHECK_RANGE)
#undef FLEXDEMO_CHECK_RANGE
  // The rules between options.
  if (!(lr * weight_decay < 1.0)) {
    fail("{lr} x {weight_decay} must be < 1, got " + str(lr) + " x " + str(weight_decay));
  }
  if (normalize && sign) fail("{normalize} needs {sign} off (sign's step is unit RMS already)");
  if ((update_rms > 0.0 || step_bound > 0.0 || rms_cap > 0.0) && sign) {
    fail("{update_rms}, {step_bound} and {rms_cap} need {sign} off (sign's step is bounded "
         "already)");
  }
  if (update_rms > 0.0 && rms_cap > 0.0) {
    fail("{update_rms} and {rms_cap} exclude each other (one sets the RMS, one caps it)");
  }
  if (update_rms > 0.0 && normalize) fail("{update_rms} and {normalize} exclude each other");
  if (overlap_step && replicator != ReplicatorKind::Demo) {
    fail("{overlap_step} needs {replicator} demo");
  }
  if (demo_exchange == DemoExchange::Owners && replicator != ReplicatorKind::Demo) {
    fail("{demo_exchange} owners needs {replicator} demo");
  }
  if (demo_exchange == DemoExchange::Owners && overlap_step) {
    fail("{demo_exchange} owners and {overlap_step} exclude each other");
  }
  if (inner_steps > 1 && replicate_every > 1) {
    fail("{inner_steps} " + std::to_string(inner_steps) + " and {replicate_every} " +
         std::to_string(replicate_every) +
         " exclude each other (both set how often replicas exchange)");
  }
  if (inner_steps > 1 && precondition) fail("{inner_steps} and {precondition} exclude each other");
  if (second_moment == SecondMoment::Shared && !precondition) {
    fail("{second_moment} shared needs {precondition}");
  }
  if (second_moment_every != 1 && second_moment == SecondMoment::Own) {
    fail("{second_moment_every} needs {second_moment} shared or auto");
  }
  if (second_moment_values != StatisticsEncoding::Fp32 &&
      second_moment_values != StatisticsEncoding::Auto && second_moment == SecondMoment::Own) {
    fail("{second_moment_values} needs {second_moment} shared or auto");
  }
  if (inner_steps > 1 && overlap_step) fail("{inner_steps} and {overlap_step} exclude each other");
  if (peer_scale_bound > 0.0 && !(peer_scale_bound > 1.0)) {
    fail("{peer_scale_bound} must be 0 (off) or > 1, got " + str(peer_scale_bound));
  }
  link_encodings(link_values);  // names a bad word
  if (link_budget == LinkBudgetMode::Auto) {
    if (replicator != ReplicatorKind::Demo) fail("{link_budget} auto needs {replicator} demo");
    if (inner_steps > 1) fail("{link_budget} auto and {inner_steps} exclude each other");
    if (link_min_topk > link_max_topk) {
      fail("{link_min_topk} " + std::to_string(link_min_topk) + " exceeds {link_max_topk} " +
           std::to_string(link_max_topk));
    }
    if (link_max_topk > chunk * chunk) {
      fail("{link_max_topk} " + std::to_string(link_max_topk) + " exceeds the " +
           std::to_string(chunk * chunk) + " coefficients of a {chunk} " + std::to_string(chunk) +
           " chunk");
    }
  }
}

std::string PeerFault::describe() const {
  switch (kind) {
    case Kind::Corrupt:
      return "a corrupt payload (" + detail + ")";
    case Kind::NonFinite:
      return "non-finite values";
    case Kind::OutOfScale: {
      std::ostringstream s;
      s.precision(3);
      s << "values " << ratio << "x the replicas' lower median norm";
      return s.str();
    }
  }
  return "a fault";
}

PeerFaultError::PeerFaultError(PeerFault fault)
    : std::runtime_error("optimizer: replica " + std::to_string(fault.replica) + " sent tensor " +
                         std::to_string(fault.tensor) + " " + fault.describe()),
      fault_(std::move(fault)) {}

// ====== The driver ======
struct Optimizer::Impl {
  std::vector<OptimParam> params;  // non-empty tensors only
  std::vector<int64_t> slot;       // per tensor given: its index in params, -1 if empty
  std::vector<int64_t> given;      // per tensor in params: its index among those given
  std::vector<dct::ChunkPlan> plans;
  OptimizerOptions options;
  std::unique_ptr<StepRule> inner;
  std::unique_ptr<Stepping> stepping;  // after inner, which it refers to
  int64_t steps = 0;
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
                     std::shared_ptr<comm::Communicator> replica_group,
                     std::shared_ptr<comm::Communicator> shard_group)
    : Optimizer(whole_parameters(std::move(params), options), options, std::move(replica_group),
                std::move(shard_group)) {}

Optimizer::Optimizer(std::vector<OptimParam> params, OptimizerOptions options,
                     std::shared_ptr<comm::Communicator> replica_group,
                     std::shared_ptr<comm::Communicator> shard_group)
    : impl_(std::make_unique<Impl>()) {
  options.validate();
  Impl& s = *impl_;
  s.options = options;
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
  const ShardSums shards{std::move(shard_group), s.given, int64_t(params.size())};
  s.inner = std::make_unique<StepRule>(s.params, options, shards);
  s.stepping = options.inner_steps > 1
                   ? make_local_steps(s.plans, options, std::move(replica_group), device, *s.inner)
                   : make_exchange_every_step(s.plans, options, shards, std::move(replica_group),
                                              device, *s.inner);
}

Optimizer::~Optimizer() = default;

namespace {

// A gradient as the replicator takes it: plan.numel() elements, undefined = zero.
at::Tensor flat(const at::Tensor& g, const OptimParam& p, size_t given) {
  if (!g.defined()) return {};
  if (g.numel() < p.plan.numel() || g.device() != p.leaf.device()) {
    throw std::invalid_argument("optimizer: the gradient of tensor " + std::to_string(given) +
                                " has " + std::to_string(g.numel()) + " elements on " +
                                g.device().str() + "; its tensor needs " +
                                std::to_string(p.plan.numel()) + " on " + p.leaf.device().str());
  }
  return g.reshape({-1}).narrow(0, 0, p.plan.numel());
}

}  // namespace

void Optimizer::start_exchange(const std::vector<size_t>& tensors) {
  std::vector<at::Tensor> grads;
  for (size_t t : tensors) {
    const int64_t slot = t < impl_->slot.size() ? impl_->slot[t] : -1;
    grads.push_back(slot < 0 ? at::Tensor() : impl_->params[size_t(slot)].leaf.grad());
  }
  start_exchange(tensors, grads);
}

void Optimizer::start_exchange(const std::vector<size_t>& tensors,
                               const std::vector<at::Tensor>& given) {
  Impl& s = *impl_;
  at::NoGradGuard no_grad;
  if (given.size() != tensors.size()) {
    throw std::invalid_argument("optimizer: start_exchange of " + std::to_string(tensors.size()) +
                                " tensors with " + std::to_string(given.size()) + " gradients");
  }
  std::vector<size_t> mine;
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < tensors.size(); ++k) {
    const size_t t = tensors[k];
    if (t >= s.slot.size()) {
      throw std::out_of_range("optimizer: start_exchange of tensor " + std::to_string(t) +
                              ", only " + std::to_string(s.slot.size()) + " given");
    }
    if (s.slot[t] < 0) continue;
    mine.push_back(size_t(s.slot[t]));
    grads.push_back(flat(given[k], s.params[mine.back()], t));
  }
  s.stepping->start(mine, grads, s.options.lr);
}

void Optimizer::step() {
  std::vector<at::Tensor> grads;
  for (size_t t = 0; t < impl_->slot.size(); ++t) {
    const int64_t slot = impl_->slot[t];
    grads.push_back(slot < 0 ? at::Tensor() : impl_->params[size_t(slot)].leaf.grad());
  }
  step(grads);
}

void Optimizer::step(const std::vector<at::Tensor>& given) {
  Impl& s = *impl_;
  at::NoGradGuard no_grad;
  if (given.size() != s.slot.size()) {
    throw std::invalid_argument("optimizer: step with " + std::to_string(given.size()) +
                                " gradients for " + std::to_string(s.slot.size()) + " tensors");
  }
  std::vector<at::Tensor> grads;
  for (size_t k = 0; k < s.params.size(); ++k) {
    const size_t t = size_t(s.given[k]);
    grads.push_back(flat(given[t], s.params[k], t));
  }
  ++s.steps;
  try {
    s.stepping->step(grads, s.options.lr, s.steps);
  } catch (const PeerFaultError& e) {  // named by the index among the tensors given
    PeerFault fault = e.fault();
    fault.tensor = size_t(s.given.at(fault.tensor));
    throw PeerFaultError(fault);
  }
}

std::vector<PeerFault> Optimizer::take_peer_faults() {
  std::vector<PeerFault> faults = impl_->stepping->replicator().take_peer_faults();
  for (PeerFault& f : faults) f.tensor = size_t(impl_->given.at(f.tensor));
  return faults;
}

void Optimizer::tamper_next_exchange(compress::Tamper how, double factor) {
  impl_->stepping->replicator().tamper_next_exchange(how, factor);
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
  return impl_->stepping->replicator().traffic();
}
int64_t Optimizer::steps() const {
  return impl_->steps;
}

ExchangeSchedule Optimizer::schedule() const {
  return impl_->stepping->schedule();
}

ExchangeSchedule Optimizer::schedule_in_flight() const {
  ExchangeSchedule in_use = schedule();
  if (const auto layout = impl_->stepping->replicator().layout()) {
    in_use.topk = layout->first;
    in_use.values = layout->second;
  }
  return in_use;
}

void Optimizer::set_schedule(const ExchangeSchedule& schedule) {
  impl_->stepping->set_schedule(schedule);
}

ExchangeCounters Optimizer::counters() const {
  return impl_->stepping->counters();
}

void Optimizer::wait_in_flight() {
  impl_->stepping->replicator().wait_in_flight();
}

uint64_t Optimizer::wire_bytes(const ExchangeSchedule& schedule) const {
  if (impl_->options.replicator != ReplicatorKind::Demo) return traffic().wire_bytes;
  uint64_t bytes = 0;
  for (const dct::ChunkPlan& plan : impl_->plans) {
    bytes += compress::wire_payload_bytes(plan, schedule.topk, schedule.values);
  }
  return bytes;
}
double Optimizer::link_bytes(const ExchangeSchedule& schedule) const {
  return double(wire_bytes(schedule)) +
         impl_->stepping->statistics_link_bytes() * double(schedule.every);
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::state_tensors() const {
  const Impl& s = *impl_;
  NamedTensors state = s.stepping->state_tensors();
  for (auto& t : s.inner->state_tensors()) state.push_back(t);
  // The replicator and the step rules number the non-empty tensors; the name carries the
  // index among all given, the same on every sharding (elastic resume matches them by it).
  for (auto& [name, t] : state) {
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos ||
        name.find_first_not_of("0123456789", dot + 1) != std::string::npos) {
      continue;  // the replicator's own (owner_replicas, outer.owner_replicas)
    }
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
  impl_->steps = steps;
  impl_->stepping->restore(steps, std::nullopt);
}

void Optimizer::restore_steps(int64_t steps, ExchangeCounters counters) {
  impl_->steps = steps;
  impl_->stepping->restore(steps, counters);
}

const dct::ChunkPlan& Optimizer::chunk_plan(size_t i) const {
  return impl_->plans.at(i);
}
std::vector<at::Tensor> Optimizer::replicated_params() const {
  return impl_->stepping->replicated_params();
}

const at::Tensor& Optimizer::residual(size_t i) const {
  return impl_->stepping->replicator().residual(i);
}

}  // namespace flexdemo::optim
