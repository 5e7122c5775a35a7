// The check shared by test_gpu (kernels::GpuStep on a GPU) and test_cuda_emulation (the same
// kernels run by an emulation on the CPU): a bucket's encode, decode and step against the CPU's
// portable kernels, which compute every element with the same arithmetic (chunk_math.h).
#pragma once

#include "demo/codec.h"
#include "flexdemo/compress.h"
#include "demo/kernels.h"
#include "demo/screen.h"
#include "isa.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo::gpu_step_check {

using compress::ValueEncoding;

// Where two buckets first differ, for a mismatch's message: the tensor, the part of its payload
// (header; the body's positions, scales or values, and the chunk) and how many bytes differ in
// all; both buckets are written to $FLEXDEMO_MISMATCH_DIR (default: the working folder) as
// mismatch-gpu.bin and mismatch-cpu.bin.
inline std::string describe_mismatch(const uint8_t* gpu, const uint8_t* cpu, size_t bytes,
                                     const std::vector<dct::ChunkPlan>& plans,
                                     const std::vector<size_t>& offsets, int64_t k,
                                     ValueEncoding encoding) {
  size_t first = bytes, differ = 0;
  for (size_t b = 0; b < bytes; ++b) {
    if (gpu[b] != cpu[b]) {
      first = std::min(first, b);
      ++differ;
    }
  }
  if (differ == 0) return "equal";
  size_t i = 0;
  while (i + 1 < offsets.size() && offsets[i + 1] <= first) ++i;
  const int64_t at = int64_t(first - offsets[i]);
  const demo::codec::Layout l =
      demo::codec::layout(plans[i].num_chunks(), plans[i].chunk_numel(), k, encoding);
  std::string where;
  const int64_t body = at - demo::codec::kHeaderBytes;
  if (body < 0) {
    where = "header byte " + std::to_string(at);
  } else if (body < l.scales_at) {
    const int64_t per_chunk = l.index_bytes > 0 ? l.k * l.index_bytes : l.record_bytes;
    where = "positions of chunk " + std::to_string(body / std::max<int64_t>(1, per_chunk));
  } else if (body < l.values_at) {
    where = "scales (body byte " + std::to_string(body) + ")";
  } else {
    where = "values (body byte " + std::to_string(body) + ")";
  }
  const char* dir = std::getenv("FLEXDEMO_MISMATCH_DIR");
  const std::string folder = dir != nullptr ? dir : ".";
  for (const auto& [name, data] : {std::pair{"gpu", gpu}, std::pair{"cpu", cpu}}) {
    std::FILE* f = std::fopen((folder + "/mismatch-" + name + ".bin").c_str(), "wb");
    if (f != nullptr) {
      std::fwrite(data, 1, bytes, f);
      std::fclose(f);
    }
  }
  return "first difference at byte " + std::to_string(first) + ": tensor " + std::to_string(i) +
         ", " + where + "; " + std::to_string(differ) + " of " + std::to_string(bytes) +
         " bytes differ (both buckets written to " + folder + "/mismatch-{gpu,cpu}.bin)";
}

// Shapes that exercise whole chunks, padded chunks, awkward divisors and vectors.
inline std::vector<dct::ChunkPlan> test_plans() {
  return {dct::make_chunk_plan({128, 192}, 64, dct::ChunkMode::Divisor),
          dct::make_chunk_plan({100, 70}, 32, dct::ChunkMode::Padded),
          dct::make_chunk_plan({96, 50}, 16, dct::ChunkMode::Divisor),
          dct::make_chunk_plan({1000}, 64, dct::ChunkMode::Padded)};
}

struct CpuReplica {  // one replica's state on the CPU path, portable kernels
  std::vector<at::Tensor> residuals;
  std::vector<uint8_t> payloads;
};

// The CPU encoder (what DemoReplicator's fast path does), with the portable kernels.
inline void cpu_encode(const std::vector<dct::ChunkPlan>& plans,
                       const std::vector<at::Tensor>& grads, double beta, double alpha, int64_t k,
                       ValueEncoding encoding, const std::vector<size_t>& offsets, size_t bytes,
                       CpuReplica& replica) {
  isa_testing::ScopedIsa portable(kernels::Isa::Portable);
  replica.payloads.assign(bytes, 0);
  for (size_t i = 0; i < plans.size(); ++i) {
    compress::TopK topk =
        kernels::dct_accumulate_topk(grads[i], plans[i], beta, alpha, replica.residuals[i], k);
    compress::encode_payload(plans[i], topk, encoding, replica.payloads.data() + offsets[i]);
    compress::add_selected(replica.residuals[i], plans[i], topk, -1.0f);
  }
}

inline bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.cpu().contiguous(), y = b.cpu().contiguous();
  return x.sizes() == y.sizes() &&
         std::memcmp(x.data_ptr(), y.data_ptr(), size_t(x.numel()) * x.element_size()) == 0;
}

// Three replicas encode two steps each on the device and on the CPU (portable kernels), then
// decode and step with sign-SGD and AdamW (with and without sign): payload bytes, residuals,
// parameters and moments must be equal bit for bit. Step: kernels::GpuStep's interface.
// tied_start: the residuals start as small integers (-3..3) and the first step has no gradients,
// so every chunk's top-k is cut inside groups of equal magnitudes (the lowest positions win).
template <typename Step>
void expect_gpu_step_equals_cpu(const Step& subject, const std::vector<dct::ChunkPlan>& plans,
                                int64_t k, ValueEncoding encoding, at::Device gpu,
                                bool tied_start = false) {
  const int replicas = 3;
  std::vector<size_t> offsets;
  for (size_t i = 0; i < plans.size(); ++i) offsets.push_back(subject.offset(i));
  at::manual_seed(7);

  // Three replicas, two steps each: the second step starts from the residual the first left.
  std::vector<CpuReplica> cpu(replicas);
  std::vector<std::vector<at::Tensor>> gpu_residuals(replicas);
  for (int r = 0; r < replicas; ++r) {
    for (const dct::ChunkPlan& p : plans) {
      const at::Tensor start = tied_start
                                   ? at::randint(-3, 4, {p.padded_rows, p.padded_cols}, at::kFloat)
                                   : at::zeros({p.padded_rows, p.padded_cols});
      cpu[r].residuals.push_back(start.clone());
      gpu_residuals[r].push_back(start.to(gpu));
    }
  }
  at::Tensor gathered_cpu = at::empty({int64_t(subject.bytes()) * replicas}, at::kByte);
  for (int step = 0; step < 2; ++step) {
    for (int r = 0; r < replicas; ++r) {
      std::vector<at::Tensor> grads;
      for (const dct::ChunkPlan& p : plans) {
        grads.push_back(step == 0 && tied_start ? at::Tensor() : at::randn({p.rows, p.cols}));
      }
      if (step == 1 && r == 0) grads[1] = at::Tensor();  // a tensor without gradient
      cpu_encode(plans, grads, 0.9, 0.01, k, encoding, offsets, subject.bytes(), cpu[r]);
      std::vector<at::Tensor> on_gpu;
      for (const at::Tensor& g : grads) on_gpu.push_back(g.defined() ? g.to(gpu) : g);
      const at::Tensor send =
          at::empty({int64_t(subject.bytes())}, at::device(gpu).dtype(at::kByte));
      subject.encode(on_gpu, gpu_residuals[r], 0.9, 0.01, send);
      subject.seal_on_device(send);  // headers and checksums by the kernels, as the CPU's
      at::Tensor host = send.cpu();
      ASSERT_EQ(std::memcmp(host.data_ptr<uint8_t>(), cpu[r].payloads.data(), subject.bytes()), 0)
          << "payloads differ: replica " << r << " step " << step << " " << name_of(encoding)
          << ": "
          << describe_mismatch(host.data_ptr<uint8_t>(), cpu[r].payloads.data(), subject.bytes(),
                               plans, offsets, k, encoding);
      for (size_t i = 0; i < plans.size(); ++i) {
        ASSERT_TRUE(bit_equal(gpu_residuals[r][i], cpu[r].residuals[i]))
            << "residual " << i << " replica " << r << " step " << step;
      }
      std::memcpy(gathered_cpu.data_ptr<uint8_t>() + r * subject.bytes(), host.data_ptr<uint8_t>(),
                  subject.bytes());
    }
  }
  subject.validate(gathered_cpu.data_ptr<uint8_t>(), replicas);
  subject.validate_on_device(gathered_cpu.to(gpu), replicas);
  // The screening's verdict against the host's screening of the same bytes: no error bit, and
  // each payload's sum of squares the host's (compress::scan_payload_values) bit for bit; with
  // the last replica's first payload scaled (re-sealed: only its values differ) its sum is the
  // host's of the scaled bytes, and with its values made NaN bit 8 is set there alone.
  const size_t tensors = plans.size();
  for (const double factor : {1.0, 1000.0, std::nan("")}) {
    at::Tensor screened = gathered_cpu.clone();
    uint8_t* bytes = screened.data_ptr<uint8_t>();
    const size_t tampered = size_t(replicas - 1) * subject.bytes() + subject.offset(0);
    if (factor != 1.0) {
      compress::tamper_payload(bytes + tampered, plans[0], k, encoding, compress::Tamper::Scale,
                               factor);
    }
    const kernels::GpuStep::Screened verdict = subject.screen_on_device(screened.to(gpu), replicas);
    ASSERT_EQ(verdict.errors.size(), size_t(replicas) * tensors);
    ASSERT_EQ(verdict.squares.size(), size_t(replicas) * tensors);
    for (int r = 0; r < replicas; ++r) {
      for (size_t i = 0; i < tensors; ++i) {
        const size_t e = size_t(r) * tensors + i;
        const compress::PayloadValues host = compress::scan_payload_values(
            bytes + size_t(r) * subject.bytes() + subject.offset(i), plans[i], k, encoding);
        const bool nan_here = std::isnan(factor) && e == size_t(replicas - 1) * tensors;
        EXPECT_EQ(verdict.errors[e], nan_here ? 8u : 0u) << "replica " << r << " tensor " << i;
        EXPECT_EQ(host.finite, !nan_here);
        if (!nan_here) {
          EXPECT_EQ(std::memcmp(&verdict.squares[e], &host.sum_squares, sizeof(double)), 0)
              << "replica " << r << " tensor " << i << ": " << verdict.squares[e] << " against "
              << host.sum_squares << " (factor " << factor << ")";
        }
      }
    }
  }
  // A flipped bit in the last replica's last body, or in a header: the kernels' check refuses both.
  for (const size_t at : {subject.bytes() * replicas - 3, subject.offset(1) + 9}) {
    at::Tensor bad = gathered_cpu.clone();
    bad.data_ptr<uint8_t>()[at] ^= 0x10;
    EXPECT_THROW(subject.validate_on_device(bad.to(gpu), replicas), compress::WireFormatError)
        << "byte " << at << " corrupted";
  }

  // Decode and step: sign-SGD, AdamW (with and without sign), the plain SGD step with its
  // direction bounded (at a bound some elements reach), against the CPU's; then the direction
  // itself (kernels::direction_hyper over zeros), against the CPU's inverse bit for bit.
  for (int variant = 0; variant < 5; ++variant) {
    const bool adamw = variant == 1 || variant == 2, direction = variant == 4;
    kernels::AdamWHyper hyper;
    hyper.lr = 0.01, hyper.weight_decay = 0.1, hyper.sign = variant < 2;
    hyper.step_bound = variant == 3 ? 1e-3 : 0.0;
    hyper.bias_correction1 = 1 - 0.9 * 0.9, hyper.bias_correction2 = 1 - 0.999 * 0.999;
    if (direction) hyper = kernels::direction_hyper();
    std::vector<at::Tensor> params, m, v, params_gpu, m_gpu, v_gpu, directions;
    for (const dct::ChunkPlan& p : plans) {
      params.push_back(direction ? at::zeros({p.rows, p.cols}) : at::randn({p.rows, p.cols}));
      params_gpu.push_back(params.back().to(gpu));
      if (adamw) {
        m.push_back(at::randn({p.rows, p.cols}) * 0.1);
        v.push_back(at::rand({p.rows, p.cols}) * 0.1);
        m_gpu.push_back(m.back().to(gpu));
        v_gpu.push_back(v.back().to(gpu));
      }
    }
    {
      isa_testing::ScopedIsa portable(kernels::Isa::Portable);
      for (size_t i = 0; i < plans.size(); ++i) {
        std::vector<const uint8_t*> payloads;
        for (int r = 0; r < replicas; ++r) {
          payloads.push_back(gathered_cpu.data_ptr<uint8_t>() + r * subject.bytes() +
                             subject.offset(i));
        }
        const compress::SparseChunks coeffs = compress::decode_mean_sparse(
            payloads, compress::wire_payload_bytes(plans[i], k, encoding), plans[i], k, encoding);
        if (direction) {
          const at::Tensor samples = at::empty({plans[i].padded_rows, plans[i].padded_cols});
          kernels::idct_sparse(coeffs, plans[i], samples);
          directions.push_back(
              samples.narrow(0, 0, plans[i].rows).narrow(1, 0, plans[i].cols).contiguous());
        }
        if (!adamw) {
          kernels::idct_sparse_sgd_step(
              coeffs, plans[i],
              {params[i], float(hyper.lr), float(1.0 - hyper.lr * hyper.weight_decay), hyper.sign,
               float(hyper.step_bound)});
        } else {
          kernels::AdamWStep step;
          static_cast<kernels::AdamWHyper&>(step) = hyper;
          step.param = params[i], step.exp_avg = m[i], step.exp_avg_sq = v[i];
          kernels::idct_sparse_adamw_step(coeffs, plans[i], step);
        }
      }
    }
    subject.decode_step(gathered_cpu.to(gpu), replicas, params_gpu, m_gpu, v_gpu, hyper);
    for (size_t i = 0; i < plans.size(); ++i) {
      EXPECT_TRUE(bit_equal(params_gpu[i], params[i])) << "param " << i << " variant " << variant;
      if (direction) {
        EXPECT_TRUE(bit_equal(params_gpu[i], directions[i])) << "direction " << i;
      }
      if (adamw) {
        EXPECT_TRUE(bit_equal(m_gpu[i], m[i])) << "exp_avg " << i << " variant " << variant;
        EXPECT_TRUE(bit_equal(v_gpu[i], v[i])) << "exp_avg_sq " << i << " variant " << variant;
      }
    }
  }
}

}  // namespace flexdemo::gpu_step_check
