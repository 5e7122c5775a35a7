// Training checkpoints on disk: OUT/checkpoints/step-N/ holds model.safetensors (the full
// parameters under descriptive names), optimizer-rank<r>.safetensors (each rank's optimizer and
// random state) and manifest.json (step, data position, topology, config, and every file's
// CRC-32), written last. Internal to src/train.
#pragma once

#include "session.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace flexdemo::train {

// The checkpoint `where` names: a checkpoint folder (refused if damaged), or a run folder, whose
// newest valid checkpoint is taken; damaged newer ones are reported on stderr when `report`.
// Throws std::invalid_argument when there is none.
std::filesystem::path find_checkpoint(const std::string& where, bool report);
// A run folder's checkpoint folders (checkpoints/step-N), newest first, damaged or not.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& run);
nlohmann::json read_manifest(const std::filesystem::path& dir);

// Collective: the full parameters (rank 0 writes them), every rank's optimizer state and
// random state, and the manifest; then only the newest cfg.keep_checkpoints are kept. A
// checkpoint is written into step-N.tmp/ and renamed into place: it is whole or absent. Returns
// its folder.
std::filesystem::path save_checkpoint(Session& s, int64_t step);

// Loads the weights (any topology) from checkpoint folder `dir` and, when `with_optimizer`, this
// rank's optimizer and random state (the same topology only). Returns the checkpoint's step.
int64_t load_checkpoint(Session& s, const std::filesystem::path& dir, bool with_optimizer);

// ====== Inside src/train (elastic_state.cpp) ======
// Rank `rank`'s optimizer-rank<rank>.safetensors of checkpoint folder `dir`, by name.
std::map<std::string, at::Tensor> read_state_file(const std::filesystem::path& dir, int64_t rank);
// The names in that file, read from its header alone.
std::vector<std::string> state_file_names(const std::filesystem::path& dir, int64_t rank);
// The owners' residual (--owner-feedback owner: "owner_residual.i" and "owner_replicas", the
// replicas it was kept among; "outer." before them under --inner-steps) is state that
// --demo-exchange and --owner-feedback, which may change on resume, make or unmake: a
// checkpoint without it loads it as zero, and one that this run keeps none of goes into the
// residual (optim::owner_residual_weight times over: the rule of src/optim/owner_replicator.cpp).
bool owner_residual_state(const std::string& name);
// A checkpoint's state for this rank by name, shaped as the tensor given; undefined where the
// checkpoint has none.
using SavedState = std::function<at::Tensor(const std::string&, const at::Tensor&)>;
// Adds a checkpoint's owners' residual to this run's residuals where this run keeps none.
void fold_owner_residual(const Session& s, const SavedState& saved);
// This rank's optimizer state from a checkpoint (its manifest, its step) written on another
// topology. Throws std::invalid_argument when the checkpoint lacks its table of ranks.
void load_state_elastic(Session& s, const std::filesystem::path& dir,
                        const nlohmann::json& manifest, int64_t step);

// Whether `where` is a transformers model folder (a config.json naming "architectures").
bool is_transformers_folder(const std::string& where);

// A session on `world` holding the weights of the checkpoint `where` names (as
// find_checkpoint; or a transformers model folder, as --init-from loads it, on the default
// data): its model and data on any topology, eval_seqs validation sequences.
std::unique_ptr<Session> open_checkpoint(const std::string& where, int64_t eval_seqs,
                                         std::shared_ptr<comm::Communicator> world);

}  // namespace flexdemo::train
