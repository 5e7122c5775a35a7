// The CUDA DeMo kernels against the CPU's portable kernels (the same arithmetic, chunk_math.h):
// payload bytes, residuals and stepped parameters must be bit-identical. Skipped, with one line
// saying so, where no GPU is visible (or the build has no CUDA).
#include "gpu_step_check.h"

#include "demo/backend.h"
#include "demo/kernels.h"
#include "flexdemo/comm.h"  // comm::Work, which a Bucket holds
#include "demo/screen.h"
#include "flexdemo/optim.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

using namespace flexdemo;
using compress::ValueEncoding;

namespace {

#define SKIP_WITHOUT_GPU()                                                            \
  if (!kernels::cuda_available()) {                                                   \
    GTEST_SKIP() << (kernels::cuda_built() ? "no GPU visible: GPU test skipped"       \
                                           : "built without CUDA: GPU test skipped"); \
  }

class GpuKernels : public testing::TestWithParam<ValueEncoding> {};

TEST_P(GpuKernels, EncodeDecodeAndStepEqualTheCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  const at::Device gpu(at::kCUDA, 0);
  const std::vector<dct::ChunkPlan> plans = gpu_step_check::test_plans();
  const kernels::GpuStep step(plans, 6, GetParam(), gpu);
  gpu_step_check::expect_gpu_step_equals_cpu(step, plans, 6, GetParam(), gpu);
}

INSTANTIATE_TEST_SUITE_P(Encodings, GpuKernels, testing::ValuesIn(values_of<ValueEncoding>()),
                         [](const auto& info) { return std::string(name_of(info.param)); });

// The optimizer end to end on a GPU (DemoReplicator through the CUDA kernels, one replica) against
// the same optimizer on the CPU with the portable kernels: every step's parameters, residuals
// and AdamW moments bit for bit, for sign-SGD and AdamW with and without sign.
TEST(GpuKernels, OptimizerStepsEqualTheCpusPortablePath) {
  SKIP_WITHOUT_GPU();
  const at::Device gpu(at::kCUDA, 0);
  const isa_testing::ScopedIsa portable(kernels::Isa::Portable);
  const std::vector<std::vector<int64_t>> shapes = {{128, 96}, {70, 30}, {500}};
  for (auto [inner, sign] : {std::pair{optim::InnerKind::Sgd, true},
                             {optim::InnerKind::AdamW, true},
                             {optim::InnerKind::AdamW, false}}) {
    optim::OptimizerOptions options = optim::preset(optim::Preset::DeMo);
    options.topk = 5, options.chunk = 32, options.inner = inner, options.sign = sign;
    options.weight_decay = 0.1, options.values = ValueEncoding::Bf16;
    at::manual_seed(3);
    std::vector<at::Tensor> on_cpu, on_gpu;
    for (const auto& shape : shapes) {
      on_cpu.push_back(at::randn(shape).set_requires_grad(true));
      on_gpu.push_back(on_cpu.back().detach().to(gpu).set_requires_grad(true));
    }
    optim::Optimizer cpu(on_cpu, options), device(on_gpu, options);
    for (int step = 0; step < 4; ++step) {
      for (size_t i = 0; i < shapes.size(); ++i) {
        const at::Tensor g = at::randn(shapes[i]);
        on_cpu[i].mutable_grad() = g;
        on_gpu[i].mutable_grad() = g.to(gpu);
      }
      cpu.step();
      device.step();
      for (size_t i = 0; i < shapes.size(); ++i) {
        ASSERT_TRUE(gpu_step_check::bit_equal(on_gpu[i].detach(), on_cpu[i].detach()))
            << "param " << i << " step " << step << " " << name_of(inner) << " sign " << sign;
      }
      const auto a = cpu.state_tensors(), b = device.state_tensors();
      ASSERT_EQ(a.size(), b.size());
      for (size_t t = 0; t < a.size(); ++t) {
        ASSERT_TRUE(gpu_step_check::bit_equal(b[t].second, a[t].second)) << a[t].first;
      }
    }
  }
}

// The GPU's screening through its backend (the kernels' verdict, then the host for a payload they
// flag) against the host's screening of the same bytes: the same faults in the same order, with
// the same details and ratios. Replica 1's first payload is scaled 1000x (the scale check),
// replica 2's third corrupted, replica 3's second made NaN; the bucket on the host (MPI's) and
// on the GPU (NCCL's).
TEST(GpuKernels, ScreeningOnTheGpuFindsWhatTheHostFinds) {
  const std::vector<dct::ChunkPlan> plans = gpu_step_check::test_plans();
  const int64_t k = 6;
  const int replicas = 4;
  for (const ValueEncoding values : {ValueEncoding::Bf16, ValueEncoding::Fp8}) {
    demo::Bucket b;
    b.topk = k, b.values = values;
    for (size_t i = 0; i < plans.size(); ++i) {
      b.tensors.push_back(i);
      b.offsets.push_back(b.bytes);
      b.bytes += compress::wire_payload_bytes(plans[i], k, values);
    }
    at::manual_seed(5);
    const at::Tensor gathered = at::zeros({int64_t(b.bytes) * replicas}, at::kByte);
    uint8_t* bytes = gathered.data_ptr<uint8_t>();
    for (int r = 0; r < replicas; ++r) {
      for (size_t i = 0; i < plans.size(); ++i) {
        const dct::ChunkPlan& p = plans[i];
        compress::TopK t = kernels::select_topk(at::randn({p.padded_rows, p.padded_cols}), p, k);
        compress::encode_payload(plans[i], t, values, bytes + r * b.bytes + b.offsets[i]);
      }
    }
    compress::tamper_payload(bytes + 1 * b.bytes + b.offsets[0], plans[0], k, values,
                             compress::Tamper::Scale, 1000.0);
    compress::tamper_payload(bytes + 2 * b.bytes + b.offsets[2], plans[2], k, values,
                             compress::Tamper::Corrupt);
    compress::tamper_payload(bytes + 3 * b.bytes + b.offsets[1], plans[1], k, values,
                             compress::Tamper::Scale, std::nan(""));
    const std::vector<optim::PeerFault> host =
        demo::screen_on_host(plans, b, gathered, replicas, 4.0);
    ASSERT_EQ(host.size(), 3u) << name_of(values);  // by tensor, then replica
    EXPECT_EQ(host[0].kind, optim::PeerFault::Kind::OutOfScale);
    EXPECT_EQ(host[1].kind, optim::PeerFault::Kind::NonFinite);
    EXPECT_EQ(host[2].kind, optim::PeerFault::Kind::Corrupt);

    SKIP_WITHOUT_GPU();
    const at::Device gpu(at::kCUDA, 0);
    demo::BackendOptions options;
    options.topk = k, options.values = values;
    std::vector<at::Tensor> residuals;
    for (const dct::ChunkPlan& p : plans) {
      residuals.push_back(at::zeros({p.padded_rows, p.padded_cols}, at::device(gpu)));
    }
    const std::unique_ptr<demo::Backend> backend =
        demo::make_cuda_backend(plans, options, residuals, gpu, at::Device(at::kCPU));
    for (const at::Tensor& where : {gathered, gathered.to(gpu)}) {
      const std::vector<optim::PeerFault> found = backend->screen(b, where, replicas, 4.0);
      ASSERT_EQ(found.size(), host.size()) << name_of(values);
      for (size_t f = 0; f < host.size(); ++f) {
        EXPECT_EQ(found[f].kind, host[f].kind) << f;
        EXPECT_EQ(found[f].replica, host[f].replica) << f;
        EXPECT_EQ(found[f].tensor, host[f].tensor) << f;
        EXPECT_EQ(found[f].ratio, host[f].ratio) << f;
        EXPECT_EQ(found[f].detail, host[f].detail) << f;
      }
    }
  }
}

TEST(GpuKernels, WithoutAGpuTheStepSaysWhy) {
  if (kernels::cuda_available()) {
    EXPECT_NO_THROW(kernels::GpuStep(gpu_step_check::test_plans(), 4, ValueEncoding::Bf16,
                                     at::Device(at::kCUDA, 0)));
  } else {
    EXPECT_THROW(kernels::GpuStep(gpu_step_check::test_plans(), 4, ValueEncoding::Bf16,
                                  at::Device(at::kCUDA, 0)),
                 std::exception);
  }
}

}  // namespace
