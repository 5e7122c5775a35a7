// The DeMo replicator (DESIGN.md §1): residual momentum kept in the DCT domain, per-chunk top-k
// with error feedback, every tensor's payload in ONE all-gather, deterministic decode, inverse DCT.
#include "replicator.h"

#include "flexdemo/comm.h"

#include <ATen/ATen.h>

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
    decoded_ = at::empty({largest}, at::kFloat);
    samples_ = at::empty({largest}, at::kFloat);
    scratch_ = at::empty({largest}, at::kFloat);
  }

  void accumulate(const std::vector<at::Tensor>& grads, double lr) override {
    for (size_t i = 0; i < plans_.size(); ++i) {
      if (grads[i].defined()) {
        dct::chunked_dct_accumulate(grads[i], plans_[i], options_.decay, lr, residuals_[i],
                                    &scratch_);
      } else {
        residuals_[i].mul_(options_.decay);
      }
    }
  }

  void exchange(const std::vector<at::Tensor>& grads, double lr,
                const DirectionSink& sink) override {
    accumulate(grads, lr);
    // Top-k extraction with error feedback, every tensor into the one bucket.
    uint8_t* send = send_bucket_.data_ptr<uint8_t>();
    for (size_t i = 0; i < plans_.size(); ++i) {
      compress::TopK topk = compress::select_topk(residuals_[i], plans_[i], options_.topk);
      compress::encode_payload(plans_[i], topk, options_.values, send + payload_offsets_[i]);
      compress::add_selected(residuals_[i], plans_[i], topk, -1.0f);  // sent leaves the residual
    }
    const uint8_t* gathered = send;
    if (replicas() > 1) {
      group_->all_gather(send_bucket_, recv_bucket_);
      gathered = recv_bucket_.data_ptr<uint8_t>();
    }
    // Decode (the mean over replicas, bit-identical everywhere) and inverse-transform.
    const size_t bucket = traffic_.wire_bytes;
    std::vector<const uint8_t*> payloads(replicas());
    for (size_t i = 0; i < plans_.size(); ++i) {
      const dct::ChunkPlan& plan = plans_[i];
      for (int r = 0; r < replicas(); ++r) {
        payloads[r] = gathered + r * bucket + payload_offsets_[i];
      }
      const at::Tensor decoded = decoded_.narrow(0, 0, plan.padded_numel());
      compress::decode_mean(payloads, payload_bytes_[i], plan, options_.topk, options_.values,
                            decoded);
      const at::Tensor samples = samples_.narrow(0, 0, plan.padded_numel());
      dct::chunked_idct_into(decoded, plan, samples, &scratch_);
      at::Tensor direction = samples.view({plan.padded_rows, plan.padded_cols});
      if (plan.is_padded()) direction = direction.narrow(0, 0, plan.rows).narrow(1, 0, plan.cols);
      sink(i, direction);
    }
  }

  DemoTraffic traffic() const override { return traffic_; }
  NamedTensors state_tensors() const override { return numbered("residual", residuals_); }
  const at::Tensor& residual(size_t i) const override { return residuals_.at(i); }

 private:
  int replicas() const { return group_ ? group_->size() : 1; }

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
};

}  // namespace

std::unique_ptr<Replicator> make_demo_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                 const DemoOptions& options,
                                                 std::shared_ptr<comm::Communicator> group) {
  return std::make_unique<DemoReplicator>(plans, options, std::move(group));
}

}  // namespace flexdemo::optim
