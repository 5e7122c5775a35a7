// The DeMo exchange (docs/algorithm.md): the residual momentum in the DCT domain, one per tensor,
// and the plan of buckets a step's payloads travel in, one all-gather each: by default one bucket
// of every tensor per step; tensors whose gradients are final early (start()) go in their own
// buckets, started at once. With overlap_step the all-gather is non-blocking and its result is
// applied one step later. Encoding and decoding are the backend's (backend.h: plain, cpu or
// cuda), which the replicator calls without knowing the device. The payloads' top-k and values
// may change between steps (set_layout); an exchange in flight completes as it was sent. Every
// replica's payloads are checked before they are decoded (screen): a peer whose payload is
// corrupt, non-finite or out of scale stops the run or is left out of the mean (PeerPolicy).
#include "demo_exchange.h"
#include "replicator.h"
#include "step_rule.h"

#include "demo/screen.h"

#include "flexdemo/comm.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <utility>

namespace flexdemo::optim {
namespace {

class DemoReplicator final : public optim::Replicator {
 public:
  DemoReplicator(const std::vector<dct::ChunkPlan>& plans, const optim::OptimizerOptions& options,
                 std::shared_ptr<comm::Communicator> group, at::Device device)
      : plans_(plans), options_(options), group_(std::move(group)), started_(plans.size(), 0) {
    if (options.transform == optim::Transform::None) options_.fast_path = false;  // DCT kernels
    for (const dct::ChunkPlan& plan : plans_) {
      residuals_.push_back(
          at::zeros({plan.padded_rows, plan.padded_cols}, at::dtype(at::kFloat).device(device)));
    }
    if (options_.overlap_step && device.is_cuda()) {
      throw std::invalid_argument("DeMo: overlap_step runs on CPUs only");
    }
    backend_ = make_backend(plans_, backend_options(options_), residuals_, device,
                            group_ ? group_->device() : at::Device(at::kCPU));
    one_bucket_ = !backend_->partial_buckets() || options_.overlap_step;
    use_layout();
    if (previews()) {
      for (const dct::ChunkPlan& plan : plans_) {
        committed_.push_back(at::empty({plan.rows, plan.cols}, at::kFloat));
      }
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

  // Not with one bucket (overlap_step): start() encodes nothing then, and a gradient held until
  // exchange() is safer copied (preconditioned) at once; that mode's exchanges and folded steps
  // forgo the fusion with it (the offer does not say who makes it).
  bool precondition_as_read(size_t i, const kernels::Preconditioning& p) override {
    return !one_bucket_ && backend_->precondition_as_read(i, p);
  }

  void accumulate(const std::vector<at::Tensor>& grads, double lr) override {
    for (size_t i = 0; i < plans_.size(); ++i) backend_->accumulate(i, grads[i], lr);
  }

  void start(const std::vector<size_t>& tensors, const std::vector<at::Tensor>& grads,
             double lr) override {
    if (one_bucket_) return;  // everything goes in the one bucket
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
    backend_->encode(b, grads, lr);
    launch(b);
  }

  void exchange(const std::vector<at::Tensor>& grads, double lr, StepRule& inner) override {
    if (options_.overlap_step) {
      exchange_overlapped(grads, lr, inner);
      return;
    }
    // The tensors not started early go in one bucket; then every bucket, in the order started.
    if (buckets_.empty()) {
      backend_->encode(all_, grads, lr);
      launch(all_);
      tamper_.reset();
      decode(all_, inner);
      return;
    }
    std::vector<size_t> rest;
    std::vector<at::Tensor> rest_grads;
    for (size_t i = 0; i < plans_.size(); ++i) {
      if (!started_[i]) rest.push_back(i), rest_grads.push_back(grads[i]);
    }
    start(rest, rest_grads, lr);
    tamper_.reset();
    for (Bucket& b : buckets_) decode(b, inner);
    buckets_.clear();
    std::fill(started_.begin(), started_.end(), 0);
  }

  std::vector<optim::PeerFault> take_peer_faults() override {
    return std::exchange(peer_faults_, {});
  }
  void tamper_next_exchange(compress::Tamper how, double factor) override {
    tamper_ = {how, factor};
  }

  optim::ExchangeTraffic traffic() const override { return traffic_; }
  NamedTensors state_tensors() const override {
    NamedTensors state = optim::numbered("residual", residuals_);
    if (options_.overlap_step) {  // the exchange in flight is part of the state
      finish_in_flight();
      state.push_back({"pending", pending_});
      state.push_back({"pending_payloads", all_.recv});
      for (auto& t : optim::numbered("committed", committed_)) state.push_back(t);
    }
    return state;
  }
  std::vector<at::Tensor> committed_params() const override { return committed_; }
  const at::Tensor& residual(size_t i) const override { return residuals_.at(i); }

 private:
  int replicas() const { return group_ ? group_->size() : 1; }

  // One step stale: apply what the previous step's exchange brought (it travelled during this
  // step's forward and backward) to the committed parameters, then start this step's. Until it
  // arrives, the parameters also carry this replica's own part of it (a preview), so the next
  // gradient is not taken a whole update behind.
  void exchange_overlapped(const std::vector<at::Tensor>& grads, double lr, StepRule& inner) {
    finish_in_flight();
    if (pending_.item<int64_t>() != 0) {
      if (previews()) restore_committed(inner);
      decode(all_, inner);
      inner.settle();  // before the committed parameters are saved
      pending_.fill_(0);
    }
    use_next_layout();  // what arrived was decoded as it was sent; this step's in the new one
    if (previews()) save_committed(inner);
    backend_->encode(all_, grads, lr);
    const bool tampered = tamper_.has_value();
    launch(all_);
    tamper_.reset();
    pending_.fill_(1);
    // The preview decodes this replica's own payloads unscreened: a test aid's tampered ones
    // (tamper_next_exchange) only if they pass a receiver's checks of one payload.
    // (A preview waiting for its tensors' whole RMS lands at the step's settle(), next.)
    if (previews() && (!tampered || whole(all_.send, all_))) preview(inner.hyper().lr, inner);
  }

  // The payloads' sizes for options_'s top-k and values, and the bucket of every tensor.
  void use_layout() {
    traffic_ = {};
    std::vector<size_t> all;
    for (size_t i = 0; i < plans_.size(); ++i) {
      const dct::ChunkPlan& plan = plans_[i];
      traffic_.kept_coefficients += plan.num_chunks() * compress::clamp_topk(options_.topk, plan);
      traffic_.params += plan.numel();
      all.push_back(i);
    }
    all_ = make_bucket(all);
    traffic_.wire_bytes = all_.bytes;
  }
  void use_next_layout() {
    if (!next_layout_) return;
    const auto [topk, values] = *next_layout_;
    next_layout_.reset();
    if (topk == options_.topk && values == options_.values) return;
    options_.topk = topk;
    options_.values = values;
    use_layout();
  }

  Bucket make_bucket(const std::vector<size_t>& tensors) const {
    Bucket b;
    b.tensors = tensors;
    b.topk = options_.topk;
    b.values = options_.values;
    for (size_t i : tensors) {
      b.offsets.push_back(b.bytes);
      b.bytes += compress::wire_payload_bytes(plans_[i], b.topk, b.values);
    }
    b.send = backend_->buffer(int64_t(b.bytes));
    b.recv = backend_->buffer(int64_t(b.bytes) * replicas());
    return b;
  }

  // The bucket's all-gather, non-blocking (one replica: its payloads are the gathered ones).
  void launch(Bucket& b) {
    if (tamper_) tamper(b);
    if (replicas() > 1) {
      b.work = group_->iall_gather(b.send, b.recv);
    } else {
      b.recv.copy_(b.send);
    }
  }
  void finish_in_flight() const {
    if (all_.work) {
      all_.work->wait();
      all_.work.reset();
    }
  }

  // Completes the bucket's all-gather; its mean over the replicas (bit-identical everywhere),
  // inverse-transformed and applied: fused into the decode where the inner optimizer's update
  // has a fused form, by the inner optimizer otherwise.
  void decode(Bucket& b, StepRule& inner) {
    if (b.work) {
      b.work->wait();
      b.work.reset();
    }
    Updates updates;
    for (size_t i = 0; i < plans_.size(); ++i) updates.fused.push_back(inner.fused_update(i));
    updates.apply = [&inner](size_t i, const at::Tensor& d) { inner.apply(i, d); };
    const std::vector<int> kept =
        passing_replicas(*backend_, b, b.recv, replicas(), options_, peer_faults_);
    decode_passing(*backend_, b, b.recv, replicas(), kept, updates);
  }

  // Whether this replica's payloads of bucket b in `bytes` (on the host) pass the checks a
  // receiver makes of each payload alone (the wire format, finite values): the screening's.
  bool whole(const at::Tensor& bytes, const Bucket& b) const {
    std::vector<dct::ChunkPlan> bucket_plans;
    for (size_t i : b.tensors) bucket_plans.push_back(plans_[i]);
    return demo::screen_payloads(bytes.data_ptr<uint8_t>(), 1, b.bytes, bucket_plans, b.offsets,
                                 b.topk, b.values, 0.0)
        .empty();
  }

  // The test aid: this replica's payloads in the bucket, tampered before they are sent.
  void tamper(Bucket& b) {
    at::Tensor host = b.send.is_cpu() ? b.send : b.send.to(at::kCPU);
    for (size_t k = 0; k < b.tensors.size(); ++k) {
      compress::tamper_payload(host.data_ptr<uint8_t>() + b.offsets[k], plans_[b.tensors[k]],
                               b.topk, b.values, tamper_->first, tamper_->second);
    }
    if (!b.send.is_cpu()) b.send.copy_(host);
  }

  // --overlap-step with the SGD rule (sign-SGD or the adaptive step) previews this replica's own
  // update (see exchange_overlapped).
  bool previews() const { return options_.overlap_step && options_.inner == optim::InnerKind::Sgd; }
  void save_committed(StepRule& inner) {
    for (size_t i = 0; i < plans_.size(); ++i) committed_[i].copy_(inner.param(i));
  }
  void restore_committed(StepRule& inner) {
    for (size_t i = 0; i < plans_.size(); ++i) inner.param(i).copy_(committed_[i]);
  }
  // The parameters step by -lr * sign(direction) (or the adaptive step's rescaled direction) of
  // this replica's own payloads alone (no weight decay: that comes with the committed update).
  void preview(double lr, StepRule& inner) {
    Updates updates;
    for (size_t i = 0; i < plans_.size(); ++i) {
      const at::Tensor param = inner.param(i);
      std::optional<Update> u;
      if (param.scalar_type() == at::kFloat && options_.sign) {
        u.emplace();
        u->param = param;
        u->hyper.lr = lr;
      }
      updates.fused.push_back(u);
    }
    updates.apply = [&inner, lr](size_t i, const at::Tensor& d) { inner.preview(i, d, lr); };
    backend_->decode(all_, all_.send, 1, updates);
  }

  std::vector<dct::ChunkPlan> plans_;
  optim::OptimizerOptions options_;
  std::shared_ptr<comm::Communicator> group_;
  std::vector<at::Tensor> residuals_;  // per tensor: float32 block-layout DCT coefficients
  std::unique_ptr<Backend> backend_;
  bool one_bucket_ = false;  // every tensor in all_ (the backend's wish, overlap_step)
  optim::ExchangeTraffic traffic_;
  mutable Bucket all_;  // every tensor (its buffers are kept from step to step)
  // This step's buckets started early (start()), in order, and which tensors they hold.
  std::vector<Bucket> buckets_;
  std::vector<char> started_;
  // set_layout's top-k and values, until the payloads in flight have been decoded.
  std::optional<std::pair<int64_t, compress::ValueEncoding>> next_layout_;
  // --overlap-step: all_ is in flight from one step to the next; pending_: whether all_.recv
  // holds payloads not yet applied (a tensor, so that checkpoints carry it).
  std::vector<at::Tensor> committed_;  // the parameters without the preview (float32)
  at::Tensor pending_ = at::zeros({1}, at::kLong);
  std::vector<optim::PeerFault> peer_faults_;                  // found since take_peer_faults
  std::optional<std::pair<compress::Tamper, double>> tamper_;  // the next exchange's (a test aid)
};

}  // namespace

demo::BackendOptions backend_options(const OptimizerOptions& options) {
  demo::BackendOptions b;
  b.decay = options.decay;
  b.dct = options.transform == Transform::Dct;
  b.fast_path = options.fast_path;
  b.topk = options.topk;
  b.values = options.values;
  return b;
}

std::vector<int> passing_replicas(const Backend& backend, const Bucket& b,
                                  const at::Tensor& gathered, int replicas,
                                  const optim::OptimizerOptions& options,
                                  std::vector<optim::PeerFault>& faults) {
  std::vector<optim::PeerFault> found =
      backend.screen(b, gathered, replicas, options.peer_scale_bound);
  for (optim::PeerFault& f : found) f.tensor = b.tensors[f.tensor];
  if (!found.empty() && options.peer_policy == optim::PeerPolicy::Stop) {
    throw optim::PeerFaultError(found.front());
  }
  std::vector<char> bad(size_t(replicas), 0);
  for (const optim::PeerFault& f : found) bad[f.replica] = 1;
  faults.insert(faults.end(), found.begin(), found.end());
  std::vector<int> kept;
  for (int r = 0; r < replicas; ++r) {
    if (!bad[r]) kept.push_back(r);
  }
  return kept;
}

void decode_passing(Backend& backend, const Bucket& b, const at::Tensor& gathered, int replicas,
                    const std::vector<int>& kept, const Updates& updates) {
  if (int(kept.size()) == replicas) {
    backend.decode(b, gathered, replicas, updates);
  } else if (!kept.empty()) {  // the peers that passed, in rank order
    const at::Tensor passed = backend.buffer(int64_t(b.bytes * kept.size()));
    for (size_t j = 0; j < kept.size(); ++j) {
      passed.narrow(0, int64_t(j * b.bytes), int64_t(b.bytes))
          .copy_(gathered.narrow(0, int64_t(kept[j] * b.bytes), int64_t(b.bytes)));
    }
    backend.decode(b, passed, int(kept.size()), updates);
  }  // no replica passed: nothing to apply
}

std::unique_ptr<Replicator> make_demo_replicator(const std::vector<dct::ChunkPlan>& plans,
                                                 const OptimizerOptions& options,
                                                 std::shared_ptr<comm::Communicator> group,
                                                 at::Device device) {
  if (options.demo_exchange == DemoExchange::Owners) {
    return make_owner_replicator(plans, options, std::move(group), device);
  }
  return std::make_unique<DemoReplicator>(plans, options, std::move(group), device);
}

}  // namespace flexdemo::optim
