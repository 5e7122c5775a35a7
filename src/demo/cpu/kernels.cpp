// The fast path's tensor-level entry points: factorised DCT plans, the choice of instruction set,
// and the loops over chunks (in parallel, one scratch area per task) around the chunk kernels.
#include "demo/kernels.h"

#include "demo/codec.h"
#include "demo/cpu/chunk_kernels.h"
#include "flexdemo/compress.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <stdexcept>
#include <vector>

namespace flexdemo::kernels {

// ====== Instruction sets ======
std::string to_string(Isa isa) {
  switch (isa) {
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
    case Isa::Portable:
      return "portable";
    case Isa::Baseline:
      break;
  }
  return "baseline";
}

Isa parse_isa(const std::string& name) {
  for (Isa isa : {Isa::Baseline, Isa::Avx2, Isa::Avx512, Isa::Portable}) {
    if (name == to_string(isa)) return isa;
  }
  throw std::invalid_argument("unknown instruction set '" + name +
                              "'; accepted: baseline, avx2, avx512, portable");
}

bool supported(Isa isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case Isa::Avx2:
      return avx2;
    case Isa::Avx512:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
    case Isa::Baseline:
    case Isa::Portable:
      break;
  }
  return true;
}

namespace {

Isa initial_isa() {
  if (const char* env = std::getenv("FLEXDEMO_ISA"); env != nullptr && *env != '\0') {
    const Isa isa = parse_isa(env);
    if (!supported(isa)) {
      throw std::invalid_argument("FLEXDEMO_ISA=" + std::string(env) + ": this CPU lacks it");
    }
    return isa;
  }
  for (Isa isa : {Isa::Avx512, Isa::Avx2}) {
    if (supported(isa)) return isa;
  }
  return Isa::Baseline;
}

std::atomic<Isa>& isa_setting() {
  static std::atomic<Isa> isa{initial_isa()};
  return isa;
}

const KernelTable& table() {
  switch (active_isa()) {
    case Isa::Avx2:
      return avx2::table;
    case Isa::Avx512:
      return avx512::table;
    case Isa::Portable:
      return portable::table;
    case Isa::Baseline:
      break;
  }
  return baseline::table;
}

}  // namespace

Isa active_isa() {
  return isa_setting().load();
}

void set_active_isa(Isa isa) {
  if (!supported(isa)) {
    throw std::invalid_argument("instruction set " + to_string(isa) + ": this CPU lacks it");
  }
  isa_setting().store(isa);
}

namespace {

namespace codec = demo::codec;

// Written through its data pointer: what ATen's in-place ops do to the version counter (readers
// such as a sharded unit's prefetched gather see that the values changed).
void bump_version(const at::Tensor& t) {
  t.unsafeGetTensorImpl()->bump_version();
}

// The per-element constants of FlexDeMo's preconditioner at step t (bias: the root of 1 - beta2^t).
ChunkPrecondition precondition_constants(double beta2, double eps, int64_t step) {
  ChunkPrecondition c;
  c.beta2 = float(beta2);
  c.one_minus_beta2 = float(1.0 - beta2);
  c.bias = float(std::sqrt(1.0 - std::pow(beta2, double(step))));
  c.eps = float(eps);
  return c;
}

ChunkShape shape_of(const dct::ChunkPlan& plan) {
  ChunkShape s;
  s.h = int(plan.chunk_rows);
  s.w = int(plan.chunk_cols);
  s.along_rows = &dct1d(plan.chunk_rows);
  s.along_cols = &dct1d(plan.chunk_cols);
  return s;
}

// A task's scratch: 32-byte aligned floats, freed when the task ends.
struct Scratch {
  explicit Scratch(int64_t floats)
      : data(static_cast<float*>(
            ::operator new[](sizeof(float) * size_t(floats), std::align_val_t(64)))) {}
  ~Scratch() { ::operator delete[](data, std::align_val_t(64)); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* data;
};

void check_block(const at::Tensor& t, const dct::ChunkPlan& plan, const char* who,
                 const char* what) {
  if (t.scalar_type() != at::kFloat || !t.is_contiguous() || !t.is_cpu() ||
      t.numel() != plan.padded_numel()) {
    throw std::invalid_argument(std::string(who) + ": " + what +
                                " must be a contiguous float32 CPU tensor of " +
                                std::to_string(plan.padded_numel()) + " elements");
  }
}

// The samples as a contiguous float32 CPU tensor (converted only if they are not one already).
at::Tensor float_samples(const at::Tensor& x, const dct::ChunkPlan& plan, const char* who) {
  if (x.numel() != plan.numel()) {
    throw std::invalid_argument(std::string(who) + ": tensor has " + std::to_string(x.numel()) +
                                " elements, plan expects " + std::to_string(plan.numel()));
  }
  if (!x.is_cpu()) throw std::invalid_argument(std::string(who) + ": CPU tensors only");
  return x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
}

// Runs per_chunk(c, kernels, shape, scratch) for every chunk, in parallel.
template <typename PerChunk>
void for_each_chunk(const dct::ChunkPlan& plan, int64_t extra_floats, PerChunk per_chunk) {
  const ChunkShape shape = shape_of(plan);
  const KernelTable& k = table();
  const int64_t floats = scratch_floats(shape) + extra_floats;
  at::parallel_for(0, plan.num_chunks(), 4, [&](int64_t begin, int64_t end) {
    Scratch scratch(floats);
    for (int64_t c = begin; c < end; ++c) per_chunk(c, k, shape, scratch.data);
  });
}

// Chunk c in the (unpadded) tensor: its first element's offset and the rows and columns of it
// that lie inside the tensor (the rest is padding).
struct ChunkPlace {
  int64_t offset;
  int valid_h, valid_w;
};
ChunkPlace place_of(const dct::ChunkPlan& plan, int64_t c) {
  const int64_t h = plan.chunk_rows, w = plan.chunk_cols;
  const int64_t ci = c / plan.col_chunks(), cj = c % plan.col_chunks();
  return {ci * h * plan.cols + cj * w, int(std::min(h, plan.rows - ci * h)),
          int(std::min(w, plan.cols - cj * w))};
}

// Chunk c + 1 of the [rows, cols] tensors t (null ones skipped; none after the last chunk).
NextChunk next_chunk(const dct::ChunkPlan& plan, int64_t c, std::initializer_list<const float*> t) {
  NextChunk next;
  if (c + 1 >= plan.num_chunks()) return next;
  const ChunkPlace place = place_of(plan, c + 1);
  int i = 0;
  for (const float* p : t) next.rows[i++] = p != nullptr ? p + place.offset : nullptr;
  next.valid_h = place.valid_h;
  next.valid_w = place.valid_w;
  return next;
}

// Where a chunk's uint64 selection keys start after its n floats (8-byte aligned).
int64_t key_offset(int64_t n) {
  return (n + 1) / 2 * 2;
}

compress::TopK empty_topk(const dct::ChunkPlan& plan, int64_t k) {
  compress::TopK out;
  out.k = compress::clamp_topk(k, plan);
  out.indices = at::empty({plan.num_chunks(), out.k}, at::kLong);
  out.values = at::empty({plan.num_chunks(), out.k}, at::kFloat);
  return out;
}

// Where dct_accumulate_encode writes one tensor's payload body.
struct PayloadOut {
  compress::ValueEncoding encoding;
  codec::Layout layout;
  uint8_t* body;  // zeroed
};

// Chunk c's top-k (ascending positions pos, values val: replaced by what a receiver decodes)
// into the payload body, and that taken out of the chunk's residual: per chunk what
// compress::encode_payload and compress::add_selected(-1) do per tensor. Bytes shared with
// neighbouring chunks (packed fields) are ORed in atomically: other tasks write those chunks.
void encode_chunk(const PayloadOut& out, const dct::ChunkPlan& plan, int64_t c, const int64_t* pos,
                  float* val, float* residual) {
  codec::put_chunk<codec::AtomicBytes>(out.body, out.layout, out.encoding, c, pos, val);
  const int64_t w = plan.chunk_cols;
  if ((w & (w - 1)) == 0) {  // offset_in_chunk by a shift and a mask, not a division per entry
    const int shift = __builtin_ctzll(uint64_t(w));
    for (int64_t j = 0; j < out.layout.k; ++j)
      residual[(pos[j] >> shift) * plan.padded_cols + (pos[j] & (w - 1))] += -1.0f * val[j];
    return;
  }
  for (int64_t j = 0; j < out.layout.k; ++j)
    residual[plan.offset_in_chunk(pos[j])] += -1.0f * val[j];
}

// The shared loop of dct_accumulate, dct_accumulate_topk (topk not null) and
// dct_accumulate_encode (payload not null); pre: the samples preconditioned as they are read.
void accumulate(const at::Tensor& x, const dct::ChunkPlan& plan, double beta, double alpha,
                const at::Tensor& residual, compress::TopK* topk, const PayloadOut* payload,
                const Preconditioning* pre) {
  const char* who = payload != nullptr ? "dct_accumulate_encode"
                    : topk != nullptr  ? "dct_accumulate_topk"
                                       : "dct_accumulate";
  check_block(residual, plan, who, "residual");
  if (pre != nullptr) {
    const at::Tensor& v = pre->grad_sq;
    if (v.numel() != plan.numel() || v.scalar_type() != at::kFloat || !v.is_contiguous() ||
        !v.is_cpu()) {
      throw std::invalid_argument(std::string(who) + ": grad_sq must be a contiguous float32 CPU " +
                                  "tensor of " + std::to_string(plan.numel()) + " elements");
    }
  }
  const bool select = topk != nullptr || payload != nullptr;
  const int64_t k = topk != nullptr ? topk->k : payload != nullptr ? payload->layout.k : 0;
  if (!x.defined()) {
    if (pre != nullptr) pre->grad_sq.mul_(pre->beta2);
    residual.mul_(beta);
    if (topk != nullptr) *topk = select_topk(residual, plan, topk->k);
    return;
  }
  const at::Tensor samples = float_samples(x, plan, who);
  const float* src = samples.data_ptr<float>();
  float* dst = residual.data_ptr<float>();
  float* v = pre != nullptr ? pre->grad_sq.data_ptr<float>() : nullptr;
  const ChunkPrecondition constants =
      pre != nullptr ? precondition_constants(pre->beta2, pre->eps, pre->step) : ChunkPrecondition{};
  const int64_t n = plan.chunk_numel();
  int64_t* idx = topk != nullptr ? topk->indices.data_ptr<int64_t>() : nullptr;
  float* val = topk != nullptr ? topk->values.data_ptr<float>() : nullptr;
  // With a selection: the chunk's new values contiguously (n floats), then the selection's
  // scratch (select_scratch(n) uint64), then (for a payload) the chunk's top-k: k int64
  // positions and k floats.
  const int64_t selection = key_offset(n) + 2 * select_scratch(n);
  const int64_t extra = select ? selection + (payload != nullptr ? 3 * k : 0) : 0;
  for_each_chunk(
      plan, extra,
      [&](int64_t c, const KernelTable& kern, const ChunkShape& shape, float* scratch) {
        const ChunkPlace place = place_of(plan, c);
        float* fresh = select ? scratch + scratch_floats(shape) : nullptr;
        float* chunk_residual = dst + plan.chunk_origin(c);
        // The next chunk's samples asked for while this one runs, and its residual too where
        // the residual's rows are the samples' (no padding): read from memory at the update, it
        // stalled the update's loads (issue 54's profile). The running mean square is laid out
        // as the samples.
        ChunkPrecondition chunk_pre = constants;
        if (v != nullptr) chunk_pre.v = v + place.offset;
        kern.dct_accumulate(shape, src + place.offset, plan.cols, place.valid_h, place.valid_w,
                            chunk_residual, plan.padded_cols, float(beta), float(alpha), fresh,
                            scratch,
                            next_chunk(plan, c, {src, plan.is_padded() ? nullptr : dst, v}),
                            v != nullptr ? &chunk_pre : nullptr);
        if (!select) return;
        int64_t* pos = idx != nullptr ? idx + c * k : reinterpret_cast<int64_t*>(fresh + selection);
        float* vals = val != nullptr ? val + c * k : fresh + selection + 2 * k;
        kern.select_topk(fresh, n, k, pos, vals,
                         reinterpret_cast<uint64_t*>(fresh + key_offset(n)));
        if (payload != nullptr) {
          encode_chunk(*payload, plan, c, pos, vals, chunk_residual);
        }
      });
  if (pre != nullptr) bump_version(pre->grad_sq);
}

// The inverse of every chunk's coefficients: into dst, the block-layout samples, or with `step`
// (valid_h, valid_w and the moments' pointers set per chunk) applied as that step to dst, the
// [rows, cols] parameters (and moments m and v laid out alike).
void inverse_chunks(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan, float* dst,
                    const StepUpdate* step, const char* who) {
  if (coeffs.counts.numel() != plan.num_chunks()) {
    throw std::invalid_argument(std::string(who) + ": " + std::to_string(coeffs.counts.numel()) +
                                " chunks given, the plan has " + std::to_string(plan.num_chunks()));
  }
  const int64_t capacity = coeffs.positions.size(1);
  const int32_t* positions = coeffs.positions.data_ptr<int32_t>();
  const float* values = coeffs.values.data_ptr<float>();
  const int64_t* counts = coeffs.counts.data_ptr<int64_t>();
  for_each_chunk(plan, 0,
                 [&](int64_t c, const KernelTable& kern, const ChunkShape& shape, float* scratch) {
                   const int32_t* pos = positions + c * capacity;
                   const float* val = values + c * capacity;
                   if (step == nullptr) {
                     kern.idct_sparse(shape, pos, val, counts[c], dst + plan.chunk_origin(c),
                                      plan.padded_cols, nullptr, scratch);
                     return;
                   }
                   const ChunkPlace place = place_of(plan, c);
                   StepUpdate update = *step;
                   update.valid_h = place.valid_h;
                   update.valid_w = place.valid_w;
                   update.next = next_chunk(plan, c, {dst, step->m, step->v});
                   if (step->m != nullptr) {
                     update.m = step->m + place.offset;
                     update.v = step->v + place.offset;
                   }
                   kern.idct_sparse(shape, pos, val, counts[c], dst + place.offset, plan.cols,
                                    &update, scratch);
                 });
}

}  // namespace

int64_t scratch_floats(const ChunkShape& shape) {
  const int64_t h8 = (shape.h + 7) / 8 * 8, w8 = (shape.w + 7) / 8 * 8;
  // two blocks, then (idct_sparse) an h x max(h, w8) matrix and 3h int32 slots; keep 32-byte steps
  return (2 * h8 * w8 + shape.h * std::max<int64_t>(shape.h, w8) + 3 * shape.h + 7) / 8 * 8;
}

// ====== Entry points ======
void dct_accumulate(const at::Tensor& x, const dct::ChunkPlan& plan, double beta, double alpha,
                    const at::Tensor& residual, const Preconditioning* pre) {
  accumulate(x, plan, beta, alpha, residual, nullptr, nullptr, pre);
}

compress::TopK dct_accumulate_topk(const at::Tensor& x, const dct::ChunkPlan& plan, double beta,
                                   double alpha, const at::Tensor& residual, int64_t k) {
  compress::TopK topk = empty_topk(plan, k);
  accumulate(x, plan, beta, alpha, residual, &topk, nullptr, nullptr);
  return topk;
}

void dct_accumulate_encode(const at::Tensor& x, const dct::ChunkPlan& plan, double beta,
                           double alpha, const at::Tensor& residual, int64_t k,
                           compress::ValueEncoding encoding, uint8_t* dst,
                           const Preconditioning* pre) {
  if (!x.defined()) {  // the residual only decays: the separate steps
    if (pre != nullptr) pre->grad_sq.mul_(pre->beta2);
    compress::TopK topk = dct_accumulate_topk(x, plan, beta, alpha, residual, k);
    compress::encode_payload(plan, topk, encoding, dst);
    compress::add_selected(residual, plan, topk, -1.0f);
    return;
  }
  const codec::Layout l =
      codec::layout(plan.num_chunks(), plan.chunk_numel(), compress::clamp_topk(k, plan), encoding);
  const PayloadOut out{encoding, l, dst + codec::kHeaderBytes};
  std::memset(out.body, 0, size_t(l.body_bytes));
  accumulate(x, plan, beta, alpha, residual, nullptr, &out, pre);
  compress::seal_payload(plan, l.k, encoding, dst);
}

compress::TopK select_topk(const at::Tensor& coeffs, const dct::ChunkPlan& plan, int64_t k) {
  check_block(coeffs, plan, "select_topk", "coefficients");
  compress::TopK topk = empty_topk(plan, k);
  const int64_t h = plan.chunk_rows, w = plan.chunk_cols, n = plan.chunk_numel();
  const float* src = coeffs.data_ptr<float>();
  int64_t* idx = topk.indices.data_ptr<int64_t>();
  float* val = topk.values.data_ptr<float>();
  const KernelTable& kern = table();
  at::parallel_for(0, plan.num_chunks(), 4, [&](int64_t begin, int64_t end) {
    Scratch scratch(key_offset(n) + 2 * select_scratch(n));  // the chunk, then selection's
    for (int64_t c = begin; c < end; ++c) {
      const float* base = src + plan.chunk_origin(c);
      for (int64_t u = 0; u < h; ++u) {
        std::copy(base + u * plan.padded_cols, base + u * plan.padded_cols + w,
                  scratch.data + u * w);
      }
      kern.select_topk(scratch.data, n, topk.k, idx + c * topk.k, val + c * topk.k,
                       reinterpret_cast<uint64_t*>(scratch.data + key_offset(n)));
    }
  });
  return topk;
}

void idct_sparse(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                 const at::Tensor& samples) {
  check_block(samples, plan, "idct_sparse", "samples");
  inverse_chunks(coeffs, plan, samples.data_ptr<float>(), nullptr, "idct_sparse");
}

namespace {

// A tensor a fused step writes: float32 CPU [plan.rows, plan.cols], rows contiguous.
float* step_target(const at::Tensor& t, const dct::ChunkPlan& plan, const char* who,
                   const char* what) {
  if (!t.defined() || t.scalar_type() != at::kFloat || !t.is_cpu() || t.dim() != 2 ||
      t.size(0) != plan.rows || t.size(1) != plan.cols || t.stride(1) != 1 ||
      t.stride(0) != plan.cols) {
    throw std::invalid_argument(std::string(who) + ": " + what + " must be a float32 CPU tensor [" +
                                std::to_string(plan.rows) + ", " + std::to_string(plan.cols) +
                                "] with contiguous rows");
  }
  return t.data_ptr<float>();
}

}  // namespace

void idct_sparse_sgd_step(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                          const SgdStep& step) {
  const char* who = "idct_sparse_sgd_step";
  StepUpdate update;
  update.sgd = {step.lr, step.keep, step.sign, step.bound};
  inverse_chunks(coeffs, plan, step_target(step.param, plan, who, "param"), &update, who);
  bump_version(step.param);
}

AdamWHyper direction_hyper() {
  AdamWHyper h;
  h.lr = -1.0;
  h.weight_decay = -1.0;  // keep = 1 - lr * weight_decay = 0
  h.sign = false;
  h.step_bound = 0.0;
  return h;
}

chunk_math::SgdConstants sgd_constants(const AdamWHyper& step) {
  return {float(step.lr), float(1.0 - step.lr * step.weight_decay), step.sign,
          float(step.step_bound)};
}

chunk_math::AdamWConstants adamw_constants(const AdamWHyper& step) {
  chunk_math::AdamWConstants c;
  c.lr = float(step.lr / step.bias_correction1);
  c.keep = float(1.0 - step.lr * step.weight_decay);
  c.beta1 = float(step.beta1);
  c.one_minus_beta1 = float(1.0 - step.beta1);
  c.beta2 = float(step.beta2);
  c.one_minus_beta2 = float(1.0 - step.beta2);
  c.sqrt_bc2 = float(std::sqrt(step.bias_correction2));
  c.eps = float(step.eps);
  c.sign = step.sign;
  return c;
}

void idct_sparse_adamw_step(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                            const AdamWStep& step) {
  const char* who = "idct_sparse_adamw_step";
  StepUpdate update;
  update.m = step_target(step.exp_avg, plan, who, "exp_avg");
  update.v = step_target(step.exp_avg_sq, plan, who, "exp_avg_sq");
  update.adamw = adamw_constants(step);
  inverse_chunks(coeffs, plan, step_target(step.param, plan, who, "param"), &update, who);
  for (const at::Tensor& t : {step.param, step.exp_avg, step.exp_avg_sq}) bump_version(t);
}

void precondition(const at::Tensor& grad, const at::Tensor& grad_sq, const at::Tensor& out,
                  double beta2, double eps, int64_t step) {
  for (const at::Tensor* t : {&grad_sq, &out}) {
    if (t->numel() != grad.numel() || t->scalar_type() != at::kFloat || !t->is_contiguous()) {
      throw std::invalid_argument("precondition: grad_sq and out must be contiguous float32 of " +
                                  std::to_string(grad.numel()) + " elements");
    }
  }
  const double bias = std::sqrt(1.0 - std::pow(beta2, double(step)));
  const at::Tensor g = grad.reshape(grad_sq.sizes()).to(at::kFloat).contiguous();
  if (!g.is_cpu() || !grad_sq.is_cpu() || !out.is_cpu()) {
    grad_sq.mul_(beta2).addcmul_(g, g, 1.0 - beta2);
    out.view(grad_sq.sizes()).copy_(g / (grad_sq.sqrt() / bias).add_(eps));
    return;
  }
  const float* gp = g.data_ptr<float>();
  float* vp = grad_sq.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const KernelTable& k = table();
  const ChunkPrecondition c = precondition_constants(beta2, eps, step);
  at::parallel_for(0, g.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    k.precondition(gp + begin, vp + begin, op + begin, end - begin, c.beta2, c.one_minus_beta2,
                   c.bias, c.eps);
  });
  bump_version(grad_sq);
  bump_version(out);
}

bool all_finite(const at::Tensor& x) {
  if (!x.is_cpu() || x.scalar_type() != at::kFloat || !x.is_contiguous()) {
    return at::isfinite(x).all().item<bool>();
  }
  return table().all_finite(x.data_ptr<float>(), x.numel());
}

double sum_squares(const at::Tensor& x) {
  const bool rows_contiguous = x.dim() == 1   ? x.is_contiguous()
                               : x.dim() == 2 ? x.stride(1) == 1 || x.size(1) <= 1
                                              : false;
  if (!x.is_cpu() || x.scalar_type() != at::kFloat || !rows_contiguous) {
    return x.to(at::kDouble).square().sum().item<double>();
  }
  const int64_t rows = x.dim() == 2 ? x.size(0) : 1, cols = x.dim() == 2 ? x.size(1) : x.numel();
  const int64_t stride = x.dim() == 2 ? x.stride(0) : cols;
  if (rows == 0 || cols == 0) return 0.0;
  const float* base = x.data_ptr<float>();
  // Blocks of whole rows, about 64k elements each: their sums in order, whatever the threads.
  const int64_t block_rows = std::max<int64_t>(1, (int64_t(1) << 16) / cols);
  const int64_t blocks = (rows + block_rows - 1) / block_rows;
  std::vector<double> partial(size_t(blocks), 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      double acc[8] = {};
      for (int64_t r = b * block_rows; r < std::min(rows, (b + 1) * block_rows); ++r) {
        const float* row = base + r * stride;
        int64_t j = 0;
        for (; j + 8 <= cols; j += 8) {
          for (int q = 0; q < 8; ++q) acc[q] += double(row[j + q]) * double(row[j + q]);
        }
        for (; j < cols; ++j) acc[0] += double(row[j]) * double(row[j]);
      }
      partial[size_t(b)] =
          ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    }
  });
  double sum = 0.0;
  for (double s : partial) sum += s;
  return sum;
}

}  // namespace flexdemo::kernels
