// Builds the shard and replica groups from node membership (MPI's host split or an explicit
// ranks-per-node), after every rank has checked the same all-gathered table.
#include "flexdemo/topology.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <stdexcept>

namespace flexdemo::comm {

std::string Topology::describe() const {
  return std::to_string(nodes) + " node" + (nodes == 1 ? "" : "s") + " x " +
         std::to_string(ranks_per_node) + " rank" + (ranks_per_node == 1 ? "" : "s") +
         ", shard size " + std::to_string(shard_size) + ", " + std::to_string(replicas) +
         " replica" + (replicas == 1 ? "" : "s");
}

namespace {

[[noreturn]] void fail(const std::string& why) {
  throw std::invalid_argument("topology: " + why);
}

}  // namespace

Topology make_topology(std::shared_ptr<Communicator> world, const TopologyOptions& options) {
  const int P = world->size(), me = world->rank();

  // This rank's node key: the lowest world rank on its node.
  int64_t key = 0;
  if (options.ranks_per_node > 0) {
    key = int64_t(me / options.ranks_per_node) * options.ranks_per_node;
  } else {
    auto host = world->split_by_host();
    at::Tensor mine = at::full({1}, int64_t(me), at::kLong);
    at::Tensor all = at::empty({host->size()}, at::kLong);
    host->all_gather(mine, all);
    key = all.min().item<int64_t>();
  }
  at::Tensor row =
      at::tensor({key, int64_t(options.ranks_per_node), int64_t(options.shard_size)}, at::kLong);
  at::Tensor table = at::empty({P, 3}, at::kLong);
  world->all_gather(row, table);
  auto t = table.accessor<int64_t, 2>();

  // The same checks, on the same table, on every rank.
  const char* names[] = {"", "--ranks-per-node", "--shard-size"};
  for (int column = 1; column <= 2; ++column) {
    for (int r = 1; r < P; ++r) {
      if (t[r][column] != t[0][column]) {
        fail(std::string("ranks disagree on ") + names[column] + ": rank 0 has " +
             std::to_string(t[0][column]) + ", rank " + std::to_string(r) + " has " +
             std::to_string(t[r][column]));
      }
    }
  }
  if (options.ranks_per_node < 0) {
    fail("--ranks-per-node must be >= 1 (or 0: from MPI), got " +
         std::to_string(options.ranks_per_node));
  }
  if (options.shard_size < 0) {
    fail("--shard-size must be >= 1 (or 0: the whole node), got " +
         std::to_string(options.shard_size));
  }
  if (options.ranks_per_node > 0 && P % options.ranks_per_node != 0) {
    fail("a world of " + std::to_string(P) + " ranks does not divide into nodes of " +
         std::to_string(options.ranks_per_node) + " (--ranks-per-node)");
  }
  std::map<int64_t, int> node_sizes;  // key -> ranks
  for (int r = 0; r < P; ++r) node_sizes[t[r][0]] += 1;
  for (const auto& [node_key, size] : node_sizes) {
    if (size != node_sizes.begin()->second) {
      fail("nodes of unequal size: the node of rank " + std::to_string(node_sizes.begin()->first) +
           " has " + std::to_string(node_sizes.begin()->second) + " ranks, the node of rank " +
           std::to_string(node_key) + " has " + std::to_string(size));
    }
  }

  Topology topo;
  topo.world = world;
  topo.nodes = int(node_sizes.size());
  topo.ranks_per_node = node_sizes.begin()->second;
  topo.shard_size = options.shard_size > 0 ? options.shard_size : topo.ranks_per_node;
  if (topo.ranks_per_node % topo.shard_size != 0) {
    fail("--shard-size " + std::to_string(topo.shard_size) + " does not divide the " +
         std::to_string(topo.ranks_per_node) + " ranks per node");
  }
  topo.replicas = P / topo.shard_size;
  topo.node = int(std::distance(node_sizes.begin(), node_sizes.find(key)));
  for (int r = 0; r < me; ++r) topo.local_rank += t[r][0] == key ? 1 : 0;
  topo.shard_rank = topo.local_rank % topo.shard_size;
  const int groups_per_node = topo.ranks_per_node / topo.shard_size;
  topo.replica_rank = topo.node * groups_per_node + topo.local_rank / topo.shard_size;
  topo.shard_group = world->split(topo.replica_rank, topo.shard_rank);
  topo.replica_group = world->split(topo.shard_rank, topo.replica_rank);
  return topo;
}

// ====== Traffic ======
TrafficMeter::TrafficMeter(const Topology& topology)
    : shard_group_(topology.shard_group),
      replica_group_(topology.replica_group),
      shard_last_(shard_group_->stats()),
      replica_last_(replica_group_->stats()) {}

StepTraffic TrafficMeter::lap() {
  const CommStats shard = shard_group_->stats(), replica = replica_group_->stats();
  StepTraffic t;
  t.intra_sent = shard.bytes_sent - shard_last_.bytes_sent;
  t.intra_received = shard.bytes_received - shard_last_.bytes_received;
  t.intra_seconds = shard.seconds - shard_last_.seconds;
  t.inter_sent = replica.bytes_sent - replica_last_.bytes_sent;
  t.inter_received = replica.bytes_received - replica_last_.bytes_received;
  t.inter_seconds = replica.seconds - replica_last_.seconds;
  t.inter_collectives = replica.collectives - replica_last_.collectives;
  shard_last_ = shard;
  replica_last_ = replica;
  return t;
}

}  // namespace flexdemo::comm
