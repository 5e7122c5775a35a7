// A sharded unit: its parameters' shards are the autograd leaves; custom autograd Functions
// all-gather them for the forward and reduce-scatter (average) the gradients in the backward.
// With reshard_after_forward the unit is recomputed in backward instead of keeping the gathered
// parameters (FSDP and activation checkpointing in one place).
#include "flexdemo/shard.h"

#include "flexdemo/comm.h"
#include "runtime/autocast.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <map>
#include <optional>
#include <stdexcept>
#include <utility>

namespace flexdemo::shard {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ShardedUnit::Impl {
  std::string name;
  std::shared_ptr<comm::Communicator> group;
  ShardOptions options;
  std::vector<ShardSpec> specs;
  std::vector<at::Tensor> shards;  // leaves, float32 [shard_numel]
  std::vector<int64_t> offsets;    // of each shard in this rank's flat bucket
  int64_t bucket_numel = 0;
  std::map<int64_t, UnitFn> pending;  // forwards awaiting their recomputing backward
  int64_t next_id = 0;
  int64_t outstanding = 0;  // forwards in grad mode whose backward has not run yet
  std::function<void()> on_ready;
  Impl* before_in_forward = nullptr;  // this forward's Prefetch::before, for its backward

  // A prefetched all-gather (prefetch()): the parameters as they were when it started, tagged
  // with their version so that a gather of since-changed parameters is never used.
  struct Prefetched {
    at::Tensor local, all;
    std::unique_ptr<comm::Work> work;
    int64_t version = 0;
  };
  std::optional<Prefetched> prefetched;
  Impl* prefetch_after_gather = nullptr;  // started once this unit's own gather is complete

  // The sum of the shards' version counters: every in-place write bumps it.
  int64_t version() const {
    int64_t v = 0;
    for (const at::Tensor& shard : shards) v += shard._version();
    return v;
  }

  at::Tensor pack() const {
    at::Tensor local = at::empty({bucket_numel}, float_options());
    for (size_t i = 0; i < shards.size(); ++i) {
      local.narrow(0, offsets[i], specs[i].shard_numel).copy_(shards[i]);
    }
    return local;
  }

  void prefetch() {
    at::NoGradGuard no_grad;
    if (prefetched) return;
    Prefetched p;
    p.version = version();
    p.local = pack();
    p.all = at::empty({group->size() * bucket_numel}, float_options());
    p.work = group->iall_gather(p.local, p.all);
    prefetched = std::move(p);
  }

  // Full parameters from every rank's shards: one all-gather for the whole unit (the prefetched
  // one, if the parameters have not changed since it started). Then the next prefetch starts.
  std::vector<at::Tensor> all_gather() {
    at::NoGradGuard no_grad;
    const int64_t S = group->size();
    at::Tensor all;
    if (prefetched) {
      prefetched->work->wait();
      if (prefetched->version == version()) all = prefetched->all;
      prefetched.reset();
    }
    if (!all.defined()) {
      all = at::empty({S * bucket_numel}, float_options());
      group->all_gather(pack(), all);
    }
    if (Impl* next = std::exchange(prefetch_after_gather, nullptr)) next->prefetch();
    const at::Tensor rows = all.view({S, bucket_numel});
    std::vector<at::Tensor> full;
    for (size_t i = 0; i < shards.size(); ++i) {
      full.push_back(rows.narrow(1, offsets[i], specs[i].shard_numel)
                         .reshape({-1})
                         .narrow(0, 0, specs[i].plan.numel())
                         .view(specs[i].shape));
    }
    return full;
  }

  // Shard gradients, averaged over the group, from full gradients: one reduce-scatter, added
  // to the shards' .grad() here rather than by autograd, so that the unit knows when they are
  // complete: after the backward of its last outstanding forward (then on_ready runs).
  void reduce_scatter_into_grads(const variable_list& full_grads) {
    at::NoGradGuard no_grad;
    const int64_t S = group->size();
    at::Tensor input = at::zeros({S, bucket_numel}, float_options());
    for (size_t i = 0; i < shards.size(); ++i) {
      if (!full_grads[i].defined()) continue;  // unused in this forward: contributes zero
      const int64_t n = specs[i].plan.numel(), sn = specs[i].shard_numel;
      at::Tensor flat = full_grads[i].reshape({-1}).to(at::kFloat);
      if (S * sn > n) flat = at::constant_pad_nd(flat, {0, S * sn - n});
      input.narrow(1, offsets[i], sn).copy_(flat.view({S, sn}));
    }
    at::Tensor out = at::empty({bucket_numel}, float_options());
    group->reduce_scatter(input, out, comm::ReduceOp::Avg);
    for (size_t i = 0; i < shards.size(); ++i) {
      const at::Tensor g = out.narrow(0, offsets[i], specs[i].shard_numel);
      at::Tensor& grad = shards[i].mutable_grad();
      if (grad.defined()) {
        grad.add_(g);
      } else {
        grad = g.clone();
      }
    }
    if (--outstanding == 0 && on_ready) on_ready();
  }

  at::TensorOptions float_options() const { return at::dtype(at::kFloat).device(options.device); }
  // The generator dropout draws from on this unit's device.
  at::Generator generator() const { return at::globalContext().defaultGenerator(options.device); }

  static Impl* from_id(int64_t id) { return reinterpret_cast<Impl*>(id); }
  int64_t id() { return reinterpret_cast<int64_t>(this); }
};

namespace {

// Keeps the gathered parameters until the backward (SHARD_GRAD_OP).
struct GatherParameters : public torch::autograd::Function<GatherParameters> {
  static variable_list forward(AutogradContext* ctx, int64_t unit, at::TensorList shards) {
    (void)shards;  // tracked by autograd: the gradients returned below are theirs
    ctx->saved_data["unit"] = unit;
    return ShardedUnit::Impl::from_id(unit)->all_gather();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* impl = ShardedUnit::Impl::from_id(ctx->saved_data["unit"].toInt());
    impl->reduce_scatter_into_grads(grads);
    return variable_list(1 + impl->shards.size());  // none for the unit id and the shards
  }
};

// Frees the gathered parameters after the forward; gathers and recomputes in the backward.
struct RecomputeUnit : public torch::autograd::Function<RecomputeUnit> {
  static at::Tensor forward(AutogradContext* ctx, int64_t unit, int64_t fn_id,
                            at::TensorList inputs, at::TensorList shards) {
    (void)shards;
    auto* impl = ShardedUnit::Impl::from_id(unit);
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["fn"] = fn_id;
    ctx->saved_data["before"] = reinterpret_cast<int64_t>(impl->before_in_forward);
    ctx->save_for_backward(inputs.vec());
    // The recomputation must draw the same random numbers (dropout) as this forward.
    ctx->saved_data["rng"] = impl->generator().get_state();
    ctx->saved_data["autocast"] = autocast::enabled(impl->options.device.type());  // alike
    return impl->pending.at(fn_id)(impl->all_gather(), inputs.vec());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_out) {
    auto* impl = ShardedUnit::Impl::from_id(ctx->saved_data["unit"].toInt());
    auto node = impl->pending.extract(ctx->saved_data["fn"].toInt());
    const UnitFn fn = std::move(node.mapped());
    const variable_list saved = ctx->get_saved_variables();

    // The unit whose output this one took runs its backward next: its gather travels meanwhile.
    impl->prefetch_after_gather = ShardedUnit::Impl::from_id(ctx->saved_data["before"].toInt());
    std::vector<at::Tensor> full = impl->all_gather();
    std::vector<at::Tensor> inputs, wrt;
    std::vector<int> input_slot(saved.size(), -1);  // where input i's gradient is in wrt
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor x = saved[i].detach();
      if (saved[i].requires_grad()) {
        x.requires_grad_(true);
        input_slot[i] = int(wrt.size());
        wrt.push_back(x);
      }
      inputs.push_back(x);
    }
    const size_t first_param = wrt.size();
    for (auto& p : full) {
      p.requires_grad_(true);
      wrt.push_back(p);
    }
    at::Tensor out;
    {
      at::Generator gen = impl->generator();
      const at::Tensor now = gen.get_state();
      gen.set_state(ctx->saved_data["rng"].toTensor());
      const c10::DeviceType device = impl->options.device.type();
      const bool autocast_was = autocast::enabled(device);
      autocast::set_enabled(device, ctx->saved_data["autocast"].toBool());
      at::AutoGradMode enable(true);
      out = fn(full, inputs);
      autocast::set_enabled(device, autocast_was);
      gen.set_state(now);
    }
    const variable_list grads =
        torch::autograd::grad({out}, wrt, {grad_out[0]}, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/true);

    variable_list result{at::Tensor(), at::Tensor()};  // unit id, fn id
    for (size_t i = 0; i < saved.size(); ++i) {
      result.push_back(input_slot[i] >= 0 ? grads[input_slot[i]] : at::Tensor());
    }
    impl->reduce_scatter_into_grads(variable_list(grads.begin() + first_param, grads.end()));
    result.resize(result.size() + impl->shards.size());  // the shards' are in their .grad()
    return result;
  }
};

}  // namespace

ShardedUnit::ShardedUnit(std::string name, const std::vector<at::Tensor>& full_params,
                         std::shared_ptr<comm::Communicator> shard_group, ShardOptions options)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.name = std::move(name);
  s.group = std::move(shard_group);
  s.options = options;
  at::NoGradGuard no_grad;
  for (const at::Tensor& p : full_params) {
    if (p.scalar_type() != at::kFloat) {
      throw std::invalid_argument("unit " + s.name + ": parameters must be float32");
    }
    ShardSpec spec = make_shard_spec(p.sizes(), options.chunk, options.chunk_mode, s.group->rank(),
                                     s.group->size());
    at::Tensor shard = at::zeros({spec.shard_numel}, s.float_options());
    shard.narrow(0, 0, spec.end - spec.begin)
        .copy_(p.detach().reshape({-1}).narrow(0, spec.begin, spec.end - spec.begin));
    s.offsets.push_back(s.bucket_numel);
    s.bucket_numel += spec.shard_numel;
    s.specs.push_back(std::move(spec));
    s.shards.push_back(shard.requires_grad_(true));
  }
}

ShardedUnit::~ShardedUnit() = default;

const std::string& ShardedUnit::name() const {
  return impl_->name;
}

at::Tensor ShardedUnit::forward(const UnitFn& fn, const std::vector<at::Tensor>& inputs,
                                const Prefetch& prefetch) {
  Impl& s = *impl_;
  s.prefetch_after_gather = prefetch.next != nullptr ? prefetch.next->impl_.get() : nullptr;
  s.before_in_forward = prefetch.before != nullptr ? prefetch.before->impl_.get() : nullptr;
  if (!at::GradMode::is_enabled()) return fn(s.all_gather(), inputs);
  ++s.outstanding;
  if (!s.options.reshard_after_forward) {
    const variable_list full = GatherParameters::apply(s.id(), at::TensorList(s.shards));
    return fn(full, inputs);
  }
  const int64_t fn_id = s.next_id++;
  s.pending.emplace(fn_id, fn);
  return RecomputeUnit::apply(s.id(), fn_id, at::TensorList(inputs), at::TensorList(s.shards));
}

void ShardedUnit::on_gradients_ready(std::function<void()> fn) {
  impl_->on_ready = std::move(fn);
}

std::vector<at::Tensor> ShardedUnit::gather() const {
  return impl_->all_gather();
}

void ShardedUnit::prefetch() {
  impl_->prefetch();
}

void ShardedUnit::load(const std::vector<at::Tensor>& full_params) {
  Impl& s = *impl_;
  if (full_params.size() != s.specs.size()) {
    throw std::invalid_argument("unit " + s.name + ": " + std::to_string(full_params.size()) +
                                " tensors given, it has " + std::to_string(s.specs.size()));
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < s.specs.size(); ++i) {
    const ShardSpec& spec = s.specs[i];
    if (full_params[i].sizes() != at::IntArrayRef(spec.shape)) {
      throw std::invalid_argument("unit " + s.name + ": tensor " + std::to_string(i) +
                                  " has the wrong shape");
    }
    s.shards[i].zero_();
    s.shards[i]
        .narrow(0, 0, spec.end - spec.begin)
        .copy_(full_params[i].reshape({-1}).narrow(0, spec.begin, spec.end - spec.begin));
  }
}
const std::vector<at::Tensor>& ShardedUnit::shards() const {
  return impl_->shards;
}
const std::vector<ShardSpec>& ShardedUnit::specs() const {
  return impl_->specs;
}

std::vector<optim::OptimParam> ShardedUnit::optim_params() const {
  std::vector<optim::OptimParam> params;
  for (size_t i = 0; i < impl_->shards.size(); ++i) {
    params.push_back({impl_->shards[i], impl_->specs[i].shard_plan});
  }
  return params;
}

int64_t ShardedUnit::param_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : impl_->shards) bytes += s.numel() * s.element_size();
  return bytes;
}

int64_t ShardedUnit::grad_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : impl_->shards) {
    if (s.grad().defined()) bytes += s.grad().numel() * s.grad().element_size();
  }
  return bytes;
}

}  // namespace flexdemo::shard
