// A session: everything a run needs (options, topology, data, sharded model, optimizer), built
// the same way for training, evaluation and generation. Internal to src/train.
#pragma once

#include "flexdemo/data.h"
#include "flexdemo/model.h"
#include "flexdemo/optim.h"
#include "flexdemo/topology.h"
#include "flexdemo/train_options.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace flexdemo::train {

struct Session {
  TrainConfig cfg;  // validated and resolved
  comm::Topology topo;
  data::TokenData tokens;
  std::unique_ptr<data::Batches> train_data, val_data;  // text windows or translation pairs
  std::unique_ptr<model::LanguageModel> lm;
  std::vector<optim::OptimParam> params;  // the model's shards, as the optimizer indexes them
  std::unique_ptr<optim::Optimizer> optimizer;
  at::Device device = at::kCPU;  // where this rank's model, gradients and optimizer state live
  int64_t per_rank = 0;          // sequences of the global batch on each rank
  int64_t micro = 0;             // sequences per forward
};

// The seed of LibTorch's default generator on world rank `rank` (dropout, T5's span corruption):
// ranks differ (they draw for different rows).
uint64_t rank_seed(const TrainConfig& cfg, int rank);

// Collective over world: validates the config, makes the topology, loads (rank 0 tokenizes) the
// data, builds the sharded model and its optimizer. Throws std::invalid_argument for bad input
// on every rank alike.
std::unique_ptr<Session> open_session(const TrainConfig& config,
                                      std::shared_ptr<comm::Communicator> world);

// Mean validation loss per scored token over cfg.eval_seqs windows (pairs) shared by all ranks.
// Collective.
double evaluate(Session& s);

}  // namespace flexdemo::train
