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
  EXPECT_GT(step.layout().decode_shared_floats * int64_t(sizeof(float)), 48 * 1024);
  gpu_step_check::expect_gpu_step_equals_cpu(step, plans, 32, ValueEncoding::Bf16, at::kCPU, true);
}

// GPT-2 small's chunk grid (each of its distinct tensor shapes once; top-k 32, chunk 64, bf16):
// the first, middle and last chunk of every tensor, encoded and then decoded by the emulated
// kernels, equal the CPU's portable kernels run on the whole tensors, bit for bit.
TEST(EmulatedKernels, Gpt2SmallGridSampledChunksEqualTheCpu) {
  const int64_t d = 768, k = 32;
  const ValueEncoding encoding = ValueEncoding::Bf16;
  std::vector<dct::ChunkPlan> plans;
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{50304, d},
                                                                             {1024, d},
                                                                             {3 * d, d},
                                                                             {d, d},
                                                                             {4 * d, d},
                                                                             {d, 4 * d},
                                                                             {d},
                                                                             {3 * d},
                                                                             {4 * d}}) {
    plans.push_back(dct::make_chunk_plan(shape, 64, dct::ChunkMode::Divisor));
  }
  const EmulatedGpuStep step(plans, k, encoding, 256);
  std::vector<size_t> offsets;
  std::vector<unsigned> blocks;
  for (size_t i = 0; i < plans.size(); ++i) {
    offsets.push_back(step.offset(i));
    const unsigned first = unsigned(step.layout().tensors[i].first_chunk);
    const unsigned chunks = unsigned(plans[i].num_chunks());
    for (unsigned c : {0u, chunks / 2, chunks - 1}) {
      if (blocks.empty() || blocks.back() != first + c) blocks.push_back(first + c);
    }
  }
  at::manual_seed(11);
  gpu_step_check::CpuReplica cpu;
  std::vector<at::Tensor> grads, residuals, params, cpu_params;
  for (const dct::ChunkPlan& p : plans) {
    grads.push_back(at::randn({p.rows, p.cols}) * 1e-3);
    cpu.residuals.push_back(at::zeros({p.padded_rows, p.padded_cols}));
    residuals.push_back(at::zeros({p.padded_rows, p.padded_cols}));
    params.push_back(at::randn({p.rows, p.cols}) * 0.02);
    cpu_params.push_back(params.back().clone());
  }
  gpu_step_check::cpu_encode(plans, grads, 0.0, 1.0, k, encoding, offsets, step.bytes(), cpu);
  const at::Tensor send = at::zeros({int64_t(step.bytes())}, at::kByte);
  step.encode(grads, residuals, 0.0, 1.0, send, &blocks);

  // Decode one replica's payloads (the CPU's, sealed) and step, on the same chunks.
  const at::Tensor gathered =
      at::from_blob(cpu.payloads.data(), {int64_t(step.bytes())}, at::kByte);
  kernels::AdamWHyper hyper;
  hyper.lr = 0.01;
  step.decode_step(gathered, 1, params, {}, {}, hyper, &blocks);
  {
    isa_testing::ScopedIsa portable(kernels::Isa::Portable);
    for (size_t i = 0; i < plans.size(); ++i) {
      const uint8_t* payload = cpu.payloads.data() + offsets[i];
      const compress::SparseChunks coeffs = compress::decode_mean_sparse(
          {payload}, compress::wire_payload_bytes(plans[i], k, encoding), plans[i], k, encoding);
      kernels::idct_sparse_sgd_step(coeffs, plans[i], {cpu_params[i], 0.01f, 1.0f});
    }
  }

  for (unsigned block : blocks) {
    const int32_t i = step.layout().chunk_tensor[block];
    const dct::ChunkPlan& p = plans[size_t(i)];
    const int64_t c = block - step.layout().tensors[size_t(i)].first_chunk;
    const int64_t ci = c / p.col_chunks(), cj = c % p.col_chunks();
    const int64_t h = p.chunk_rows, w = p.chunk_cols;
    auto region = [&](const at::Tensor& t) {
      return t.narrow(0, ci * h, std::min(h, t.size(0) - ci * h))
          .narrow(1, cj * w, std::min(w, t.size(1) - cj * w));
    };
    EXPECT_TRUE(at::equal(region(residuals[size_t(i)]), region(cpu.residuals[size_t(i)])))
        << "residual of tensor " << i << " chunk " << c;
    EXPECT_TRUE(at::equal(region(params[size_t(i)]), region(cpu_params[size_t(i)])))
        << "update of tensor " << i << " chunk " << c;
    const demo::codec::Layout l = demo::codec::layout(p.num_chunks(), p.chunk_numel(), k, encoding);
    const uint8_t* got = send.data_ptr<uint8_t>() + offsets[size_t(i)] + demo::codec::kHeaderBytes;
    const uint8_t* want = cpu.payloads.data() + offsets[size_t(i)] + demo::codec::kHeaderBytes;
    for (int64_t j = 0; j < l.k; ++j) {
      ASSERT_EQ(demo::codec::get_position(got, l, c, j), demo::codec::get_position(want, l, c, j))
          << "tensor " << i << " chunk " << c << " entry " << j;
      const float a = demo::codec::get_value(got, l, encoding, c * l.k + j);
      const float b = demo::codec::get_value(want, l, encoding, c * l.k + j);
      ASSERT_EQ(std::memcmp(&a, &b, sizeof(float)), 0)
          << "tensor " << i << " chunk " << c << " entry " << j;
    }
  }
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
