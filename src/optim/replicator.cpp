// The Replicator base's defaults and the factory that picks an implementation by kind; the
// implementations live one per file (demo_replicator.cpp, owner_replicator.cpp, dense_replicators.cpp).
#include "replicator.h"

#include <stdexcept>
#include <utility>

namespace flexdemo::optim {

const at::Tensor& Replicator::residual(size_t) const {
  throw std::logic_error("this replicator keeps no residual");
}

void Replicator::tamper_next_exchange(compress::Tamper, double) {
  throw std::invalid_argument("payload tampering (a test aid) needs the demo replicator");
}

std::unique_ptr<Replicator> make_replicator(const std::vector<dct::ChunkPlan>& plans,
                                            const OptimizerOptions& options,
                                            std::shared_ptr<comm::Communicator> group,
                                            at::Device device) {
  switch (options.replicator) {
    case ReplicatorKind::Demo:
      return make_demo_replicator(plans, options, std::move(group), device);
    case ReplicatorKind::Full:
      return make_dense_replicator(plans, options, std::move(group), true, device);
    case ReplicatorKind::None:
      return make_dense_replicator(plans, options, std::move(group), false, device);
    case ReplicatorKind::Random:
      return make_random_replicator(plans, options, std::move(group), device);
  }
  throw std::invalid_argument("unknown replicator");
}

}  // namespace flexdemo::optim
