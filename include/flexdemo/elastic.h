// flexdemo/elastic.h — the one rule of an elastic resume, for `flexdemo train --resume` and
// Python's flexdemo.ElasticLoadPlanner alike: on another number of replicas (nodes), replica r
// takes the optimizer state of the checkpoint's replica r mod R (R: the checkpoint's replicas),
// so that every saved replica's residual lives on where replicas are added, and the first ones'
// where replicas are removed.
#pragma once

#include "flexdemo/optim.h"

#include <cstdint>
#include <string>
#include <vector>

namespace flexdemo::optim {

inline int64_t resumed_from_replica(int64_t replica, int64_t checkpoint_replicas) {
  return replica % checkpoint_replicas;
}

// An owner's residual (the owners' exchange, --owner-feedback owner) kept among
// `saved_replicas` replicas and continued by replica `replica` of `replicas`: how many times over
// it goes into that replica's residual, so that the replicas' mean of their residuals holds it
// whole (the replicas continuing the same saved one share it). As many replicas: `replicas`.
inline double owner_residual_weight(int64_t replica, int64_t replicas, int64_t saved_replicas) {
  const int64_t source = resumed_from_replica(replica, saved_replicas);
  int64_t continuing = 0;
  for (int64_t r = 0; r < replicas; ++r) {
    continuing += resumed_from_replica(r, saved_replicas) == source ? 1 : 0;
  }
  return double(replicas) / double(continuing);
}

// ====== The second moment across a resume ======
// second_moment auto chooses by the replicas a run starts on (shared from
// kSharedSecondMomentReplicas on), so a checkpoint written on another number of replicas can hold
// the other kind of second moment than this run's options choose. One rule for both fronts:
// `flexdemo train --resume` and Python's FlexDeMo.load_state_dict.

// The optimizer state each kind keeps, by name (before the ".i" of its tensor): each replica's
// own "grad_sq"; the shared one "moment_rows" (of matrices), "moment_cols" and, where it is
// summed every few steps, "moment_own". Auto: none.
std::vector<std::string> second_moment_state(SecondMoment kind);
// The kind whose state `name` is, read from its first part (a front may add its own after a
// '.': "grad_sq.3", Python's "grad_sq.replica0.shard0"); Auto: no second moment's.
SecondMoment second_moment_of(const std::string& name);

// What a checkpoint's optimizer state holds of a second moment.
struct SavedSecondMoment {
  SecondMoment kind = SecondMoment::Auto;  // Auto: none (or both: not a checkpoint of one run)
  bool summed_apart = false;               // shared, summed every few steps (its moment_own)
};
SavedSecondMoment saved_second_moment(const std::vector<std::string>& state_names);

// The options a resume on `replicas` replicas makes its optimizer with, from this run's
// (`options`, second_moment as given: auto or a kind) and what its checkpoint holds: `options`
// where they precondition with the saved kind (or do not precondition, or it holds none); under
// auto the saved kind kept (second_moment set to it; each replica's own with
// second_moment_every and second_moment_values at their defaults, which it does not use).
// Otherwise an OptionsError in one line that names the options to pass: the other kind asked
// for, or a shared one summed at another interval than the checkpoint's.
OptimizerOptions resumed_second_moment(OptimizerOptions options, int64_t replicas,
                                       const SavedSecondMoment& saved);

}  // namespace flexdemo::optim
