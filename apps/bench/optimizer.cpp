// `flexdemo bench optimizer`: one DeMo step (single replica) against LibTorch's AdamW step on the
// same GPT-2-shaped parameters, timed in the same run; prints the ratio and the wire size.
#include "bench.h"

#include "flexdemo/kernels.h"
#include "flexdemo/optim.h"
#include "flexdemo/runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/core.h>
#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <stdexcept>

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

std::vector<at::Tensor> make_params(const std::vector<NamedShape>& shapes) {
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) {
    at::Tensor p = (at::randn(s.shape) * 0.02).set_requires_grad(true);
    p.mutable_grad() = at::randn(s.shape);
    params.push_back(p);
  }
  return params;
}

template <typename Step>
double median_step_ms(int steps, Step&& step) {
  for (int i = 0; i < 2; ++i) step();  // warm-up: first-touch allocations and caches
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

optim::OptimizerOptions demo_options(const DemoBenchArgs& args) {
  if (args.steps < 1) {
    throw std::invalid_argument("--steps must be >= 1, got " + std::to_string(args.steps));
  }
  if (args.topk < 1)
    throw std::invalid_argument("--topk must be >= 1, got " + std::to_string(args.topk));
  if (args.chunk < 1) {
    throw std::invalid_argument("--chunk must be >= 1, got " + std::to_string(args.chunk));
  }
  optim::OptimizerOptions options;
  options.topk = args.topk;
  options.chunk = args.chunk;
  options.values = parse_name<compress::ValueEncoding>(args.values);
  options.inner = parse_name<optim::InnerKind>(args.inner);
  options.validate();
  return options;
}

int run_bench_optimizer(const OptimizerBenchArgs& args) {
  const optim::OptimizerOptions options = demo_options(args);
  if (args.threads < 1) {
    throw std::invalid_argument("--threads must be >= 1, got " + std::to_string(args.threads));
  }
  set_num_threads(args.threads);
  at::manual_seed(0);

  const auto shapes = gpt2_parameter_shapes(gpt2_shape(args.scale));
  std::vector<at::Tensor> demo_params = make_params(shapes);
  std::vector<at::Tensor> adamw_params = make_params(shapes);

  optim::Optimizer demo(demo_params, options);
  torch::optim::AdamW adamw(adamw_params, torch::optim::AdamWOptions(1e-3).weight_decay(0.0));

  const double demo_ms = median_step_ms(args.steps, [&] { demo.step(); });
  const double adamw_ms = median_step_ms(args.steps, [&] { adamw.step(); });
  const optim::ExchangeTraffic t = demo.traffic();

  nlohmann::ordered_json out;
  out["params"] = t.params;
  out["demo_ms"] = demo_ms;
  out["adamw_ms"] = adamw_ms;
  out["ratio"] = demo_ms / adamw_ms;
  out["wire_bytes"] = t.wire_bytes;
  out["kept_coefficients"] = t.kept_coefficients;
  out["bytes_per_param"] = double(t.wire_bytes) / double(t.params);
  out["inner"] = args.inner;
  out["isa"] = kernels::to_string(kernels::active_isa());
  if (args.json) {
    fmt::print("{}\n", out.dump());
  } else {
    fmt::print("params             {}\n", t.params);
    fmt::print("demo_ms            {:.2f}\n", demo_ms);
    fmt::print("adamw_ms           {:.2f}\n", adamw_ms);
    fmt::print("ratio              {:.2f}   (demo_ms / adamw_ms)\n", demo_ms / adamw_ms);
    fmt::print("wire_bytes         {}\n", t.wire_bytes);
    fmt::print("kept_coefficients  {}   ({:.3f} bytes each)\n", t.kept_coefficients,
               double(t.wire_bytes) / double(t.kept_coefficients));
    fmt::print("bytes_per_param    {:.5f}   (dense fp32 all-reduce: 4 bytes per param)\n",
               double(t.wire_bytes) / double(t.params));
    fmt::print("inner              {}\n", args.inner);
    fmt::print("isa                {}   (the fast path's kernels; FLEXDEMO_ISA to choose)\n",
               kernels::to_string(kernels::active_isa()));
  }
  return 0;
}

}  // namespace flexdemo::bench
