// kernels::GpuStep's interface over CPU tensors, with the CUDA kernels (cuda_kernels.cuh,
// unchanged) launched by the emulation (cuda_emulation.h): what test_cuda_emulation checks bit for
// bit against the CPU's kernels and what bench/gpu_model.cpp traces. Include once per program.
#pragma once

#include "cuda_emulation.h"  // first: the CUDA words the kernels use

#include "demo/cpu/chunk_kernels.h"
#include "demo/cuda/cuda_kernels.cuh"
#include "demo/cuda/host_table.h"
#include "flexdemo/compress.h"
#include "demo/kernels.h"

#include <ATen/ATen.h>

#include <cstring>
#include <vector>

namespace flexdemo::cuda_emulation {

class EmulatedGpuStep {
 public:
  EmulatedGpuStep(const std::vector<dct::ChunkPlan>& plans, int64_t k,
                  compress::ValueEncoding encoding, unsigned threads)
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

  // Every chunk, or only `blocks` (the bucket's chunk numbers), traced into `counts` if given.
  void encode(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& residuals,
              double beta, double alpha, const at::Tensor& send,
              const std::vector<unsigned>* blocks = nullptr, Counts* counts = nullptr) const {
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
    launch_blocks(kernels::cuda::encode_kernel, blocks != nullptr ? *blocks : all_blocks(),
                  threads_, encode_shared_bytes(), counts, table(descs), float(beta), float(alpha),
                  send.data_ptr<uint8_t>());
  }

  void seal(uint8_t* payloads) const {
    for (size_t i = 0; i < plans_.size(); ++i) {
      compress::seal_payload(plans_[i], k_, encoding_, payloads + offset(i));
    }
  }

  // The headers and checksums by the kernels (GpuStep::seal_on_device), into send.
  void seal_on_device(const at::Tensor& send, Counts* counts = nullptr) const {
    const std::vector<kernels::cuda::TensorDesc> descs = layout_.tensors;
    std::vector<uint32_t> crcs(std::max<size_t>(1, layout_.segment_tensor.size()));
    launch_blocks(kernels::cuda::crc_segments_kernel, blocks_for(layout_.segment_tensor.size()),
                  threads_, 0, counts, table(descs), static_cast<const uint8_t*>(send.data_ptr()),
                  int64_t(0), 1, crcs.data());
    launch_blocks(kernels::cuda::crc_finish_kernel, first(descs.size()), threads_, 0, counts,
                  table(descs), send.data_ptr<uint8_t>(), int64_t(0),
                  static_cast<const uint32_t*>(crcs.data()), static_cast<uint32_t*>(nullptr));
  }

  // The kernels' screening (GpuStep::screen_on_device): per replica and tensor its error bits
  // and its values' sum of squares. The checksums' part, then the chunks' (only `blocks` of
  // screen_chunks_kernel's, if given), then the sums.
  kernels::GpuStep::Screened screen_on_device(const at::Tensor& gathered, int replicas,
                                              Counts* counts = nullptr) const {
    kernels::GpuStep::Screened out;
    out.errors = check_checksums(gathered, replicas, counts);
    std::vector<double> chunk_squares = screen_chunks(gathered, replicas, out.errors, nullptr, counts);
    out.squares = screen_sums(chunk_squares, replicas, counts);
    return out;
  }
  std::vector<uint32_t> check_checksums(const at::Tensor& gathered, int replicas,
                                        Counts* counts = nullptr) const {
    const std::vector<kernels::cuda::TensorDesc> descs = layout_.tensors;
    const size_t segments = size_t(replicas) * layout_.segment_tensor.size();
    std::vector<uint32_t> crcs(std::max<size_t>(1, segments));
    std::vector<uint32_t> errors(size_t(replicas) * descs.size(), 0);
    uint8_t* data = gathered.data_ptr<uint8_t>();
    launch_blocks(kernels::cuda::crc_segments_kernel, blocks_for(segments), threads_, 0, counts,
                  table(descs), static_cast<const uint8_t*>(data), int64_t(bytes()), replicas,
                  crcs.data());
    launch_blocks(kernels::cuda::crc_finish_kernel, first(size_t(replicas) * descs.size()),
                  threads_, 0, counts, table(descs), data, int64_t(bytes()),
                  static_cast<const uint32_t*>(crcs.data()), errors.data());
    return errors;
  }
  // Per (replica, chunk) its sum of squares (a thread each); errors as the kernel ORs them.
  std::vector<double> screen_chunks(const at::Tensor& gathered, int replicas,
                                    std::vector<uint32_t>& errors,
                                    const std::vector<unsigned>* blocks,
                                    Counts* counts = nullptr) const {
    const std::vector<kernels::cuda::TensorDesc> descs = layout_.tensors;
    const size_t chunks = size_t(replicas) * layout_.chunk_tensor.size();
    std::vector<double> chunk_squares(std::max<size_t>(1, chunks), 0.0);
    launch_blocks(kernels::cuda::screen_chunks_kernel,
                  blocks != nullptr ? *blocks : blocks_for(chunks), threads_, 0, counts,
                  table(descs), static_cast<const uint8_t*>(gathered.data_ptr<uint8_t>()),
                  int64_t(bytes()), replicas, chunk_squares.data(), errors.data());
    return chunk_squares;
  }
  std::vector<double> screen_sums(const std::vector<double>& chunk_squares, int replicas,
                                  Counts* counts = nullptr) const {
    const std::vector<kernels::cuda::TensorDesc> descs = layout_.tensors;
    std::vector<double> squares(size_t(replicas) * descs.size(), 0.0);
    launch_blocks(kernels::cuda::screen_sums_kernel, first(squares.size()), threads_, 0, counts,
                  table(descs), static_cast<const double*>(chunk_squares.data()), squares.data());
    return squares;
  }
  void validate_on_device(const at::Tensor& gathered, int replicas) const {
    for (uint32_t e : screen_on_device(gathered, replicas).errors) {
      if ((e & 7u) != 0) {
        validate(gathered.data_ptr<uint8_t>(), replicas);
        throw compress::WireFormatError("the kernels' check found a payload wrong");
      }
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
                   const std::vector<at::Tensor>& exp_avg_sq, const kernels::AdamWHyper& hyper,
                   const std::vector<unsigned>* blocks = nullptr, Counts* counts = nullptr) const {
    std::vector<kernels::cuda::TensorDesc> descs = layout_.tensors;
    const bool adamw = !exp_avg.empty();
    for (size_t i = 0; i < descs.size(); ++i) {
      descs[i].param = params[i].data_ptr<float>();
      if (adamw) {
        descs[i].exp_avg = exp_avg[i].data_ptr<float>();
        descs[i].exp_avg_sq = exp_avg_sq[i].data_ptr<float>();
      }
    }
    launch_blocks(kernels::cuda::decode_step_kernel, blocks != nullptr ? *blocks : all_blocks(),
                  threads_, decode_shared_bytes(), counts, table(descs),
                  static_cast<const uint8_t*>(gathered.data_ptr<uint8_t>()), int64_t(bytes()),
                  replicas, kernels::sgd_constants(hyper), kernels::adamw_constants(hyper), adamw);
  }

  const kernels::cuda::HostTable& layout() const { return layout_; }

 private:
  static std::vector<unsigned> first(size_t n) {
    std::vector<unsigned> blocks(n);
    for (size_t b = 0; b < n; ++b) blocks[b] = unsigned(b);
    return blocks;
  }
  std::vector<unsigned> blocks_for(size_t threads) const {  // one thread each
    return first((threads + threads_ - 1) / threads_);
  }
  std::vector<unsigned> all_blocks() const {
    std::vector<unsigned> blocks(layout_.chunk_tensor.size());
    for (size_t b = 0; b < blocks.size(); ++b) blocks[b] = unsigned(b);
    return blocks;
  }
  size_t encode_shared_bytes() const {
    return size_t(layout_.encode_shared_floats) * sizeof(float);
  }
  size_t decode_shared_bytes() const {
    return size_t(layout_.decode_shared_floats) * sizeof(float);
  }
  kernels::cuda::TensorTable table(const std::vector<kernels::cuda::TensorDesc>& descs) const {
    kernels::cuda::TensorTable b;
    b.tensors = descs.data();
    b.chunk_tensor = layout_.chunk_tensor.data();
    b.num_chunks = int64_t(layout_.chunk_tensor.size());
    b.encode_shared_floats = layout_.encode_shared_floats;
    b.decode_shared_floats = layout_.decode_shared_floats;
    b.encoding = encoding_;
    b.num_tensors = int64_t(descs.size());
    b.segment_tensor = layout_.segment_tensor.data();
    b.num_segments = int64_t(layout_.segment_tensor.size());
    b.max_k = layout_.max_k;
    demo::codec::crc_x2n_table(b.crc_x2n);
    return b;
  }

  std::vector<dct::ChunkPlan> plans_;
  int64_t k_;
  compress::ValueEncoding encoding_;
  unsigned threads_;
  kernels::cuda::HostTable layout_;
};

}  // namespace flexdemo::cuda_emulation
