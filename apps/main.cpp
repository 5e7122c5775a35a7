// The `flexdemo` command: parses arguments (CLI11) and dispatches to the subcommands.
// Any error becomes one line on stderr and a non-zero exit.
#include "bench/bench.h"
#include "flexdemo/comm.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <memory>
#include <string>

namespace {

void add_demo_bench_flags(CLI::App* cmd, flexdemo::bench::DemoBenchArgs& args) {
  cmd->add_option("--scale", args.scale, "GPT-2-124M shapes scaled by S (0.25: 3.8M params)")
      ->capture_default_str();
  cmd->add_option("--topk", args.topk, "coefficients kept per chunk")->capture_default_str();
  cmd->add_option("--chunk", args.chunk, "target chunk edge")->capture_default_str();
  cmd->add_option("--values", args.values, "wire value encoding")
      ->check(CLI::IsMember({"fp32", "bf16", "int8", "1bit"}))
      ->capture_default_str();
  cmd->add_option("--steps", args.steps, "optimizer steps (timed: the median is reported)")
      ->capture_default_str();
  cmd->add_flag("--json", args.json, "print one JSON object (rank 0)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexdemo: FlexDeMo training — hybrid sharding inside nodes, DeMo between nodes"};
  app.require_subcommand(1);
  auto* bench = app.add_subcommand("bench", "benchmarks that print ratios measured in one run");
  bench->require_subcommand(1);

  flexdemo::bench::OptimizerBenchArgs opt;
  auto* optimizer = bench->add_subcommand(
      "optimizer", "time a DeMo step (one replica) against an AdamW step on GPT-2-shaped params");
  add_demo_bench_flags(optimizer, opt);
  optimizer->add_option("--threads", opt.threads, "intra-op threads")->capture_default_str();

  flexdemo::bench::ExchangeBenchArgs ex;
  auto* exchange = bench->add_subcommand(
      "exchange", "under mpirun: DeMo's bytes between replicas against a dense all-reduce");
  add_demo_bench_flags(exchange, ex);
  exchange->add_option("--replicator", ex.replicator, "exchange between nodes")
      ->check(CLI::IsMember({"demo", "full", "none", "random"}))
      ->capture_default_str();
  exchange->add_option("--inner", ex.inner, "inner optimizer")
      ->check(CLI::IsMember({"sgd", "adamw"}))
      ->capture_default_str();
  exchange
      ->add_option("--ranks-per-node", ex.ranks_per_node,
                   "ranks per node (0: ranks sharing a host, from MPI)")
      ->capture_default_str();
  exchange
      ->add_option("--shard-size", ex.shard_size,
                   "ranks per shard group, dividing the node (0: the whole node)")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // Name what is accepted where a subcommand is missing: those of the deepest one given.
    CLI::App* level = &app;
    for (bool deeper = true; deeper;) {
      deeper = false;
      for (CLI::App* sub : level->get_subcommands({})) {
        if (sub->parsed()) {
          level = sub;
          deeper = true;
          break;
        }
      }
    }
    std::string accepted;
    for (const CLI::App* sub : level->get_subcommands({})) {
      accepted += (accepted.empty() ? "" : ", ") + sub->get_name();
    }
    std::fprintf(stderr, "flexdemo: error: %s%s (see --help)\n", e.what(),
                 accepted.empty() ? "" : ("; accepted: " + accepted).c_str());
    return 2;
  }
  // MPI lives until after an error is printed: every rank reports before any of them exits.
  std::unique_ptr<flexdemo::comm::MpiRuntime> mpi;
  try {
    if (optimizer->parsed()) return flexdemo::bench::run_bench_optimizer(opt);
    if (exchange->parsed()) {
      mpi = std::make_unique<flexdemo::comm::MpiRuntime>(&argc, &argv);
      return flexdemo::bench::run_bench_exchange(ex, mpi->world());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flexdemo: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
