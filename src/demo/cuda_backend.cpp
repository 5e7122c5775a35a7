// The DeMo step on a GPU behind backend.h: kernels::GpuStep encodes a bucket of every tensor in
// one launch and decodes and updates it in another. The headers and checksums are written, and
// the received payloads screened, by kernels too (the host waits only for the verdict); the
// bucket's buffers lie in pinned host memory (an MPI replica group) or on the device (NCCL). Built
// in every build: without CUDA, GpuStep's constructor says why it cannot run.
#include "backend.h"

#include "flexdemo/comm.h"
#include "flexdemo/compress.h"
#include "flexdemo/dct.h"
#include "demo/kernels.h"
#include "demo/screen.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace flexdemo::demo {
namespace {

class CudaBackend final : public Backend {
 public:
  CudaBackend(const std::vector<dct::ChunkPlan>& plans, const BackendOptions& options,
              const std::vector<at::Tensor>& residuals, at::Device device,
              at::Device replica_device)
      : plans_(plans),
        options_(options),
        residuals_(residuals),
        device_(device),
        replica_device_(replica_device) {
    if (!options.dct) {
      throw std::invalid_argument("DeMo: transform none runs on CPUs only");
    }
    int64_t largest = 1;
    for (const dct::ChunkPlan& plan : plans) largest = std::max(largest, plan.padded_numel());
    scratch_ = at::empty({largest}, at::dtype(at::kFloat).device(device));
    kernels_for(every_tensor(), options.topk, options.values);  // the tables on the device, once
  }

  at::Tensor buffer(int64_t bytes) const override {
    if (replica_device_.is_cuda()) {
      return at::empty({bytes}, at::dtype(at::kByte).device(replica_device_));
    }
    return at::empty({bytes}, at::dtype(at::kByte).pinned_memory(true));
  }

  // It encodes every tensor in one launch; it screens and decodes a bucket of any of them (the
  // owners' exchange decodes each owner's share).
  bool partial_buckets() const override { return false; }

  // The kernels' verdict, then what the host's screening (screen_payloads) makes of it: a payload
  // the kernels flag is copied to the host and checked there alone, for the host's own finding
  // and message (as every replica, whatever its device, names it); the others count in the
  // scale check by the kernels' sums, which are the host's bits.
  std::vector<optim::PeerFault> screen(const Bucket& b, const at::Tensor& gathered, int replicas,
                                       double scale_bound) const override {
    const kernels::GpuStep& gpu = kernels_for(b.tensors, b.topk, b.values);
    staged_ = on_device(gathered);  // the decode that follows reads this copy
    staged_from_ = gathered;
    const kernels::GpuStep::Screened verdict = gpu.screen_on_device(staged_, replicas);
    std::vector<optim::PeerFault> found;
    const size_t tensors = b.tensors.size();
    std::vector<double> norms(static_cast<size_t>(replicas), 0.0);
    std::vector<char> judged(static_cast<size_t>(replicas), 0);
    for (size_t i = 0; i < tensors; ++i) {
      for (int r = 0; r < replicas; ++r) {
        const size_t e = size_t(r) * tensors + i;
        judged[r] = 1;
        norms[r] = std::sqrt(verdict.squares[e]);
        if (verdict.errors[e] == 0) continue;
        const dct::ChunkPlan& plan = plans_[b.tensors[i]];
        const int64_t size = int64_t(compress::wire_payload_bytes(plan, b.topk, b.values));
        const at::Tensor payload =
            gathered.narrow(0, int64_t(size_t(r) * b.bytes + b.offsets[i]), size).to(at::kCPU);
        const std::optional<optim::PeerFault> fault = check_payload(
            payload.data_ptr<uint8_t>(), plan, b.topk, b.values, r, i, &norms[r]);
        judged[r] = !fault;
        if (fault) found.push_back(*fault);
      }
      add_out_of_scale(norms, judged, i, scale_bound, found);
    }
    return found;
  }

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
    const kernels::GpuStep& gpu = kernels_for(b.tensors, b.topk, b.values);
    const bool in_place = b.send.device() == device_;  // NCCL: the bucket lies on this GPU
    const at::Tensor encoded =
        in_place ? b.send : at::empty({int64_t(b.bytes)}, at::dtype(at::kByte).device(device_));
    gpu.encode(grads, residuals_, options_.decay, lr, encoded);
    gpu.seal_on_device(encoded);
    if (!in_place) b.send.copy_(encoded);  // MPI: to the pinned host bucket (waits for it)
  }

  // A bucket of some of the tensors (the owners' exchange decodes each owner's share) runs the
  // kernels of a layout of those tensors alone: its payloads lie in the bucket as that layout's.
  void decode(const Bucket& b, const at::Tensor& gathered, int replicas,
              const Updates& updates) override {
    const kernels::GpuStep& gpu = kernels_for(b.tensors, b.topk, b.values);
    // The screening's copy when it screened these very bytes (an MPI bucket lies on the host).
    const bool screened = staged_.defined() && staged_from_.is_same(gathered);
    const at::Tensor on_device = screened ? staged_ : this->on_device(gathered);
    staged_ = at::Tensor();
    staged_from_ = at::Tensor();
    if (b.tensors.empty()) return;
    const bool fused = std::all_of(b.tensors.begin(), b.tensors.end(), [&](size_t i) {
      const std::optional<Update>& u = updates.fused.at(i);
      return u.has_value() && !u->measured;
    });
    if (!fused) {  // a rule the kernels do not fuse: each tensor's direction, then apply()
      std::vector<at::Tensor> directions;
      for (size_t i : b.tensors) {
        directions.push_back(at::zeros({plans_[i].rows, plans_[i].cols},
                                       at::dtype(at::kFloat).device(device_)));
      }
      gpu.decode_step(on_device, replicas, directions, {}, {}, kernels::direction_hyper());
      for (size_t k = 0; k < b.tensors.size(); ++k) updates.apply(b.tensors[k], directions[k]);
      return;
    }
    std::vector<at::Tensor> params, exp_avg, exp_avg_sq;
    for (size_t i : b.tensors) {
      const Update& u = *updates.fused[i];
      params.push_back(u.param);
      if (u.rule == Update::Rule::AdamW) {
        exp_avg.push_back(u.exp_avg);
        exp_avg_sq.push_back(u.exp_avg_sq);
      }
    }
    gpu.decode_step(on_device, replicas, params, exp_avg, exp_avg_sq,
                    updates.fused[b.tensors.front()]->hyper);
  }

 private:
  // The kernels' tables for a layout (these tensors, in this order, at this top-k and values),
  // built once per layout used.
  const kernels::GpuStep& kernels_for(const std::vector<size_t>& tensors, int64_t topk,
                                      compress::ValueEncoding values) const {
    auto& slot = kernels_[{tensors, topk, values}];
    if (!slot) {
      std::vector<dct::ChunkPlan> plans;
      for (size_t i : tensors) plans.push_back(plans_.at(i));
      slot = std::make_unique<kernels::GpuStep>(plans, topk, values, device_);
    }
    return *slot;
  }
  std::vector<size_t> every_tensor() const {
    std::vector<size_t> all(plans_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    return all;
  }
  at::Tensor on_device(const at::Tensor& gathered) const {
    return gathered.device() == device_ ? gathered : gathered.to(device_, /*non_blocking=*/true);
  }

  std::vector<dct::ChunkPlan> plans_;
  BackendOptions options_;
  std::vector<at::Tensor> residuals_;  // handles: the replicator's tensors
  at::Device device_, replica_device_;
  at::Tensor scratch_;  // float32 on the device, for accumulate's DCT
  // The gathered bucket screen() last copied to the device, and what it copied: the decode of
  // the same tensor reuses it (one copy a step, not two), then lets it go.
  mutable at::Tensor staged_, staged_from_;
  mutable std::map<std::tuple<std::vector<size_t>, int64_t, compress::ValueEncoding>,
                   std::unique_ptr<kernels::GpuStep>>
      kernels_;
};

// The CUDA kernels against the CPU's portable ones on a small bucket (two tensors: whole 64 x 64
// chunks, and a padded vector): encode, seal and a sign-SGD decode. "" when every byte and bit
// agrees; else what differs first.
std::string kernels_disagree(at::Device device) {
  const std::vector<dct::ChunkPlan> plans = {
      dct::make_chunk_plan({128, 192}, 64, dct::ChunkMode::Divisor),
      dct::make_chunk_plan({1000}, 64, dct::ChunkMode::Padded)};
  const int64_t k = 8;
  const compress::ValueEncoding values = compress::ValueEncoding::Bf16;
  const kernels::GpuStep gpu(plans, k, values, device);
  std::vector<at::Tensor> grads, cpu_residuals, gpu_residuals, cpu_params, gpu_params;
  for (const dct::ChunkPlan& p : plans) {  // deterministic data, no random generator touched
    const at::Tensor x = at::arange(p.numel(), at::kFloat);
    grads.push_back(
        (at::sin(x * 0.37f) * 0.01f + at::cos(x * 0.011f) * 0.003f).view({p.rows, p.cols}));
    cpu_residuals.push_back(at::zeros({p.padded_rows, p.padded_cols}));
    gpu_residuals.push_back(cpu_residuals.back().to(device));
    cpu_params.push_back((at::cos(x * 0.07f) * 0.02f).view({p.rows, p.cols}));
    gpu_params.push_back(cpu_params.back().to(device));
  }
  std::vector<uint8_t> expected(gpu.bytes(), 0);
  std::vector<compress::SparseChunks> coeffs;
  const kernels::Isa saved = kernels::active_isa();
  kernels::set_active_isa(kernels::Isa::Portable);
  for (size_t i = 0; i < plans.size(); ++i) {
    compress::TopK topk =
        kernels::dct_accumulate_topk(grads[i], plans[i], 0.0, 1.0, cpu_residuals[i], k);
    compress::encode_payload(plans[i], topk, values, expected.data() + gpu.offset(i));
    compress::add_selected(cpu_residuals[i], plans[i], topk, -1.0f);
    const uint8_t* payload = expected.data() + gpu.offset(i);
    coeffs.push_back(compress::decode_mean_sparse(
        {payload}, compress::wire_payload_bytes(plans[i], k, values), plans[i], k, values));
    kernels::idct_sparse_sgd_step(coeffs.back(), plans[i], {cpu_params[i], 0.01f, 1.0f});
  }
  kernels::set_active_isa(saved);

  std::vector<at::Tensor> on_device;
  for (const at::Tensor& g : grads) on_device.push_back(g.to(device));
  const at::Tensor send = at::empty({int64_t(gpu.bytes())}, at::dtype(at::kByte).device(device));
  gpu.encode(on_device, gpu_residuals, 0.0, 1.0, send);
  gpu.seal_on_device(send);
  const at::Tensor got = send.cpu();
  for (size_t b = 0; b < expected.size(); ++b) {
    if (got.data_ptr<uint8_t>()[b] != expected[b]) {
      return "payload byte " + std::to_string(b) + " of " + std::to_string(expected.size());
    }
  }
  kernels::AdamWHyper hyper;
  hyper.lr = 0.01;
  gpu.decode_step(send, 1, gpu_params, {}, {}, hyper);
  for (size_t i = 0; i < plans.size(); ++i) {
    if (!at::equal(gpu_residuals[i].cpu(), cpu_residuals[i])) {
      return "residual of tensor " + std::to_string(i);
    }
    if (!at::equal(gpu_params[i].cpu(), cpu_params[i])) {
      return "sign-SGD update of tensor " + std::to_string(i);
    }
  }
  return "";
}

// The DeMo step on the CPU's backend for tensors elsewhere (make_host_staged_backend).
class HostStagedBackend final : public Backend {
 public:
  HostStagedBackend(const std::vector<dct::ChunkPlan>& plans,
                    const BackendOptions& options,
                    const std::vector<at::Tensor>& residuals, at::Device replica_device)
      : residuals_(residuals), replica_device_(replica_device) {
    for (const at::Tensor& r : residuals) host_residuals_.push_back(r.to(at::kCPU).clone());
    inner_ = options.fast_path && options.dct ? make_cpu_backend(plans, options, host_residuals_)
                               : make_plain_backend(plans, options, host_residuals_);
  }

  at::Tensor buffer(int64_t bytes) const override {
    if (replica_device_.is_cuda()) {
      return at::empty({bytes}, at::dtype(at::kByte).device(replica_device_));
    }
    return at::empty({bytes}, at::kByte);
  }
  bool partial_buckets() const override { return false; }

  std::vector<optim::PeerFault> screen(const Bucket& b, const at::Tensor& gathered, int replicas,
                                       double scale_bound) const override {
    return inner_->screen(on_host(b), gathered.to(at::kCPU), replicas, scale_bound);
  }

  void accumulate(size_t i, const at::Tensor& grad, double lr) override {
    inner_->accumulate(i, grad.defined() ? grad.to(at::kCPU) : grad, lr);
    residuals_[i].copy_(host_residuals_[i]);
  }

  void encode(Bucket& b, const std::vector<at::Tensor>& grads, double lr) override {
    std::vector<at::Tensor> host_grads;
    for (const at::Tensor& g : grads) host_grads.push_back(g.defined() ? g.to(at::kCPU) : g);
    Bucket host = on_host(b);
    host.send = b.send.is_cpu() ? b.send : at::empty({int64_t(b.bytes)}, at::kByte);
    inner_->encode(host, host_grads, lr);
    if (!b.send.is_cpu()) b.send.copy_(host.send);
    for (size_t i : b.tensors) residuals_[i].copy_(host_residuals_[i]);
  }

  void decode(const Bucket& b, const at::Tensor& gathered, int replicas,
              const Updates& updates) override {
    Updates host = updates;
    for (std::optional<Update>& u : host.fused) {
      if (!u) continue;
      u->param = u->param.to(at::kCPU).contiguous();
      if (u->exp_avg.defined()) u->exp_avg = u->exp_avg.to(at::kCPU).contiguous();
      if (u->exp_avg_sq.defined()) u->exp_avg_sq = u->exp_avg_sq.to(at::kCPU).contiguous();
    }
    host.apply = [&](size_t i, const at::Tensor& direction) {
      updates.apply(i, direction.to(residuals_[i].device()));  // where the tensor lies
    };
    inner_->decode(on_host(b), gathered.to(at::kCPU), replicas, host);
    for (size_t i = 0; i < updates.fused.size(); ++i) {
      if (!updates.fused[i]) continue;
      updates.fused[i]->param.copy_(host.fused[i]->param);
      if (host.fused[i]->exp_avg.defined()) updates.fused[i]->exp_avg.copy_(host.fused[i]->exp_avg);
      if (host.fused[i]->exp_avg_sq.defined()) {
        updates.fused[i]->exp_avg_sq.copy_(host.fused[i]->exp_avg_sq);
      }
    }
  }

 private:
  static Bucket on_host(const Bucket& b) {
    Bucket h;
    h.tensors = b.tensors;
    h.offsets = b.offsets;
    h.bytes = b.bytes;
    h.topk = b.topk;
    h.values = b.values;
    return h;
  }

  std::vector<at::Tensor> residuals_;  // the replicator's, on their device
  std::vector<at::Tensor> host_residuals_;
  at::Device replica_device_;
  std::unique_ptr<Backend> inner_;
};

}  // namespace

std::unique_ptr<Backend> make_host_staged_backend(const std::vector<dct::ChunkPlan>& plans,
                                                  const BackendOptions& options,
                                                  const std::vector<at::Tensor>& residuals,
                                                  at::Device replica_device) {
  return std::make_unique<HostStagedBackend>(plans, options, residuals, replica_device);
}

std::unique_ptr<Backend> make_cuda_backend(const std::vector<dct::ChunkPlan>& plans,
                                           const BackendOptions& options,
                                           const std::vector<at::Tensor>& residuals,
                                           at::Device device, at::Device replica_device) {
  static std::mutex mutex;
  static std::map<int, std::string> verdicts;  // per GPU: what disagrees ("" nothing)
  std::string disagree;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = verdicts.find(device.index());
    if (it == verdicts.end()) {
      const char* forced = std::getenv("FLEXDEMO_GPU_FALLBACK");
      std::string verdict = forced != nullptr && std::string(forced) == "1"
                                ? "FLEXDEMO_GPU_FALLBACK=1"
                                : kernels_disagree(device);
      if (!verdict.empty()) {
        std::fprintf(stderr,
                     "flexdemo: warning: the GPU kernels disagree with the CPU's on %s (%s); "
                     "DeMo's step runs on the CPU's kernels instead (slower)\n",
                     device.str().c_str(), verdict.c_str());
      }
      it = verdicts.emplace(device.index(), verdict).first;
    }
    disagree = it->second;
  }
  if (!disagree.empty()) return make_host_staged_backend(plans, options, residuals, replica_device);
  return std::make_unique<CudaBackend>(plans, options, residuals, device, replica_device);
}

}  // namespace flexdemo::demo
