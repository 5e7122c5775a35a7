// What the two DeMo replicators share (demo_replicator.cpp: the all-gather; owner_replicator.cpp:
// the owners' exchange): the backend's options from the optimizer's, the screening of a gathered
// bucket's payloads, and the decode of the replicas that passed it.
#pragma once

#include "demo/backend.h"

#include "flexdemo/optim.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace flexdemo::optim {

// The step's types, as the replicators name them.
using demo::Backend;
using demo::Bucket;
using demo::make_backend;
using demo::Update;
using demo::Updates;

// What the backend's kernels need of the options.
demo::BackendOptions backend_options(const OptimizerOptions& options);

// The replicas (of `replicas`, b's layout back to back in `gathered`) whose payloads all pass
// the checks (demo/screen.h, by the backend: b.tensors index its plans), in rank order; every
// failure is appended to `faults` (tensor: the replicator's index). Under PeerPolicy::Stop the
// first failure throws PeerFaultError.
std::vector<int> passing_replicas(const demo::Backend& backend, const demo::Bucket& b,
                                  const at::Tensor& gathered, int replicas,
                                  const OptimizerOptions& options, std::vector<PeerFault>& faults);
// backend.decode of the `kept` replicas' payloads alone (none kept: nothing is applied).
void decode_passing(demo::Backend& backend, const demo::Bucket& b, const at::Tensor& gathered,
                    int replicas, const std::vector<int>& kept, const demo::Updates& updates);

// The owners' exchange: the most coefficients a chunk (at least topk) whose payload at
// owner_values fits in the bytes of one at topk and values, for the plans' largest chunk.
int64_t owner_topk_that_fits(const std::vector<dct::ChunkPlan>& plans, int64_t topk,
                             compress::ValueEncoding values, compress::ValueEncoding owner_values);

}  // namespace flexdemo::optim
