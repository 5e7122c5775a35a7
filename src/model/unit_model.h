// The part every model shares: its sharded units, their parameters' names and the count.
// Internal to src/model; models add units in order and run them in their forward.
#pragma once

#include "flexdemo/model.h"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::model {

// Config checks shared by the models: one line naming the option and what is accepted.
inline void require_positive(int64_t value, const char* option) {
  if (value <= 0) {
    throw std::invalid_argument(std::string("--") + option + " must be > 0, got " +
                                std::to_string(value));
  }
}
inline void require_heads_divide_width(int64_t heads, int64_t width) {
  if (width % heads != 0) {
    throw std::invalid_argument("--heads " + std::to_string(heads) + " must divide --width " +
                                std::to_string(width));
  }
}

class UnitModel : public LanguageModel {
 public:
  const std::vector<std::unique_ptr<shard::ShardedUnit>>& units() const override { return units_; }
  const std::vector<std::vector<std::string>>& param_names() const override { return names_; }
  int64_t num_params() const override { return num_params_; }

 protected:
  // A unit of named initial parameters, sharded over group.
  void add_unit(const std::string& name,
                const std::vector<std::pair<std::string, at::Tensor>>& params,
                std::shared_ptr<comm::Communicator> group, const shard::ShardOptions& options) {
    std::vector<at::Tensor> tensors;
    std::vector<std::string> names;
    for (const auto& [n, t] : params) {
      names.push_back(n);
      tensors.push_back(t);
      num_params_ += t.numel();
    }
    units_.push_back(
        std::make_unique<shard::ShardedUnit>(name, tensors, std::move(group), options));
    names_.push_back(names);
  }

  std::vector<std::unique_ptr<shard::ShardedUnit>> units_;

 private:
  std::vector<std::vector<std::string>> names_;
  int64_t num_params_ = 0;
};

}  // namespace flexdemo::model
