// The record of a training run: config.json, one metrics.jsonl line per step, the progress line
// on stdout, and summary.json at the end. Rank 0 writes; the collectives run on every rank.
// Internal to src/train.
#pragma once

#include "session.h"

#include "flexdemo/link_budget.h"
#include "flexdemo/optim.h"
#include "flexdemo/topology.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <optional>

namespace flexdemo::train {

// One step over all ranks.
struct StepMetrics {
  int64_t step = 0;  // 1-based: steps done
  double loss = 0.0, lr = 0.0;
  double step_s = 0.0, comm_s = 0.0;  // mean over ranks; comm_s: waiting for collectives
  double inter_collectives = 0.0;     // mean per rank
  double intra_sent = 0.0, intra_recv = 0.0, inter_sent = 0.0, inter_recv = 0.0;  // bytes, sum
  double elapsed_s = 0.0;     // when the step ended, on rank 0's clock, since the run log began
  int64_t skipped_steps = 0;  // so far
  double peers_left_out = 0;  // this step's payloads left out (--on-bad-peer drop): per replica
                              // group, each peer's once
  std::optional<double> val_loss;                     // when evaluated at this step
  std::optional<optim::LinkChoice> link_choice;       // --link-budget auto chose before this step
  std::optional<optim::ExchangeSchedule> schedule;    // --link-budget auto: what its exchange sent
};

// A step's metrics are reduced over the ranks in a collective the trainer shares with other
// values (run_training's one collective over the world a step): this rank's are packed into
// kReducedMetrics doubles, the ranks' sums unpacked (bytes summed; loss, times and collectives
// averaged over the world's `ranks`).
// How many times this run was restarted: FLEXDEMO_RESTARTS (set by `flexdemo supervise`) plus
// SLURM_RESTART_COUNT (set by Slurm on a requeue).
int64_t restarts();

inline constexpr int64_t kReducedMetrics = 9;
void pack_step_metrics(double loss, double step_s, const comm::StepTraffic& traffic,
                       int64_t peers_left_out, double* out);
void unpack_step_metrics(const double* sums, int ranks, StepMetrics& m);

class RunLog {
 public:
  // Rank 0: writes config.json, opens metrics.jsonl (a resumed run keeps the lines of the steps
  // its checkpoint holds and drops later ones, so each step appears once) and prints the header.
  RunLog(const Session& s, int64_t start_step);
  void record(const StepMetrics& m);  // the metrics line and the progress line
  double elapsed_s() const;           // since the log began
  // Collective: every rank's peak memory; rank 0 writes summary.json and prints the last line.
  void finish(int64_t steps_done);

 private:
  // What the replicas exchange across: "nodes", or "islands" where an island holds several.
  const char* between() const { return s_.topo.island_nodes > 1 ? "islands" : "nodes"; }
  const Session& s_;
  const int64_t start_step_;
  const bool root_, terminal_;
  std::ofstream metrics_;
  const std::chrono::steady_clock::time_point started_;
  double val_loss_ = NAN, inter_bytes_total_ = 0.0, seconds_total_ = 0.0;
  double peers_left_out_ = 0.0;  // since this start
};

}  // namespace flexdemo::train
