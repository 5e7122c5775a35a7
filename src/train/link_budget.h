// --link-budget auto: measures the link between nodes and the compute of a step while training,
// and chooses the exchange schedule (top-k, value encoding, interval) whose exchange stays hidden
// behind compute. Internal to src/train.
//
// The choice, made alike on every rank from measurements shared by all of them:
//   latency  = a tiny all-gather over the replica group       (the slowest rank's)
//   probe    = an all-gather of kProbeBytes per rank over it   (the slowest rank's, the slower
//              of two back to back; every replica group at once, as the exchanges run)
//   compute  = a step's forward and backward, mean since the last choice (the slowest rank's)
//   exchange(schedule) = latency + (probe - latency) * wire bytes(schedule) / kProbeBytes
//                        (the wire bytes of the rank that sends most)
//   budget(schedule)   = under --overlap-step: 0.8 * every * compute (the exchange travels
//                        behind the next `every` steps' compute, with a margin);
//                        otherwise 0.1 * every * compute (it adds to the step: at most 1.1x)
// and the first schedule of the ladder (best first) with exchange <= budget; when none fits, the
// last (the fewest bytes a step).
#pragma once

#include "session.h"

#include "flexdemo/optim.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <vector>

namespace flexdemo::train {

// The bounds a choice stays in (the --link-* options).
struct LinkBounds {
  int64_t min_topk = 8, max_topk = 128, max_every = 4;
  std::vector<compress::ValueEncoding> values;  // preferred first
  bool overlap = false;                         // --overlap-step
};

// The schedules tried, best first: every top-k from max_topk down by halves to min_topk (the last
// one min_topk itself), each with the encodings in the order given, all exchanging every step;
// then min_topk with the last encoding every 2, 4, ... steps up to max_every (max_every itself
// last). Up to 128 a larger top-k trained better per step (docs/results/equal-steps.md, and under
// --overlap-step 128 against 32), and 2bit costs +0.16% against bf16 at 2.5x fewer bytes, so
// top-k goes first; beyond 128 it did not help (512: no better than 32), hence the default
// --link-max-topk 128 (docs/results/link-budget.md).
std::vector<optim::ExchangeSchedule> link_ladder(const LinkBounds& bounds);

// What a choice goes by (seconds; the slowest rank's).
struct LinkMeasure {
  double latency_s = 0.0, probe_s = 0.0, probe_bytes = 0.0, compute_s = 0.0;
  // The predicted time of an all-gather of `bytes` per rank over the replica group.
  double exchange_s(double bytes) const;
};

// How long an exchange of a schedule exchanging every `every` steps may take (see above).
double exchange_budget_s(bool overlap, double compute_s, int64_t every);

// The index in `ladder` of the first schedule whose exchange (wire_bytes[i] per rank) fits its
// budget; the last one when none does.
size_t choose_schedule(const std::vector<optim::ExchangeSchedule>& ladder,
                       const std::vector<double>& wire_bytes, const LinkMeasure& measure,
                       bool overlap);

class LinkBudget {
 public:
  static constexpr double kProbeBytes = 256 * 1024;
  static constexpr int64_t kWarmSteps = 3;  // the first choice before the 4th step of a run

  // Off (--link-budget off): does nothing. start_step: the step the run starts (or resumes) at.
  // Choices come before steps kWarmSteps + n * --link-probe-every (0-based; n = 0, 1, ...), the
  // same steps for a resumed run, from the first at least kWarmSteps after its start on.
  // Testing aid: FLEXDEMO_INJECT_LINK="P0,P1,..." makes choice n go by a probe of Pn seconds
  // (the last repeating), no latency and 1 s of compute, instead of what was measured (the
  // probes still run), so that its choices are known in advance.
  LinkBudget(Session& s, int64_t start_step);
  bool active() const { return active_; }
  // Collective over the world when a choice is due before step `step` (0-based): measures,
  // chooses, applies the schedule to the optimizer and returns the choice and what it went by
  // (for metrics.jsonl); nothing otherwise.
  std::optional<nlohmann::ordered_json> before_step(int64_t step);
  // This step's forward and backward on this rank (the first step of a run is not counted: it
  // allocates).
  void add_compute(double seconds);

 private:
  LinkMeasure measure(int64_t choice);

  Session& s_;
  bool active_;
  LinkBounds bounds_;
  std::vector<optim::ExchangeSchedule> ladder_;
  int64_t first_choice_;
  std::vector<double> injected_probe_s_;
  double compute_sum_ = 0.0;
  int64_t compute_steps_ = 0, seen_steps_ = 0;
};

}  // namespace flexdemo::train
