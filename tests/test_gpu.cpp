// The CUDA DeMo kernels against the CPU's portable kernels (the same arithmetic, chunk_math.h):
// payload bytes, residuals and stepped parameters must be bit-identical. Skipped, with one line
// saying so, where no GPU is visible (or the build has no CUDA).
#include "bucket_check.h"

#include "flexdemo/kernels.h"

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
  const std::vector<dct::ChunkPlan> plans = bucket_check::test_plans();
  const kernels::GpuBucket bucket(plans, 6, GetParam(), gpu);
  bucket_check::expect_bucket_equals_cpu(bucket, plans, 6, GetParam(), gpu);
}

INSTANTIATE_TEST_SUITE_P(Encodings, GpuKernels,
                         testing::Values(ValueEncoding::Fp32, ValueEncoding::Bf16,
                                         ValueEncoding::Int8, ValueEncoding::Sign),
                         [](const auto& info) { return std::string(name_of(info.param)); });

TEST(GpuKernels, WithoutAGpuTheBucketSaysWhy) {
  if (kernels::cuda_available()) {
    EXPECT_NO_THROW(
        kernels::GpuBucket(bucket_check::test_plans(), 4, ValueEncoding::Bf16, at::Device(at::kCUDA, 0)));
  } else {
    EXPECT_THROW(kernels::GpuBucket(bucket_check::test_plans(), 4, ValueEncoding::Bf16, at::Device(at::kCUDA, 0)),
                 std::exception);
  }
}

}  // namespace
