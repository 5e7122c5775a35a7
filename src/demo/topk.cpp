// Per-chunk top-k by magnitude over block-layout coefficients (the plain path: a bounded heap per
// chunk; kernels::select_topk is the fast one), and adding values back at the selected positions
// (error feedback).
#include "flexdemo/compress.h"

#include "demo/chunk_math.h"
#include "demo/codec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <utility>

namespace flexdemo::compress {

int64_t clamp_topk(int64_t k, const dct::ChunkPlan& plan) {
  return demo::codec::clamp_k(k, plan.chunk_numel());
}

namespace {

void check_coeffs(const at::Tensor& coeffs, const dct::ChunkPlan& plan, const char* who) {
  if (coeffs.scalar_type() != at::kFloat || !coeffs.is_contiguous() || !coeffs.is_cpu() ||
      coeffs.numel() != plan.padded_numel()) {
    throw std::invalid_argument(std::string(who) +
                                ": coefficients must be a contiguous float32 CPU tensor of " +
                                std::to_string(plan.padded_numel()) + " elements");
  }
}

}  // namespace

// A min-heap of keys per chunk whose top is the weakest coefficient kept so far.
TopK select_topk_plain(const at::Tensor& coeffs, const dct::ChunkPlan& plan, int64_t k_requested) {
  check_coeffs(coeffs, plan, "select_topk");
  const int64_t k = clamp_topk(k_requested, plan);
  const int64_t h = plan.chunk_rows, w = plan.chunk_cols, stride = plan.padded_cols;
  TopK out;
  out.k = k;
  out.indices = at::empty({plan.num_chunks(), k}, at::kLong);
  out.values = at::empty({plan.num_chunks(), k}, at::kFloat);
  const float* src = coeffs.data_ptr<float>();
  int64_t* idx_out = out.indices.data_ptr<int64_t>();
  float* val_out = out.values.data_ptr<float>();
  at::parallel_for(0, plan.num_chunks(), 16, [&](int64_t begin, int64_t end) {
    const auto stronger = std::greater<uint64_t>();
    std::vector<uint64_t> heap(k);
    std::vector<int64_t> kept;
    for (int64_t c = begin; c < end; ++c) {
      const float* base = src + plan.chunk_origin(c);
      int64_t filled = 0;
      for (int64_t u = 0; u < h; ++u) {
        const float* row = base + u * stride;
        for (int64_t v = 0; v < w; ++v) {
          const uint64_t key = kernels::chunk_math::topk_key(row[v], u * w + v);
          if (filled < k) {
            heap[filled++] = key;
            if (filled == k) std::make_heap(heap.begin(), heap.end(), stronger);
          } else if (key > heap.front()) {
            std::pop_heap(heap.begin(), heap.end(), stronger);
            heap.back() = key;
            std::push_heap(heap.begin(), heap.end(), stronger);
          }
        }
      }
      kept.clear();
      for (uint64_t key : heap) kept.push_back(kernels::chunk_math::key_position(key));
      std::sort(kept.begin(), kept.end());
      for (int64_t j = 0; j < k; ++j) {
        idx_out[c * k + j] = kept[j];
        val_out[c * k + j] = base[plan.offset_in_chunk(kept[j])];
      }
    }
  });
  return out;
}

void add_selected(const at::Tensor& coeffs, const dct::ChunkPlan& plan, const TopK& topk,
                  float alpha) {
  check_coeffs(coeffs, plan, "add_selected");
  float* dst = coeffs.data_ptr<float>();
  const int64_t* idx = topk.indices.data_ptr<int64_t>();
  const float* val = topk.values.data_ptr<float>();
  const int64_t k = topk.k;
  at::parallel_for(0, plan.num_chunks(), 64, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      float* base = dst + plan.chunk_origin(c);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t pos = idx[c * k + j];
        base[plan.offset_in_chunk(pos)] += alpha * val[c * k + j];
      }
    }
  });
}

}  // namespace flexdemo::compress
