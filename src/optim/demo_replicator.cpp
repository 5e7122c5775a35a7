// The DeMo replicator (docs/algorithm.md): residual momentum kept
// in the DCT domain, per-chunk top-k with error feedback, deterministic decode, inverse DCT. The
// payloads travel in buckets, one all-gather each: by default one bucket of every tensor per step;
// tensors whose gradients are final early (start()) go in their own buckets, started at once. With
// overlap_step the all-gather is non-blocking and its result is applied one step later. On a GPU
// every tensor goes in the one bucket, encoded and decoded by kernels::GpuBucket (one launch
// each); the payloads travel through pinned host memory (MPI) or stay on the device (NCCL), and
// are validated on the host either way. The payloads' top-k and values may change between steps
// (set_layout); an exchange in flight completes as it was sent.
#include "inner.h"
#include "replicator.h"

#include "flexdemo/comm.h"
#include "flexdemo/kernels.h"

#include <ATen/ATen.h>

#include <functional>
#include <stdexcept>

namespace flexdemo::optim {

namespace {

// Some tensors' payloads, all-gathered in one collective.
struct Bucket {
  std::vector<size_t> tensors;  // replicator indices
  std::vector<size_t> offsets;  // of each tensor's payload in the bucket
  size_t bytes = 0;             // one replica's payloads
  at::Tensor send;              // uint8 [bytes], host (pinned when the state is on a GPU)
  at::Tensor recv;              // uint8 [replicas * bytes], rank order, host
  std::unique_ptr<comm::Work> work;
};

class DemoReplicator final : public Replicator {
 public:
  DemoReplicator(const std::vector<dct::ChunkPlan>& plans, const OptimizerOptions& options,
                 std::shared_ptr<comm::Communicator> group, at::Device device)
      : plans_(plans),
        options_(options),
        group_(std::move(group)),
        device_(device),
        started_(plans.size(), 0) {
    if (device.is_cuda() && options.overlap_step) {
      throw std::invalid_argument("DeMo: overlap_step runs on CPUs only");
    }
    if (options.transform == Transform::None) {
      if (device.is_cuda()) throw std::invalid_argument("DeMo: transform none runs on CPUs only");
      options_.fast_path = false;  // the fused kernels are the DCT's
    }
    int64_t largest = 1;
    const auto floats = at::dtype(at::kFloat).device(device);
    for (const dct::ChunkPlan& plan : plans_) {
      residuals_.push_back(at::zeros({plan.padded_rows, plan.padded_cols}, floats));
      largest = std::max(largest, plan.padded_numel());
    }
    use_layout(device);
    if (previews()) {
      for (const dct::ChunkPlan& plan : plans_) {
        committed_.push_back(at::empty({plan.rows, plan.cols}, at::kFloat));
      }
    }
    scratch_ = at::empty({largest}, floats);
    if (!device.is_cuda()) {  // the CPU paths' decode buffers; the GPU's kernels need none
      decoded_ = at::empty({largest}, floats);
      samples_ = at::empty({largest}, floats);
    }
  }

  void set_layout(int64_t topk, compress::ValueEncoding values) override {
    next_layout_ = {topk, values};
    if (!all_.work && pending_.item<int64_t>() == 0) use_next_layout();  // nothing in flight
  }
  std::optional<std::pair<int64_t, compress::ValueEncoding>> layout() const override {
    return std::make_pair(options_.topk, options_.values);
  }
  void wait_in_flight() override { finish_in_flight(); }

  void accumulate(const std::vector<at::Tensor>& grads, double lr) override {
    for (size_t i = 0; i < plans_.size(); ++i) accumulate_one(i, grads[i], lr);
  }

  void start(const std::vector<size_t>& tensors, const std::vector<at::Tensor>& grads,
             double lr) override {
    if (options_.overlap_step || gpu_) return;  // everything goes in the one bucket
    std::vector<size_t> fresh;
    for (size_t k = 0; k < tensors.size(); ++k) {
      if (started_.at(tensors[k])) {
        throw std::logic_error("DeMo: tensor " + std::to_string(tensors[k]) +
                               " already started this step");
      }
      started_[tensors[k]] = 1;
      fresh.push_back(tensors[k]);
    }
    if (fresh.empty()) return;
    buckets_.push_back(make_bucket(fresh));
    Bucket& b = buckets_.back();
    for (size_t k = 0; k < fresh.size(); ++k) encode_one(b, k, grads[k], lr);
    launch(b);
  }

  void exchange(const std::vector<at::Tensor>& grads, double lr, InnerOptimizer& inner) override {
    if (gpu_) {
      exchange_on_gpu(grads, lr, inner);
      return;
    }
    if (options_.overlap_step) {
      // One step stale: apply what the previous step's exchange brought (it travelled during
      // this step's forward and backward) to the committed parameters, then start this step's.
      // Until it arrives, the parameters also carry this replica's own part of it (a preview),
      // so the next gradient is not taken a whole update behind.
      finish_in_flight();
      if (pending_.item<int64_t>() != 0) {
        if (previews()) restore_committed(inner);
        decode(all_, inner);
        pending_.fill_(0);
      }
      use_next_layout();  // what arrived was decoded as it was sent; this step's in the new one
      if (previews()) save_committed(inner);
      encode(all_, grads, lr);
      launch(all_);
      pending_.fill_(1);
      if (previews()) preview(lr, inner);
      return;
    }
    // The tensors not started early go in one bucket; then every bucket, in the order started.
    if (buckets_.empty()) {
      encode(all_, grads, lr);
      launch(all_);
      decode(all_, inner);
      return;
    }
    std::vector<size_t> rest;
    std::vector<at::Tensor> rest_grads;
    for (size_t i = 0; i < plans_.size(); ++i) {
      if (!started_[i]) rest.push_back(i), rest_grads.push_back(grads[i]);
    }
    start(rest, rest_grads, lr);
    for (Bucket& b : buckets_) decode(b, inner);
    buckets_.clear();
    std::fill(started_.begin(), started_.end(), 0);
  }

  ExchangeTraffic traffic() const override { return traffic_; }
  NamedTensors state_tensors() const override {
    NamedTensors state = numbered("residual", residuals_);
    if (options_.overlap_step) {  // the exchange in flight is part of the state
      finish_in_flight();
      state.push_back({"pending", pending_});
      state.push_back({"pending_payloads", all_.recv});
      for (auto& t : numbered("committed", committed_)) state.push_back(t);
    }
    return state;
  }
  std::vector<at::Tensor> committed_params() const override { return committed_; }
  const at::Tensor& residual(size_t i) const override { return residuals_.at(i); }

 private:
  int replicas() const { return group_ ? group_->size() : 1; }

  // The payloads' sizes, the bucket of every tensor and (on a GPU) the kernels for options_'s
  // top-k and values.
  void use_layout(at::Device device) {
    payload_bytes_.clear();
    traffic_ = {};
    std::vector<size_t> all;
    for (size_t i = 0; i < plans_.size(); ++i) {
      const dct::ChunkPlan& plan = plans_[i];
      payload_bytes_.push_back(compress::wire_payload_bytes(plan, options_.topk, options_.values));
      traffic_.kept_coefficients += plan.num_chunks() * compress::clamp_topk(options_.topk, plan);
      traffic_.params += plan.numel();
      all.push_back(i);
    }
    all_ = make_bucket(all);
    traffic_.wire_bytes = all_.bytes;
    if (!device.is_cuda()) return;
    gpu_ = std::make_unique<kernels::GpuBucket>(plans_, options_.topk, options_.values, device);
    const auto bytes = at::dtype(at::kByte).device(device);
    device_send_ = at::empty({int64_t(all_.bytes)}, bytes);
    device_recv_ = at::empty({int64_t(all_.bytes) * replicas()}, bytes);
    all_.send = at::empty({int64_t(all_.bytes)}, at::dtype(at::kByte).pinned_memory(true));
    all_.recv =
        at::empty({int64_t(all_.bytes) * replicas()}, at::dtype(at::kByte).pinned_memory(true));
  }
  void use_next_layout() {
    if (!next_layout_) return;
    const auto [topk, values] = *next_layout_;
    next_layout_.reset();
    if (topk == options_.topk && values == options_.values) return;
    options_.topk = topk;
    options_.values = values;
    use_layout(device_);
  }

  Bucket make_bucket(const std::vector<size_t>& tensors) const {
    Bucket b;
    b.tensors = tensors;
    for (size_t i : tensors) {
      b.offsets.push_back(b.bytes);
      b.bytes += payload_bytes_[i];
    }
    b.send = at::empty({int64_t(b.bytes)}, at::kByte);
    b.recv = at::empty({int64_t(b.bytes) * replicas()}, at::kByte);
    return b;
  }

  // The bucket's all-gather, non-blocking (one replica: its payloads are the gathered ones).
  void launch(Bucket& b) {
    if (replicas() > 1) {
      b.work = group_->iall_gather(b.send, b.recv);
    } else {
      b.recv.copy_(b.send);
    }
  }

  // Encode on the GPU; the headers and checksums on the host; the all-gather over the replica
  // group's device (MPI: the pinned host buffers; NCCL: the device ones); every payload validated
  // on the host; decode and step on the GPU.
  void exchange_on_gpu(const std::vector<at::Tensor>& grads, double lr, InnerOptimizer& inner) {
    gpu_->encode(grads, residuals_, options_.decay, lr, device_send_);
    if (replicas() == 1) {  // nothing travels: decode this replica's own payloads where they are
      inner.apply_gpu(*gpu_, device_send_, 1);
      return;
    }
    all_.send.copy_(device_send_);  // waits for the kernel
    gpu_->seal(all_.send.data_ptr<uint8_t>());
    const bool on_device = group_->device().is_cuda();
    if (on_device) {
      device_send_.copy_(all_.send);
      group_->all_gather(device_send_, device_recv_);
      all_.recv.copy_(device_recv_);
    } else {
      group_->all_gather(all_.send, all_.recv);
    }
    gpu_->validate(all_.recv.data_ptr<uint8_t>(), replicas());
    if (!on_device) device_recv_.copy_(all_.recv, /*non_blocking=*/true);
    inner.apply_gpu(*gpu_, device_recv_, replicas());
  }

  // --overlap-step with sign-SGD previews this replica's own update (see exchange()).
  bool previews() const {
    return options_.overlap_step && options_.inner == InnerKind::SignSgd && options_.sign;
  }
  void save_committed(InnerOptimizer& inner) {
    for (size_t i = 0; i < plans_.size(); ++i) committed_[i].copy_(inner.param(i));
  }
  void restore_committed(InnerOptimizer& inner) {
    for (size_t i = 0; i < plans_.size(); ++i) inner.param(i).copy_(committed_[i]);
  }
  // The parameters step by -lr * sign(direction) of this replica's own payloads alone (no
  // weight decay: that comes with the committed update).
  void preview(double lr, InnerOptimizer& inner) {
    const uint8_t* own = all_.send.data_ptr<uint8_t>();
    for (size_t i = 0; i < plans_.size(); ++i) {
      at::Tensor param = inner.param(i);
      const at::Tensor d = direction(i, {own + all_.offsets[i]}, [&](const auto& coeffs) {
        if (param.scalar_type() != at::kFloat) return false;
        kernels::idct_sparse_sign_step(coeffs, plans_[i], {param, float(lr), 1.0f});
        return true;
      });
      if (d.defined()) param.sub_(d.sign(), lr);
    }
  }

  void finish_in_flight() const {
    if (all_.work) {
      all_.work->wait();
      all_.work.reset();
    }
  }

  // residual = decay * residual + lr * DCT(grad) (transform none: lr * grad, in the block layout
  // which is the samples' own)
  void accumulate_one(size_t i, const at::Tensor& grad, double lr) {
    const dct::ChunkPlan& plan = plans_[i];
    if (options_.fast_path && !gpu_) {
      kernels::dct_accumulate(grad, plan, options_.decay, lr, residuals_[i]);
    } else if (grad.defined() && options_.transform == Transform::None) {
      residuals_[i].mul_(options_.decay);
      residuals_[i]
          .narrow(0, 0, plan.rows)
          .narrow(1, 0, plan.cols)
          .add_(grad.reshape({plan.rows, plan.cols}).to(at::kFloat), lr);
    } else if (grad.defined()) {
      dct::chunked_dct_accumulate(grad, plans_[i], options_.decay, lr, residuals_[i], &scratch_);
    } else {
      residuals_[i].mul_(options_.decay);
    }
  }

  // Every tensor of the bucket: grads holds all tensors' gradients (replicator order).
  void encode(Bucket& b, const std::vector<at::Tensor>& grads, double lr) {
    for (size_t k = 0; k < b.tensors.size(); ++k) encode_one(b, k, grads[b.tensors[k]], lr);
  }

  // The bucket's k-th tensor: the residual update, top-k extraction with error feedback, its
  // payload into the send buffer. The fast path does the first two chunk by chunk in one pass.
  void encode_one(Bucket& b, size_t k, const at::Tensor& grad, double lr) {
    const size_t i = b.tensors[k];
    compress::TopK topk;
    if (options_.fast_path) {
      topk = kernels::dct_accumulate_topk(grad, plans_[i], options_.decay, lr, residuals_[i],
                                          options_.topk);
    } else {
      accumulate_one(i, grad, lr);
      topk = compress::select_topk_plain(residuals_[i], plans_[i], options_.topk);
    }
    compress::encode_payload(plans_[i], topk, options_.values,
                             b.send.data_ptr<uint8_t>() + b.offsets[k]);
    compress::add_selected(residuals_[i], plans_[i], topk, -1.0f);  // sent leaves the residual
  }

  // Completes the bucket's all-gather; the mean over replicas of its payloads (bit-identical
  // everywhere), inverse-transformed and applied by the inner optimizer tensor by tensor.
  void decode(Bucket& b, InnerOptimizer& inner) {
    if (b.work) {
      b.work->wait();
      b.work.reset();
    }
    const uint8_t* gathered = b.recv.data_ptr<uint8_t>();
    std::vector<const uint8_t*> payloads(replicas());
    for (size_t k = 0; k < b.tensors.size(); ++k) {
      for (int r = 0; r < replicas(); ++r) payloads[r] = gathered + r * b.bytes + b.offsets[k];
      const size_t i = b.tensors[k];
      const at::Tensor d = direction(i, payloads, [&](const compress::SparseChunks& coeffs) {
        return inner.apply_sparse(i, coeffs, plans_[i]);
      });
      if (d.defined()) inner.apply(i, d);
    }
  }

  // Tensor i's direction from its payloads (one per replica, rank order): float32 [rows,
  // cols]. On the fast path `fused` may apply its step straight from the sparse coefficients,
  // in the inverse's pass (the direction never goes through memory): when it does (returns
  // true) an undefined tensor is returned.
  at::Tensor direction(size_t i, const std::vector<const uint8_t*>& payloads,
                       const std::function<bool(const compress::SparseChunks&)>& fused) {
    const dct::ChunkPlan& plan = plans_[i];
    const at::Tensor samples = samples_.narrow(0, 0, plan.padded_numel());
    if (options_.fast_path) {  // per chunk, only the coefficients received
      const compress::SparseChunks coeffs = compress::decode_mean_sparse(
          payloads, payload_bytes_[i], plan, options_.topk, options_.values);
      if (fused && fused(coeffs)) return {};
      kernels::idct_sparse(coeffs, plan, samples);
    } else {
      const at::Tensor decoded = decoded_.narrow(0, 0, plan.padded_numel());
      compress::decode_mean(payloads, payload_bytes_[i], plan, options_.topk, options_.values,
                            decoded);
      if (options_.transform == Transform::None) {
        samples.copy_(decoded);
      } else {
        dct::chunked_idct_into(decoded, plan, samples, &scratch_);
      }
    }
    at::Tensor d = samples.view({plan.padded_rows, plan.padded_cols});
    return plan.is_padded() ? d.narrow(0, 0, plan.rows).narrow(1, 0, plan.cols) : d;
  }

  std::vector<dct::ChunkPlan> plans_;
  OptimizerOptions options_;
  std::shared_ptr<comm::Communicator> group_;
  at::Device device_;                  // of the state
  std::vector<at::Tensor> residuals_;  // per tensor: float32 block-layout DCT coefficients
  std::vector<size_t> payload_bytes_;  // per tensor
  ExchangeTraffic traffic_;
  mutable Bucket all_;  // every tensor (its buffers are kept from step to step)
  // This step's buckets started early (start()), in order, and which tensors they hold.
  std::vector<Bucket> buckets_;
  std::vector<char> started_;
  // set_layout's top-k and values, until the payloads in flight have been decoded.
  std::optional<std::pair<int64_t, compress::ValueEncoding>> next_layout_;
  at::Tensor decoded_;  // float32 scratch buffers as large as the largest padded tensor (the
  at::Tensor samples_;  // first two on CPUs only), so that a step allocates nothing big
  at::Tensor scratch_;
  // --overlap-step: all_ is in flight from one step to the next; pending_: whether all_.recv
  // holds payloads not yet applied (a tensor, so that checkpoints carry it).
  std::vector<at::Tensor> committed_;  // the parameters without the preview (float32)
  at::Tensor pending_ = at::zeros({1}, at::kLong);
  // On a GPU: the kernels, and the bucket's payloads on the device (all_'s are pinned host).
  std::unique_ptr<kernels::GpuBucket> gpu_;
  at::Tensor device_send_, device_recv_;
};

}  // namespace

std::unique_ptr<Replicator> make_demo_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                 const OptimizerOptions& options,
                                                 std::shared_ptr<comm::Communicator> group,
                                                 at::Device device) {
  return std::make_unique<DemoReplicator>(plans, options, std::move(group), device);
}

}  // namespace flexdemo::optim
