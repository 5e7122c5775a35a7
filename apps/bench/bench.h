// The benchmarks behind `flexdemo bench ...`: GPT-2-shaped parameter sets and the runners.
// Each runner prints ratios measured in one run against a baseline on the same machine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}
namespace flexdemo::optim {
struct OptimizerOptions;
}

namespace flexdemo::bench {

// GPT-2-124M's shapes scaled by `scale`: vocab 50304*s, width 768*s, context 1024*s (each
// rounded down to a multiple of 64, at least 64), 12*s layers (at least 1). Tied embeddings.
struct GptShape {
  int64_t vocab = 0, width = 0, context = 0, layers = 0;
};
GptShape gpt2_shape(double scale);

struct NamedShape {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<NamedShape> gpt2_parameter_shapes(const GptShape& gpt);

// What both benchmarks share: the parameter set and the DeMo step (a named step, the library's
// optim::preset, with the options given over it: the same defaults as the command and Python).
struct DemoBenchArgs {
  double scale = 0.25;             // GPT-2-124M shapes scaled by this
  std::string step = "flexdemo";   // flexdemo, flexdemo-adamw or demo
  int64_t topk = 0;                // coefficients kept per chunk (0: the step's)
  int64_t chunk = 64;              // target chunk edge
  std::string values;              // wire value encoding ("": the step's)
  int steps = 10;                  // optimizer steps
  bool json = false;               // one JSON object instead of text
};

// The DeMo options the flags ask for, validated (and --steps checked).
optim::OptimizerOptions demo_options(const DemoBenchArgs& args);

struct OptimizerBenchArgs : DemoBenchArgs {
  int threads = 1;
  std::string device = "cpu";  // or "cuda"
};
int run_bench_optimizer(const OptimizerBenchArgs& args);

struct ExchangeBenchArgs : DemoBenchArgs {
  ExchangeBenchArgs() { steps = 20; }
  std::string replicator = "demo";  // compared against "full" (plain HSDP)
  int ranks_per_node = 0;           // 0: from MPI
  int shard_size = 0;               // 0: the whole node
};
// Collective over world: FlexDeMo on a GPT-2-shaped model sharded inside nodes.
int run_bench_exchange(const ExchangeBenchArgs& args, std::shared_ptr<comm::Communicator> world);

struct LinkBenchArgs {
  int64_t bytes = 4 << 20;  // each rank's ring shift
  int repeats = 10;         // timed runs of each probe (the median is reported)
  bool json = false;        // one JSON object instead of text
};
// Collective over world (one rank a node): a message's latency and a node's rate each way.
int run_bench_link(const LinkBenchArgs& args, std::shared_ptr<comm::Communicator> world);

}  // namespace flexdemo::bench
