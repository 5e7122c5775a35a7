// flexdemo/link_budget.h — the exchange's schedule chosen from the link (the link_* options of
// OptimizerOptions, link_budget auto): measures the link between nodes and the compute of a step
// while training, and sets the optimizers' schedule (top-k, value encoding, interval) whose
// exchange stays hidden behind compute. `flexdemo train --link-budget auto` and Python's
// FlexDeMo(link_budget="auto") both drive this one.
//
// The choice, made alike on every rank from measurements shared by all of them:
//   latency  = a tiny all-gather over the replica group       (the slowest rank's)
//   probe    = an all-gather of kProbeBytes per rank over it   (the slowest rank's, the slower
//              of two back to back; every replica group at once, as the exchanges run)
//   compute  = a step's forward and backward, mean since the last choice (the slowest rank's)
//   exchange(schedule) = latency + (probe - latency) * wire bytes(schedule) / kProbeBytes
//                        (the wire bytes of the rank that sends most)
//   budget(schedule)   = under overlap_step: 0.8 * every * compute (the exchange travels behind
//                        the next `every` steps' compute, with a margin); otherwise
//                        0.1 * every * compute (it adds to the step: at most 1.1x)
// and the first schedule of the ladder (best first) with exchange <= budget; when none fits, the
// last (the fewest bytes a step).
#pragma once

#include "flexdemo/optim.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace flexdemo::comm {
class Communicator;
}

namespace flexdemo::optim {

// link_values as encodings, in order; OptionsError naming {link_values} for a bad word.
std::vector<compress::ValueEncoding> link_encodings(const std::string& list);

// The bounds a choice stays in (the link_* options).
struct LinkBounds {
  int64_t min_topk = 8, max_topk = 128, max_every = 4;
  std::vector<compress::ValueEncoding> values;  // preferred first
  bool overlap = false;                         // overlap_step
};

// The bounds the link_* options of `options` set.
LinkBounds link_bounds(const OptimizerOptions& options);

// The schedules tried, best first: every top-k from max_topk down by halves to min_topk (the last
// one min_topk itself), each with the encodings in the order given, all exchanging every step;
// then min_topk with the last encoding every 2, 4, ... steps up to max_every (max_every itself
// last). Up to 128 a larger top-k trained better per step (docs/results/equal-steps.md, and under
// overlap 128 against 32), and 2bit costs +0.16% against bf16 at 2.5x fewer bytes, so top-k goes
// first; beyond 128 it did not help (512: no better than 32), hence the default link_max_topk 128
// (docs/results/link-budget.md).
std::vector<ExchangeSchedule> link_ladder(const LinkBounds& bounds);

// What a choice goes by (seconds; the slowest rank's).
struct LinkMeasure {
  double latency_s = 0.0, probe_s = 0.0, probe_bytes = 0.0, compute_s = 0.0;
  // The predicted time of an all-gather of `bytes` per rank over the replica group.
  double exchange_s(double bytes) const;
};

// How long an exchange of a schedule exchanging every `every` steps may take (see above).
double exchange_budget_s(bool overlap, double compute_s, int64_t every);

// The index in `ladder` of the first schedule whose exchange (wire_bytes[i] per rank:
// Optimizer::link_bytes, the payloads and the shared second moment's sums) fits its budget; the
// last one when none does.
size_t choose_schedule(const std::vector<ExchangeSchedule>& ladder,
                       const std::vector<double>& wire_bytes, const LinkMeasure& measure,
                       bool overlap);

// One choice and what it went by.
struct LinkChoice {
  int64_t step = 0;  // the first step that uses it (1-based)
  ExchangeSchedule schedule;
  LinkMeasure measure;             // the slowest rank's
  int replicas = 1;                // in the replica group
  double wire_bytes = 0.0;         // of the schedule (link_bytes), the rank that sends most
  double exchange_s = 0.0;         // predicted
  double budget_s = 0.0;
  double rank_bytes_per_s() const;  // what a rank's probe moved per second: (R - 1) probes in
  bool hidden() const { return exchange_s <= budget_s; }
  // "link budget before step 4: 93.1 Mbit/s a rank between nodes, latency 0.21 ms, compute
  // 412 ms a step -> top-k 128, bf16 values, exchange every step (35 ms predicted against a
  // budget of 41 ms)"
  std::string describe() const;
};

// What a checkpoint keeps of a schedule that changes while training, and its restore in two
// halves around the optimizer's state: the exchange in flight's schedule sizes its payloads
// (state), the schedule set and the counters follow the state.
struct ScheduleState {
  ExchangeSchedule set;        // Optimizer::schedule()
  ExchangeSchedule in_flight;  // Optimizer::schedule_in_flight() (its `every`: set's)
  ExchangeCounters counters;
};
ScheduleState schedule_state(const Optimizer& optimizer);
// Before the state is loaded (into a fresh optimizer, or over state a load already wrote in
// place: an exchange it marked in flight is unmarked, to be loaded again with the rest).
void restore_schedule_before_state(Optimizer& optimizer, const ScheduleState& state);
// After the state is loaded: the steps taken, the counters and the schedule set.
void restore_schedule_after_state(Optimizer& optimizer, const ScheduleState& state,
                                  int64_t steps);

class LinkBudget {
 public:
  static constexpr double kProbeBytes = 256 * 1024;
  static constexpr int64_t kWarmSteps = 3;  // the first choice before the 4th step of a run

  // The optimizers one schedule applies to (one per parameter group; the first one's link_*
  // options and overlap_step rule; link_budget off: does nothing); the groups every rank agrees
  // over on the slowest's measures, in turn (the world; or groups that tile it, such as the
  // shard group and the replica group: nullptr entries are skipped); the replica group
  // (nullptr: one replica, nothing to measure); and the step the run starts (or resumes) at. Choices come before steps kWarmSteps +
  // n * link_probe_every (0-based; n = 0, 1, ...), the same steps for a resumed run, from the
  // first at least kWarmSteps after its start on.
  // Testing aid: FLEXDEMO_INJECT_LINK="P0,P1,..." makes choice n go by a probe of Pn seconds
  // (the last repeating), no latency and 1 s of compute, instead of what was measured (the
  // probes still run), so that its choices are known in advance.
  LinkBudget(std::vector<Optimizer*> optimizers,
             std::vector<std::shared_ptr<comm::Communicator>> agreement,
             std::shared_ptr<comm::Communicator> replicas, int64_t start_step);
  bool active() const { return active_; }
  // Collective over the agreement groups when a choice is due before step `step` (0-based): measures,
  // chooses, applies the schedule to the optimizers and returns the choice; nothing otherwise.
  std::optional<LinkChoice> before_step(int64_t step);
  // This step's forward and backward on this rank (the first step of a run is not counted: it
  // allocates).
  void add_compute(double seconds);

 private:
  LinkMeasure measure(int64_t choice);

  std::vector<Optimizer*> optimizers_;
  std::vector<std::shared_ptr<comm::Communicator>> agreement_;
  std::shared_ptr<comm::Communicator> replicas_;
  bool active_;
  int64_t probe_every_ = 1;
  LinkBounds bounds_;
  std::vector<ExchangeSchedule> ladder_;
  int64_t first_choice_;
  std::vector<double> injected_probe_s_;
  double compute_sum_ = 0.0;
  int64_t compute_steps_ = 0, seen_steps_ = 0;
};

}  // namespace flexdemo::optim
