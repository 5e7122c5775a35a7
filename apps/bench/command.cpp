// `flexdemo bench optimizer|exchange|link`: the benchmarks' command lines (the runners are
// optimizer.cpp, exchange.cpp and link.cpp beside this file).
#include "../subcommand.h"
#include "bench.h"

#include "flexdemo/compress.h"
#include "flexdemo/optim.h"

namespace flexdemo::app {

namespace {

void add_demo_bench_flags(CLI::App* cmd, bench::DemoBenchArgs& args) {
  cmd->add_option("--scale", args.scale, "GPT-2-124M shapes scaled by S (0.25: 3.8M params)")
      ->capture_default_str();
  cmd->add_option("--step", args.step,
                  "the DeMo step whose defaults apply: flexdemo (the default), flexdemo-adamw, demo")
      ->check(CLI::IsMember(names_of<optim::Preset>()))
      ->capture_default_str();
  cmd->add_option("--topk", args.topk, "coefficients kept per chunk (default: the step's)");
  cmd->add_option("--chunk", args.chunk, "target chunk edge")->capture_default_str();
  cmd->add_option("--values", args.values, "wire value encoding (default: the step's)")
      ->check(CLI::IsMember(names_of<compress::ValueEncoding>()));
  cmd->add_option("--steps", args.steps, "optimizer steps (timed: the median is reported)")
      ->capture_default_str();
  cmd->add_flag("--json", args.json, "print one JSON object (rank 0)");
}

}  // namespace

std::vector<Subcommand> add_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "benchmarks that print ratios measured in one run");
  bench->require_subcommand(1);

  auto opt = std::make_shared<bench::OptimizerBenchArgs>();
  Subcommand optimizer;
  optimizer.cli = bench->add_subcommand(
      "optimizer", "time a DeMo step (one replica) against an AdamW step on GPT-2-shaped params");
  add_demo_bench_flags(optimizer.cli, *opt);
  optimizer.cli->add_option("--threads", opt->threads, "intra-op threads")->capture_default_str();
  optimizer.cli
      ->add_option("--device", opt->device,
                   "cpu, or cuda (GPU 0: the CUDA kernels, and LibTorch's fused AdamW besides)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  optimizer.run = [opt](std::shared_ptr<comm::Communicator>) {
    return bench::run_bench_optimizer(*opt);
  };

  auto ex = std::make_shared<bench::ExchangeBenchArgs>();
  Subcommand exchange;
  exchange.cli = bench->add_subcommand(
      "exchange", "under mpirun: DeMo's bytes between replicas against a dense all-reduce");
  add_demo_bench_flags(exchange.cli, *ex);
  exchange.cli->add_option("--replicator", ex->replicator, "exchange between nodes")
      ->check(CLI::IsMember(names_of<optim::ReplicatorKind>()))
      ->capture_default_str();
  exchange.cli
      ->add_option("--ranks-per-node", ex->ranks_per_node,
                   "ranks per node (0: ranks sharing a host, from MPI)")
      ->envname("FLEXDEMO_RANKS_PER_NODE")
      ->capture_default_str();
  exchange.cli
      ->add_option("--shard-size", ex->shard_size,
                   "ranks per shard group, dividing the node (0: the whole node)")
      ->capture_default_str();
  exchange.uses_mpi = true;
  exchange.run = [ex](std::shared_ptr<comm::Communicator> world) {
    return bench::run_bench_exchange(*ex, std::move(world));
  };
  auto li = std::make_shared<bench::LinkBenchArgs>();
  Subcommand link;
  link.cli = bench->add_subcommand(
      "link", "under mpirun, one rank a node: the network's latency a message and rate each way");
  link.cli->add_option("--bytes", li->bytes, "bytes each rank sends in the ring shift (the rate)")
      ->capture_default_str();
  link.cli->add_option("--repeats", li->repeats, "timed runs of each probe (the median counts)")
      ->capture_default_str();
  link.cli->add_flag("--json", li->json, "print one JSON object (rank 0)");
  link.uses_mpi = true;
  link.run = [li](std::shared_ptr<comm::Communicator> world) {
    return bench::run_bench_link(*li, std::move(world));
  };
  return {optimizer, exchange, link};
}

}  // namespace flexdemo::app
