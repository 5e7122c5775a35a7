// The CUDA DeMo kernels (src/demo/cuda/cuda_kernels.cuh, unchanged) run on the CPU by an emulation
// of blocks and threads (cuda_emulation.h), checked bit for bit against the CPU's portable kernels
// by the same check test_gpu runs on a GPU (gpu_step_check.h). Without a GPU this is what tests the
// kernels' logic: indexing, padding, radix selection, scans, packing, decode and the steps.
#include "cuda_emulation.h"  // first: the CUDA words the kernels use

#include "demo/cpu/chunk_kernels.h"
#include "demo/cuda/cuda_kernels.cuh"
#include "demo/cuda/host_table.h"

#include "gpu_step_check.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

using namespace flexdemo;
using compress::ValueEncoding;

namespace {

// kernels::GpuStep's interface over CPU tensors, the kernels launched by the emulation.
class EmulatedGpuStep {
 public:
  EmulatedGpuStep(const std::vector<dct::ChunkPlan>& plans, int64_t k, ValueEncoding encoding,
                  unsigned threads)
      : plans_(plans),
        k_(k),
        encoding_(encoding),
        threads_(threads),
        layout_(kernels::cuda::host_table(plans, k, encoding)) {
    for (size_t i = 0; i < plans.size(); ++i) {
      kernels::cuda::TensorDesc& d = layout_.tensors[i];
      const kernels::Dct1d& rows = kernels::dct1d(plans[i].chunk_rows);
      const kernels::Dct1d& cols = kernels::dct1d(plans[i].chunk_cols);
      d.basis_rows = rows.full, d.basis_rows_t = rows.full_t;
      d.basis_cols = cols.full, d.basis_cols_t = cols.full_t;
      d.basis_rows_stride = rows.full_stride, d.basis_cols_stride = cols.full_stride;
    }
  }

  size_t bytes() const { return layout_.bytes; }
  size_t offset(size_t i) const { return size_t(layout_.tensors.at(i).payload_offset); }

  void encode(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& residuals,
              double beta, double alpha, const at::Tensor& send) const {
    std::vector<kernels::cuda::TensorDesc> descs = layout_.tensors;
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < descs.size(); ++i) {
      descs[i].residual = residuals[i].data_ptr<float>();
      if (grads[i].defined()) {
        inputs.push_back(grads[i].to(at::kFloat).contiguous());
        descs[i].grad = inputs.back().data_ptr<float>();
      }
    }
    std::memset(send.data_ptr(), 0, bytes());
    cuda_emulation::launch(kernels::cuda::encode_kernel, unsigned(layout_.chunk_tensor.size()),
                           threads_, shared_bytes(), table(descs), float(beta), float(alpha),
                           send.data_ptr<uint8_t>());
  }

  void seal(uint8_t* payloads) const {
    for (size_t i = 0; i < plans_.size(); ++i) {
      compress::seal_payload(plans_[i], k_, encoding_, payloads + offset(i));
    }
  }

  void validate(const uint8_t* gathered, int replicas) const {
    for (int r = 0; r < replicas; ++r) {
      for (size_t i = 0; i < plans_.size(); ++i) {
        compress::validate_payload(gathered + r * bytes() + offset(i), layout_.payload_bytes[i],
                                   plans_[i], k_, encoding_);
      }
    }
  }

  void decode_step(const at::Tensor& gathered, int replicas, const std::vector<at::Tensor>& params,
                   const std::vector<at::Tensor>& exp_avg,
                   const std::vector<at::Tensor>& exp_avg_sq,
                   const kernels::AdamWHyper& hyper) const {
    std::vector<kernels::cuda::TensorDesc> descs = layout_.tensors;
    const bool adamw = !exp_avg.empty();
    for (size_t i = 0; i < descs.size(); ++i) {
      descs[i].param = params[i].data_ptr<float>();
      if (adamw) {
        descs[i].exp_avg = exp_avg[i].data_ptr<float>();
        descs[i].exp_avg_sq = exp_avg_sq[i].data_ptr<float>();
      }
    }
    cuda_emulation::launch(
        kernels::cuda::decode_step_kernel, unsigned(layout_.chunk_tensor.size()), threads_,
        shared_bytes(), table(descs), static_cast<const uint8_t*>(gathered.data_ptr<uint8_t>()),
        int64_t(bytes()), replicas, float(hyper.lr), float(1.0 - hyper.lr * hyper.weight_decay),
        kernels::adamw_constants(hyper), adamw);
  }

 private:
  size_t shared_bytes() const { return size_t(layout_.shared_floats) * sizeof(float); }
  kernels::cuda::TensorTable table(const std::vector<kernels::cuda::TensorDesc>& descs) const {
    kernels::cuda::TensorTable b;
    b.tensors = descs.data();
    b.chunk_tensor = layout_.chunk_tensor.data();
    b.num_chunks = int64_t(layout_.chunk_tensor.size());
    b.shared_floats = layout_.shared_floats;
    b.encoding = encoding_;
    return b;
  }

  std::vector<dct::ChunkPlan> plans_;
  int64_t k_;
  ValueEncoding encoding_;
  unsigned threads_;
  kernels::cuda::HostTable layout_;
};

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

}  // namespace
