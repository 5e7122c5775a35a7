// The DeMo optimizer step (DESIGN.md §1) with the residual kept in the DCT domain and every
// tensor's payload exchanged in one bucketed all-gather. Must not talk to MPI directly.
#include "flexdemo/optim.h"

#include "flexdemo/comm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <sstream>
#include <stdexcept>

namespace flexdemo::optim {

void DemoOptions::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument("DeMo: " + what); };
  auto str = [](double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  if (!(lr > 0.0)) fail("lr must be > 0, got " + str(lr));
  if (!(decay >= 0.0 && decay < 1.0)) fail("decay must be in [0, 1), got " + str(decay));
  if (topk <= 0) fail("topk must be > 0, got " + std::to_string(topk));
  if (chunk <= 0) fail("chunk must be > 0, got " + std::to_string(chunk));
  if (!(weight_decay >= 0.0) || !(lr * weight_decay < 1.0)) {
    fail("weight_decay must be >= 0 with lr * weight_decay < 1, got " + str(weight_decay));
  }
}

struct DemoOptimizer::Impl {
  std::vector<at::Tensor> params;
  DemoOptions options;
  std::shared_ptr<comm::Communicator> replica_group;

  std::vector<dct::ChunkPlan> plans;    // per parameter
  std::vector<at::Tensor> residuals;    // per parameter: float32 block-layout DCT coefficients
  std::vector<size_t> payload_offsets;  // per parameter: where its payload sits in the bucket
  std::vector<size_t> payload_bytes;    // per parameter
  DemoTraffic traffic;

  at::Tensor send_bucket;  // uint8 [bucket bytes]: this replica's payloads back to back
  at::Tensor recv_bucket;  // uint8 [replicas * bucket bytes], rank order
  at::Tensor decoded;      // float32 scratch buffers, each as large as the largest padded
  at::Tensor samples;      // parameter, so that a step allocates nothing big
  at::Tensor scratch;

  int replicas() const { return replica_group ? replica_group->size() : 1; }
};

namespace {

// p -= lr * sign(update) (or lr * update), update being the padded [R, C] inverse transform.
void apply_update(at::Tensor& p, const at::Tensor& update, const dct::ChunkPlan& plan,
                  const DemoOptions& o) {
  if (p.scalar_type() == at::kFloat && p.is_contiguous() && !plan.is_padded()) {
    float* dst = p.data_ptr<float>();
    const float* u = update.data_ptr<float>();
    const float lr = float(o.lr);
    at::parallel_for(0, p.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      if (o.sign) {
        for (int64_t i = begin; i < end; ++i) dst[i] -= lr * float((u[i] > 0.0f) - (u[i] < 0.0f));
      } else {
        for (int64_t i = begin; i < end; ++i) dst[i] -= lr * u[i];
      }
    });
    return;
  }
  at::Tensor cropped = update.view({plan.padded_rows, plan.padded_cols})
                           .narrow(0, 0, plan.rows)
                           .narrow(1, 0, plan.cols);
  p.sub_((o.sign ? cropped.sign() : cropped).reshape(p.sizes()), o.lr);
}

}  // namespace

DemoOptimizer::DemoOptimizer(std::vector<at::Tensor> params, DemoOptions options,
                             std::shared_ptr<comm::Communicator> replica_group)
    : impl_(std::make_unique<Impl>()) {
  options.validate();
  Impl& s = *impl_;
  s.params = std::move(params);
  s.options = options;
  s.replica_group = std::move(replica_group);

  size_t offset = 0;
  int64_t largest = 0;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const at::Tensor& p = s.params[i];
    if (!p.defined() || p.numel() == 0) {
      throw std::invalid_argument("DeMo: parameter " + std::to_string(i) + " is empty");
    }
    if (!p.is_cpu() || !at::isFloatingType(p.scalar_type())) {
      throw std::invalid_argument("DeMo: parameter " + std::to_string(i) +
                                  " must be a floating CPU tensor");
    }
    dct::ChunkPlan plan = dct::make_chunk_plan(p.sizes(), options.chunk, options.chunk_mode);
    const size_t bytes = compress::wire_payload_bytes(plan, options.topk, options.values);
    s.plans.push_back(plan);
    s.residuals.push_back(at::zeros({plan.padded_rows, plan.padded_cols}, at::kFloat));
    s.payload_offsets.push_back(offset);
    s.payload_bytes.push_back(bytes);
    offset += bytes;
    largest = std::max(largest, plan.padded_numel());
    s.traffic.kept_coefficients += plan.num_chunks() * compress::clamp_topk(options.topk, plan);
    s.traffic.params += p.numel();
  }
  s.traffic.wire_bytes = offset;
  s.send_bucket = at::empty({int64_t(offset)}, at::kByte);
  s.recv_bucket = at::empty({int64_t(offset) * s.replicas()}, at::kByte);
  s.decoded = at::empty({largest}, at::kFloat);
  s.samples = at::empty({largest}, at::kFloat);
  s.scratch = at::empty({largest}, at::kFloat);
}

DemoOptimizer::~DemoOptimizer() = default;

void DemoOptimizer::step() {
  Impl& s = *impl_;
  const DemoOptions& o = s.options;
  at::NoGradGuard no_grad;
  uint8_t* send = s.send_bucket.data_ptr<uint8_t>();

  // Residual update and top-k extraction with error feedback, per tensor into the bucket.
  for (size_t i = 0; i < s.params.size(); ++i) {
    at::Tensor& p = s.params[i];
    const dct::ChunkPlan& plan = s.plans[i];
    at::Tensor& residual = s.residuals[i];
    if (o.weight_decay > 0.0) p.mul_(1.0 - o.lr * o.weight_decay);
    const at::Tensor& grad = p.grad();
    if (grad.defined()) {
      dct::chunked_dct_accumulate(grad, plan, o.decay, o.lr, residual, &s.scratch);
    } else {
      residual.mul_(o.decay);
    }
    compress::TopK topk = compress::select_topk(residual, plan, o.topk);
    compress::encode_payload(plan, topk, o.values, send + s.payload_offsets[i]);
    compress::add_selected(residual, plan, topk, -1.0f);  // what is sent leaves the residual
  }

  // One all-gather for the whole step.
  const size_t bucket = s.payload_offsets.empty() ? 0 : size_t(s.send_bucket.numel());
  const uint8_t* gathered = send;
  if (s.replicas() > 1) {
    s.replica_group->all_gather(s.send_bucket, s.recv_bucket);
    gathered = s.recv_bucket.data_ptr<uint8_t>();
  }

  // Decode (the mean over replicas, bit-identical everywhere) and apply.
  std::vector<const uint8_t*> payloads(s.replicas());
  for (size_t i = 0; i < s.params.size(); ++i) {
    const dct::ChunkPlan& plan = s.plans[i];
    for (int r = 0; r < s.replicas(); ++r) {
      payloads[r] = gathered + r * bucket + s.payload_offsets[i];
    }
    at::Tensor decoded = s.decoded.narrow(0, 0, plan.padded_numel());
    compress::decode_mean(payloads, s.payload_bytes[i], plan, o.topk, o.values, decoded);
    at::Tensor update = s.samples.narrow(0, 0, plan.padded_numel());
    dct::chunked_idct_into(decoded, plan, update, &s.scratch);
    apply_update(s.params[i], update, plan, o);
  }
}

void DemoOptimizer::zero_grad() {
  for (at::Tensor& p : impl_->params) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

const DemoOptions& DemoOptimizer::options() const {
  return impl_->options;
}
const std::vector<at::Tensor>& DemoOptimizer::params() const {
  return impl_->params;
}
DemoTraffic DemoOptimizer::traffic() const {
  return impl_->traffic;
}
const at::Tensor& DemoOptimizer::residual(size_t i) const {
  return impl_->residuals.at(i);
}
const dct::ChunkPlan& DemoOptimizer::chunk_plan(size_t i) const {
  return impl_->plans.at(i);
}

}  // namespace flexdemo::optim
