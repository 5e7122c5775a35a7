// flexdemo's DeMo step as torch custom ops (torch.ops.flexdemo.*), over the library's backends
// (src/demo/backend.h): the fused CPU kernels for CPU tensors, the CUDA kernels for GPU tensors.
// The ops exchange nothing: the Python optimizer (flexdemo/optim.py) all-gathers the payloads
// through torch.distributed between encode and decode.
//
// A step's tensors travel as one bucket: each tensor's payload (wire format, header and checksum
// included) back to back in the order given, payload_bytes() each. Every op names the tensors'
// layout the same way: chunk (target edge), chunk_mode ("divisor": the reference DeMo's,
// "padded"), topk (per chunk; clamped to a smaller chunk, as the reference does) and values (the
// wire encoding: fp32, bf16, int8, 1bit, 2bit, fp8).
#include "demo/backend.h"
#include "demo/screen.h"

#include "flexdemo/comm.h"  // a Bucket's Work (complete for its destructor)
#include "flexdemo/compress.h"
#include "flexdemo/dct.h"
#include "flexdemo/kernels.h"
#include "flexdemo/optim.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace flexdemo::ops {
namespace {

using TensorList = c10::List<std::optional<at::Tensor>>;

// What every op is told about the tensors' layout, and what follows from it.
struct Layout {
  std::vector<dct::ChunkPlan> plans;
  int64_t chunk = 64;
  dct::ChunkMode chunk_mode = dct::ChunkMode::Divisor;
  demo::BackendOptions options;  // topk, values, decay
  std::vector<size_t> offsets;      // of each tensor's payload in the bucket
  size_t bytes = 0;                 // one replica's payloads
};

template <typename E>
E parse_option(const std::string& op, const std::string& name) {
  try {
    return parse_name<E>(name);
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, "flexdemo." + op + ": " + e.what());
  }
}

Layout layout_of(const std::string& op, at::TensorList params, int64_t chunk,
                 const std::string& chunk_mode, int64_t topk, const std::string& values) {
  TORCH_CHECK_VALUE(chunk > 0, "flexdemo.", op, ": chunk ", chunk, "; it must be > 0");
  TORCH_CHECK_VALUE(topk > 0, "flexdemo.", op, ": topk ", topk, "; it must be > 0");
  Layout l;
  l.chunk = chunk;
  l.chunk_mode = parse_option<dct::ChunkMode>(op, chunk_mode);
  l.options.topk = topk;
  l.options.values = parse_option<compress::ValueEncoding>(op, values);
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_VALUE(p.numel() > 0, "flexdemo.", op, ": tensor ", i, " has no elements");
    TORCH_CHECK_VALUE(p.device() == params[0].device(), "flexdemo.", op, ": tensor ", i, " on ",
                      p.device(), ", tensor 0 on ", params[0].device(), "; one device a bucket");
    l.plans.push_back(dct::make_chunk_plan(p.sizes(), chunk, l.chunk_mode));
    l.offsets.push_back(l.bytes);
    l.bytes += compress::wire_payload_bytes(l.plans.back(), topk, l.options.values);
  }
  return l;
}

demo::Bucket bucket_of(const Layout& l) {
  demo::Bucket b;
  for (size_t i = 0; i < l.plans.size(); ++i) b.tensors.push_back(i);
  b.offsets = l.offsets;
  b.bytes = l.bytes;
  b.topk = l.options.topk;
  b.values = l.options.values;
  return b;
}

// The backend for a layout on a device, reused while the layout and the residuals stay the same
// (the CUDA backend builds its chunk tables once per layout).
std::shared_ptr<demo::Backend> backend_for(const Layout& l,
                                           const std::vector<at::Tensor>& residuals,
                                           at::Device device, at::Device bucket_device) {
  using Key = std::tuple<std::string, std::vector<int64_t>, std::vector<const void*>>;
  std::vector<int64_t> numbers = {l.options.topk, int64_t(l.options.values),
                                  int64_t(l.chunk_mode), l.chunk};
  for (const dct::ChunkPlan& p : l.plans) {
    numbers.insert(numbers.end(), {p.rows, p.cols, p.chunk_rows, p.chunk_cols});
  }
  std::vector<const void*> storage;
  for (const at::Tensor& r : residuals) storage.push_back(r.data_ptr());
  Key key{device.str() + "/" + bucket_device.str() + "/" + std::to_string(l.options.decay), numbers,
          storage};
  static std::mutex mutex;
  static std::map<Key, std::shared_ptr<demo::Backend>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= 8) cache.clear();  // a few optimizers' layouts at a time
  std::shared_ptr<demo::Backend> backend;
  if (device.is_cuda()) {
    backend = demo::make_cuda_backend(l.plans, l.options, residuals, device, bucket_device);
  } else {
    backend = demo::make_cpu_backend(l.plans, l.options, residuals);
  }
  cache.emplace(key, backend);
  return backend;
}

void check_params(const std::string& op, at::TensorList params) {
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].scalar_type() == at::kFloat && params[i].is_contiguous(),
                      "flexdemo.", op, ": tensor ", i, " is ", params[i].scalar_type(),
                      params[i].is_contiguous() ? "" : ", not contiguous",
                      "; the step updates contiguous float32 tensors");
  }
}

std::vector<at::Tensor> checked_residuals(const std::string& op, const Layout& l,
                                          at::TensorList params, at::TensorList residuals) {
  TORCH_CHECK_VALUE(residuals.size() == params.size(), "flexdemo.", op, ": ", residuals.size(),
                    " residuals for ", params.size(), " tensors");
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < residuals.size(); ++i) {
    const at::Tensor& r = residuals[i];
    const dct::ChunkPlan& plan = l.plans[i];
    TORCH_CHECK_VALUE(r.scalar_type() == at::kFloat && r.is_contiguous() &&
                          r.numel() == plan.padded_numel() && r.device() == params[i].device(),
                      "flexdemo.", op, ": residual ", i, " must be contiguous float32 of ",
                      plan.padded_numel(), " elements on ", params[i].device(),
                      " (residual_shape), not ", r.scalar_type(), " ", r.sizes(), " on ",
                      r.device());
    out.push_back(r.view({plan.padded_rows, plan.padded_cols}));
  }
  return out;
}

std::vector<at::Tensor> checked_grads(const std::string& op, at::TensorList params,
                                      const TensorList& grads) {
  TORCH_CHECK_VALUE(grads.size() == params.size(), "flexdemo.", op, ": ", grads.size(),
                    " gradients for ", params.size(), " tensors");
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < grads.size(); ++i) {
    const std::optional<at::Tensor> g = grads[i];
    if (!g || !g->defined()) {
      out.emplace_back();
      continue;
    }
    TORCH_CHECK_VALUE(g->numel() == params[i].numel() && g->device() == params[i].device(),
                      "flexdemo.", op, ": gradient ", i, " is ", g->sizes(), " on ", g->device(),
                      ", its tensor ", params[i].sizes(), " on ", params[i].device());
    out.push_back(g->to(at::kFloat).contiguous());
  }
  return out;
}

void check_bytes(const std::string& op, const at::Tensor& t, int64_t expected, const char* what) {
  TORCH_CHECK_VALUE(
      t.scalar_type() == at::kByte && t.is_contiguous() && t.dim() == 1 && t.numel() == expected,
      "flexdemo.", op, ": ", what, " must be contiguous uint8 of ", expected,
      " bytes (payload_bytes), not ", t.scalar_type(), " ", t.sizes());
}

// ====== The ops ======

std::vector<int64_t> payload_bytes(at::TensorList params, int64_t chunk,
                                   const std::string& chunk_mode, int64_t topk,
                                   const std::string& values) {
  const Layout l = layout_of("payload_bytes", params, chunk, chunk_mode, topk, values);
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < l.plans.size(); ++i) {
    sizes.push_back(int64_t(compress::wire_payload_bytes(l.plans[i], topk, l.options.values)));
  }
  return sizes;
}

std::vector<int64_t> residual_shape(const at::Tensor& param, int64_t chunk,
                                    const std::string& chunk_mode) {
  const Layout l = layout_of("residual_shape", {param}, chunk, chunk_mode, 1, "fp32");
  return {l.plans[0].padded_rows, l.plans[0].padded_cols};
}

void accumulate(at::TensorList params, const TensorList& grads, at::TensorList residuals,
                int64_t chunk, const std::string& chunk_mode, double decay, double lr) {
  Layout l = layout_of("accumulate", params, chunk, chunk_mode, 1, "fp32");
  l.options.decay = decay;
  const std::vector<at::Tensor> r = checked_residuals("accumulate", l, params, residuals);
  const std::vector<at::Tensor> g = checked_grads("accumulate", params, grads);
  if (params.empty()) return;
  const auto backend = backend_for(l, r, params[0].device(), params[0].device());
  for (size_t i = 0; i < g.size(); ++i) backend->accumulate(i, g[i], lr);
}

void encode(at::TensorList params, const TensorList& grads, at::TensorList residuals,
            const at::Tensor& payloads, int64_t chunk, const std::string& chunk_mode, int64_t topk,
            const std::string& values, double decay, double lr) {
  Layout l = layout_of("encode", params, chunk, chunk_mode, topk, values);
  l.options.decay = decay;
  const std::vector<at::Tensor> r = checked_residuals("encode", l, params, residuals);
  const std::vector<at::Tensor> g = checked_grads("encode", params, grads);
  check_bytes("encode", payloads, int64_t(l.bytes), "payloads");
  if (params.empty()) return;
  demo::Bucket b = bucket_of(l);
  b.send = payloads;
  backend_for(l, r, params[0].device(), payloads.device())->encode(b, g, lr);
}

// FlexDeMo's preconditioner, one pass per tensor: v = beta2 * v + (1 - beta2) * g^2, and into out
// g / (sqrt(v) / sqrt(1 - beta2^step) + eps) (AdamW's denominator, on this replica's own
// gradient), instead of the six passes and two temporaries of the same formula in foreach ops.
// v and out: float32, contiguous, g's size; g of any floating dtype and layout
// (kernels::precondition).
void precondition(at::TensorList grads, at::TensorList grad_sq, at::TensorList out, double beta2,
                  double eps, int64_t step) {
  const std::string op = "precondition";
  TORCH_CHECK_VALUE(grad_sq.size() == grads.size() && out.size() == grads.size(), "flexdemo.", op,
                    ": ", grad_sq.size(), " grad_sq and ", out.size(), " out for ", grads.size(),
                    " gradients");
  TORCH_CHECK_VALUE(step >= 1, "flexdemo.", op, ": step ", step, "; it counts from 1");
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "flexdemo.", op, ": beta2 ", beta2,
                    "; it must be in [0, 1)");
  check_params(op, grad_sq);
  check_params(op, out);
  for (size_t i = 0; i < grads.size(); ++i) {
    for (const at::Tensor& t : {grad_sq[i], out[i]}) {
      TORCH_CHECK_VALUE(grads[i].numel() == t.numel() && grads[i].device() == t.device(),
                        "flexdemo.", op, ": gradient ", i, " has ", grads[i].numel(),
                        " elements on ", grads[i].device(), ", its grad_sq or out ", t.numel(),
                        " on ", t.device());
    }
    kernels::precondition(grads[i], grad_sq[i], out[i], beta2, eps, step);
  }
}

// decode_sgd and decode_adamw: from `replicas` buckets in `gathered` (rank order), every
// payload validated, the mean per coefficient, the inverse DCT and the update of each param.
void decode(const std::string& op, const at::Tensor& gathered, int64_t replicas,
            at::TensorList params, const Layout& l, const demo::Updates& updates) {
  TORCH_CHECK_VALUE(replicas >= 1, "flexdemo.", op, ": replicas ", replicas, "; it must be >= 1");
  check_bytes(op, gathered, int64_t(l.bytes) * replicas, "gathered");
  check_params(op, params);
  if (params.empty()) return;
  const demo::Bucket b = bucket_of(l);
  backend_for(l, {}, params[0].device(), gathered.device())
      ->decode(b, gathered, int(replicas), updates);
}

// SGD: param = (1 - lr * weight_decay) * param - lr * g, g = sign(direction) (DeMo's), or with
// sign off the direction, first scaled down to RMS rms_cap where its tensor's RMS is above it,
// then clamped to [-step_bound, step_bound] (0: neither). Fused into the decode (the CPU kernels
// take the RMS from the coefficients) but for rms_cap over padded chunks or on a GPU, where the
// whole direction is decoded first.
void decode_sgd(const at::Tensor& gathered, int64_t replicas, at::TensorList params, int64_t chunk,
                const std::string& chunk_mode, int64_t topk, const std::string& values, double lr,
                double weight_decay, bool sign, double step_bound, double rms_cap) {
  const std::string op = "decode_sgd";
  const Layout l = layout_of(op, params, chunk, chunk_mode, topk, values);
  TORCH_CHECK_VALUE(step_bound >= 0.0, "flexdemo.", op, ": step_bound ", step_bound,
                    "; it must be >= 0 (0: none)");
  TORCH_CHECK_VALUE(rms_cap >= 0.0, "flexdemo.", op, ": rms_cap ", rms_cap,
                    "; it must be >= 0 (0: none)");
  const bool capped = !sign && rms_cap > 0.0;
  demo::Updates updates;
  for (size_t i = 0; i < params.size(); ++i) {
    std::optional<demo::Update>& u = updates.fused.emplace_back();
    if (capped && l.plans[i].is_padded()) continue;  // the cap is fused for unpadded chunks
    u.emplace();
    u->rms_cap = capped ? rms_cap : 0.0;
    u->param = params[i].view({l.plans[i].rows, l.plans[i].cols});
    u->hyper.lr = lr;
    u->hyper.weight_decay = weight_decay;
    u->hyper.sign = sign;
    u->hyper.step_bound = sign ? 0.0 : step_bound;
  }
  updates.apply = [&](size_t i, const at::Tensor& direction) {
    at::Tensor p = params[i].view({l.plans[i].rows, l.plans[i].cols});
    if (weight_decay != 0.0) p.mul_(1.0 - lr * weight_decay);
    const double rms = std::sqrt(kernels::sum_squares(direction) / double(direction.numel()));
    const double scale = rms > rms_cap ? rms_cap / rms : 1.0;
    if (step_bound > 0.0) {
      p.sub_((scale != 1.0 ? direction * scale : direction).clamp(-step_bound, step_bound), lr);
    } else {
      p.add_(direction, -lr * scale);  // one pass, no temporary
    }
  };
  decode(op, gathered, replicas, params, l, updates);
}

void decode_adamw(const at::Tensor& gathered, int64_t replicas, at::TensorList params,
                  at::TensorList exp_avg, at::TensorList exp_avg_sq, int64_t chunk,
                  const std::string& chunk_mode, int64_t topk, const std::string& values, double lr,
                  double weight_decay, double beta1, double beta2, double eps, int64_t step,
                  bool sign) {
  const std::string op = "decode_adamw";
  const Layout l = layout_of(op, params, chunk, chunk_mode, topk, values);
  TORCH_CHECK_VALUE(step >= 1, "flexdemo.", op, ": step ", step, "; it counts from 1");
  TORCH_CHECK_VALUE(exp_avg.size() == params.size() && exp_avg_sq.size() == params.size(),
                    "flexdemo.", op, ": ", exp_avg.size(), " exp_avg and ", exp_avg_sq.size(),
                    " exp_avg_sq for ", params.size(), " tensors");
  check_params(op, exp_avg);
  check_params(op, exp_avg_sq);
  demo::Updates updates;
  for (size_t i = 0; i < params.size(); ++i) {
    const dct::ChunkPlan& plan = l.plans[i];
    TORCH_CHECK_VALUE(exp_avg[i].numel() == plan.numel() && exp_avg_sq[i].numel() == plan.numel(),
                      "flexdemo.", op, ": tensor ", i, "'s moments are not its shape");
    demo::Update& u = updates.fused.emplace_back().emplace();
    u.rule = demo::Update::Rule::AdamW;
    u.param = params[i].view({plan.rows, plan.cols});
    u.exp_avg = exp_avg[i].view({plan.rows, plan.cols});
    u.exp_avg_sq = exp_avg_sq[i].view({plan.rows, plan.cols});
    u.hyper.lr = lr;
    u.hyper.weight_decay = weight_decay;
    u.hyper.beta1 = beta1;
    u.hyper.beta2 = beta2;
    u.hyper.eps = eps;
    u.hyper.bias_correction1 = 1.0 - std::pow(beta1, double(step));
    u.hyper.bias_correction2 = 1.0 - std::pow(beta2, double(step));
    u.hyper.sign = sign;
  }
  decode(op, gathered, replicas, params, l, updates);
}

// Faulty peers: every payload of `replicas` buckets in `gathered` checked before a value is
// decoded (demo/screen.h: structure and checksum, finite values, the values' norm against
// scale_bound times the replicas' lower median). One row per failure, float64 on the CPU:
// (replica, tensor, kind: 0 corrupt, 1 non-finite, 2 out of scale, ratio).
at::Tensor screen(const at::Tensor& gathered, int64_t replicas, at::TensorList params,
                  int64_t chunk, const std::string& chunk_mode, int64_t topk,
                  const std::string& values, double scale_bound) {
  const std::string op = "screen";
  const Layout l = layout_of(op, params, chunk, chunk_mode, topk, values);
  TORCH_CHECK_VALUE(replicas >= 1, "flexdemo.", op, ": replicas ", replicas, "; it must be >= 1");
  TORCH_CHECK_VALUE(scale_bound == 0.0 || scale_bound > 1.0, "flexdemo.", op, ": scale_bound ",
                    scale_bound, "; it must be 0 (no scale check) or > 1");
  check_bytes(op, gathered, int64_t(l.bytes) * replicas, "gathered");
  const at::Tensor host = gathered.is_cpu() ? gathered : gathered.to(at::kCPU);
  const std::vector<optim::PeerFault> faults =
      demo::screen_payloads(host.data_ptr<uint8_t>(), int(replicas), l.bytes, l.plans, l.offsets,
                            topk, l.options.values, scale_bound);
  at::Tensor rows = at::empty({int64_t(faults.size()), 4}, at::kDouble);
  double* row = rows.data_ptr<double>();
  for (const optim::PeerFault& f : faults) {
    *row++ = f.replica;
    *row++ = double(f.tensor);
    *row++ = double(int(f.kind));
    *row++ = f.ratio;
  }
  return rows;
}

// A test aid: the bucket's payloads tampered as a faulty sender would (compress::tamper_payload):
// how "scale" (every value factor times, NaN for non-finite; re-sealed) or "corrupt".
void tamper_(const at::Tensor& payloads, at::TensorList params, int64_t chunk,
             const std::string& chunk_mode, int64_t topk, const std::string& values,
             const std::string& how, double factor) {
  const std::string op = "tamper_";
  const Layout l = layout_of(op, params, chunk, chunk_mode, topk, values);
  check_bytes(op, payloads, int64_t(l.bytes), "payloads");
  TORCH_CHECK_VALUE(how == "scale" || how == "corrupt", "flexdemo.", op, ": how '", how,
                    "'; accepted: scale, corrupt");
  at::Tensor host = payloads.is_cpu() ? payloads : payloads.to(at::kCPU);
  for (size_t i = 0; i < l.plans.size(); ++i) {
    compress::tamper_payload(
        host.data_ptr<uint8_t>() + l.offsets[i], l.plans[i], topk, l.options.values,
        how == "scale" ? compress::Tamper::Scale : compress::Tamper::Corrupt, factor);
  }
  if (!payloads.is_cpu()) payloads.copy_(host);
}

bool cuda_built() {
  return kernels::cuda_built();
}

}  // namespace

TORCH_LIBRARY(flexdemo, m) {
  const std::string layout = "int chunk, str chunk_mode, int topk, str values";
  m.def(("payload_bytes(Tensor[] params, " + layout + ") -> int[]").c_str());
  m.def("residual_shape(Tensor param, int chunk, str chunk_mode) -> int[]");
  m.def(
      "accumulate(Tensor[] params, Tensor?[] grads, Tensor(a!)[] residuals, int chunk, "
      "str chunk_mode, float decay, float lr) -> ()");
  m.def(("encode(Tensor[] params, Tensor?[] grads, Tensor(a!)[] residuals, Tensor(b!) payloads, " +
         layout + ", float decay, float lr) -> ()")
            .c_str());
  m.def(("decode_sgd(Tensor gathered, int replicas, Tensor(a!)[] params, " + layout +
         ", float lr, float weight_decay, bool sign, float step_bound, float rms_cap) -> ()")
            .c_str());
  m.def(("decode_adamw(Tensor gathered, int replicas, Tensor(a!)[] params, Tensor(b!)[] exp_avg, "
         "Tensor(c!)[] exp_avg_sq, " +
         layout +
         ", float lr, float weight_decay, float beta1, float beta2, float eps, int step, "
         "bool sign) -> ()")
            .c_str());
  m.def(("screen(Tensor gathered, int replicas, Tensor[] params, " + layout +
         ", float scale_bound) -> Tensor")
            .c_str());
  m.def(
      ("tamper_(Tensor(a!) payloads, Tensor[] params, " + layout + ", str how, float factor) -> ()")
          .c_str());
  m.def(
      "precondition(Tensor[] grads, Tensor(a!)[] grad_sq, Tensor(b!)[] out, float beta2, "
      "float eps, int step) -> ()");
  m.def("cuda_built() -> bool", &cuda_built);
}

TORCH_LIBRARY_IMPL(flexdemo, CompositeExplicitAutograd, m) {
  m.impl("payload_bytes", &payload_bytes);
  m.impl("residual_shape", &residual_shape);
  m.impl("screen", &screen);
  m.impl("tamper_", &tamper_);
}

// One implementation for both devices: the backend is chosen by the tensors' device.
TORCH_LIBRARY_IMPL(flexdemo, CPU, m) {
  m.impl("precondition", &precondition);
  m.impl("accumulate", &accumulate);
  m.impl("encode", &encode);
  m.impl("decode_sgd", &decode_sgd);
  m.impl("decode_adamw", &decode_adamw);
}
TORCH_LIBRARY_IMPL(flexdemo, CUDA, m) {
  m.impl("precondition", &precondition);
  m.impl("accumulate", &accumulate);
  m.impl("encode", &encode);
  m.impl("decode_sgd", &decode_sgd);
  m.impl("decode_adamw", &decode_adamw);
}

}  // namespace flexdemo::ops
