// The host-staged backend (the GPU's fallback when its kernels disagree with the CPU's) against
// the CPU backend it wraps: on tensors that already lie on the host its staging is a copy, so
// payloads, residuals and updates must be equal bit for bit.
#include "closed_form.h"
#include "demo/backend.h"
#include "optim/demo_exchange.h"

#include "flexdemo/comm.h"
#include "flexdemo/compress.h"
#include "flexdemo/dct.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

using namespace flexdemo;

namespace {

demo::Bucket bucket_of(const std::vector<dct::ChunkPlan>& plans, const demo::BackendOptions& o,
                       demo::Backend& backend) {
  demo::Bucket b;
  for (size_t i = 0; i < plans.size(); ++i) {
    b.tensors.push_back(i);
    b.offsets.push_back(b.bytes);
    b.bytes += compress::wire_payload_bytes(plans[i], o.topk, o.values);
  }
  b.topk = o.topk;
  b.values = o.values;
  b.send = backend.buffer(int64_t(b.bytes));
  return b;
}

TEST(Backends, HostStagedEqualsTheCpuBackendItWraps) {
  const std::vector<dct::ChunkPlan> plans = {
      dct::make_chunk_plan({128, 192}, 64, dct::ChunkMode::Divisor),
      dct::make_chunk_plan({1000}, 64, dct::ChunkMode::Padded)};
  demo::BackendOptions o;
  o.topk = 8;
  o.values = compress::ValueEncoding::Bf16;
  std::vector<at::Tensor> direct_residuals, staged_residuals, grads, direct_params, staged_params;
  at::manual_seed(3);
  for (const dct::ChunkPlan& p : plans) {
    direct_residuals.push_back(at::zeros({p.padded_rows, p.padded_cols}));
    staged_residuals.push_back(at::zeros({p.padded_rows, p.padded_cols}));
    grads.push_back(at::randn({p.rows, p.cols}));
    direct_params.push_back(at::randn({p.rows, p.cols}));
    staged_params.push_back(direct_params.back().clone());
  }
  auto direct = demo::make_cpu_backend(plans, o, direct_residuals);
  auto staged = demo::make_host_staged_backend(plans, o, staged_residuals, at::kCPU);
  EXPECT_FALSE(staged->partial_buckets());

  demo::Bucket a = bucket_of(plans, o, *direct), b = bucket_of(plans, o, *staged);
  for (int step = 0; step < 2; ++step) {
    direct->encode(a, grads, 0.01);
    staged->encode(b, grads, 0.01);
    ASSERT_EQ(std::memcmp(a.send.data_ptr(), b.send.data_ptr(), a.bytes), 0) << "step " << step;
    for (size_t i = 0; i < plans.size(); ++i) {
      EXPECT_TRUE(at::equal(direct_residuals[i], staged_residuals[i])) << "residual " << i;
    }
    const at::Tensor gathered = at::cat({a.send, a.send});  // two replicas
    demo::Updates ua, ub;
    for (size_t i = 0; i < plans.size(); ++i) {
      demo::Update u;
      u.hyper.lr = 0.01;
      u.param = direct_params[i];
      ua.fused.push_back(u);
      u.param = staged_params[i];
      ub.fused.push_back(u);
    }
    direct->decode(a, gathered, 2, ua);
    staged->decode(b, gathered, 2, ub);
    for (size_t i = 0; i < plans.size(); ++i) {
      EXPECT_TRUE(at::equal(direct_params[i], staged_params[i])) << "update " << i;
      EXPECT_FALSE(at::equal(direct_params[i], staged_params[i].clone().zero_()));
    }
  }
}

}  // namespace

TEST(Backends, OwnersReturnAsManyCoefficientsAsFitInAPayload) {
  // --demo-exchange owners: at 2-bit values an owner returns the most coefficients a chunk whose
  // payload fits in the bytes of a replica's (the closed form decides), never fewer than top-k
  // and never more than the chunk holds.
  using compress::ValueEncoding;
  const dct::ChunkPlan chunk = dct::make_chunk_plan({64, 64}, 64, dct::ChunkMode::Divisor);
  const dct::ChunkPlan wide = dct::make_chunk_plan({128, 256}, 64, dct::ChunkMode::Divisor);
  auto bytes = [&](int64_t k, ValueEncoding values) {
    optim::OptimizerOptions o = optim::preset(optim::Preset::DeMo);
    o.topk = k;
    o.values = values;
    return closed_form_payload_bytes({chunk}, o);
  };
  for (ValueEncoding values : {ValueEncoding::Bf16, ValueEncoding::Fp32, ValueEncoding::Fp8}) {
    const int64_t k = optim::owner_topk_that_fits({wide}, 32, values, ValueEncoding::TwoBit);
    EXPECT_LE(bytes(k, ValueEncoding::TwoBit), bytes(32, values)) << name_of(values);
    EXPECT_GT(bytes(k + 1, ValueEncoding::TwoBit), bytes(32, values)) << name_of(values);
  }
  EXPECT_EQ(optim::owner_topk_that_fits({wide}, 32, ValueEncoding::Bf16, ValueEncoding::TwoBit),
            104);
  EXPECT_EQ(optim::owner_topk_that_fits({wide}, 32, ValueEncoding::TwoBit, ValueEncoding::TwoBit),
            32);
  const dct::ChunkPlan vector = dct::make_chunk_plan({64}, 64, dct::ChunkMode::Divisor);  // 64
  EXPECT_EQ(optim::owner_topk_that_fits({vector}, 32, ValueEncoding::Bf16, ValueEncoding::TwoBit),
            64);
}
