// `flexdemo bench exchange`: FlexDeMo on a GPT-2-shaped
// parameter set, sharded inside (emulated) nodes, every rank feeding its own gradients through
// the sharded forward/backward. Counts the bytes between nodes against `full` (plain HSDP), the
// bytes inside nodes and the state per rank, and checks that replicas stay bit-identical.
#include "bench.h"

#include "flexdemo/comm.h"
#include "flexdemo/optim.h"
#include "flexdemo/runtime.h"
#include "flexdemo/shard.h"
#include "flexdemo/topology.h"

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <stdexcept>

namespace flexdemo::bench {
namespace {

// The unit a GPT-2 parameter belongs to: "embeddings", "h<l>" or "ln_f".
std::string unit_of(const std::string& name) {
  if (name == "wte" || name == "wpe") return "embeddings";
  return name.substr(0, name.find('.'));
}

// A sharded GPT-2-shaped parameter set whose "loss" is sum_i <p_i, g_i>: its gradient is the
// g_i each rank draws, so the backward exercises the real reduce-scatter path.
struct ShardedParams {
  std::vector<std::unique_ptr<shard::ShardedUnit>> units;
  std::vector<std::vector<int64_t>> unit_members;  // per unit: parameter indices

  ShardedParams(const std::vector<NamedShape>& shapes, const comm::Topology& topo,
                const optim::OptimizerOptions& o) {
    at::manual_seed(1234);  // the same initial parameters on every rank
    shard::ShardOptions so;
    so.chunk = o.chunk;
    so.chunk_mode = o.chunk_mode;
    std::vector<at::Tensor> pending;
    std::string current;
    auto flush = [&] {
      if (!pending.empty()) {
        units.push_back(
            std::make_unique<shard::ShardedUnit>(current, pending, topo.shard_group, so));
      }
      pending.clear();
    };
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (unit_of(shapes[i].name) != current) {
        flush();
        current = unit_of(shapes[i].name);
        unit_members.emplace_back();
      }
      pending.push_back(at::randn(shapes[i].shape) * 0.02);
      unit_members.back().push_back(int64_t(i));
    }
    flush();
  }

  void backward(const std::vector<at::Tensor>& grads) {
    at::Tensor loss = at::zeros({});
    for (size_t u = 0; u < units.size(); ++u) {
      std::vector<at::Tensor> g;
      for (int64_t i : unit_members[u]) g.push_back(grads[i]);
      loss = loss + units[u]->forward(
                        [](const std::vector<at::Tensor>& p, const std::vector<at::Tensor>& in) {
                          at::Tensor sum = at::zeros({});
                          for (size_t i = 0; i < p.size(); ++i) sum = sum + (p[i] * in[i]).sum();
                          return sum;
                        },
                        g);
    }
    loss.backward();
  }

  int64_t param_bytes() const {
    int64_t b = 0;
    for (const auto& u : units) b += u->param_bytes();
    return b;
  }
  int64_t grad_bytes() const {
    int64_t b = 0;
    for (const auto& u : units) b += u->grad_bytes();
    return b;
  }
};

struct RunResult {
  comm::StepTraffic per_step;  // of the last step
  double step_ms = 0.0;
  int64_t params = 0, param_bytes = 0, grad_bytes = 0, state_bytes = 0;
  bool identical = true;
};

RunResult run(const std::vector<NamedShape>& shapes, const comm::Topology& topo,
              const optim::OptimizerOptions& o, int steps, bool progress) {
  ShardedParams model(shapes, topo, o);
  optim::Optimizer optimizer(shard::optim_params(model.units), o, topo.replica_group,
                             topo.shard_group);
  comm::TrafficMeter meter(topo);
  at::Generator gen = at::detail::createCPUGenerator(1000 + topo.world->rank());  // own grads
  RunResult result;
  double seconds = 0.0;
  for (int step = 0; step < steps; ++step) {
    std::vector<at::Tensor> grads;
    for (const auto& s : shapes) grads.push_back(at::randn(s.shape, gen));
    meter.lap();
    const auto t0 = std::chrono::steady_clock::now();
    optimizer.zero_grad();
    model.backward(grads);
    optimizer.step();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    result.per_step = meter.lap();
    if (progress && (step + 1) % 5 == 0) {
      fmt::print("  step {:3d}/{}  between nodes {:>10} B  inside nodes {:>10} B\n", step + 1,
                 steps, result.per_step.inter_sent, result.per_step.intra_sent);
    }
  }
  result.step_ms = 1e3 * seconds / steps;
  result.params = optimizer.traffic().params;
  result.param_bytes = model.param_bytes();
  result.grad_bytes = model.grad_bytes();
  result.state_bytes = optimizer.state_bytes();
  // Every replica must hold bit-identical shards: compare with the first replica.
  int64_t mismatched = 0;
  for (const auto& u : model.units) {
    for (const at::Tensor& s : u->shards()) {
      at::Tensor first = s.detach().clone();
      topo.replica_group->broadcast(first, 0);
      mismatched += at::equal(first, s.detach()) ? 0 : 1;
    }
  }
  at::Tensor bad = at::full({1}, mismatched, at::kLong);
  topo.world->all_reduce(bad, comm::ReduceOp::Sum);
  result.identical = bad.item<int64_t>() == 0;
  return result;
}

}  // namespace

int run_bench_exchange(const ExchangeBenchArgs& args, std::shared_ptr<comm::Communicator> world) {
  optim::OptimizerOptions options = demo_options(args);
  options.replicator = parse_name<optim::ReplicatorKind>(args.replicator);
  options.validate();
  const auto shapes = gpt2_parameter_shapes(gpt2_shape(args.scale));

  set_num_threads(1);
  const comm::Topology topo =
      comm::make_topology(std::move(world), {args.ranks_per_node, args.shard_size});
  const bool root = topo.world->rank() == 0;
  if (root && !args.json) {
    fmt::print(
        "FlexDeMo exchange: {}; GPT-2 x{} shapes; {}, the {} step, top-{} of {}x{} chunks, {} "
        "values\n",
        topo.describe(), args.scale, args.replicator, args.step, options.topk, options.chunk,
        options.chunk, name_of(options.values));
  }
  const RunResult main = run(shapes, topo, options, args.steps, root && !args.json);
  optim::OptimizerOptions dense = options;
  dense.replicator = optim::ReplicatorKind::Full;
  const RunResult baseline = run(shapes, topo, dense, 2, false);  // bytes per step are fixed

  const uint64_t inter = main.per_step.inter_sent, full = baseline.per_step.inter_sent;
  const int64_t state = main.param_bytes + main.grad_bytes + main.state_bytes;
  nlohmann::ordered_json out;
  out["topology"] = topo.describe();
  out["params"] = main.params;  // this rank's shard
  out["replicator"] = args.replicator;
  out["inter_node_bytes_per_step"] = inter;
  out["full_inter_node_bytes_per_step"] = full;
  out["reduction"] = inter > 0 ? double(full) / double(inter) : 0.0;
  out["intra_node_bytes_per_step"] = main.per_step.intra_sent;
  out["param_bytes"] = main.param_bytes;
  out["grad_bytes"] = main.grad_bytes;
  out["optimizer_state_bytes"] = main.state_bytes;
  out["state_bytes"] = state;
  out["step_ms"] = main.step_ms;
  out["replicas_identical"] = main.identical && baseline.identical;
  if (root) {
    if (args.json) {
      fmt::print("{}\n", out.dump());
    } else {
      fmt::print("between nodes per step, per rank: {} {} B, full {} B ({:.0f}x fewer)\n",
                 args.replicator, inter, full, out["reduction"].get<double>());
      fmt::print("inside nodes per step, per rank: {} B\n", main.per_step.intra_sent);
      fmt::print(
          "state per rank: params {} + grads {} + optimizer {} = {} B "
          "(shard of {} parameters)\n",
          main.param_bytes, main.grad_bytes, main.state_bytes, state, main.params);
      fmt::print("step {:.1f} ms; replicas bit-identical: {}\n", main.step_ms,
                 out["replicas_identical"].get<bool>() ? "yes" : "NO");
    }
  }
  return out["replicas_identical"].get<bool>() ? 0 : 1;
}

}  // namespace flexdemo::bench
