// demo/kernels.h (private) — DeMo's CPU fast path: fused per-chunk kernels for the chunked DCT, the
// residual update and top-k, and the inverse DCT of sparse coefficients (optionally applying the
// inner optimizer's step as it goes). Each kernel exists for
// several instruction sets (chosen at run time: the best this CPU has, or FLEXDEMO_ISA) and is
// checked against the plain path (dct.h's matrix products, compress.h's heap top-k). "portable"
// is the GPU kernels' arithmetic run on the CPU (dense transforms, bit-identical to the GPU).
#pragma once

#include "flexdemo/compress.h"
#include "flexdemo/dct.h"

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace flexdemo::kernels {

enum class Isa { Baseline, Avx2, Avx512, Portable };
std::string to_string(Isa isa);          // "baseline" "avx2" "avx512" "portable"
Isa parse_isa(const std::string& name);  // inverse of to_string
bool supported(Isa isa);                 // whether this CPU runs it
// The instruction set the kernels use: at start the best supported one, or FLEXDEMO_ISA when set.
Isa active_isa();
void set_active_isa(Isa isa);  // throws std::invalid_argument if this CPU lacks it

// FlexDeMo's preconditioner (precondition() below) on a gradient as the transform reads it:
// dct_accumulate(x, ..., &p) takes the same bits as precondition(x, p.grad_sq, out, p.beta2, p.eps,
// p.step) followed by dct_accumulate(out, ...), without writing and reading out. grad_sq:
// contiguous float32 of the gradient's element count, updated in place (an undefined x decays
// it, as precondition's caller does for a missing gradient).
struct Preconditioning {
  at::Tensor grad_sq;
  double beta2 = 0.999, eps = 1e-8;
  int64_t step = 1;
};

// residual = beta * residual + alpha * DCT(x) (dct::chunked_dct_accumulate's contract, float32
// residual in block layout); x undefined scales the residual only. beta = 0 overwrites. pre: x
// preconditioned as it is read.
void dct_accumulate(const at::Tensor& x, const dct::ChunkPlan& plan, double beta, double alpha,
                    const at::Tensor& residual, const Preconditioning* pre = nullptr);
// The same, then every chunk's top-k of the new residual (compress::select_topk's result),
// chunk by chunk while it is in cache.
compress::TopK dct_accumulate_topk(const at::Tensor& x, const dct::ChunkPlan& plan, double beta,
                                   double alpha, const at::Tensor& residual, int64_t k);
// All of one tensor's encode, chunk by chunk while each is in cache (what the GPU's encode does):
// dct_accumulate, every chunk's top-k, its payload (compress::wire_payload_bytes(plan, k,
// encoding) bytes, header and checksum included) written to dst, and what a receiver decodes
// taken out of the residual (error feedback). Equal, byte for byte and bit for bit, to
// dct_accumulate_topk, compress::encode_payload and compress::add_selected(..., -1). pre: x
// preconditioned as it is read (see dct_accumulate).
void dct_accumulate_encode(const at::Tensor& x, const dct::ChunkPlan& plan, double beta,
                           double alpha, const at::Tensor& residual, int64_t k,
                           compress::ValueEncoding encoding, uint8_t* dst,
                           const Preconditioning* pre = nullptr);
// Per-chunk top-k of block-layout coefficients by partial selection.
compress::TopK select_topk(const at::Tensor& coeffs, const dct::ChunkPlan& plan, int64_t k);

// Inverse DCT of per-chunk sparse coefficients (compress::decode_mean_sparse's result) into
// samples: a contiguous float32 [padded_rows, padded_cols] tensor, overwritten. Equal to
// dct::chunked_idct_into of the dense coefficients up to float rounding; deterministic.
void idct_sparse(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                 const at::Tensor& samples);

// SGD with decoupled weight decay, param = keep * param - lr * g, where g is DeMo's
// sign(direction), or with sign off the direction clamped to [-bound, bound] (bound 0: not
// clamped), and direction is what idct_sparse would write: applied chunk by chunk as it is made,
// so the direction never goes through memory. param: float32 [plan.rows, plan.cols], rows
// contiguous.
struct SgdStep {
  at::Tensor param;
  float lr = 0.0f;
  float keep = 1.0f;  // 1 - lr * weight_decay
  bool sign = true;
  float bound = 0.0f;
};
void idct_sparse_sgd_step(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                          const SgdStep& step);

// The AdamW step (torch.optim.AdamW's formula, with decoupled weight decay) fed with
// sign(direction), or the direction with sign off, applied the same way: the parameters and
// both moments are updated chunk by chunk as the direction is made. All three float32
// [plan.rows, plan.cols], rows contiguous. bias_correction1/2: 1 - beta1^t, 1 - beta2^t.
struct AdamWHyper {
  double lr = 0.0, weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double bias_correction1 = 1.0, bias_correction2 = 1.0;
  bool sign = true;
  double step_bound = 0.0;  // the SGD rule's, with sign off (SgdStep::bound)
};
// The SGD numbers with which a fused step over a parameter of zeros writes the direction itself:
// keep 0, lr -1, no sign or bound (keep * p - lr * x is x exactly).
AdamWHyper direction_hyper();
struct AdamWStep : AdamWHyper {
  at::Tensor param, exp_avg, exp_avg_sq;
};
void idct_sparse_adamw_step(const compress::SparseChunks& coeffs, const dct::ChunkPlan& plan,
                            const AdamWStep& step);

// FlexDeMo's preconditioner (AdamW's denominator on a replica's own gradient): in place on
// grad_sq, grad_sq = beta2 * grad_sq + (1 - beta2) * g^2, and into out
// g / (sqrt(grad_sq) / sqrt(1 - beta2^step) + eps), g the gradient as float32 (grad_sq and out:
// contiguous float32 of the gradient's element count). On the CPU one pass of the kernels;
// elsewhere the same formula in ATen's ops.
void precondition(const at::Tensor& grad, const at::Tensor& grad_sq, const at::Tensor& out,
                  double beta2, double eps, int64_t step);

// Whether x holds no infinity or NaN: a float32 CPU tensor in one pass of the kernels, stopping at
// the first block with one; any other through ATen.
bool all_finite(const at::Tensor& x);

// The sum of x's squares in float64: what the RMS cap and --update-rms measure a direction by.
// A float32 CPU tensor whose rows are contiguous (a narrowed view included) takes one pass and
// no temporaries, summed in fixed blocks in a fixed order (the same bits on every replica, for
// any thread count); any other goes through ATen.
double sum_squares(const at::Tensor& x);

// ====== GPU (CUDA builds) ======
// The same step on a GPU: one bucket of tensors (the same every step), one kernel launch for
// encoding them all and one for decoding and stepping, each element computed as the "portable"
// CPU kernels compute it (bit-identical payloads and updates). The chunk tables and DCT bases
// are built on the device once.
bool cuda_built();      // this build has the CUDA kernels (FLEXDEMO_CUDA)
bool cuda_available();  // ... and this process sees a GPU

// GPU time per phase of GpuStep (CUDA events around each launch), for benchmarks: off until
// enabled. gpu_phase_times() waits for the launches recorded since the last call and returns, per
// phase (encode, seal, validate, decode_step), their milliseconds summed, how many there were and
// the bytes they must move through DRAM (and, for the encode, the transforms' multiply-adds).
struct GpuPhase {
  double ms = 0.0;
  int64_t launches = 0;
  double bytes = 0.0;
  double fmas = 0.0;
};
void set_gpu_phase_timing(bool on);
std::map<std::string, GpuPhase> gpu_phase_times();

class GpuStep {
 public:
  // Throws std::runtime_error in a build without CUDA; chunks of at most 16384 coefficients.
  GpuStep(const std::vector<dct::ChunkPlan>& plans, int64_t k, compress::ValueEncoding encoding,
          at::Device device);
  ~GpuStep();
  GpuStep(const GpuStep&) = delete;
  GpuStep& operator=(const GpuStep&) = delete;

  size_t bytes() const;           // one replica's payloads, back to back
  size_t offset(size_t i) const;  // of tensor i's payload
  // For every tensor: residual = beta * residual + alpha * DCT(grad) (grads: plan.numel()
  // elements on the device, undefined = zero; residuals: float32 block layout on the device),
  // top-k, error feedback, and the payload's body into send (uint8 [bytes()] on the device); then
  // seal_on_device (or seal() on a host copy) writes the headers and checksums.
  void encode(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& residuals,
              double beta, double alpha, const at::Tensor& send) const;
  void seal(uint8_t* payloads) const;  // host memory, bytes(): headers and checksums
  // Throws compress::WireFormatError unless each of `replicas` buckets (host) is intact.
  void validate(const uint8_t* gathered, int replicas) const;
  // The same two on the device, by kernels on the current stream: seal_on_device writes the
  // headers and checksums into send (uint8 [bytes()] on the device); validate_on_device checks
  // `replicas` buckets (uint8 on the device) by screen_on_device (on a failure a host copy is
  // checked again, for the precise message) and throws compress::WireFormatError as validate
  // does.
  void seal_on_device(const at::Tensor& send) const;
  void validate_on_device(const at::Tensor& gathered, int replicas) const;
  // What the screening (demo/screen.h) needs of `replicas` buckets (uint8 on the device), by
  // kernels, the host waiting only for this verdict (12 bytes a replica and tensor): per replica
  // r and tensor i, at r * tensors + i, the error bits (1 the header, 2 the checksum, 4 a chunk's
  // positions, 8 a value that is not finite) and the values' sum of squares, summed in
  // codec.h's order as compress::scan_payload_values sums them (the same bits).
  struct Screened {
    std::vector<uint32_t> errors;
    std::vector<double> squares;
  };
  Screened screen_on_device(const at::Tensor& gathered, int replicas) const;
  // From `replicas` validated buckets (uint8 on the device, rank order): per coefficient the mean
  // of the replicas that sent it, the inverse DCT, and the sign-SGD step (lr, weight decay from
  // hyper; exp_avg empty) or AdamW's on each params[i] (float32 [rows, cols], contiguous).
  void decode_step(const at::Tensor& gathered, int replicas, const std::vector<at::Tensor>& params,
                   const std::vector<at::Tensor>& exp_avg,
                   const std::vector<at::Tensor>& exp_avg_sq, const AdamWHyper& hyper) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flexdemo::kernels
