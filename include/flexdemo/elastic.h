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

}  // namespace flexdemo::optim
