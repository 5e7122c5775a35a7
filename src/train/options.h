// What the trainer derives from its options (train_options.h): config.json in and out, the resume
// check, the optimizer's options and the learning-rate schedule. Internal to src/train.
#pragma once

#include "flexdemo/model.h"
#include "flexdemo/optim.h"
#include "flexdemo/train_options.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace flexdemo::train {

// An option's flag from its name: weight_decay -> --weight-decay.
std::string flag_of(const std::string& name);

// An option's value as config.json writes it: words for enums, null for an unset optional.
template <class T>
nlohmann::ordered_json json_of(const T& value) {
  if constexpr (is_optional<T>::value) {
    return value ? json_of(*value) : nlohmann::ordered_json(nullptr);
  } else if constexpr (std::is_enum_v<T>) {
    return name_of(value);
  } else {
    return value;
  }
}

// Every saved option (all but OptionRole::Unsaved), in declaration order.
nlohmann::ordered_json to_json(const TrainConfig& config);
// A config holding the OptionRole::Model options of a saved config (a checkpoint's model and
// data), defaults elsewhere.
TrainConfig model_config_from_json(const nlohmann::json& saved);
// Throws std::invalid_argument when `run` (resolved) differs from the config saved with the
// checkpoint at `where` in an option a resume must keep (OptionRole::Model and State).
void check_resumable(const nlohmann::json& saved, const TrainConfig& run, const std::string& where);

// The optimizer a resolved config asks for (validated).
optim::OptimizerOptions optimizer_options(const TrainConfig& config);
// The model a config asks for: its --model's family, and the preset with the dimensions given
// (> 0) overriding it.
model::ModelFamily family(const TrainConfig& config);
model::GptConfig gpt_config(const TrainConfig& config, int64_t vocab);
model::T5Config t5_config(const TrainConfig& config, int64_t vocab);
model::LlamaConfig llama_config(const TrainConfig& config, int64_t vocab);

// Linear warmup to --lr, then a cosine to --lr x --min-lr-ratio at the last step.
double scheduled_lr(const TrainConfig& config, int64_t step);

}  // namespace flexdemo::train
