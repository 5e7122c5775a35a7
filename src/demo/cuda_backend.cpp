// The DeMo step on a GPU behind backend.h: kernels::GpuStep encodes a bucket of every tensor in
// one launch and decodes and updates it in another. The headers and checksums are written, and
// the received payloads validated, by kernels too (the host waits only for the verdict); the
// bucket's buffers lie in pinned host memory (an MPI replica group) or on the device (NCCL). Built
// in every build: without CUDA, GpuStep's constructor says why it cannot run.
#include "backend.h"

#include "flexdemo/dct.h"

#include <ATen/ATen.h>

#include <map>
#include <stdexcept>
#include <utility>

namespace flexdemo::demo {
namespace {

class CudaBackend final : public Backend {
 public:
  CudaBackend(const std::vector<dct::ChunkPlan>& plans, const optim::OptimizerOptions& options,
              const std::vector<at::Tensor>& residuals, at::Device device,
              at::Device replica_device)
      : plans_(plans),
        options_(options),
        residuals_(residuals),
        device_(device),
        replica_device_(replica_device) {
    if (options.overlap_step) throw std::invalid_argument("DeMo: overlap_step runs on CPUs only");
    if (options.transform == optim::Transform::None) {
      throw std::invalid_argument("DeMo: transform none runs on CPUs only");
    }
    int64_t largest = 1;
    for (const dct::ChunkPlan& plan : plans) largest = std::max(largest, plan.padded_numel());
    scratch_ = at::empty({largest}, at::dtype(at::kFloat).device(device));
    kernels_for(options.topk, options.values);  // the tables and bases on the device, once
  }

  at::Tensor buffer(int64_t bytes) const override {
    if (replica_device_.is_cuda()) {
      return at::empty({bytes}, at::dtype(at::kByte).device(replica_device_));
    }
    return at::empty({bytes}, at::dtype(at::kByte).pinned_memory(true));
  }

  bool partial_buckets() const override { return false; }  // one launch for every tensor

  void accumulate(size_t i, const at::Tensor& grad, double lr) override {
    if (grad.defined()) {
      dct::chunked_dct_accumulate(grad, plans_[i], options_.decay, lr, residuals_[i], &scratch_);
    } else {
      residuals_[i].mul_(options_.decay);
    }
  }

  void encode(Bucket& b, const std::vector<at::Tensor>& grads, double lr) override {
    if (b.tensors.size() != plans_.size()) {
      throw std::logic_error("DeMo on a GPU: one bucket of every tensor a step");
    }
    const kernels::GpuStep& gpu = kernels_for(b.topk, b.values);
    const bool in_place = b.send.device() == device_;  // NCCL: the bucket lies on this GPU
    const at::Tensor encoded =
        in_place ? b.send : at::empty({int64_t(b.bytes)}, at::dtype(at::kByte).device(device_));
    gpu.encode(grads, residuals_, options_.decay, lr, encoded);
    gpu.seal_on_device(encoded);
    if (!in_place) b.send.copy_(encoded);  // MPI: to the pinned host bucket (waits for it)
  }

  void decode(const Bucket& b, const at::Tensor& gathered, int replicas,
              const Updates& updates) override {
    const kernels::GpuStep& gpu = kernels_for(b.topk, b.values);
    std::vector<at::Tensor> params, exp_avg, exp_avg_sq;
    for (const std::optional<Update>& u : updates.fused) {
      if (!u) {
        throw std::invalid_argument(
            "DeMo on a GPU: its kernels update by sign-SGD or AdamW only (plain SGD without sign "
            "and Nesterov SGD run on CPUs)");
      }
      params.push_back(u->param);
      if (u->rule == Update::Rule::AdamW) {
        exp_avg.push_back(u->exp_avg);
        exp_avg_sq.push_back(u->exp_avg_sq);
      }
    }
    const at::Tensor on_device =
        gathered.device() == device_ ? gathered : gathered.to(device_, /*non_blocking=*/true);
    gpu.validate_on_device(on_device, replicas);
    if (params.empty()) return;
    gpu.decode_step(on_device, replicas, params, exp_avg, exp_avg_sq, updates.fused.front()->hyper);
  }

 private:
  // The kernels' tables for a layout, built once per layout used.
  const kernels::GpuStep& kernels_for(int64_t topk, compress::ValueEncoding values) {
    auto& slot = kernels_[{topk, values}];
    if (!slot) slot = std::make_unique<kernels::GpuStep>(plans_, topk, values, device_);
    return *slot;
  }

  std::vector<dct::ChunkPlan> plans_;
  optim::OptimizerOptions options_;
  std::vector<at::Tensor> residuals_;  // handles: the replicator's tensors
  at::Device device_, replica_device_;
  at::Tensor scratch_;  // float32 on the device, for accumulate's DCT
  std::map<std::pair<int64_t, compress::ValueEncoding>, std::unique_ptr<kernels::GpuStep>> kernels_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const std::vector<dct::ChunkPlan>& plans,
                                           const optim::OptimizerOptions& options,
                                           const std::vector<at::Tensor>& residuals,
                                           at::Device device, at::Device replica_device) {
  return std::make_unique<CudaBackend>(plans, options, residuals, device, replica_device);
}

}  // namespace flexdemo::demo
