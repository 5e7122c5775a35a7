// The DeMo step on a CPU, two ways behind backend.h: "plain", the reference (whole-tensor DCTs
// as matrix products, top-k by a heap, a dense decode, every update applied by the inner
// optimizer), and "cpu", the fast path (kernels.h: the DCT fused with the residual update and
// top-k chunk by chunk, the sparse inverse fused with the SGD or AdamW update). Both write
// and read payloads through compress.h's wire format, so their bytes are the same.
#include "backend.h"
#include "screen.h"

#include "flexdemo/compress.h"
#include "flexdemo/dct.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <utility>

namespace flexdemo::demo {
namespace {

// What the two share: the buffers, the residuals, the payloads' encoding and validation.
class HostBackend : public Backend {
 public:
  HostBackend(const std::vector<dct::ChunkPlan>& plans, const BackendOptions& options,
              const std::vector<at::Tensor>& residuals)
      : plans_(plans), options_(options), residuals_(residuals) {
    int64_t largest = 1;
    for (const dct::ChunkPlan& plan : plans) largest = std::max(largest, plan.padded_numel());
    scratch_ = at::empty({largest}, at::kFloat);
    samples_ = at::empty({largest}, at::kFloat);
  }

  at::Tensor buffer(int64_t bytes) const override { return at::empty({bytes}, at::kByte); }

  std::vector<optim::PeerFault> screen(const Bucket& b, const at::Tensor& gathered, int replicas,
                                       double scale_bound) const override {
    return screen_on_host(plans_, b, gathered, replicas, scale_bound);
  }

  void encode(Bucket& b, const std::vector<at::Tensor>& grads, double lr) override {
    for (size_t k = 0; k < b.tensors.size(); ++k) {
      encode_one(b.tensors[k], grads[k], lr, b.topk, b.values,
                 b.send.data_ptr<uint8_t>() + b.offsets[k]);
    }
  }

  void decode(const Bucket& b, const at::Tensor& gathered, int replicas,
              const Updates& updates) override {
    const uint8_t* bytes = gathered.data_ptr<uint8_t>();
    std::vector<const uint8_t*> payloads(static_cast<size_t>(replicas));
    for (size_t k = 0; k < b.tensors.size(); ++k) {
      for (int r = 0; r < replicas; ++r) payloads[r] = bytes + r * b.bytes + b.offsets[k];
      const size_t i = b.tensors[k];
      const dct::ChunkPlan& plan = plans_[i];
      const at::Tensor samples = samples_.narrow(0, 0, plan.padded_numel());
      const size_t size = compress::wire_payload_bytes(plan, b.topk, b.values);
      if (!decode_one(i, payloads, size, b, samples, updates.fused.at(i))) continue;
      at::Tensor d = samples.view({plan.padded_rows, plan.padded_cols});
      updates.apply(i, plan.is_padded() ? d.narrow(0, 0, plan.rows).narrow(1, 0, plan.cols) : d);
    }
  }

 protected:
  // Tensor i's residual update, its top-k, its payload to dst, and what a receiver decodes from
  // it taken out of the residual (error feedback).
  virtual void encode_one(size_t i, const at::Tensor& grad, double lr, int64_t topk,
                          compress::ValueEncoding values, uint8_t* dst) = 0;
  // Tensor i's direction from its payloads: applied as `update` (then false), or written into
  // samples (block layout) for the inner optimizer (then true).
  virtual bool decode_one(size_t i, const std::vector<const uint8_t*>& payloads, size_t size,
                          const Bucket& b, const at::Tensor& samples,
                          const std::optional<Update>& update) = 0;

  std::vector<dct::ChunkPlan> plans_;
  BackendOptions options_;
  std::vector<at::Tensor> residuals_;  // handles: the replicator's tensors
  at::Tensor scratch_, samples_;       // float32, as large as the largest padded tensor
};

// ====== plain ======
class PlainBackend final : public HostBackend {
 public:
  PlainBackend(const std::vector<dct::ChunkPlan>& plans, const BackendOptions& options,
               const std::vector<at::Tensor>& residuals)
      : HostBackend(plans, options, residuals), decoded_(at::empty_like(samples_)) {}

  // residual = decay * residual + lr * DCT(grad); transform none: lr * grad, in the block layout
  // which is the samples' own.
  void accumulate(size_t i, const at::Tensor& grad, double lr) override {
    const dct::ChunkPlan& plan = plans_[i];
    at::Tensor& residual = residuals_[i];
    if (!grad.defined()) {
      residual.mul_(options_.decay);
    } else if (!options_.dct) {
      residual.mul_(options_.decay);
      residual.narrow(0, 0, plan.rows)
          .narrow(1, 0, plan.cols)
          .add_(grad.reshape({plan.rows, plan.cols}).to(at::kFloat), lr);
    } else {
      dct::chunked_dct_accumulate(grad, plan, options_.decay, lr, residual, &scratch_);
    }
  }

 protected:
  void encode_one(size_t i, const at::Tensor& grad, double lr, int64_t topk,
                  compress::ValueEncoding values, uint8_t* dst) override {
    accumulate(i, grad, lr);
    compress::TopK selected = compress::select_topk_plain(residuals_[i], plans_[i], topk);
    compress::encode_payload(plans_[i], selected, values, dst);
    compress::add_selected(residuals_[i], plans_[i], selected, -1.0f);  // sent leaves it
  }

  bool decode_one(size_t i, const std::vector<const uint8_t*>& payloads, size_t size,
                  const Bucket& b, const at::Tensor& samples,
                  const std::optional<Update>&) override {
    const dct::ChunkPlan& plan = plans_[i];
    const at::Tensor decoded = decoded_.narrow(0, 0, plan.padded_numel());
    compress::decode_mean(payloads, size, plan, b.topk, b.values, decoded);
    if (!options_.dct) {
      samples.copy_(decoded);
    } else {
      dct::chunked_idct_into(decoded, plan, samples, &scratch_);
    }
    return true;  // the reference: every update by the inner optimizer
  }

 private:
  at::Tensor decoded_;
};

// ====== cpu: the fused kernels ======
// A direction's sum of squares over the tensor, from its coefficients: the chunked DCT is
// orthonormal, so it is that of its coefficients (float64). Unpadded chunks only: a padded
// chunk's inverse has values outside the tensor.
double coefficient_squares(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan) {
  if (plan.is_padded()) throw std::logic_error("the RMS cap is fused for unpadded chunks only");
  const int64_t capacity = coeffs.positions.size(1);
  const float* values = coeffs.values.data_ptr<float>();
  const int64_t* counts = coeffs.counts.data_ptr<int64_t>();
  double sum = 0.0;
  for (int64_t c = 0; c < plan.num_chunks(); ++c) {
    for (int64_t e = c * capacity; e < c * capacity + counts[c]; ++e) {
      sum += double(values[e]) * double(values[e]);
    }
  }
  return sum;
}

class CpuBackend final : public HostBackend {
 public:
  CpuBackend(const std::vector<dct::ChunkPlan>& plans, const BackendOptions& options,
             const std::vector<at::Tensor>& residuals)
      : HostBackend(plans, options, residuals), preconditioning_(plans.size()) {}

  // The preconditioner in the transform's read of each chunk: the scaled gradient is never
  // written (a pass over memory less, and its divisions overlap the transform's arithmetic).
  bool precondition_as_read(size_t i, const kernels::Preconditioning& p) override {
    preconditioning_.at(i) = p;
    return true;
  }

  void accumulate(size_t i, const at::Tensor& grad, double lr) override {
    const std::optional<kernels::Preconditioning> pre = taken_preconditioning(i, grad);
    kernels::dct_accumulate(grad, plans_[i], options_.decay, lr, residuals_[i],
                            pre ? &*pre : nullptr);
  }

 protected:
  // Chunk by chunk: the transform, the top-k, the payload's share and the error feedback while
  // the chunk is in cache.
  void encode_one(size_t i, const at::Tensor& grad, double lr, int64_t topk,
                  compress::ValueEncoding values, uint8_t* dst) override {
    const std::optional<kernels::Preconditioning> pre = taken_preconditioning(i, grad);
    kernels::dct_accumulate_encode(grad, plans_[i], options_.decay, lr, residuals_[i], topk, values,
                                   dst, pre ? &*pre : nullptr);
  }

  // Per chunk, only the coefficients received; the update fused into their inverse, so the
  // direction never goes through memory.
  bool decode_one(size_t i, const std::vector<const uint8_t*>& payloads, size_t /*size*/,
                  const Bucket& b, const at::Tensor& samples,
                  const std::optional<Update>& update) override {
    const dct::ChunkPlan& plan = plans_[i];
    const compress::SparseChunks coeffs = mean_of_screened(payloads, plan, b.topk, b.values);
    if (!update) {
      kernels::idct_sparse(coeffs, plan, samples);
      return true;
    }
    const kernels::AdamWHyper& h = update->hyper;
    if (update->rule == Update::Rule::Sgd) {
      // The direction times s steps as the direction does with the rate times s and the bound
      // over s.
      auto step = [coeffs, plan, param = update->param, h](double s) {
        kernels::idct_sparse_sgd_step(coeffs, plan,
                                      {param, float(h.lr * s), float(1.0 - h.lr * h.weight_decay),
                                       h.sign, float(h.step_bound / s)});
      };
      if (update->measured) {
        update->measured(coefficient_squares(coeffs, plan), step);
      } else {
        step(1.0);
      }
    } else {
      kernels::AdamWStep step;
      static_cast<kernels::AdamWHyper&>(step) = h;
      step.param = update->param;
      step.exp_avg = update->exp_avg;
      step.exp_avg_sq = update->exp_avg_sq;
      kernels::idct_sparse_adamw_step(coeffs, plan, step);
    }
    return false;
  }

 private:
  // Tensor i's preconditioning offered for this gradient, taken once. Offers come with
  // gradients only (a missing one's mean square decays where it is missing); one left over by a
  // step that failed before its encode is dropped here, never applied to a missing gradient.
  std::optional<kernels::Preconditioning> taken_preconditioning(size_t i, const at::Tensor& grad) {
    std::optional<kernels::Preconditioning> p = std::exchange(preconditioning_.at(i), std::nullopt);
    return grad.defined() ? p : std::nullopt;
  }

  std::vector<std::optional<kernels::Preconditioning>> preconditioning_;
};

}  // namespace

std::vector<optim::PeerFault> screen_on_host(const std::vector<dct::ChunkPlan>& plans,
                                             const Bucket& b, const at::Tensor& gathered,
                                             int replicas, double scale_bound) {
  const at::Tensor host = gathered.is_cpu() ? gathered : gathered.to(at::kCPU);
  std::vector<dct::ChunkPlan> bucket_plans;
  for (size_t i : b.tensors) bucket_plans.push_back(plans[i]);
  return screen_payloads(host.data_ptr<uint8_t>(), replicas, b.bytes, bucket_plans, b.offsets,
                         b.topk, b.values, scale_bound);
}

std::unique_ptr<Backend> make_plain_backend(const std::vector<dct::ChunkPlan>& plans,
                                            const BackendOptions& options,
                                            const std::vector<at::Tensor>& residuals) {
  return std::make_unique<PlainBackend>(plans, options, residuals);
}

std::unique_ptr<Backend> make_cpu_backend(const std::vector<dct::ChunkPlan>& plans,
                                          const BackendOptions& options,
                                          const std::vector<at::Tensor>& residuals) {
  return std::make_unique<CpuBackend>(plans, options, residuals);
}

std::unique_ptr<Backend> make_backend(const std::vector<dct::ChunkPlan>& plans,
                                      const BackendOptions& options,
                                      const std::vector<at::Tensor>& residuals, at::Device device,
                                      at::Device replica_device) {
  if (device.is_cuda()) return make_cuda_backend(plans, options, residuals, device, replica_device);
  if (options.fast_path && options.dct) return make_cpu_backend(plans, options, residuals);
  return make_plain_backend(plans, options, residuals);
}

}  // namespace flexdemo::demo
