// The train options' checks and conversions, all driven by the one declaration in
// train_options.h: validation, config.json, the resume check, and the optimizer they ask for.
#include "options.h"

#include "flexdemo/text.h"

#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <type_traits>

namespace flexdemo::train {

namespace {

template <class T>
void read_json(T& field, const nlohmann::json& j) {
  if constexpr (is_optional<T>::value) {
    if (j.is_null()) {
      field.reset();
    } else {
      typename T::value_type v{};
      read_json(v, j);
      field = v;
    }
  } else if constexpr (std::is_enum_v<T>) {
    field = parse_name<T>(j.get<std::string>());
  } else {
    field = j.get<T>();
  }
}

// The range and word checks of one option.
template <class T>
void check_accepted(const T& value, const OptionSpec& spec) {
  const Accepts& a = spec.accepts;
  if constexpr (is_optional<T>::value) {
    if (value) check_accepted(*value, spec);  // unset: the optimizer's, valid
  } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (a.range.holds(double(value))) return;
    throw std::invalid_argument(
        fmt::format("{} must be {}, got {}", spec.flag(), a.range.text(), value));
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!a.words) return;
    const std::vector<std::string> words = a.words();
    if (std::find(words.begin(), words.end(), value) != words.end()) return;
    std::string accepted;
    for (const std::string& w : words) accepted += (accepted.empty() ? "" : ", ") + w;
    throw std::invalid_argument("unknown " + spec.flag() + " '" + value +
                                "'; accepted: " + accepted);
  }
}

bool uses_demo_replicator(const TrainConfig& c) {
  const bool demo_optimizer =
      c.optimizer == OptimizerKind::FlexDemo || c.optimizer == OptimizerKind::FlexDemoAdamW;
  return c.replicator ? *c.replicator == optim::ReplicatorKind::Demo : demo_optimizer;
}

}  // namespace

std::string flag_of(const std::string& name) {
  if (name == "peer_policy") return "--on-bad-peer";  // the optimizer's name for it
  std::string f = "--" + name;
  std::replace(f.begin(), f.end(), '_', '-');
  return f;
}

std::string OptionSpec::flag() const {
  return flag_of(name);
}

// What an option the --optimizer chooses resolves to under each: "112 for flexdemo; 32 for
// flexdemo-adamw, adamw, sgd".
std::string chosen_text(const std::string& name) {
  std::vector<std::pair<std::string, std::string>> groups;  // value, the optimizers
  for (const std::string& kind : names_of<OptimizerKind>()) {
    TrainConfig c;
    c.optimizer = parse_name<OptimizerKind>(kind);
    c.resolve();
    std::string value;
    for_each_option(c, [&](const auto& field, const OptionSpec& spec) {
      if (spec.name == name) value = json_of(field).dump();
    });
    auto at = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == value; });
    if (at == groups.end()) {
      groups.push_back({value, kind});
    } else {
      at->second += ", " + kind;
    }
  }
  if (groups.size() == 1) return groups.front().first;
  std::string text;
  for (const auto& [value, kinds] : groups) {
    text += (text.empty() ? "" : "; ") + value + " for " + kinds;
  }
  return text;
}

std::string OptionSpec::help_text() const {
  std::string text = optim::spell(help, flag_of);
  if (chosen) text += " (default: " + chosen_text(name) + ")";
  return text;
}

model::ModelFamily family(const TrainConfig& c) {
  return model::model_family(c.model);
}

model::GptConfig gpt_config(const TrainConfig& c, int64_t vocab) {
  model::GptConfig mc = model::gpt_preset(c.model, vocab);
  if (c.width > 0) mc.width = c.width;
  if (c.layers > 0) mc.layers = c.layers;
  if (c.heads > 0) mc.heads = c.heads;
  if (c.context > 0) mc.context = c.context;
  mc.dropout = c.dropout;
  return mc;
}

model::T5Config t5_config(const TrainConfig& c, int64_t vocab) {
  model::T5Config tc = model::t5_preset(c.model, vocab);
  if (c.width > 0) tc.width = c.width;
  if (c.layers > 0) tc.layers = c.layers;
  if (c.heads > 0) tc.heads = c.heads;
  if (c.ff > 0) tc.ff = c.ff;
  return tc;
}

model::LlamaConfig llama_config(const TrainConfig& c, int64_t vocab) {
  model::LlamaConfig lc = model::llama_preset(c.model, vocab);
  if (c.width > 0) lc.width = c.width;
  if (c.layers > 0) lc.layers = c.layers;
  if (c.heads > 0) lc.heads = c.heads;
  if (c.kv_heads > 0) lc.kv_heads = c.kv_heads;
  if (c.context > 0) lc.context = c.context;
  if (c.ff > 0) lc.ff = c.ff;
  lc.rope_theta = c.rope_theta;
  lc.tied_head = c.tied_head;
  lc.dropout = c.dropout;
  return lc;
}

// ====== Validation ======
namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument(what);
}

// The optimizer's rules (their one place: OptimizerOptions::validate) on the options as they
// resolve, its option names spelled as this command's flags.
void check_optimizer(const TrainConfig& c) {
  try {
    TrainConfig resolved = c;
    resolved.resolve();
    optimizer_options(resolved);
  } catch (const optim::OptionsError& e) {
    fail(e.spelled(flag_of));
  }
}

// The trainer's own rules that tie the exchange between nodes to the other options.
void check_exchange(const TrainConfig& c) {
  const bool demo_replicator = uses_demo_replicator(c);
  if (c.exchange_in_backward) {
    // A unit's payloads leave during the backward: nothing may change its gradient afterwards.
    if (!demo_replicator) {
      fail(
          "--exchange-in-backward needs the demo replicator (--optimizer flexdemo or "
          "flexdemo-adamw)");
    }
    if (c.overlap_step) fail("--exchange-in-backward and --overlap-step exclude each other");
    if (c.clip != 0) {
      fail(
          fmt::format("--exchange-in-backward needs --clip 0 (clipping scales by the whole "
                      "gradient's norm, known only after the backward), got --clip {}",
                      c.clip));
    }
    if (c.on_nonfinite != NonFinitePolicy::Stop) {
      fail(
          "--exchange-in-backward needs --on-nonfinite stop (a skipped step would already have "
          "sent its payloads), got --on-nonfinite " +
          name_of(c.on_nonfinite));
    }
  }
  if (c.inner_steps <= 1 && c.outer_sign) {
    fail("--outer-sign needs --inner-steps above 1 (it signs the outer step)");
  }
}

// The rules that tie the model to its data and to the options of one family.
void check_model(const TrainConfig& c) {
  using model::ModelFamily;
  const ModelFamily f = family(c);
  if (c.model == name_of(f)) {  // a family name: no dimensions of its own
    std::vector<std::pair<const char*, int64_t>> needed = {
        {"--width", c.width}, {"--layers", c.layers}, {"--heads", c.heads}};
    if (f != ModelFamily::T5) needed.push_back({"--context", c.context});
    if (f == ModelFamily::Llama) needed.push_back({"--kv-heads", c.kv_heads});
    if (f != ModelFamily::Gpt) needed.push_back({"--ff", c.ff});
    std::string flags;
    bool missing = false;
    for (const auto& [flag, value] : needed) {
      flags += (flags.empty() ? "" : ", ") + std::string(flag);
      missing = missing || value <= 0;
    }
    if (missing) {
      fail("--model " + c.model + " has no dimensions of its own: give " + flags +
           " (or --init-from a transformers folder)");
    }
  }
  if (data::is_pair_source(c.data) && f != ModelFamily::T5) {
    fail("--data " + c.data +
         " holds translation pairs, which train an encoder-decoder: --model t5-nano or t5-small, "
         "got --model " +
         c.model);
  }
  if (f != ModelFamily::Llama) {
    const TrainConfig defaults;
    if (c.kv_heads != 0) fail(fmt::format("--kv-heads applies to llama-* models, not {}", c.model));
    if (c.rope_theta != defaults.rope_theta) {
      fail(fmt::format("--rope-theta applies to llama-* models, not {}", c.model));
    }
    if (!c.tied_head)
      fail(fmt::format("--no-tied-head applies to llama-* models, not {}", c.model));
    if (c.ff != 0 && f != ModelFamily::T5) {
      fail(fmt::format("--ff applies to llama-* and t5-* models, not {}", c.model));
    }
  }
  if (f == ModelFamily::T5) {
    t5_config(c, 260).validate();
  } else if (f == ModelFamily::Llama) {
    const model::LlamaConfig lc = llama_config(c, 260);
    lc.validate();
    if (c.seq > lc.context) {
      fail(fmt::format("--seq {} exceeds the model's context {} (set --context)", c.seq,
                       lc.context));
    }
  } else {
    const model::GptConfig mc = gpt_config(c, 260);
    mc.validate();
    if (c.seq > mc.context) {
      fail(fmt::format("--seq {} exceeds the model's context {} (set --context)", c.seq,
                       mc.context));
    }
  }
}

}  // namespace

void TrainConfig::validate() const {
  for_each_option(*this,
                  [](const auto& value, const OptionSpec& spec) { check_accepted(value, spec); });
  // The rules that tie options together.
  if (tokenizer == TokenizerKind::Bpe && (vocab < 260 || vocab > 65535)) {
    fail(fmt::format("--vocab must be in [260, 65535], got {}", vocab));
  }
  if (!tokenizer_model.empty() && tokenizer != TokenizerKind::Bpe) {
    fail("--tokenizer-model needs --tokenizer bpe");
  }
  check_optimizer(*this);
  check_exchange(*this);
  check_model(*this);
  if (out.empty()) fail("--out must not be empty");
}

void TrainConfig::resolve() {
  const bool demo =
      optimizer == OptimizerKind::FlexDemo || optimizer == OptimizerKind::FlexDemoAdamW;
  if (!replicator) replicator = demo ? optim::ReplicatorKind::Demo : optim::ReplicatorKind::Full;
  // The optimizer's defaults are the library's (optim::preset, optim::options_for), the same
  // Python's FlexDeMo and the C++ API start from: this command says which step and what was
  // given. The dense optimizers take flexdemo-adamw's for the DeMo options they do not use, and
  // their own first moment.
  const optim::Preset step = optimizer == OptimizerKind::FlexDemo ? optim::Preset::FlexDemo
                                                                  : optim::Preset::FlexDemoAdamW;
  std::vector<std::pair<std::string, std::string>> given = {
      {"inner", optimizer == OptimizerKind::FlexDemo || optimizer == OptimizerKind::Sgd ? "sgd"
                                                                                       : "adamw"},
      {"sign", sign ? "true" : "false"},
      {"normalize", normalize ? "true" : "false"},
      {"update_rms", fmt::format("{}", update_rms)},
      {"inner_steps", std::to_string(inner_steps)},
      {"chunk", std::to_string(chunk)}};
  if (!demo) given.push_back({"lr", "0.001"}), given.push_back({"beta1", "0.9"});
  if (lr) given.push_back({"lr", fmt::format("{}", *lr)});
  if (beta1) given.push_back({"beta1", fmt::format("{}", *beta1)});
  if (precondition) given.push_back({"precondition", *precondition ? "true" : "false"});
  if (fold_lr) given.push_back({"fold_lr", *fold_lr ? "true" : "false"});
  if (rms_cap) given.push_back({"rms_cap", fmt::format("{}", *rms_cap)});
  if (topk) given.push_back({"topk", std::to_string(*topk)});
  if (values) given.push_back({"values", name_of(*values)});
  const optim::OptimizerOptions o = optim::options_for(step, given);
  if (!lr) lr = o.lr;
  if (!beta1) beta1 = o.beta1;
  if (!precondition) precondition = o.precondition;
  if (!fold_lr) fold_lr = o.fold_lr;
  if (!rms_cap) rms_cap = o.rms_cap;
  if (!topk) topk = o.topk;
  if (!values) values = o.values;
}

// ====== config.json ======
nlohmann::ordered_json to_json(const TrainConfig& config) {
  nlohmann::ordered_json j;
  for_each_option(config, [&j](const auto& value, const OptionSpec& spec) {
    if (spec.role != OptionRole::Unsaved) j[spec.name] = json_of(value);
  });
  return j;
}

TrainConfig model_config_from_json(const nlohmann::json& saved) {
  TrainConfig c;
  for_each_option(c, [&saved](auto& field, const OptionSpec& spec) {
    if (spec.role == OptionRole::Model && saved.contains(spec.name)) {
      read_json(field, saved[spec.name]);
    }
  });
  return c;
}

void check_resumable(const nlohmann::json& saved, const TrainConfig& run,
                     const std::string& where) {
  for_each_option(run, [&](const auto& value, const OptionSpec& spec) {
    if (spec.role != OptionRole::Model && spec.role != OptionRole::State) return;
    if (!saved.contains(spec.name)) return;
    const std::string was = saved[spec.name].dump(), now = json_of(value).dump();
    if (was != now) {
      throw std::invalid_argument("--resume: " + where + " was written with " + spec.flag() + " " +
                                  was + ", this run has " + now +
                                  " (options that define the model, data and optimizer state "
                                  "must match)");
    }
  });
}

// ====== What the options ask for ======
optim::OptimizerOptions optimizer_options(const TrainConfig& c) {
  optim::OptimizerOptions o;
  o.inner = c.optimizer == OptimizerKind::FlexDemo || c.optimizer == OptimizerKind::Sgd
                ? optim::InnerKind::Sgd
                : optim::InnerKind::AdamW;
  o.replicator = c.replicator.value();
  o.demo_exchange = c.demo_exchange;
  o.owner_topk = c.owner_topk;
  o.owner_values = c.owner_values;
  o.owner_feedback = c.owner_feedback;
  o.sign = c.sign;
  o.normalize = c.normalize;
  o.update_rms = c.update_rms;
  o.step_bound = c.step_bound;
  o.rms_cap = c.rms_cap.value();
  o.lr = c.lr.value();
  o.weight_decay = c.weight_decay;
  o.beta1 = c.beta1.value();
  o.beta2 = c.beta2;
  o.topk = c.topk.value();
  o.chunk = c.chunk;  // for the top-k's bound: the shards' chunk plans are the units' (session.cpp)
  o.transform = c.transform;
  o.decay = c.decay;
  o.fold_lr = c.fold_lr.value();
  o.precondition = c.precondition.value();
  o.second_moment = c.second_moment;
  o.second_moment_every = c.second_moment_every;
  o.second_moment_values = c.second_moment_values;
  o.values = c.values.value();
  o.replicate_every = c.replicate_every;
  o.inner_steps = c.inner_steps;
  o.outer_lr = c.outer_lr;
  o.outer_momentum = c.outer_momentum;
  o.outer_sign = c.outer_sign;
  o.overlap_step = c.overlap_step;
  o.seed = c.seed;
  o.peer_policy = c.on_bad_peer;
  o.peer_scale_bound = c.peer_scale_bound;
  o.link_budget = c.link_budget;
  o.link_min_topk = c.link_min_topk;
  o.link_max_topk = c.link_max_topk;
  o.link_values = c.link_values;
  o.link_max_every = c.link_max_every;
  o.link_probe_every = c.link_probe_every;
  o.validate();
  return o;
}

double scheduled_lr(const TrainConfig& c, int64_t step) {
  const double lr = c.lr.value();
  if (step < c.warmup) return lr * double(step + 1) / double(c.warmup);
  const double span = std::max<int64_t>(1, c.steps - c.warmup);
  const double progress = std::min(1.0, double(step - c.warmup) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cosine);
}

}  // namespace flexdemo::train
