// `flexdemo bench link`: what the network between the ranks delivers, in the terms of the
// projection's model (python -m flexdemo.project): a message's latency and a node's rate each way.
// Run it with one rank a node, on the nodes a projection is checked against.
#include "bench.h"

#include "flexdemo/comm.h"

#include <ATen/ATen.h>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <stdexcept>

namespace flexdemo::bench {
namespace {

// The slowest rank's seconds for `collective`, the median over `repeats` after one unmeasured
// run (connections are opened on first use). A barrier before each run starts all ranks together.
template <class Collective>
double median_seconds(comm::Communicator& world, int repeats, Collective collective) {
  std::vector<double> times;
  for (int i = 0; i <= repeats; ++i) {
    world.barrier();
    const auto begin = std::chrono::steady_clock::now();
    collective();
    const at::Tensor mine = at::tensor(
        {std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count()},
        at::kDouble);
    const at::Tensor every = at::empty({world.size()}, at::kDouble);
    world.all_gather(mine, every);
    if (i > 0) times.push_back(every.max().item<double>());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

}  // namespace

int run_bench_link(const LinkBenchArgs& args, std::shared_ptr<comm::Communicator> world) {
  const int n = world->size(), rank = world->rank();
  if (args.bytes < 1) {
    throw std::invalid_argument(fmt::format("--bytes must be >= 1, got {}", args.bytes));
  }
  if (args.repeats < 1) {
    throw std::invalid_argument(fmt::format("--repeats must be >= 1, got {}", args.repeats));
  }
  if (n < 2) throw std::invalid_argument("bench link: needs at least 2 ranks (one a node)");
  // Latency: an all-gather of one byte a rank, which the model counts as n - 1 messages.
  const at::Tensor one = at::zeros({1}, at::kByte), all = at::zeros({n}, at::kByte);
  const double gather_s =
      median_seconds(*world, args.repeats, [&] { world->all_gather(one, all); });
  // Rate: a ring shift, every rank sending `bytes` to the next and receiving as many from the
  // one before it at once: each node's link loaded both ways, as in a ring all-reduce.
  const at::Tensor in = at::zeros({args.bytes}, at::kByte), out = at::zeros_like(in);
  std::vector<int64_t> send(n, 0), recv(n, 0);
  send[(rank + 1) % n] = args.bytes;
  recv[(rank + n - 1) % n] = args.bytes;
  const double shift_s =
      median_seconds(*world, args.repeats, [&] { world->all_to_all_v(in, send, out, recv); });

  const double latency_ms = 1000 * gather_s / (n - 1);
  const double rate_mbit = 8e-6 * double(args.bytes) / shift_s;
  if (rank == 0) {
    nlohmann::ordered_json j;
    j["ranks"] = n;
    j["latency_ms"] = latency_ms;
    j["rate_mbit"] = rate_mbit;
    j["all_gather_1_byte_ms"] = 1000 * gather_s;
    j["ring_shift_bytes"] = args.bytes;
    j["ring_shift_ms"] = 1000 * shift_s;
    if (args.json) {
      fmt::print("{}\n", j.dump());
    } else {
      fmt::print(
          "{} ranks: latency {:.3f} ms a message (1-byte all-gather {:.2f} ms over {} "
          "messages); rate {:.1f} Mbit/s each way ({} B ring shift in {:.1f} ms)\n",
          n, latency_ms, 1000 * gather_s, n - 1, rate_mbit, args.bytes, 1000 * shift_s);
    }
  }
  return 0;
}

}  // namespace flexdemo::bench
