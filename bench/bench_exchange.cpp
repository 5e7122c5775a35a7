// `flexdemo bench exchange` (the demo until the trainer exists): every MPI rank is a replica of a
// GPT-2-shaped parameter set with its own gradients; DeMo's bucketed all-gather is counted
// against the dense fp32 all-reduce that plain data parallelism would send for the same step.
#include "bench/bench.h"

#include "flexdemo/comm.h"
#include "flexdemo/optim.h"
#include "flexdemo/runtime.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <stdexcept>

namespace flexdemo::bench {

int run_bench_exchange(const ExchangeBenchArgs& args) {
  if (args.steps < 1) {
    throw std::invalid_argument("--steps must be >= 1, got " + std::to_string(args.steps));
  }
  comm::MpiRuntime mpi;
  auto world = mpi.world();
  auto demo_group = world->split(0, world->rank());   // DeMo's traffic only
  auto dense_group = world->split(0, world->rank());  // the baseline's traffic only

  optim::DemoOptions options;
  options.topk = args.topk;
  options.chunk = args.chunk;
  options.values = compress::parse_value_encoding(args.values);
  options.validate();
  set_num_threads(1);

  at::manual_seed(1234);  // identical initial parameters on every replica
  const auto shapes = gpt2_parameter_shapes(gpt2_shape(args.scale));
  std::vector<at::Tensor> params;
  for (const auto& s : shapes)
    params.push_back((at::randn(s.shape) * 0.02).set_requires_grad(true));
  optim::DemoOptimizer demo(params, options, demo_group);

  const bool root = world->rank() == 0;
  if (root && !args.json) {
    fmt::print("DeMo exchange: {} replicas, {} parameters, top-{} of {}x{} chunks, {} values\n",
               world->size(), demo.traffic().params, options.topk, options.chunk, options.chunk,
               args.values);
  }
  double demo_step_s = 0.0;
  at::Generator gen = at::detail::createCPUGenerator(1000 + world->rank());  // own gradients
  for (int step = 0; step < args.steps; ++step) {
    for (auto& p : params) p.mutable_grad() = at::randn(p.sizes(), gen);
    const auto t0 = std::chrono::steady_clock::now();
    demo.step();
    demo_step_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (auto& p : params) dense_group->all_reduce(p.grad(), comm::ReduceOp::Avg);
    if (root && !args.json && (step + 1) % 5 == 0) {
      fmt::print("  step {:3d}/{}  DeMo sent {:>10} B  dense all-reduce sent {:>12} B\n", step + 1,
                 args.steps, demo_group->stats().bytes_sent, dense_group->stats().bytes_sent);
    }
  }

  // Replicas must hold bit-identical parameters: compare everyone against rank 0.
  int64_t mismatched = 0;
  for (auto& p : params) {
    at::Tensor reference = p.detach().clone();
    world->broadcast(reference, 0);
    mismatched += at::equal(reference, p.detach()) ? 0 : 1;
  }
  at::Tensor bad = at::full({1}, mismatched, at::kLong);
  world->all_reduce(bad, comm::ReduceOp::Sum);

  const comm::CommStats d = demo_group->stats(), a = dense_group->stats();
  nlohmann::ordered_json out;
  out["replicas"] = world->size();
  out["params"] = demo.traffic().params;
  out["steps"] = args.steps;
  out["demo_bytes_sent"] = d.bytes_sent;
  out["dense_bytes_sent"] = a.bytes_sent;
  out["reduction"] = double(a.bytes_sent) / double(std::max<uint64_t>(1, d.bytes_sent));
  out["demo_step_ms"] = 1e3 * demo_step_s / args.steps;
  out["replicas_identical"] = bad.item<int64_t>() == 0;
  if (root) {
    if (args.json) {
      fmt::print("{}\n", out.dump());
    } else {
      fmt::print(
          "bytes sent per rank over {} steps: DeMo {} B, dense all-reduce {} B "
          "({:.0f}x fewer)\n",
          args.steps, d.bytes_sent, a.bytes_sent, out["reduction"].get<double>());
      fmt::print("DeMo step {:.1f} ms per rank; replicas bit-identical: {}\n",
                 out["demo_step_ms"].get<double>(), bad.item<int64_t>() == 0 ? "yes" : "NO");
    }
  }
  return bad.item<int64_t>() == 0 ? 0 : 1;
}

}  // namespace flexdemo::bench
