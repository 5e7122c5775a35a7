// flexdemo/optim.h — the DeMo optimizer (decoupled momentum) over LibTorch parameters.
// Per step and tensor: decoupled weight decay, residual update in the DCT domain, per-chunk
// top-k with error feedback, ONE bucketed all-gather of every tensor's payload over the
// replica group, deterministic decode, then a sign-SGD (or plain SGD) step.
#pragma once

#include "flexdemo/compress.h"
#include "flexdemo/dct.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::optim {

struct DemoOptions {
  double lr = 1e-3;      // learning rate (> 0); also folded into the residual
  double decay = 0.999;  // residual decay, in [0, 1)
  int64_t topk = 32;     // coefficients kept per chunk (> 0; clamped to the chunk)
  int64_t chunk = 64;    // target chunk edge (> 0)
  dct::ChunkMode chunk_mode = dct::ChunkMode::Divisor;
  double weight_decay = 0.0;  // decoupled, >= 0 and lr * weight_decay < 1
  bool sign = true;           // sign-SGD on the decoded update (off: plain SGD)
  compress::ValueEncoding values = compress::ValueEncoding::Fp32;  // wire value encoding

  void validate() const;  // throws std::invalid_argument naming the bad option
};

// What one step puts on the wire and keeps (identical every step for a given parameter set).
struct DemoTraffic {
  uint64_t wire_bytes = 0;        // this replica's payload, all tensors, headers included
  int64_t kept_coefficients = 0;  // sum over tensors of chunks * k
  int64_t params = 0;             // parameter elements covered
};

class DemoOptimizer {
 public:
  // params: leaf tensors (float32, float64 or bfloat16; CPU). replica_group: the ranks that hold
  // the same parameters and exchange payloads; nullptr means a single replica (no exchange, but
  // the payload is still encoded and decoded, so the numbers match a multi-replica run).
  DemoOptimizer(std::vector<at::Tensor> params, DemoOptions options,
                std::shared_ptr<comm::Communicator> replica_group = nullptr);
  ~DemoOptimizer();
  DemoOptimizer(const DemoOptimizer&) = delete;
  DemoOptimizer& operator=(const DemoOptimizer&) = delete;

  // One step from the parameters' .grad() (a missing gradient counts as zero). Collective over
  // the replica group: every replica must call it with the same parameter shapes.
  void step();
  void zero_grad();  // resets the gradients to zero (keeps their storage)

  const DemoOptions& options() const;
  const std::vector<at::Tensor>& params() const;
  DemoTraffic traffic() const;
  // The residual momentum of parameter i in the DCT domain (block layout, see dct.h).
  const at::Tensor& residual(size_t i) const;
  const dct::ChunkPlan& chunk_plan(size_t i) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexdemo::optim
