// The CUDA DeMo kernels against the CPU's portable kernels (the same arithmetic, chunk_math.h):
// payload bytes, residuals and stepped parameters must be bit-identical. Skipped, with one line
// saying so, where no GPU is visible (or the build has no CUDA).
#include "gpu_step_check.h"

#include "demo/kernels.h"
#include "flexdemo/optim.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

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
