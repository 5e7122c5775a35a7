// The C++ door of the cross-front check (tests/python/test_cross_front.py): under mpirun on 4
// ranks as 2 replicas x 2 shards, the library's Optimizer (the one `flexdemo train` builds: its
// options from the same options_for) steps this rank's shards (rows cut as torch.chunk cuts
// them, chunked by their own shape, as FSDP2's local shards are in Python) with the gradients
// given, its replica group an MPI communicator; then writes its parameters and optimizer state.
//   cross_front IN OUT [SHARDS]
// IN: shapes.txt (one tensor a line, its dimensions), params.f32 (every tensor, whole, float32),
// grads.f32 (per step, per replica, every tensor whole), configs.txt (one run a line: the step,
// flexdemo, flexdemo-adamw or demo, then name=value options). SHARDS: ranks a replica (default
// 2; the replicas: the rest). OUT/<line>.rank<r>.f32: after that run, this rank's shards,
// then its state tensors in name order; OUT/<line>.rank<r>.bytes: the bytes it sent over the
// replica group (comm.h's count).
#include "flexdemo/comm.h"
#include "flexdemo/optim.h"
#include "flexdemo/runtime.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

using namespace flexdemo;

namespace {

std::vector<std::vector<int64_t>> read_shapes(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::vector<int64_t>> shapes;
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::vector<int64_t> dims;
    for (int64_t d; words >> d;) dims.push_back(d);
    if (!dims.empty()) shapes.push_back(dims);
  }
  return shapes;
}

at::Tensor read_floats(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error("cross_front: cannot read " + path);
  const int64_t bytes = in.tellg();
  in.seekg(0);
  at::Tensor t = at::empty({bytes / 4}, at::kFloat);
  in.read(reinterpret_cast<char*>(t.data_ptr<float>()), bytes);
  return t;
}

// Tensor i of a flat run of whole tensors, and its shard (torch.chunk's rows).
std::vector<at::Tensor> shards_of(const at::Tensor& flat, const std::vector<std::vector<int64_t>>& shapes,
                                  int shard, int shards) {
  std::vector<at::Tensor> out;
  int64_t at = 0;
  for (const auto& shape : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const at::Tensor whole = flat.narrow(0, at, n).view(shape);
    at += n;
    out.push_back(whole.chunk(shards, 0).at(size_t(shard)).clone());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  use_native_blas(argv);
  comm::MpiRuntime mpi(&argc, &argv);
  if (argc != 3 && argc != 4) {
    std::cerr << "usage: cross_front IN OUT [SHARDS]\n";
    return 2;
  }
  const std::string in = argv[1], out = argv[2];
  try {
    set_num_threads(1);
    const auto world = mpi.world();
    const int shards = argc == 4 ? std::stoi(argv[3]) : 2, rank = world->rank();
    const int replica = rank / shards, shard = rank % shards, replica_count = world->size() / shards;
    const auto replicas = world->split(shard, replica);  // the ranks holding this shard
    const auto shard_group = world->split(replica, shard);  // this replica's ranks
    const auto shapes = read_shapes(in + "/shapes.txt");
    const at::Tensor start = read_floats(in + "/params.f32");
    const at::Tensor grads = read_floats(in + "/grads.f32");
    const int64_t steps = grads.numel() / (replica_count * start.numel());
    std::ifstream configs(in + "/configs.txt");
    int line = 0;
    for (std::string config; std::getline(configs, config); ++line) {
      std::istringstream words(config);
      std::string step;
      words >> step;
      std::vector<std::pair<std::string, std::string>> given;
      for (std::string word; words >> word;) {
        const size_t eq = word.find('=');
        given.push_back({word.substr(0, eq), word.substr(eq + 1)});
      }
      const optim::OptimizerOptions options =
          optim::options_for(parse_name<optim::Preset>(step), given);
      std::vector<at::Tensor> params = shards_of(start, shapes, shard, shards);
      replicas->reset_stats();
      optim::Optimizer opt(params, options, replicas, shard_group);
      for (int64_t s = 0; s < steps; ++s) {
        const at::Tensor mine =
            grads.narrow(0, (s * replica_count + replica) * start.numel(), start.numel());
        opt.step(shards_of(mine, shapes, shard, shards));
      }
      std::vector<at::Tensor> written = params;
      auto state = opt.state_tensors();
      std::sort(state.begin(), state.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
      for (const auto& [name, t] : state) written.push_back(t);
      const std::string stem = out + "/" + std::to_string(line) + ".rank" + std::to_string(rank);
      std::ofstream(stem + ".bytes") << replicas->stats().bytes_sent << "\n";
      std::ofstream file(stem + ".f32", std::ios::binary);
      for (const at::Tensor& t : written) {
        const at::Tensor c = t.to(at::kFloat).contiguous();
        file.write(reinterpret_cast<const char*>(c.data_ptr<float>()), c.numel() * 4);
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "cross_front: " << e.what() << "\n";
    comm::MpiRuntime::abort_job(1);
  }
  return 0;
}
