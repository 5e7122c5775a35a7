// flexdemo/topology.h — who shards with whom and who replicates with whom.
// World = R shard groups x S ranks. A shard group lies inside one island (one node, or
// --island-nodes consecutive nodes on a fast fabric) and shards the model; the ranks holding the
// same shard in every shard group form a replica group, which exchanges only what the
// replicator sends (the slow link between islands).
#pragma once

#include "flexdemo/comm.h"

#include <memory>
#include <string>

namespace flexdemo::comm {

struct TopologyOptions {
  int ranks_per_node = 0;  // 0: from MPI (the ranks sharing a host form a node)
  int shard_size = 0;      // S, dividing the island's ranks; 0: the whole island
  int island_nodes = 1;    // consecutive nodes (in order of their lowest rank) an island holds
};

struct Topology {
  std::shared_ptr<Communicator> world;
  std::shared_ptr<Communicator> shard_group;    // S ranks inside one node
  std::shared_ptr<Communicator> replica_group;  // R ranks holding the same shard
  int nodes = 1;
  int ranks_per_node = 1;
  int island_nodes = 1;          // nodes an island holds
  int islands = 1;               // nodes / island_nodes
  int island = 0;                // this rank's island
  int shard_size = 1;            // S
  int replicas = 1;              // R = world size / S
  int node = 0;                  // this rank's node, 0-based in order of their lowest world rank
  int local_rank = 0;            // this rank's place in its node
  int shard_rank = 0;            // its place in its shard group: the shard it holds
  int replica_rank = 0;          // its place in its replica group: its shard group's index
  // One line, e.g. "2 nodes x 2 ranks, shard size 2, 2 replicas", or with islands of several
  // nodes "2 islands x 2 nodes x 1 rank, shard size 2, 2 replicas".
  std::string describe() const;
};

// Collective over world. Every rank checks the same gathered facts, so a bad topology (options
// that differ between ranks, a world not divisible into nodes, nodes of unequal size, S not
// dividing the island, islands not dividing the nodes) throws the same std::invalid_argument on
// every rank, never a hang.
Topology make_topology(std::shared_ptr<Communicator> world, const TopologyOptions& options);

// Bytes moved inside shard groups (the fast link) and between them (the slow link).
struct StepTraffic {
  uint64_t intra_sent = 0, intra_received = 0;  // shard group
  uint64_t inter_sent = 0, inter_received = 0;  // replica group
  double intra_seconds = 0.0, inter_seconds = 0.0;
  uint64_t inter_collectives = 0;  // collectives completed in the replica group
};

// Reads a topology's counters: lap() gives what moved since the previous lap (or creation).
class TrafficMeter {
 public:
  explicit TrafficMeter(const Topology& topology);
  StepTraffic lap();

 private:
  std::shared_ptr<Communicator> shard_group_, replica_group_;
  CommStats shard_last_, replica_last_;
};

}  // namespace flexdemo::comm
