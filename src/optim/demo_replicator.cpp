// The DeMo replicator (DESIGN.md §1): residual momentum kept in the DCT domain, per-chunk top-k
// with error feedback, every tensor's payload in ONE all-gather, deterministic decode, inverse DCT.
// With overlap_step the all-gather is non-blocking and its result is applied one step later.
#include "inner.h"
#include "replicator.h"

#include "flexdemo/comm.h"
#include "flexdemo/kernels.h"

#include <ATen/ATen.h>

#include <optional>
#include <stdexcept>

namespace flexdemo::optim {

const at::Tensor& Replicator::residual(size_t) const {
  throw std::logic_error("this replicator keeps no residual");
}

namespace {

class DemoReplicator final : public Replicator {
 public:
  DemoReplicator(const std::vector<dct::ChunkPlan>& plans, const DemoOptions& options,
                 std::shared_ptr<comm::Communicator> group)
      : plans_(plans), options_(options), group_(std::move(group)) {
    size_t offset = 0;
    int64_t largest = 1;
    for (const dct::ChunkPlan& plan : plans_) {
      const size_t bytes = compress::wire_payload_bytes(plan, options.topk, options.values);
      residuals_.push_back(at::zeros({plan.padded_rows, plan.padded_cols}, at::kFloat));
      payload_offsets_.push_back(offset);
      payload_bytes_.push_back(bytes);
      offset += bytes;
      largest = std::max(largest, plan.padded_numel());
      traffic_.kept_coefficients += plan.num_chunks() * compress::clamp_topk(options.topk, plan);
      traffic_.params += plan.numel();
    }
    traffic_.wire_bytes = offset;
    send_bucket_ = at::empty({int64_t(offset)}, at::kByte);
    recv_bucket_ = at::empty({int64_t(offset) * replicas()}, at::kByte);
    if (previews()) {
      for (const dct::ChunkPlan& plan : plans_) {
        committed_.push_back(at::empty({plan.rows, plan.cols}, at::kFloat));
      }
    }
    decoded_ = at::empty({largest}, at::kFloat);
    samples_ = at::empty({largest}, at::kFloat);
    scratch_ = at::empty({largest}, at::kFloat);
  }

  void accumulate(const std::vector<at::Tensor>& grads, double lr) override {
    for (size_t i = 0; i < plans_.size(); ++i) accumulate_one(i, grads[i], lr);
  }

  void exchange(const std::vector<at::Tensor>& grads, double lr, InnerOptimizer& inner) override {
    if (options_.overlap_step) {
      // One step stale: apply what the previous step's exchange brought (it travelled during
      // this step's forward and backward) to the committed parameters, then start this step's.
      // Until it arrives, the parameters also carry this replica's own part of it (a preview),
      // so the next gradient is not taken a whole update behind.
      finish_in_flight();
      if (pending_.item<int64_t>() != 0) {
        if (previews()) restore_committed(inner);
        decode(recv_bucket_.data_ptr<uint8_t>(), inner);
      }
      if (previews()) save_committed(inner);
      encode(grads, lr);
      if (replicas() > 1) {
        in_flight_ = group_->iall_gather(send_bucket_, recv_bucket_);
      } else {
        recv_bucket_.copy_(send_bucket_);
      }
      pending_.fill_(1);
      if (previews()) preview(lr, inner);
      return;
    }
    encode(grads, lr);
    const uint8_t* gathered = send_bucket_.data_ptr<uint8_t>();
    if (replicas() > 1) {
      group_->all_gather(send_bucket_, recv_bucket_);
      gathered = recv_bucket_.data_ptr<uint8_t>();
    }
    decode(gathered, inner);
  }

  DemoTraffic traffic() const override { return traffic_; }
  NamedTensors state_tensors() const override {
    NamedTensors state = numbered("residual", residuals_);
    if (options_.overlap_step) {  // the exchange in flight is part of the state
      finish_in_flight();
      state.push_back({"pending", pending_});
      state.push_back({"pending_payloads", recv_bucket_});
      for (auto& t : numbered("committed", committed_)) state.push_back(t);
    }
    return state;
  }
  std::vector<at::Tensor> committed_params() const override { return committed_; }
  const at::Tensor& residual(size_t i) const override { return residuals_.at(i); }

 private:
  int replicas() const { return group_ ? group_->size() : 1; }

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
    const uint8_t* own = send_bucket_.data_ptr<uint8_t>();
    for (size_t i = 0; i < plans_.size(); ++i) {
      at::Tensor param = inner.param(i);
      std::optional<kernels::SignStep> step;
      if (param.scalar_type() == at::kFloat) step = kernels::SignStep{param, float(lr), 1.0f};
      const at::Tensor d = direction(i, {own + payload_offsets_[i]}, step);
      if (d.defined()) param.sub_(d.sign(), lr);
    }
  }

  void finish_in_flight() const {
    if (in_flight_) {
      in_flight_->wait();
      in_flight_.reset();
    }
  }

  // residual = decay * residual + lr * DCT(grad)
  void accumulate_one(size_t i, const at::Tensor& grad, double lr) {
    if (options_.fast_path) {
      kernels::dct_accumulate(grad, plans_[i], options_.decay, lr, residuals_[i]);
    } else if (grad.defined()) {
      dct::chunked_dct_accumulate(grad, plans_[i], options_.decay, lr, residuals_[i], &scratch_);
    } else {
      residuals_[i].mul_(options_.decay);
    }
  }

  // The residual update, top-k extraction with error feedback, every tensor's payload into the
  // one send bucket. The fast path does the first two chunk by chunk in one pass.
  void encode(const std::vector<at::Tensor>& grads, double lr) {
    uint8_t* send = send_bucket_.data_ptr<uint8_t>();
    for (size_t i = 0; i < plans_.size(); ++i) {
      compress::TopK topk;
      if (options_.fast_path) {
        topk = kernels::dct_accumulate_topk(grads[i], plans_[i], options_.decay, lr, residuals_[i],
                                            options_.topk);
      } else {
        accumulate_one(i, grads[i], lr);
        topk = compress::select_topk_plain(residuals_[i], plans_[i], options_.topk);
      }
      compress::encode_payload(plans_[i], topk, options_.values, send + payload_offsets_[i]);
      compress::add_selected(residuals_[i], plans_[i], topk, -1.0f);  // sent leaves the residual
    }
  }

  // The mean over replicas of the gathered payloads (bit-identical everywhere), inverse-
  // transformed and applied by the inner optimizer tensor by tensor.
  void decode(const uint8_t* gathered, InnerOptimizer& inner) {
    const size_t bucket = traffic_.wire_bytes;
    std::vector<const uint8_t*> payloads(replicas());
    for (size_t i = 0; i < plans_.size(); ++i) {
      for (int r = 0; r < replicas(); ++r) {
        payloads[r] = gathered + r * bucket + payload_offsets_[i];
      }
      const at::Tensor d = direction(i, payloads, inner.sign_step(i));
      if (d.defined()) inner.apply(i, d);
    }
  }

  // Tensor i's direction from its payloads (one per replica, rank order): float32 [rows,
  // cols]. On the fast path, given a sign step, that step is applied instead in the inverse's
  // pass (the direction never goes through memory) and an undefined tensor is returned.
  at::Tensor direction(size_t i, const std::vector<const uint8_t*>& payloads,
                       const std::optional<kernels::SignStep>& step) {
    const dct::ChunkPlan& plan = plans_[i];
    const at::Tensor samples = samples_.narrow(0, 0, plan.padded_numel());
    if (options_.fast_path) {  // per chunk, only the coefficients received
      const compress::SparseChunks coeffs = compress::decode_mean_sparse(
          payloads, payload_bytes_[i], plan, options_.topk, options_.values);
      if (step) {
        kernels::idct_sparse_sign_step(coeffs, plan, *step);
        return {};
      }
      kernels::idct_sparse(coeffs, plan, samples);
    } else {
      const at::Tensor decoded = decoded_.narrow(0, 0, plan.padded_numel());
      compress::decode_mean(payloads, payload_bytes_[i], plan, options_.topk, options_.values,
                            decoded);
      dct::chunked_idct_into(decoded, plan, samples, &scratch_);
    }
    at::Tensor d = samples.view({plan.padded_rows, plan.padded_cols});
    return plan.is_padded() ? d.narrow(0, 0, plan.rows).narrow(1, 0, plan.cols) : d;
  }

  std::vector<dct::ChunkPlan> plans_;
  DemoOptions options_;
  std::shared_ptr<comm::Communicator> group_;
  std::vector<at::Tensor> residuals_;    // per tensor: float32 block-layout DCT coefficients
  std::vector<size_t> payload_offsets_;  // per tensor: where its payload sits in the bucket
  std::vector<size_t> payload_bytes_;
  DemoTraffic traffic_;
  at::Tensor send_bucket_;  // uint8 [bucket bytes]: this replica's payloads back to back
  at::Tensor recv_bucket_;  // uint8 [replicas * bucket bytes], rank order
  at::Tensor decoded_;      // float32 scratch buffers as large as the largest padded tensor,
  at::Tensor samples_;      // so that a step allocates nothing big
  at::Tensor scratch_;
  // --overlap-step: the exchange started last step, and whether recv_bucket_ holds payloads
  // not yet applied (a tensor, so that checkpoints carry it).
  mutable std::unique_ptr<comm::Work> in_flight_;
  std::vector<at::Tensor> committed_;  // the parameters without the preview (float32)
  at::Tensor pending_ = at::zeros({1}, at::kLong);
};

}  // namespace

std::unique_ptr<Replicator> make_demo_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                 const DemoOptions& options,
                                                 std::shared_ptr<comm::Communicator> group) {
  return std::make_unique<DemoReplicator>(plans, options, std::move(group));
}

}  // namespace flexdemo::optim
