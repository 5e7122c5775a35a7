// Replicators: how replicas turn their gradients into one shared update direction. Internal to
// the optimizer; every implementation sends all of a step's tensors in ONE collective, except
// the tensors given to start() (DeMo), which go in their own.
#pragma once

#include "flexdemo/optim.h"

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::kernels {
struct Preconditioning;  // demo/kernels.h
}

namespace flexdemo::optim {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// {prefix.0, tensors[0]}, {prefix.1, tensors[1]}, ...
inline NamedTensors numbered(const std::string& prefix, const std::vector<at::Tensor>& tensors) {
  NamedTensors named;
  for (size_t i = 0; i < tensors.size(); ++i) {
    named.push_back({prefix + "." + std::to_string(i), tensors[i]});
  }
  return named;
}

class StepRule;

class Replicator {
 public:
  virtual ~Replicator() = default;
  // Folds this step's gradients (plan.numel() elements each; undefined = zero) into the state
  // without exchanging: the steps between two exchanges. lr: the scale a gradient enters the
  // state with (this step's learning rate, or 1 with fold_lr off); the step's own rate is the
  // StepRule's.
  virtual void accumulate(const std::vector<at::Tensor>& grads, double lr) = 0;
  // Folds them in, exchanges over the replica group, and has `inner` apply each tensor's
  // direction (inner.apply, or the fused sign step where it offers one). The directions are
  // bit-identical on every replica.
  virtual void exchange(const std::vector<at::Tensor>& grads, double lr, StepRule& inner) = 0;
  // On an exchange step, before exchange(): these tensors' gradients (grads[k] is tensors[k]'s)
  // are final; fold them in and start their exchange now, non-blocking. exchange() then skips
  // them and completes it. A hint: kinds that cannot start early ignore it.
  virtual void start(const std::vector<size_t>& tensors, const std::vector<at::Tensor>& grads,
                     double lr) {
    (void)tensors;
    (void)grads;
    (void)lr;
  }
  // Offers to precondition tensor i's gradient of this step (the next one accumulate, exchange
  // or start is given) as its transform reads it: true if this kind will (then that gradient
  // comes unscaled), false if the caller must precondition it first (the default).
  virtual bool precondition_as_read(size_t i, const kernels::Preconditioning& p) {
    (void)i;
    (void)p;
    return false;
  }
  virtual ExchangeTraffic traffic() const = 0;
  // The state carried from step to step (handles: loading copies into them), named for files.
  virtual NamedTensors state_tensors() const = 0;
  // After loading state: the exchanges done so far and the steps folded in since the last one.
  virtual void restore_counters(int64_t exchanges, int64_t pending) {
    (void)exchanges;
    (void)pending;
  }
  virtual const at::Tensor& residual(size_t i) const;  // throws unless the kind keeps one
  // DeMo: the top-k and values of the payloads from the next one encoded on (an exchange in
  // flight completes as it was sent), and those of the payloads last put in use. The kinds
  // whose payloads do not depend on them ignore the one and have no other.
  virtual void set_layout(int64_t topk, compress::ValueEncoding values) {
    (void)topk;
    (void)values;
  }
  virtual std::optional<std::pair<int64_t, compress::ValueEncoding>> layout() const { return {}; }
  // Demo: the peers' payloads found faulty since the last call (tensor: this replicator's
  // index), and the test aid that tampers this replica's payloads of the next exchange.
  virtual std::vector<PeerFault> take_peer_faults() { return {}; }
  virtual void tamper_next_exchange(compress::Tamper how, double factor);
  // Waits for the exchange in flight between steps (overlap_step), if any, without applying it.
  virtual void wait_in_flight() {}
  // Where the parameters carry a replica's own preview (--overlap-step): the committed ones,
  // identical on every replica. Empty otherwise.
  virtual std::vector<at::Tensor> committed_params() const { return {}; }
};

// The state lives on `device`, the parameters' (CPU or a GPU).
std::unique_ptr<Replicator> make_replicator(const std::vector<dct::ChunkPlan>& plans,
                                            const OptimizerOptions& options,
                                            std::shared_ptr<comm::Communicator> replica_group,
                                            at::Device device);

// ====== The implementations (one file each) ======
std::unique_ptr<Replicator> make_demo_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                 const OptimizerOptions& options,
                                                 std::shared_ptr<comm::Communicator> group,
                                                 at::Device device);
// Demo with options.demo_exchange Owners (owner_replicator.cpp).
std::unique_ptr<Replicator> make_owner_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                  const OptimizerOptions& options,
                                                  std::shared_ptr<comm::Communicator> group,
                                                  at::Device device);
// Full (exchange = true) and None (exchange = false): the mean gradient since the last exchange.
std::unique_ptr<Replicator> make_dense_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                  const OptimizerOptions& options,
                                                  std::shared_ptr<comm::Communicator> group,
                                                  bool exchange, at::Device device);
std::unique_ptr<Replicator> make_random_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                   const OptimizerOptions& options,
                                                   std::shared_ptr<comm::Communicator> group,
                                                   at::Device device);

}  // namespace flexdemo::optim
