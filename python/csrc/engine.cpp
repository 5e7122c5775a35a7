// The Python package's one door to flexdemo's DeMo step: the library's optimizer (flexdemo/
// optim.h) as a TorchScript class, torch.classes.flexdemo.Engine, over a torch.distributed group
// (process_group.h). The step's whole control (layout, preconditioning, residuals, encode,
// screening, decode, the step rules, validation and the state) is the library's, the same the
// trainer runs; flexdemo/optim.py only maps parameter groups, learning rates and DTensors onto
// it. Also here: the options' one declaration as Python reads it, and payload sizes.
#include "process_group.h"

#include "flexdemo/comm.h"
#include "flexdemo/compress.h"
#include "flexdemo/dct.h"
#include "flexdemo/elastic.h"
#include "flexdemo/link_budget.h"
#include "flexdemo/optim.h"

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace flexdemo::ops {
namespace {

using Grads = c10::List<std::optional<at::Tensor>>;

// "name=value" pairs.
std::vector<std::pair<std::string, std::string>> pairs_of(const std::vector<std::string>& given) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const std::string& g : given) {
    const size_t eq = g.find('=');
    TORCH_CHECK_VALUE(eq != std::string::npos, "flexdemo: option '", g, "' is not name=value");
    out.emplace_back(g.substr(0, eq), g.substr(eq + 1));
  }
  return out;
}

// An OptionsError as Python's ValueError, its options spelled as the caller's keywords
// (spelling: "name=keyword" pairs; an option not in it keeps its name).
template <class F>
auto options_checked(F&& f, const std::vector<std::string>& spelling = {}) {
  try {
    return f();
  } catch (const optim::OptionsError& e) {
    const auto keywords = pairs_of(spelling);
    C10_THROW_ERROR(ValueError, "flexdemo: " + e.spelled([&](const std::string& name) {
      for (const auto& [option, keyword] : keywords) {
        if (option == name) return keyword;
      }
      return name;
    }));
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, std::string("flexdemo: ") + e.what());
  }
}

// preset "": the one the given inner rule brings (optim::preset_for; an unknown rule is
// named by options_for).
optim::OptimizerOptions resolve(const std::string& preset, const std::vector<std::string>& given,
                                const std::vector<std::string>& spelling) {
  return options_checked(
      [&] {
        const auto pairs = pairs_of(given);
        optim::Preset step = optim::Preset::FlexDemo;
        if (!preset.empty()) {
          step = parse_name<optim::Preset>(preset);
        } else {
          for (const auto& [name, value] : pairs) {
            if (name != "inner") continue;
            for (const optim::InnerKind inner : values_of<optim::InnerKind>()) {
              if (name_of(inner) == value) step = optim::preset_for(inner);
            }
          }
        }
        return optim::options_for(step, pairs);
      },
      spelling);
}

class Engine final : public torch::CustomClassHolder {
 public:
  // params: this rank's tensors (contiguous float32, one device; a shard is its local tensor,
  // chunked by its own shape; with a shard group an empty one too, so that every rank of the
  // group gives the same tensors); preset ("": by the inner rule) and given options ("name=value")
  // as options_for takes them, spelled in errors as `spelling` says; group: the replica group's torch.distributed
  // name ("" for one replica); device: where its collectives take their buffers; shard_group and
  // shard_device the same for the ranks holding the other shards of these tensors ("": whole
  // tensors), over which a tensor's RMS is taken (update_rms, rms_cap).
  Engine(std::vector<at::Tensor> params, std::string preset, std::vector<std::string> given,
         std::vector<std::string> spelling, std::string group, std::string device,
         std::string shard_group, std::string shard_device) {
    const optim::OptimizerOptions options = resolve(preset, given, spelling);
    std::vector<optim::OptimParam> tensors;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      TORCH_CHECK_VALUE(p.scalar_type() == at::kFloat && p.is_contiguous() &&
                            (p.numel() > 0 || !shard_group.empty()),
                        "flexdemo: tensor ", i, " is ", p.scalar_type(), " ", p.sizes(),
                        "; the step updates non-empty contiguous float32 tensors (keep the "
                        "weights float32, autocast the forward)");
      dct::ChunkPlan plan;  // an empty shard's: no elements (the optimizer skips it)
      plan.rows = 0;
      if (p.numel() > 0) plan = dct::make_chunk_plan(p.sizes(), options.chunk, options.chunk_mode);
      tensors.push_back({p, plan});
    }
    std::shared_ptr<comm::Communicator> replicas;
    if (!group.empty()) replicas = process_group_communicator(group, at::Device(device));
    group_ = replicas;
    tensors_ = params.size();
    optimizer_ = options_checked([&] {
      std::shared_ptr<comm::Communicator> shards;
      if (!shard_group.empty()) {
        shards = process_group_communicator(shard_group, at::Device(shard_device));
      }
      return std::make_unique<optim::Optimizer>(std::move(tensors), options, std::move(replicas),
                                                std::move(shards));
    });
  }

  // One step at rate lr from these gradients (None: zero): exchanges when one is due and
  // applies it. Collective over the replica group.
  void step(const Grads& grads, double lr) {
    optimizer_->set_lr(lr);
    optimizer_->step(list_of(grads));
  }
  // This step's gradients are final: their exchange may start now (a hint; step() completes it).
  void start(const Grads& grads, double lr) {
    optimizer_->set_lr(lr);
    std::vector<size_t> all(tensors_);
    for (size_t i = 0; i < tensors_; ++i) all[i] = i;
    optimizer_->start_exchange(all, list_of(grads));
  }

  std::vector<std::string> options() const {
    std::vector<std::string> out;
    for (const optim::OptionInfo& info : optim::option_infos()) {
      out.push_back(info.name + "=" + optim::option_value(optimizer_->options(), info.name));
    }
    return out;
  }
  // The state by name ("residual.3"), sharing storage with the engine: loading copies into it.
  std::vector<std::string> state_names() const {
    std::vector<std::string> names;
    for (const auto& [name, t] : optimizer_->state_tensors()) names.push_back(name);
    return names;
  }
  std::vector<at::Tensor> state_tensors() const {
    std::vector<at::Tensor> tensors;
    for (const auto& [name, t] : optimizer_->state_tensors()) tensors.push_back(t);
    return tensors;
  }
  void restore_steps(int64_t steps) { optimizer_->restore_steps(steps); }
  int64_t steps() const { return optimizer_->steps(); }
  int64_t exchanges() const { return optimizer_->counters().exchanges; }
  // What one exchange puts on the wire from this replica (payloads, headers included).
  int64_t wire_bytes() const { return int64_t(optimizer_->traffic().wire_bytes); }
  // This rank's bytes sent and received over the replica group, and its collectives.
  std::vector<int64_t> traffic() const {
    if (!group_) return {0, 0, 0};
    const comm::CommStats s = group_->stats();
    return {int64_t(s.bytes_sent), int64_t(s.bytes_received), int64_t(s.collectives)};
  }
  // The peers' payloads that failed the checks since the last call: (replica, tensor, what).
  std::vector<std::tuple<int64_t, int64_t, std::string>> take_peer_faults() {
    std::vector<std::tuple<int64_t, int64_t, std::string>> out;
    for (const optim::PeerFault& f : optimizer_->take_peer_faults()) {
      out.emplace_back(f.replica, int64_t(f.tensor), f.describe());
    }
    return out;
  }
  // A test aid: this replica's payloads of the next exchange tampered ("scale" or "corrupt").
  void tamper_next_exchange(const std::string& how, double factor) {
    TORCH_CHECK_VALUE(how == "scale" || how == "corrupt", "flexdemo: tamper how '", how,
                      "'; accepted: scale, corrupt");
    optimizer_->tamper_next_exchange(
        how == "scale" ? compress::Tamper::Scale : compress::Tamper::Corrupt, factor);
  }
  void wait_in_flight() { optimizer_->wait_in_flight(); }

  // The exchange's schedule, for a checkpoint (it changes under link_budget auto;
  // optim::ScheduleState): [topk, values, every] set, [topk, values] of the exchange in flight,
  // [exchanges, folded] (values as their index in the encodings' name table, NameTable order:
  // part of the checkpoint format, so that table grows at its end only).
  std::vector<int64_t> schedule_state() const {
    const optim::ScheduleState s = optim::schedule_state(*optimizer_);
    return {s.set.topk,       encoding_index(s.set.values),       s.set.every,
            s.in_flight.topk, encoding_index(s.in_flight.values), s.counters.exchanges,
            s.counters.folded};
  }
  // Before the state is copied in (DCP may have written it in place already).
  void set_schedule_in_flight(const std::vector<int64_t>& state) {
    optim::restore_schedule_before_state(*optimizer_, schedule_of(state));
  }
  // After: the steps taken, the counters and the schedule set.
  void restore_schedule(const std::vector<int64_t>& state, int64_t steps) {
    optim::restore_schedule_after_state(*optimizer_, schedule_of(state), steps);
  }

  // The most bytes the exchange in flight's payloads (overlap_step: state) take, whatever
  // schedule the link budget chooses: all replicas' payloads of the largest schedule, the
  // options' own among them (the same all run long).
  int64_t in_flight_capacity() const {
    const optim::OptimizerOptions& o = optimizer_->options();
    uint64_t most = optimizer_->wire_bytes({o.topk, o.values, 1});
    if (o.link_budget == optim::LinkBudgetMode::Auto) {
      for (const optim::ExchangeSchedule& s : optim::link_ladder(optim::link_bounds(o))) {
        most = std::max(most, optimizer_->wire_bytes(s));
      }
    }
    return int64_t(most) * (group_ ? group_->size() : 1);
  }

  optim::Optimizer& optimizer() { return *optimizer_; }
  const std::shared_ptr<comm::Communicator>& replicas() const { return group_; }

 private:
  static int64_t encoding_index(compress::ValueEncoding v) {
    const auto all = values_of<compress::ValueEncoding>();
    return int64_t(std::find(all.begin(), all.end(), v) - all.begin());
  }
  static compress::ValueEncoding encoding_at(int64_t i) {
    return values_of<compress::ValueEncoding>().at(size_t(i));
  }
  static optim::ScheduleState schedule_of(const std::vector<int64_t>& s) {
    TORCH_CHECK_VALUE(s.size() == 7, "flexdemo: a schedule state of ", s.size(),
                      " numbers; 7 expected");
    return {{s[0], encoding_at(s[1]), s[2]}, {s[3], encoding_at(s[4]), s[2]}, {s[5], s[6]}};
  }

  std::vector<at::Tensor> list_of(const Grads& grads) const {
    TORCH_CHECK_VALUE(grads.size() == tensors_, "flexdemo: ", grads.size(), " gradients for ",
                      tensors_, " tensors");
    std::vector<at::Tensor> out;
    for (size_t i = 0; i < grads.size(); ++i) {
      const std::optional<at::Tensor> g = grads[i];
      if (!g || !g->defined()) {
        out.emplace_back();
      } else {
        out.push_back(g->scalar_type() == at::kFloat ? g->contiguous() : g->to(at::kFloat));
      }
    }
    return out;
  }

  std::shared_ptr<comm::Communicator> group_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  size_t tensors_ = 0;
};

// The link budget (flexdemo/link_budget.h) over a FlexDeMo's engines (one per parameter group):
// one schedule for all, chosen from the slowest rank's measures, agreed over `groups` in turn
// (torch.distributed's group names: the shard group and the replicate group, which tile the
// ranks that step; their collectives' buffers on `devices`), probing the first engine's
// replica group.
class LinkBudget final : public torch::CustomClassHolder {
 public:
  LinkBudget(std::vector<c10::intrusive_ptr<Engine>> engines, std::vector<std::string> groups,
             std::vector<std::string> devices, int64_t start_step)
      : engines_(std::move(engines)) {
    TORCH_CHECK_VALUE(!engines_.empty(), "flexdemo: a link budget over no engine");
    TORCH_CHECK_VALUE(groups.size() == devices.size(), "flexdemo: one device per group");
    std::vector<optim::Optimizer*> optimizers;
    for (const auto& e : engines_) optimizers.push_back(&e->optimizer());
    std::vector<std::shared_ptr<comm::Communicator>> agreement;
    for (size_t g = 0; g < groups.size(); ++g) {
      agreement.push_back(process_group_communicator(groups[g], at::Device(devices[g])));
    }
    budget_ = std::make_unique<optim::LinkBudget>(std::move(optimizers), std::move(agreement),
                                                  engines_.front()->replicas(), start_step);
  }
  bool active() const { return budget_->active(); }
  void add_compute(double seconds) { budget_->add_compute(seconds); }
  // Collective over the world when a choice is due before step `step` (0-based): () when none
  // is, else (the line that says it, topk, values, every).
  std::vector<std::string> before_step(int64_t step) {
    const std::optional<optim::LinkChoice> c = budget_->before_step(step);
    if (!c) return {};
    return {c->describe(), std::to_string(c->schedule.topk), name_of(c->schedule.values),
            std::to_string(c->schedule.every)};
  }

 private:
  std::vector<c10::intrusive_ptr<Engine>> engines_;  // kept alive: the budget holds their optimizers
  std::unique_ptr<optim::LinkBudget> budget_;
};

// ====== The options' declaration, as Python reads it ======
// (name, type, accepts, help) of every option, in declaration order: accepts a number's range
// (">= 1", "[0, 1)", "" for any), help naming other options as {name}.
std::vector<std::tuple<std::string, std::string, std::string, std::string>> option_table() {
  std::vector<std::tuple<std::string, std::string, std::string, std::string>> out;
  for (const optim::OptionInfo& info : optim::option_infos()) {
    std::string accepts = info.range.text();
    if (accepts.rfind("in ", 0) == 0) accepts = accepts.substr(3);
    out.emplace_back(info.name, info.type, accepts, info.help);
  }
  return out;
}

// Every option as "name=value" for a preset ("": by the inner rule) with these given
// (options_for: validated).
std::vector<std::string> resolved_options(const std::string& preset,
                                          const std::vector<std::string>& given,
                                          const std::vector<std::string>& spelling) {
  const optim::OptimizerOptions o = resolve(preset, given, spelling);
  std::vector<std::string> out;
  for (const optim::OptionInfo& info : optim::option_infos()) {
    out.push_back(info.name + "=" + optim::option_value(o, info.name));
  }
  return out;
}

// Python's FlexDeMo.load_state_dict: the options a resume on `replicas` replicas takes from a
// checkpoint whose optimizer state has these names (Python's keys: "grad_sq.replica0.shard0",
// ...), by the trainer's rule (optim::resumed_second_moment): "name=value" of each option that
// changes from these (none: they stand); a ValueError where the checkpoint's state is refused.
std::vector<std::string> resumed_options(const std::string& preset,
                                         const std::vector<std::string>& given,
                                         const std::vector<std::string>& spelling,
                                         const std::vector<std::string>& saved, int64_t replicas) {
  return options_checked(
      [&] {
        const optim::OptimizerOptions asked = resolve(preset, given, spelling);
        const optim::OptimizerOptions kept =
            optim::resumed_second_moment(asked, replicas, optim::saved_second_moment(saved));
        std::vector<std::string> changed;
        for (const optim::OptionInfo& info : optim::option_infos()) {
          const std::string word = optim::option_value(kept, info.name);
          if (word != optim::option_value(asked, info.name)) {
            changed.push_back(info.name + "=" + word);
          }
        }
        return changed;
      },
      spelling);
}

// The kind of second moment ("own", "shared"; "": none) whose state `name` is, and each kind's
// state names (flexdemo/elastic.h).
std::string second_moment_of(const std::string& name) {
  const optim::SecondMoment kind = optim::second_moment_of(name);
  return kind == optim::SecondMoment::Auto ? "" : name_of(kind);
}

std::vector<std::string> second_moment_state(const std::string& kind) {
  return optim::second_moment_state(parse_name<optim::SecondMoment>(kind));
}

// Each tensor's payload in bytes (header and checksum included), chunked by its own shape.
std::vector<int64_t> payload_bytes(const std::vector<at::Tensor>& params, int64_t chunk,
                                   const std::string& chunk_mode, int64_t topk,
                                   const std::string& values) {
  TORCH_CHECK_VALUE(chunk > 0 && topk > 0, "flexdemo: chunk ", chunk, " and topk ", topk,
                    " must be > 0");
  const auto mode = options_checked([&] { return parse_name<dct::ChunkMode>(chunk_mode); });
  const auto encoding =
      options_checked([&] { return parse_name<compress::ValueEncoding>(values); });
  std::vector<int64_t> sizes;
  for (const at::Tensor& p : params) {
    sizes.push_back(int64_t(
        compress::wire_payload_bytes(dct::make_chunk_plan(p.sizes(), chunk, mode), topk, encoding)));
  }
  return sizes;
}

bool cuda_built() {
#ifdef FLEXDEMO_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(flexdemo, m) {
  m.class_<Engine>("Engine")
      .def(torch::init<std::vector<at::Tensor>, std::string, std::vector<std::string>,
                       std::vector<std::string>, std::string, std::string, std::string,
                       std::string>())
      .def("step", &Engine::step)
      .def("start", &Engine::start)
      .def("options", &Engine::options)
      .def("state_names", &Engine::state_names)
      .def("state_tensors", &Engine::state_tensors)
      .def("restore_steps", &Engine::restore_steps)
      .def("steps", &Engine::steps)
      .def("exchanges", &Engine::exchanges)
      .def("wire_bytes", &Engine::wire_bytes)
      .def("traffic", &Engine::traffic)
      .def("take_peer_faults", &Engine::take_peer_faults)
      .def("tamper_next_exchange", &Engine::tamper_next_exchange)
      .def("wait_in_flight", &Engine::wait_in_flight)
      .def("schedule_state", &Engine::schedule_state)
      .def("set_schedule_in_flight", &Engine::set_schedule_in_flight)
      .def("restore_schedule", &Engine::restore_schedule)
      .def("in_flight_capacity", &Engine::in_flight_capacity);
  m.class_<LinkBudget>("LinkBudget")
      .def(torch::init<std::vector<c10::intrusive_ptr<Engine>>, std::vector<std::string>,
                       std::vector<std::string>, int64_t>())
      .def("active", &LinkBudget::active)
      .def("add_compute", &LinkBudget::add_compute)
      .def("before_step", &LinkBudget::before_step);
  m.def("option_table", &option_table);
  m.def("resolved_options", &resolved_options);
  m.def("payload_bytes", &payload_bytes);
  m.def("cuda_built", &cuda_built);
  m.def("all_finite", static_cast<bool (*)(const std::vector<at::Tensor>&)>(&optim::all_finite));
  m.def("resumed_options", &resumed_options);
  m.def("second_moment_of", &second_moment_of);
  m.def("second_moment_state", &second_moment_state);
  m.def("resumed_from_replica", &optim::resumed_from_replica);
  m.def("owner_residual_weight", &optim::owner_residual_weight);
}

}  // namespace flexdemo::ops
