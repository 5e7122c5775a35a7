// The benchmarks behind `flexdemo bench ...`: GPT-2-shaped parameter sets and the runners.
// Each runner prints ratios measured in one run against a baseline on the same machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

struct OptimizerBenchArgs {
  double scale = 0.25;
  int64_t topk = 32;
  int64_t chunk = 64;
  std::string values = "fp32";
  int threads = 1;
  int steps = 10;
  bool json = false;
};
int run_bench_optimizer(const OptimizerBenchArgs& args);

struct ExchangeBenchArgs {
  double scale = 0.25;
  int64_t topk = 32;
  int64_t chunk = 64;
  std::string values = "bf16";
  int steps = 20;
  bool json = false;
};
// Collective: run under mpirun; every rank is one replica.
int run_bench_exchange(const ExchangeBenchArgs& args);

}  // namespace flexdemo::bench
