// flexdemo/elastic.h — the one rule of an elastic resume, for `flexdemo train --resume` and
// Python's flexdemo.ElasticLoadPlanner alike: on another number of replicas (nodes), replica r
// takes the optimizer state of the checkpoint's replica r mod R (R: the checkpoint's replicas),
// so that every saved replica's residual lives on where replicas are added, and the first ones'
// where replicas are removed.
#pragma once

#include <cstdint>

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

}  // namespace flexdemo::optim
