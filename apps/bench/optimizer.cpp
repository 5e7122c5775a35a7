// `flexdemo bench optimizer`: one DeMo step (single replica) against LibTorch's AdamW step on the
// same GPT-2-shaped parameters, timed in the same run; prints the ratio and the wire size.
#include "bench.h"

#include "demo/kernels.h"
#include "flexdemo/optim.h"
#include "flexdemo/runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <fmt/core.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>
#include <string>

namespace flexdemo::bench {

GptShape gpt2_shape(double scale) {
  if (!(scale > 0.0)) {
    throw std::invalid_argument(fmt::format("--scale must be > 0, got {}", scale));
  }
  auto round64 = [](double v) { return std::max<int64_t>(64, int64_t(v) / 64 * 64); };
  GptShape g;
  g.vocab = round64(50304 * scale);
  g.width = round64(768 * scale);
  g.context = round64(1024 * scale);
  g.layers = std::max<int64_t>(1, int64_t(12 * scale));
  return g;
}

std::vector<NamedShape> gpt2_parameter_shapes(const GptShape& g) {
  const int64_t d = g.width;
  std::vector<NamedShape> shapes = {{"wte", {g.vocab, d}}, {"wpe", {g.context, d}}};
  for (int64_t l = 0; l < g.layers; ++l) {
    const std::string p = "h" + std::to_string(l) + ".";
    shapes.push_back({p + "ln_1.weight", {d}});
    shapes.push_back({p + "ln_1.bias", {d}});
    shapes.push_back({p + "attn.c_attn.weight", {3 * d, d}});
    shapes.push_back({p + "attn.c_attn.bias", {3 * d}});
    shapes.push_back({p + "attn.c_proj.weight", {d, d}});
    shapes.push_back({p + "attn.c_proj.bias", {d}});
    shapes.push_back({p + "ln_2.weight", {d}});
    shapes.push_back({p + "ln_2.bias", {d}});
    shapes.push_back({p + "mlp.c_fc.weight", {4 * d, d}});
    shapes.push_back({p + "mlp.c_fc.bias", {4 * d}});
    shapes.push_back({p + "mlp.c_proj.weight", {d, 4 * d}});
    shapes.push_back({p + "mlp.c_proj.bias", {d}});
  }
  shapes.push_back({"ln_f.weight", {d}});
  shapes.push_back({"ln_f.bias", {d}});
  return shapes;
}

namespace {

std::vector<at::Tensor> make_params(const std::vector<NamedShape>& shapes, at::Device device) {
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) {
    at::Tensor p = (at::randn(s.shape) * 0.02).to(device).set_requires_grad(true);
    p.mutable_grad() = at::randn(s.shape).to(device);
    params.push_back(p);
  }
  return params;
}

// A step's median wall time; on a GPU each step ends when the device is done with it.
template <typename Step>
double median_step_ms(int steps, at::Device device, Step&& step) {
  auto synced = [&] {
    step();
    if (device.is_cuda()) at::detail::getCUDAHooks().deviceSynchronize(device.index());
  };
  for (int i = 0; i < 2; ++i) synced();  // warm-up: first-touch allocations and caches
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    synced();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// LibTorch's fused AdamW (one kernel over every tensor, as torch.optim.AdamW(fused=True)) on
// the same parameters: the GPU baseline. LibTorch 2.0 and later; 0 (not measured) before.
double fused_adamw_step_ms(const std::vector<at::Tensor>& params, int steps) {
#if TORCH_VERSION_MAJOR >= 2
  std::vector<at::Tensor> grads, exp_avg, exp_avg_sq, step_counts;
  for (const at::Tensor& p : params) {
    grads.push_back(p.grad());
    exp_avg.push_back(at::zeros_like(p));
    exp_avg_sq.push_back(at::zeros_like(p));
    step_counts.push_back(at::zeros({}, p.options()));
  }
  std::vector<at::Tensor> leaves;
  for (const at::Tensor& p : params) leaves.push_back(p.detach());
  return median_step_ms(steps, params.front().device(), [&] {
    for (at::Tensor& s : step_counts) s.add_(1);
    at::_fused_adamw_(leaves, grads, exp_avg, exp_avg_sq, {}, step_counts, 1e-3, 0.9, 0.999, 0.0,
                      1e-8, false, false);
  });
#else
  (void)params;
  (void)steps;
  return 0.0;
#endif
}

}  // namespace

optim::OptimizerOptions demo_options(const DemoBenchArgs& args) {
  if (args.steps < 1) {
    throw std::invalid_argument("--steps must be >= 1, got " + std::to_string(args.steps));
  }
  std::vector<std::pair<std::string, std::string>> given = {{"chunk",
                                                            std::to_string(args.chunk)}};
  if (args.topk != 0) given.push_back({"topk", std::to_string(args.topk)});
  if (!args.values.empty()) given.push_back({"values", args.values});
  try {
    return optim::options_for(parse_name<optim::Preset>(args.step), given);
  } catch (const optim::OptionsError& e) {
    throw std::invalid_argument(e.spelled([](const std::string& name) { return "--" + name; }));
  }
}

int run_bench_optimizer(const OptimizerBenchArgs& args) {
  const optim::OptimizerOptions options = demo_options(args);
  if (args.threads < 1) {
    throw std::invalid_argument("--threads must be >= 1, got " + std::to_string(args.threads));
  }
  set_num_threads(args.threads);
  at::manual_seed(0);

  const at::Device device = args.device == "cuda" ? at::Device(at::kCUDA, 0) : at::kCPU;
  if (device.is_cuda() && !kernels::cuda_available()) {
    throw std::invalid_argument(
        "--device cuda: no usable GPU (needs a CUDA build, scripts/build.sh --cuda, and a visible "
        "GPU)");
  }
  const auto shapes = gpt2_parameter_shapes(gpt2_shape(args.scale));
  std::vector<at::Tensor> demo_params = make_params(shapes, device);
  std::vector<at::Tensor> adamw_params = make_params(shapes, device);

  optim::Optimizer demo(demo_params, options);
  torch::optim::AdamW adamw(adamw_params, torch::optim::AdamWOptions(1e-3).weight_decay(0.0));

  if (device.is_cuda()) kernels::set_gpu_phase_timing(true);
  const double demo_ms = median_step_ms(args.steps, device, [&] { demo.step(); });
  const std::map<std::string, kernels::GpuPhase> phases = kernels::gpu_phase_times();
  kernels::set_gpu_phase_timing(false);
  const double adamw_ms = median_step_ms(args.steps, device, [&] { adamw.step(); });
  const double fused_ms = device.is_cuda() ? fused_adamw_step_ms(adamw_params, args.steps) : 0.0;
  const optim::ExchangeTraffic t = demo.traffic();

  nlohmann::ordered_json out;
  out["params"] = t.params;
  out["demo_ms"] = demo_ms;
  out["adamw_ms"] = adamw_ms;
  out["ratio"] = demo_ms / adamw_ms;
  out["device"] = device.str();
  if (device.is_cuda()) {
    out["adamw_fused_ms"] = fused_ms;
    out["ratio_fused"] = demo_ms / fused_ms;
  }
  // Per phase of the DeMo step on the GPU (CUDA events, every timed step and its warm-ups):
  // milliseconds a launch, and the DRAM bandwidth and multiply-add rate that implies.
  for (const auto& [name, p] : phases) {
    const double seconds = p.ms / 1e3;
    out["phases"][name] = {{"ms", p.ms / double(std::max<int64_t>(1, p.launches))},
                           {"gb_per_s", seconds > 0 ? p.bytes / seconds / 1e9 : 0.0},
                           {"gflop_per_s", seconds > 0 ? 2.0 * p.fmas / seconds / 1e9 : 0.0}};
  }
  out["wire_bytes"] = t.wire_bytes;
  out["kept_coefficients"] = t.kept_coefficients;
  out["bytes_per_param"] = double(t.wire_bytes) / double(t.params);
  out["step"] = args.step;
  out["topk"] = options.topk;
  out["values"] = name_of(options.values);
  out["isa"] = kernels::to_string(kernels::active_isa());
  if (args.json) {
    fmt::print("{}\n", out.dump());
  } else {
    fmt::print("params             {}\n", t.params);
    fmt::print("demo_ms            {:.2f}\n", demo_ms);
    fmt::print("adamw_ms           {:.2f}\n", adamw_ms);
    fmt::print("ratio              {:.2f}   (demo_ms / adamw_ms)\n", demo_ms / adamw_ms);
    if (device.is_cuda()) {
      fmt::print("adamw_fused_ms     {:.2f}   (LibTorch's fused CUDA AdamW)\n", fused_ms);
      fmt::print("ratio_fused        {:.2f}   (demo_ms / adamw_fused_ms)\n", demo_ms / fused_ms);
    }
    for (const auto& [name, p] : phases) {
      const double seconds = p.ms / 1e3;
      fmt::print("phase {:<12} {:.3f} ms   {:.0f} GB/s   {:.0f} GFLOP/s\n", name,
                 p.ms / double(std::max<int64_t>(1, p.launches)),
                 seconds > 0 ? p.bytes / seconds / 1e9 : 0.0,
                 seconds > 0 ? 2.0 * p.fmas / seconds / 1e9 : 0.0);
    }
    fmt::print("device             {}\n", device.str());
    fmt::print("wire_bytes         {}\n", t.wire_bytes);
    fmt::print("kept_coefficients  {}   ({:.3f} bytes each)\n", t.kept_coefficients,
               double(t.wire_bytes) / double(t.kept_coefficients));
    fmt::print("bytes_per_param    {:.5f}   (dense fp32 all-reduce: 4 bytes per param)\n",
               double(t.wire_bytes) / double(t.params));
    fmt::print("step               {} (top-k {}, {} values)\n", args.step, options.topk,
               name_of(options.values));
    fmt::print("isa                {}   (the fast path's kernels; FLEXDEMO_ISA to choose)\n",
               kernels::to_string(kernels::active_isa()));
  }
  return 0;
}

}  // namespace flexdemo::bench
