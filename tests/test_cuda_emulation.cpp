// The CUDA DeMo kernels (src/demo/cuda/cuda_kernels.cuh, unchanged) run on the CPU by an emulation
// of blocks and threads (cuda_emulation.h), checked bit for bit against the CPU's portable kernels
// by the same check test_gpu runs on a GPU (gpu_step_check.h). Without a GPU this is what tests the
// kernels' logic: indexing, padding, radix selection, scans, packing, decode and the steps.
#include "emulated_gpu_step.h"  // first: the CUDA words the kernels use

#include "gpu_step_check.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

using namespace flexdemo;
using compress::ValueEncoding;
using cuda_emulation::EmulatedGpuStep;

namespace {

class EmulatedKernels : public testing::TestWithParam<ValueEncoding> {};

// 32 threads a block: fewer than a chunk's coefficients, so every thread handles several.
TEST_P(EmulatedKernels, EncodeDecodeAndStepEqualTheCpuBitForBit) {
  const std::vector<dct::ChunkPlan> plans = gpu_step_check::test_plans();
  const EmulatedGpuStep step(plans, 6, GetParam(), 32);
  gpu_step_check::expect_gpu_step_equals_cpu(step, plans, 6, GetParam(), at::kCPU, true);
}

INSTANTIATE_TEST_SUITE_P(Encodings, EmulatedKernels, testing::ValuesIn(values_of<ValueEncoding>()),
                         [](const auto& info) { return std::string(name_of(info.param)); });

// The launch's own block size (256 threads, more than a small chunk's coefficients, so most
// threads have none), small chunks, k larger than the vector's chunks hold (clamped), and a first
// step of zero gradients: top-k among equal magnitudes.
TEST(EmulatedKernels, LaunchBlockSizeSmallChunksClampedKAndTies) {
  const std::vector<dct::ChunkPlan> plans = {
      dct::make_chunk_plan({24, 12}, 4, dct::ChunkMode::Divisor),
      dct::make_chunk_plan({7}, 4, dct::ChunkMode::Padded)};
  const EmulatedGpuStep step(plans, 5, ValueEncoding::Sign, 256);
  gpu_step_check::expect_gpu_step_equals_cpu(step, plans, 5, ValueEncoding::Sign, at::kCPU, true);
}

// Chunks of 128 x 128 (and 1-D chunks of 128): over 48 KB of shared memory, the launch's opt-in
// path on a GPU.
TEST(EmulatedKernels, Chunks128NeedingTheSharedMemoryOptIn) {
  const std::vector<dct::ChunkPlan> plans = {
      dct::make_chunk_plan({256, 128}, 128, dct::ChunkMode::Divisor),
      dct::make_chunk_plan({300}, 128, dct::ChunkMode::Padded)};
  const EmulatedGpuStep step(plans, 32, ValueEncoding::Bf16, 256);
  EXPECT_GT(step.layout().shared_floats * int64_t(sizeof(float)), 48 * 1024);
  gpu_step_check::expect_gpu_step_equals_cpu(step, plans, 32, ValueEncoding::Bf16, at::kCPU, true);
}

// A mismatch names the tensor, the part of its payload and how many bytes differ.
TEST(EmulatedKernels, AMismatchSaysWhere) {
  const std::vector<dct::ChunkPlan> plans = gpu_step_check::test_plans();
  const EmulatedGpuStep step(plans, 6, ValueEncoding::Bf16, 32);
  std::vector<size_t> offsets;
  for (size_t i = 0; i < plans.size(); ++i) offsets.push_back(step.offset(i));
  std::vector<uint8_t> a(step.bytes(), 0), b(step.bytes(), 0);
  const demo::codec::Layout l =
      demo::codec::layout(plans[2].num_chunks(), plans[2].chunk_numel(), 6, ValueEncoding::Bf16);
  b[offsets[2] + size_t(demo::codec::kHeaderBytes + l.values_at) + 1] = 1;
  b[offsets[3] + 2] = 1;
  setenv("FLEXDEMO_MISMATCH_DIR", testing::TempDir().c_str(), 1);
  const std::string message = gpu_step_check::describe_mismatch(b.data(), a.data(), a.size(), plans,
                                                                offsets, 6, ValueEncoding::Bf16);
  EXPECT_NE(message.find("tensor 2, values"), std::string::npos) << message;
  EXPECT_NE(message.find("2 of " + std::to_string(a.size()) + " bytes differ"), std::string::npos)
      << message;
}

}  // namespace
