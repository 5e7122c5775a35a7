// The DeMo step on one kind of device, behind one interface: encode a bucket of tensors into
// payloads, and decode the replicas' payloads of a bucket into each tensor's update. Three
// implementations: plain (the reference: whole-tensor matrix-product DCTs, heap top-k, dense
// decode) and cpu (the fused per-chunk kernels of kernels.h, per instruction set), which share
// host_backend.cpp's payload handling, and cuda (cuda_backend.cpp: kernels::GpuStep, one launch to
// encode a bucket, one to decode and update it). The replicator (replicator.cpp) calls only
// this; it never branches on the device. A backend knows nothing of the optimizer above it: it
// receives what its kernels need (BackendOptions), never the optimizer's options.
#pragma once

#include "flexdemo/compress.h"
#include "flexdemo/dct.h"
#include "demo/kernels.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace flexdemo::optim {
struct PeerFault;  // flexdemo/optim.h
}

namespace flexdemo::comm {
class Work;
}

namespace flexdemo::demo {

// Some tensors' payloads, all-gathered in one collective; a bucket keeps the top-k and values it
// was encoded with while it is in flight.
struct Bucket {
  std::vector<size_t> tensors;  // the replicator's tensor indices
  std::vector<size_t> offsets;  // of each tensor's payload in the bucket
  size_t bytes = 0;             // one replica's payloads
  int64_t topk = 0;
  compress::ValueEncoding values = compress::ValueEncoding::Bf16;
  at::Tensor send;  // uint8 [bytes]: this replica's payloads (the backend's buffer)
  at::Tensor recv;  // uint8 [replicas * bytes]: every replica's, rank order
  std::unique_ptr<comm::Work> work;
};

// The update of one tensor, fused into its decode where the backend can: SGD
// (param = keep * param - lr * g, keep = 1 - lr * weight_decay, g = sign(direction), or with
// hyper.sign off the direction clamped to hyper.step_bound) or AdamW (its formula on
// sign(direction), or the direction with hyper.sign off), from this step's numbers.
struct Update {
  enum class Rule { Sgd, AdamW } rule = Rule::Sgd;
  at::Tensor param;  // float32 [rows, cols], rows contiguous
  kernels::AdamWHyper hyper;
  // SGD with hyper.sign off, the direction scaled by a factor s decided above the backend from
  // its sum of squares over this tensor's elements (the RMS cap). Where set, the backend calls
  // measured(squares, step) with that sum, and step(s) applies the direction times s, at once or
  // later (the factor may wait for other shards' sums; step keeps what it needs). The CPU
  // kernels fuse it for unpadded chunks (the sum from the coefficients: the transform is
  // orthonormal); the GPU's leave it to `apply`.
  std::function<void(double squares, std::function<void(double s)> step)> measured;
  at::Tensor exp_avg, exp_avg_sq;  // AdamW
};
// Per tensor (the replicator's index) its fused update, or none: then `apply` (the inner
// optimizer's dense step) gets the tensor's direction, float32 [rows, cols], valid during the call.
struct Updates {
  std::vector<std::optional<Update>> fused;
  std::function<void(size_t tensor, const at::Tensor& direction)> apply;
};

// What the kernels need: the residual's decay, the transform, which CPU path, and the first
// layout (the GPU's prepares its tables for it; a bucket carries its own top-k and values).
struct BackendOptions {
  double decay = 0.999;        // residual = decay * residual + lr * DCT(grad)
  bool dct = true;             // the chunked DCT; false: the samples themselves (plain path only)
  bool fast_path = true;       // CPU: the fused kernels; false: the plain reference
  int64_t topk = 32;           // coefficients a chunk
  compress::ValueEncoding values = compress::ValueEncoding::Fp32;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // A bucket's byte buffer of `bytes` where this backend and the replica group want it.
  virtual at::Tensor buffer(int64_t bytes) const = 0;
  // Whether a bucket may hold some of the tensors (the replicator's early buckets); if not,
  // every bucket holds every tensor, in order.
  virtual bool partial_buckets() const { return true; }
  // Offers to precondition the tensor's next gradient (that of its next accumulate or encode)
  // as its transform reads it: true if this backend will (then that gradient comes unscaled and
  // p.grad_sq is updated then), false if the caller must precondition it first
  // (kernels::precondition). The CPU's fast path fuses it; the others decline.
  virtual bool precondition_as_read(size_t tensor, const kernels::Preconditioning& p) {
    (void)tensor;
    (void)p;
    return false;
  }
  // Without exchanging: residual = decay * residual + lr * DCT(grad) (grad: plan.numel()
  // elements, undefined = zero).
  virtual void accumulate(size_t tensor, const at::Tensor& grad, double lr) = 0;
  // Each of the bucket's tensors (grads[k] is tensors[k]'s): accumulate, top-k of every chunk,
  // its payload (header and checksum included) into b.send, and what a receiver decodes from it
  // taken out of the residual (error feedback).
  virtual void encode(Bucket& b, const std::vector<at::Tensor>& grads, double lr) = 0;
  // screen.h's checks of `replicas` buckets of payloads in `gathered` (rank order; b's layout):
  // every failure, by tensor and then replica (PeerFault::tensor: the tensor's place in b). The
  // CPU's backends screen on the host; the GPU's by kernels, waiting only for their verdict.
  virtual std::vector<optim::PeerFault> screen(const Bucket& b, const at::Tensor& gathered,
                                               int replicas, double scale_bound) const = 0;
  // From `replicas` buckets of payloads in `gathered` (rank order; b's layout), each screened
  // already (screen.h: screen_payloads; or this replica's own, whole): per coefficient the mean
  // of the replicas that sent it (summed in rank order, so bit-identical on every replica), the
  // inverse DCT, and each tensor's update.
  virtual void decode(const Bucket& b, const at::Tensor& gathered, int replicas,
                      const Updates& updates) = 0;
};

// screen_payloads of a bucket on the host (gathered copied there if it lies elsewhere); plans:
// the backend's, which b.tensors index.
std::vector<optim::PeerFault> screen_on_host(const std::vector<dct::ChunkPlan>& plans,
                                             const Bucket& b, const at::Tensor& gathered,
                                             int replicas, double scale_bound);

// The backend for these options and the state's device: cuda for a GPU, cpu for the fast path,
// plain otherwise (and for transform none). residuals: the replicator's, float32 block layout.
// replica_device: where the replica group's collectives want their buffers.
std::unique_ptr<Backend> make_backend(const std::vector<dct::ChunkPlan>& plans,
                                      const BackendOptions& options,
                                      const std::vector<at::Tensor>& residuals, at::Device device,
                                      at::Device replica_device);

// The implementations (host_backend.cpp, cuda_backend.cpp).
std::unique_ptr<Backend> make_plain_backend(const std::vector<dct::ChunkPlan>& plans,
                                            const BackendOptions& options,
                                            const std::vector<at::Tensor>& residuals);
std::unique_ptr<Backend> make_cpu_backend(const std::vector<dct::ChunkPlan>& plans,
                                          const BackendOptions& options,
                                          const std::vector<at::Tensor>& residuals);
// On a GPU: the CUDA kernels, after a check on this GPU (once per process) that they agree with
// the CPU's portable kernels bit for bit; if they do not (or FLEXDEMO_GPU_FALLBACK=1), one
// warning line and the host-staged backend instead.
std::unique_ptr<Backend> make_cuda_backend(const std::vector<dct::ChunkPlan>& plans,
                                           const BackendOptions& options,
                                           const std::vector<at::Tensor>& residuals,
                                           at::Device device, at::Device replica_device);
// The CPU's backend (fast or plain path) for tensors on another device: gradients, residuals,
// payloads and updated tensors cross to the host and back every step. Slow; the GPU's fallback.
std::unique_ptr<Backend> make_host_staged_backend(const std::vector<dct::ChunkPlan>& plans,
                                                  const BackendOptions& options,
                                                  const std::vector<at::Tensor>& residuals,
                                                  at::Device replica_device);

}  // namespace flexdemo::demo
