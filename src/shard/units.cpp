// What spans a model's units: their optimizer tensors in one order, and the hook that starts each
// unit's exchange between nodes as soon as its backward is done.
#include "flexdemo/shard.h"

namespace flexdemo::shard {

std::vector<optim::OptimParam> optim_params(const Units& units) {
  std::vector<optim::OptimParam> all;
  for (const auto& unit : units) {
    for (auto& p : unit->optim_params()) all.push_back(p);
  }
  return all;
}

ExchangeInBackward::ExchangeInBackward(const Units& units, optim::Optimizer& optimizer)
    : units_(units) {
  size_t first = 0;  // the optimizer's index of the unit's first tensor
  for (const auto& unit : units) {
    std::vector<size_t> tensors(unit->shards().size());
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i] = first + i;
    first += tensors.size();
    unit->on_gradients_ready([&optimizer, tensors] { optimizer.start_exchange(tensors); });
  }
}

ExchangeInBackward::~ExchangeInBackward() {
  for (const auto& unit : units_) unit->on_gradients_ready(nullptr);
}

}  // namespace flexdemo::shard
