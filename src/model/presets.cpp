// The model presets of every family together, and a preset's family: the one list the command
// line, config files and the trainer check a --model against.
#include "unit_model.h"

#include <algorithm>
#include <stdexcept>

namespace flexdemo::model {

std::vector<std::string> model_presets() {
  std::vector<std::string> all;
  for (const auto& family : {gpt_presets(), llama_presets(), t5_presets()}) {
    all.insert(all.end(), family.begin(), family.end());
  }
  return all;
}

ModelFamily model_family(const std::string& preset) {
  auto in = [&preset](const std::vector<std::string>& names) {
    return std::find(names.begin(), names.end(), preset) != names.end();
  };
  if (in(gpt_presets())) return ModelFamily::Gpt;
  if (in(llama_presets())) return ModelFamily::Llama;
  if (in(t5_presets())) return ModelFamily::T5;
  std::string accepted;
  for (const std::string& name : model_presets()) accepted += (accepted.empty() ? "" : ", ") + name;
  throw std::invalid_argument("unknown model '" + preset + "'; accepted: " + accepted);
}

}  // namespace flexdemo::model
