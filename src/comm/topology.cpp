// Builds the shard and replica groups from node membership (MPI's host split or an explicit
// ranks-per-node), after every rank has checked the same all-gathered table.
#include "flexdemo/topology.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <stdexcept>

namespace flexdemo::comm {

std::string Topology::describe() const {
  const std::string layout =
      island_nodes > 1 ? std::to_string(islands) + " island" + (islands == 1 ? "" : "s") + " x " +
                             std::to_string(island_nodes) + " nodes"
                       : std::to_string(nodes) + " node" + (nodes == 1 ? "" : "s");
  return layout + " x " +
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
  at::Tensor row = at::tensor({key, int64_t(options.ranks_per_node), int64_t(options.shard_size),
                               int64_t(options.island_nodes)},
                              at::kLong);
  at::Tensor table = at::empty({P, 4}, at::kLong);
  world->all_gather(row, table);
  auto t = table.accessor<int64_t, 2>();

  // The same checks, on the same table, on every rank.
  const char* names[] = {"", "--ranks-per-node", "--shard-size", "--island-nodes"};
  for (int column = 1; column <= 3; ++column) {
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
    fail("--shard-size must be >= 1 (or 0: the whole island), got " +
         std::to_string(options.shard_size));
  }
  if (options.island_nodes < 1) {
    fail("--island-nodes must be >= 1, got " + std::to_string(options.island_nodes));
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
  topo.island_nodes = options.island_nodes;
  if (topo.nodes % topo.island_nodes != 0) {
    fail("--island-nodes " + std::to_string(topo.island_nodes) + " does not divide the " +
         std::to_string(topo.nodes) + " nodes");
  }
  topo.islands = topo.nodes / topo.island_nodes;
  const int island_ranks = topo.island_nodes * topo.ranks_per_node;
  topo.shard_size = options.shard_size > 0 ? options.shard_size : island_ranks;
  if (island_ranks % topo.shard_size != 0) {
    fail("--shard-size " + std::to_string(topo.shard_size) + " does not divide the " +
         (topo.island_nodes == 1
              ? std::to_string(topo.ranks_per_node) + " ranks per node"
              : "island's " + std::to_string(island_ranks) + " ranks (" +
                    std::to_string(topo.island_nodes) + " nodes x " +
                    std::to_string(topo.ranks_per_node) + ")"));
  }
  topo.replicas = P / topo.shard_size;
  topo.node = int(std::distance(node_sizes.begin(), node_sizes.find(key)));
  topo.island = topo.node / topo.island_nodes;
  for (int r = 0; r < me; ++r) topo.local_rank += t[r][0] == key ? 1 : 0;
  // Its place in its island: the island's nodes in order, each node's ranks in order.
  const int island_rank = (topo.node % topo.island_nodes) * topo.ranks_per_node + topo.local_rank;
  topo.shard_rank = island_rank % topo.shard_size;
  const int groups_per_island = island_ranks / topo.shard_size;
  topo.replica_rank = topo.island * groups_per_island + island_rank / topo.shard_size;
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
