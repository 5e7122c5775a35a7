// Elastic resume (checkpoint_store.h): the optimizer state of a checkpoint written on another
// topology, by one rule: this rank's replica r takes the state of the checkpoint's replica
// r mod R, each tensor's state put together from that replica's shards and cut again for this
// run's shard group.
#include "checkpoint_store.h"

#include "flexdemo/comm.h"
#include "flexdemo/elastic.h"
#include "flexdemo/optim.h"
#include "flexdemo/safetensors.h"
#include "flexdemo/shard.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <map>
#include <vector>

namespace flexdemo::train {

namespace fs = std::filesystem;

namespace {

fs::path state_file(const fs::path& dir, int64_t rank) {
  return dir / ("optimizer-rank" + std::to_string(rank) + ".safetensors");
}

}  // namespace

std::map<std::string, at::Tensor> read_state_file(const fs::path& dir, int64_t rank) {
  std::map<std::string, at::Tensor> state;
  for (auto& [name, t] : read_safetensors(state_file(dir, rank).string())) state[name] = t;
  return state;
}

std::vector<std::string> state_file_names(const fs::path& dir, int64_t rank) {
  return safetensors_names(state_file(dir, rank).string());
}

namespace {

// The manifest's table of ranks, checked: world_size pairs [replica, shard] that fill a grid of
// R replicas x S shards, each place once. Throws std::invalid_argument otherwise.
std::vector<std::pair<int64_t, int64_t>> rank_places(const nlohmann::json& manifest,
                                                     const fs::path& dir) {
  const nlohmann::json& table = manifest.at("ranks");
  std::vector<std::pair<int64_t, int64_t>> places;
  if (table.is_array() && int64_t(table.size()) == manifest.at("world_size").get<int64_t>()) {
    for (const auto& place : table) {
      if (!place.is_array() || place.size() != 2 || !place[0].is_number_unsigned() ||
          !place[1].is_number_unsigned()) {
        break;
      }
      places.push_back({place[0].get<int64_t>(), place[1].get<int64_t>()});
    }
  }
  std::vector<std::pair<int64_t, int64_t>> grid = places;
  std::sort(grid.begin(), grid.end());
  const int64_t shards = grid.empty() ? 0 : grid.back().second + 1;
  bool whole = !grid.empty() && places.size() == table.size() && int64_t(grid.size()) % shards == 0;
  for (size_t i = 0; whole && i < grid.size(); ++i) {
    whole = grid[i] == std::pair<int64_t, int64_t>(int64_t(i) / shards, int64_t(i) % shards);
  }
  if (!whole) {
    throw std::invalid_argument("checkpoint " + dir.string() +
                                " is damaged: its manifest's table of ranks is not a whole grid "
                                "of [replica, shard] places");
  }
  return places;
}

// The replicas that wrote a checkpoint (its manifest's table of ranks, checked).
int64_t checkpoint_replicas(const nlohmann::json& manifest, const fs::path& dir) {
  int64_t replicas = 0;
  for (const auto& place : rank_places(manifest, dir)) {
    replicas = std::max(replicas, place.first + 1);
  }
  return replicas;
}

}  // namespace

bool owner_residual_state(const std::string& name) {
  const size_t pos = name.rfind("owner_");
  if (pos == std::string::npos || (pos > 0 && name[pos - 1] != '.')) return false;
  return name.compare(pos, std::string::npos, "owner_replicas") == 0 ||
         name.compare(pos, 15, "owner_residual.") == 0;
}

void fold_owner_residual(const Session& s, const SavedState& saved) {
  const auto state = s.optimizer->state_tensors();
  if (std::any_of(state.begin(), state.end(),
                  [](const auto& named) { return owner_residual_state(named.first); })) {
    return;  // this run keeps its own: loaded as it is
  }
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : state) {
    const size_t pos = name.rfind("residual.");
    if (pos == std::string::npos || (pos > 0 && name[pos - 1] != '.')) continue;
    const std::string prefix = name.substr(0, pos);  // "outer." under --inner-steps
    const at::Tensor replicas = saved(prefix + "owner_replicas", at::empty({1}));
    const at::Tensor held = saved(prefix + "owner_" + name.substr(pos), t);
    if (!replicas.defined() || !held.defined()) continue;
    const auto kept_among = int64_t(replicas.item<double>());
    if (kept_among < 1) continue;
    t.add_(held.to(t.device()),
           optim::owner_residual_weight(s.topo.replica_rank, s.topo.replicas, kept_among));
  }
}

// The optimizer state of a checkpoint written on another topology, by one rule
// (docs/reliability.md, "Elastic resume"): this rank's replica r takes the state of the
// checkpoint's replica r mod R (R: the checkpoint's replicas), each tensor's state put together
// from that replica's shards and cut again for this rank's shard; under --overlap-step the exchange
// in flight is not applied: the parameters stay as saved, with replica 0's preview of it (its own
// step) in place of the replicas' mean; the random state is seeded from --seed, the rank and
// the step.
void load_state_elastic(Session& s, const fs::path& dir, const nlohmann::json& manifest,
                        int64_t step) {
  const auto& world = s.topo.world;
  const std::string written = manifest.at("topology").get<std::string>();
  if (!manifest.contains("ranks")) {
    throw std::invalid_argument(
        "--resume: " + dir.string() + " was written by " + written +
        " without the table of ranks that resuming on another topology needs (an older "
        "flexdemo); this run is " +
        s.topo.describe() + ": resume it on its own topology");
  }
  // [replica, shard] per world rank: every place of a replicas x shards grid exactly once.
  const std::vector<std::pair<int64_t, int64_t>> places = rank_places(manifest, dir);
  const int64_t replicas = checkpoint_replicas(manifest, dir);
  const int64_t source = optim::resumed_from_replica(s.topo.replica_rank, replicas);
  std::vector<std::map<std::string, at::Tensor>> shards;  // the source replica's, by shard
  for (size_t w = 0; w < places.size(); ++w) {
    if (places[w].first != source) continue;
    const size_t shard = size_t(places[w].second);
    if (shards.size() <= shard) shards.resize(shard + 1);
    shards[shard] = read_state_file(dir, int64_t(w));
  }
  std::vector<const shard::ShardSpec*> specs;  // by the optimizer's tensor index
  for (const auto& unit : s.lm->units()) {
    for (const shard::ShardSpec& spec : unit->specs()) specs.push_back(&spec);
  }
  const auto unfit = [&dir](const std::string& name) {
    return std::invalid_argument("--resume: the optimizer state " + name + " in " + dir.string() +
                                 " does not fit this run's shards");
  };
  // `name`'s state for this rank, shaped as `like`: the source replica's shards put together
  // and cut again for this rank's shard; undefined where the checkpoint has none.
  const auto cut = [&](const std::string& name, const at::Tensor& like) -> at::Tensor {
    std::vector<at::Tensor> parts;
    for (const auto& shard : shards) {
      auto it = shard.find(name);
      if (it != shard.end()) parts.push_back(it->second);
    }
    if (parts.empty()) return {};
    const size_t dot = name.rfind('.');
    const bool indexed = dot != std::string::npos &&
                         name.find_first_not_of("0123456789", dot + 1) == std::string::npos;
    if (!indexed) {  // the replicator's own (owner_replicas): alike on every shard
      if (parts.front().sizes() != like.sizes()) throw unfit(name);
      return parts.front();
    }
    // A matrix is sharded in whole chunk-rows (dim 0), a vector, held as [1, n], in chunks.
    const shard::ShardSpec& spec = *specs.at(std::stoul(name.substr(dot + 1)));
    const int dim = spec.plan.rows > 1 ? 0 : 1;
    // --second-moment shared: a matrix's column statistics are the whole tensor's on every shard.
    if (dim == 0 && name.rfind("moment_cols.", 0) == 0) {
      if (parts.front().sizes() != like.sizes()) throw unfit(name);
      return parts.front();
    }
    const int64_t offset = dim == 0 ? spec.begin / spec.plan.cols : spec.begin;
    const at::Tensor whole = at::cat(parts, dim);
    if (whole.size(1 - dim) != like.size(1 - dim) || offset + like.size(dim) > whole.size(dim)) {
      throw unfit(name);
    }
    return whole.narrow(dim, offset, like.size(dim));
  };
  at::NoGradGuard no_grad;
  for (auto& [name, t] : s.optimizer->state_tensors()) {
    if (name == "pending") {  // --overlap-step's exchange in flight: its preview stands for it
      t.zero_();
      continue;
    }
    // The payloads in flight and the parameters before the preview: the next step overwrites them.
    // A replica's own previewed parameters: the weights loaded (replica 0's) stand for them.
    if (name == "pending_payloads" || name.rfind("committed.", 0) == 0 ||
        name.rfind("previewed.", 0) == 0) {
      continue;
    }
    const at::Tensor saved = cut(name, t);
    if (saved.defined()) {
      t.copy_(saved);
    } else if (owner_residual_state(name)) {
      t.zero_();
    } else {
      throw unfit(name);
    }
  }
  fold_owner_residual(s, cut);
  at::manual_seed(rank_seed(s.cfg, world->rank()) + uint64_t(step));
  if (world->rank() == 0) {
    std::printf(
        "resuming step %ld, written by %s, on %s: shards re-cut, replica r continues replica r "
        "mod %ld\n",
        long(step), written.c_str(), s.topo.describe().c_str(), long(replicas));
  }
}

}  // namespace flexdemo::train
