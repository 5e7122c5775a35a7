// kernels::GpuStep: the host side of the CUDA DeMo kernels (cuda_kernels.cu) — chunk tables and
// DCT bases on the device, the per-step pointers, the launches on the current stream, and the
// payloads' headers and checksums on the host. Without FLEXDEMO_CUDA it only says so.
#include "demo/kernels.h"

#include "demo/cpu/chunk_kernels.h"
#include "demo/cuda/host_table.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#if defined(FLEXDEMO_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#endif

namespace flexdemo::kernels {

cuda::HostTable cuda::host_table(const std::vector<dct::ChunkPlan>& plans, int64_t k,
                                 compress::ValueEncoding encoding) {
  HostTable layout;
  for (size_t i = 0; i < plans.size(); ++i) {
    const dct::ChunkPlan& plan = plans[i];
    if (plan.chunk_numel() > kMaxChunkNumel) {
      throw std::invalid_argument("GPU DeMo kernels: chunks of " +
                                  std::to_string(plan.chunk_numel()) + " coefficients; at most " +
                                  std::to_string(kMaxChunkNumel) + " (a smaller --chunk)");
    }
    TensorDesc d;
    d.rows = plan.rows;
    d.cols = plan.cols;
    d.padded_cols = plan.padded_cols;
    d.chunk_h = int(plan.chunk_rows);
    d.chunk_w = int(plan.chunk_cols);
    d.col_chunks = plan.col_chunks();
    d.first_chunk = int64_t(layout.chunk_tensor.size());
    d.payload_offset = int64_t(layout.bytes);
    d.body = demo::codec::layout(plan.num_chunks(), plan.chunk_numel(), k, encoding);
    d.first_segment = int64_t(layout.segment_tensor.size());
    const int64_t segments = (d.body.body_bytes + kChecksumSegment - 1) / kChecksumSegment;
    layout.segment_tensor.insert(layout.segment_tensor.end(), size_t(segments), int32_t(i));
    layout.max_k = std::max(layout.max_k, int(d.body.k));
    {  // the header (the same every step), as the host writes it
      std::vector<uint8_t> payload(compress::wire_payload_bytes(plan, k, encoding), 0);
      compress::seal_payload(plan, k, encoding, payload.data());
      std::memcpy(d.header, payload.data(), sizeof(d.header));
    }
    layout.tensors.push_back(d);
    layout.chunk_tensor.insert(layout.chunk_tensor.end(), size_t(plan.num_chunks()), int32_t(i));
    layout.payload_bytes.push_back(compress::wire_payload_bytes(plan, k, encoding));
    layout.bytes += layout.payload_bytes.back();
    const int h = int(plan.chunk_rows), w = int(plan.chunk_cols);
    layout.encode_shared_floats = std::max(layout.encode_shared_floats, encode_shared_floats(h, w));
    layout.decode_shared_floats = std::max(layout.decode_shared_floats, decode_shared_floats(h, w));
  }
  return layout;
}

#if defined(FLEXDEMO_CUDA)

bool cuda_built() {
  return true;
}

namespace {

// The launches timed since the last gpu_phase_times(), and their events.
struct PhaseTimer {
  struct Pending {
    std::string phase;
    cudaEvent_t start, stop;
    GpuPhase work;
  };
  std::mutex mutex;
  bool on = false;
  std::vector<Pending> pending;
};
PhaseTimer& phase_timer() {
  static PhaseTimer timer;
  return timer;
}

// Times what is launched on `stream` during its life as one launch of `phase` (when enabled).
class PhaseScope {
 public:
  PhaseScope(const char* phase, cudaStream_t stream, double bytes, double fmas = 0.0)
      : stream_(stream) {
    PhaseTimer& t = phase_timer();
    std::lock_guard<std::mutex> lock(t.mutex);
    if (!t.on) return;
    entry_.phase = phase;
    entry_.work.bytes = bytes;
    entry_.work.fmas = fmas;
    entry_.work.launches = 1;
    cudaEventCreate(&entry_.start);
    cudaEventCreate(&entry_.stop);
    cudaEventRecord(entry_.start, stream_);
    timing_ = true;
  }
  ~PhaseScope() {
    if (!timing_) return;
    cudaEventRecord(entry_.stop, stream_);
    PhaseTimer& t = phase_timer();
    std::lock_guard<std::mutex> lock(t.mutex);
    t.pending.push_back(entry_);
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  cudaStream_t stream_;
  PhaseTimer::Pending entry_{};
  bool timing_ = false;
};

}  // namespace

void set_gpu_phase_timing(bool on) {
  PhaseTimer& t = phase_timer();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.on = on;
}

std::map<std::string, GpuPhase> gpu_phase_times() {
  PhaseTimer& t = phase_timer();
  std::lock_guard<std::mutex> lock(t.mutex);
  std::map<std::string, GpuPhase> out;
  for (PhaseTimer::Pending& p : t.pending) {
    float ms = 0.0f;
    if (cudaEventSynchronize(p.stop) == cudaSuccess) cudaEventElapsedTime(&ms, p.start, p.stop);
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.stop);
    GpuPhase& phase = out[p.phase];
    phase.ms += ms;
    phase.launches += 1;
    phase.bytes += p.work.bytes;
    phase.fmas += p.work.fmas;
  }
  t.pending.clear();
  return out;
}

bool cuda_available() {
  return at::hasCUDA();
}

struct GpuStep::Impl {
  std::vector<dct::ChunkPlan> plans;
  int64_t k = 1;
  compress::ValueEncoding encoding = compress::ValueEncoding::Bf16;
  at::Device device = at::kCPU;
  std::vector<size_t> offsets, sizes;  // per tensor, in one replica's bucket
  size_t bytes = 0;
  std::vector<cuda::TensorDesc> descs;  // host copy; the step's pointers are set per call
  // What each kernel must move through DRAM, and the encode's transforms' multiply-adds.
  double param_bytes = 0, residual_bytes = 0, encode_fmas = 0;
  at::Tensor descs_on_device;  // uint8, the descs
  at::Tensor chunk_tensor;     // int32 [chunks] on the device
  at::Tensor segment_tensor;   // int32 [checksum segments] on the device
  int64_t num_segments = 0;
  // DCT-II of size n on the device, Dct1d::full's layout (and full_t's, transposed).
  std::map<std::pair<int64_t, bool>, at::Tensor> bases;
  cuda::TensorTable table;

  const float* basis(int64_t n, bool transposed, int64_t* stride) {
    const Dct1d& plan = dct1d(n);
    *stride = plan.full_stride;
    at::Tensor& slot = bases[{n, transposed}];
    if (!slot.defined()) {
      const float* host = transposed ? plan.full_t : plan.full;
      slot = at::from_blob(const_cast<float*>(host), {n * plan.full_stride}, at::kFloat).to(device);
    }
    return slot.data_ptr<float>();
  }

  // The descs with this call's pointers, to the device, on the current stream without a host
  // sync: from a pinned copy that the caching host allocator keeps until the copy has run; the
  // launch's table.
  const cuda::TensorTable& upload() {
    const int64_t size = int64_t(descs.size() * sizeof(cuda::TensorDesc));
    const at::Tensor host = at::empty({size}, at::dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), descs.data(), size_t(size));
    descs_on_device.copy_(host, /*non_blocking=*/true);
    table.tensors = reinterpret_cast<const cuda::TensorDesc*>(descs_on_device.data_ptr());
    return table;
  }
};

GpuStep::GpuStep(const std::vector<dct::ChunkPlan>& plans, int64_t k,
                 compress::ValueEncoding encoding, at::Device device)
    : impl_(std::make_unique<Impl>()) {
  if (!device.is_cuda()) throw std::invalid_argument("GpuStep: a CUDA device is needed");
  Impl& m = *impl_;
  const c10::cuda::CUDAGuard guard(device);
  m.plans = plans;
  m.k = k;
  m.encoding = encoding;
  m.device = device;
  cuda::HostTable layout = cuda::host_table(plans, k, encoding);
  for (size_t i = 0; i < plans.size(); ++i) {
    cuda::TensorDesc& d = layout.tensors[i];
    d.basis_rows = m.basis(plans[i].chunk_rows, false, &d.basis_rows_stride);
    d.basis_cols = m.basis(plans[i].chunk_cols, false, &d.basis_cols_stride);
    d.basis_rows_t = m.basis(plans[i].chunk_rows, true, &d.basis_rows_stride);
    d.basis_cols_t = m.basis(plans[i].chunk_cols, true, &d.basis_cols_stride);
    m.offsets.push_back(size_t(d.payload_offset));
  }
  for (const dct::ChunkPlan& plan : plans) {
    m.param_bytes += 4.0 * double(plan.numel());
    m.residual_bytes += 4.0 * double(plan.padded_numel());
    m.encode_fmas += double(plan.num_chunks()) * double(plan.chunk_numel()) *
                     double(plan.chunk_rows + plan.chunk_cols);
  }
  m.descs = std::move(layout.tensors);
  m.sizes = std::move(layout.payload_bytes);
  m.bytes = layout.bytes;
  m.table.encode_shared_floats = layout.encode_shared_floats;
  m.table.decode_shared_floats = layout.decode_shared_floats;
  m.chunk_tensor =
      at::from_blob(layout.chunk_tensor.data(), {int64_t(layout.chunk_tensor.size())}, at::kInt)
          .to(device);
  m.descs_on_device = at::empty({int64_t(m.descs.size() * sizeof(cuda::TensorDesc))},
                                at::dtype(at::kByte).device(device));
  m.table.chunk_tensor = m.chunk_tensor.data_ptr<int32_t>();
  m.table.num_chunks = int64_t(layout.chunk_tensor.size());
  m.table.encoding = encoding;
  m.num_segments = int64_t(layout.segment_tensor.size());
  m.segment_tensor =
      at::from_blob(layout.segment_tensor.data(), {m.num_segments}, at::kInt).to(device);
  m.table.segment_tensor = m.segment_tensor.data_ptr<int32_t>();
  m.table.num_segments = m.num_segments;
  m.table.num_tensors = int64_t(m.descs.size());
  m.table.max_k = layout.max_k;
  demo::codec::crc_x2n_table(m.table.crc_x2n);
  m.upload();  // the layout's fields (headers, segments) before any step sets the pointers
}

GpuStep::~GpuStep() = default;

size_t GpuStep::bytes() const {
  return impl_->bytes;
}

size_t GpuStep::offset(size_t i) const {
  return impl_->offsets.at(i);
}

namespace {

// t as a float32 device tensor of `numel` elements the kernels may read or write in place.
float* device_floats(const at::Tensor& t, int64_t numel, at::Device device, const char* what) {
  if (!t.defined() || t.scalar_type() != at::kFloat || t.device() != device || !t.is_contiguous() ||
      t.numel() != numel) {
    throw std::invalid_argument(std::string("GpuStep: ") + what +
                                " must be a contiguous float32 tensor of " + std::to_string(numel) +
                                " elements on " + device.str());
  }
  return t.data_ptr<float>();
}

// t as `replicas` buckets of `bytes` on the device (uint8, contiguous).
void check_buckets(const at::Tensor& t, size_t bytes, int replicas, at::Device device,
                   const char* what) {
  if (t.scalar_type() != at::kByte || t.device() != device || !t.is_contiguous() ||
      size_t(t.numel()) != bytes * size_t(replicas)) {
    throw std::invalid_argument("GpuStep: " + std::string(what) + " must be " +
                                std::to_string(replicas) + " x " + std::to_string(bytes) +
                                " contiguous bytes on " + device.str());
  }
}

}  // namespace

void GpuStep::encode(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& residuals,
                     double beta, double alpha, const at::Tensor& send) const {
  Impl& m = *impl_;
  const c10::cuda::CUDAGuard guard(m.device);
  std::vector<at::Tensor> inputs;  // kept alive until the launch is queued
  for (size_t i = 0; i < m.plans.size(); ++i) {
    const dct::ChunkPlan& plan = m.plans[i];
    cuda::TensorDesc& d = m.descs[i];
    d.residual = device_floats(residuals.at(i), plan.padded_numel(), m.device, "a residual");
    d.grad = nullptr;
    if (grads.at(i).defined()) {
      inputs.push_back(grads[i].to(m.device, at::kFloat).contiguous());
      d.grad = device_floats(inputs.back(), plan.numel(), m.device, "a gradient");
    }
  }
  check_buckets(send, m.bytes, 1, m.device, "send");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(m.device.index()).stream();
  const cuda::TensorTable& table = m.upload();
  const PhaseScope timed("encode", stream, m.param_bytes + 2 * m.residual_bytes + double(m.bytes),
                         m.encode_fmas);
  cuda::encode(table, float(beta), float(alpha), send.data_ptr<uint8_t>(), int64_t(m.bytes),
               stream);
  for (const at::Tensor& r : residuals) r.unsafeGetTensorImpl()->bump_version();
}

void GpuStep::seal(uint8_t* payloads) const {
  for (size_t i = 0; i < impl_->plans.size(); ++i) {
    compress::seal_payload(impl_->plans[i], impl_->k, impl_->encoding,
                           payloads + impl_->offsets[i]);
  }
}

void GpuStep::validate(const uint8_t* gathered, int replicas) const {
  const Impl& m = *impl_;
  for (int r = 0; r < replicas; ++r) {
    for (size_t i = 0; i < m.plans.size(); ++i) {
      compress::validate_payload(gathered + r * m.bytes + m.offsets[i], m.sizes[i], m.plans[i], m.k,
                                 m.encoding);
    }
  }
}

void GpuStep::seal_on_device(const at::Tensor& send) const {
  Impl& m = *impl_;
  const c10::cuda::CUDAGuard guard(m.device);
  check_buckets(send, m.bytes, 1, m.device, "send");
  const at::Tensor scratch =
      at::empty({std::max<int64_t>(1, m.num_segments)}, at::dtype(at::kInt).device(m.device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(m.device.index()).stream();
  const PhaseScope timed("seal", stream, 2.0 * double(m.bytes));
  cuda::seal(m.table, send.data_ptr<uint8_t>(), reinterpret_cast<uint32_t*>(scratch.data_ptr()),
             stream);
}

GpuStep::Screened GpuStep::screen_on_device(const at::Tensor& gathered, int replicas) const {
  Impl& m = *impl_;
  const c10::cuda::CUDAGuard guard(m.device);
  check_buckets(gathered, m.bytes, replicas, m.device, "gathered");
  const int64_t n = replicas * int64_t(m.descs.size());
  // The verdict in one buffer, read back in one copy: n uint32 of errors, then (8-byte aligned)
  // n doubles of sums.
  const int64_t errors_bytes = (4 * n + 7) / 8 * 8;
  const at::Tensor verdict =
      at::empty({std::max<int64_t>(8, errors_bytes + 8 * n)}, at::dtype(at::kByte).device(m.device));
  uint8_t* base = verdict.data_ptr<uint8_t>();
  const at::Tensor scratch = at::empty({std::max<int64_t>(1, replicas * m.num_segments)},
                                       at::dtype(at::kInt).device(m.device));
  const at::Tensor chunk_squares =
      at::empty({std::max<int64_t>(1, replicas * m.table.num_chunks)},
                at::dtype(at::kDouble).device(m.device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(m.device.index()).stream();
  {
    const PhaseScope timed("validate", stream, 2.0 * double(m.bytes) * replicas);
    cuda::screen(m.table, gathered.data_ptr<uint8_t>(), int64_t(m.bytes), replicas,
                 reinterpret_cast<uint32_t*>(scratch.data_ptr()), chunk_squares.data_ptr<double>(),
                 reinterpret_cast<uint32_t*>(base), reinterpret_cast<double*>(base + errors_bytes),
                 stream);
  }
  const at::Tensor host = verdict.to(at::kCPU);  // waits for the kernels
  Screened out;
  out.errors.resize(size_t(n));
  out.squares.resize(size_t(n));
  if (n > 0) {
    std::memcpy(out.errors.data(), host.data_ptr<uint8_t>(), sizeof(uint32_t) * size_t(n));
    std::memcpy(out.squares.data(), host.data_ptr<uint8_t>() + errors_bytes,
                sizeof(double) * size_t(n));
  }
  return out;
}

void GpuStep::validate_on_device(const at::Tensor& gathered, int replicas) const {
  const int64_t tensors = int64_t(impl_->descs.size());
  const std::vector<uint32_t> errors = screen_on_device(gathered, replicas).errors;
  for (int64_t e = 0; e < replicas * tensors; ++e) {
    if ((errors[e] & 7u) == 0) continue;  // a value not finite is the screening's, not the format's
    const at::Tensor host = gathered.to(at::kCPU);  // the precise message, from the host's check
    validate(host.data_ptr<uint8_t>(), replicas);
    const char* what = errors[e] & 1 ? "header" : errors[e] & 2 ? "checksum" : "positions";
    throw compress::WireFormatError("payload of tensor " + std::to_string(e % tensors) +
                                    " from replica " + std::to_string(e / tensors) +
                                    ": the GPU's check found its " + what + " wrong");
  }
}

void GpuStep::decode_step(const at::Tensor& gathered, int replicas,
                          const std::vector<at::Tensor>& params,
                          const std::vector<at::Tensor>& exp_avg,
                          const std::vector<at::Tensor>& exp_avg_sq,
                          const AdamWHyper& hyper) const {
  Impl& m = *impl_;
  const c10::cuda::CUDAGuard guard(m.device);
  const bool adamw = !exp_avg.empty();
  for (size_t i = 0; i < m.plans.size(); ++i) {
    const int64_t numel = m.plans[i].numel();
    cuda::TensorDesc& d = m.descs[i];
    d.param = device_floats(params.at(i), numel, m.device, "a parameter");
    d.exp_avg = adamw ? device_floats(exp_avg.at(i), numel, m.device, "exp_avg") : nullptr;
    d.exp_avg_sq = adamw ? device_floats(exp_avg_sq.at(i), numel, m.device, "exp_avg_sq") : nullptr;
  }
  check_buckets(gathered, m.bytes, replicas, m.device, "gathered");
  const chunk_math::AdamWConstants constants = adamw_constants(hyper);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(m.device.index()).stream();
  const cuda::TensorTable& table = m.upload();
  {
    const PhaseScope timed("decode_step", stream,
                           (adamw ? 6.0 : 2.0) * m.param_bytes + double(m.bytes) * replicas);
    cuda::decode_step(table, gathered.data_ptr<uint8_t>(), int64_t(m.bytes), replicas,
                      sgd_constants(hyper), adamw ? &constants : nullptr, stream);
  }
  for (size_t i = 0; i < m.plans.size(); ++i) {  // written by the kernel, as ATen's ops would
    params[i].unsafeGetTensorImpl()->bump_version();
    if (adamw) {
      exp_avg[i].unsafeGetTensorImpl()->bump_version();
      exp_avg_sq[i].unsafeGetTensorImpl()->bump_version();
    }
  }
}

#else  // without CUDA

bool cuda_built() {
  return false;
}

void set_gpu_phase_timing(bool) {}

std::map<std::string, GpuPhase> gpu_phase_times() {
  return {};
}

bool cuda_available() {
  return false;
}

struct GpuStep::Impl {};

GpuStep::GpuStep(const std::vector<dct::ChunkPlan>&, int64_t, compress::ValueEncoding, at::Device) {
  throw std::runtime_error(
      "this flexdemo was built without CUDA (scripts/build.sh --cuda builds it with)");
}
GpuStep::~GpuStep() = default;
size_t GpuStep::bytes() const {
  return 0;
}
size_t GpuStep::offset(size_t) const {
  return 0;
}
void GpuStep::encode(const std::vector<at::Tensor>&, const std::vector<at::Tensor>&, double, double,
                     const at::Tensor&) const {}
void GpuStep::seal(uint8_t*) const {}
void GpuStep::validate(const uint8_t*, int) const {}
void GpuStep::seal_on_device(const at::Tensor&) const {}
void GpuStep::validate_on_device(const at::Tensor&, int) const {}
GpuStep::Screened GpuStep::screen_on_device(const at::Tensor&, int) const {
  return {};
}
void GpuStep::decode_step(const at::Tensor&, int, const std::vector<at::Tensor>&,
                          const std::vector<at::Tensor>&, const std::vector<at::Tensor>&,
                          const AdamWHyper&) const {}

#endif

}  // namespace flexdemo::kernels
